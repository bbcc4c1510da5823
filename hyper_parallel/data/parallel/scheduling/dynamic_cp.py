"""Dynamic context parallelism: a CP size per packed group, balancing every DP x CP position's cost.

Owns: ``schedule_dynamic_cp``. Not responsible for: which sizes are allowed (``parallel.scheduling.plan``), growing
groups over idle positions afterwards (``parallel.scheduling.fill``), or the CP groups themselves
(``parallel.process_groups``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.parallel.scheduling.balanced import balanced_step, step_schedule
from hyper_parallel.data.parallel.scheduling.schedule import Schedule

__all__ = ["schedule_dynamic_cp"]


def schedule_dynamic_cp(
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
    """A CP size per packed group from ``cp_sizes``, balancing every position's cost over the step.

    1. Each sequence's least size ``c`` holds it (``layout.padded_lengths(L, c) <= c * capacity``); its size is the
       least ``c >= that`` whose per-position cost ``cost / c`` stays within the step's mean position cost (so no
       sequence outweighs a position), the largest size when none does.
    2. The micro-batch count starts at the fewest that hold the padded tokens (a multiple of ``vpp_group``).
    3. Sequences by size then per-position cost, descending, each to the least-loaded aligned block of its size
       with room in some micro-batch (joining that block's group or opening one), the first such micro-batch.
       When one finds no room, the count grows by ``vpp_group``.

    Args:
        lengths: real lengths in global id order (each fits the largest size: ``build_schedule`` checks).
        layout: the delivery layout; ``R = dp_size * layout.cp_size`` positions.
        dp_size: the DP size of the static grid.
        cp_sizes: the allowed sizes, ascending, each dividing the next and ``R``.
        capacity: tokens per rank (``layout.local_capacity(max(cp_sizes))``).
        vpp_group: the micro-batch count is a multiple of this.
        max_num_seqs: the most real sequences of a group.
        cost: each real length's cost (``sequence_cost``); None: the length squared.

    Returns:
        The ``Schedule``; deterministic for the same input.
    """
    positions = dp_size * layout.cp_size
    chain = [int(size) for size in cp_sizes]
    lengths = np.asarray(lengths, dtype=np.int64)
    weights = np.asarray(lengths.astype(np.float64) ** 2 if cost is None else cost(lengths), dtype=np.float64)
    padded = {size: layout.padded_lengths(lengths, size) for size in chain}
    least = np.full(len(lengths), chain[-1], dtype=np.int64)
    for size in reversed(chain):
        least = np.where(padded[size] <= capacity * size, size, least)
    tokens_needed = sum(int(padded[size][least == size].sum()) for size in chain)
    count = max(1, -(-tokens_needed // (positions * capacity)))
    count = -(-count // vpp_group) * vpp_group
    mean = float(weights.sum()) / (count * positions)
    sizes = least.copy()
    for size in chain:  # the least size keeping cost / size within the mean, never below the least that holds
        sizes = np.where((sizes < size) & (weights / sizes > mean), size, sizes)
    tokens = np.zeros(len(lengths), dtype=np.int64)
    for size in chain:
        tokens[sizes == size] = padded[size][sizes == size]
    step = balanced_step(count, vpp_group, positions, capacity, sizes, tokens, weights, max_num_seqs)
    return step_schedule(step, chain[0], 1)
