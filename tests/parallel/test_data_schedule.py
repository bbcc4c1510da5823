"""The packing scheduler over real gloo ranks: DP2 x CP2, DP2 x CP2 x TP2, DP3 (uneven data) and CP2 x PP2 grids.

Each DP rank's loader yields micro-batches of the online collator (``TextPackingCollator``, alignment 1) built from
synthetic sequences with long-tailed (seeded lognormal) lengths; every token encodes its sequence and offset
(``1 + sequence * 1024 + offset``; 0 is padding) and every loss-carrying label is its token + 7, so the test can
check, from what each rank receives, that every valid token of a step (prompt-only ones included) arrives exactly
once, at its own position, with its label, cut in the ``zigzag_thd`` layout of the micro-batch's CP size. The
expectations are regenerated here from the seeds, never read from the code under test. Many cases run in one
launch per grid.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections import Counter

import numpy as np
import pytest
import torch

from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.build_collate_fn import TextPackingCollator
from hyper_parallel.data.batching.data_schedule import (
    get_batch_on_this_cp_rank,
    get_batch_on_this_rank_for_sequence_packing,
    wrap_data_iterator,
)
from hyper_parallel.data.batching.get_batch import LOSS_INPUT_KEYS, MODEL_INPUT_KEYS, ParallelBatch
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.parallel.data_schedule_utils import PackingSchedulerConfig
from hyper_parallel.data.parallel.process_groups import ProcessGroupCollection
from parallel.launch import launch

OFFSETS = 1024  # a token is 1 + sequence * OFFSETS + offset
LABEL_SHIFT = 7
MAX_SEQLEN = 64  # max_seqlen_per_dp_cp_rank of every case


# -- data (regenerated identically by the workers and by the test) -----------------------------------------------


def rank_stream(case: dict, dp_rank: int) -> list[list[tuple[int, np.ndarray, np.ndarray]]]:
    """Every micro-batch DP rank ``dp_rank``'s loader yields: lists of ``(sequence id, input_ids, labels)``.

    A rank yields ``steps * num_microbatches`` micro-batches unless ``case["total"]`` says fewer; each step fetches
    the next ``num_microbatches`` of them.
    """
    total = case.get("total", {}).get(str(dp_rank), case["steps"] * case["num_microbatches"])
    batches = []
    for j in range(total):
        rng = np.random.default_rng([case["seed"], dp_rank, j])
        batch = []
        for i in range(int(rng.integers(1, 5))):
            sequence = (dp_rank * 256 + j) * 8 + i
            length = int(np.clip(rng.lognormal(2.6, 0.9), 1, case["longest"]))
            ids = 1 + sequence * OFFSETS + np.arange(length)
            labels = ids + LABEL_SHIFT
            kind = int(rng.integers(0, 4))
            labels[: length if kind == 0 else int(rng.integers(0, length))] = IGNORE_INDEX  # 0: prompt only
            batch.append((sequence, ids, labels))
        batches.append(batch)
    return batches


def loader(case: dict, dp_rank: int):
    collate = TextPackingCollator(alignment=1)
    for batch in rank_stream(case, dp_rank):
        yield collate([{"input_ids": ids, "labels": labels} for _, ids, labels in batch])


def expected_tokens(case: dict, dp_size: int, step: int) -> dict[int, int]:
    """Every valid token of the step's global batch (what each DP rank fetches in that step) -> its label."""
    tokens, count = {}, case["num_microbatches"]
    for dp_rank in range(dp_size):
        for batch in rank_stream(case, dp_rank)[step * count : (step + 1) * count]:
            for _, ids, labels in batch:
                tokens.update(zip(ids.tolist(), labels.tolist(), strict=True))
    return tokens


# -- the workers ---------------------------------------------------------------------------------------------------


def members(group) -> list[int]:
    return [torch.distributed.get_rank()] if group is None else torch.distributed.get_process_group_ranks(group)


def listed(tensor):
    """A delivered field as lists; None for a field this PP stage does not own."""
    return None if tensor is None else tensor.tolist()


def micro_batch_record(batch: dict) -> dict:
    """What the test checks of one delivered micro-batch, from Megatron's keys."""
    params = batch["packed_seq_params"]
    return {
        **{name: listed(batch[name]) for name in ("tokens", "labels", "loss_mask", "position_ids")},
        "cu": [
            getattr(params, name).tolist()
            for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
        ],
        "cu_dtype": str(params.cu_seqlens_q.dtype),
        "max_seqlen": [params.max_seqlen_q, params.max_seqlen_kv],
        "format": params.qkv_format,
        "local_cp_size": params.local_cp_size,
        "cp_group": members(params.cp_group),
        "tp_cp_group": None if params.tp_cp_group is None else members(params.tp_cp_group),
    }


def stage_case(case: dict, groups: ProcessGroupCollection) -> dict:
    """The same case through ``ParallelBatch`` itself: ``schedule`` once per step, then iterate the step."""
    config = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=MAX_SEQLEN, **case["config"])
    get_batch = ParallelBatch(
        attention_mode="packed", cp_layout="zigzag_thd", reset_position_ids=True, scheduler=config,
        pg_collection=groups, sequence_parallel=config.sequence_parallel,
    )  # fmt: skip
    iterator = loader(case, groups.dp_rank) if groups.is_data_rank else None
    steps = []
    while len(steps) <= case["steps"]:
        try:
            step = get_batch.schedule(iterator, case["num_microbatches"])
        except StopIteration:
            return {"steps": steps, "stopped": True}
        micro_batches = []
        for model_inputs, loss_inputs in step:  # our keys, mapped to Megatron's here in the test
            assert set(model_inputs) == set(MODEL_INPUT_KEYS) and set(loss_inputs) == set(LOSS_INPUT_KEYS)
            fields = {"tokens": model_inputs["input_ids"], "position_ids": model_inputs["position_ids"],
                      "labels": loss_inputs["labels"], "loss_mask": loss_inputs["loss_mask"],
                      "packed_seq_params": model_inputs["packed_seq_params"]}  # fmt: skip
            micro_batches.append(micro_batch_record(fields))
        steps.append({"count": len(step), "stats": step.stats.as_tensor().tolist(), "micro_batches": micro_batches})
    return {"steps": steps, "stopped": False}


def run_case(case: dict, groups: ProcessGroupCollection) -> dict:
    """Every step of one case: the scheduler's outcome and each micro-batch this rank receives."""
    config = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=MAX_SEQLEN, **case["config"])
    iterator = loader(case, groups.dp_rank) if groups.is_data_rank else None
    dynamic = case["config"].get("scheduler") == "dynamic_cp"
    stage = {"vpp_size": config.vpp_size, "vp_stage": 0 if config.vpp_size else None}
    steps = []
    for _ in range(case["steps"] + 2):
        try:
            wrapped, count, stats = wrap_data_iterator(iterator, config, case["num_microbatches"], pg_collection=groups)
        except StopIteration:
            return {"steps": steps, "stopped": True}
        micro_batches = []
        for _ in range(count):
            batch = get_batch_on_this_rank_for_sequence_packing(
                wrapped, pg_collection=groups, dynamic_cp=dynamic, sequence_parallel=config.sequence_parallel, **stage
            )
            micro_batches.append(micro_batch_record(batch))
        try:
            get_batch_on_this_rank_for_sequence_packing(wrapped, pg_collection=groups, dynamic_cp=dynamic, **stage)
            after = "another micro-batch"
        except StopIteration:
            after = "StopIteration"
        steps.append(
            {"count": count, "stats": stats.as_tensor().tolist(), "micro_batches": micro_batches, "after": after}
        )
    return {"steps": steps, "stopped": False}


def error_case(case: dict, groups: ProcessGroupCollection) -> dict:
    """A case that must fail: the error, and how many micro-batches the loader gave before it."""
    reads = []

    def counted():
        for item in case_items(case, groups.dp_rank):
            reads.append(1)
            yield item

    try:
        settings = {"max_seqlen_per_dp_cp_rank": MAX_SEQLEN, **case["config"]}
        config = PackingSchedulerConfig(**settings | case.get("config_by_position", {}).get(str(groups.position), {}))
        count = case.get("microbatches_by_position", {}).get(str(groups.position), case.get("num_microbatches", 2))
        chosen = (
            groups
            if case.get("groups", "full") == "full"
            else ProcessGroupCollection(tp=groups.tp, pp=groups.pp, dp=groups.dp, cp=groups.cp)
        )
        wrap_data_iterator(counted() if groups.is_data_rank else None, config, count, pg_collection=chosen)
    except (DataConfigError, DataFileError, StopIteration) as error:
        return {"error": [type(error).__name__, str(error)], "reads": len(reads)}
    return {"error": None, "reads": len(reads)}


def case_items(case: dict, dp_rank: int):
    kind = case["items"]
    if kind == "zero_spans":  # boundaries with a zero-length span: the batch contract refuses them when read
        ones = torch.ones(1, 4, dtype=torch.int64)
        yield Batch(input_ids=ones, labels=ones, cu_seq_lens=torch.tensor([0, 2, 2, 4], dtype=torch.int32))
    elif kind == "bad_on_1" and dp_rank == 1:  # a Megatron-style dict: the stage takes Batches only
        yield {"tokens": torch.ones(1, 4, dtype=torch.int64), "cu_seqlens": torch.tensor([0, 4], dtype=torch.int32)}
    elif kind == "oversize":
        length = 4 * MAX_SEQLEN + 1
        yield TextPackingCollator()([{"input_ids": np.arange(1, length + 1), "labels": np.arange(length)}])
    else:
        yield from loader(case | {"steps": 1}, dp_rank)


def cp_rank_slice(rank: int, world_size: int, groups: ProcessGroupCollection) -> dict:
    """get_batch_on_this_cp_rank on a hand-made batch: the static group, and the legacy batch metadata."""
    bounds = torch.tensor([0, 8, 12], dtype=torch.int32)
    batch = {"tokens": torch.arange(12)[None], "labels": torch.arange(12)[None] + 100, "cu_seq_lens": bounds}
    static = get_batch_on_this_cp_rank(batch, groups.cp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        legacy = get_batch_on_this_cp_rank({**batch, "hybrid_cp_group": groups.cp})
    return {
        "legacy_warnings": [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)],
        "static": static["tokens"].tolist(),
        "legacy": legacy["tokens"].tolist(),
        "labels": static["labels"].tolist(),
        "cu": static["cu_seq_lens"].tolist(),
    }


def grid_worker(rank: int, world_size: int, *, shape, names, sizes, cases, errors, extra=False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    groups = ProcessGroupCollection.from_mesh(init_device_mesh("cpu", shape, mesh_dim_names=names), sizes)
    report = {"place": [groups.dp_rank, groups.cp_rank, groups.tp_rank, groups.pp_rank, groups.position]}
    for name, case in cases.items():
        try:
            report[name] = run_case(case, groups)
        except (DataConfigError, DataFileError) as error:
            report[name] = {"failed": [type(error).__name__, str(error)]}
    for name, case in cases.items():
        report[f"{name}@stage"] = stage_case(case, groups)
    first = next(iter(cases.values()))
    report["evaluation"] = [run_case(first, groups) for _ in range(2)]  # two evaluations, fresh iterators
    for name, case in errors.items():
        report[name] = error_case(case, groups)
    if extra:
        report["cp_slice"] = cp_rank_slice(rank, world_size, groups)
    return report


# -- checks --------------------------------------------------------------------------------------------------------


def effective_alignment(config: dict, cp: int, tp: int) -> int:
    """The local length's multiple, from the rules: N, x tp with SP, x 32 per SP shard with MXFP8, even under CP."""
    alignment = config.get("pad_packed_seq_alignment", 1)
    multiple = 1 if alignment == "max" else alignment
    shard = tp if config.get("sequence_parallel") else 1
    multiple = math.lcm(multiple, shard)
    if config.get("mxfp8"):
        multiple = math.lcm(multiple, 32 * shard)
    return math.lcm(multiple, 2) if cp > 1 else multiple


def zigzag_positions(bounds: list[int], c: int, r: int) -> list[int]:
    """The within-sequence positions CP rank ``r`` of ``c`` holds: per sequence, chunks ``r`` and ``2c-1-r``."""
    if c == 1:
        return [p for a, b in zip(bounds[:-1], bounds[1:], strict=True) for p in range(b - a)]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        chunk = (b - a) // (2 * c)
        out += list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * c - 1 - r) * chunk, (2 * c - r) * chunk))
    return out


def check_case(reports: list[dict], name: str, case: dict, dims: dict, allowed: tuple[int, ...]) -> None:
    dp, cp, tp = dims["dp"], dims["cp"], dims["tp"]
    config = case["config"]
    runs = [report[name] for report in reports]
    assert all("failed" not in run for run in runs), runs[0]
    assert all(run["stopped"] for run in runs), "the end of data must reach every rank"
    assert len({len(run["steps"]) for run in runs}) == 1, "every rank stops at the same call"
    assert len(runs[0]["steps"]) == case["steps"]
    places = [report["place"] for report in reports]
    for step in range(case["steps"]):
        outcome = {(run["steps"][step]["count"], tuple(run["steps"][step]["stats"])) for run in runs}
        assert len(outcome) == 1, f"step {step}: every rank runs the same micro-batches: {outcome}"
        count = runs[0]["steps"][step]["count"]
        multiple = dp * (config.get("microbatch_group_size_per_vp_stage") or 1 if config.get("vpp_size") else 1)
        assert count >= 1 and (count * dp) % multiple == 0
        assert all(run["steps"][step]["after"] == "StopIteration" for run in runs)
        seen: dict[int, int] = {}
        labels = expected_tokens(case, dp, step)
        sequence_lengths = Counter((token - 1) // OFFSETS for token in labels)  # every token of a sequence, once
        stride, pp = dp * cp * tp, dims.get("pp", 1)
        for rank, (run, (_, _, tp_rank, pp_rank, _)) in enumerate(zip(runs, places, strict=True)):
            for m, batch in enumerate(run["steps"][step]["micro_batches"]):
                peer = runs[rank - tp_rank]["steps"][step]["micro_batches"][m]
                assert without_groups(batch) == without_groups(peer), "TP peers receive identical tensors"
                check_stage_fields(batch, pp_rank, pp)
                first = runs[rank - pp_rank * stride]["steps"][step]["micro_batches"][m]
                last = runs[rank + (pp - 1 - pp_rank) * stride]["steps"][step]["micro_batches"][m]
                assert thd_metadata(batch) == thd_metadata(first), "every PP stage gets the same THD metadata"
                batch = batch | {name: first[name] for name in FIRST_STAGE} | {name: last[name] for name in LAST_STAGE}
                assert rank in batch["cp_group"]
                check_micro_batch(batch, config, tp, allowed, rank)
                if tp_rank or pp_rank:
                    continue
                check_real_lengths(runs, batch, step, m, sequence_lengths)
                for token, label in zip(batch["tokens"][0], batch["labels"][0], strict=True):
                    if token:
                        seen[token] = seen.get(token, 0) + 1
                        assert label == labels[token]
        assert sorted(seen.values()) == [1] * len(seen), "a valid token arrived twice"
        assert seen.keys() == labels.keys(), f"step {step}: every valid token arrives"
        check_groups_hold_one_micro_batch(runs, places, step, cp)


FIRST_STAGE = ("tokens", "position_ids")  # PP stage 0 (and MTP stages) only
LAST_STAGE = ("labels", "loss_mask")  # the last PP stage only


def check_stage_fields(batch: dict, pp_rank: int, pp: int) -> None:
    """Megatron's pipeline field ownership: the first stage tokens and positions, the last labels and loss mask,
    the middle stages only the THD metadata (the others are None)."""
    for names, owned in ((FIRST_STAGE, pp_rank == 0), (LAST_STAGE, pp_rank == pp - 1)):
        assert all((batch[name] is not None) == owned for name in names), (pp_rank, names)


def thd_metadata(batch: dict) -> dict:
    return {name: batch[name] for name in ("cu", "cu_dtype", "max_seqlen", "format", "local_cp_size")}


def check_real_lengths(runs, batch: dict, step: int, m: int, sequence_lengths: Counter) -> None:
    """``cu_seqlens_q`` counts each packed sequence's real tokens: the lengths of the sequences whose tokens the CP
    group holds, plus at most one padding sequence at the tail."""
    group = [runs[member]["steps"][step]["micro_batches"][m]["tokens"][0] for member in batch["cp_group"]]
    held = {(token - 1) // OFFSETS for tokens in group for token in tokens if token}
    real = Counter(np.diff(batch["cu"][0]).tolist())
    wanted = Counter(sequence_lengths[sequence] for sequence in held)
    assert not wanted - real, f"real lengths {sorted(real.elements())} lack {sorted((wanted - real).elements())}"
    assert real.total() - wanted.total() <= 1, "at most one tail padding sequence"


def without_groups(batch: dict) -> dict:
    return {name: value for name, value in batch.items() if name not in ("cp_group", "tp_cp_group")}


def check_micro_batch(batch: dict, config: dict, tp: int, allowed, rank: int) -> None:
    c = batch["local_cp_size"]
    assert c in allowed, f"CP size {c} is not one of the configured {allowed}"
    assert len(batch["cp_group"]) == c
    local = len(batch["tokens"][0])
    if config.get("pad_packed_seq_alignment") == "max":
        assert local == MAX_SEQLEN
    else:
        assert local % effective_alignment(config, c, tp) == 0 and local <= MAX_SEQLEN
    assert batch["format"] == "thd" and batch["cu_dtype"] == "torch.int32"
    real, kv_real, bounds, kv_padded = batch["cu"]  # cu_seqlens_q/kv count real tokens, *_padded the layout
    assert kv_real == real and kv_padded == bounds and bounds[0] == 0 and bounds[-1] == c * local
    lengths = np.diff(bounds)
    assert (lengths > 0).all() and batch["max_seqlen"] == [int(lengths.max())] * 2, "max_seqlen: the padded maximum"
    real_lengths = np.diff(real)
    assert len(real) == len(bounds) and (real_lengths >= 1).all() and (real_lengths <= lengths).all()
    if c > 1:
        assert (lengths % (2 * c) == 0).all()
    members = sorted(batch["cp_group"])
    assert batch["position_ids"][0] == zigzag_positions(bounds, c, members.index(rank)), "zigzag_thd by position"
    for token, label, mask, place in zip(
        batch["tokens"][0], batch["labels"][0], batch["loss_mask"][0], batch["position_ids"][0], strict=True
    ):
        assert mask == float(label != IGNORE_INDEX)
        if token:
            assert place == (token - 1) % OFFSETS, "a token sits at its own offset within its sequence"
        else:
            assert label == IGNORE_INDEX
    if config.get("sequence_parallel"):
        assert batch["tp_cp_group"] is not None and len(batch["tp_cp_group"]) == c * tp
        assert set(batch["cp_group"]) <= set(batch["tp_cp_group"])


def check_groups_hold_one_micro_batch(runs, places, step: int, cp: int) -> None:
    """The ranks of one CP group hold the same boundaries, and groups are aligned blocks of positions."""
    for run in runs:
        for m, batch in enumerate(run["steps"][step]["micro_batches"]):
            for other in batch["cp_group"]:
                assert runs[other]["steps"][step]["micro_batches"][m]["cu"] == batch["cu"]
            positions = sorted(places[other][4] for other in batch["cp_group"])
            c = len(positions)
            assert positions == list(range(positions[0], positions[0] + c)) and positions[0] % c == 0


# -- the grids -----------------------------------------------------------------------------------------------------

BASE = {"seed": 11, "steps": 2, "num_microbatches": 3, "longest": 2 * MAX_SEQLEN - 8}
SMALL = {"seed": 1, "steps": 1, "num_microbatches": 2, "longest": 20}
DYNAMIC_BASE = BASE | {"longest": 3 * MAX_SEQLEN}

GRIDS = {
    "dp2_cp2": {
        "world_size": 4,
        "shape": (2, 2),
        "names": ("dp", "cp"),
        "sizes": (1, 2, 4),
        "dims": {"dp": 2, "cp": 2, "tp": 1},
        "cases": {
            "dp_balanced": BASE | {"config": {"scheduler": "dp_balanced", "pad_packed_seq_alignment": 8}},
            "dp_balanced_vpp": BASE
            | {"config": {"scheduler": "dp_balanced", "vpp_size": 2, "microbatch_group_size_per_vp_stage": 2}},
            "dynamic_cp": DYNAMIC_BASE | {"seed": 12, "config": {"scheduler": "dynamic_cp"}},
            "compute_balanced": BASE
            | {"seed": 13, "config": {"scheduler": "compute_balanced", "pad_packed_seq_alignment": "max"}},
        },
        "errors": {
            "zero_spans": SMALL | {"items": "zero_spans", "config": {}},
            "bad_on_1": SMALL | {"items": "bad_on_1", "config": {}},
            "oversize": SMALL | {"items": "oversize", "config": {}},
            "no_dynamic_groups": SMALL | {"items": "normal", "groups": "static", "config": {"scheduler": "dynamic_cp"}},
            "zero_microbatches": SMALL | {"items": "normal", "config": {}, "num_microbatches": 0},
            "other_microbatches": SMALL
            | {"items": "normal", "config": {}, "microbatches_by_position": {"2": 3, "3": 3}},
            "other_limit": SMALL
            | {"items": "normal", "config": {}, "config_by_position": {"3": {"max_seqlen_per_dp_cp_rank": 128}}},
        },
        "extra": True,
    },
    "dp2_cp2_tp2": {
        "world_size": 8,
        "shape": (2, 2, 2),
        "names": ("dp", "cp", "tp"),
        "sizes": (1, 2, 4),
        "dims": {"dp": 2, "cp": 2, "tp": 2},
        "cases": {
            "dp_balanced_sp": BASE
            | {
                "seed": 21,
                "config": {"scheduler": "dp_balanced", "sequence_parallel": True, "pad_packed_seq_alignment": 4},
            },
            "dynamic_cp_sp": DYNAMIC_BASE
            | {"seed": 22, "config": {"scheduler": "dynamic_cp", "sequence_parallel": True}},
            "compute_balanced_mxfp8": BASE
            | {"seed": 23, "config": {"scheduler": "compute_balanced", "mxfp8": True, "sequence_parallel": True}},
        },
        "errors": {"zero_spans": SMALL | {"items": "zero_spans", "config": {}}},
    },
    "dp3": {
        "world_size": 3,
        "shape": (3,),
        "names": ("dp",),
        "sizes": (1, 3),
        "dims": {"dp": 3, "cp": 1, "tp": 1},
        "cases": {
            # DP rank 2 never has data; DP rank 1 fetches 3, then 1, then no micro-batch
            name: BASE
            | {
                "seed": 30 + i,
                "steps": 3,
                "total": {"1": 4, "2": 0},
                "longest": MAX_SEQLEN if name != "dynamic_cp" else 3 * MAX_SEQLEN,
                "config": {"scheduler": name},
            }
            for i, name in enumerate(("dp_balanced", "dynamic_cp", "compute_balanced"))
        },
        "errors": {"zero_spans": SMALL | {"items": "zero_spans", "config": {}}},
    },
    "cp2_pp2": {
        "world_size": 4,
        "shape": (2, 2),
        "names": ("pp", "cp"),
        "sizes": (1, 2),
        "dims": {"dp": 1, "cp": 2, "tp": 1, "pp": 2},
        "cases": {
            "dp_balanced": BASE | {"seed": 41, "config": {"scheduler": "dp_balanced"}},
            "dp_balanced_vpp": BASE | {"seed": 43, "config": {"scheduler": "dp_balanced", "vpp_size": 2}},
            "dynamic_cp": DYNAMIC_BASE | {"seed": 42, "longest": 2 * MAX_SEQLEN, "config": {"scheduler": "dynamic_cp"}},
        },
        "errors": {
            "zero_spans": SMALL | {"items": "zero_spans", "config": {}},
            "other_scheduler": SMALL
            | {"items": "normal", "config": {}, "config_by_position": {"1": {"scheduler": "compute_balanced"}}},
        },
    },
    "dp2_tp2_pp2": {
        "world_size": 8,
        "shape": (2, 2, 2),
        "names": ("pp", "dp", "tp"),
        "sizes": (1, 2),
        "dims": {"dp": 2, "cp": 1, "tp": 2, "pp": 2},
        "cases": {
            "dp_balanced_vpp": BASE
            | {
                "seed": 51,
                "longest": MAX_SEQLEN - 4,
                "config": {"scheduler": "dp_balanced", "vpp_size": 2, "microbatch_group_size_per_vp_stage": 2},
            },
            "dynamic_cp_sp": BASE | {"seed": 52, "config": {"scheduler": "dynamic_cp", "sequence_parallel": True}},
        },
        "errors": {"zero_spans": SMALL | {"items": "zero_spans", "config": {}}},
    },
}


def run_grid(tmp_path, grid: dict) -> list[dict]:
    worker = functools.partial(
        grid_worker,
        shape=grid["shape"],
        names=grid["names"],
        sizes=grid["sizes"],
        cases=grid["cases"],
        errors=grid["errors"],
        extra=grid.get("extra", False),
    )
    found = launch(worker, tmp_path, world_size=grid["world_size"])
    assert [report.get("error") for report in found] == [None] * grid["world_size"]
    return [report["value"] | {"rank": report["rank"]} for report in found]


@pytest.fixture(scope="module")
def dp2_cp2(tmp_path_factory):
    return run_grid(tmp_path_factory.mktemp("dp2_cp2"), GRIDS["dp2_cp2"])


@pytest.mark.parametrize("name", list(GRIDS["dp2_cp2"]["cases"]))
def test_dp2_cp2_every_token_once_aligned_and_equal_counts(dp2_cp2, name):
    grid = GRIDS["dp2_cp2"]
    allowed = grid["sizes"] if name.startswith("dynamic") else (grid["dims"]["cp"],)
    check_case(dp2_cp2, name, grid["cases"][name], grid["dims"], allowed)


@pytest.fixture(scope="module")
def dp2_cp2_tp2(tmp_path_factory):
    return run_grid(tmp_path_factory.mktemp("dp2_cp2_tp2"), GRIDS["dp2_cp2_tp2"])


@pytest.fixture(scope="module")
def dp3(tmp_path_factory):
    return run_grid(tmp_path_factory.mktemp("dp3"), GRIDS["dp3"])


@pytest.fixture(scope="module")
def cp2_pp2(tmp_path_factory):
    return run_grid(tmp_path_factory.mktemp("cp2_pp2"), GRIDS["cp2_pp2"])


@pytest.mark.parametrize("name", list(GRIDS["dp2_cp2_tp2"]["cases"]))
def test_dp2_cp2_tp2_tp_peers_get_identical_micro_batches(dp2_cp2_tp2, name):
    grid = GRIDS["dp2_cp2_tp2"]
    allowed = grid["sizes"] if name.startswith("dynamic") else (grid["dims"]["cp"],)
    check_case(dp2_cp2_tp2, name, grid["cases"][name], grid["dims"], allowed)


@pytest.mark.parametrize("name", list(GRIDS["dp3"]["cases"]))
def test_dp3_a_rank_without_data_still_gets_work(dp3, name):
    grid = GRIDS["dp3"]
    allowed = grid["sizes"] if name.startswith("dynamic") else (1,)
    check_case(dp3, name, grid["cases"][name], grid["dims"], allowed)
    for step in range(grid["cases"][name]["steps"]):
        batches = dp3[2][name]["steps"][step]["micro_batches"]
        assert any(token for batch in batches for token in batch["tokens"][0]), "DP rank 2 fetched nothing yet works"


@pytest.fixture(scope="module")
def dp2_tp2_pp2(tmp_path_factory):
    return run_grid(tmp_path_factory.mktemp("dp2_tp2_pp2"), GRIDS["dp2_tp2_pp2"])


@pytest.mark.parametrize("name", list(GRIDS["dp2_tp2_pp2"]["cases"]))
def test_dp2_tp2_pp2_stages_own_their_fields_with_vpp_and_dynamic_cp(dp2_tp2_pp2, name):
    """Eight processes: TP peers identical, the first stage tokens and positions, the last labels and loss mask,
    every valid token once; VPP micro-batch counts a multiple of the stage group, dynamic CP over DP ranks."""
    grid = GRIDS["dp2_tp2_pp2"]
    allowed = grid["sizes"] if name.startswith("dynamic") else (1,)
    check_case(dp2_tp2_pp2, name, grid["cases"][name], grid["dims"], allowed)


@pytest.mark.parametrize("name", list(GRIDS["cp2_pp2"]["cases"]))
def test_cp2_pp2_every_stage_gets_the_same_micro_batches(cp2_pp2, name):
    grid = GRIDS["cp2_pp2"]
    allowed = grid["sizes"] if name.startswith("dynamic") else (grid["dims"]["cp"],)
    check_case(cp2_pp2, name, grid["cases"][name], grid["dims"], allowed)


ALL_GRIDS = ("dp2_cp2", "dp2_cp2_tp2", "dp3", "cp2_pp2", "dp2_tp2_pp2")


@pytest.mark.parametrize("grid", ALL_GRIDS)
def test_parallel_batch_and_the_megatron_views_deliver_the_same_micro_batches(request, grid):
    """``ParallelBatch.schedule`` iterated directly gives, rank by rank, exactly what ``wrap_data_iterator`` and
    ``get_batch_on_this_rank_for_sequence_packing`` give for the same input."""
    for report in request.getfixturevalue(grid):
        for name in GRIDS[grid]["cases"]:
            views = report[name]
            direct = report[f"{name}@stage"]
            assert direct["stopped"] and views["stopped"]
            steps = [{key: value for key, value in step.items() if key != "after"} for step in views["steps"]]
            assert direct["steps"] == steps, (grid, name, report["place"])


@pytest.mark.parametrize("grid", ALL_GRIDS)
def test_evaluation_ends_on_every_rank_at_once_and_can_run_again(request, grid):
    """One wrap_data_iterator call per evaluation iteration; when the data ends, StopIteration reaches every DP
    rank, TP peer and PP stage in the same call, and a second evaluation over fresh iterators delivers the same."""
    reports = request.getfixturevalue(grid)
    first = next(iter(GRIDS[grid]["cases"]))
    for report in reports:
        passes = report["evaluation"]
        assert all(run["stopped"] for run in passes)
        assert passes[0] == passes[1] == report[first]
    assert len({len(report["evaluation"][0]["steps"]) for report in reports}) == 1


def test_a_zero_length_span_fails_alike_on_every_rank(dp2_cp2, dp2_cp2_tp2, dp3, cp2_pp2, dp2_tp2_pp2):
    """Every data rank raises its own reader's error; its TP peers and PP stages raise the same type, naming it."""
    for reports in (dp2_cp2, dp2_cp2_tp2, dp3, cp2_pp2, dp2_tp2_pp2):
        for report in reports:
            kind, message = report["zero_spans"]["error"]
            assert kind == "DataFileError" and "it must strictly increase (no empty sequence)" in message
            if report["place"][2] or report["place"][3]:  # a TP peer or a later PP stage
                assert "(the data rank) failed to schedule the step" in message


def test_a_malformed_micro_batch_fails_on_every_rank_naming_the_dp_rank(dp2_cp2):
    for report in dp2_cp2:
        kind, message = report["bad_on_1"]["error"]
        assert kind == "DataFileError"
        if report["place"][0] == 1:
            assert "micro-batch 0 of this step is a dict; the packing scheduler takes Batches" in message
            assert "indexed_batch" in message
        else:
            assert "DP rank 1 failed to read its micro-batches" in message


@pytest.mark.parametrize(
    ("grid", "case", "expected"),
    [
        ("dp2_cp2", "other_microbatches", "schedule.num_microbatches: ranks 0-1 have 2, ranks 2-3 have 3"),
        ("dp2_cp2", "other_limit", "packing_scheduler.max_seqlen_per_dp_cp_rank: ranks 0-2 have 64, rank 3 has 128"),
        ("cp2_pp2", "other_scheduler", "packing_scheduler.scheduler: rank 0 has 'dp_balanced', rank 1 has "
         "'compute_balanced'"),
    ],
)  # fmt: skip
def test_ranks_that_disagree_raise_the_same_error_everywhere_before_delivering(request, grid, case, expected):
    """A rank of the DP x CP domain with another num_microbatches or scheduler field fails the step on every rank
    (TP peers and PP stages included), naming the field and each global rank's value, instead of hanging. In these
    grids the global ranks of PP stage 0's DP x CP domain are its positions, ``dp_rank * cp_size + cp_rank``."""
    rule = (
        "the ranks disagree on the packing scheduler's settings (every DP x CP rank of a step must schedule with "
        "the same PackingSchedulerConfig and num_microbatches): "
    )
    for report in request.getfixturevalue(grid):
        kind, message = report[case]["error"]
        assert kind == "DataConfigError" and f"{rule}{expected}. Every rank must shape the same batches" in message


def test_a_sequence_too_long_for_every_cp_size_fails_on_every_rank(dp2_cp2):
    errors = {tuple(report["oversize"]["error"]) for report in dp2_cp2}
    assert len(errors) == 1 and next(iter(errors))[0] == "DataConfigError"
    assert "max_seqlen_per_dp_cp_rank" in next(iter(errors))[1]


def test_validation_fails_before_any_data_is_read(dp2_cp2):
    for report in dp2_cp2:
        assert report["no_dynamic_groups"]["reads"] == 0 and report["zero_microbatches"]["reads"] == 0
        assert report["no_dynamic_groups"]["error"][0] == "DataConfigError"
        assert "pg_collection.dynamic_cp, which is empty" in report["no_dynamic_groups"]["error"][1]
        assert report["zero_microbatches"]["error"] == [
            "DataConfigError",
            "num_microbatches must be an integer >= 1, got 0",
        ]


def test_get_batch_on_this_cp_rank_cuts_the_static_group_and_honours_hybrid_cp_group(dp2_cp2):
    # sequences [0, 8) and [8, 12) in 4 chunks each: CP rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    expected = {0: [0, 1, 6, 7, 8, 11], 1: [2, 3, 4, 5, 9, 10]}
    for report in dp2_cp2:
        cut = report["cp_slice"]
        assert cut["static"] == cut["legacy"] == [expected[report["place"][1]]]
        assert cut["labels"] == [[t + 100 for t in expected[report["place"][1]]]] and cut["cu"] == [0, 8, 12]
        assert [message.split(";")[0] for message in cut["legacy_warnings"]] == [
            "the batch key hybrid_cp_group is deprecated"
        ]


# -- one process: keywords and validation --------------------------------------------------------------------------


def test_the_deprecated_keywords_stay_in_the_signatures():
    for function in (get_batch_on_this_cp_rank, get_batch_on_this_rank_for_sequence_packing):
        parameters = inspect.signature(function).parameters
        for name in ("dynamic_cp", "dynamic_cp_group_func", "is_hybrid_cp", "hybrid_cp_group_func"):
            assert name in parameters
    assert list(inspect.signature(get_batch_on_this_cp_rank).parameters)[:2] == ["batch", "cp_group"]


def one_rank_batch() -> dict:
    return {
        "tokens": torch.arange(1, 5)[None],
        "labels": torch.arange(1, 5)[None],
        "cu_seq_lens": torch.tensor([0, 4], dtype=torch.int32),
        "local_cp_size": torch.tensor([1]),
    }


def test_is_hybrid_cp_warns_and_means_dynamic_cp():
    with pytest.warns(DeprecationWarning, match="is_hybrid_cp is deprecated; use dynamic_cp"):
        cut = get_batch_on_this_cp_rank(one_rank_batch(), is_hybrid_cp=True, dynamic_cp_group_func=lambda size: None)
    assert cut["tokens"].tolist() == [[1, 2, 3, 4]]
    with pytest.warns(DeprecationWarning, match="hybrid_cp_group_func is deprecated; use dynamic_cp_group_func"):
        get_batch_on_this_cp_rank(one_rank_batch(), dynamic_cp=True, hybrid_cp_group_func=lambda size: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_batch_on_this_cp_rank(one_rank_batch(), dynamic_cp=True, dynamic_cp_group_func=lambda size: None)


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"dynamic_cp": True, "is_hybrid_cp": False}, "is_hybrid_cp=False and dynamic_cp=True contradict"),
        ({"dynamic_cp_group_func": len, "hybrid_cp_group_func": abs}, "hybrid_cp_group_func=.* contradict"),
        ({"dynamic_cp": "yes"}, "dynamic_cp must be true or false"),
    ],
)
def test_conflicting_keywords_raise_before_reading(keywords, message):
    read = []

    def never():
        read.append(1)
        yield one_rank_batch()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(DataConfigError, match=message):
            get_batch_on_this_rank_for_sequence_packing(never(), pg_collection=ProcessGroupCollection(), **keywords)
        with pytest.raises(DataConfigError, match=message):
            get_batch_on_this_cp_rank(one_rank_batch(), **keywords)
    assert read == []


def test_dynamic_cp_without_a_group_function_or_size_is_refused():
    with pytest.raises(DataConfigError, match="pass dynamic_cp_group_func"):
        get_batch_on_this_cp_rank(one_rank_batch(), dynamic_cp=True)
    batch = one_rank_batch()
    del batch["local_cp_size"]
    with pytest.raises(DataFileError, match="the batch has no local_cp_size"):
        get_batch_on_this_cp_rank(batch, dynamic_cp=True, dynamic_cp_group_func=lambda size: None)


def test_one_process_runs_a_whole_step_and_stops_at_the_end():
    config = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=MAX_SEQLEN)
    case = SMALL | {"steps": 1}
    iterator, count, stats = wrap_data_iterator(loader(case, 0), config, 2, pg_collection=ProcessGroupCollection())
    tokens = []
    for _ in range(count):
        batch = get_batch_on_this_rank_for_sequence_packing(iterator, pg_collection=ProcessGroupCollection())
        tokens += [t for t in batch["tokens"][0].tolist() if t]
        assert batch["packed_seq_params"].local_cp_size == 1 and batch["packed_seq_params"].cp_group is None
    assert sorted(tokens) == sorted(expected_tokens(case, 1, 0)) and stats.num_micro_batches == count
    exhausted = loader(case, 0)
    list(exhausted)
    with pytest.raises(StopIteration):
        wrap_data_iterator(exhausted, config, 2, pg_collection=ProcessGroupCollection())
