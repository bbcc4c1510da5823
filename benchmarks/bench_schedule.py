"""The packing scheduler on one SFT-like step: packing efficiency, per-rank cost balance, and scheduling time.

* **Input.** One step's sequence lengths, seeded lognormal (median 1,536 tokens, sigma 1.2, clipped to
  ``[16, 131072]``: a long tail past 64k), as many as fill 97% of ``NUM_MICROBATCHES * R * capacity`` tokens (so
  well-filled micro-batches hold the step in ``NUM_MICROBATCHES``), where
  ``R = 8`` DP x CP ranks and ``capacity`` is 128k tokens per rank (32k with ``--quick``).
* **Ours.** ``build_schedule`` then ``schedule_stats`` (what every rank computes per step, communication aside) for
  ``dp_balanced`` and ``compute_balanced`` (static DP4 x CP2) and ``dynamic_cp`` (sizes 1, 2, 4, 8 over the same 8
  ranks), with the default cost ``24576 L + L**2`` and alignment 1.
* **Rows.** Packing efficiency (valid tokens over the tokens the ranks hold, ``FlopsStats.packing_efficiency``)
  against a perfect 1.0; max over mean per-rank step cost (``FlopsStats.imbalance``); capacity used (valid tokens
  over ``micro-batches * R * capacity``, information: fewer, fuller micro-batches); and the scheduling time
  against reading and collating the same step with the library's online collator (``TextPackingCollator``): the
  step's tokens are generated untimed into one buffer, then each DP rank's ``NUM_MICROBATCHES`` micro-batches
  (consecutive sequences, about ``cp * capacity`` tokens each) are sliced out as samples and collated, timed.
* **The whole step on a mesh.** Four gloo processes, DP2 x CP2: each DP rank's loader yields ``NUM_MICROBATCHES``
  micro-batches of seeded lognormal sequences (``MESH_CAPACITY`` tokens per rank, 8k with ``--quick``), collated by
  ``TextPackingCollator(alignment=1)`` (the reference, timed on every rank). Ours, on every rank:
  ``ParallelBatch(attention_mode="packed", scheduler=...).schedule`` on those micro-batches (gather the lengths,
  plan, pack) and iterating the step (deliver every micro-batch). Per round the two are timed interleaved between
  barriers; a round's time is its slowest rank's, and the best round is reported. Each rank runs one intra-op
  thread (torchrun's ``OMP_NUM_THREADS=1``). The gloo floor row times, in the same rounds, the two bare all-gathers
  a step cannot do without (the step header over DP x CP, every DP rank's lengths and tokens over DP).
* **Dynamic CP against Megatron's rule.** ``MEGATRON_STEPS`` seeded lognormal steps per rank count
  (``MEGATRON_RANKS``, 4 to 64 DP x CP ranks, CP 2; median 2,048 tokens, sigma 1.0, clipped to ``[128, 32768]``;
  ``max_seqlen_per_dp_cp_rank`` 8k; as many sequences as fill ``FILL`` of ``NUM_MICROBATCHES * R * 8k`` tokens)
  go through ours (``dynamic_cp`` with cost ``L**2``, sizes the powers of two dividing ``R``) and through
  ``benchmarks.megatron_dynamic_cp`` (Megatron-LM's published rule, written from its description), both measured
  by ``schedule_quality`` (cost ``L**2 / cp`` per rank over real lengths).
"""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing

from benchmarks.common import BenchContext, Row, log, measure
from benchmarks.megatron_dynamic_cp import (
    ScheduleQuality,
    check_reference_schedule,
    megatron_dynamic_cp,
    schedule_quality,
)
from hyper_parallel.data.batching.build_collate_fn import TextPackingCollator
from hyper_parallel.data.batching.get_batch import ParallelBatch
from hyper_parallel.data.parallel.data_schedule_utils import PackingSchedulerConfig, build_schedule, schedule_stats
from hyper_parallel.data.parallel.process_groups import ProcessGroupCollection

NAME = "schedule"
TITLE = "Packing scheduler on an SFT-like step: packing efficiency, per-rank cost balance, scheduling time"

CAPACITY_FULL = 128 * 1024
CAPACITY_QUICK = 32 * 1024
NUM_MICROBATCHES = 4  # what each DP rank fetches per step
DP, CP = 4, 2
DYNAMIC_SIZES = (1, 2, 4, 8)
MEDIAN, SIGMA, SHORTEST, LONGEST = 1536, 1.2, 16, 128 * 1024
SEED = 1234
VOCAB = 50_000
FILL = 0.97  # the step's tokens against its micro-batches' capacity: a scheduler that packs well needs no more
EFFICIENCY_GOAL = 0.99
BALANCE_GOAL = 1.05
TIME_GOAL = 0.05
SCHEDULERS = ("dp_balanced", "dynamic_cp", "compute_balanced")
MEGATRON_RANKS = (4, 8, 12, 32, 64)  # DP x CP ranks of the side-by-side rows (12: not a power of two)
MEGATRON_CP = 2
MEGATRON_STEPS, MEGATRON_STEPS_QUICK = 8, 3
MEGATRON_CAPACITY = 8192
MEGATRON_MEDIAN, MEGATRON_SIGMA, MEGATRON_SHORTEST, MEGATRON_LONGEST = 2048, 1.0, 128, 32 * 1024

_NOTE_EFFICIENCY = (
    "FlopsStats.packing_efficiency: valid tokens over the tokens the ranks hold (each group's local packed length "
    "times its CP size, summed over micro-batches: zigzag padding to 2*cp per sequence and alignment), against 1.0"
)
_NOTE_BALANCE = (
    "FlopsStats: the most loaded rank's step cost (each group's 24576 L + L^2 over its padded lengths, divided by its "
    "CP size, summed over the step's micro-batches) against the mean rank's; ratio = imbalance"
)
_NOTE_CAPACITY = (
    "valid tokens against micro-batches x 8 ranks x max_seqlen_per_dp_cp_rank: how full the micro-batches are "
    "(information; fewer micro-batches for the same data is better)"
)
_NOTE_TIME = (
    "ms of build_schedule + schedule_stats for the step (every rank runs both; the all-gather of lengths is not "
    "included), best of the run's repeats; reference: slicing the step's sequences out of one token buffer as "
    "samples and collating them with TextPackingCollator (zigzag padding to 2*cp, alignment 2*cp) into the DP "
    "ranks' micro-batches of the step (token generation untimed, no tokenizing); each DP rank collates only its "
    "quarter of that in parallel, so against one rank's collation the ratio is 4x"
)


MESH_SHAPE, MESH_SIZES = (2, 2), (1, 2, 4)  # DP x CP of the mesh rows, and its dynamic CP sizes
MESH_CAPACITY, MESH_CAPACITY_QUICK = 32 * 1024, 8 * 1024
MESH_GOAL = 0.3
MESH_TIMEOUT = timedelta(seconds=300)  # a rank left waiting fails the group instead of hanging the run
_NOTE_MESH = (
    "ms of one step on a 4-rank gloo mesh (DP2 x CP2), the slowest rank's, best round: ParallelBatch.schedule "
    "(the step header's all-gather, one exchange of lengths and tokens, plan, pack) and iterating the step (every "
    "micro-batch delivered, packed attention); reference: the same ranks' loaders producing the step (each "
    "collating its NUM_MICROBATCHES micro-batches with TextPackingCollator(alignment=1)), timed in the same rounds"
)

_NOTE_FLOOR = (
    "information: ms of the two bare gloo all-gathers a scheduled step cannot do without, on the same mesh, the "
    "slowest rank's, best round (the step header, 10 int64 words, over DP x CP; every DP rank's lengths and tokens, "
    "padded to the widest, over DP), against the loaders' best round of the scheduler rows: the least the mesh rows "
    "could cost with planning, packing and delivery free"
)


def _mesh_samples(dp_rank: int, capacity: int) -> list[list[dict[str, np.ndarray]]]:
    """One DP rank's micro-batches: seeded lognormal sequences filling ``FILL`` of ``cp * capacity`` each."""
    rng = np.random.default_rng([SEED, dp_rank])
    batches = []
    for _ in range(NUM_MICROBATCHES):
        lengths = np.clip(np.round(rng.lognormal(np.log(MEDIAN), SIGMA, size=256)), SHORTEST, capacity).astype(int)
        lengths = lengths[: max(1, int(np.searchsorted(np.cumsum(lengths), FILL * MESH_SHAPE[1] * capacity)))]
        ids = [rng.integers(0, VOCAB, size=n, dtype=np.int64) for n in lengths]
        batches.append([{"input_ids": tokens, "labels": tokens} for tokens in ids])
    return batches


def _mesh_rank(rank: int, world_size: int, port: int, capacity: int, repeats: int, report: str) -> None:
    """One rank of the mesh rows: interleaved rounds of the loaders' collation and the scheduled step."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1: four ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=MESH_TIMEOUT)  # fmt: skip
    try:
        mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=("dp", "cp"))
        groups = ProcessGroupCollection.from_mesh(mesh, MESH_SIZES)
        collate = TextPackingCollator(alignment=1)
        samples = _mesh_samples(groups.dp_rank, capacity)
        floor = _FloorGathers(groups, capacity)
        times: dict[str, list[list[float]]] = {}
        for _ in range(repeats):
            dist.barrier()
            begun = time.perf_counter()
            floor.run()
            times.setdefault("floor", []).append([time.perf_counter() - begun])
            for name in SCHEDULERS:
                config = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=capacity, scheduler=name)
                stage = ParallelBatch(attention_mode="packed", scheduler=config, pg_collection=groups)
                dist.barrier()
                start = time.perf_counter()
                batches = [collate(batch) for batch in samples]
                produced = time.perf_counter()
                dist.barrier()
                begun = time.perf_counter()
                step = stage.schedule(iter(batches), NUM_MICROBATCHES)
                delivered = sum(int((loss["loss_mask"] > 0).sum()) for _, loss in step)
                done = time.perf_counter()
                times.setdefault(name, []).append([produced - start, done - begun, delivered])
        gathered = [None] * world_size
        dist.all_gather_object(gathered, times)
        if rank == 0:
            Path(report).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


class _FloorGathers:
    """The bare collectives one scheduled step cannot do without, on the same groups: an all-gather of the step
    header (10 int64 words) over DP x CP, then one of every DP rank's lengths and tokens (its words padded to the
    widest rank's) over DP."""

    def __init__(self, groups: ProcessGroupCollection, capacity: int) -> None:
        words = [
            sum(len(batch) + 2 * sum(len(sample["input_ids"]) for sample in batch) for batch in batches)
            for batches in (_mesh_samples(dp_rank, capacity) for dp_rank in range(MESH_SHAPE[0]))
        ]
        self.groups = groups
        self.header, self.headers = (
            torch.zeros(10, dtype=torch.int64),
            torch.empty(MESH_SHAPE[0] * MESH_SHAPE[1], 10, dtype=torch.int64),
        )
        self.payload = torch.zeros(max(words), dtype=torch.int64)
        self.payloads = torch.empty(MESH_SHAPE[0], max(words), dtype=torch.int64)

    def run(self) -> None:
        dist.all_gather(list(self.headers.unbind(0)), self.header, group=self.groups.dp_cp)
        dist.all_gather(list(self.payloads.unbind(0)), self.payload, group=self.groups.dp)


def mesh_rows(context: BenchContext) -> list[Row]:
    """The scheduler's whole step on the 4-rank mesh against the loaders producing it, per scheduler."""
    capacity = MESH_CAPACITY_QUICK if context.quick else MESH_CAPACITY
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    report = context.workdir / "mesh.json"
    world_size = MESH_SHAPE[0] * MESH_SHAPE[1]
    log(f"mesh DP{MESH_SHAPE[0]} x CP{MESH_SHAPE[1]}: {world_size} gloo processes, {capacity:,} tokens per rank")
    torch.multiprocessing.start_processes(_mesh_rank, (world_size, port, capacity, context.repeats, str(report)),
                                          nprocs=world_size, start_method="spawn")  # fmt: skip
    ranks = json.loads(report.read_text())
    expected = sum(int(np.sum(b["labels"] >= 0)) for d in range(MESH_SHAPE[0]) for batch in
                   _mesh_samples(d, capacity) for b in batch)  # fmt: skip
    rows = []
    loaders = min(
        max(entry[0] for entry in round_)
        for name in SCHEDULERS
        for round_ in zip(*(rank[name] for rank in ranks), strict=True)
    )
    floor = min(max(entry[0] for entry in round_) for round_ in zip(*(rank["floor"] for rank in ranks), strict=True))
    for name in SCHEDULERS:
        rounds = list(zip(*(rank[name] for rank in ranks), strict=True))
        delivered = {sum(entry[2] for entry in round_) for round_ in rounds}
        assert delivered == {expected}, f"{name}: the mesh delivered {delivered} loss tokens, not {expected}"
        reference = min(max(entry[0] for entry in round_) for round_ in rounds)
        ours = min(max(entry[1] for entry in round_) for round_ in rounds)
        label = f"{name} DP2 x CP2 mesh {capacity // 1024}k/rank: schedule + deliver vs loaders"
        rows.append(Row.compare(label, ours * 1e3, reference * 1e3, "ms", MESH_GOAL, _NOTE_MESH, False))
    label = f"gloo floor DP2 x CP2 mesh {capacity // 1024}k/rank: bare step all-gathers vs loaders"
    rows.append(Row.compare(label, floor * 1e3, loaders * 1e3, "ms", None, _NOTE_FLOOR, False))
    return rows


_NOTE_MEGATRON_BALANCE = (
    "schedule_quality over the steps: the most loaded rank's step cost (sum of L^2 / cp over real lengths) over "
    "the mean rank's, averaged over the steps; reference: Megatron-LM's dynamic-CP rule (benchmarks/"
    "megatron_dynamic_cp.py: longest first, power-of-two sizes, cost L^2/cp, cap 1.05 x tallest x mslpr, empty "
    "ranks filled by growing groups) on the same lengths"
)
_NOTE_MEGATRON_CRITICAL = (
    "schedule_quality: per step, the sum over micro-batches of the most loaded rank's cost (a step whose "
    "micro-batches each wait for their slowest rank), summed over the steps, in units of L^2 / 1e9 (information)"
)
_NOTE_MEGATRON_COUNT = "micro-batches over the steps, ours against Megatron's rule (information; fewer is better)"
_NOTE_MEGATRON_EMPTY = (
    "groups (and micro-batches) that hold at least one sequence, as a fraction of all, over the steps; the row "
    "name gives the counts of padding-only groups and of micro-batches empty on every rank, ours vs reference; "
    "goal: never more empty ones than Megatron's rule"
)


def megatron_lengths(ranks: int, seed: int) -> np.ndarray:
    """One side-by-side step: seeded lognormal lengths filling ``FILL`` of the step's micro-batches."""
    rng = np.random.default_rng(seed)
    target = FILL * NUM_MICROBATCHES * ranks * MEGATRON_CAPACITY
    more = rng.lognormal(np.log(MEGATRON_MEDIAN), MEGATRON_SIGMA, size=int(4 * target / MEGATRON_MEDIAN) + 16)
    lengths = np.clip(np.round(more), MEGATRON_SHORTEST, MEGATRON_LONGEST).astype(np.int64)
    return lengths[: max(ranks, int(np.searchsorted(np.cumsum(lengths), target, side="right")))]


def ours_dynamic_cp(lengths: np.ndarray, ranks: int) -> ScheduleQuality:
    """Our ``dynamic_cp`` schedule of one step with cost ``L**2``, measured by ``schedule_quality``."""
    config = PackingSchedulerConfig(
        max_seqlen_per_dp_cp_rank=MEGATRON_CAPACITY, scheduler="dynamic_cp", cost_linear=0, cost_quadratic=1
    )
    sizes = [1 << k for k in range(ranks.bit_length()) if ranks % (1 << k) == 0]
    built = build_schedule(
        config,
        lengths,
        layout=config.layout(cp_size=MEGATRON_CP, tp_size=1),
        dp_size=ranks // MEGATRON_CP,
        dynamic_cp_sizes=sizes,
    )
    return schedule_quality(built.micro_batches, lengths, ranks=ranks)


def megatron_reference(lengths: np.ndarray, ranks: int) -> ScheduleQuality:
    """Megatron's dynamic-CP rule on one step, its invariants checked, measured by ``schedule_quality``."""
    micro_batches = megatron_dynamic_cp(lengths, ranks=ranks, max_seqlen_per_rank=MEGATRON_CAPACITY)
    check_reference_schedule(micro_batches, lengths, ranks=ranks, max_seqlen_per_rank=MEGATRON_CAPACITY)
    return schedule_quality(micro_batches, lengths, ranks=ranks)


def megatron_rows(steps: int) -> list[Row]:
    """The side-by-side rows: ours against Megatron's dynamic-CP rule on the same steps, per rank count."""
    rows = []
    for ranks in MEGATRON_RANKS:
        ours, reference = [], []
        for step in range(steps):
            lengths = megatron_lengths(ranks, SEED + 100 * ranks + step)
            ours.append(ours_dynamic_cp(lengths, ranks))
            reference.append(megatron_reference(lengths, ranks))
        rows.extend(_megatron_rank_rows(ranks, ours, reference))
    return rows


def _megatron_rank_rows(ranks: int, ours: list[ScheduleQuality], reference: list[ScheduleQuality]) -> list[Row]:
    def total(qualities, name):
        return sum(getattr(quality, name) for quality in qualities)

    def filled(qualities, empty, count):
        return 1.0 - total(qualities, empty) / total(qualities, count)

    prefix = f"dynamic_cp vs Megatron {ranks} ranks ({len(ours)} steps)"
    empty = {name: (total(ours, name), total(reference, name)) for name in ("empty_groups", "empty_micro_batches")}
    log(f"{prefix}: empty groups {empty['empty_groups']}, empty micro-batches {empty['empty_micro_batches']}")
    return [
        Row.compare(
            f"{prefix}: max / mean rank cost",
            float(np.mean([q.imbalance for q in ours])),
            float(np.mean([q.imbalance for q in reference])),
            "max/mean",
            1.0,
            _NOTE_MEGATRON_BALANCE,
            higher_is_better=False,
        ),
        Row.compare(
            f"{prefix}: critical path",
            total(ours, "critical_path") / 1e9,
            total(reference, "critical_path") / 1e9,
            "GL^2",
            None,
            _NOTE_MEGATRON_CRITICAL,
            higher_is_better=False,
        ),
        Row.compare(
            f"{prefix}: micro-batches",
            total(ours, "num_micro_batches"),
            total(reference, "num_micro_batches"),
            "count",
            None,
            _NOTE_MEGATRON_COUNT,
            higher_is_better=False,
        ),
        Row.compare(
            f"{prefix}: groups with a sequence (empty: {empty['empty_groups'][0]} vs {empty['empty_groups'][1]})",
            filled(ours, "empty_groups", "num_groups"),
            filled(reference, "empty_groups", "num_groups"),
            "fraction",
            1.0,
            _NOTE_MEGATRON_EMPTY,
        ),
        Row.compare(
            f"{prefix}: micro-batches with a sequence (empty: {empty['empty_micro_batches'][0]} vs "
            f"{empty['empty_micro_batches'][1]})",
            filled(ours, "empty_micro_batches", "num_micro_batches"),
            filled(reference, "empty_micro_batches", "num_micro_batches"),
            "fraction",
            1.0,
            _NOTE_MEGATRON_EMPTY,
        ),
    ]


def step_lengths(capacity: int) -> np.ndarray:
    """Seeded lognormal lengths filling ``FILL`` of ``NUM_MICROBATCHES * R * capacity`` tokens."""
    rng = np.random.default_rng(SEED)
    target = NUM_MICROBATCHES * DP * CP * capacity
    lengths = np.zeros(0, dtype=np.int64)
    while lengths.sum() < target:
        more = rng.lognormal(np.log(MEDIAN), SIGMA, size=4096)
        lengths = np.concatenate([lengths, np.clip(np.round(more), SHORTEST, LONGEST).astype(np.int64)])
    return lengths[: int(np.searchsorted(np.cumsum(lengths), FILL * target, side="right"))]


def collate_step(lengths: np.ndarray, tokens: np.ndarray, labels: np.ndarray, capacity: int):
    """The reference: every DP rank's micro-batches of the step, read from the buffers and collated."""
    collate = TextPackingCollator(alignment=2 * CP, pad_each_sequence_to=2 * CP)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    cuts = np.searchsorted(ends, np.arange(1, NUM_MICROBATCHES * DP) * CP * capacity)
    batches = []
    for first, stop in zip(np.r_[0, cuts], np.r_[cuts, len(lengths)], strict=True):
        samples = [
            {"input_ids": tokens[start:end], "labels": labels[start:end]}
            for start, end in zip(starts[first:stop].tolist(), ends[first:stop].tolist(), strict=True)
        ]
        if samples:
            batches.append(collate(samples))
    return batches


def run(context: BenchContext) -> list[Row]:
    capacity = CAPACITY_QUICK if context.quick else CAPACITY_FULL
    lengths = step_lengths(capacity)
    log(
        f"{len(lengths)} sequences, {int(lengths.sum()):,} tokens (median {int(np.median(lengths))}, longest "
        f"{int(lengths.max())}), {DP * CP} ranks of {capacity:,} tokens"
    )
    rng = np.random.default_rng(SEED + 1)
    tokens = rng.integers(0, VOCAB, size=int(lengths.sum()), dtype=np.int64)
    labels = tokens.copy()

    configs = {name: PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=capacity, scheduler=name) for name in SCHEDULERS}
    sizes = {"dynamic_cp": DYNAMIC_SIZES}

    def schedule(name: str):
        layout = configs[name].layout(cp_size=CP, tp_size=1)
        built = build_schedule(configs[name], lengths, layout=layout, dp_size=DP, dynamic_cp_sizes=sizes.get(name, ()))
        return built, schedule_stats(built, lengths, configs[name], layout=layout)

    cases = {name: (lambda name=name: schedule(name)) for name in SCHEDULERS}
    cases["collate"] = lambda: collate_step(lengths, tokens, labels, capacity)
    timings = measure(cases, context.repeats)
    collated = collate_step(lengths, tokens, labels, capacity)
    assert sum(batch.trained_tokens for batch in collated) == int(lengths.sum())

    label = f"{capacity // 1024}k/rank"
    rows = []
    for name in SCHEDULERS:
        built, stats = schedule(name)
        assert stats.valid_tokens == int(lengths.sum())
        used = sorted({group.cp_size for groups in built.micro_batches for group in groups})
        log(f"{name}: {stats.num_micro_batches} micro-batches, CP sizes {used}")
        prefix = f"{name} {label}"
        rows.append(
            Row.compare(
                f"{prefix}: packing efficiency",
                stats.packing_efficiency,
                1.0,
                "fraction",
                EFFICIENCY_GOAL,
                _NOTE_EFFICIENCY,
            )
        )
        rows.append(
            Row.compare(
                f"{prefix}: max / mean rank cost",
                stats.max_rank_cost / 1e9,
                stats.mean_rank_cost / 1e9,
                "Gcost",
                BALANCE_GOAL if name == "compute_balanced" else None,
                _NOTE_BALANCE,
                higher_is_better=False,
            )
        )
        rows.append(
            Row.compare(
                f"{prefix}: capacity used ({stats.num_micro_batches} micro-batches)",
                stats.valid_tokens / 1e6,
                stats.num_micro_batches * DP * CP * capacity / 1e6,
                "Mtokens",
                None,
                _NOTE_CAPACITY,
            )
        )
        rows.append(
            Row.compare(
                f"{prefix}: scheduling time ({len(lengths)} seqs)",
                timings[name].best * 1e3,
                timings["collate"].best * 1e3,
                "ms",
                TIME_GOAL,
                _NOTE_TIME,
                higher_is_better=False,
            )
        )
    rows.extend(mesh_rows(context))
    rows.extend(megatron_rows(MEGATRON_STEPS_QUICK if context.quick else MEGATRON_STEPS))
    return rows
