"""Specification of the delivery plan: metadata a collator computes in the DataLoader worker for one CP rank.

A batch that carries it (``Batch.delivery``) must be delivered exactly as the stage delivers the same batch without
it: every field equal to the plain reference of ``get_batch_reference`` (Python loops sharing no code with the
library) and to the stage's own computation, through real DataLoader workers too.
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from hyper_parallel.data.batching.attention_runtime import PackedSeqParams
from hyper_parallel.data.batching.build_collate_fn import build_indexed_collate_fn, build_online_text_collate_fn
from hyper_parallel.data.batching.delivery_plan import DeliveryMetadata, DeliveryPlan, prepare_delivery
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout

from .get_batch_reference import check_rank, expected_fields, indexed_boundaries
from .test_get_batch import EOD, SETTINGS, at_rank, indexed_batches, indexed_samples, online_batches


def same_value(ours, theirs, where: str) -> None:
    """Two delivered values are equal: tensors by value and dtype, BlockMasks table by table, THD params by field."""
    if isinstance(ours, torch.Tensor):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    elif isinstance(ours, PackedSeqParams):
        for name, value in vars(ours).items():
            same_value(value, vars(theirs)[name], f"{where}.{name}")
    elif ours is not None and hasattr(ours, "as_tuple"):  # a BlockMask
        assert ours.seq_lengths == theirs.seq_lengths and ours.BLOCK_SIZE == theirs.BLOCK_SIZE, where
        for mine, other in zip(ours.as_tuple(flatten=True), theirs.as_tuple(flatten=True), strict=True):
            if isinstance(mine, torch.Tensor):
                same_value(mine, other, where)
    else:
        assert ours == theirs, where


def same_delivery(ours, theirs) -> None:
    for mine, other in zip(ours, theirs, strict=True):
        assert list(mine) == list(other)
        for name in mine:
            same_value(mine[name], other[name], name)


@pytest.mark.parametrize("settings", [*SETTINGS, {"attention_mode": "packed"}],
                         ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))  # fmt: skip
@pytest.mark.parametrize(("cp", "layout"), [(1, "contiguous"), (2, "contiguous"), (2, "zigzag"), (2, "zigzag_thd"),
                                            (4, "zigzag_thd")])  # fmt: skip
def test_a_prepared_online_batch_is_delivered_as_the_reference_and_as_the_stage_computes_it(cp, layout, settings):
    if settings["attention_mode"] == "packed" and cp > 1 and layout != "zigzag_thd":
        pytest.skip("packed attention with CP needs zigzag_thd")
    window = settings.get("sliding_window")
    for rank in range(cp):
        stage = at_rank(cp, rank, cp_layout=layout, eod_token_id=EOD, **settings)
        plain = at_rank(cp, rank, cp_layout=layout, eod_token_id=EOD, **settings)
        batches = online_batches(cp, layout, seed=rank)
        prepared = [prepare_delivery(batch, stage.delivery_plan) for batch in batches]
        assert all(isinstance(batch.delivery, DeliveryMetadata) for batch in prepared)
        ours, theirs = iter(prepared), iter(batches)
        for batch in batches:
            delivered = stage(ours)
            expected = expected_fields(
                batch.input_ids.tolist(), batch.labels.tolist(), batch.cu_seq_lens.tolist(), cp=cp, rank=rank,
                layout=layout, causal=settings.get("causal", True), window=window,
                reset_position_ids=settings.get("reset_position_ids", False),
                eod_mask_loss=settings.get("eod_mask_loss", False), eod=EOD, pad=0,
            )  # fmt: skip
            check_rank(*delivered, expected, settings["attention_mode"], window)
            same_delivery(delivered, plain(theirs))


@pytest.mark.parametrize("settings", SETTINGS[:4], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize(("cp", "layout"), [(1, "contiguous"), (2, "zigzag"), (4, "contiguous")])
def test_the_indexed_collator_prepares_the_same_delivery(cp, layout, settings):
    rng = np.random.default_rng(cp)
    for rank in range(cp):
        stage = at_rank(cp, rank, source_type="indexed", cp_layout=layout, eod_token_id=EOD, **settings)
        collate = build_indexed_collate_fn(eod_token_id=EOD, layout=stage.layout, delivery_plan=stage.delivery_plan)
        batch = collate(indexed_samples(2, 16, rng))
        assert batch.delivery.plan == stage.delivery_plan
        delivered = stage(iter([batch]))
        ids, labels = batch.input_ids.tolist(), batch.labels.tolist()
        expected = expected_fields(
            ids, labels, indexed_boundaries(ids, labels, EOD), cp=cp, rank=rank, layout=layout,
            causal=settings.get("causal", True), window=settings.get("sliding_window"),
            reset_position_ids=settings.get("reset_position_ids", False), eod=EOD,
        )  # fmt: skip
        check_rank(*delivered, expected, settings["attention_mode"], settings.get("sliding_window"))


def _documents(seed: int) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(4):
        lengths = rng.integers(5, 60, size=int(rng.integers(1, 6)))
        groups.append([{"input_ids": (ids := rng.integers(3, 99, size=n)), "labels": ids} for n in lengths])
    return groups


@pytest.mark.parametrize("mode", ["packed", "flex"])
def test_metadata_computed_in_dataloader_workers_is_delivered_as_the_stage_computes_it(mode):
    cp, rank = 2, 1
    stage = at_rank(cp, rank, attention_mode=mode, cp_layout="zigzag_thd" if mode == "packed" else "zigzag")
    plain = at_rank(cp, rank, attention_mode=mode, cp_layout=stage.cp_layout)
    collate = build_online_text_collate_fn(layout=stage.layout, delivery_plan=stage.delivery_plan)
    loader = DataLoader(_documents(5), batch_size=None, collate_fn=collate, num_workers=2, pin_memory=False)
    reference = build_online_text_collate_fn(layout=stage.layout)
    delivered = 0
    for batch, samples in zip(loader, _documents(5), strict=True):
        assert batch.delivery is not None
        same_delivery(stage(iter([batch])), plain(iter([reference(samples)])))
        delivered += 1
    assert delivered == 4


def test_a_prepared_batch_pickles_and_moves_with_its_metadata():
    stage = at_rank(2, 0, attention_mode="flex", cp_layout="zigzag")
    batch = prepare_delivery(online_batches(2, "zigzag")[0], stage.delivery_plan)
    copy = pickle.loads(pickle.dumps(batch))
    same_value(copy.delivery.columns, batch.delivery.columns, "columns")
    same_value(copy.delivery.flex_tables.kv_indices, batch.delivery.flex_tables.kv_indices, "kv_indices")
    moved = batch.to("meta")
    assert moved.delivery.columns.device.type == "meta"
    assert moved.delivery.flex_tables.first.device.type == "meta" and batch.delivery.columns.device.type == "cpu"


def test_metadata_for_another_rank_is_refused_naming_the_fix():
    batch = online_batches(2, "zigzag")[0]
    other = prepare_delivery(batch, at_rank(2, 0, cp_layout="zigzag").delivery_plan)
    with pytest.raises(DataConfigError, match=r"computed for DeliveryPlan\(cp_size=2, cp_rank=0.*delivery_plan"):
        at_rank(2, 1, cp_layout="zigzag")(iter([other]))


def test_a_collator_refuses_a_plan_that_cuts_rows_otherwise_than_its_layout():
    plan = DeliveryPlan(cp_size=2, cp_rank=0, cp_layout="zigzag")
    with pytest.raises(DataConfigError, match="cp_size 2 in the zigzag layout"):
        build_online_text_collate_fn(layout=DeliveryLayout(cp_size=4, cp_layout="zigzag"), delivery_plan=plan)
    with pytest.raises(DataConfigError, match="must be a DeliveryPlan"):
        build_online_text_collate_fn(layout=DeliveryLayout(cp_size=2, cp_layout="zigzag"), delivery_plan="zigzag")


@pytest.mark.parametrize(("settings", "message"), [
    ({"cp_size": 2, "cp_rank": 2}, "cp_rank 2 must be below cp_size 2"),
    ({"cp_layout": "zig"}, "cp_layout"),
    ({"attention_mode": "sparse"}, "attention_mode"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"causal": 1}, "causal"),
])  # fmt: skip
def test_a_bad_plan_is_refused_naming_the_setting(settings, message):
    with pytest.raises(DataConfigError, match=message):
        DeliveryPlan(**settings)


def test_the_stage_plan_follows_its_settings():
    stage = at_rank(4, 3, attention_mode="dense", cp_layout="zigzag", sliding_window=2, reset_position_ids=True)
    assert stage.delivery_plan == DeliveryPlan(cp_size=4, cp_rank=3, cp_layout="zigzag", attention_mode="dense",
                                               sliding_window=2, reset_position_ids=True)  # fmt: skip
    assert replace(stage.delivery_plan, cp_rank=0) != stage.delivery_plan
    assert indexed_batches(count=1)[0].delivery is None  # a collator without a plan computes nothing
