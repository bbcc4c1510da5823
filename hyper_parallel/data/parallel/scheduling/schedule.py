"""The value a planner returns: one step's micro-batches as aligned blocks of DP x CP positions.

Owns: ``ScheduledGroup`` and ``Schedule`` (with the check that every micro-batch tiles the positions) and
``static_schedule``, which lays groups of one CP size over the DP replicas. Not responsible for: choosing the groups
(the planners) or what a group's ranks hold (``parallel.delivery_layout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Schedule", "ScheduledGroup", "static_schedule"]


@dataclass(frozen=True)
class ScheduledGroup:
    """The sequences an aligned block of positions shares in one micro-batch.

    Attributes:
        first_position: the block's first DP x CP position (a multiple of ``cp_size``).
        cp_size: the positions in the block, the micro-batch's CP size on them.
        sequence_ids: global ids, in packing order; empty for a group of padding only.
    """

    first_position: int
    cp_size: int
    sequence_ids: tuple[int, ...]


@dataclass(frozen=True)
class Schedule:
    """One step's micro-batches; each covers positions ``0 .. R-1`` with aligned blocks, in position order.

    Raises:
        ValueError: a micro-batch whose groups leave a gap, overlap, are not aligned, or cover another ``R``.
    """

    micro_batches: tuple[tuple[ScheduledGroup, ...], ...]

    def __post_init__(self) -> None:
        sizes = set()
        for index, groups in enumerate(self.micro_batches):
            position = 0
            for group in groups:
                if group.first_position != position or group.cp_size < 1 or position % group.cp_size:
                    raise ValueError(f"micro-batch {index}: group {group} is not the aligned block at {position}")
                position += group.cp_size
            sizes.add(position)
        if len(sizes) > 1 or 0 in sizes:
            raise ValueError(f"the micro-batches cover different numbers of positions: {sorted(sizes)}")

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)

    @property
    def num_positions(self) -> int:
        """``R``, the DP x CP positions every micro-batch covers (0 for a schedule without micro-batches)."""
        return sum(group.cp_size for group in self.micro_batches[0]) if self.micro_batches else 0

    def group_at(self, micro_batch: int, position: int) -> ScheduledGroup:
        """The group position ``position`` belongs to in micro-batch ``micro_batch``."""
        for group in self.micro_batches[micro_batch]:
            if group.first_position <= position < group.first_position + group.cp_size:
                return group
        raise IndexError(f"position {position} is outside the {self.num_positions} positions of the schedule")


def static_schedule(bins: Sequence[Sequence[int]], dp_size: int, cp_size: int) -> Schedule:
    """Bin ``m * dp + d`` to DP replica ``d`` (positions ``d*cp .. d*cp+cp-1``) in micro-batch ``m``."""
    return Schedule(
        tuple(
            tuple(
                ScheduledGroup(replica * cp_size, cp_size, tuple(int(i) for i in bins[start + replica]))
                for replica in range(dp_size)
            )
            for start in range(0, len(bins), dp_size)
        )
    )
