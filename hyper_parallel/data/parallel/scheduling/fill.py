"""Giving idle positions work after a planner ran, as Megatron-Core's dynamic CP does.

Owns: ``fill_idle_positions``. A position is idle in a micro-batch when its group holds no sequence (padding only).
Per micro-batch, until nothing changes:

1. **Grow** (dynamic CP): a group whose aligned block of the next allowed size holds only idle positions besides
   its own takes that block, if its sequences still fit.
2. **Move**: an idle position receives one sequence from a group of two or more (any micro-batch; the same block
   in another micro-batch first, so a static replica's cost is kept; then the shortest sequence). It opens a group
   of the least allowed size that holds it, on an aligned block of idle positions. A micro-batch with no sequence
   at all may also take the only sequence of a group whose micro-batch keeps another.
3. **Merge** (dynamic CP): when positions stay idle and the largest size covers every position, the micro-batch's
   sequences become one group of all positions, if they fit (Megatron's fallback for sizes that are not powers of
   two).

Not responsible for: the planning itself (the planners) or refusing what stays idle (``parallel.scheduling.plan``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.parallel.scheduling.schedule import Schedule, ScheduledGroup

__all__ = ["fill_idle_positions"]


class _Fill:
    """The step as mutable micro-batches: ``groups[m]`` maps a group's first position to ``[size, members]``."""

    def __init__(self, schedule: Schedule, lengths, layout: DeliveryLayout, capacity: int, chain, limit) -> None:
        self.chain, self.limit, self.capacity, self.layout = list(chain), limit, capacity, layout
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.positions = schedule.num_positions
        self.groups = [
            {g.first_position: [g.cp_size, list(g.sequence_ids)] for g in groups} for groups in schedule.micro_batches
        ]
        self.padded = {c: layout.padded_lengths(self.lengths, c) for c in self.chain}
        least = np.full(len(self.lengths), self.chain[-1], dtype=np.int64)
        for c in reversed(self.chain):
            least = np.where(self.padded[c] <= c * capacity, c, least)
        self.least = least.tolist()

    def fits(self, members: list[int], size: int) -> bool:
        return int(self.padded[size][members].sum()) <= size * self.capacity

    def idle_block(self, m: int, first: int, size: int) -> bool:
        """The aligned block ``[first, first + size)`` of micro-batch ``m`` holds only idle groups."""
        groups = self.groups[m]
        position = first
        while position < first + size:
            group = groups.get(position)
            if group is None or group[1] or position + group[0] > first + size:
                return False
            position += group[0]
        return True

    def take_block(self, m: int, first: int, size: int, members: list[int]) -> None:
        groups = self.groups[m]
        for position in [p for p in groups if first <= p < first + size]:
            del groups[position]
        groups[first] = [size, members]

    def release(self, m: int, first: int) -> None:
        """Group ``first`` of micro-batch ``m`` becomes idle groups of the smallest size."""
        size = self.groups[m].pop(first)[0]
        for position in range(first, first + size, self.chain[0]):
            self.groups[m][position] = [self.chain[0], []]

    def grow(self, m: int) -> bool:
        changed = False
        for current, larger in zip(self.chain[:-1], self.chain[1:], strict=True):
            for first, (size, members) in sorted(self.groups[m].items()):
                if size != current or not members or first not in self.groups[m]:
                    continue
                start = first - first % larger
                others = [(start, first), (first + size, start + larger)]
                if all(self.idle_block(m, a, b - a) for a, b in others if b > a) and self.fits(members, larger):
                    self.groups[m].pop(first)
                    self.take_block(m, start, larger, members)
                    changed = True
        return changed

    def move(self, m: int) -> bool:
        empty = not any(members for _, members in self.groups[m].values())
        for first in sorted(p for p, (_, members) in self.groups[m].items() if not members):
            if first not in self.groups[m] or self.groups[m][first][1]:
                continue
            size = self.groups[m][first][0]
            best = self._donor(m, first, size, empty)
            if best is not None:
                d, at, index = best
                target = self.least[index]
                self.groups[d][at][1].remove(index)
                if not self.groups[d][at][1]:
                    self.release(d, at)
                self.take_block(m, first - first % target, target, [index])
                return True
        return False

    def _donor(self, m: int, first: int, size: int, empty: bool):
        best = None
        for d, groups in enumerate(self.groups):
            busy = sum(1 for _, members in groups.values() if members)
            for at, (donor_size, members) in groups.items():
                if len(members) < 2 and not (empty and members and d != m and busy >= 2):
                    continue
                for index in members:
                    target = self.least[index]
                    if not self.idle_block(m, first - first % target, target):
                        continue
                    key = (len(members) < 2, (at, donor_size) != (first, size), int(self.lengths[index]), d, at, index)
                    if best is None or key < best:
                        best = key
        return None if best is None else best[3:]

    def merge(self, m: int) -> None:
        groups = self.groups[m]
        members = [i for first in sorted(groups) for i in groups[first][1]]
        idle = any(not group[1] for group in groups.values())
        if not idle or not members or self.chain[-1] != self.positions:
            return
        if (self.limit is None or len(members) <= self.limit) and self.fits(members, self.positions):
            self.groups[m] = {0: [self.positions, members]}

    def schedule(self) -> Schedule:
        return Schedule(
            tuple(
                tuple(ScheduledGroup(first, size, tuple(members)) for first, (size, members) in sorted(g.items()))
                for g in self.groups
            )
        )


def fill_idle_positions(
    schedule: Schedule,
    lengths: np.ndarray,
    *,
    layout: DeliveryLayout,
    capacity: int,
    cp_sizes: Sequence[int],
    max_num_seqs: int | None = None,
) -> Schedule:
    """``schedule`` with its idle positions given work where a sequence can fill them (see the module).

    Args:
        schedule: a planner's schedule of ``lengths`` (global id order).
        layout: the delivery layout (padding per size).
        capacity: tokens per rank.
        cp_sizes: the allowed CP sizes, ascending, each dividing the next (static: the one CP size).
        max_num_seqs: the most real sequences of a group.

    Returns:
        A ``Schedule`` of the same micro-batch count, each sequence once; the same schedule when nothing is idle.
    """
    if all(group.sequence_ids for groups in schedule.micro_batches for group in groups):
        return schedule
    state = _Fill(schedule, lengths, layout, capacity, cp_sizes, max_num_seqs)
    changed = True
    while changed:
        changed = False
        for m in range(len(state.groups)):
            while state.grow(m) | state.move(m):
                changed = True
    for m in range(len(state.groups)):
        state.merge(m)
    return state.schedule()
