"""Megatron-Core's ``DpBalancedScheduler``: order-preserving next-fit over the DP replicas, static CP.

Owns: ``schedule_dp_balanced``. Not responsible for: checking lengths and fits, filling idle ranks or raising on an
alignment that cannot be met (``parallel.scheduling.plan``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.parallel.scheduling.schedule import Schedule, static_schedule

__all__ = ["schedule_dp_balanced"]


def schedule_dp_balanced(
    lengths: np.ndarray,
    *,
    layout: DeliveryLayout,
    dp_size: int,
    cp_sizes: Sequence[int],
    capacity: int,
    vpp_group: int = 1,
    max_num_seqs: int | None = None,
    cost: Callable[[np.ndarray], np.ndarray] | None = None,
) -> Schedule:
    """Megatron-Core's DP-balanced packing.

    1. Sequences in global id order go to the open group while its padded tokens stay within
       ``capacity * cp`` (and it holds fewer than ``max_num_seqs``); otherwise a new group opens with them.
    2. While the group count is not a multiple of ``dp * vpp_group``, the last sequence of the last group holding
       more than one moves into a new group at the end (walking back over singletons).
    3. Where no group can give one up, groups of padding only make up the count; they take the last slots of the
       last micro-batches, at most ``dp - 1`` per micro-batch, so a micro-batch keeps a real group while there are
       groups enough (else a micro-batch stays empty, which ``build_schedule`` refuses).
    4. Group ``m * dp + d`` of the result is DP replica ``d``'s in micro-batch ``m`` (all its CP ranks share it).

    Args:
        lengths: real lengths in global id order (each must fit: ``build_schedule`` checks).
        layout: the delivery layout (its CP size and per-sequence padding).
        dp_size: the DP replicas.
        cp_sizes: ``(layout.cp_size,)``; the registry's common signature.
        capacity: tokens per rank (``layout.local_capacity()``).
        vpp_group: the micro-batch count is a multiple of this.
        max_num_seqs: the most real sequences of a group.
        cost: unused (the common signature).

    Returns:
        The ``Schedule``; micro-batch count = groups / dp.

    Example:
        lengths ``[6, 3, 5, 4, 2]``, dp 2, cp 1, capacity 10: micro-batches ``[[0, 1], [2]]`` and ``[[4], [3]]``.
    """
    cp = int(cp_sizes[0])
    padded = layout.padded_lengths(lengths, cp)
    ends = np.concatenate([[0], np.cumsum(padded)])
    limit = capacity * cp
    bins: list[list[int]] = []
    start, count = 0, len(padded)
    while start < count:
        stop = max(start + 1, int(np.searchsorted(ends, ends[start] + limit, side="right")) - 1)
        if max_num_seqs is not None:
            stop = min(stop, start + max_num_seqs)
        bins.append(list(range(start, stop)))
        start = stop
    need = -len(bins) % (dp_size * vpp_group)
    index = len(bins) - 1
    while need and index >= 0:
        if len(bins[index]) > 1:
            bins.append([bins[index].pop()])
            need -= 1
        else:
            index -= 1
    return static_schedule(_with_padding_groups(bins, need, dp_size), dp_size, cp)


def _with_padding_groups(bins: list[list[int]], need: int, dp_size: int) -> list[list[int]]:
    """``bins`` laid out row-major with ``need`` empty groups in the last slots of the last micro-batches, at most
    ``dp - 1`` per micro-batch from the end (the rest, if any, in the first micro-batches' tail)."""
    rows = (len(bins) + need) // dp_size
    empties = [0] * rows
    for row in range(rows - 1, -1, -1):
        empties[row] = min(dp_size - 1, need)
        need -= empties[row]
    for row in range(rows):  # what is left fills whole micro-batches from the end
        if need <= 0:
            break
        extra = min(need, dp_size - empties[rows - 1 - row])
        empties[rows - 1 - row] += extra
        need -= extra
    out, source = [], iter(bins)
    for row in range(rows):
        out.extend(next(source) for _ in range(dp_size - empties[row]))
        out.extend([] for _ in range(empties[row]))
    return out
