"""The keys a loader reads, in order, and the position after the batches its caller has consumed.

Owns: handing a key source's batches of keys (indices, or ``(position, record)`` pairs) to a
``torch.utils.data.DataLoader`` that fetches them, possibly ahead in workers; knowing which of them the caller has
not consumed; and the state that restarts reading right after what it consumed. Not responsible for: where keys
come from and what a source keeps (``key_sources``), what the loaders make of the fetched samples
(``build_dataloader``), tokenizing, or packing.

State of a ``TrackedDataLoader``::

    {"kind": the source's kind ("mapping" or "iterable"), checked by the source,
     "position": sampler state (mapping) | stream cursor (iterable),
     "replay": key batches taken but not consumed, read again first,
     "replay_epoch": the epoch they belong to (if the source has moved past it, the replay ends the epoch)}

A mapping source rewinds its sampler to the state before the oldest unconsumed batch (so the replay holds only
keys of partly consumed reads); a stream cannot rewind, so every unconsumed record is replayed. A state is checked
whole before anything is restored: the tracker checks ``replay`` and ``replay_epoch``, the key source its kind, its
keys and its DP placement, and the sampler or stream its position.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.utils.data

from hyper_parallel.data.batching.key_sources import KeyBatch, MappingKeys, StreamKeys
from hyper_parallel.data.batching.worker_errors import raise_worker_failure
from hyper_parallel.data.errors import ResumeStateError
from hyper_parallel.data.resume_checks import check_state_type, state_field

__all__ = ["TrackedDataLoader"]

_WHERE = "the loader state['source']"


class TrackedDataLoader:
    """A torch DataLoader over source keys that knows which taken keys the caller has not consumed yet.

    It is also the DataLoader's ``batch_sampler``: the DataLoader iterates it in this process to get keys. Key
    batches to read again (after a restore) come first, then the source's; if the source has meanwhile moved to
    the next epoch, the replayed batches end the current one.

    Args:
        batches_per_read: source batches per read; the dynamic loader reads several at once, since its output does
            not depend on how records are grouped into reads.
        reads_per_fetch: reads the DataLoader fetches in one call, handed to the caller one read at a time (the
            fetch's output must then be a list with one entry per key). Reads of a fetch not yet consumed are
            pending as prefetched ones are: a mapping source's sampler rewinds before them (its state is the one of
            one read per fetch), a stream replays them (its state resumes the same batches).
    """

    def __init__(
        self,
        source: MappingKeys | StreamKeys,
        worker_dataset,
        collate_fn: Callable,
        loader_options: dict,
        batches_per_read: int,
        reads_per_fetch: int = 1,
    ) -> None:
        if not isinstance(reads_per_fetch, int) or isinstance(reads_per_fetch, bool) or reads_per_fetch < 1:
            raise ValueError(f"reads_per_fetch must be a positive int, got {reads_per_fetch!r}")
        self.source = source
        self.batches_per_read = batches_per_read
        self.reads_per_fetch = reads_per_fetch
        self.unconsumed: deque[KeyBatch] = deque()
        self._fetch_reads: deque[int] = deque()  # how many of the unconsumed reads each fetch in flight holds
        self.replay: deque[list] = deque()  # key batches to read again before the source's
        self.replay_epoch: int | None = None  # the epoch the replayed keys belong to
        self._generation = 0
        self.loader = torch.utils.data.DataLoader(
            worker_dataset, batch_sampler=self, collate_fn=collate_fn, **loader_options
        )

    def _pulls(self) -> Iterator[KeyBatch]:
        while self.replay:
            yield KeyBatch(self.replay.popleft(), self.replay_epoch, replayed=True)
        replay_epoch, self.replay_epoch = self.replay_epoch, None
        if replay_epoch is None or replay_epoch == self.source.epoch:
            yield from self.source.pull(self.batches_per_read)

    def __iter__(self) -> Iterator[list]:
        generation = self._generation
        pulls = self._pulls()
        # An iteration superseded by a newer one stops taking keys, so no key is lost between the two.
        while generation == self._generation:
            fetch = list(itertools.islice(pulls, self.reads_per_fetch))
            if not fetch:
                return
            self.unconsumed.extend(fetch)
            self._fetch_reads.append(len(fetch))
            yield fetch[0].keys if len(fetch) == 1 else [key for pulled in fetch for key in pulled.keys]

    def __len__(self) -> int:
        return len(self.source)

    def rewind(self, partly_consumed: KeyBatch | None = None) -> None:
        """After an abandoned iteration: continue after what the caller consumed."""
        if self.unconsumed or partly_consumed:
            self._restore(self.state_dict(partly_consumed))

    def batches(self) -> Iterator[tuple[KeyBatch, object]]:
        """``(key batch, DataLoader output)`` pairs from the current position to the end of the epoch."""
        self.rewind()
        self._generation += 1
        for output in self.loader:
            raise_worker_failure(output)  # before taking the keys: as without workers, they stay unconsumed
            reads = self._fetch_reads.popleft()
            if reads == 1:  # the output as the collate made it (a fixed loader's is a batch, not a list)
                yield self.unconsumed.popleft(), output
                continue
            start = 0
            for _ in range(reads):
                pulled = self.unconsumed.popleft()
                end = start + len(pulled.keys)
                yield pulled, output[start:end]
                start = end

    def reads_whole_epoch(self) -> bool:
        """Whether the next ``batches()`` reads the source's current epoch from its beginning."""
        self.rewind()
        return not self.replay and self.source.in_fresh_epoch()

    def state_dict(self, partly_consumed: KeyBatch | None = None) -> dict:
        """The position after what the caller consumed.

        Args:
            partly_consumed: the unused rest of a delivered batch, marked ``replayed`` (it is read again first).
        """
        pending = ([partly_consumed] if partly_consumed else []) + list(self.unconsumed)
        replayed = [pulled.keys for pulled in pending if pulled.replayed]
        fresh = [pulled for pulled in pending if not pulled.replayed]
        position, fresh_replay = self.source.position(fresh)
        replay = replayed + fresh_replay + list(self.replay)
        replay_epoch = pending[0].epoch if pending else self.replay_epoch
        return {
            "kind": self.source.kind,
            "position": position,
            "replay": replay,
            "replay_epoch": replay_epoch if replay else None,
        }

    def next_epoch(self, partly_consumed: KeyBatch | None = None) -> int:
        """The epoch of the next key after what the caller consumed (the replay's, else the source's)."""
        pending = [partly_consumed] if partly_consumed else list(self.unconsumed)
        if pending:
            return pending[0].epoch
        return self.replay_epoch if self.replay else self.source.epoch

    def check_state(
        self,
        state: Mapping,
        saved_placement: tuple[int, int] | None = None,
        *,
        packs_per_rank: bool = False,
        holds_samples: bool = False,
    ) -> None:
        """Refuse a malformed state, or one the source cannot continue, naming the key and what it must be.

        Args:
            saved_placement: the DP rank and size the state was saved at, for the source to check that it can
                continue here (``packs_per_rank``, ``holds_samples``: see ``MappingKeys.check_placement``).
        """
        where = _WHERE
        check_state_type(state, Mapping, where)
        self.source.check_kind(state_field(state, "kind", str, where), "the state")
        position = state_field(state, "position", Mapping, where)
        replay = state_field(state, "replay", list, where)
        if saved_placement is not None:
            self.source.check_placement(
                position, bool(replay), saved_placement, packs_per_rank=packs_per_rank, holds_samples=holds_samples
            )
        epoch = self.source.check_position(position)
        for index, keys in enumerate(replay):
            check_state_type(keys, list, f"{where}['replay'][{index}]")
            self.source.check_keys(keys, f"{where}['replay'][{index}]")
        replay_epoch = state_field(state, "replay_epoch", (int, None), where)
        # The replayed keys belong to the position's epoch, or end the one before (the source moved on): any other
        # epoch would silently skip or repeat one.
        if replay and (replay_epoch is None or not epoch - 1 <= replay_epoch <= epoch):
            raise ResumeStateError(
                f"{where}['replay_epoch'] is {replay_epoch!r}, but the replayed keys must belong to the position's "
                f"epoch {epoch} or the one before; the state is damaged: restore it as saved, or start without it"
            )

    def load_state_dict(self, state: dict) -> None:
        """Continue after what ``state`` describes (checked whole first: a refused state changes nothing)."""
        self.check_state(state)
        self._restore(state)

    def _restore(self, state: dict) -> None:
        self._generation += 1
        self.unconsumed.clear()
        self._fetch_reads.clear()
        self.source.restore(state["position"])
        self.replay = deque(state["replay"])
        self.replay_epoch = state["replay_epoch"]

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.source.epoch:
            self.source.set_epoch(epoch)
            self.unconsumed.clear()
            self._fetch_reads.clear()
            self.replay.clear()
            self.replay_epoch = None
