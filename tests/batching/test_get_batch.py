"""Specification of ``ParallelBatch`` in one process: every CP rank's view of real collated batches, rank by rank.

A ``DataLoaderParallelContext`` made from integers places the process at any CP rank without a process group, so
each rank's fields can be compared with the plain reference of ``get_batch_reference`` (Python loops, written from
the conventions of docs/distributed.md, sharing no code with the library). The multi-process tests
(``tests/parallel/test_get_batch.py``) check the same under real gloo ranks, with the TP broadcast.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hyper_parallel.data.batching import ParallelBatch
from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.build_collate_fn import IndexedStackingCollator, TextPackingCollator, indexed_batch
from hyper_parallel.data.batching.get_batch import LOSS_INPUT_KEYS, MODEL_INPUT_KEYS, SOURCE_TYPES
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.parallel.data_schedule_utils import PackingSchedulerConfig
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.parallel.process_groups import ProcessGroupCollection

from .get_batch_reference import check_rank, expected_fields, indexed_boundaries

EOD = 2


def online_batches(cp: int, layout: str, count: int = 3, seed: int = 0) -> list:
    """Packed batches of the Online collator, aligned for ``layout`` as ``build_online_text_collate_fn`` aligns."""
    rng = np.random.default_rng(seed)
    parts = 2 * cp if layout != "contiguous" and cp > 1 else cp
    collator = TextPackingCollator(
        alignment=parts, pad_token_id=0, pad_each_sequence_to=parts if layout == "zigzag_thd" else 1
    )
    batches = []
    for _ in range(count):
        samples = []
        for length in rng.integers(1, 14, size=int(rng.integers(1, 5))):
            ids = rng.integers(3, 50, size=length)
            labels = np.append(ids[1:], IGNORE_INDEX)
            labels[rng.random(length) < 0.2] = IGNORE_INDEX
            if (labels == IGNORE_INDEX).all():  # the transforms refuse a record without a loss token
                labels[0] = ids[0]
            samples.append({"input_ids": ids, "labels": labels})
        batches.append(collator(samples))
    return batches


def indexed_samples(rows: int, width: int, rng) -> list[dict]:
    """GPTDataset-like samples: tokens with EODs, labels shifted by one, a loss mask (0 on some EOD inputs)."""
    samples = []
    for _ in range(rows):
        stream = rng.integers(3, 50, size=width + 1)
        stream[rng.random(width + 1) < 0.2] = EOD
        loss_mask = np.ones(width, dtype=np.float32)
        loss_mask[(stream[:-1] == EOD) & (rng.random(width) < 0.5)] = 0.0
        samples.append({"tokens": stream[:-1], "labels": stream[1:], "loss_mask": loss_mask})
    return samples


def indexed_batches(rows: int = 2, width: int = 16, count: int = 3, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    collator = IndexedStackingCollator(eod_token_id=EOD)
    return [collator(indexed_samples(rows, width, rng)) for _ in range(count)]


def at_rank(cp: int, rank: int, **settings) -> ParallelBatch:
    return ParallelBatch(parallel_context=DataLoaderParallelContext(cp_rank=rank, cp_size=cp), **settings)


# -- every rank's fields ------------------------------------------------------------------------------------------

SETTINGS = [
    {"attention_mode": "dense"},
    {"attention_mode": "dense", "sliding_window": 3, "reset_position_ids": True},
    {"attention_mode": "dense", "causal": False},
    {"attention_mode": "flex"},
    {"attention_mode": "flex", "sliding_window": 4},
    {"attention_mode": "none", "eod_mask_loss": True},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize(("cp", "layout"), [(1, "contiguous"), (2, "contiguous"), (2, "zigzag"), (2, "zigzag_thd"),
                                            (4, "zigzag"), (4, "zigzag_thd")])  # fmt: skip
def test_every_online_rank_holds_the_reference_fields(cp, layout, settings):
    window = settings.get("sliding_window")
    for rank in range(cp):
        get_batch = at_rank(cp, rank, source_type="online", cp_layout=layout, eod_token_id=EOD, **settings)
        batches = online_batches(cp, layout)
        iterator = iter(batches)
        for batch in batches:
            model_inputs, loss_inputs = get_batch(iterator)
            expected = expected_fields(
                batch.input_ids.tolist(), batch.labels.tolist(), batch.cu_seq_lens.tolist(), cp=cp, rank=rank,
                layout=layout, causal=settings.get("causal", True), window=window,
                reset_position_ids=settings.get("reset_position_ids", False),
                eod_mask_loss=settings.get("eod_mask_loss", False), eod=EOD,
            )  # fmt: skip
            check_rank(model_inputs, loss_inputs, expected, settings["attention_mode"], window)
        with pytest.raises(StopIteration):
            get_batch(iterator)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize(("cp", "layout"), [(1, "contiguous"), (2, "contiguous"), (2, "zigzag"), (4, "contiguous")])
def test_every_indexed_rank_holds_the_reference_fields(cp, layout, settings):
    """Indexed boundaries come from the EOD tokens (after an EOD input, at each row end), not from the batch."""
    window = settings.get("sliding_window")
    for rank in range(cp):
        get_batch = at_rank(cp, rank, source_type="indexed", cp_layout=layout, eod_token_id=EOD, **settings)
        batches = indexed_batches()
        iterator = iter(batches)
        for batch in batches:
            model_inputs, loss_inputs = get_batch(iterator)
            ids, labels = batch.input_ids.tolist(), batch.labels.tolist()
            expected = expected_fields(
                ids, labels, indexed_boundaries(ids, labels, EOD), cp=cp, rank=rank, layout=layout,
                causal=settings.get("causal", True), window=window,
                reset_position_ids=settings.get("reset_position_ids", False),
                eod_mask_loss=settings.get("eod_mask_loss", False), eod=EOD,
            )  # fmt: skip
            check_rank(model_inputs, loss_inputs, expected, settings["attention_mode"], window)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_packed_params_are_global_in_the_zigzag_thd_layout(cp):
    layout = "zigzag_thd" if cp > 1 else "contiguous"
    for rank in range(cp):
        get_batch = at_rank(cp, rank, source_type="online", attention_mode="packed", cp_layout=layout)
        batches = online_batches(cp, layout, seed=cp)
        iterator = iter(batches)
        for batch in batches:
            model_inputs, loss_inputs = get_batch(iterator)
            expected = expected_fields(
                batch.input_ids.tolist(), batch.labels.tolist(), batch.cu_seq_lens.tolist(), cp=cp, rank=rank,
                layout=layout, pad=0,
            )  # fmt: skip
            check_rank(model_inputs, loss_inputs, expected, "packed", None)


@pytest.mark.parametrize(("cp", "layout"), [(2, "contiguous"), (2, "zigzag"), (4, "zigzag_thd"), (2, "zigzag_thd")])
def test_the_local_slices_put_together_by_their_positions_are_the_batch(cp, layout):
    batches = online_batches(cp, layout, seed=7)
    gathered = [torch.full_like(batch.input_ids, -1) for batch in batches]
    for rank in range(cp):
        get_batch = at_rank(cp, rank, source_type="online", cp_layout=layout, attention_mode="none")
        iterator = iter(batches)
        for target in gathered:
            model_inputs, _ = get_batch(iterator)
            rows = torch.arange(target.shape[0])[:, None]
            assert (target[rows, model_inputs["position_ids"]] == -1).all()  # no column held twice
            target[rows, model_inputs["position_ids"]] = model_inputs["input_ids"]
    assert all(torch.equal(target, batch.input_ids) for target, batch in zip(gathered, batches, strict=True))


# -- attention equals attention on each document alone -------------------------------------------------------------


def per_document_attention(q, k, v, spans, causal: bool, window) -> torch.Tensor:
    """Attention of every position over its own document only, computed document by document."""
    out = torch.zeros_like(q)
    for start, end in spans:
        length = end - start
        allowed = torch.ones(length, length, dtype=torch.bool)
        query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
        if causal:
            allowed &= key <= query
        if window is not None:
            allowed &= query - key <= window
        out[:, start:end] = F.scaled_dot_product_attention(
            q[:, start:end], k[:, start:end], v[:, start:end], attn_mask=allowed
        )
    return out


ATTENTION_CASES = [(2, "contiguous", None), (2, "zigzag", 3), (2, "zigzag_thd", None), (4, "zigzag_thd", 5)]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on CPU: slow but exact
@pytest.mark.parametrize("mode", ["dense", "flex"])
@pytest.mark.parametrize(("cp", "layout", "window"), ATTENTION_CASES)
def test_attention_of_the_local_queries_equals_attention_on_each_document(mode, cp, layout, window):
    """SDPA (dense) or flex_attention (flex) of each rank's local queries against all keys, with its mask, equals
    attention computed on each document alone at those positions; the padding sequence too."""
    generator = torch.Generator().manual_seed(cp)
    batch = online_batches(cp, layout, count=1, seed=11)[0]
    width = batch.input_ids.shape[1]
    q, k, v = (torch.randn(1, width, 8, generator=generator) for _ in range(3))  # one head: [H, T, D]
    spans = [(int(a), int(b)) for a, b in itertools.pairwise(batch.cu_seq_lens.tolist())]
    expected = per_document_attention(q, k, v, spans, True, window)
    for rank in range(cp):
        get_batch = at_rank(
            cp, rank, source_type="online", cp_layout=layout, attention_mode=mode, sliding_window=window
        )
        model_inputs, _ = get_batch(iter([batch]))
        columns = model_inputs["position_ids"][0]
        if mode == "dense":
            mask = model_inputs["swa_mask"] if window is not None else model_inputs["attention_mask"]
            got = F.scaled_dot_product_attention(q[:, columns], k, v, attn_mask=mask[0])
        else:
            from torch.nn.attention.flex_attention import flex_attention

            got = flex_attention(q[None, :, columns], k[None], v[None], block_mask=model_inputs["attention_mask"])[0]
        torch.testing.assert_close(got, expected[:, columns], rtol=1e-5, atol=1e-5)


# -- the sources' shapes ------------------------------------------------------------------------------------------


def test_a_megatron_style_dict_is_converted_once_at_the_edge():
    """The stage takes Batches only: a plain ``default_collate`` dict (``tokens``, labels with 0 at padding,
    ``loss_mask``) is refused naming the one converter, and converted by it gives what the Indexed collator's Batch
    of the same samples gives."""
    samples = indexed_samples(2, 16, np.random.default_rng(3))
    stacked = torch.utils.data.default_collate(samples)
    before = stacked["labels"].clone()
    get_batch = ParallelBatch("indexed", attention_mode="dense")
    with pytest.raises(DataFileError, match=r"received a dict.*indexed_batch"):
        get_batch(iter([stacked]))
    from_dict = get_batch(iter([indexed_batch(stacked, eod_token_id=EOD)]))
    from_batch = get_batch(iter([IndexedStackingCollator(eod_token_id=EOD)(samples)]))
    for got, wanted in zip(from_dict, from_batch, strict=True):
        assert list(got) == list(wanted)
        assert all(torch.equal(got[name], wanted[name]) for name in got if isinstance(got[name], torch.Tensor))
    assert torch.equal(stacked["labels"], before)  # the caller's dict is not changed
    assert (from_dict[1]["labels"][stacked["loss_mask"] == 0] == IGNORE_INDEX).all()


def _all_eod_samples(rows: int, columns: int, tokens: torch.Tensor | None = None) -> Batch:
    """A batch whose inputs are all EOD (or ``tokens``), its labels the next EOD, the loss taken everywhere."""
    tokens = torch.full((rows, columns), EOD, dtype=torch.long) if tokens is None else tokens
    stacked = {"tokens": tokens, "labels": torch.full_like(tokens, EOD), "loss_mask": torch.ones(rows, columns)}
    return indexed_batch(stacked, eod_token_id=EOD)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_micro_batch_without_a_loss_token_is_refused_before_it_is_cut(rows):
    """With eod_mask_loss, a micro-batch of EOD inputs only would have no token to take the loss from (a NaN mean
    loss): get_batch refuses it on the reading rank, naming the fix, whatever the CP rank; one token with a loss
    beside such rows is enough, and without eod_mask_loss every EOD label is trained on."""
    for cp_rank in range(2):
        get_batch = at_rank(2, cp_rank, source_type="indexed", eod_token_id=EOD, eod_mask_loss=True)
        with pytest.raises(DataFileError, match=r"no token of the micro-batch of \d row\(s\) carries a loss"):
            get_batch(iter([_all_eod_samples(rows, 16)]))
    with pytest.raises(DataFileError, match="or set eod_mask_loss to false"):
        at_rank(2, 0, source_type="indexed", eod_token_id=EOD, eod_mask_loss=True)(iter([_all_eod_samples(rows, 16)]))
    tokens = torch.full((rows, 16), EOD, dtype=torch.long)
    tokens[-1, 5] = 7
    mixed = _all_eod_samples(rows, 16, tokens)
    _, loss_inputs = ParallelBatch("indexed", eod_token_id=EOD, eod_mask_loss=True)(iter([mixed]))
    assert loss_inputs["loss_mask"].sum() == 1
    _, loss_inputs = ParallelBatch("indexed", eod_token_id=EOD)(iter([_all_eod_samples(rows, 16)]))
    assert loss_inputs["loss_mask"].all()


def test_a_batch_of_another_kind_is_refused_with_the_fix():
    with pytest.raises(DataFileError, match=r"received a list.*build_online_text_collate_fn"):
        ParallelBatch("online")(iter([[1, 2, 3]]))
    with pytest.raises(DataFileError, match=r"received a dict.*convert a megatron-style dict once"):
        ParallelBatch("online")(iter([{"tokens": torch.zeros(1, 4, dtype=torch.long)}]))


def test_a_data_rank_needs_the_iterator_not_the_loader():
    batches = online_batches(1, "contiguous", count=1)
    with pytest.raises(
        DataConfigError, match=r"needs the loader's iterator, got list; call get_batch\(iter\(loader\)\)"
    ):
        ParallelBatch("online")(batches)
    with pytest.raises(DataConfigError, match="got NoneType"):
        ParallelBatch("online")()


def test_the_outputs_are_on_the_device():
    model_inputs, loss_inputs = ParallelBatch("online", device="cpu")(iter(online_batches(1, "contiguous", count=1)))
    assert all(
        t.device == torch.device("cpu") for t in [*model_inputs.values(), *loss_inputs.values()] if t is not None
    )


def test_a_broken_boundary_list_is_refused_naming_the_rule():
    batch = online_batches(1, "contiguous", count=1)[0]
    broken = {"input_ids": batch.input_ids, "labels": batch.labels, "cu_seq_lens": torch.tensor([0, 3, 3, 99])}
    with pytest.raises(DataFileError, match="cu_seq_lens"):
        ParallelBatch("online")(iter([Batch(**broken)]))


# -- settings -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"source_type": "onlin"}, r"source_type is 'onlin' \(did you mean 'online'\?\); use one of online, indexed"),
        ({"attention_mode": "flash"}, r"attention_mode is 'flash'.*use one of dense, packed, flex, none"),
        ({"cp_layout": "zig_zag"}, r"cp_layout is 'zig_zag' \(did you mean 'zigzag'\?\)"),
        ({"causal": "yes"}, r"causal must be true or false, got 'yes'"),
        ({"reset_position_ids": 1}, r"reset_position_ids must be true or false, got 1"),
        ({"sliding_window": 0}, r"sliding_window must be an integer >= 1, got 0"),
        ({"sliding_window": 2.5}, r"sliding_window must be an integer >= 1, got 2.5"),
        ({"sliding_window": True}, r"sliding_window must be an integer >= 1, got the bool True"),
        (
            {"sliding_window": 8, "attention_mode": "packed"},
            r"no effect with attention_mode 'packed'.*window_size=\(8, 0\)",
        ),
        ({"sliding_window": 8, "attention_mode": "none"}, r"no effect with attention_mode 'none'"),
        ({"eod_mask_loss": True}, r"eod_token_id is not set, but eod_mask_loss needs it"),
        ({"eod_token_id": -1}, r"eod_token_id must be an integer >= 0, got -1"),
        ({"parallel_context": object()}, r"parallel_context must be a DataLoaderParallelContext"),
    ],
)
def test_bad_settings_are_named_with_the_fix(settings, message):
    settings = {"source_type": "online", **settings}
    with pytest.raises(DataConfigError, match=message):
        ParallelBatch(settings.pop("source_type"), **settings)


def test_layouts_the_attention_mode_cannot_use_are_refused_and_the_source_type_decides_nothing():
    with pytest.raises(
        DataConfigError, match=r"attention_mode 'packed' with cp_size 2 needs cp_layout 'zigzag_thd', got"
    ):
        at_rank(2, 0, source_type="online", attention_mode="packed", cp_layout="zigzag")
    at_rank(2, 0, source_type="online", attention_mode="packed", cp_layout="zigzag_thd")
    ParallelBatch("online", attention_mode="packed")  # one CP rank: every layout holds the whole row
    # Indexed rows cut at EOD tokens do not divide into 2 * cp chunks: the batch's own boundaries say so.
    with pytest.raises(DataConfigError, match=r"zigzag_thd CP layout cuts every sequence into 2\*cp_size=4"):
        at_rank(2, 1, source_type="indexed", cp_layout="zigzag_thd")(iter(indexed_batches(seed=5)))
    for source_type in SOURCE_TYPES:  # the same batch gives the same outputs whatever the source type says
        get_batch = ParallelBatch(source_type, attention_mode="packed")
        assert repr(get_batch(iter(online_batches(1, "contiguous", count=1)))) == repr(
            ParallelBatch("online", attention_mode="packed")(iter(online_batches(1, "contiguous", count=1)))
        )


def test_the_layout_is_decided_once_from_the_context():
    layout = at_rank(4, 1, cp_layout="zigzag_thd", sequence_parallel=True).layout
    assert layout == DeliveryLayout(cp_size=4, cp_layout="zigzag_thd", sequence_parallel=True)
    assert layout.sequence_multiple() == 8 and layout.pad_sequences


def test_repr_names_the_settings_and_the_ranks():
    text = repr(at_rank(4, 3, source_type="online", cp_layout="zigzag", attention_mode="flex"))
    assert "source_type='online'" in text and "cp_layout='zigzag'" in text and "cp=3/4" in text and "tp=0/1" in text


# -- scheduled steps (one process; the gloo meshes are in tests/parallel/test_data_schedule.py) -------------------


def scheduled(**settings) -> ParallelBatch:
    config = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=32, **settings)
    return ParallelBatch(attention_mode="packed", scheduler=config, pg_collection=ProcessGroupCollection())


def test_a_scheduled_step_delivers_every_token_once_with_the_same_keys():
    """``schedule`` plans one step; ``len(step)`` micro-batches come out of ``get_batch(step)`` and of iterating it,
    with the keys of every other mode, then ``StopIteration``; every real token of the step arrives once."""
    batches = online_batches(1, "contiguous", count=4, seed=7)
    wanted = sorted(t for batch in batches for t in batch.input_ids[0].tolist() if t)  # ids 3..49; 0 pads
    get_batch = scheduled()
    iterator = iter(batches)
    seen = []
    for _ in range(2):
        step = get_batch.schedule(iterator, 2)
        assert len(step) == step.num_micro_batches == step.stats.num_micro_batches >= 1
        first = get_batch(step)
        rest = list(step)
        assert len(rest) == len(step) - 1
        for model_inputs, loss_inputs in [first, *rest]:
            assert tuple(model_inputs) == MODEL_INPUT_KEYS and tuple(loss_inputs) == LOSS_INPUT_KEYS
            params = model_inputs["packed_seq_params"]
            assert params.local_cp_size == 1 and params.cp_group is None
            ids = model_inputs["input_ids"][0]
            seen += ids[ids != 0].tolist()
        with pytest.raises(StopIteration):
            next(step)
    with pytest.raises(StopIteration):
        get_batch.schedule(iterator, 2)
    assert sorted(seen) == wanted


def scheduled_inputs(**settings) -> list[dict]:
    """Every scheduled micro-batch's model inputs over two steps of the same seeded batches."""
    get_batch, iterator = (
        scheduled(pad_packed_seq_alignment=8, **settings),
        iter(online_batches(1, "contiguous", count=4, seed=7)),
    )
    return [inputs for _ in range(2) for inputs, _ in get_batch.schedule(iterator, 2)]


def test_the_tail_padding_policy_reaches_the_scheduled_rows():
    """Alignment 8 pads each packed row at its tail: ``append_dummy_seq`` makes that padding a sequence of its own
    (all pad ids, counted as its own tokens), ``extend_last`` adds it to the last real sequence's padded end (its
    real length unchanged), so the real tokens are fewer than the padded ones."""
    dummy, extended = scheduled_inputs(), scheduled_inputs(thd_tail_padding_policy="extend_last")
    assert len(dummy) == len(extended)
    tails = 0
    for with_dummy, with_extension in zip(dummy, extended, strict=True):
        a, b = with_dummy["packed_seq_params"], with_extension["packed_seq_params"]
        assert torch.equal(with_dummy["input_ids"], with_extension["input_ids"])  # the same tokens, padded alike
        if a.cu_seqlens_q_padded.numel() == b.cu_seqlens_q_padded.numel():
            continue  # no tail padding in this micro-batch
        tails += 1
        last = with_dummy["input_ids"][0, int(a.cu_seqlens_q_padded[-2]) :]
        assert (last == 0).all() and torch.equal(a.cu_seqlens_q, a.cu_seqlens_q_padded)
        assert b.cu_seqlens_q_padded.numel() == a.cu_seqlens_q_padded.numel() - 1
        assert int(b.cu_seqlens_q_padded[-1]) == int(a.cu_seqlens_q_padded[-1])
        assert int(b.cu_seqlens_q[-1]) == int(a.cu_seqlens_q_padded[-2]) < int(b.cu_seqlens_q_padded[-1])
    assert tails >= 1


def test_a_fixed_cu_seqlens_capacity_gives_every_micro_batch_the_same_shapes():
    """``thd_max_packed_sequences`` 4: at most 3 real sequences a group (the dummy slot reserved), and every
    boundary tensor holds 5 entries, the unused ones repeating the last."""
    for inputs in scheduled_inputs(thd_max_packed_sequences=4):
        params = inputs["packed_seq_params"]
        for bounds in (params.cu_seqlens_q, params.cu_seqlens_kv, params.cu_seqlens_q_padded):
            assert bounds.shape == (5,)
        spans = torch.diff(params.cu_seqlens_q_padded)
        used = int((spans > 0).sum())
        assert (spans[used:] == 0).all() and used <= 4
        assert int(params.cu_seqlens_q_padded[-1]) == inputs["input_ids"].shape[1]


def test_the_layout_takes_the_schedulers_alignment():
    layout = scheduled(pad_packed_seq_alignment=8, mxfp8=True).layout
    assert layout == DeliveryLayout(cp_layout="zigzag_thd", alignment=8, mxfp8=True, max_seqlen_per_rank=32)
    assert layout.local_multiple() == 32


def test_a_scheduler_needs_its_groups_and_a_plain_stage_cannot_plan():
    config = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=32)
    with pytest.raises(DataConfigError, match=r"needs their groups: pass pg_collection"):
        ParallelBatch(scheduler=config, parallel_context=DataLoaderParallelContext(dp_rank=1, dp_size=2))
    alone = ParallelBatch(scheduler=config)  # one rank: its groups are this process alone
    assert (alone.pg_collection.dp_size, alone.pg_collection.dynamic_cp_sizes) == (1, (1,))
    with pytest.raises(DataConfigError, match=r"pg_collection.dynamic_cp, which is empty"):
        ParallelBatch(scheduler=replace(config, scheduler="dynamic_cp"), pg_collection=ProcessGroupCollection())
    with pytest.raises(DataConfigError, match=r"scheduler must be a PackingSchedulerConfig, got dict"):
        ParallelBatch(scheduler={"max_seqlen_per_dp_cp_rank": 32}, pg_collection=ProcessGroupCollection())
    with pytest.raises(DataConfigError, match=r"has no scheduler, so it cannot plan a step"):
        ParallelBatch().schedule(iter([]), 1)
