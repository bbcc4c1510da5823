"""Specification of ``BatchRelay``: the TP broadcast on PP stage 0, then one PP hop with field ownership.

Real gloo meshes of 8 processes (``parallel.launch``): PP2 x DP2 x TP2, PP2 x CP2 x TP2, PP4 x TP2 and PP4 x DP2 with
a multi-token-prediction stage. The data rank of every (DP, CP) coordinate produces seeded batches, then the end of
data. Every rank must hold exactly the fields its stage owns (written out here as Megatron-Core gives them: the first
stage and the MTP stages tokens and positions, the last stage labels and loss mask, every stage the THD metadata),
bit-equal to what its data rank produced; the end of data and any failure reach every rank in the same call; and
the bytes over PP are the owned fields' bytes plus one header per later stage, counted here independently, which
is less than sending every field to every stage.
"""

from __future__ import annotations

import functools
import hashlib

import pytest
import torch

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.parallel.batch_parallel import (
    BROADCAST_FIELDS,
    BatchRelay,
    header_bytes,
    pipeline_bytes,
    stage_fields,
)
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext
from parallel.launch import grid_coordinates, launch

WORLD_SIZE = 8
FIELDS = (*BROADCAST_FIELDS, "local_cp_size")
# What each kind of stage takes, written out independently of the relay's ownership table.
FIRST = {"input_ids", "position_ids"}
LAST = {"labels", "loss_mask"}
EVERY = {"cu_seq_lens", "cu_seq_lens_real", "local_cp_size", "attention_mask", "local_columns", "dataset_id"}
MESHES = {
    "PP2xDP2xTP2": ((2, 2, 2), ("pp", "dp", "tp"), ()),
    "PP2xCP2xTP2": ((2, 2, 2), ("pp", "cp", "tp"), ()),
    "PP4xTP2": ((4, 2), ("pp", "tp"), ()),
    "PP4xDP2+MTP2": ((4, 2), ("pp", "dp"), (2,)),
}
CALLS = 3  # batches before the end of data


def batches(dp: int, cp: int) -> list[dict[str, torch.Tensor] | None]:
    """What the data rank of coordinate (dp, cp) produces: packed micro-batches of changing length, then None."""
    generator = torch.Generator().manual_seed(1000 * dp + cp)
    produced: list[dict[str, torch.Tensor] | None] = []
    for length in (64, 24, 40)[:CALLS]:
        cuts = torch.sort(torch.randperm(length - 1, generator=generator)[:3] + 1).values
        produced.append(
            {
                "input_ids": torch.randint(0, 50_000, (1, length), generator=generator),
                "labels": torch.randint(-100, 50_000, (1, length), generator=generator),
                "loss_mask": torch.rand(1, length, generator=generator),
                "position_ids": torch.arange(length).reshape(1, length),
                "cu_seq_lens": torch.cat([torch.tensor([0]), cuts, torch.tensor([length])]).to(torch.int32),
                "local_cp_size": torch.tensor([1 + dp], dtype=torch.int64),
            }
        )
    return [*produced, None]


def owned(stage: int, pp_size: int, mtp_stages: tuple[int, ...]) -> set[str]:
    names = set(EVERY)
    if stage == 0 or stage in mtp_stages:
        names |= FIRST
    if stage == pp_size - 1:
        names |= LAST
    return names


def tensor_bytes(fields: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in fields.values())


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _describe(fields: dict[str, torch.Tensor] | None) -> dict | None:
    if fields is None:
        return None
    return {name: [str(t.dtype), list(t.shape), _digest(t)] for name, t in fields.items()}


def _coordinates(rank: int, shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, int]:
    found = dict(zip(names, grid_coordinates(rank, WORLD_SIZE, shape), strict=True))
    return {name: found.get(name, 0) for name in ("pp", "dp", "cp", "tp")}


def _context(shape, names) -> DataLoaderParallelContext:
    from torch.distributed.device_mesh import init_device_mesh

    return DataLoaderParallelContext.from_mesh(init_device_mesh("cpu", shape, mesh_dim_names=names))


# -- every stage its fields ---------------------------------------------------------------------------------------


def relay_every_batch(rank: int, world_size: int, mesh: str) -> list:
    """Every rank relays until the end of data; it reports what it holds and the bytes of each call."""
    shape, names, mtp_stages = MESHES[mesh]
    context = _context(shape, names)
    relay = BatchRelay(context, FIELDS, mtp_stages=mtp_stages)
    produced = iter(batches(context.dp_rank, context.cp_rank))
    calls = []
    for _ in range(CALLS + 1):
        held = relay.relay(lambda: next(produced))
        calls.append([_describe(held), relay.last_tp_bytes, relay.last_pp_bytes])
    return calls


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_stage_receives_exactly_the_fields_it_owns_bit_equal_then_the_end(tmp_path, mesh):
    shape, names, mtp_stages = MESHES[mesh]
    reports = launch(functools.partial(relay_every_batch, mesh=mesh), tmp_path, WORLD_SIZE)

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    pp_size = shape[names.index("pp")]
    tp_size = shape[names.index("tp")] if "tp" in names else 1
    header = header_bytes(FIELDS)
    for rank, report in enumerate(reports):
        place = _coordinates(rank, shape, names)
        stage = place["pp"]
        mine = owned(stage, pp_size, mtp_stages)
        for call, (held, tp_bytes, pp_bytes) in enumerate(report["value"]):
            batch = batches(place["dp"], place["cp"])[call]
            if batch is None:  # the end of data: None everywhere in the same call, the headers alone
                assert held is None, (rank, call)
                assert tp_bytes == (header if stage == 0 and tp_size > 1 else 0)
                assert pp_bytes == (header * (pp_size - 1) if stage == 0 else header)
                continue
            expected = {name: tensor for name, tensor in batch.items() if name in mine}
            assert held == _describe(expected), (rank, call)
            assert tp_bytes == (header + tensor_bytes(batch) if stage == 0 and tp_size > 1 else 0)
            if stage:
                assert pp_bytes == header + tensor_bytes(expected)
                continue
            later = [{n: t for n, t in batch.items() if n in owned(s, pp_size, mtp_stages)} for s in range(1, pp_size)]
            assert pp_bytes == sum(header + tensor_bytes(fields) for fields in later)
            everything = (pp_size - 1) * (header + tensor_bytes(batch))
            assert pp_bytes < everything  # ownership shrinks what crosses the pipeline
            assert pp_bytes == pipeline_bytes(batch, pp_size, mtp_stages=mtp_stages, field_names=FIELDS)


def test_a_middle_stage_takes_the_thd_metadata_alone():
    packed = ("input_ids", "labels", "position_ids", "loss_mask", "cu_seq_lens", "local_cp_size")
    assert stage_fields(packed, 1, 4) == ("cu_seq_lens", "local_cp_size")
    assert stage_fields(packed, 0, 4) == ("input_ids", "position_ids", "cu_seq_lens", "local_cp_size")
    assert set(stage_fields(FIELDS, 1, 4)) == EVERY  # a dense mask is needed by every layer, so every stage
    assert set(stage_fields(FIELDS, 3, 4)) == EVERY | LAST
    assert set(stage_fields(FIELDS, 2, 4, mtp_stages=(2,))) == EVERY | FIRST
    assert set(stage_fields(FIELDS, 0, 1)) == set(FIELDS)  # one stage is first and last
    custom = {"input_ids": "all", "cu_seq_lens": "last"}
    assert stage_fields(("input_ids", "cu_seq_lens"), 1, 3, custom) == ("input_ids",)


# -- end of data and failures on every rank -----------------------------------------------------------------------

FAILURES = {
    "file": lambda: DataFileError("data.jsonl, line 3: not JSON"),
    "config": lambda: DataConfigError("seq_length must be an integer"),
    "other": lambda: RuntimeError("disk gone"),
}


def relay_until_failure(rank: int, world_size: int, mesh: str, failure: str, failing_call: int) -> dict:
    """The data rank of coordinate (dp 0, cp 0) fails in call ``failing_call``; the others end their data."""
    shape, names, mtp_stages = MESHES[mesh]
    context = _context(shape, names)
    relay = BatchRelay(context, FIELDS, mtp_stages=mtp_stages)
    produced = iter(batches(context.dp_rank, context.cp_rank))
    fails = context.dp_rank == 0 and context.cp_rank == 0
    calls = 0

    def produce():
        if fails and calls == failing_call:
            if failure == "unregistered":
                return {"input_ids": torch.zeros(1, 4, dtype=torch.int64), "tokens": torch.zeros(1, 4)}
            raise FAILURES[failure]()
        return next(produced)

    try:
        while relay.relay(produce) is not None:
            calls += 1
    except Exception as error:  # noqa: BLE001 - reported to the test with the call it came in
        return {"call": calls, "type": type(error).__name__, "message": str(error)}
    return {"call": calls, "type": None}


@pytest.mark.parametrize(
    ("mesh", "failure"),
    [("PP2xDP2xTP2", "file"), ("PP2xCP2xTP2", "config"), ("PP4xTP2", "other"), ("PP4xDP2+MTP2", "unregistered")],
)
def test_a_data_rank_failure_raises_on_its_tp_peers_and_every_stage_in_the_same_call(tmp_path, mesh, failure):
    shape, names, _ = MESHES[mesh]
    worker = functools.partial(relay_until_failure, mesh=mesh, failure=failure, failing_call=1)
    reports = launch(worker, tmp_path, WORLD_SIZE)

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    outcomes = [r["value"] for r in reports]
    places = [_coordinates(rank, shape, names) for rank in range(WORLD_SIZE)]
    data_rank = next(rank for rank, p in enumerate(places) if p == {"pp": 0, "dp": 0, "cp": 0, "tp": 0})
    own = outcomes[data_rank]
    expected_type = {"file": "DataFileError", "config": "DataConfigError", "other": "RuntimeError"}.get(failure)
    assert own["call"] == 1 and own["type"] == (expected_type or "DataConfigError")
    if failure == "unregistered":
        assert own["message"].startswith("the field 'tokens' is not in the TP broadcast registry")
    relayed_type = "DataFileError" if own["type"] == "RuntimeError" else own["type"]
    relayed = (
        f"global rank {data_rank} (the data rank) failed to read the next batch ({own['type']}: {own['message']}); "
        f"see rank {data_rank}'s log"
    )
    for rank, (place, outcome) in enumerate(zip(places, outcomes, strict=True)):
        if rank == data_rank:
            continue
        if place["dp"] == 0 and place["cp"] == 0:  # its TP peers and every stage of them
            assert outcome == {"call": 1, "type": relayed_type, "message": relayed}, rank
        else:  # another coordinate reads its own data to the end
            assert outcome == {"call": CALLS, "type": None}, rank


def test_a_failure_in_the_first_call_reaches_every_rank_before_any_batch(tmp_path):
    worker = functools.partial(relay_until_failure, mesh="PP4xTP2", failure="file", failing_call=0)
    reports = launch(worker, tmp_path, WORLD_SIZE)

    assert [r["value"]["call"] for r in reports] == [0] * WORLD_SIZE
    assert [r["value"]["type"] for r in reports] == ["DataFileError"] * WORLD_SIZE
    assert {r["value"]["message"] for r in reports[1:]} == {
        "global rank 0 (the data rank) failed to read the next batch (DataFileError: data.jsonl, line 3: not JSON); "
        "see rank 0's log"
    }


# -- one process --------------------------------------------------------------------------------------------------


def test_without_process_groups_the_relay_returns_what_the_data_rank_produced():
    relay = BatchRelay(DataLoaderParallelContext.standalone(), FIELDS)
    batch = batches(0, 0)[0]
    held = relay.relay(lambda: batch)
    assert held.keys() == batch.keys() and all(held[name] is batch[name] for name in batch)
    assert relay.relay(lambda: None) is None
    assert (relay.last_tp_bytes, relay.last_pp_bytes) == (0, 0)
    error = DataFileError("record 9: no text")
    with pytest.raises(DataFileError) as raised:
        relay.relay(lambda: (_ for _ in ()).throw(error))
    assert raised.value is error


def test_bad_ownership_and_contexts_are_refused_with_the_fix():
    context = DataLoaderParallelContext.standalone()
    with pytest.raises(DataConfigError, match="the relay's owner of field 'labels' is 'middle'; use one of"):
        BatchRelay(context, FIELDS, {"labels": "middle"})
    with pytest.raises(DataConfigError, match=r"mtp_stages holds stage 2, but the pipeline has 1 stage\(s\)"):
        BatchRelay(context, FIELDS, mtp_stages=(2,))
    with pytest.raises(DataConfigError, match="the relay field registry .* names a field twice"):
        BatchRelay(context, ("input_ids", "input_ids"))
    with pytest.raises(DataConfigError, match="has pp_size 2 but no pp_group"):
        BatchRelay(DataLoaderParallelContext(pp_size=2), FIELDS)
    with pytest.raises(DataConfigError, match=r"has tp_size 4 but no tp_group, .* from_groups\(tp_group=...\)"):
        BatchRelay(DataLoaderParallelContext(tp_rank=1, tp_size=4), FIELDS)
    with pytest.raises(DataConfigError, match="BatchRelay needs a DataLoaderParallelContext"):
        BatchRelay(object(), FIELDS)
