"""Data-parallel batch sampler for map-style datasets: which dataset indices each rank reads, step by step.

Owns: the per-epoch order of sample positions (``single``: in order; ``cyclic``: a fresh permutation each
epoch), how one micro-step of ``micro_batch_size * dp_world_size`` positions is split between data-parallel
ranks, the optional per-rank data sharding, the optional rearrange map to physical dataset indices (checked to
hold indices of the dataset, and hashed into the state), the resumable position (epoch, consumed samples) with
its checks, and the two validated option groups the loaders share with it: ``BatchLayout`` (batch sizes and
the rank layout) and ``SamplerOptions`` (order and seed). Plans are pure numpy functions; the sampler is a thin
stateful iterator over them that ``torch.utils.data.DataLoader(batch_sampler=...)`` consumes. Ranks are plain
integers. Not responsible for: ``torch.distributed``, reading samples (the datasets), collation (``batching``),
or accounting for batches a ``DataLoader`` has prefetched but the trainer has not consumed yet.

Layout without data sharding, ``M = micro_batch_size * dp_world_size``: micro-step ``b`` covers epoch positions
``[b*M, (b+1)*M)`` and rank ``r`` reads the contiguous slice ``[b*M + r*mbs, b*M + (r+1)*mbs)``. An optimizer step
of ``global_batch_size`` samples is ``global_batch_size / M`` consecutive micro-steps, so global batch ``g`` is
exactly the positions ``[g*gbs, (g+1)*gbs)`` whatever the DP size and micro batch size. This is why a checkpoint
taken at a step boundary resumes exactly with another DP size.

Example, 10 samples, mbs 2, dp 2, gbs 4, ``single``, ``drop_last``: the epoch holds positions 0..7 (two complete
steps); rank 0 reads ``[0, 1]``, ``[4, 5]``, rank 1 reads ``[2, 3]``, ``[6, 7]``.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from xxhash import xxh3_64

from hyper_parallel.data.errors import DataConfigError, DataFileError, ResumeStateError, require_int

__all__ = [
    "MAX_SEED",
    "RETIRED_SAMPLER_TYPES",
    "SAMPLER_TYPES",
    "STATE_VERSION",
    "BatchLayout",
    "DatasetBatchSampler",
    "SamplerOptions",
    "bitmap_positions",
    "cyclic_order",
    "epoch_length",
    "load_rearrange_map",
    "num_micro_steps",
    "pending_positions",
    "rearrange_map_identity",
    "rank_batch_positions",
    "rank_num_batches",
    "remaining_bitmap",
    "sharded_bucket",
]

SAMPLER_TYPES = ("single", "cyclic")
# Sampler types of earlier hyper_parallel releases -> why they are refused and what to write instead.
RETIRED_SAMPLER_TYPES = {
    "distributed": (
        "torch DistributedSampler's order (padded by repeating samples, strided over DP ranks) is not available; "
        "use sampler_type 'cyclic' for a shuffled order (a new seeded permutation every epoch; what "
        "'distributed' with sampler_shuffle: true gave) or 'single' for the order of the data (sampler_shuffle: "
        "false), and drop sampler_shuffle and sampler_drop_last"
    ),
}
STATE_VERSION = 1
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's largest seed; numpy's generators take any seed >= 0

_INT32_LIMIT = 2**31
_STATE_KEYS = (
    "version",
    "sampler_type",
    "epoch",
    "consumed_samples",
    "total_samples",
    "global_batch_size",
    "micro_batch_size",
    "dp_world_size",
    "seed",
    "data_sharding",
    "drop_last",
)
# Entries of a rearrange map read at a time: checking and hashing a memory-mapped map never loads it whole.
_MAP_CHUNK = 1 << 20


def _index_dtype(total: int) -> type[np.integer]:
    return np.int32 if total < _INT32_LIMIT else np.int64


# -- options ------------------------------------------------------------------------------------------------------


def _set(instance, name: str, value) -> None:
    object.__setattr__(instance, name, value)  # a frozen dataclass normalising its own fields in __post_init__


@dataclass(frozen=True, kw_only=True)
class BatchLayout:
    """Batch sizes and the data-parallel layout: which samples each rank's micro-batch holds.

    Args:
        micro_batch_size: samples per micro-batch on each rank.
        global_batch_size: samples per optimizer step over all ranks; default (None) and resolved here:
            ``micro_batch_size * dp_world_size``; must be a multiple of it.
        dp_rank, dp_world_size: this rank and the data-parallel size.

    Raises:
        DataConfigError: a value is not an integer in range, or the global batch does not split into micro-batches.
    """

    micro_batch_size: int = 1
    global_batch_size: int | None = None
    dp_rank: int = 0
    dp_world_size: int = 1

    def __post_init__(self) -> None:
        _set(self, "micro_batch_size", require_int("micro_batch_size", self.micro_batch_size, 1))
        _set(self, "dp_world_size", require_int("dp_world_size", self.dp_world_size, 1))
        _set(self, "dp_rank", require_int("dp_rank", self.dp_rank, 0))
        if self.dp_rank >= self.dp_world_size:
            raise DataConfigError(
                f"dp_rank {self.dp_rank} is out of range for dp_world_size {self.dp_world_size}; ranks are "
                f"0..{self.dp_world_size - 1}"
            )
        micro_step = self.micro_step
        global_batch_size = micro_step if self.global_batch_size is None else self.global_batch_size
        _set(self, "global_batch_size", require_int("global_batch_size", global_batch_size, 1))
        if self.global_batch_size % micro_step:
            raise DataConfigError(
                f"global_batch_size {self.global_batch_size} is not a multiple of micro_batch_size "
                f"{self.micro_batch_size} x dp_world_size {self.dp_world_size} = {micro_step}; set it to a multiple "
                f"of {micro_step} (gradient accumulation steps = global_batch_size / {micro_step})"
            )

    @property
    def micro_step(self) -> int:
        """Samples of one micro-step over all ranks: ``micro_batch_size * dp_world_size``."""
        return self.micro_batch_size * self.dp_world_size


@dataclass(frozen=True, kw_only=True)
class SamplerOptions:
    """How a mapping source's samples are ordered, and the seed of the loaders' generators.

    Args:
        sampler_type: ``single`` (positions in order) or ``cyclic`` (``default_rng([seed, epoch]).permutation``);
            the ``distributed`` type of earlier hyper_parallel releases is refused with what to use instead.
        data_sharding: ``cyclic`` only: each rank reads its own contiguous bucket of the epoch, in its own
            per-epoch permutation (see ``sharded_bucket``); better locality, not resumable with another DP size.
        data_rearrange_map: logical index -> physical dataset index (an array, a list or a ``.npy`` path),
            checked against the dataset's length when the sampler is built (``load_rearrange_map``).
        drop_last: keep only complete global batches (``total % global_batch_size`` positions are left out each
            epoch); a stream drops its incomplete last micro-batch of records.
        seed: seeds the ``cyclic`` orders and the loaders' torch generators.

    Raises:
        DataConfigError: an unknown sampler type, a flag that is not a bool, data sharding without the cyclic
            order, or a seed outside [0, 2**64 - 1].
    """

    sampler_type: str = "single"
    data_sharding: bool = False
    data_rearrange_map: Any = None
    drop_last: bool = True
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.sampler_type not in SAMPLER_TYPES:
            retired = RETIRED_SAMPLER_TYPES.get(self.sampler_type) if isinstance(self.sampler_type, str) else None
            if retired:
                raise DataConfigError(f"sampler_type {self.sampler_type!r}: {retired}")
            raise DataConfigError(f"unknown sampler_type {self.sampler_type!r}; choose one of {list(SAMPLER_TYPES)}")
        for name in ("drop_last", "data_sharding"):
            flag = getattr(self, name)
            if not isinstance(flag, bool | np.bool_):
                raise DataConfigError(f"{name} must be a bool, got {flag!r}; write true or false, unquoted")
            _set(self, name, bool(flag))
        if self.data_sharding and self.sampler_type != "cyclic":
            raise DataConfigError(
                f"data_sharding needs sampler_type 'cyclic' (got {self.sampler_type!r}); the 'single' order is "
                "already sequential, so set data_sharding to false or use the cyclic sampler"
            )
        _set(self, "seed", _checked_seed(self.seed))


def _checked_seed(seed) -> int:
    try:
        value = None if isinstance(seed, bool | np.bool_) else operator.index(seed)
    except TypeError:
        value = None
    if value is None or not 0 <= value <= MAX_SEED:
        raise DataConfigError(
            f"seed must be an integer in [0, 2**64 - 1] (it seeds torch generators and the cyclic orders), got {seed!r}"
        )
    return value


def _option_values(options) -> dict[str, Any]:
    """An option dataclass's fields as keyword arguments (``dataclasses.asdict`` would deep-copy arrays)."""
    return {field.name: getattr(options, field.name) for field in fields(options)}


# -- pure plans ---------------------------------------------------------------------------------------------------


def epoch_length(total_samples: int, global_batch_size: int, drop_last: bool) -> int:
    """Positions one epoch covers: whole global batches only with ``drop_last``, else every sample.

    Dropping ``total % global_batch_size`` (rather than a remainder of the micro-step) keeps every optimizer
    step complete and makes the epoch independent of the DP size.
    """
    return total_samples - total_samples % global_batch_size if drop_last else total_samples


def num_micro_steps(epoch_len: int, micro_batch_size: int, dp_world_size: int) -> int:
    """Micro-steps in an epoch of ``epoch_len`` positions (the last one may be partial without ``drop_last``)."""
    return -(-epoch_len // (micro_batch_size * dp_world_size))


def rank_batch_positions(
    micro_step: int, *, micro_batch_size: int, dp_rank: int, dp_world_size: int, epoch_len: int
) -> range:
    """Epoch positions that rank ``dp_rank`` reads at ``micro_step`` (no data sharding); O(1).

    Returns:
        ``range(b*M + r*mbs, b*M + (r+1)*mbs)`` clipped at ``epoch_len``; empty when the rank has nothing left in
        the epoch's final, partial micro-step.
    """
    start = min(micro_step * micro_batch_size * dp_world_size + dp_rank * micro_batch_size, epoch_len)
    return range(start, min(start + micro_batch_size, epoch_len))


def _bucket_bounds(epoch_len: int, dp_rank: int, dp_world_size: int) -> tuple[int, int]:
    """``[begin, end)`` of rank ``dp_rank``'s bucket: equal sizes, the first ``epoch_len % dp`` one larger."""
    size, extra = divmod(epoch_len, dp_world_size)
    begin = dp_rank * size + min(dp_rank, extra)
    return begin, begin + size + (dp_rank < extra)


def rank_num_batches(
    *, epoch_len: int, micro_batch_size: int, dp_rank: int, dp_world_size: int, data_sharding: bool
) -> int:
    """Batches rank ``dp_rank`` reads in a whole epoch; they are the epoch's first micro-steps."""
    if data_sharding:
        begin, end = _bucket_bounds(epoch_len, dp_rank, dp_world_size)
        return -(-(end - begin) // micro_batch_size)
    remaining = epoch_len - dp_rank * micro_batch_size
    return max(0, -(-remaining // (micro_batch_size * dp_world_size)))


def cyclic_order(total_samples: int, *, seed: int, epoch: int) -> np.ndarray:
    """The ``cyclic`` order of an epoch: ``np.random.default_rng([seed, epoch]).permutation(total_samples)``.

    Built by shuffling an ``arange`` in place, which draws the same numbers as ``permutation`` and so gives the
    same order, in int32 when the indices fit (half the memory of int64 for large datasets).
    """
    order = np.arange(total_samples, dtype=_index_dtype(total_samples))
    np.random.default_rng([seed, epoch]).shuffle(order)
    return order


def sharded_bucket(epoch_len: int, *, dp_rank: int, dp_world_size: int, seed: int, epoch: int) -> np.ndarray:
    """Rank ``dp_rank``'s positions in the order it reads them, with data sharding.

    The epoch's positions ``0..epoch_len-1`` are split into ``dp_world_size`` contiguous buckets (equal with
    ``drop_last``; otherwise the first ``epoch_len % dp`` are one larger), so each rank reads one contiguous
    stretch of the dataset; each rank permutes its bucket with ``default_rng([seed, epoch, dp_rank])``.
    """
    begin, end = _bucket_bounds(epoch_len, dp_rank, dp_world_size)
    bucket = np.arange(begin, end, dtype=_index_dtype(epoch_len))
    np.random.default_rng([seed, epoch, dp_rank]).shuffle(bucket)
    return bucket


def remaining_bitmap(positions: np.ndarray, total_samples: int) -> bytes:
    """Epoch positions as a state stores them: a bitmap of ``total_samples`` bits, one per position, packed (the
    length does not depend on the global batch size, which may change with the DP size)."""
    bits = np.zeros(total_samples, dtype=bool)
    bits[positions] = True
    return np.packbits(bits).tobytes()


def bitmap_positions(bitmap: bytes, total_samples: int) -> np.ndarray:
    """The positions set in a packed bitmap of ``total_samples`` bits, in epoch order."""
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), count=total_samples)
    return np.flatnonzero(bits).astype(_index_dtype(total_samples))


def pending_positions(
    plan: np.ndarray, consumed: int, *, micro_batch_size: int, dp_rank: int, dp_world_size: int
) -> np.ndarray:
    """The epoch positions of ``plan`` that rank ``dp_rank`` has still to read after ``consumed`` of them (all ranks
    together, a micro-step boundary): its slices of the micro-steps from there on, in its reading order."""
    step = micro_batch_size * dp_world_size
    offsets = np.arange(consumed, len(plan))
    return plan[consumed:][(offsets % step) // micro_batch_size == dp_rank]


def _map_chunks(array: np.ndarray, total_samples: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(start, entries)`` over the first ``total_samples`` entries of a map, ``_MAP_CHUNK`` at a time."""
    for start in range(0, total_samples, _MAP_CHUNK):
        yield start, np.asarray(array[start : min(start + _MAP_CHUNK, total_samples)])


def load_rearrange_map(data_rearrange_map: Any, total_samples: int) -> np.ndarray | None:
    """Validate a rearrange map (logical index -> physical dataset index) given as an array, list or ``.npy`` path.

    A ``.npy`` file is memory-mapped and its values are checked a chunk at a time, so a large map costs no memory
    until batches read it. Only the first ``total_samples`` entries are read (and checked); longer maps are allowed.

    Raises:
        DataFileError: the file is missing or unreadable, or the array it holds is not a 1-D integer array at
            least ``total_samples`` long whose entries are physical indices in ``[0, total_samples)``.
        DataConfigError: the same problems with an in-memory map.
    """
    if data_rearrange_map is None:
        return None
    if isinstance(data_rearrange_map, str | os.PathLike):
        path = Path(data_rearrange_map)
        where, error = f"data_rearrange_map file {path}", DataFileError
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as failure:
            raise DataFileError(
                f"{where} cannot be read as a .npy array ({failure}); save it with numpy.save"
            ) from None
        if not isinstance(array, np.ndarray):  # e.g. an .npz archive, which holds several arrays
            raise DataFileError(f"{where} holds {type(array).__name__}, not one array; save it with numpy.save")
    else:
        where, error = "data_rearrange_map", DataConfigError
        array = np.asarray(data_rearrange_map)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise error(f"{where} must be a 1-D integer array, got shape {array.shape} and dtype {array.dtype}")
    if len(array) < total_samples:
        raise error(
            f"{where} holds {len(array)} entries but total_samples is {total_samples}; it needs one physical "
            "index per logical sample"
        )
    for start, entries in _map_chunks(array, total_samples):
        if entries.min() >= 0 and entries.max() < total_samples:
            continue
        position = int(np.flatnonzero((entries < 0) | (entries >= total_samples))[0])
        raise error(
            f"{where}: entry {start + position} is {int(entries[position])}, which is not an index of the dataset's "
            f"{total_samples} samples (every entry must be in [0, {total_samples})); the map was made for other "
            "data: rebuild it for this dataset, or set data_rearrange_map to the map made for it"
        )
    return array


def rearrange_map_identity(rearrange_map: np.ndarray, total_samples: int) -> str:
    """What a resume compares of a rearrange map: its length and the xxh3 of the entries it uses.

    The entries are hashed as little-endian int64, so the same order saved in another integer dtype is the same map.
    """
    digest = xxh3_64()
    for _, entries in _map_chunks(rearrange_map, total_samples):
        digest.update(entries.astype("<i8", copy=False).tobytes())
    return f"{total_samples} entries, xxh3_64 {digest.hexdigest()}"


# -- the sampler --------------------------------------------------------------------------------------------------


class DatasetBatchSampler:
    """Yields this rank's micro-batches (``list[int]`` of dataset indices) for a map-style dataset.

    Iterating yields the batches from the current position to the end of the current epoch, then moves to the
    next epoch and stops; the next ``iter()`` yields that epoch. The position advances before each batch is
    yielded, so right after ``next()`` returns, ``state_dict()`` describes the position after that batch. Only the
    most recent iterator is live: starting a new one, ``set_epoch`` or ``load_state_dict`` ends the earlier ones.

    Args:
        total_samples: length of the map-style dataset (logical samples).
        micro_batch_size, global_batch_size, dp_rank, dp_world_size: see ``BatchLayout``.
        consumed_samples: global positions of ``epoch`` already consumed (all ranks together); a multiple of
            ``micro_batch_size * dp_world_size``, or the epoch's length (then the next epoch starts).
        epoch: the epoch to start in; ``cyclic`` draws a new order per epoch.
        sampler_type, data_sharding, data_rearrange_map, drop_last, seed: see ``SamplerOptions``.

    Raises:
        DataConfigError: an argument is invalid or two contradict each other.
        DataFileError: the rearrange map file cannot be read or is malformed.
    """

    def __init__(
        self,
        *,
        total_samples: int,
        micro_batch_size: int,
        global_batch_size: int | None = None,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        consumed_samples: int = 0,
        epoch: int = 0,
        drop_last: bool = True,
        data_rearrange_map: Any = None,
        sampler_type: str = "single",
        data_sharding: bool = False,
        seed: int = 1234,
    ) -> None:
        self.total_samples = require_int("total_samples", total_samples, 1)
        layout = BatchLayout(
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
        )
        options = SamplerOptions(
            sampler_type=sampler_type,
            data_sharding=data_sharding,
            data_rearrange_map=data_rearrange_map,
            drop_last=drop_last,
            seed=seed,
        )
        self.micro_batch_size, self.global_batch_size = layout.micro_batch_size, layout.global_batch_size
        self.dp_rank, self.dp_world_size = layout.dp_rank, layout.dp_world_size
        self.sampler_type, self.seed = options.sampler_type, options.seed
        self.drop_last, self.data_sharding = options.drop_last, options.data_sharding
        self.epoch_len = epoch_length(self.total_samples, self.global_batch_size, self.drop_last)
        if self.epoch_len == 0:
            raise DataConfigError(
                f"total_samples {self.total_samples} is smaller than global_batch_size {self.global_batch_size} "
                "with drop_last, so an epoch would hold no complete step; lower global_batch_size or set "
                "drop_last to false"
            )
        self.rearrange_map = load_rearrange_map(options.data_rearrange_map, self.total_samples)
        self.num_micro_steps = num_micro_steps(self.epoch_len, self.micro_batch_size, self.dp_world_size)
        # After an elastic change of the DP size: the positions of the current epoch left to read (all ranks), in
        # epoch order; the epoch's micro-steps then cover these instead of every position. None: the whole epoch.
        self._remaining: np.ndarray | None = None
        self._order_cache: tuple[int, np.ndarray] | None = None  # (epoch, cyclic order or sharded bucket)
        self._generation = 0  # bumped by every new iterator and state change; older iterators then stop
        epoch = require_int("epoch", epoch, 0)
        consumed = require_int("consumed_samples", consumed_samples, 0)
        problem = self._position_problem(consumed, layout.micro_step, self.epoch_len)
        if problem:
            raise DataConfigError(f"consumed_samples {consumed}: {problem}")
        self._set_position(epoch, consumed)

    @cached_property
    def rearrange_map_identity(self) -> str | None:
        """The rearrange map as states record it (``rearrange_map_identity``), or None without a map; hashed when
        first asked, so a run that saves no state never reads a large map whole."""
        if self.rearrange_map is None:
            return None
        return rearrange_map_identity(self.rearrange_map, self.total_samples)

    @classmethod
    def from_options(cls, total_samples: int, layout: BatchLayout, options: SamplerOptions) -> DatasetBatchSampler:
        """The sampler of one rank at the start of epoch 0, from the option groups a loader holds."""
        return cls(total_samples=total_samples, **_option_values(layout), **_option_values(options))

    # -- position -------------------------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def consumed_samples(self) -> int:
        """Global positions of the current epoch already handed out (all ranks together)."""
        return self._consumed

    @staticmethod
    def _position_problem(consumed: int, micro_step: int, length: int) -> str | None:
        """Why ``consumed`` is not a micro-step boundary of ``length`` positions cut in micro-steps of
        ``micro_step``."""
        if consumed > length:
            return f"beyond the epoch, which holds {length} positions"
        if consumed % micro_step and consumed != length:
            return f"not a multiple of micro_batch_size x dp_world_size = {micro_step} (nor the epoch end)"
        return None

    @staticmethod
    def _normalized(epoch: int, consumed: int, length: int) -> tuple[int, int]:
        # The epoch's end is the next epoch's start: store it that way so no empty epoch is ever iterated.
        return (epoch + 1, 0) if consumed >= length else (epoch, consumed)

    def _set_position(self, epoch: int, consumed: int, remaining: np.ndarray | None = None) -> None:
        length = self.epoch_len if remaining is None else len(remaining)
        self._epoch, self._consumed = self._normalized(epoch, consumed, length)
        self._remaining = remaining if self._epoch == epoch else None
        self._generation += 1

    @property
    def _plan_len(self) -> int:
        """Positions the current epoch's micro-steps cover."""
        return self.epoch_len if self._remaining is None else len(self._remaining)

    @property
    def _rank_batches(self) -> int:
        return rank_num_batches(
            epoch_len=self._plan_len,
            micro_batch_size=self.micro_batch_size,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world_size,
            data_sharding=self.data_sharding,
        )

    @property
    def reads_remaining(self) -> bool:
        """Whether the current epoch reads only the positions an elastic change of the DP size left to read."""
        return self._remaining is not None

    def physical_indices(self, positions: np.ndarray, epoch: int | None = None) -> np.ndarray:
        """The dataset indices at ``positions`` of ``epoch``'s order (default: the current epoch's), rearrange map
        applied (no data sharding)."""
        if self.sampler_type == "single":
            values = np.asarray(positions)
        elif epoch is None or epoch == self._epoch:
            values = self._order()[positions]
        else:
            values = cyclic_order(self.total_samples, seed=self.seed, epoch=epoch)[positions]
        return values if self.rearrange_map is None else self.rearrange_map[values]

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``, unless it is already the current epoch (then keep the position)."""
        epoch = require_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._set_position(epoch, 0)

    def _micro_step(self) -> int:
        return self._consumed // (self.micro_batch_size * self.dp_world_size)

    def __len__(self) -> int:
        """Batches this rank still gets in the current epoch."""
        return max(0, self._rank_batches - self._micro_step())

    # -- batches --------------------------------------------------------------------------------------------------

    def _order(self) -> np.ndarray:
        """The current epoch's cyclic order, or this rank's sharded bucket; built once per epoch."""
        if self._order_cache is None or self._order_cache[0] != self._epoch:
            if self.data_sharding:
                order = sharded_bucket(
                    self.epoch_len,
                    dp_rank=self.dp_rank,
                    dp_world_size=self.dp_world_size,
                    seed=self.seed,
                    epoch=self._epoch,
                )
            else:
                order = cyclic_order(self.total_samples, seed=self.seed, epoch=self._epoch)
            self._order_cache = (self._epoch, order)
        return self._order_cache[1]

    def batch_indices(self, micro_step: int) -> list[int]:
        """Dataset indices this rank reads at ``micro_step`` of the current epoch; O(micro_batch_size)."""
        mbs = self.micro_batch_size
        if self.data_sharding:
            values = self._order()[micro_step * mbs : (micro_step + 1) * mbs]
        else:
            positions = rank_batch_positions(
                micro_step,
                micro_batch_size=mbs,
                dp_rank=self.dp_rank,
                dp_world_size=self.dp_world_size,
                epoch_len=self._plan_len,
            )
            if self._remaining is not None:
                return self.physical_indices(self._remaining[positions.start : positions.stop]).tolist()
            if self.sampler_type == "single":  # identity order: a slice of positions, never a full array
                if self.rearrange_map is None:
                    return list(positions)
                return self.rearrange_map[positions.start : positions.stop].tolist()
            values = self._order()[positions.start : positions.stop]
        if self.rearrange_map is not None:
            values = self.rearrange_map[values]
        return values.tolist()

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's remaining batches of the current epoch; afterwards the position is the next epoch's start."""
        self._generation += 1
        generation = self._generation
        micro_step_size = self.micro_batch_size * self.dp_world_size
        first, last = self._micro_step(), self._rank_batches
        if first >= last:  # nothing left for this rank in this epoch (only in a partial final micro-step)
            self._set_position(self._epoch + 1, 0)
            return
        for step in range(first, last):
            batch = self.batch_indices(step)
            if step + 1 == last:  # this rank's last batch of the epoch: the position after it is the next epoch
                self._set_position(self._epoch + 1, 0)
                generation = self._generation
            else:
                self._consumed = (step + 1) * micro_step_size
            yield batch
            if self._generation != generation:  # a newer iterator, set_epoch or load_state_dict took over
                return

    # -- checkpointing --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position and the settings it depends on, as a small plain dict."""
        state = {
            "version": STATE_VERSION,
            "sampler_type": self.sampler_type,
            "epoch": self._epoch,
            "consumed_samples": self._consumed,
            "total_samples": self.total_samples,
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "dp_world_size": self.dp_world_size,
            "seed": self.seed,
            "data_sharding": self.data_sharding,
            "drop_last": self.drop_last,
            "data_rearrange_map": self.rearrange_map_identity,
        }
        if self._remaining is not None:  # only while an epoch handed over by an elastic change is read
            state["remaining"] = remaining_bitmap(self._remaining, self.total_samples)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the position of ``state``, after checking it (``check_state``); a refused state changes nothing.

        Raises:
            ResumeStateError: the state is malformed, of an unknown version, or cannot be resumed exactly here.
        """
        epoch, consumed, remaining = self._checked_position(state)
        self._set_position(epoch, consumed, remaining if epoch == state["epoch"] else None)

    def saved_remaining(self, state: Mapping[str, Any]) -> np.ndarray | None:
        """The positions a state's ``remaining`` bitmap holds (None: the whole epoch), checked."""
        bitmap = state.get("remaining")  # states saved before elastic changes hold none
        if bitmap is None:
            return None
        if not isinstance(bitmap, bytes) or len(bitmap) != -(-self.total_samples // 8):
            raise ResumeStateError(
                f"the batch sampler state's remaining must be a bitmap of {-(-self.total_samples // 8)} bytes (one "
                f"bit per position of the {self.total_samples} samples), got {type(bitmap).__name__} of "
                f"{len(bitmap) if isinstance(bitmap, bytes) else '?'}; the checkpoint is damaged: restore it as "
                "saved, or start without it"
            )
        return bitmap_positions(bitmap, self.total_samples)

    def check_state(self, state: Mapping[str, Any]) -> tuple[int, int]:
        """Check that ``state`` describes the same data order and a position this sampler can continue from.

        The DP size and micro batch size may differ from the saved ones (same global batch size) when the state
        is at an optimizer-step boundary: global batch ``g`` is the same positions for every layout. With data
        sharding the DP size must match, since each rank's bucket depends on it.

        Returns:
            The ``(epoch, consumed_samples)`` the state resumes at (the end of an epoch is the next one's start).

        Raises:
            ResumeStateError: the state is malformed, of an unknown version, or cannot be resumed exactly here.
        """
        return self._checked_position(state)[:2]

    def _checked_position(self, state: Mapping[str, Any]) -> tuple[int, int, np.ndarray | None]:
        """``check_state``'s position, and the positions of its ``remaining`` bitmap (decoded once)."""
        if not isinstance(state, Mapping):
            raise ResumeStateError(f"a batch sampler state must be a dict, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ResumeStateError(
                f"unknown batch sampler state version {state.get('version')!r} (this code reads version "
                f"{STATE_VERSION}); resume with the code that wrote the checkpoint"
            )
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ResumeStateError(f"the batch sampler state lacks {missing}; the checkpoint is incomplete")
        # Settings that change the data order itself: resuming with any of them changed would not continue it.
        checks = [
            ("sampler_type", self.sampler_type),
            ("total_samples", self.total_samples),
            ("drop_last", self.drop_last),
            ("data_sharding", self.data_sharding),
            ("global_batch_size", self.global_batch_size),
        ]
        if self.sampler_type == "cyclic":  # the single order does not use the seed
            checks.append(("seed", self.seed))
        for key, current in checks:
            if state[key] != current:
                raise ResumeStateError(
                    f"cannot resume the batch sampler: the checkpoint has {key}={state[key]!r} but this run has "
                    f"{key}={current!r}, which gives a different sample order; restore the checkpoint's {key} or "
                    "start the data from scratch"
                )
        # States saved before the map was recorded hold no key: they were saved without a map.
        saved_map = state.get("data_rearrange_map")
        if not isinstance(saved_map, str | None):
            raise ResumeStateError(
                f"the batch sampler state's data_rearrange_map must be a string or None, got {saved_map!r}; the "
                "checkpoint is damaged: restore it as saved, or start without it"
            )
        if saved_map != self.rearrange_map_identity:
            raise ResumeStateError(
                f"cannot resume the batch sampler: the checkpoint was saved with data_rearrange_map "
                f"{saved_map or 'none'} but this run has {self.rearrange_map_identity or 'none'}, which gives a "
                "different sample order; resume with the checkpoint's data_rearrange_map, or start the data from "
                "scratch"
            )
        epoch = require_int("the saved epoch", state["epoch"], 0, ResumeStateError)
        consumed = require_int("the saved consumed_samples", state["consumed_samples"], 0, ResumeStateError)
        saved_mbs = require_int("the saved micro_batch_size", state["micro_batch_size"], 1, ResumeStateError)
        saved_dp = require_int("the saved dp_world_size", state["dp_world_size"], 1, ResumeStateError)
        remaining = self.saved_remaining(state)
        length = self.epoch_len if remaining is None else len(remaining)
        problem = self._position_problem(consumed, saved_mbs * saved_dp, length)
        if problem:
            raise ResumeStateError(f"the saved consumed_samples {consumed} is invalid: {problem}")
        if saved_dp != self.dp_world_size and self.data_sharding:
            raise ResumeStateError(
                f"cannot resume with dp_world_size {self.dp_world_size}: the checkpoint used {saved_dp} with "
                "data_sharding, where each rank walks its own bucket of the data and the buckets depend on the DP "
                f"size; resume with dp_world_size {saved_dp}, or turn data_sharding off for elastic resumption"
            )
        layout_changed = saved_dp != self.dp_world_size or saved_mbs != self.micro_batch_size
        if layout_changed and consumed % self.global_batch_size and consumed != length:
            raise ResumeStateError(
                f"cannot resume with dp_world_size {self.dp_world_size} and micro_batch_size "
                f"{self.micro_batch_size}: the checkpoint (dp_world_size {saved_dp}, micro_batch_size {saved_mbs}) "
                f"was taken in the middle of an optimizer step (consumed_samples {consumed} is not a multiple of "
                f"global_batch_size {self.global_batch_size}), and the rest of that step is split differently "
                "between ranks; resume with the saved layout, or from a checkpoint taken at a step boundary"
            )
        return (*self._normalized(epoch, consumed, length), remaining)
