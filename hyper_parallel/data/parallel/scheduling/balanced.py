"""The cost-balanced placement that ``dynamic_cp`` and ``compute_balanced`` share.

Owns: ``_Step`` (sequences placed over micro-batches of unit positions), ``balanced_step`` (longest-processing-time
placement by per-position cost), and ``step_schedule`` (the placement as a
``Schedule``).
Not responsible for: the sizes and costs each scheduler chooses, or filling idle positions afterwards
(``parallel.scheduling.fill``).
"""

from __future__ import annotations

import heapq

import numpy as np

from hyper_parallel.data.parallel.scheduling.schedule import Schedule, ScheduledGroup

__all__ = ["balanced_step", "step_schedule"]


class _Step:
    """Sequences placed over micro-batches of ``units`` positions, each position holding ``room`` tokens.

    A group of size ``c`` sits on the aligned block ``[first, first + c)`` of one micro-batch and is recorded at
    its first position; ``load[u]`` is the cost position ``u`` carries over the step (each group's cost divided by
    its size). ``single[u, m]`` is the room a size-1 sequence finds at position ``u`` of micro-batch ``m`` (-1:
    none, the position belongs to a wider group or its group is full).
    """

    def __init__(self, units: int, room: int, max_num_seqs: int | None) -> None:
        self.units, self.room, self.max_num_seqs = units, room, max_num_seqs
        self.owner = np.zeros((0, units), dtype=np.int64)  # first position of the holding group, -1 when free
        self.size = np.zeros((0, units), dtype=np.int64)  # at a group's first position: its size, else 0
        self.free = np.zeros((0, units), dtype=np.int64)  # at a group's first position: tokens left in it
        self.single = np.zeros((units, 0), dtype=np.int64)
        self.members: dict[tuple[int, int], list[int]] = {}
        self.load = [0.0] * units

    @property
    def count(self) -> int:
        return self.owner.shape[0]

    def extend(self, count: int) -> None:
        units = self.units
        self.owner = np.concatenate([self.owner, np.full((count, units), -1, dtype=np.int64)])
        self.size = np.concatenate([self.size, np.zeros((count, units), dtype=np.int64)])
        self.free = np.concatenate([self.free, np.zeros((count, units), dtype=np.int64)])
        self.single = np.concatenate([self.single, np.full((units, count), self.room, dtype=np.int64)], axis=1)

    def place(self, index: int, micro_batch: int, first: int, size: int, tokens: int, weight: float) -> None:
        if self.owner[micro_batch, first] < 0:
            self.owner[micro_batch, first : first + size] = first
            self.size[micro_batch, first] = size
            self.free[micro_batch, first] = self.room * size
            self.members[micro_batch, first] = []
            if size > 1:
                self.single[first : first + size, micro_batch] = -1
        self.free[micro_batch, first] -= tokens
        members = self.members[micro_batch, first]
        members.append(index)
        if size == 1:
            full = self.max_num_seqs is not None and len(members) >= self.max_num_seqs
            self.single[first, micro_batch] = -1 if full else self.free[micro_batch, first]
        for u in range(first, first + size):
            self.load[u] += weight / size

    def wide_slot(self, size: int, tokens: int) -> tuple[int, int] | None:
        """``(first, micro_batch)`` for a sequence of size ``size > 1``: the least-loaded aligned block (its highest
        position load) that it can join or open in some micro-batch, the first such micro-batch."""
        blocks = self.units // size
        owner = self.owner.reshape(self.count, blocks, size)
        opens = (owner < 0).all(axis=2) & (tokens <= self.room * size)
        firsts = np.arange(blocks) * size
        joins = (owner[:, :, 0] == firsts) & (self.size[:, ::size] == size) & (self.free[:, ::size] >= tokens)
        if self.max_num_seqs is not None:
            counts = np.zeros_like(joins)
            for (micro_batch, first), members in self.members.items():
                if first % size == 0 and self.size[micro_batch, first] == size:
                    counts[micro_batch, first // size] = len(members) >= self.max_num_seqs
            joins &= ~counts
        fits = opens | joins
        usable = fits.any(axis=0)
        if not usable.any():
            return None
        loads = np.asarray(self.load).reshape(blocks, size).max(axis=1)
        block = int(np.where(usable, loads, np.inf).argmin())
        return block * size, int(fits[:, block].argmax())


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
    step = _Step(units, room, max_num_seqs)
    step.extend(count)
    order = np.lexsort((np.arange(len(sizes)), -weights / sizes, -sizes))
    wide = order[sizes[order] > 1]
    for index in wide.tolist():
        size, need, weight = int(sizes[index]), int(tokens[index]), float(weights[index])
        slot = step.wide_slot(size, need)
        while slot is None:
            step.extend(grow)
            slot = step.wide_slot(size, need)
        step.place(index, slot[1], slot[0], size, need, weight)
    # Size-1 sequences (most of them): a heap of positions by load, first fit over the micro-batches.
    # Rooms, tokens left and members of size-1 groups live in lists and dicts here (numpy scalar access would
    # dominate); the rooms go back to ``step.single`` when the micro-batches grow and at the end.
    heap = [(load, u) for u, load in enumerate(step.load)]
    heapq.heapify(heap)
    members, limit = step.members, max_num_seqs
    rooms = step.single.tolist()
    for index in order[len(wide) :].tolist():
        need, weight = int(tokens[index]), float(weights[index])
        skipped = []
        while True:
            if not heap:
                step.single[:] = rooms
                step.extend(grow)
                rooms = step.single.tolist()
                heap, skipped = skipped, []
                heapq.heapify(heap)
            load, u = heapq.heappop(heap)
            row = rooms[u]
            micro_batch = next((m for m, room in enumerate(row) if room >= need), -1)
            if micro_batch < 0:
                skipped.append((load, u))
                continue
            group = members.get((micro_batch, u))
            if group is None:
                step.owner[micro_batch, u] = u
                step.size[micro_batch, u] = 1
                group = members[micro_batch, u] = []
            group.append(index)
            left = row[micro_batch] - need
            row[micro_batch] = -1 if limit is not None and len(group) >= limit else left
            step.load[u] = load + weight
            heapq.heappush(heap, (load + weight, u))
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
    step.single[:] = rooms
    return step


def step_schedule(step: _Step, smallest: int, unit: int) -> Schedule:
    """The placement as a ``Schedule``; free positions become groups of padding only of size ``smallest``.

    ``unit`` is the positions one scheduling unit stands for (the static CP size for ``compute_balanced``, else 1).
    """
    micro_batches = []
    for micro_batch in range(step.count):
        groups, first = [], 0
        sizes = step.size[micro_batch]
        while first < step.units:
            size = int(sizes[first])
            members = tuple(step.members[micro_batch, first]) if size else ()
            groups.append(ScheduledGroup(first * unit, (size or smallest) * unit, members))
            first += size or smallest
        micro_batches.append(tuple(groups))
    return Schedule(tuple(micro_batches))
