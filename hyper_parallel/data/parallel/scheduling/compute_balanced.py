"""Static CP with every DP replica's estimated step cost balanced.

Owns: ``schedule_compute_balanced``. Not responsible for: the cost model (``parallel.scheduling.config``), checking
fits or filling idle replicas (``parallel.scheduling.plan``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.parallel.scheduling.balanced import balanced_step, step_schedule
from hyper_parallel.data.parallel.scheduling.schedule import Schedule

__all__ = ["schedule_compute_balanced"]


def schedule_compute_balanced(
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
    """Static CP; every DP replica's step cost balanced, in the fewest micro-batches that hold the sequences.

    The count starts at the fewest micro-batches (a multiple of ``vpp_group``) whose ``dp`` groups of
    ``capacity * cp`` tokens hold the padded lengths. Sequences by cost, descending (ties by id), go to the
    least-loaded DP replica that has room in one of its micro-batches, the first such micro-batch; when one finds no
    room the count grows by ``vpp_group`` and placement goes on.

    Args:
        lengths: real lengths in global id order (each fits: ``build_schedule`` checks).
        layout: the delivery layout (its per-sequence padding).
        dp_size: the DP replicas.
        cp_sizes: ``(layout.cp_size,)``.
        capacity: tokens per rank (``layout.local_capacity()``).
        vpp_group: the micro-batch count is a multiple of this.
        max_num_seqs: the most real sequences of a group.
        cost: each padded length's cost (``sequence_cost``); None: the padded length itself.

    Returns:
        The ``Schedule``: every group one DP replica's ``cp`` positions; deterministic.
    """
    cp = int(cp_sizes[0])
    padded = layout.padded_lengths(lengths, cp)
    weights = np.asarray(padded if cost is None else cost(padded), dtype=np.float64)
    count = max(1, -(-int(padded.sum()) // (dp_size * capacity * cp)))
    count = -(-count // vpp_group) * vpp_group
    units = np.ones(len(padded), dtype=np.int64)
    step = balanced_step(count, vpp_group, dp_size, capacity * cp, units, padded, weights, max_num_seqs)
    return step_schedule(step, 1, cp)
