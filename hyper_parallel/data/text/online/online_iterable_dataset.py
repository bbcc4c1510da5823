"""The Online iterable source: a Hugging Face stream (``streaming=True``), sharded by DP rank and buffer-shuffled.

Owns: reading records one after another, giving each DP rank a disjoint share (together they cover the data),
shuffling with a seeded bounded buffer, epochs, and a cursor that can be saved and restored exactly, the shuffle
buffer included. Not responsible for: tokenization (the transform) or batching (the loaders).

How a stream is read::

    Hugging Face IterableDataset (files in order)
      -> split_dataset_by_node(rank, world)   whole files per rank when they divide evenly, else every world-th record
      -> shuffle buffer of B records           seeded with (seed, epoch, dp_rank): each new record replaces and
                                               releases a random buffered one; the rest drain at the end
      -> (position, record)                    position counts this rank's records in the epoch
"""

from __future__ import annotations

import numpy as np

from hyper_parallel.data.errors import DataFileError, ResumeStateError

__all__ = ["OnlineIterableDataset"]

_STATE_VERSION = 1


class OnlineIterableDataset:
    """Records on demand: "give me the next records".

    Args:
        hf_dataset: a ``datasets.IterableDataset``.
        description: where the records come from, used in messages.
        dp_rank, dp_world_size: this rank's share of the stream.
        shuffle_buffer_size: records held for shuffling; 0 keeps the file order.
        seed: seeds the shuffle (with the epoch and the DP rank).
    """

    def __init__(
        self,
        hf_dataset,
        description: str,
        *,
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
        self._start_epoch(0)

    # Cursor --------------------------------------------------------------------------------------------------

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0
        self._source_state: dict | None = None
        self._source_exhausted = False
        self._buffer: list = []
        self._rng = np.random.default_rng([self.seed, epoch, self.dp_rank])
        self._records = None
        self._shard = None

    def _rank_share(self):
        from datasets.distributed import split_dataset_by_node

        shard = split_dataset_by_node(self.hf_dataset, rank=self.dp_rank, world_size=self.dp_world_size)
        if self._source_state is not None:
            shard.load_state_dict(self._source_state)
        return shard

    def _generate(self):
        """This epoch's records from the current cursor; keeps the cursor consistent at every ``yield``."""
        buffer, size, rng = self._buffer, self.shuffle_buffer_size, self._rng
        if not self._source_exhausted:
            self._shard = self._rank_share()
            for record in self._source_records(self._shard):
                if size == 0:
                    yield record
                elif len(buffer) < size:
                    buffer.append(record)
                else:
                    slot = int(rng.integers(size))
                    released, buffer[slot] = buffer[slot], record
                    yield released
            self._source_exhausted = True
        while buffer:
            slot = int(rng.integers(len(buffer)))
            buffer[slot], buffer[-1] = buffer[-1], buffer[slot]
            yield buffer.pop()

    def _source_records(self, shard):
        records = iter(shard)
        while True:
            try:
                yield next(records)
            except StopIteration:
                return
            except Exception as error:  # noqa: BLE001 - the readers raise many types; all get the source named
                raise DataFileError(
                    f"{self.description}: reading the stream failed after {self.position} records of DP rank "
                    f"{self.dp_rank} (epoch {self.epoch}): {error}. Fix or remove the malformed record"
                ) from error

    def read(self, max_records: int) -> list[tuple[int, dict]]:
        """Up to ``max_records`` next ``(position, record)`` pairs; an empty list ends the epoch and starts the next."""
        if self._records is None:
            self._records = self._generate()
        taken = []
        for record in self._records:
            taken.append((self.position, record))
            self.position += 1
            if len(taken) == max_records:
                return taken
        if not taken:
            self._start_epoch(self.epoch + 1)
        return taken

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless the stream is already in it."""
        if epoch != self.epoch:
            self._start_epoch(epoch)

    # Resume --------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The cursor: source position, the shuffle buffer's records and the shuffle generator's state."""
        source_state = self._source_state
        if self._shard is not None and not self._source_exhausted:
            source_state = self._shard.state_dict()
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "seed": self.seed,
            "shuffle_buffer_size": self.shuffle_buffer_size,
            "source_state": source_state,
            "source_exhausted": self._source_exhausted,
            "buffer": list(self._buffer),
            "rng": self._rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ResumeStateError(
                f"stream state version {state.get('version')!r} is not supported (expected {_STATE_VERSION}); "
                "it was saved by an incompatible release"
            )
        for key, why in (
            ("dp_world_size", "each DP rank reads its own share of a stream, so the shares would differ"),
            ("dp_rank", "the state holds another rank's cursor and buffer"),
            ("seed", "the shuffle order depends on it"),
            ("shuffle_buffer_size", "the shuffle order depends on it"),
        ):
            if state[key] != getattr(self, key):
                raise ResumeStateError(
                    f"cannot resume the stream of {self.description}: the state has {key}={state[key]!r} but this "
                    f"run has {getattr(self, key)!r}, and {why}. Resume with the same value, or start a new epoch "
                    "without the state"
                )
        self._start_epoch(int(state["epoch"]))
        self.position = int(state["position"])
        self._source_state = state["source_state"]
        self._source_exhausted = bool(state["source_exhausted"])
        self._buffer = list(state["buffer"])
        self._rng.bit_generator.state = state["rng"]

    def __repr__(self) -> str:
        return (
            f"OnlineIterableDataset({self.description}, dp {self.dp_rank}/{self.dp_world_size}, "
            f"shuffle buffer {self.shuffle_buffer_size}, epoch {self.epoch})"
        )
