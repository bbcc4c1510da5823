"""The cost-balanced placement that ``dynamic_cp`` and ``compute_balanced`` share.

Owns: ``_Step`` (sequences placed over micro-batches of unit positions), ``balanced_step`` (longest-processing-time
placement by per-position cost; the walk of its size-1 sequences is the C helper ``_placement``, ``csrc/placement.c``),
and ``step_schedule`` (the placement as a ``Schedule``).
Not responsible for: the sizes and costs each scheduler chooses, or filling idle positions afterwards
(``parallel.scheduling.fill``).
"""

from __future__ import annotations

import numpy as np

from hyper_parallel.data.parallel.scheduling import _placement
from hyper_parallel.data.parallel.scheduling.schedule import Schedule, ScheduledGroup

__all__ = ["balanced_step", "step_schedule"]


class _Step:
    """Sequences placed over micro-batches of ``units`` positions, each position holding ``room`` tokens.

    A group of size ``c`` sits on the aligned block ``[first, first + c)`` of one micro-batch and is recorded at
    its first position; ``load[u]`` is the cost position ``u`` carries over the step (each group's cost divided by
    its size).
    """

    def __init__(self, count: int, units: int, room: int, max_num_seqs: int | None) -> None:
        self.units, self.room, self.max_num_seqs = units, room, max_num_seqs
        self.owner = np.full((count, units), -1, dtype=np.int64)  # first position of the holding group, -1: free
        self.size = np.zeros((count, units), dtype=np.int64)  # at a group's first position: its size, else 0
        # at a group's first position: the tokens a sequence may still bring (-1 once it holds max_num_seqs)
        self.free = np.zeros((count, units), dtype=np.int64)
        self.members: dict[tuple[int, int], list[int]] = {}
        self.load = np.zeros(units)

    @property
    def count(self) -> int:
        return self.owner.shape[0]

    def extend(self, count: int) -> None:
        units = self.units
        self.owner = np.concatenate([self.owner, np.full((count, units), -1, dtype=np.int64)])
        self.size = np.concatenate([self.size, np.zeros((count, units), dtype=np.int64)])
        self.free = np.concatenate([self.free, np.zeros((count, units), dtype=np.int64)])

    def wide_slot(self, size: int, tokens: int) -> tuple[int, int] | None:
        """``(first, micro_batch)`` for a sequence of size ``size > 1``: the least-loaded aligned block (its highest
        position load) that it can join or open in some micro-batch, the first such micro-batch."""
        blocks = self.units // size
        opens = (self.owner.reshape(self.count, blocks, size) < 0).all(axis=2) & (tokens <= self.room * size)
        fits = opens | ((self.size[:, ::size] == size) & (self.free[:, ::size] >= tokens))
        usable = fits.any(axis=0)
        if not usable.any():
            return None
        loads = self.load.reshape(blocks, size).max(axis=1)
        block = int(np.where(usable, loads, np.inf).argmin())
        return block * size, int(fits[:, block].argmax())

    def place_wide(self, index: int, micro_batch: int, first: int, size: int, tokens: int, weight: float) -> None:
        """Sequence ``index`` of size ``size > 1`` joins or opens the group at ``first`` of ``micro_batch``."""
        if self.owner[micro_batch, first] < 0:
            self.owner[micro_batch, first : first + size] = first
            self.size[micro_batch, first] = size
            self.free[micro_batch, first] = self.room * size
            self.members[micro_batch, first] = []
        members = self.members[micro_batch, first]
        members.append(index)
        full = self.max_num_seqs is not None and len(members) >= self.max_num_seqs
        self.free[micro_batch, first] = -1 if full else self.free[micro_batch, first] - tokens
        self.load[first : first + size] += weight / size

    def place_singles(self, indices: np.ndarray, tokens: np.ndarray, weights: np.ndarray, grow: int) -> None:
        """Size-1 sequences ``indices``, in order, each to the least-loaded position (ties: the lowest) that has
        room in one of its micro-batches, the first such micro-batch; ``grow`` more micro-batches when no position
        has room.

        Each step depends on the loads the previous ones left, so the walk runs in the C helper
        ``_placement.place_singles`` (``csrc/placement.c`` says how) on the rooms of each position's micro-batches
        (-1 where a wider group sits). It returns each sequence's position and micro-batch, the loads it leaves
        (``load``) and the micro-batch count; here the arrays grow to that count and take the groups, each group's
        members in placement order.
        """
        rooms = np.where(self.owner.T < 0, self.room, -1)
        needs = np.ascontiguousarray(tokens[indices], dtype=np.int64)
        costs = np.ascontiguousarray(weights[indices], dtype=np.float64)
        positions, micro_batches, self.load, count = _placement.place_singles(
            needs, costs, self.load, rooms, self.room, self.max_num_seqs, grow
        )
        if count > self.count:
            self.extend(count - self.count)
        key = positions * count + micro_batches  # the groups by position, then micro-batch
        order = np.argsort(key, kind="stable")  # each group's members in placement order
        sizes = np.bincount(key)
        groups = np.flatnonzero(sizes)
        ends = np.cumsum(sizes)[groups]
        group_u, group_m = np.divmod(groups, count)
        self.owner[group_m, group_u] = group_u
        self.size[group_m, group_u] = 1
        ids = indices[order].tolist()
        spans = zip(group_u.tolist(), group_m.tolist(), (ends - sizes[groups]).tolist(), ends.tolist(), strict=True)
        for u, micro_batch, start, end in spans:
            self.members[micro_batch, u] = ids[start:end]


def balanced_step(
    count: int,
    grow: int,
    units: int,
    room: int,
    sizes: np.ndarray,
    tokens: np.ndarray,
    weights: np.ndarray,
    max_num_seqs: int | None,
) -> _Step:
    """Longest-processing-time placement by per-position cost over ``count`` micro-batches (``grow`` more at a time
    when a sequence finds no room).

    Sequences go in order of size, then per-position cost, both descending (ties by id). A sequence of size ``c``
    goes to the aligned block of ``c`` positions with the lowest load that has a micro-batch where it can join that
    block's group or open one, the first such micro-batch.
    """
    step = _Step(count, units, room, max_num_seqs)
    order = np.lexsort((-weights / sizes, -sizes))  # a stable sort: ties keep id order
    wide = order[sizes[order] > 1]
    for index in wide.tolist():
        size, need, weight = int(sizes[index]), int(tokens[index]), float(weights[index])
        slot = step.wide_slot(size, need)
        while slot is None:
            step.extend(grow)
            slot = step.wide_slot(size, need)
        step.place_wide(index, slot[1], slot[0], size, need, weight)
    step.place_singles(order[len(wide) :], tokens, weights, grow)  # most sequences
    return step


def step_schedule(step: _Step, smallest: int, unit: int) -> Schedule:
    """The placement as a ``Schedule``; free positions become groups of padding only of size ``smallest``.

    ``unit`` is the positions one scheduling unit stands for (the static CP size for ``compute_balanced``, else 1).
    """
    micro_batches, members = [], step.members
    for micro_batch, sizes in enumerate(step.size.tolist()):
        groups, first = [], 0
        while first < step.units:
            size = sizes[first]
            ids = tuple(members[micro_batch, first]) if size else ()
            groups.append(ScheduledGroup(first * unit, (size or smallest) * unit, ids))
            first += size or smallest
        micro_batches.append(tuple(groups))
    return Schedule(tuple(micro_batches))
