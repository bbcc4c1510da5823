"""Specification of the collate functions: packing Online samples, the alignment rule, stacking Indexed samples.

Both return a ``Batch`` (the batch contract, ``tests/batching/test_batch.py``). Packed batches are compared with a
reference built the plain way (Python lists, one sample at a time); Indexed boundaries with ``ltor_fields``.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.build_collate_fn import (
    IndexedStackingCollator,
    TextPackingCollator,
    build_indexed_collate_fn,
    build_online_text_collate_fn,
    indexed_batch,
)
from hyper_parallel.data.batching.build_dataloader import FixedBatchDataLoader
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.indexed.ltor_fields import ltor_fields
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset


def make_samples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for length in lengths:
        ids = rng.integers(1, 1000, size=length, dtype=np.int64)
        labels = np.concatenate([ids[1:], [IGNORE_INDEX]])
        labels[rng.random(length) < 0.3] = IGNORE_INDEX
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def reference_pack(samples, alignment, pad_id):
    ids, labels, cu = [], [], [0]
    for sample in samples:
        ids += [int(x) for x in sample["input_ids"]]
        labels += [int(x) for x in sample["labels"]]
        cu.append(len(ids))
    while len(ids) % alignment:
        ids.append(pad_id)
        labels.append(IGNORE_INDEX)
    if len(ids) != cu[-1]:
        cu.append(len(ids))
    return ids, labels, cu


# -- the row and sequence multiples of a layout -------------------------------------------------------------------

ALIGNMENTS = [
    ({}, 1),
    ({"cp_size": 2}, 2),
    ({"cp_size": 2, "tp_size": 4}, 2),  # tp counts only with sequence parallelism
    ({"cp_size": 2, "tp_size": 4, "sequence_parallel": True}, 8),
    ({"tp_size": 4, "sequence_parallel": True}, 4),
    ({"cp_size": 2, "tp_size": 4, "sequence_parallel": True, "sequence_multiple": 32}, 32),
    ({"cp_size": 2, "tp_size": 4, "sequence_parallel": True, "sequence_multiple": 12}, 24),
    ({"cp_size": 3, "sequence_multiple": 32}, 96),
    ({"sequence_multiple": 7}, 7),
    ({"cp_size": 2, "cp_layout": "contiguous"}, 2),
    ({"cp_size": 2, "cp_layout": "zigzag"}, 4),  # the zigzag layouts cut rows into 2 * cp chunks
    ({"cp_size": 4, "cp_layout": "zigzag_thd"}, 8),
    ({"cp_size": 1, "cp_layout": "zigzag"}, 1),  # one CP rank cuts nothing
    ({"cp_size": 2, "tp_size": 4, "sequence_parallel": True, "cp_layout": "zigzag"}, 8),
    ({"cp_size": 4, "tp_size": 2, "sequence_parallel": True, "cp_layout": "zigzag_thd"}, 8),
    ({"cp_size": 2, "cp_layout": "zigzag", "sequence_multiple": 3}, 12),
]


@pytest.mark.parametrize(("kwargs", "expected"), ALIGNMENTS)
def test_rows_are_padded_to_the_layouts_row_multiple(kwargs, expected):
    """The expected multiples are worked out by hand: ``lcm(cp * tp_sp, 2 * cp for zigzag layouts, sequence_multiple)``;
    the loose keywords and the layout they stand for give the same collator."""
    sizes = {key: value for key, value in kwargs.items() if key != "sequence_multiple"}
    multiple = kwargs.get("sequence_multiple", 1)
    by_keywords = build_online_text_collate_fn(sequence_multiple=multiple, **sizes)
    by_layout = build_online_text_collate_fn(sequence_multiple=multiple, layout=DeliveryLayout(**sizes))
    assert by_keywords.alignment == by_layout.alignment == expected
    cp = sizes.get("cp_size", 1)
    per_sequence = 2 * cp if sizes.get("cp_layout") == "zigzag_thd" and cp > 1 else 1
    assert by_keywords.pad_each_sequence_to == by_layout.pad_each_sequence_to == per_sequence
    lengths = [3, 5, 1, 9]
    total = sum(-(-n // per_sequence) * per_sequence for n in lengths)
    assert by_layout(make_samples(lengths)).num_tokens == -(-total // expected) * expected


def test_the_builder_pads_each_sequence_for_zigzag_thd():
    """``cp_layout="zigzag_thd"`` with cp 2: rows a multiple of 4, and every sequence too (inside its boundaries);
    the other layouts pad only the row, unless the layout turns per-sequence padding on."""
    collator = build_online_text_collate_fn(layout=DeliveryLayout(cp_size=2, cp_layout="zigzag_thd"))
    assert (collator.alignment, collator.pad_each_sequence_to, collator.records_real) == (4, 4, True)
    batch = collator(make_samples([3, 2, 5]))
    assert batch.cu_seq_lens.tolist() == [0, 4, 8, 16]
    assert batch.cu_seq_lens_real.tolist() == [0, 3, 5, 10]
    assert build_online_text_collate_fn(cp_size=2, cp_layout="zigzag").pad_each_sequence_to == 1
    assert build_online_text_collate_fn(cp_size=1, cp_layout="zigzag_thd").pad_each_sequence_to == 1
    padded_contiguous = DeliveryLayout(cp_size=4, cp_layout="contiguous", pad_sequences=True)
    assert build_online_text_collate_fn(layout=padded_contiguous).pad_each_sequence_to == 8
    unpadded = build_online_text_collate_fn(cp_size=2)
    assert not unpadded.records_real and unpadded(make_samples([3, 2])).cu_seq_lens_real is None


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"cp_size": 0}, ["cp_size must be an integer >= 1, got 0"]),
        ({"tp_size": -1}, ["tp_size must be an integer >= 1, got -1"]),
        ({"sequence_multiple": 0}, ["sequence_multiple must be", "got 0", "kernels need", "(1 for none)"]),
        ({"cp_size": 1.5}, ["cp_size", "1.5"]),
        ({"cp_size": True}, ["cp_size", "bool True"]),
        ({"sequence_parallel": "yes"}, ["sequence_parallel must be true or false, got 'yes'"]),
        ({"cp_layout": "zigzag-thd"}, ["cp_layout is 'zigzag-thd' (did you mean 'zigzag_thd'?); use one of"]),
        ({"tail_padding": "extend"}, ["tail_padding is 'extend' (did you mean 'extend_last'?)", "append_dummy_seq"]),
        ({"layout": {"cp_size": 2}}, ["layout must be a DeliveryLayout", "got dict"]),
        (
            {"layout": DeliveryLayout(cp_size=2), "cp_size": 2},
            ["got both a layout (cp 2", "and ['cp_size']", "give either the layout or those keywords"],
        ),
    ],
)
def test_bad_layout_settings_are_refused(kwargs, named):
    """A bad layout setting is a ``DataConfigError`` naming the setting and the value."""
    with pytest.raises(DataConfigError) as error:
        build_online_text_collate_fn(**kwargs)
    for text in named:
        assert text in str(error.value)


# -- TextPackingCollator ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alignment", [1, 2, 4, 8, 32, 96])
@pytest.mark.parametrize("lengths", [[1], [5], [3, 2], [7, 1, 13, 4], [16, 16], list(range(1, 20))])
def test_packing_matches_the_reference(lengths, alignment):
    samples = make_samples(lengths, seed=len(lengths) * 100 + alignment)
    batch = TextPackingCollator(alignment=alignment, pad_token_id=3)(samples)
    assert type(batch) is Batch and set(batch) == {"input_ids", "labels", "loss_mask", "cu_seq_lens"}
    assert batch.position_ids is None and batch.megatron_attention_mask is None and batch.extras == {}
    assert batch.cu_seq_lens_real is None  # no sequence holds padding: the dummy tail is all its own
    ids, labels, cu = reference_pack(samples, alignment, 3)
    assert batch.input_ids.dtype == torch.int64 and batch.labels.dtype == torch.int64
    assert batch.cu_seq_lens.dtype == torch.int32 and batch.loss_mask.dtype == torch.float32
    assert batch.input_ids.shape == (1, len(ids)) and batch.labels.shape == (1, len(ids))
    assert batch.cu_seq_lens.ndim == 1
    assert batch.input_ids[0].tolist() == ids
    assert batch.labels[0].tolist() == labels
    assert batch.loss_mask[0].tolist() == [float(label != IGNORE_INDEX) for label in labels]
    assert batch.cu_seq_lens.tolist() == cu
    assert batch.input_ids.shape[1] % alignment == 0


def test_padding_is_a_synthetic_sequence():
    samples = make_samples([3, 2])
    batch = TextPackingCollator(alignment=4, pad_token_id=9)(samples)
    assert batch["cu_seq_lens"].tolist() == [0, 3, 5, 8]
    assert batch["input_ids"][0, 5:].tolist() == [9, 9, 9]
    assert batch["labels"][0, 5:].tolist() == [IGNORE_INDEX] * 3
    assert batch.loss_mask[0, 5:].tolist() == [0.0] * 3 and batch.num_sequences == 3
    assert batch["input_ids"][0, :5].tolist() == samples[0]["input_ids"].tolist() + samples[1]["input_ids"].tolist()


def test_sequences_held_side_by_side_pack_as_their_samples_would():
    """Worked example: tokens [1, 2, 3, 4, 5] holding lengths 3 and 2, each padded to 2, the row to 8: the sequences
    sit at [0, 4) and [4, 6), the dummy tail at [6, 8), which counts its padding as real tokens."""
    collator = TextPackingCollator(alignment=8, pad_token_id=9, pad_each_sequence_to=2)
    tokens = np.array([1, 2, 3, 4, 5], dtype=np.int64)
    batch = collator.pack_arrays([tokens], [tokens + 10], np.array([3, 2], dtype=np.int64))
    assert batch.input_ids.tolist() == [[1, 2, 3, 9, 4, 5, 9, 9]]
    assert batch.labels.tolist() == [[11, 12, 13, IGNORE_INDEX, 14, 15, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch.cu_seq_lens.tolist() == [0, 4, 6, 8]
    assert batch.cu_seq_lens_real.tolist() == [0, 3, 5, 7]


def test_position_ids_restart_at_every_packed_sequence_when_asked_for():
    """Worked example: lengths 3 and 2, alignment 4: positions [0, 1, 2, 0, 1] then the padding's own [0, 1, 2];
    they are absent unless asked for."""
    samples = make_samples([3, 2])
    asked = TextPackingCollator(alignment=4, position_ids=True)(samples)
    assert asked.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert TextPackingCollator(alignment=4)(samples).position_ids is None
    built = build_online_text_collate_fn(position_ids=True)(samples)
    assert built.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    with pytest.raises(DataConfigError, match="position_ids must be true or false"):
        TextPackingCollator(position_ids="yes")


@pytest.mark.parametrize("multiple", [2, 4, 8])
@pytest.mark.parametrize("lengths", [[1], [4], [3, 2], [7, 1, 13, 4], list(range(1, 12))])
def test_each_sequence_is_padded_inside_its_boundaries(lengths, multiple):
    """``pad_each_sequence_to`` (the zigzag_thd layout's 2 * cp): every sample padded at its end, with the pad id
    and ignored labels, its padding part of its own sequence; the tail padding a multiple too."""
    samples = make_samples(lengths, seed=multiple)
    batch = TextPackingCollator(alignment=2 * multiple, pad_token_id=3, pad_each_sequence_to=multiple)(samples)
    ids, labels, cu = [], [], [0]
    for sample in samples:
        pad = -len(sample["input_ids"]) % multiple
        ids += [int(x) for x in sample["input_ids"]] + [3] * pad
        labels += [int(x) for x in sample["labels"]] + [IGNORE_INDEX] * pad
        cu.append(len(ids))
    tail = -len(ids) % (2 * multiple)
    ids, labels = ids + [3] * tail, labels + [IGNORE_INDEX] * tail
    cu += [len(ids)] if tail else []
    assert batch.input_ids[0].tolist() == ids and batch.labels[0].tolist() == labels
    assert batch.cu_seq_lens.tolist() == cu
    assert all(length % multiple == 0 for length in np.diff(cu))
    assert batch.trained_tokens == sum(int((sample["labels"] != IGNORE_INDEX).sum()) for sample in samples)


def test_per_sequence_padding_worked_example():
    """Lengths 3 and 2 padded to 4, alignment 8: [a a a p | b b p p], boundaries [0, 4, 8]; position ids restart
    at each sequence and run on through its padding."""
    samples = [{"input_ids": [11, 12, 13], "labels": [12, 13, -100]}, {"input_ids": [21, 22], "labels": [-100, 23]}]
    batch = TextPackingCollator(alignment=8, pad_each_sequence_to=4, position_ids=True)(samples)
    assert batch.input_ids.tolist() == [[11, 12, 13, 0, 21, 22, 0, 0]]
    assert batch.labels.tolist() == [[12, 13, -100, -100, -100, 23, -100, -100]]
    assert batch.cu_seq_lens.tolist() == [0, 4, 8]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert "pad_each_sequence_to=4" in repr(TextPackingCollator(alignment=8, pad_each_sequence_to=4))


def test_per_sequence_padding_needs_an_alignment_of_its_multiple():
    with pytest.raises(DataConfigError, match=r"alignment 6 is not a multiple of pad_each_sequence_to 4.*set align"):
        TextPackingCollator(alignment=6, pad_each_sequence_to=4)
    with pytest.raises(DataConfigError, match=r"pad_each_sequence_to must be an integer >= 1, got 0.*zigzag_thd"):
        TextPackingCollator(pad_each_sequence_to=0)


def test_no_padding_when_aligned():
    samples = make_samples([3, 1])
    batch = TextPackingCollator(alignment=4, pad_token_id=9)(samples)
    assert batch["cu_seq_lens"].tolist() == [0, 3, 4]
    assert batch["input_ids"].shape == (1, 4)
    assert batch["labels"][0, 3].item() == samples[1]["labels"][0]
    batch = TextPackingCollator()(make_samples([5, 6, 7]))
    assert batch["cu_seq_lens"].tolist() == [0, 5, 11, 18]


def test_inputs_of_other_types_and_dtypes():
    samples = [
        {"input_ids": [1, 2, 3], "labels": [2, 3, IGNORE_INDEX]},
        {"input_ids": torch.tensor([4, 5], dtype=torch.int32), "labels": torch.tensor([5, IGNORE_INDEX])},
        {"input_ids": np.array([6], dtype=np.uint16), "labels": np.array([IGNORE_INDEX], dtype=np.int32)},
        {"input_ids": (7, 8), "labels": (8, IGNORE_INDEX), "extra": "ignored"},
    ]
    batch = TextPackingCollator(alignment=3, pad_token_id=0)(samples)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 0]]
    assert batch["labels"].tolist() == [[2, 3, IGNORE_INDEX, 5, IGNORE_INDEX, IGNORE_INDEX, 8, IGNORE_INDEX, -100]]
    assert batch["cu_seq_lens"].tolist() == [0, 3, 5, 6, 8, 9]


def test_outputs_do_not_alias_the_samples():
    samples = make_samples([4])
    before = samples[0]["input_ids"].copy()
    batch = TextPackingCollator()(samples)
    batch["input_ids"][0, 0] = -1
    assert (samples[0]["input_ids"] == before).all()


@pytest.mark.parametrize(
    ("samples", "match"),
    [
        ([], "no samples"),
        ([{"input_ids": [1, 2], "labels": [2, 3]}, {"input_ids": [], "labels": []}], "sample 1 .*empty"),
        ([{"input_ids": [1, 2, 3], "labels": [2, 3]}], "sample 0 of the batch has 3 input_ids but 2 labels"),
        ([{"input_ids": [[1, 2]], "labels": [[2, 3]]}], "sample 0 .*1-D"),
        ([{"input_ids": 5, "labels": 6}], "1-D"),
        ([{"input_ids": [1, 2]}], "sample 0 .*no 'labels'"),
        ([{"input_ids": [1.0, 2.0], "labels": [2, 3]}], "integer"),
        ([{"input_ids": [1], "labels": [2]}, None], "sample 1 .*NoneType"),
    ],
)
def test_packing_rejects_bad_batches(samples, match):
    with pytest.raises(DataFileError, match=match):
        TextPackingCollator(alignment=4)(samples)


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"alignment": 0}, "set alignment to the multiple of the packed length, as DeliveryLayout.row_multiple("),
        ({"alignment": 2.0}, "build_online_text_collate_fn"),
        ({"pad_token_id": -1}, "set pad_token_id to a token id of the vocabulary"),
        ({"pad_token_id": "0"}, "so 0 works"),
    ],
)
def test_collator_rejects_bad_settings(kwargs, fix):
    """Each bad setting is a ``DataConfigError`` naming it, its value and the fix."""
    ((name, value),) = kwargs.items()
    with pytest.raises(DataConfigError) as error:
        TextPackingCollator(**kwargs)
    assert f"{name} must be an integer" in str(error.value) and repr(value) in str(error.value)
    assert fix in str(error.value)


def test_text_collator_pickles():
    collator = TextPackingCollator(alignment=8, pad_token_id=5)
    clone = pickle.loads(pickle.dumps(collator))
    samples = make_samples([3, 9])
    assert clone(samples) == collator(samples)


# -- build_online_text_collate_fn ---------------------------------------------------------------------------------


class _Tokenizer:
    def __init__(self, pad_token_id):
        self.pad_token_id = pad_token_id


def test_online_builder_alignment_and_pad_ids(tokenizer):
    collator = build_online_text_collate_fn(cp_size=2, tp_size=4, sequence_parallel=True, sequence_multiple=32)
    assert (collator.alignment, collator.pad_token_id) == (32, 0)
    assert build_online_text_collate_fn(_Tokenizer(7)).pad_token_id == 7
    assert build_online_text_collate_fn(_Tokenizer(None)).pad_token_id == 0
    assert build_online_text_collate_fn(object()).pad_token_id == 0
    assert build_online_text_collate_fn(_Tokenizer(7), pad_token_id=2).pad_token_id == 2
    assert build_online_text_collate_fn(_Tokenizer(7), pad_token_id=0).pad_token_id == 0  # 0 is not "unset"
    assert build_online_text_collate_fn(tokenizer).pad_token_id == tokenizer.pad_token_id
    assert build_online_text_collate_fn(cp_size=4).alignment == 4
    batch = build_online_text_collate_fn(_Tokenizer(7), cp_size=4)(make_samples([2, 3]))
    assert batch["input_ids"][0, 5:].tolist() == [7, 7, 7]
    with pytest.raises(DataConfigError):
        build_online_text_collate_fn(cp_size=0)


class _MegatronTokenizer:
    """A tokenizer with Megatron's naming whose own pad id may lie past its vocabulary."""

    def __init__(self, pad: int, vocab_size: int):
        self.pad, self.vocab_size = pad, vocab_size


@pytest.mark.parametrize("pad_token_id", [8192, 8193, 10**6])
def test_online_builder_refuses_a_pad_id_past_the_tokenizer_vocabulary(tokenizer, pad_token_id):
    """The padding goes through the embedding: an id at or past the vocabulary size is refused when the collator is
    built, naming the id, the vocabulary and the setting; the last id of the vocabulary is accepted."""
    assert build_online_text_collate_fn(tokenizer, pad_token_id=8191).pad_token_id == 8191
    with pytest.raises(DataConfigError) as error:
        build_online_text_collate_fn(tokenizer, pad_token_id=pad_token_id)
    message = str(error.value)
    assert (
        f"pad_token_id {pad_token_id} is outside the vocabulary [0, 8192) of tokenizer {tokenizer.name_or_path}"
        in message
    )
    assert "Set pad_token_id on the collate_fn node to an id below 8192" in message


@pytest.mark.parametrize(("pad", "vocab_size", "refused"), [(99, 100, False), (100, 100, True), (5000, 100, True)])
def test_online_builder_refuses_the_tokenizer_s_own_pad_id_past_its_vocabulary(pad, vocab_size, refused):
    if refused:
        with pytest.raises(DataConfigError, match=rf"pad_token_id {pad} is outside the vocabulary \[0, {vocab_size}\)"):
            build_online_text_collate_fn(_MegatronTokenizer(pad, vocab_size))
    else:
        assert build_online_text_collate_fn(_MegatronTokenizer(pad, vocab_size)).pad_token_id == pad


def test_online_builder_with_real_tokenizer(tokenizer):
    texts = ["It is a truth universally acknowledged.", "Emma Woodhouse, handsome, clever, and rich."]
    samples = []
    for text in texts:
        ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
        samples.append({"input_ids": ids, "labels": np.append(ids[1:], IGNORE_INDEX)})
    batch = build_online_text_collate_fn(tokenizer, sequence_multiple=16)(samples)
    ids, labels, cu = reference_pack(samples, 16, build_online_text_collate_fn(tokenizer).pad_token_id)
    assert batch["input_ids"][0].tolist() == ids and batch["labels"][0].tolist() == labels
    assert batch["cu_seq_lens"].tolist() == cu


# -- Indexed stacking ---------------------------------------------------------------------------------------------

EOD = 0


def make_indexed_sample(seq_length, seed, attention=False, dataset_id=0):
    """A sample as GPTDataset gives it: EODs inside, and a loss mask with zeros (padding, eod_mask_loss)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 6, size=seq_length + 1, dtype=np.int64)  # about one EOD in six
    loss_mask = (rng.random(seq_length) > 0.2).astype(np.float32)
    sample = {
        "tokens": tokens[:-1],
        "labels": tokens[1:],
        "loss_mask": loss_mask,
        "position_ids": np.arange(seq_length, dtype=np.int64),
        "dataset_id": np.int64(dataset_id),
    }
    if attention:
        sample["attention_mask"] = ~np.tril(np.ones((seq_length, seq_length), dtype=bool))[None]
    return sample


@pytest.mark.parametrize("attention", [False, True])
def test_indexed_stacking(attention):
    samples = [make_indexed_sample(16, seed, attention, dataset_id=seed % 2) for seed in range(4)]
    batch = build_indexed_collate_fn(eod_token_id=EOD)(samples)
    assert type(batch) is Batch
    assert batch.input_ids.shape == (4, 16) and batch.input_ids.dtype == torch.int64
    assert batch.labels.shape == (4, 16)
    assert batch.loss_mask.shape == (4, 16) and batch.loss_mask.dtype == torch.float32
    assert batch.position_ids.shape == (4, 16)
    assert list(batch.extras) == ["dataset_id"] and batch.extras["dataset_id"].tolist() == [0, 1, 0, 1]
    for row, sample in enumerate(samples):
        trained = sample["loss_mask"] == 1
        assert batch.input_ids[row].tolist() == sample["tokens"].tolist()
        assert batch.labels[row].tolist() == np.where(trained, sample["labels"], IGNORE_INDEX).tolist()
        assert batch.loss_mask[row].tolist() == sample["loss_mask"].tolist()  # the dataset's mask, unchanged
    if attention:
        mask = batch.megatron_attention_mask  # megatron-core's attention_mask, renamed once, True = masked out
        assert mask.shape == (4, 1, 16, 16) and mask.dtype == torch.bool and "attention_mask" not in batch
        assert torch.equal(mask[2, 0], torch.from_numpy(samples[2]["attention_mask"][0]))
    else:
        assert batch.megatron_attention_mask is None and "megatron_attention_mask" not in batch


def test_ignore_index_marking_leaves_the_callers_labels_unchanged():
    """The collator marks the labels of its own stack; ``indexed_batch`` marks a copy of a megatron-style dict's
    int64 labels: neither the samples' labels nor the dict's change, in numpy or torch samples."""
    numpy_samples = [make_indexed_sample(16, seed) for seed in range(3)]
    torch_samples = [{k: torch.as_tensor(v) for k, v in s.items()} for s in numpy_samples]
    before = [s["labels"].copy() for s in numpy_samples]
    for samples in (numpy_samples, torch_samples):
        batch = IndexedStackingCollator(eod_token_id=EOD)(samples)
        assert (batch.labels == IGNORE_INDEX).any()
        assert all(np.array_equal(np.asarray(s["labels"]), b) for s, b in zip(samples, before, strict=True))
    stacked = default_collate(torch_samples)
    labels = stacked["labels"].clone()
    batch = indexed_batch(stacked, eod_token_id=EOD)
    assert torch.equal(stacked["labels"], labels) and batch.labels is not stacked["labels"]
    expected = labels.masked_fill(stacked["loss_mask"] == 0, IGNORE_INDEX)
    assert torch.equal(batch.labels, expected)


def test_megatron_names_are_converted_once_at_the_edge():
    """``tokens`` is renamed ``input_ids`` in the collator, and only there: the batch has no ``tokens`` key."""
    samples = [make_indexed_sample(8, seed, dataset_id=3) for seed in range(2)]
    batch = build_indexed_collate_fn(eod_token_id=EOD)(samples)
    assert "tokens" not in batch and batch["input_ids"] is batch.input_ids
    assert batch["dataset_id"].tolist() == [3, 3]
    assert list(batch) == ["input_ids", "labels", "loss_mask", "cu_seq_lens", "position_ids", "dataset_id"]


def test_indexed_boundaries_end_after_each_eod_and_at_each_row_end():
    """Worked example: rows ``[5, 0, 7, 8]`` and ``[0, 1, 2, 0]`` with EOD 0 hold sequences ``[5, 0]``, ``[7, 8]``,
    ``[0]`` and ``[1, 2, 0]``: the EOD ends the document it belongs to, and no sequence crosses a row."""
    rows = np.array([[5, 0, 7, 8], [0, 1, 2, 0]])
    samples = [{"tokens": row, "labels": np.append(row[1:], 9), "loss_mask": np.ones(4, np.float32)} for row in rows]
    batch = build_indexed_collate_fn(eod_token_id=0)(samples)
    assert batch.cu_seq_lens.tolist() == [0, 2, 4, 5, 8] and batch.cu_seq_lens.dtype == torch.int32
    assert [ids.tolist() for ids, _ in batch.sequences()] == [[5, 0], [7, 8], [0], [1, 2, 0]]
    assert IndexedStackingCollator()(samples).cu_seq_lens.tolist() == [0, 4, 8]  # no EOD id: one sequence a row


@pytest.mark.parametrize("seed", range(6))
def test_indexed_boundaries_are_those_of_ltor_fields(seed):
    """Position ids reset by ``ltor_fields`` (megatron-core's rule) restart exactly at the batch's boundaries."""
    samples = [make_indexed_sample(24, seed * 10 + row) for row in range(3)]
    batch = build_indexed_collate_fn(eod_token_id=EOD)(samples)
    starts = np.concatenate(
        [ltor_fields(s["tokens"], EOD, True, False, False, False).position_ids == 0 for s in samples]
    )
    assert np.flatnonzero(starts).tolist() == batch.cu_seq_lens[:-1].tolist()


def test_indexed_stacking_of_torch_samples():
    samples = [{k: torch.as_tensor(v) for k, v in make_indexed_sample(8, seed).items()} for seed in range(3)]
    batch = IndexedStackingCollator(eod_token_id=EOD)(samples)
    assert batch.input_ids.shape == (3, 8) and batch.extras["dataset_id"].shape == (3,)


def test_indexed_errors():
    collate = IndexedStackingCollator(eod_token_id=EOD)
    good = [make_indexed_sample(8, seed) for seed in range(3)]
    with pytest.raises(DataFileError, match="no samples"):
        collate([])
    with pytest.raises(DataFileError, match="sample 1 of the batch is None"):
        collate([good[0], None, good[2]])
    partial = dict(good[1])
    del partial["position_ids"]
    with pytest.raises(DataFileError, match=r"sample 1 .*missing \['position_ids'\]"):
        collate([good[0], partial])
    with pytest.raises(DataFileError, match=r"sample 1 .*extra \['attention_mask'\]"):
        collate([good[0], make_indexed_sample(8, 1, attention=True)])
    with pytest.raises(DataFileError, match="sample 1 .*'tokens' has shape"):
        collate([good[0], make_indexed_sample(9, 1)])
    without_mask = [{k: v for k, v in sample.items() if k != "loss_mask"} for sample in good]
    with pytest.raises(DataFileError, match=r"no \['loss_mask'\] .*need \['tokens', 'labels', 'loss_mask'\]"):
        collate(without_mask)
    as_lists = [{k: v.tolist() if k == "tokens" else v for k, v in sample.items()} for sample in good]
    with pytest.raises(DataFileError, match="'tokens' did not stack .*must be a 1-D numpy array or tensor"):
        collate(as_lists)


def test_indexed_collate_pickles():
    collate = build_indexed_collate_fn(eod_token_id=EOD)
    clone = pickle.loads(pickle.dumps(collate))
    samples = [make_indexed_sample(8, seed) for seed in range(2)]
    assert clone.eod_token_id == EOD and clone(samples) == collate(samples)


class _EosTokenizer:
    def __init__(self, eos_token_id):
        self.eos_token_id = eos_token_id


def test_indexed_builder_takes_the_eod_of_the_tokenizer(tokenizer, caplog):
    assert build_indexed_collate_fn(tokenizer).eod_token_id == tokenizer.eod
    assert build_indexed_collate_fn(_EosTokenizer(7)).eod_token_id == 7
    assert build_indexed_collate_fn(_EosTokenizer(7), eod_token_id=3).eod_token_id == 3
    with pytest.raises(DataConfigError, match="has no EOD/EOS token id.*set eod_token_id"):
        build_indexed_collate_fn(_EosTokenizer(None))
    with pytest.raises(DataConfigError, match="eod_token_id must be an integer >= 0, got -1.*EOD"):
        build_indexed_collate_fn(eod_token_id=-1)
    caplog.clear()
    with caplog.at_level("WARNING", logger="hyper_parallel.data"):
        assert build_indexed_collate_fn().eod_token_id is None
    assert "no EOD id: cu_seq_lens mark row ends only" in caplog.text


def test_a_gpt_dataset_batch_keeps_its_masks(tmp_path, tokenizer, caplog):
    """A real pipeline with ``eod_mask_loss`` and reset position ids: the batch's loss mask is the dataset's, the
    labels are ignored exactly there, and sequences start where the dataset's position ids restart."""
    prefix = tmp_path / "corpus_text_document"
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(60):
        document = [*rng.integers(2, 8000, size=int(rng.integers(3, 40))).tolist(), tokenizer.eod]
        builder.add_document(document, [len(document)])
    builder.finalize(f"{prefix}.idx")
    config = {
        "seq_length": 32,
        "split": "100, 0, 0",
        "data_cache_path": str(tmp_path / "cache"),
        "eod_mask_loss": True,
        "reset_position_ids": True,
        "create_ltor_fields_in_dataloader": True,
        "create_attention_mask": False,
    }
    train, _, _ = build_indexed_text_dataset(str(prefix), config, tokenizer=tokenizer)
    samples = train.__getitems__([0, 1, 2, 3])
    batch = build_indexed_collate_fn(tokenizer)(samples)
    loss_mask = torch.stack([sample["loss_mask"] for sample in samples])
    labels = torch.stack([sample["labels"] for sample in samples])
    assert torch.equal(batch.input_ids, torch.stack([sample["tokens"] for sample in samples]))
    assert torch.equal(batch.loss_mask, loss_mask) and 0 < batch.trained_tokens < loss_mask.numel()
    assert torch.equal(batch.labels, labels.masked_fill(loss_mask == 0, IGNORE_INDEX))
    restarts = np.flatnonzero(torch.stack([sample["position_ids"] for sample in samples]).reshape(-1) == 0)
    assert restarts.tolist() == batch.cu_seq_lens[:-1].tolist() and batch.num_sequences > 4
    assert train[0]["tokens"].shape == (32,) and "input_ids" not in train[0]  # samples keep megatron's names
    # A loader without a collate_fn stacks with the dataset's own EOD id: the same boundaries, and no warning.
    with caplog.at_level("WARNING", logger="hyper_parallel.data"):
        loaded = next(iter(FixedBatchDataLoader(train, micro_batch_size=4)))
    assert torch.equal(loaded.cu_seq_lens, batch.cu_seq_lens) and "no EOD id" not in caplog.text


# -- per-sequence padding, tail policies, real boundaries -----------------------------------------------------------


def reference_thd_pack(samples, per_sequence, alignment, tail_padding, pad_id):
    """One sample at a time: each padded at its end to ``per_sequence``, then the row's tail padding as a dummy
    sequence or at the last sequence's end; the real boundaries count each sequence's real tokens (the dummy's
    padding counts as its own)."""
    ids, cu, real = [], [0], [0]
    for sample in samples:
        tokens = [int(x) for x in sample["input_ids"]]
        ids += tokens + [pad_id] * (-len(tokens) % per_sequence)
        cu.append(len(ids))
        real.append(real[-1] + len(tokens))
    tail = -len(ids) % alignment
    ids += [pad_id] * tail
    if tail and tail_padding == "append_dummy_seq":
        cu.append(len(ids))
        real.append(real[-1] + tail)
    cu[-1] = len(ids)
    return ids, cu, real


@pytest.mark.parametrize("tail_padding", ["append_dummy_seq", "extend_last"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_per_sequence_padding_records_the_real_boundaries_under_both_tail_policies(tail_padding, cp, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 20, size=int(rng.integers(1, 7))).tolist()
    samples = make_samples(lengths, seed=seed)
    layout = DeliveryLayout(cp_size=cp, cp_layout="zigzag_thd")
    batch = build_online_text_collate_fn(
        layout=layout, sequence_multiple=16, tail_padding=tail_padding, pad_token_id=5
    )(samples)
    ids, cu, real = reference_thd_pack(samples, 2 * cp, math.lcm(2 * cp, 16), tail_padding, 5)
    assert batch.input_ids[0].tolist() == ids
    assert batch.cu_seq_lens.tolist() == cu and batch.cu_seq_lens_real.tolist() == real
    assert batch.trained_tokens == sum(int((s["labels"] != IGNORE_INDEX).sum()) for s in samples)
    assert all(n % (2 * cp) == 0 for n in np.diff(cu))  # every padded sequence divides into 2 * cp chunks


def test_extend_last_adds_the_tail_padding_to_the_last_sequence():
    """Worked example of the module docstring: alignment 4, lengths 3 and 2."""
    collator = TextPackingCollator(alignment=4, tail_padding="extend_last", position_ids=True)
    assert collator.records_real
    batch = collator(make_samples([3, 2]))
    assert batch.cu_seq_lens.tolist() == [0, 3, 8] and batch.cu_seq_lens_real.tolist() == [0, 3, 5]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    dummy = TextPackingCollator(alignment=4)(make_samples([3, 2]))
    assert dummy.cu_seq_lens.tolist() == [0, 3, 5, 8] and dummy.cu_seq_lens_real is None
    padded = TextPackingCollator(alignment=4, pad_each_sequence_to=4)(make_samples([3, 6]))
    assert padded.cu_seq_lens.tolist() == [0, 4, 12] and padded.cu_seq_lens_real.tolist() == [0, 3, 9]
    assert not TextPackingCollator(alignment=1, tail_padding="extend_last").records_real  # nothing to pad


def test_the_indexed_collator_refuses_rows_its_layout_cannot_cut():
    samples = [make_indexed_sample(10, seed) for seed in range(2)]
    fine = build_indexed_collate_fn(eod_token_id=EOD, layout=DeliveryLayout(cp_size=5))(samples)
    assert fine.input_ids.shape == (2, 10)
    collator = build_indexed_collate_fn(eod_token_id=EOD, layout=DeliveryLayout(cp_size=2, cp_layout="zigzag"))
    with pytest.raises(DataConfigError) as error:
        collator(samples)
    message = str(error.value)
    assert "the Indexed rows hold 10 tokens (seq_length)" in message and "cp 2 (zigzag" in message
    assert "set data_config.seq_length to a multiple of 4, such as 8 or 12" in message
    with pytest.raises(DataConfigError, match="layout must be a DeliveryLayout .*got int"):
        build_indexed_collate_fn(eod_token_id=EOD, layout=2)
