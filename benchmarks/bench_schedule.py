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
"""

from __future__ import annotations

import numpy as np

from benchmarks.common import BenchContext, Row, log, measure
from hyper_parallel.data.batching.build_collate_fn import TextPackingCollator
from hyper_parallel.data.parallel.data_schedule_utils import PackingSchedulerConfig, build_schedule, schedule_stats

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
        built = build_schedule(
            configs[name], lengths, dp_size=DP, cp_size=CP, tp_size=1, dynamic_cp_sizes=sizes.get(name, ())
        )
        return built, schedule_stats(built, lengths, configs[name], tp_size=1)

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
    return rows
