"""Megatron-LM's published dynamic-CP packing rule, written from its description, as the benchmarks' reference.

Owns: ``megatron_dynamic_cp``, which schedules one step's sequence lengths the way Megatron-LM's dev branch
describes its packing-aware dynamic context-parallel scheduler (``next_hdp_group_packing_aware``), micro-batch by
micro-batch; ``ReferenceGroup``, one CP group of a micro-batch; ``check_reference_schedule``, its own invariants
(every sequence once, no rank above ``max_seqlen_per_rank`` real tokens, every rank of every micro-batch covered);
and ``schedule_quality``, the side-by-side figures of a schedule in the same terms for ours and the reference.
Not responsible for: our scheduler (``hyper_parallel.data.parallel.data_schedule_utils``), padding, alignment,
VPP group alignment, or timing.

The rule, per micro-batch (``R`` ranks, ``mslpr`` real tokens per rank, cost per rank ``L**2 / cp``):

1. The waiting sequences, longest first (ties by id). The first opens a group of its least size on ranks
   ``0 .. c-1``: ``c = 2**ceil(log2(L / mslpr))``, at least ``min_cp_size``. The micro-batch's cap is
   ``1.05 * L_first * mslpr``.
2. Each next sequence tries every power-of-two size ``c`` from its least up to ``R``, smallest first: joining each
   existing group of size ``c`` whose per-rank length stays within ``mslpr``, then opening a new group on the
   ``c`` least loaded free ranks (the free ranks all carry 0, so the lowest-numbered ones). The candidate with the
   lowest resulting maximum rank cost wins (the first one on a tie) if that maximum is within the cap; otherwise
   the sequence waits for the next micro-batch.
3. While a rank is empty, a group of the smallest size grows to the next size into the ranks after it (the groups
   behind it move back); when none can grow, one full ``R``-rank group takes the longest-first sequences that fit
   and the rest wait.

Example::

    megatron_dynamic_cp(np.array([16, 4, 4]), ranks=4, max_seqlen_per_rank=8)
    # [(ReferenceGroup(0, 2, (0,)), ReferenceGroup(2, 2, (1, 2)))]: 16 needs cp 2; 4 and 4 share a cp-1 group on
    # rank 2, which then grows to cp 2 so that rank 3 is not empty
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CAP_SLACK",
    "ReferenceGroup",
    "ScheduleQuality",
    "check_reference_schedule",
    "megatron_dynamic_cp",
    "schedule_quality",
]

CAP_SLACK = 0.05  # Megatron's cap on a micro-batch's rank cost: (1 + slack) * tallest length * mslpr


@dataclass(frozen=True)
class ReferenceGroup:
    """One CP group of a micro-batch: ranks ``first_rank .. first_rank + cp_size - 1`` share ``sequence_ids``."""

    first_rank: int
    cp_size: int
    sequence_ids: tuple[int, ...]


@dataclass
class _Group:
    size: int
    ids: list[int]
    tokens: int  # real tokens of the group (its per-rank length is tokens / size)
    cost: float  # cost each of its ranks carries: sum of L**2 / size


def _least_size(length: int, mslpr: int, min_cp_size: int) -> int:
    """``2**ceil(log2(L / mslpr))``, at least ``min_cp_size`` (Megatron's ``dcp_gpus_needed``)."""
    return max(min_cp_size, 1 << max(0, math.ceil(math.log2(length / mslpr))))


def _place(group: _Group, index: int, length: int) -> None:
    group.ids.append(index)
    group.tokens += length
    group.cost += length * length / group.size


def _best_candidate(
    groups: list[_Group], length: int, sizes: Sequence[int], free: int, mslpr: int, cap: float
) -> tuple[int, int] | None:
    """``(size, group index or -1 to open)`` with the lowest resulting maximum rank cost within ``cap``."""
    current = max(group.cost for group in groups)
    best, best_cost = None, math.inf
    for size in sizes:
        cost = length * length / size
        for index, group in enumerate(groups):
            if group.size == size and group.tokens + length <= mslpr * size:
                resulting = max(current, group.cost + cost)
                if resulting <= cap and resulting < best_cost:
                    best, best_cost = (size, index), resulting
        if free >= size:
            resulting = max(current, cost)
            if resulting <= cap and resulting < best_cost:
                best, best_cost = (size, -1), resulting
    return best


def _grow_one(groups: list[_Group], sizes: Sequence[int], lengths: np.ndarray, ranks: int) -> bool:
    """Grow the first group of the smallest size to the next size, if the ranks after the groups have room."""
    smallest = min(group.size for group in groups)
    larger = [size for size in sizes if size > smallest]
    if not larger or sum(group.size for group in groups) + larger[0] - smallest > ranks:
        return False
    group = next(group for group in groups if group.size == smallest)
    group.size = larger[0]
    group.cost = float((lengths[group.ids].astype(np.float64) ** 2).sum()) / group.size
    return True


def _micro_batch(
    waiting: list[int], lengths: np.ndarray, ranks: int, sizes: Sequence[int], mslpr: int, min_cp_size: int
) -> tuple[list[_Group], list[int]]:
    """One micro-batch's groups in rank order, and the sequences left waiting."""
    first = waiting[0]
    tall = int(lengths[first])
    cap = (1.0 + CAP_SLACK) * tall * mslpr
    groups = [_Group(_least_size(tall, mslpr, min_cp_size), [], 0, 0.0)]
    _place(groups[0], first, tall)
    left = []
    for index in waiting[1:]:
        length = int(lengths[index])
        least = _least_size(length, mslpr, min_cp_size)
        free = ranks - sum(group.size for group in groups)
        choice = _best_candidate(groups, length, [s for s in sizes if s >= least], free, mslpr, cap)
        if choice is None:
            left.append(index)
            continue
        size, target = choice
        if target < 0:
            groups.append(_Group(size, [], 0, 0.0))
        _place(groups[target], index, length)
    while sum(group.size for group in groups) < ranks:
        if not _grow_one(groups, sizes, lengths, ranks):
            return _full_group(waiting, lengths, ranks, mslpr)
    return groups, left


def _full_group(waiting: list[int], lengths: np.ndarray, ranks: int, mslpr: int) -> tuple[list[_Group], list[int]]:
    """Megatron's fallback: one group of all ``ranks`` takes the longest-first sequences that fit."""
    group, left = _Group(ranks, [], 0, 0.0), []
    for index in waiting:
        if group.tokens + int(lengths[index]) <= mslpr * ranks:
            _place(group, index, int(lengths[index]))
        else:
            left.append(index)
    return [group], left


def megatron_dynamic_cp(
    lengths: np.ndarray, *, ranks: int, max_seqlen_per_rank: int, min_cp_size: int = 1
) -> list[tuple[ReferenceGroup, ...]]:
    """One step's micro-batches under Megatron's dynamic-CP rule (see the module docstring).

    Args:
        lengths: real lengths (``>= 1``) of the step's sequences, in global id order.
        ranks: the DP x CP ranks ``R``.
        max_seqlen_per_rank: real tokens one rank holds per micro-batch (``mslpr``).
        min_cp_size: the least CP size of a group (a power of two).

    Returns:
        The micro-batches, each a tuple of groups in rank order covering ranks ``0 .. R-1``.

    Raises:
        ValueError: a sequence needs a CP size above the largest power of two within ``ranks``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    sizes = [1 << k for k in range(ranks.bit_length()) if min_cp_size <= 1 << k <= ranks]
    too_long = [
        i for i, length in enumerate(lengths.tolist()) if _least_size(length, max_seqlen_per_rank, 1) > sizes[-1]
    ]
    if too_long:
        raise ValueError(f"sequences {too_long[:5]} need a CP size above {sizes[-1]} at {max_seqlen_per_rank}/rank")
    waiting = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    micro_batches = []
    while waiting:
        groups, waiting = _micro_batch(waiting, lengths, ranks, sizes, max_seqlen_per_rank, min_cp_size)
        firsts = np.cumsum([0] + [group.size for group in groups])
        micro_batches.append(
            tuple(
                ReferenceGroup(int(first), group.size, tuple(group.ids))
                for first, group in zip(firsts.tolist(), groups, strict=False)
            )
        )
    return micro_batches


def check_reference_schedule(
    micro_batches: Sequence[Sequence[ReferenceGroup]], lengths: np.ndarray, *, ranks: int, max_seqlen_per_rank: int
) -> None:
    """Raise ``AssertionError`` unless every sequence is placed once, every micro-batch covers ranks ``0 .. R-1``
    with contiguous groups, and no rank holds more than ``max_seqlen_per_rank`` real tokens (``sum(L) / cp``)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    placed = sorted(i for groups in micro_batches for group in groups for i in group.sequence_ids)
    assert placed == list(range(len(lengths))), "a sequence is missing or placed twice"
    for number, groups in enumerate(micro_batches):
        rank = 0
        for group in groups:
            assert group.first_rank == rank, f"micro-batch {number}: group {group} does not start at rank {rank}"
            total = int(lengths[list(group.sequence_ids)].sum())
            assert total <= max_seqlen_per_rank * group.cp_size, f"micro-batch {number}: {group} is over capacity"
            rank += group.cp_size
        assert rank == ranks, f"micro-batch {number} covers {rank} ranks, not {ranks}"


@dataclass(frozen=True)
class ScheduleQuality:
    """A step's schedule in terms both schedulers share (cost per rank ``L**2 / cp`` over real lengths).

    Attributes:
        num_micro_batches: the step's micro-batch count.
        max_rank_cost, mean_rank_cost: per rank, the step's summed cost; their max and mean.
        critical_path: the sum over micro-batches of the most loaded rank's cost (what a step takes when every
            micro-batch waits for its slowest rank).
        num_groups: the groups over all micro-batches.
        empty_groups: groups without a sequence (padding only).
        empty_micro_batches: micro-batches without a sequence on any rank.
    """

    num_micro_batches: int
    max_rank_cost: float
    mean_rank_cost: float
    critical_path: float
    num_groups: int
    empty_groups: int
    empty_micro_batches: int

    @property
    def imbalance(self) -> float:
        return self.max_rank_cost / self.mean_rank_cost if self.mean_rank_cost else 1.0


def schedule_quality(micro_batches: Sequence[Sequence], lengths: np.ndarray, *, ranks: int) -> ScheduleQuality:
    """The ``ScheduleQuality`` of micro-batches of groups with ``first``/``cp_size``/``sequence_ids``.

    Groups are read by their first rank: ``first_rank`` (``ReferenceGroup``) or ``first_position`` (ours).
    """
    squares = np.asarray(lengths, dtype=np.float64) ** 2
    step = np.zeros(ranks)
    critical, empty_groups, empty_micro_batches = 0.0, 0, 0
    for groups in micro_batches:
        local = np.zeros(ranks)
        for group in groups:
            first = getattr(group, "first_rank", getattr(group, "first_position", None))
            local[first : first + group.cp_size] = squares[list(group.sequence_ids)].sum() / group.cp_size
            empty_groups += not group.sequence_ids
        empty_micro_batches += all(not group.sequence_ids for group in groups)
        step += local
        critical += float(local.max())
    return ScheduleQuality(
        num_micro_batches=len(micro_batches),
        max_rank_cost=float(step.max()),
        mean_rank_cost=float(step.mean()),
        critical_path=critical,
        num_groups=sum(len(groups) for groups in micro_batches),
        empty_groups=empty_groups,
        empty_micro_batches=empty_micro_batches,
    )
