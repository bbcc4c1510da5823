"""The keys a loader reads, in order, and the position after the batches its caller has consumed.

Owns: turning a mapping source's DP batch sampler or an iterable source's stream into batches of keys (indices, or
``(position, record)`` pairs) that a ``torch.utils.data.DataLoader`` fetches, possibly ahead in workers; knowing
which of them the caller has not consumed; and the state that restarts reading right after what it consumed.
Not responsible for: what the loaders make of the fetched samples (``build_dataloader``), tokenizing, or packing.

State of a ``TrackedDataLoader``::

    {"position": sampler state (mapping) | stream cursor (iterable),
     "replay": key batches taken but not consumed, read again first,
     "replay_epoch": the epoch they belong to (if the source has moved past it, the replay ends the epoch)}

A mapping source rewinds its sampler to the state before the oldest unconsumed batch (so the replay holds only
keys of partly consumed reads); a stream cannot rewind, so every unconsumed record is replayed. A state is checked
whole before anything is restored: the tracker checks ``replay`` and ``replay_epoch``, each key source its keys,
and the sampler or stream its position.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.utils.data

from hyper_parallel.data.batching.worker_errors import raise_worker_failure
from hyper_parallel.data.errors import ResumeStateError
from hyper_parallel.data.resume_checks import check_state_type, state_field
from hyper_parallel.data.text.transform_dataset import IterableTransformDataset

__all__ = ["KeyBatch", "MappingKeys", "StreamKeys", "TrackedDataLoader"]


@dataclass
class KeyBatch:
    """A key batch the torch DataLoader has taken from the source (or from the replay list)."""

    keys: list
    epoch: int
    sampler_state: dict | None = None  # mapping sources: the sampler's state before this batch
    replayed: bool = False


class MappingKeys:
    """Index batches from the DP batch sampler, a pure function of ``(epoch, consumed_samples)``.

    Unconsumed batches are described by rewinding the sampler to the state before the oldest of them.
    """

    kind = "mapping"

    def __init__(self, dataset, sampler) -> None:
        self.dataset = dataset
        self.sampler = sampler

    def pull(self, batches_per_read: int) -> Iterator[KeyBatch]:
        batches = iter(self.sampler)
        while True:
            before = self.sampler.state_dict()
            keys = []
            for batch in itertools.islice(batches, batches_per_read):
                keys += batch
            if not keys:
                return
            yield KeyBatch(keys, before["epoch"], before)

    def position(self, unconsumed: list[KeyBatch]) -> tuple[dict, list[list]]:
        """The state to restore and the key batches to read again first."""
        return (unconsumed[0].sampler_state if unconsumed else self.sampler.state_dict()), []

    def check_position(self, state: Mapping) -> int:
        """Check a saved sampler state; returns the epoch it resumes in."""
        return self.sampler.check_state(state)[0]

    def check_keys(self, keys: list, name: str) -> None:
        size = len(self.dataset)
        for position, index in enumerate(keys):
            check_state_type(index, int, f"{name}[{position}]")
            if not 0 <= index < size:
                raise ResumeStateError(
                    f"{name}[{position}] is record {index}, but the dataset has {size} records; the state was saved "
                    "over other data: resume with the same data, or start without the state"
                )

    def restore(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def at_epoch_start(self, state: dict) -> bool:
        return state["consumed_samples"] == 0

    def in_fresh_epoch(self) -> bool:
        return self.sampler.consumed_samples == 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)


class StreamKeys:
    """Record batches read from an iterable source in this process; the workers only tokenize them.

    The stream's cursor is always ahead of the caller, so unconsumed records are kept and read again first.
    """

    kind = "iterable"

    def __init__(self, dataset: IterableTransformDataset, records_per_batch: int, drop_last: bool) -> None:
        self.stream = dataset.stream
        self.dataset = dataset.record_transform()
        self.records_per_batch = records_per_batch
        self.drop_last = drop_last

    def pull(self, batches_per_read: int) -> Iterator[KeyBatch]:
        size = self.records_per_batch * batches_per_read
        while keys := self.stream.read(size):
            if self.drop_last and len(keys) < size:  # the stream's last records: drop an incomplete batch
                keys = keys[: len(keys) - len(keys) % self.records_per_batch]
                if not keys:
                    continue  # the next read ends the epoch
            yield KeyBatch(keys, self.stream.epoch)

    def position(self, unconsumed: list[KeyBatch]) -> tuple[dict, list[list]]:
        return self.stream.state_dict(), [pulled.keys for pulled in unconsumed]

    def check_position(self, state: Mapping) -> int:
        """Check a saved stream cursor; returns the epoch it resumes in."""
        self.stream.check_state(state)
        return state["epoch"]

    def check_keys(self, keys: list, name: str) -> None:
        for position, key in enumerate(keys):
            check_state_type(key, (list, tuple), f"{name}[{position}]")
            if len(key) != 2:
                raise ResumeStateError(f"{name}[{position}] must be a (position, record) pair, got {len(key)} items")
            check_state_type(key[0], int, f"{name}[{position}][0]")
            check_state_type(key[1], Mapping, f"{name}[{position}][1]")

    def restore(self, state: dict) -> None:
        self.stream.load_state_dict(state)

    @property
    def epoch(self) -> int:
        return self.stream.epoch

    def at_epoch_start(self, state: dict) -> bool:
        return False  # a stream is split by the DP size, so its state never moves to another DP size

    def in_fresh_epoch(self) -> bool:
        return self.stream.position == 0

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def __len__(self) -> int:
        raise TypeError("a loader over a streaming (iterable) source has no length; iterate until it stops")


class TrackedDataLoader:
    """A torch DataLoader over source keys that knows which taken keys the caller has not consumed yet.

    It is also the DataLoader's ``batch_sampler``: the DataLoader iterates it in this process to get keys. Key
    batches to read again (after a restore) come first, then the source's; if the source has meanwhile moved to
    the next epoch, the replayed batches end the current one.

    Args:
        batches_per_read: source batches fetched together; the dynamic loader reads several at once, since its
            output does not depend on how records are grouped into reads.
    """

    def __init__(self, source, worker_dataset, collate_fn: Callable, loader_options: dict, batches_per_read: int):
        self.source = source
        self.batches_per_read = batches_per_read
        self.unconsumed: deque[KeyBatch] = deque()
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
            pulled = next(pulls, None)
            if pulled is None:
                return
            self.unconsumed.append(pulled)
            yield pulled.keys

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
            yield self.unconsumed.popleft(), output

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
        return {"position": position, "replay": replay, "replay_epoch": replay_epoch if replay else None}

    def check_state(self, state: Mapping) -> None:
        """Refuse a malformed state, or one the source cannot continue, naming the key and what it must be."""
        where = "the loader state['source']"
        check_state_type(state, Mapping, where)
        epoch = self.source.check_position(state_field(state, "position", Mapping, where))
        replay = state_field(state, "replay", list, where)
        for position, keys in enumerate(replay):
            check_state_type(keys, list, f"{where}['replay'][{position}]")
            self.source.check_keys(keys, f"{where}['replay'][{position}]")
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
        self.source.restore(state["position"])
        self.replay = deque(state["replay"])
        self.replay_epoch = state["replay_epoch"]

    def at_epoch_start(self, state: dict) -> bool:
        return not state["replay"] and self.source.at_epoch_start(state["position"])

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.source.epoch:
            self.source.set_epoch(epoch)
            self.unconsumed.clear()
            self.replay.clear()
            self.replay_epoch = None
