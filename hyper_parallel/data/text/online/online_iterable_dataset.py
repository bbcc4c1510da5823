"""The Online iterable source: a Hugging Face stream (``streaming=True``), sharded by DP rank and buffer-shuffled.

Owns: reading records in blocks, giving each DP rank a disjoint share (together they cover the data),
shuffling with a seeded bounded buffer, epochs, a cursor that can be saved, checked and restored exactly (the
shuffle buffer included), and the identity of the files read. Not responsible for: tokenization (the transform) or
batching (the loaders).

How a stream is read::

    Hugging Face IterableDataset (files in order)
      -> split_dataset_by_node(rank, world)   whole files per rank when they divide evenly, else every world-th record
      -> blocks of _BLOCK_RECORDS records      one Arrow-to-Python conversion per block; the records of the current
                                               block not yet taken are part of the cursor
      -> shuffle buffer of B records           seeded with (seed, epoch, dp_rank): each new record replaces and
                                               releases a random buffered one; the rest drain at the end
      -> (position, record)                    position counts this rank's records in the epoch

A handover (an elastic change of the DP size, ``batching.elastic``) gives every rank of the new DP size ``D'`` the
rest of one epoch that the ``D`` ranks of the old split had begun: the new rank reads each old rank's share in
turn (``split_dataset_by_node(s, D)``), from where that rank's cursor had read it to (its Hugging Face state), and
keeps the ``j``-th record read of share ``s`` when ``(j + s) % D' == dp_rank``; the records the old ranks had read
but not delivered are handed to the new ranks by the loader. A handover of a handover adds a level: the records
each rank of the previous one had dealt itself below its frontier (its count dealt) are left out, and the rest
dealt again. The next epoch is read with the new split.
"""

from __future__ import annotations

import copy
import itertools
import os
from collections import deque
from collections.abc import Mapping, Sequence

import numpy as np

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataFileError, ResumeStateError
from hyper_parallel.data.resume_checks import check_state_type, data_identity, state_field
from hyper_parallel.data.text.records import data_file_entries

__all__ = ["OnlineIterableDataset", "epoch_start_cursor", "handover_cursor"]

logger = get_logger(__name__)

_STATE_VERSION = 2  # 2 adds the current block ("block", "block_records"); a version 1 state still loads
_LOADABLE_VERSIONS = (1, 2)
_BLOCK_RECORDS = 128  # records converted from Arrow at once; a saved cursor holds at most this many of them
_SLOT_DRAWS = 128  # shuffle-buffer slots drawn at once (the same slots as one draw per record)
# Cursor fields that must equal this stream's settings, and why.
_SETTINGS = (
    ("dp_world_size", "each DP rank reads its own share of a stream, so the shares would differ"),
    ("dp_rank", "the state holds another rank's cursor and buffer"),
    ("seed", "the shuffle order depends on it"),
    ("shuffle_buffer_size", "the shuffle order depends on it"),
)


class OnlineIterableDataset:
    """Records on demand: "give me the next records".

    Args:
        hf_dataset: a ``datasets.IterableDataset``.
        description: where the records come from, used in messages.
        dp_rank, dp_world_size: this rank's share of the stream.
        shuffle_buffer_size: records held for shuffling; 0 keeps the file order.
        seed: seeds the shuffle (with the epoch and the DP rank).
        files: the files the stream reads, whose identity loader states record.
    """

    def __init__(
        self,
        hf_dataset,
        description: str,
        *,
        files: Sequence[str | os.PathLike] = (),
        dp_rank: int = 0,
        dp_world_size: int = 1,
        shuffle_buffer_size: int = 10_000,
        seed: int = 1234,
    ) -> None:
        self.hf_dataset = hf_dataset
        self.description = description
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.shuffle_buffer_size = shuffle_buffer_size
        self.seed = seed
        self.files = list(files)
        self._identity: dict | None = None
        self._plain_arrow = _reads_as_plain_arrow(hf_dataset)
        self._start_epoch(0)

    # Cursor --------------------------------------------------------------------------------------------------

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0
        self._source_state: dict | None = None
        self._source_exhausted = False
        self._buffer: list = []
        self._block: deque = deque()  # records of the current block not yet shuffled in or given out
        self._block_records = _BLOCK_RECORDS  # a source state counts blocks of this size
        self._rng = np.random.default_rng([self.seed, epoch, self.dp_rank])
        self._drawn_from: dict | None = None  # the generator's state before the slots drawn ahead, if any
        self._drawn_bounds = np.empty(0, dtype=np.int64)  # the bounds of the slots drawn ahead
        self._slots_taken = 0  # of the slots drawn ahead
        self._records = None
        self._handover: dict | None = None  # the old split's shares this epoch is read from, after a DP change

    def _share(self, rank: int, world_size: int):
        """Share ``rank`` of ``world_size`` of the stream; plain Arrow rows are read as Arrow tables (the same records
        and cursor, in one conversion per block)."""
        from datasets.distributed import split_dataset_by_node

        shard = split_dataset_by_node(self.hf_dataset, rank=rank, world_size=world_size)
        return shard.with_format("arrow") if self._plain_arrow else shard

    def _blocks(self, shard):
        """The shard's records, a block of ``_block_records`` at a time, each as a list of record dicts."""
        if self._plain_arrow:
            return (table.to_pylist() for table in shard.iter(batch_size=self._block_records))
        return (_column_records(columns) for columns in shard.iter(batch_size=self._block_records))

    def _rank_share(self, restore: bool = True):
        shard = self._share(self.dp_rank, self.dp_world_size)
        if restore and self._source_state is not None:
            shard.load_state_dict(self._source_state)
        return shard

    def _generate(self):
        """This epoch's records from the current cursor; keeps the cursor consistent at every ``yield``."""
        buffer, size = self._buffer, self.shuffle_buffer_size
        if not self._source_exhausted:
            records = self._source_records(self._rank_share()) if self._handover is None else self._handover_records()
            slots: list[int] = []
            for record in records:
                if size == 0:
                    yield record
                elif len(buffer) < size:
                    buffer.append(record)
                else:
                    if self._slots_taken == len(slots):
                        slots = self._draw_slots(np.full(_SLOT_DRAWS, size))
                    slot = slots[self._slots_taken]
                    self._slots_taken += 1
                    released, buffer[slot] = buffer[slot], record
                    yield released
            self._source_exhausted = True
        for slot in self._draw_slots(np.arange(len(buffer), 0, -1)):  # the whole drain at once
            self._slots_taken += 1
            buffer[slot], buffer[-1] = buffer[-1], buffer[slot]
            yield buffer.pop()

    def _draw_slots(self, bounds: np.ndarray) -> list[int]:
        """Shuffle slots below ``bounds``, drawn at once after the slots taken so far; the generator's state after
        each slot taken is recovered by drawing the taken ones again (``_rng_state``)."""
        self._rng.bit_generator.state = self._rng_state()
        self._drawn_from, self._drawn_bounds, self._slots_taken = self._rng.bit_generator.state, bounds, 0
        return self._rng.integers(bounds).tolist()

    def _rng_state(self) -> dict:
        """The shuffle generator's state after the slots taken: a block of draws leaves a generator where as many
        single draws would, so the taken slots drawn again from the state before them give it."""
        if self._drawn_from is None or self._slots_taken == len(self._drawn_bounds):
            return self._rng.bit_generator.state
        replay = np.random.default_rng()
        replay.bit_generator.state = self._drawn_from
        replay.integers(self._drawn_bounds[: self._slots_taken])
        return replay.bit_generator.state

    def _source_records(self, shard):
        """The rest of the current block, then the shard's records block by block; the cursor (the source state
        after the block, the block's records not yet taken) stays exact at every ``yield``."""
        block = self._block
        while block:
            yield block.popleft()
        blocks = self._blocks(shard)
        while (records := self._next_block(blocks)) is not None:
            self._source_state = shard.state_dict()  # after this block, whose untaken records the cursor holds
            block.extend(records)
            while block:
                yield block.popleft()

    def _handover_records(self):
        """This rank's records of the old split's shares, from the current share on (see the module description);
        the cursor (the share, its Hugging Face state after the block, the block's records not yet dealt, the count
        dealt) stays exact at every ``yield``."""
        handover, block = self._handover, self._block
        shares, old_size = handover["shares"], handover["base_world_size"]
        while handover["share"] < old_size:
            share = handover["share"]
            if not shares[share]["done"]:
                shard = self._share(share, old_size)
                start = self._source_state if self._source_state is not None else shares[share]["source_state"]
                if start is not None:
                    shard.load_state_dict(start)
                blocks = self._blocks(shard)
                while True:
                    while block:
                        record = block.popleft()
                        if self._dealt_here(share):
                            yield record
                    records = self._next_block(blocks)
                    if records is None:
                        break
                    self._source_state = shard.state_dict()
                    block.extend(records)
            handover.update(share=share + 1, dealt=[0] * len(handover["dealt"]))
            self._source_state = None

    def _dealt_here(self, share: int) -> bool:
        """Whether the next record of ``share`` is this rank's: each earlier handover level dealt it to a rank that
        had not reached it (at or past that rank's frontier), and this one deals it here."""
        handover = self._handover
        dealt = handover["dealt"]
        for level, step in enumerate(handover["levels"]):
            index = dealt[level]
            dealt[level] += 1
            frontier = step["frontiers"][share][(index + share) % step["deal_world_size"]]
            if frontier is None or index < frontier:  # that rank had it: delivered, or handed over as a record
                return False
        index = dealt[-1]
        dealt[-1] += 1
        return (index + share) % self.dp_world_size == self.dp_rank

    def _next_block(self, blocks):
        """The next block of a shard's block iterator, as records; None at its end (a read error names the
        source)."""
        try:
            return next(blocks)
        except StopIteration:
            return None
        except Exception as error:  # noqa: BLE001 - the readers raise many types; all get the source named
            raise DataFileError(
                f"{self.description}: reading the stream failed after {self.position} records of DP rank "
                f"{self.dp_rank} (epoch {self.epoch}): {error}. Fix or remove the malformed record"
            ) from error

    @property
    def handing_over(self) -> bool:
        """Whether the current epoch is read from the old split's shares, after a DP change."""
        return self._handover is not None

    def read(self, max_records: int) -> list[tuple[int, dict]]:
        """Up to ``max_records`` next ``(position, record)`` pairs; an empty list ends the epoch and starts the next."""
        if self._records is None:
            self._records = self._generate()
        records = list(itertools.islice(self._records, max_records))
        if not records:
            logger.debug(
                "DP rank %d's stream of %s: epoch %d ended after %d records",
                self.dp_rank,
                self.description,
                self.epoch,
                self.position,
            )
            self._start_epoch(self.epoch + 1)
            return []
        taken = list(enumerate(records, self.position))
        self.position += len(taken)
        return taken

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless the stream is already in it."""
        if epoch != self.epoch:
            self._start_epoch(epoch)

    # Resume --------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The cursor: source position after the current block, the block's untaken records, the shuffle buffer's
        records and the shuffle generator's state."""
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "seed": self.seed,
            "shuffle_buffer_size": self.shuffle_buffer_size,
            "source_state": self._source_state,
            "source_exhausted": self._source_exhausted,
            "block": list(self._block),
            "block_records": self._block_records,
            "buffer": list(self._buffer),
            "rng": self._rng_state(),
            **({"handover": copy.deepcopy(self._handover)} if self._handover is not None else {}),
        }

    def check_state(self, state: Mapping) -> None:
        """Refuse a cursor this stream cannot continue: malformed, of another version, rank or shuffle."""
        where = "the stream cursor"
        check_state_type(state, Mapping, where)
        version = state.get("version")
        if version not in _LOADABLE_VERSIONS:
            raise ResumeStateError(
                f"stream state version {version!r} is not supported (expected one of {_LOADABLE_VERSIONS}); "
                "it was saved by an incompatible release"
            )
        for key, why in _SETTINGS:
            if state_field(state, key, int, where) != getattr(self, key):
                raise ResumeStateError(
                    f"cannot resume the stream of {self.description}: the state has {key}={state[key]!r} but this "
                    f"run has {getattr(self, key)!r}, and {why}. Resume with the same value, or start a new epoch "
                    "without the state"
                )
        for key in ("epoch", "position"):
            if state_field(state, key, int, where) < 0:
                raise ResumeStateError(f"{where}['{key}'] is {state[key]}; it counts from 0")
        state_field(state, "source_exhausted", bool, where)
        handover = state.get("handover")
        if handover is not None:
            self._check_handover(handover, f"{where}['handover']")
        if state_field(state, "source_state", (Mapping, None), where) is not None:
            _check_like(state["source_state"], self._shard_template(handover), f"{where}['source_state']")
        if version >= 2:
            _check_block(state, where)
        buffer = state_field(state, "buffer", list, where)
        if len(buffer) > self.shuffle_buffer_size:
            raise ResumeStateError(
                f"{where}['buffer'] holds {len(buffer)} records, more than the shuffle buffer's "
                f"{self.shuffle_buffer_size}; the state belongs to another stream"
            )
        for index, record in enumerate(buffer):
            check_state_type(record, Mapping, f"{where}['buffer'][{index}]")
        rng = state_field(state, "rng", Mapping, where)
        try:
            np.random.default_rng(0).bit_generator.state = rng  # a scratch generator: nothing changes on failure
        except (TypeError, ValueError, KeyError) as error:
            raise ResumeStateError(f"{where}['rng'] is not a numpy PCG64 generator state ({error})") from None

    def _check_handover(self, handover, where: str) -> None:
        """Check a handover: the old split's size, one share entry per old rank, the share being read."""
        check_state_type(handover, Mapping, where)
        old_size = state_field(handover, "base_world_size", int, where)
        shares = state_field(handover, "shares", list, where)
        if old_size < 1 or len(shares) != old_size:
            raise ResumeStateError(f"{where} holds {len(shares)} shares of an old split of {old_size}; it is damaged")
        levels = state_field(handover, "levels", list, where)
        dealt = state_field(handover, "dealt", list, where)
        if not 0 <= state_field(handover, "share", int, where) <= old_size or len(dealt) != len(levels) + 1:
            raise ResumeStateError(f"{where}['share'] or ['dealt'] does not fit its levels; the state is damaged")
        for index, count in enumerate(dealt):
            check_state_type(count, int, f"{where}['dealt'][{index}]")
        for index, level in enumerate(levels):
            name = f"{where}['levels'][{index}]"
            check_state_type(level, Mapping, name)
            size = state_field(level, "deal_world_size", int, name)
            frontiers = state_field(level, "frontiers", list, name)
            if len(frontiers) != old_size or any(
                not isinstance(share, list) or len(share) != size for share in frontiers
            ):
                raise ResumeStateError(f"{name}['frontiers'] must hold {size} counts for each of {old_size} shares")
            for share in frontiers:
                for count in share:
                    check_state_type(count, (int, None), f"{name}['frontiers']")
        for index, share in enumerate(shares):
            name = f"{where}['shares'][{index}]"
            check_state_type(share, Mapping, name)
            state_field(share, "done", bool, name)
            if state_field(share, "source_state", (Mapping, None), name) is not None:
                template = self._share(index, old_size).state_dict()
                _check_like(share["source_state"], template, f"{name}['source_state']")

    def _shard_template(self, handover: Mapping | None) -> dict:
        """A fresh Hugging Face state of the shard a cursor's ``source_state`` belongs to: this rank's, or in a
        handover the old share being read."""
        if handover is None or handover["share"] >= handover["base_world_size"]:
            return self._rank_share(restore=False).state_dict()
        return self._share(handover["share"], handover["base_world_size"]).state_dict()

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from the cursor ``state`` (checked first: a refused state changes nothing)."""
        self.check_state(state)
        self._start_epoch(int(state["epoch"]))
        self.position = int(state["position"])
        self._source_state = state["source_state"]
        self._source_exhausted = state["source_exhausted"]
        self._buffer = list(state["buffer"])
        # A version 1 state counted single records: read the rest of its epoch one record at a time.
        self._block = deque(state.get("block", ()))
        self._block_records = state.get("block_records", 1)
        self._rng.bit_generator.state = state["rng"]
        self._handover = copy.deepcopy(state.get("handover"))

    def data_identity(self) -> dict | None:
        """The identity (paths, sizes, modification times) of the files read, taken when first asked; None when
        the files are not known."""
        if self._identity is None and self.files:
            self._identity = data_identity(self.description, data_file_entries(self.files))
        return self._identity

    def __repr__(self) -> str:
        return (
            f"OnlineIterableDataset({self.description}, dp {self.dp_rank}/{self.dp_world_size}, "
            f"shuffle buffer {self.shuffle_buffer_size}, epoch {self.epoch})"
        )


def epoch_start_cursor(*, epoch: int, dp_rank: int, dp_world_size: int, seed: int, shuffle_buffer_size: int) -> dict:
    """The cursor of DP rank ``dp_rank`` of ``dp_world_size`` at the start of ``epoch``, nothing read (what
    ``state_dict()`` gives there)."""
    return {
        "version": _STATE_VERSION,
        "epoch": epoch,
        "position": 0,
        "dp_rank": dp_rank,
        "dp_world_size": dp_world_size,
        "seed": seed,
        "shuffle_buffer_size": shuffle_buffer_size,
        "source_state": None,
        "source_exhausted": False,
        "block": [],
        "block_records": _BLOCK_RECORDS,
        "buffer": [],
        "rng": np.random.default_rng([seed, epoch, dp_rank]).bit_generator.state,
    }


def handover_cursor(*, shares: list[dict], base_world_size: int, levels: list[dict], **placement) -> dict:
    """The cursor at the start of a handover of an epoch (``placement``: as for ``epoch_start_cursor``): ``shares``
    (one per rank of the old split of ``base_world_size``: ``{"source_state": its Hugging Face state, or None from
    the start, "done": whether the old rank had read all of it}``) and the ``levels`` of earlier handovers of the
    same epoch (``{"deal_world_size", "frontiers": per share, per rank of that size, its count dealt, None for
    all}``)."""
    handover = {
        "base_world_size": base_world_size,
        "shares": shares,
        "levels": levels,
        "share": 0,
        "dealt": [0] * (len(levels) + 1),
    }
    return {**epoch_start_cursor(**placement), "handover": handover}


def _check_block(state: Mapping, where: str) -> None:
    """Check a version 2 cursor's current block: its block size and the records not yet taken from it."""
    block_records = state_field(state, "block_records", int, where)
    if block_records < 1:
        raise ResumeStateError(f"{where}['block_records'] is {block_records}; a block holds at least one record")
    block = state_field(state, "block", list, where)
    if len(block) >= block_records:
        raise ResumeStateError(
            f"{where}['block'] holds {len(block)} untaken records of a block of {block_records}; the state is damaged"
        )
    for index, record in enumerate(block):
        check_state_type(record, Mapping, f"{where}['block'][{index}]")


def _reads_as_plain_arrow(hf_dataset) -> bool:
    """Whether the records of ``hf_dataset`` are its Arrow tables' rows as they are: no output format, and no
    feature (image, audio...) that ``datasets`` decodes when read."""
    from datasets.features.features import require_decoding

    features = getattr(hf_dataset, "features", None)
    return getattr(hf_dataset, "_formatting", None) is None and not any(
        require_decoding(feature) for feature in (features or {}).values()
    )


def _column_records(columns: Mapping[str, list]) -> list[dict]:
    """A block read as columns (``{name: values}``) as one record dict per row."""
    names = list(columns)
    return [dict(zip(names, row, strict=True)) for row in zip(*columns.values(), strict=True)]


def _check_like(value, template, name: str) -> None:
    """Check a saved Hugging Face stream state against the layout of a fresh one (``template``), before it is
    handed to ``datasets``, which would fail on a malformed one only later, mid-read, with a bare KeyError."""
    if template is None:  # e.g. "previous_state": None at first, a nested state later
        check_state_type(value, (Mapping, None), name)
    elif isinstance(template, Mapping):
        check_state_type(value, Mapping, name)
        for key, inner in template.items():
            if key not in value:
                raise ResumeStateError(
                    f"{name} has no {key!r}; the state was saved by another release of datasets or is damaged"
                )
            _check_like(value[key], inner, f"{name}[{key!r}]")
    elif isinstance(template, str) and value != template:
        raise ResumeStateError(
            f"{name} is {value!r} but this stream's is {template!r}: the state was saved over data read another way "
            "(another file format or release of datasets); resume with the same data and release"
        )
    else:
        check_state_type(value, bool if isinstance(template, bool) else type(template), name)
