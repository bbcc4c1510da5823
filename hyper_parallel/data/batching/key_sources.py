"""Where a loader's keys come from, and what each kind of source keeps in a loader state.

Owns: the key sources a loader reads (``MappingKeys``: index batches from the DP batch sampler; ``StreamKeys``:
``(position, record)`` batches read from a stream in this process), each with its own part of the resume contract
(its position; checking its kind, keys and DP placement in a saved state; the key of each sample a loader
buffers, and how buffered samples are written into a state and read back), what each source checks of a batch
(ready samples: at least one loss token per micro-batch) and says of it (a stream's dropped last records), and
``key_source_for``, the one place that asks what kind of dataset a loader reads (it asks the dataset:
``record_reading()``).
Not responsible for: which keys the caller has consumed (``read_tracking``), fetching or transforming records
(the DataLoader and its workers), choosing the samples of a batch (the loaders and packing policies), or
collating them (the collators; a source only names the default one for what its records give).

What each source keeps in a state::

    source     keys                position            a buffered sample
    mapping    dataset indices     the sampler state   [record index, window]: the record is read and
                                                       transformed again on load, and must give that window
    iterable   (position, record)  the stream cursor   {"input_ids": [...], "labels": [...]}: a stream is
                                                       not read twice, so the tokens themselves
    mixture    (n, payload)        the mixture stream  the tokens (an Indexed row's "document_lengths" too),
    stream                         cursor              with "sample", "source" and "window"
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch.utils.data

from hyper_parallel.data.batching.build_collate_fn import build_indexed_collate_fn, build_online_text_collate_fn
from hyper_parallel.data.batching.loader_options import LoaderOptions
from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError, ResumeStateError
from hyper_parallel.data.parallel.batch_sampler import BatchLayout, DatasetBatchSampler
from hyper_parallel.data.resume_checks import check_state_type, dataset_identity, state_field, transform_identity

__all__ = ["KeyBatch", "MappingKeys", "MixtureStreamKeys", "StreamKeys", "key_source_for"]

logger = get_logger(__name__)

_DAMAGED = "the checkpoint is damaged: restore the state as saved, or start without it"


@dataclass
class KeyBatch:
    """A key batch the torch DataLoader has taken from the source (or from the replay list)."""

    keys: list
    epoch: int
    sampler_state: dict | None = None  # mapping sources: the sampler's state before this batch
    replayed: bool = False


class _KeySource:
    """What both key sources share: the dataset a loader reads, its identities, and what its records give.

    Args:
        read: the loader's dataset (its identity goes into states).
        dataset: the worker-side dataset: a key in, the list of that record's samples out.
        layout: the loader's batch sizes and DP placement.
        transform: what turns records into ModelSamples (Online datasets); None when records are samples.
    """

    kind = ""

    def __init__(self, read, dataset, layout: BatchLayout, transform) -> None:
        self._read = read
        self.dataset = dataset
        self.layout = layout
        self.transform = transform

    @cached_property
    def identities(self) -> tuple[dict | None, dict | None]:
        """What the source reads (its data identity) and how records become samples (the transform's identity)."""
        transform = transform_identity(self.transform) if self.transform is not None else None
        return dataset_identity(self._read), transform

    def default_collate_fn(self) -> Callable:
        """The collator for what the records give: packing for ModelSamples, stacking for ready samples."""
        if self.transform is not None:
            return build_online_text_collate_fn()
        # Indexed datasets say which id ends their documents; other map-style datasets have one sequence per row.
        return build_indexed_collate_fn(eod_token_id=getattr(self._read, "eod_token_id", None))

    def check_loss_tokens(self, keys: list, batch) -> None:
        """Refuse a batch of ready samples (Indexed) in which no token carries a loss: its mean loss would be NaN.

        The whole micro-batch is the unit, as the loss is averaged over its loss tokens: a sample without one
        beside samples with some is trained on as it is. Online records are checked one at a time by their
        transform instead (a record without a loss token is an error, or skipped with ``on_invalid_record``).
        """
        loss_mask = batch.get("loss_mask") if self.transform is None and isinstance(batch, Mapping) else None
        if loss_mask is None or torch.as_tensor(loss_mask).any():
            return
        identity = self.identities[0]
        source = identity["source"] if identity else type(self._read).__name__
        shown = keys if len(keys) <= 8 else [*keys[:8], f"... {len(keys) - 8} more"]
        raise DataFileError(
            f"{source}: the micro-batch of samples {shown} has no token whose loss is taken (its loss_mask is 0 "
            "everywhere: the samples hold only EOD tokens, masked by eod_mask_loss, or padding), so its loss would "
            "be NaN; remove the empty documents from the data and rebuild the .bin/.idx files, or set "
            "data_config.eod_mask_loss to false"
        )

    def require_model_samples(self, loader: str) -> None:
        """Refuse a dataset whose records are not turned into ModelSamples by a transform (an Indexed dataset)."""
        if self.transform is None:
            raise DataConfigError(
                f"{loader} reads Online datasets (from build_online_text_dataset), not {type(self._read).__name__}; "
                "use FixedBatchDataLoader for fixed-length Indexed samples"
            )

    def check_kind(self, kind, where: str) -> None:
        if kind != self.kind:
            raise ResumeStateError(
                f"{where} was saved over a source of kind {kind!r} but this loader reads one of kind {self.kind!r} "
                "(the source type: mapping or iterable); resume with the same loader and source type, or start "
                "without the state"
            )


class MappingKeys(_KeySource):
    """Index batches from the DP batch sampler, a pure function of ``(epoch, consumed_samples)``.

    Unconsumed batches are described by rewinding the sampler to the state before the oldest of them.
    """

    kind = "mapping"

    def __init__(self, read, dataset, sampler: DatasetBatchSampler, layout: BatchLayout, transform) -> None:
        super().__init__(read, dataset, layout, transform)
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

    def check_placement(
        self, position: Mapping, replaying: bool, saved: tuple[int, int], *, packs_per_rank: bool, holds_samples: bool
    ) -> None:
        """Refuse a state saved at another DP placement (``saved``: its rank and DP size) that cannot continue here.

        The sampler plans one global sample space, so it checks a changed DP size itself (at an optimizer-step
        boundary it is exact). A loader that packs each rank's share on its own (``packs_per_rank``) may change
        the DP size only at the start of an epoch, with nothing buffered (``holds_samples``), and never the rank.
        """
        if not packs_per_rank:
            return
        (rank, size), here = saved, self.layout
        at_epoch_start = not replaying and not holds_samples and position.get("consumed_samples") == 0
        if size != here.dp_world_size and not at_epoch_start:
            raise ResumeStateError(
                f"cannot resume a loader saved with dp_world_size={size} on dp_world_size="
                f"{here.dp_world_size} mid-epoch: each DP rank packs its own share of the data into token-budget "
                "batches, so a different DP size gives different batches. Resume with the saved DP size, from a "
                "state saved at an epoch boundary, or merge every rank's state with "
                "batching.merge_rank_states(states) and give the merged state to every new loader (each record of "
                "the epoch is then delivered once, in another order)"
            )
        if size == here.dp_world_size and rank != here.dp_rank:
            raise ResumeStateError(
                f"the state belongs to DP rank {rank} but this loader is rank {here.dp_rank}; each rank "
                "must load its own state"
            )

    def restore(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def in_fresh_epoch(self) -> bool:
        return self.sampler.consumed_samples == 0 and not self.sampler.reads_remaining

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    # Buffered samples --------------------------------------------------------------------------------------------

    def sample_key(self, key: int, window: int) -> tuple[int, int]:
        """The key of a record's ``window``-th sample: enough to read it again."""
        return key, window

    def encode_samples(self, entries: Sequence[tuple]) -> list[list[int]]:
        return [[int(index), int(window)] for (index, window), _ in entries]

    def decode_samples(self, saved: list, where: str) -> list[tuple]:
        """The ``(key, sample)`` pairs ``saved`` describes, checked; the records are read and transformed again."""
        for position, key in enumerate(saved):
            check_state_type(key, (list, tuple), f"{where}[{position}]")
            if len(key) != 2 or not all(isinstance(part, int) and not isinstance(part, bool) for part in key):
                raise ResumeStateError(
                    f"{where}[{position}] must be a [record index, window] pair of integers, got {key!r}; {_DAMAGED}"
                )
        self.check_keys([index for index, _ in saved], where)
        indices = list(dict.fromkeys(index for index, _ in saved))  # each buffered record once, in order
        records = dict(zip(indices, self.dataset.__getitems__(indices), strict=True)) if indices else {}
        entries = []
        for position, (index, window) in enumerate(saved):
            if not 0 <= window < len(records[index]):
                raise ResumeStateError(
                    f"{where}[{position}] is window {window} of record {index}, which now gives "
                    f"{len(records[index])} windows: the data files or the transform changed since the state was "
                    "saved; resume with the same data and data_transform, or start without the state"
                )
            entries.append(((index, window), records[index][window]))
        return entries


class StreamKeys(_KeySource):
    """Record batches read from an iterable source in this process; the workers only transform them.

    The stream's cursor is always ahead of the caller, so unconsumed records are kept and read again first. A
    stream is split between the DP ranks, so a state only continues on the rank and DP size that saved it (another
    DP size takes the states of every rank merged: ``batching.elastic``).
    """

    kind = "iterable"

    def __init__(self, read, stream, records, layout: BatchLayout, drop_last: bool, transform) -> None:
        if (stream.dp_rank, stream.dp_world_size) != (layout.dp_rank, layout.dp_world_size):
            raise DataConfigError(
                f"the streaming dataset was built for DP rank {stream.dp_rank} of {stream.dp_world_size}, but the "
                f"loader is for rank {layout.dp_rank} of {layout.dp_world_size}; build the dataset with the loader's "
                "dp_rank and dp_world_size"
            )
        super().__init__(read, records, layout, transform)
        self.stream = stream
        self.records_per_batch = layout.micro_batch_size
        self.drop_last = drop_last
        self._drop_reported = False  # a stream's length is known only at its end: the drop is said once, then

    def pull(self, batches_per_read: int) -> Iterator[KeyBatch]:
        size = self.records_per_batch * batches_per_read
        while keys := self.stream.read(size):
            if self.drop_last and len(keys) < size:  # the stream's last records: drop an incomplete batch
                self._report_drop(len(keys) % self.records_per_batch)
                keys = keys[: len(keys) - len(keys) % self.records_per_batch]
                if not keys:
                    continue  # the next read ends the epoch
            yield KeyBatch(keys, self.stream.epoch)

    def _report_drop(self, dropped: int) -> None:
        if not dropped or self._drop_reported:
            return
        self._drop_reported = True
        logger.warning(
            "DP rank %d of %d left out the last %d records of %r in epoch %d: drop_last, the default, drops a "
            "stream's incomplete last micro-batch of %d records (said once per loader). Set drop_last: false on "
            "the dataloader to read every record",
            self.layout.dp_rank,
            self.layout.dp_world_size,
            dropped,
            self.stream,
            self.stream.epoch,
            self.records_per_batch,
        )

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

    def check_placement(
        self, position: Mapping, replaying: bool, saved: tuple[int, int], *, packs_per_rank: bool, holds_samples: bool
    ) -> None:
        """Refuse a state saved on another DP rank or size: its cursor and records are that rank's share."""
        here = self.layout
        if tuple(saved) != (here.dp_rank, here.dp_world_size):
            raise ResumeStateError(
                f"the state was saved by DP rank {saved[0]} of {saved[1]}, but this loader is rank "
                f"{here.dp_rank} of {here.dp_world_size}: a stream is split between the DP ranks, so each rank "
                "resumes its own state, with the saved DP size; to change the DP size, merge every rank's state with "
                "batching.merge_rank_states(states) and give the merged state to every new loader"
            )

    def restore(self, state: dict) -> None:
        self.stream.load_state_dict(state)

    @property
    def epoch(self) -> int:
        return self.stream.epoch

    def in_fresh_epoch(self) -> bool:
        return self.stream.position == 0 and not self.stream.handing_over

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def __len__(self) -> int:
        raise TypeError("a loader over a streaming (iterable) source has no length; iterate until it stops")

    # Buffered samples --------------------------------------------------------------------------------------------

    def sample_key(self, key, window: int) -> None:
        return None  # the sample itself is saved

    def encode_samples(self, entries: Sequence[tuple]) -> list[dict]:
        return [
            {"input_ids": np.asarray(s["input_ids"]).tolist(), "labels": np.asarray(s["labels"]).tolist()}
            for _, s in entries
        ]

    def decode_samples(self, saved: list, where: str) -> list[tuple]:
        return [(None, _saved_sample(sample, f"{where}[{position}]")) for position, sample in enumerate(saved)]


class MixtureStreamKeys(StreamKeys):
    """The keys of a mixture with a streaming source (``mixture.mixture_stream``): ``(n, payload)`` pairs naming
    their source, read in this process like a stream's. A buffered sample keeps its sample number and source (with
    its tokens, as a stream's), so that the mixture's tally counts it where it came from."""

    def sample_key(self, key, window: int) -> tuple[tuple[int, str], int]:
        return (key[0], key[1]["source"]), window

    def encode_samples(self, entries: Sequence[tuple]) -> list[dict]:
        encoded = super().encode_samples(entries)
        for sample, (((number, name), window), model_sample) in zip(encoded, entries, strict=True):
            sample.update(sample=int(number), source=name, window=int(window))
            if "document_lengths" in model_sample:  # an Indexed row's documents, each a sequence of its own
                sample["document_lengths"] = np.asarray(model_sample["document_lengths"]).tolist()
        return encoded

    def decode_samples(self, saved: list, where: str) -> list[tuple]:
        entries = []
        for position, sample in enumerate(saved):
            name = f"{where}[{position}]"
            check_state_type(sample, Mapping, name)
            key = (state_field(sample, "sample", int, name), state_field(sample, "source", str, name))
            decoded = _saved_sample(sample, name)
            if "document_lengths" in sample:
                lengths = np.asarray(state_field(sample, "document_lengths", list, name), dtype=np.int64)
                if lengths.ndim != 1 or (lengths <= 0).any() or lengths.sum() != len(decoded["input_ids"]):
                    raise ResumeStateError(f"{name}['document_lengths'] does not cover its input_ids; {_DAMAGED}")
                decoded["document_lengths"] = lengths
            entries.append(((key, state_field(sample, "window", int, name)), decoded))
        return entries


def _saved_sample(sample, name: str) -> dict:
    """A buffered stream sample from a state: ``input_ids`` and ``labels``, integer lists of one non-zero length."""
    check_state_type(sample, Mapping, name)
    arrays = {}
    for key in ("input_ids", "labels"):
        array = np.asarray(state_field(sample, key, list, name))
        if array.ndim != 1 or not len(array) or array.dtype.kind not in "iu":
            raise ResumeStateError(f"{name}['{key}'] must be a non-empty list of token ids; {_DAMAGED}")
        arrays[key] = array.astype(np.int64)
    if len(arrays["input_ids"]) != len(arrays["labels"]):
        raise ResumeStateError(f"{name} has {len(arrays['input_ids'])} input_ids but {len(arrays['labels'])} labels")
    return arrays


class _ReadySamplesAsRecords(torch.utils.data.Dataset):
    """A dataset of ready samples (Indexed) read as records of one sample each, as the loaders read every dataset."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> list:
        return [self.dataset[index]]

    def __getitems__(self, indices: list[int]) -> list[list]:
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems is not None else map(self.dataset.__getitem__, indices)
        return [[sample] for sample in samples]


def key_source_for(dataset, options: LoaderOptions) -> MappingKeys | StreamKeys:
    """The key source that reads ``dataset``: the one place that asks what kind of dataset a loader reads.

    A transform dataset describes itself (``record_reading()``): a stream is read here and its records transformed
    in the workers; a dataset read by index gets the DP batch sampler of ``options``. Any other dataset is a
    map-style dataset of ready samples (such as the Indexed GPTDataset), read by index as records of one sample.
    """
    describe = getattr(dataset, "record_reading", None)
    reading = describe() if callable(describe) else None
    layout = options.layout
    if reading is not None and reading.stream is not None:
        keys = MixtureStreamKeys if getattr(reading.stream, "mixed", False) else StreamKeys
        return keys(dataset, reading.stream, reading.records, layout, options.sampler.drop_last, reading.transform)
    sampler = DatasetBatchSampler.from_options(len(dataset), layout, options.sampler)
    if reading is None:
        return MappingKeys(dataset, _ReadySamplesAsRecords(dataset), sampler, layout, None)
    return MappingKeys(dataset, dataset, sampler, layout, reading.transform)
