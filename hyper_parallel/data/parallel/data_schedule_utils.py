"""The pure half of the packing scheduler: settings, alignment arithmetic, scheduling algorithms, statistics, packing.

Owns: ``PackingSchedulerConfig`` and its validation; the alignment of a rank's CP-local packed length
(``local_alignment``, ``local_capacity``, ``local_packed_length``, ``padded_lengths``); the ``Schedule`` of one step's
sequences over the DP x CP positions and the three algorithms that build it (``schedule_dp_balanced``,
``schedule_dynamic_cp``, ``schedule_compute_balanced``, dispatched by ``build_schedule``); the step's ``FlopsStats``;
Everything here is computed
identically on every rank from the gathered lengths. Not responsible for: collectives, fetching or rerouting data
(``parallel.data_schedule``), the process groups (``parallel.process_groups``), or the CP layout's columns
(``parallel.batch_parallel``).

Vocabulary: ``R = dp * cp`` positions (the DP x CP ranks of one TP/PP coordinate), a rank's position being
``dp_rank * cp + cp_rank``. Global sequence ids are DP-rank-major (DP rank 0's sequences of the step in order, then
DP rank 1's, ...). A group of CP size ``c`` occupies the aligned block of positions ``[b*c, (b+1)*c)``; its
sequences are padded each to a multiple of ``2*c`` (the ``zigzag_thd`` chunks, when ``c > 1``) and every rank of
the block holds ``local_packed_length`` tokens of them, at most ``max_seqlen_per_dp_cp_rank``.

Example::

    config = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=10)
    schedule = build_schedule(config, np.array([6, 3, 5, 4, 2]), dp_size=2, cp_size=1, tp_size=1)
    # two micro-batches: DP rank 0 gets sequences [0, 1] then [4]; DP rank 1 gets [2] then [3]
"""

from __future__ import annotations

import difflib
import heapq
import math
from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields

import numpy as np
import torch

from hyper_parallel.data.errors import DataConfigError, DataFileError, require_int

__all__ = [
    "SCHEDULERS",
    "FlopsStats",
    "PackingSchedulerConfig",
    "Schedule",
    "ScheduledGroup",
    "build_schedule",
    "local_alignment",
    "local_capacity",
    "local_packed_length",
    "padded_lengths",
    "schedule_compute_balanced",
    "schedule_dp_balanced",
    "schedule_dynamic_cp",
    "schedule_stats",
    "sequence_cost",
]

SCHEDULERS = ("dp_balanced", "dynamic_cp", "compute_balanced")
MXFP8_BLOCK = 32  # tokens of one MXFP8 scaling block: a rank's shard after sequence parallelism is a multiple

_BOOL_FIELDS = ("mxfp8", "sequence_parallel", "deterministic_mode", "cuda_graphs", "router_z_loss")
_DYNAMIC_CONFLICTS = {
    "deterministic_mode": "the CP size of every packed micro-batch depends on the step's lengths, so the reduction "
    "order of attention and gradients changes from step to step and results cannot be bitwise reproducible",
    "cuda_graphs": "a CUDA graph is captured for fixed communicators and shapes, and dynamic CP changes the CP group "
    "and the local shapes per micro-batch",
    "router_z_loss": "the router z-loss is averaged over the static CP group, which dynamic CP replaces per "
    "micro-batch, so the loss would be scaled wrongly",
}


# -- settings ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackingSchedulerConfig:
    """Settings of the packing scheduler, validated when built (from Python or YAML through ``_target_``).

    Attributes:
        max_seqlen_per_dp_cp_rank: the most tokens (real and padding) one rank holds per micro-batch, CP-local.
        scheduler: one of ``SCHEDULERS``: ``dp_balanced`` (Megatron-Core's order-preserving packing, static CP),
            ``dynamic_cp`` (a CP size per packed group from the dynamic CP sizes), ``compute_balanced`` (static CP,
            balancing each rank's estimated cost ``cost_linear * L + cost_quadratic * L**2``).
        pad_packed_seq_alignment: an int ``N`` (``1 <= N <= max_seqlen_per_dp_cp_rank``): a rank's CP-local
            packed length is a multiple of ``N`` (before sequence parallelism); or ``"max"``: every rank's local
            length is ``max_seqlen_per_dp_cp_rank`` (fixed shapes).
        mxfp8: a rank's shard after sequence parallelism must be a multiple of 32 tokens (MXFP8 blocks).
        sequence_parallel: the CP-local length is split over the TP ranks, so it is a multiple of the TP size.
        vpp_size: virtual pipeline stages (None or 1: none).
        microbatch_group_size_per_vp_stage: with ``vpp_size > 1``, the micro-batch count is a multiple of this
            (default: the pipeline-parallel size, as in Megatron-Core); unused without VPP.
        max_num_seqs: at most this many real sequences in one group (None: no limit).
        min_dynamic_cp_size: the smallest CP size ``dynamic_cp`` gives a group.
        deterministic_mode, cuda_graphs, router_z_loss: the trainer's settings; each is refused with
            ``dynamic_cp``. ``cuda_graphs`` also needs fixed shapes: alignment ``"max"``.
        cost_linear, cost_quadratic: ``a`` and ``b`` of a sequence's estimated cost ``a*L + b*L**2`` (the defaults
            are a 7B model's ``12 h**2 L + 2 h L**2`` with ``h = 4096``, divided by ``2 h``).
        pad_token_id: input id written in padding (its labels are ``IGNORE_INDEX``).

    Raises:
        DataConfigError: a field of the wrong type or out of range, an unknown scheduler, an alignment above
            ``max_seqlen_per_dp_cp_rank``, CUDA graphs without alignment ``"max"``, or ``dynamic_cp`` with
            deterministic mode, CUDA graphs or the router z-loss (naming the field, its value and the fix).

    Example:
        ``PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=8192, scheduler="dynamic_cp", min_dynamic_cp_size=2)``
    """

    max_seqlen_per_dp_cp_rank: int
    scheduler: str = "dp_balanced"
    pad_packed_seq_alignment: int | str = 1
    mxfp8: bool = False
    sequence_parallel: bool = False
    vpp_size: int | None = None
    microbatch_group_size_per_vp_stage: int | None = None
    max_num_seqs: int | None = None
    min_dynamic_cp_size: int = 1
    deterministic_mode: bool = False
    cuda_graphs: bool = False
    router_z_loss: bool = False
    cost_linear: float = 24576.0
    cost_quadratic: float = 1.0
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        limit = _config_int(
            "max_seqlen_per_dp_cp_rank", self.max_seqlen_per_dp_cp_rank, 1, "the tokens one rank holds per micro-batch"
        )
        if self.scheduler not in SCHEDULERS:
            close = difflib.get_close_matches(str(self.scheduler), SCHEDULERS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise DataConfigError(f"scheduler is {self.scheduler!r}{hint}; use one of {', '.join(SCHEDULERS)}")
        alignment = self.pad_packed_seq_alignment
        if alignment != "max":
            if isinstance(alignment, str):
                raise DataConfigError(
                    f"pad_packed_seq_alignment is {alignment!r}; use an integer N (the CP-local length is a multiple "
                    "of N) or 'max' (every rank holds max_seqlen_per_dp_cp_rank tokens)"
                )
            alignment = _config_int("pad_packed_seq_alignment", alignment, 1, "an integer N, or 'max'")
            if alignment > limit:
                raise DataConfigError(
                    f"pad_packed_seq_alignment {alignment} is above max_seqlen_per_dp_cp_rank {limit}, so no "
                    f"aligned length fits on a rank; use an alignment <= {limit}, or 'max'"
                )
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool | np.bool_):
                raise DataConfigError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
        for name, meaning in (
            ("vpp_size", "the virtual pipeline stages of the trainer"),
            ("microbatch_group_size_per_vp_stage", "the micro-batches of one VPP stage group"),
            ("max_num_seqs", "the most real sequences of one packed group"),
        ):
            if getattr(self, name) is not None:
                _config_int(name, getattr(self, name), 1, f"None or {meaning}")
        _config_int("min_dynamic_cp_size", self.min_dynamic_cp_size, 1, "the smallest dynamic CP size (1 for any)")
        _config_int("pad_token_id", self.pad_token_id, 0, "a token id of the vocabulary (0 works: it is masked)")
        for name in ("cost_linear", "cost_quadratic"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
                raise DataConfigError(f"{name} must be a number >= 0, got {value!r} ({type(value).__name__})")
            if not math.isfinite(value) or value < 0:
                raise DataConfigError(f"{name} must be a finite number >= 0, got {value}")
        if self.cost_linear == 0 and self.cost_quadratic == 0:
            raise DataConfigError(
                "cost_linear and cost_quadratic are both 0, so every sequence would cost nothing; set at least one "
                "(the defaults 24576 and 1 model a 7B transformer)"
            )
        if self.scheduler == "dynamic_cp":
            for name, reason in _DYNAMIC_CONFLICTS.items():
                if getattr(self, name):
                    raise DataConfigError(
                        f"scheduler='dynamic_cp' cannot run with {name}=True: {reason}; set {name}=False, or use a "
                        "static scheduler ('dp_balanced' or 'compute_balanced')"
                    )
        if self.cuda_graphs and self.pad_packed_seq_alignment not in ("max", limit):
            raise DataConfigError(
                f"cuda_graphs=True needs fixed shapes, but pad_packed_seq_alignment is "
                f"{self.pad_packed_seq_alignment!r}; set pad_packed_seq_alignment to 'max' (or to "
                f"max_seqlen_per_dp_cp_rank, {limit})"
            )


def _config_int(name: str, value, minimum: int, meaning: str) -> int:
    try:
        return require_int(name, value, minimum)
    except DataConfigError as error:
        raise DataConfigError(f"{error}; set it to {meaning}") from None


# -- alignment --------------------------------------------------------------------------------------------------


def local_alignment(config: PackingSchedulerConfig, *, cp_size: int, tp_size: int) -> int:
    """The multiple of a rank's CP-local packed length.

    Args:
        config: the scheduler's settings.
        cp_size: the CP size of the group (2 when above 1: the ``zigzag_thd`` chunks make every local length even).
        tp_size: the TP size (counts with ``sequence_parallel`` and ``mxfp8``).

    Returns:
        ``lcm(N (1 for "max"), tp if sequence_parallel, 32 * tp_sp if mxfp8, 2 if cp_size > 1)`` with
        ``tp_sp = tp if sequence_parallel else 1``.

    Example:
        alignment 1, ``cp_size=2, tp_size=4, sequence_parallel=True, mxfp8=True``: 128.
    """
    cp = require_int("cp_size", cp_size, 1)
    tp = require_int("tp_size", tp_size, 1)
    tp_sp = tp if config.sequence_parallel else 1
    alignment = 1 if config.pad_packed_seq_alignment == "max" else config.pad_packed_seq_alignment
    return math.lcm(alignment, tp_sp, MXFP8_BLOCK * tp_sp if config.mxfp8 else 1, 2 if cp > 1 else 1)


def local_capacity(config: PackingSchedulerConfig, *, cp_size: int, tp_size: int) -> int:
    """The most real and padding tokens the scheduler gives one rank per micro-batch.

    Returns:
        ``max_seqlen_per_dp_cp_rank`` rounded down to ``local_alignment``; with alignment ``"max"``,
        ``max_seqlen_per_dp_cp_rank`` itself.

    Raises:
        DataConfigError: no aligned length fits (the alignment is above ``max_seqlen_per_dp_cp_rank``), or, with
            ``"max"``, ``max_seqlen_per_dp_cp_rank`` is not a multiple of the alignment; the message names both.
    """
    multiple = local_alignment(config, cp_size=cp_size, tp_size=tp_size)
    limit = config.max_seqlen_per_dp_cp_rank
    what = (
        f"the CP-local alignment {multiple} (pad_packed_seq_alignment {config.pad_packed_seq_alignment!r}, "
        f"sequence_parallel {config.sequence_parallel} with tp {tp_size}, mxfp8 {config.mxfp8}, cp {cp_size})"
    )
    if config.pad_packed_seq_alignment == "max" and limit % multiple:
        raise DataConfigError(
            f"pad_packed_seq_alignment='max' pads every rank to max_seqlen_per_dp_cp_rank {limit}, which is not a "
            f"multiple of {what}; set max_seqlen_per_dp_cp_rank to a multiple of {multiple}"
        )
    if limit < multiple:
        raise DataConfigError(
            f"max_seqlen_per_dp_cp_rank {limit} is below {what}, so no aligned length fits on a rank; raise "
            f"max_seqlen_per_dp_cp_rank to at least {multiple}"
        )
    return limit // multiple * multiple


def padded_lengths(lengths: np.ndarray, cp_size: int) -> np.ndarray:
    """Each length padded up to a multiple of ``2 * cp_size`` (the ``zigzag_thd`` chunks) when ``cp_size > 1``.

    Example:
        ``padded_lengths(np.array([5, 8, 1]), 2)`` is ``[8, 8, 4]``; with ``cp_size=1`` the lengths are unchanged.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if cp_size <= 1:
        return lengths
    return lengths + -lengths % (2 * cp_size)


def local_packed_length(config: PackingSchedulerConfig, padded_total: int, *, cp_size: int, tp_size: int) -> int:
    """The tokens every rank of a group of CP size ``cp_size`` holds for sequences of ``padded_total`` tokens.

    Args:
        padded_total: the sum of the group's ``padded_lengths`` (0 for a group of padding only).

    Returns:
        ``max_seqlen_per_dp_cp_rank`` with alignment ``"max"``; else ``padded_total / cp_size`` rounded up to the
        ``local_alignment``, at least one alignment (so a group without sequences is one padding sequence).
    """
    if config.pad_packed_seq_alignment == "max":
        return config.max_seqlen_per_dp_cp_rank
    multiple = local_alignment(config, cp_size=cp_size, tp_size=tp_size)
    local = -(-int(padded_total) // cp_size)
    return max(multiple, -(-local // multiple) * multiple)


def sequence_cost(lengths: np.ndarray, config: PackingSchedulerConfig) -> np.ndarray:
    """The estimated cost ``cost_linear * L + cost_quadratic * L**2`` of each length, float64."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return config.cost_linear * lengths + config.cost_quadratic * lengths * lengths


# -- the schedule -----------------------------------------------------------------------------------------------


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


def _static_schedule(bins: Sequence[Sequence[int]], dp_size: int, cp_size: int) -> Schedule:
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


# -- dp_balanced ------------------------------------------------------------------------------------------------


def schedule_dp_balanced(
    lengths: np.ndarray,
    *,
    dp_size: int,
    cp_size: int,
    capacity: int,
    multiple: int,
    max_num_seqs: int | None = None,
) -> Schedule:
    """Megatron-Core's ``DpBalancedScheduler``: order-preserving next-fit, then the group count aligned.

    1. Sequences in global id order go to the open group while its padded tokens stay within
       ``capacity * cp_size`` (and it holds fewer than ``max_num_seqs``); otherwise a new group opens with them.
    2. While the group count is not a multiple of ``multiple`` (``dp * vpp group``), the last sequence of the last
       group holding more than one moves into a new group at the end (walking back over singletons). Where no
       group can give one up, groups of padding only are added (so an empty DP rank still runs every micro-batch).
    3. Group ``m * dp + d`` is DP replica ``d``'s in micro-batch ``m`` (all its CP ranks share it).

    Args:
        lengths: real lengths in global id order (each must fit: ``build_schedule`` checks).
        capacity: tokens per rank (``local_capacity``).
        multiple: the group count's multiple.

    Returns:
        The ``Schedule``; micro-batch count = groups / dp.

    Example:
        lengths ``[6, 3, 5, 4, 2]``, dp 2, cp 1, capacity 10, multiple 2: micro-batches ``[[0, 1], [2]]`` and
        ``[[4], [3]]``.
    """
    padded = padded_lengths(lengths, cp_size)
    ends = np.concatenate([[0], np.cumsum(padded)])
    limit = capacity * cp_size
    bins: list[list[int]] = []
    start, count = 0, len(padded)
    while start < count:
        stop = max(start + 1, int(np.searchsorted(ends, ends[start] + limit, side="right")) - 1)
        if max_num_seqs is not None:
            stop = min(stop, start + max_num_seqs)
        bins.append(list(range(start, stop)))
        start = stop
    need = -len(bins) % multiple
    index = len(bins) - 1
    while need and index >= 0:
        if len(bins[index]) > 1:
            bins.append([bins[index].pop()])
            need -= 1
        else:
            index -= 1
    bins.extend([] for _ in range(need))
    return _static_schedule(bins, dp_size, cp_size)


# -- cost-balanced assignment (dynamic_cp and compute_balanced) ---------------------------------------------------


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


def _balanced_step(
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


def _fill_and_schedule(step: _Step, chain: Sequence[int], lengths: np.ndarray, unit: int) -> Schedule:
    """Grow groups over free neighbours (next size of ``chain``, if their sequences fit), pad the rest, build.

    ``unit`` is the positions one scheduling unit stands for (the static CP size for ``compute_balanced``, else
    1). Free positions left over become groups of padding only, of the smallest size.
    """
    owner, sizes_at, members = step.owner, step.size, step.members
    for micro_batch in range(step.count):
        grown = True
        while grown:
            grown = False
            for current, larger in zip(chain[:-1], chain[1:], strict=True):
                for first in np.flatnonzero(sizes_at[micro_batch] == current).tolist():
                    start = first - first % larger
                    block = owner[micro_batch, start : start + larger]
                    if np.count_nonzero(block >= 0) != current:
                        continue
                    ids = members[micro_batch, first]
                    if padded_lengths(lengths[ids], larger * unit).sum() > step.room * larger:
                        continue
                    block[:] = start
                    sizes_at[micro_batch, first] = 0
                    sizes_at[micro_batch, start] = larger
                    members[micro_batch, start] = members.pop((micro_batch, first))
                    grown = True
    smallest = chain[0]
    micro_batches = []
    for micro_batch in range(step.count):
        groups = []
        first = 0
        while first < step.units:
            size = int(sizes_at[micro_batch, first])
            if size:
                groups.append(ScheduledGroup(first * unit, size * unit, tuple(members[micro_batch, first])))
            else:
                groups.append(ScheduledGroup(first * unit, smallest * unit, ()))
            first += size or smallest
        micro_batches.append(tuple(groups))
    return Schedule(tuple(micro_batches))


def _micro_batch_step(multiple: int, per_micro_batch: int) -> int:
    """The least micro-batch count step keeping ``per_micro_batch * count`` a multiple of ``multiple``."""
    return multiple // math.gcd(multiple, per_micro_batch)


# -- dynamic_cp -------------------------------------------------------------------------------------------------


def schedule_dynamic_cp(
    lengths: np.ndarray,
    *,
    dp_size: int,
    cp_size: int,
    cp_sizes: Sequence[int],
    capacity: int,
    multiple: int,
    cost: np.ndarray,
    max_num_seqs: int | None = None,
) -> Schedule:
    """A CP size per packed group from ``cp_sizes``, balancing every position's cost over the step.

    1. Each sequence's least size ``c`` holds it (``padded_lengths(L, c) <= c * capacity``); its size is the least
       ``c >= that`` whose per-position cost ``cost / c`` stays within the step's mean position cost (so no
       sequence outweighs a position), the largest size when none does.
    2. The micro-batch count starts at the fewest that hold the padded tokens (a multiple of ``multiple``).
    3. Sequences by size then per-position cost, descending, each to the least-loaded aligned block of its size
       with room in some micro-batch (joining that block's group or opening one), the first such micro-batch.
       When one finds no room, the count grows by ``multiple`` and placement restarts.
    4. In every micro-batch, a group whose aligned neighbour block of the same size is free doubles to the next
       size (if its sequences still fit), until none can; positions still free get groups of padding only.

    Args:
        lengths: real lengths in global id order (each fits the largest size: ``build_schedule`` checks).
        dp_size, cp_size: the static grid; ``R = dp_size * cp_size`` positions.
        cp_sizes: the allowed sizes, ascending, each dividing the next and ``R``.
        capacity: tokens per rank (``local_capacity``).
        multiple: the micro-batch count's multiple (the VPP stage group).
        cost: each sequence's cost (``sequence_cost``).

    Returns:
        The ``Schedule``; deterministic for the same input.
    """
    positions = dp_size * cp_size
    chain = [int(size) for size in cp_sizes]
    lengths = np.asarray(lengths, dtype=np.int64)
    cost = np.asarray(cost, dtype=np.float64)
    least = np.full(len(lengths), chain[-1], dtype=np.int64)
    for size in reversed(chain):
        least = np.where(padded_lengths(lengths, size) <= capacity * size, size, least)
    step_size = _micro_batch_step(multiple, 1)
    tokens_needed = sum(int(padded_lengths(lengths[least == size], size).sum()) for size in chain)
    count = max(1, -(-tokens_needed // (positions * capacity)))
    count = -(-count // step_size) * step_size
    mean = float(cost.sum()) / (count * positions)
    sizes = least.copy()
    for size in chain:  # the least size keeping cost / size within the mean, never below the least that holds
        sizes = np.where((sizes < size) & (cost / sizes > mean), size, sizes)
    tokens = np.zeros(len(lengths), dtype=np.int64)
    for size in chain:
        tokens[sizes == size] = padded_lengths(lengths[sizes == size], size)
    step = _balanced_step(count, step_size, positions, capacity, sizes, tokens, cost, max_num_seqs)
    return _fill_and_schedule(step, chain, lengths, 1)


# -- compute_balanced -------------------------------------------------------------------------------------------


def schedule_compute_balanced(
    lengths: np.ndarray,
    *,
    dp_size: int,
    cp_size: int,
    capacity: int,
    multiple: int,
    cost: np.ndarray,
    max_num_seqs: int | None = None,
) -> Schedule:
    """Static CP; every DP replica's step cost balanced, in the fewest micro-batches that hold the sequences.

    The count starts at the fewest micro-batches whose ``dp`` groups of ``capacity * cp_size`` tokens hold the
    padded lengths (``dp * count`` a multiple of ``multiple``). Sequences by cost, descending (ties by id), go to
    the least-loaded DP replica that has room in one of its micro-batches, the first such micro-batch; when one
    finds no room the count grows and placement restarts.

    Args:
        lengths: real lengths in global id order (each fits: ``build_schedule`` checks).
        capacity: tokens per rank (``local_capacity``).
        multiple: the group count's multiple (``dp * vpp group``).
        cost: each sequence's cost (``sequence_cost`` of its padded length).

    Returns:
        The ``Schedule``: every group one DP replica's ``cp_size`` positions; deterministic.
    """
    padded = padded_lengths(lengths, cp_size)
    weights = np.asarray(cost, dtype=np.float64)
    step_size = _micro_batch_step(multiple, dp_size)
    count = max(1, -(-int(padded.sum()) // (dp_size * capacity * cp_size)))
    count = -(-count // step_size) * step_size
    units = np.ones(len(padded), dtype=np.int64)
    step = _balanced_step(count, step_size, dp_size, capacity * cp_size, units, padded, weights, max_num_seqs)
    return _fill_and_schedule(step, [1], np.asarray(lengths, dtype=np.int64), cp_size)


# -- the dispatcher ---------------------------------------------------------------------------------------------


def build_schedule(
    config: PackingSchedulerConfig,
    lengths: np.ndarray,
    *,
    dp_size: int,
    cp_size: int,
    tp_size: int,
    dynamic_cp_sizes: Sequence[int] = (),
    vpp_group: int = 1,
) -> Schedule:
    """The step's schedule by ``config.scheduler``, from every sequence's real length in global id order.

    Args:
        config: the scheduler's settings.
        lengths: int lengths (``>= 1``) of the step's sequences, DP-rank-major global id order.
        dp_size, cp_size, tp_size: the static grid (``R = dp_size * cp_size`` positions).
        dynamic_cp_sizes: the runtime CP sizes of the dynamic CP groups (``dynamic_cp`` only; each divides ``R``);
            sizes below ``min_dynamic_cp_size`` are not used.
        vpp_group: the micro-batch count is a multiple of this (the VPP stage group; 1 without VPP).

    Returns:
        The ``Schedule``. Static schedulers: ``dp * vpp_group`` divides the group count (so ``vpp_group`` divides
        the micro-batch count); ``dynamic_cp``: ``vpp_group`` divides the micro-batch count.

    Raises:
        DataFileError: ``lengths`` is empty (the global batch holds no sequence) or holds a length below 1.
        DataConfigError: a sequence that no allowed CP size can hold (naming its global id, length and padded
            length, and the setting to raise), bad sizes, or ``dynamic_cp`` without usable dynamic CP sizes.
    """
    if not isinstance(config, PackingSchedulerConfig):
        raise DataConfigError(f"config must be a PackingSchedulerConfig, got {type(config).__name__}")
    dp = require_int("dp_size", dp_size, 1)
    cp = require_int("cp_size", cp_size, 1)
    tp = require_int("tp_size", tp_size, 1)
    group = require_int("vpp_group", vpp_group, 1)
    lengths = _checked_lengths(lengths)
    if config.scheduler != "dynamic_cp":
        capacity = local_capacity(config, cp_size=cp, tp_size=tp)
        _check_fits(lengths, capacity, [cp], config, tp_size=tp, static=True)
        algorithm = schedule_dp_balanced if config.scheduler == "dp_balanced" else schedule_compute_balanced
        extra = (
            {} if config.scheduler == "dp_balanced" else {"cost": sequence_cost(padded_lengths(lengths, cp), config)}
        )
        return algorithm(
            lengths,
            dp_size=dp,
            cp_size=cp,
            capacity=capacity,
            multiple=dp * group,
            max_num_seqs=config.max_num_seqs,
            **extra,
        )
    sizes = _dynamic_sizes(config, dynamic_cp_sizes, dp * cp)
    # One capacity for every size: the largest size's alignment is a multiple of every smaller one's.
    capacity = local_capacity(config, cp_size=sizes[-1], tp_size=tp)
    _check_fits(lengths, capacity, sizes, config, tp_size=tp, static=False)
    return schedule_dynamic_cp(
        lengths,
        dp_size=dp,
        cp_size=cp,
        cp_sizes=sizes,
        capacity=capacity,
        multiple=group,
        cost=sequence_cost(lengths, config),
        max_num_seqs=config.max_num_seqs,
    )


def _checked_lengths(lengths) -> np.ndarray:
    array = np.asarray(lengths)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise DataFileError(f"lengths must be a 1-D integer array, got shape {array.shape} of {array.dtype}")
    if array.size == 0:
        raise DataFileError(
            "the global batch holds no sequence: no DP rank fetched a sequence this step, so there is nothing to "
            "schedule; check that the loader yields micro-batches with at least one non-empty sequence"
        )
    array = array.astype(np.int64)
    if int(array.min()) < 1:
        bad = int(np.argmin(array))
        raise DataFileError(f"sequence {bad} of the global batch has length {int(array[bad])}; lengths must be >= 1")
    return array


def _dynamic_sizes(config: PackingSchedulerConfig, dynamic_cp_sizes: Sequence[int], positions: int) -> list[int]:
    sizes = sorted({require_int("dynamic CP size", size, 1) for size in dynamic_cp_sizes})
    for size in sizes:
        if positions % size:
            raise DataConfigError(
                f"dynamic CP size {size} does not divide the {positions} DP x CP ranks; use sizes that divide it"
            )
    usable = [size for size in sizes if size >= config.min_dynamic_cp_size]
    for smaller, larger in zip(usable[:-1], usable[1:], strict=True):
        if larger % smaller:
            raise DataConfigError(
                f"dynamic CP sizes {usable} do not nest: {larger} is not a multiple of {smaller}, so their aligned "
                "blocks could leave positions no allowed size covers; use sizes that each divide the next (powers "
                "of two such as 1, 2, 4, 8)"
            )
    if not usable:
        raise DataConfigError(
            f"scheduler='dynamic_cp' has no dynamic CP size to use: the process groups hold sizes {sizes} and "
            f"min_dynamic_cp_size is {config.min_dynamic_cp_size}; build ProcessGroupCollection.from_mesh(mesh, "
            "dynamic_cp_sizes=...) with sizes that divide dp * cp, and at least one >= min_dynamic_cp_size"
        )
    return usable


def _check_fits(
    lengths: np.ndarray,
    capacity: int,
    sizes: Sequence[int],
    config: PackingSchedulerConfig,
    *,
    tp_size: int,
    static: bool,
) -> None:
    largest = sizes[-1]
    padded = padded_lengths(lengths, largest)
    over = np.flatnonzero(padded > capacity * largest)
    if not over.size:
        return
    index = int(over[np.argmax(lengths[over])])
    multiple = local_alignment(config, cp_size=largest, tp_size=tp_size)
    needed = -(-int(padded[index]) // (largest * multiple)) * multiple
    fix = (
        f"raise max_seqlen_per_dp_cp_rank to at least {needed}, or use a larger context-parallel size"
        if static
        else f"raise max_seqlen_per_dp_cp_rank to at least {needed}, or add larger dynamic CP sizes than "
        f"{largest} (dynamic_cp_sizes of ProcessGroupCollection.from_mesh)"
    )
    raise DataConfigError(
        f"sequence {index} of the global batch (length {int(lengths[index])}, padded to {int(padded[index])} for CP "
        f"size {largest}) does not fit {largest} rank(s) of {capacity} tokens (max_seqlen_per_dp_cp_rank "
        f"{config.max_seqlen_per_dp_cp_rank}, aligned); {len(over)} sequence(s) are too long; {fix}"
    )


# -- statistics -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopsStats:
    """What one step's schedule costs, the same on every rank.

    Attributes:
        num_micro_batches: the step's micro-batch count.
        seqlen_sum: the sum of the scheduled sequences' padded lengths (Megatron-Core's FLOPs input).
        seqlen_squared_sum: the sum of their squares.
        valid_tokens: real tokens scheduled (every token of the global batch, once).
        scheduled_tokens: the tokens the ranks hold: over micro-batches and positions, the local packed length.
        packing_efficiency: ``valid_tokens / scheduled_tokens``.
        max_rank_cost, mean_rank_cost: per position, the sum over the step's micro-batches of its group's cost
            (``sequence_cost`` of the padded lengths) divided by the group's CP size; their max and mean.
    """

    num_micro_batches: int
    seqlen_sum: float
    seqlen_squared_sum: float
    valid_tokens: int
    scheduled_tokens: int
    packing_efficiency: float
    max_rank_cost: float
    mean_rank_cost: float

    @property
    def imbalance(self) -> float:
        """``max_rank_cost / mean_rank_cost`` (1.0 when the mean is 0)."""
        return self.max_rank_cost / self.mean_rank_cost if self.mean_rank_cost else 1.0

    def as_tensor(self) -> torch.Tensor:
        """The fields in order as float64 ``[8]`` (what a broadcast sends)."""
        return torch.tensor([float(value) for value in astuple(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> FlopsStats:
        """The inverse of ``as_tensor``."""
        values = torch.as_tensor(tensor, dtype=torch.float64).reshape(-1).tolist()
        if len(values) != len(fields(cls)):
            raise ValueError(f"FlopsStats.from_tensor needs {len(fields(cls))} values, got {len(values)}")
        return cls(*(int(round(v)) if f.type == "int" else v for f, v in zip(fields(cls), values, strict=True)))


def schedule_stats(
    schedule: Schedule, lengths: np.ndarray, config: PackingSchedulerConfig, *, tp_size: int
) -> FlopsStats:
    """The ``FlopsStats`` of ``schedule`` over sequences of ``lengths`` (global id order)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    groups = [group for groups in schedule.micro_batches for group in groups]
    counts = np.fromiter((len(group.sequence_ids) for group in groups), dtype=np.int64, count=len(groups))
    sizes = np.fromiter((group.cp_size for group in groups), dtype=np.int64, count=len(groups))
    ids = np.fromiter((i for group in groups for i in group.sequence_ids), dtype=np.int64, count=int(counts.sum()))
    owner = np.repeat(np.arange(len(groups)), counts)
    real = lengths[ids]
    size = sizes[owner]
    padded = np.where(size > 1, real + -real % (2 * size), real)
    totals = np.bincount(owner, weights=padded, minlength=len(groups)).astype(np.int64)
    group_cost = np.bincount(owner, weights=sequence_cost(padded, config), minlength=len(groups))
    local = np.fromiter(
        (
            local_packed_length(config, int(total), cp_size=int(c), tp_size=tp_size)
            for total, c in zip(totals, sizes, strict=True)
        ),
        dtype=np.int64,
        count=len(groups),
    )
    positions = schedule.num_positions
    firsts = np.fromiter((group.first_position for group in groups), dtype=np.int64, count=len(groups))
    per_rank = group_cost / np.maximum(sizes, 1)
    # Each group adds its per-rank cost to the positions of its block: a difference array over positions.
    delta = np.bincount(firsts, weights=per_rank, minlength=positions + 1)
    delta -= np.bincount(firsts + sizes, weights=per_rank, minlength=positions + 1)
    rank_cost = np.cumsum(delta)[:positions]
    scheduled = int((local * sizes).sum())
    valid = int(real.sum())
    return FlopsStats(
        num_micro_batches=schedule.num_micro_batches,
        seqlen_sum=float(padded.sum()),
        seqlen_squared_sum=float((padded.astype(np.float64) ** 2).sum()),
        valid_tokens=valid,
        scheduled_tokens=scheduled,
        packing_efficiency=valid / scheduled if scheduled else 0.0,
        max_rank_cost=float(rank_cost.max()) if positions else 0.0,
        mean_rank_cost=float(rank_cost.mean()) if positions else 0.0,
    )
