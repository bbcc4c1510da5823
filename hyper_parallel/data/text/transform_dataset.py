"""Apply a data transform lazily to an Online source: RawSample in, ModelSamples out, at read time.

Owns: pairing a source with a transform so that records are tokenized only when read (in DataLoader workers when
there are any), naming the record in every transform error, and telling the loaders how to read each kind
(``record_reading``: by index, or a stream read in the main process whose records the workers transform). Not
responsible for: reading files (the sources), the transform itself (``build_data_transform``), order or batching
(samplers and loaders).

A transform maps one record to a list of ModelSamples (``{"input_ids", "labels"}``, labels already shifted): one
for a conversation, several for a long document cut into windows, none for a rejected record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.utils.data

from hyper_parallel.data.text.online.online_iterable_dataset import OnlineIterableDataset
from hyper_parallel.data.text.online.online_mapping_dataset import OnlineMappingDataset

__all__ = ["IterableTransformDataset", "RecordReading", "StreamRecordTransform", "TransformDataset"]

Transform = Callable[..., list]


@dataclass(frozen=True)
class RecordReading:
    """How a loader reads a transform dataset, as the dataset describes itself (``record_reading()``).

    Attributes:
        transform: turns one record into a list of ModelSamples (its settings go into loader states).
        stream: for an iterable source, the stream the loader reads in its main process (its cursor is saved
            exactly); None for a source read by index.
        records: for an iterable source, the worker-side half that transforms the streamed ``(position, record)``
            keys; None for a source read by index (the dataset itself).
    """

    transform: Transform
    stream: OnlineIterableDataset | None = None
    records: StreamRecordTransform | None = None


class _Wheres(Sequence[str]):
    """The names of a read's records (``"record 17 of ..."``), each made only when a transform asks for it, which
    a batched transform does only to name a record in an error or a warning."""

    def __init__(self, where: Callable[[Any], str], keys: Sequence) -> None:
        self._where = where
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, position: int) -> str:
        return self._where(self._keys[position])


def _transform_batch(transform: Transform, records: list, wheres: Sequence[str]) -> list[list[dict]]:
    """Several records through ``transform``: in one call when it has ``batch`` (e.g. one tokenizer call)."""
    if hasattr(transform, "batch"):
        return transform.batch(records, wheres)
    return [transform(record, where=where) for record, where in zip(records, wheres, strict=True)]


class _Transformed:
    """What both transform datasets share: the source they read and the transform, with what loaders ask of them."""

    def __init__(self, read: OnlineMappingDataset | OnlineIterableDataset, transform: Transform) -> None:
        self._read = read
        self.transform = transform

    @property
    def max_seq_len(self) -> int | None:
        return getattr(self.transform, "max_seq_len", None)

    @property
    def description(self) -> str:
        return self._read.description

    def data_identity(self) -> dict | None:
        return self._read.data_identity()


class TransformDataset(_Transformed, torch.utils.data.Dataset):
    """A mapping source with its transform: ``dataset[i]`` is the list of ModelSamples of record ``i``."""

    def __init__(self, source: OnlineMappingDataset, transform: Transform) -> None:
        super().__init__(source, transform)
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> list[dict]:
        return self.transform(self.source[index], where=self.where(index))

    def __getitems__(self, indices: list[int]) -> list[list[dict]]:
        """Several records at once (one Arrow read), as ``torch.utils.data.DataLoader`` asks for a batch."""
        return _transform_batch(self.transform, self.source.records(indices), _Wheres(self.where, indices))

    def where(self, index: int) -> str:
        return self.source.where(index)

    def record_reading(self) -> RecordReading:
        """Read by index (the DP batch sampler's), each record transformed where it is fetched."""
        return RecordReading(self.transform)

    def __repr__(self) -> str:
        return f"TransformDataset({self.source!r}, {type(self.transform).__name__})"


class StreamRecordTransform(torch.utils.data.Dataset):
    """The worker-side half of an iterable source: turns a ``(position, record)`` key into ModelSamples.

    The stream is read in the loader's main process (so its cursor can be saved exactly); the records travel to
    the workers as the "indices" of this dataset and are tokenized there.
    """

    def __init__(self, transform: Transform, stream_description: str) -> None:
        self.transform = transform
        self.stream_description = stream_description

    def __getitem__(self, key: tuple[int, Mapping]) -> list[dict]:
        return self.transform(key[1], where=self.where(key))

    def __getitems__(self, keys: list[tuple[int, Mapping]]) -> list[list[dict]]:
        return _transform_batch(self.transform, [key[1] for key in keys], _Wheres(self.where, keys))

    def where(self, key: tuple[int, Mapping]) -> str:
        return f"record {key[0]} of {self.stream_description}"


class IterableTransformDataset(_Transformed, torch.utils.data.IterableDataset):
    """An iterable source with its transform. Iterating yields this epoch's remaining ModelSamples in order.

    The loaders read ``stream`` themselves and tokenize in workers; iterating this object directly runs in the
    calling process only.
    """

    def __init__(self, stream: OnlineIterableDataset, transform: Transform) -> None:
        super().__init__(stream, transform)
        self.stream = stream

    def record_transform(self) -> StreamRecordTransform:
        return StreamRecordTransform(
            self.transform, f"DP rank {self.stream.dp_rank}'s stream of {self.stream.description}"
        )

    def record_reading(self) -> RecordReading:
        """Read as a stream in the loader's main process, the records transformed in the workers."""
        return RecordReading(self.transform, self.stream, self.record_transform())

    def __iter__(self) -> Iterator[dict]:
        worker = torch.utils.data.get_worker_info()
        if worker is not None and worker.num_workers > 1:
            raise RuntimeError(
                "an IterableTransformDataset read by a plain torch DataLoader with several workers would repeat "
                "every record in each worker; use FixedBatchDataLoader or DynamicBatchDataLoader from "
                "hyper_parallel.data.batching, which read the stream once and tokenize in workers"
            )
        records = self.record_transform()
        while batch := self.stream.read(1):  # one at a time, so state_dict() is never ahead
            for key in batch:
                yield from records[key]

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)

    def __repr__(self) -> str:
        return f"IterableTransformDataset({self.stream!r}, {type(self.transform).__name__})"
