"""Fixed and dynamic (token-budget) DataLoaders with exact, worker-count-independent resume.

Owns: choosing the ModelSamples of each micro-batch, DataLoader workers and prefetch, and the loader state.
Not responsible for: reading files (sources), tokenizing (transforms), packing the chosen samples (collators) or
parallel delivery (``ParallelBatch``).

How a loader reads, whatever the source::

    main process: source keys, in order                  workers (or the main process)
      mapping:  index lists from the DP batch sampler  ->  dataset[index] -> transform -> ModelSamples
      iterable: (position, record) lists read from the  ->  transform(record) -> ModelSamples
                stream (sharded by DP rank, buffer-shuffled)
    torch DataLoader returns the results in key order, so the batches never depend on ``num_workers``.

Resume: ``read_tracking.TrackedDataLoader`` knows which fetched keys the caller has not consumed (the prefetch)
and describes the position after what it consumed. The dynamic loader adds its token buffer (as ``(index,
window)`` keys for mapping sources, as token lists for streams) and the unabsorbed rest of the read in progress. A
restored loader therefore yields exactly the batches an uninterrupted run would yield.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import cached_property

import numpy as np
import torch
import torch.utils.data

from hyper_parallel.data.batching.build_collate_fn import build_indexed_collate_fn, build_online_text_collate_fn
from hyper_parallel.data.batching.read_tracking import KeyBatch, MappingKeys, StreamKeys, TrackedDataLoader
from hyper_parallel.data.batching.worker_errors import CollateInWorker, FetchInWorker
from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError, ResumeStateError
from hyper_parallel.data.parallel.batch_sampler import build_dataset_batch_sampler
from hyper_parallel.data.resume_checks import (
    check_same_data,
    check_state_type,
    dataset_identity,
    state_field,
    transform_changes,
    transform_identity,
)
from hyper_parallel.data.text.transform_dataset import IterableTransformDataset, TransformDataset

__all__ = ["DynamicBatchDataLoader", "FixedBatchDataLoader", "TextTokenBatcher", "calculate_num_micro_batches"]

logger = get_logger(__name__)

# Version 2 records the data and the transform the state was saved over; version 1 states (without them) are read
# with a warning, since their layout is otherwise the same.
_STATE_VERSION = 2
_READABLE_VERSIONS = (1, 2)
# The envelope fields every loader state has, and their types (the loader and source type are compared first).
_ENVELOPE_FIELDS = (("dp_rank", int), ("dp_world_size", int), ("micro_batch_size", int), ("source", Mapping))
# The dynamic loader reads about this many records per DataLoader fetch (amortising per-fetch costs).
_RECORDS_PER_READ = 32


def calculate_num_micro_batches(global_batch_size: int, micro_batch_size: int, dp_world_size: int) -> int:
    """Micro-batches per rank in one optimizer step: ``global / (micro * dp)``, which must divide evenly."""
    per_step = micro_batch_size * dp_world_size
    if micro_batch_size <= 0 or dp_world_size <= 0 or global_batch_size <= 0 or global_batch_size % per_step:
        raise DataConfigError(
            f"global_batch_size={global_batch_size} must be a positive multiple of micro_batch_size * "
            f"dp_world_size = {micro_batch_size} * {dp_world_size}; change one of them"
        )
    return global_batch_size // per_step


# Worker-side helpers (module level so that worker processes can unpickle them) -----------------------------------


def _as_lists(items: list) -> list:
    """Keep each record's ModelSamples apart: the dynamic loader chooses among them in the main process."""
    return items


class _OneSamplePerRecord(torch.utils.data.Dataset):
    """The fixed loader's view of an Online dataset: at most one ModelSample per record."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def _checked(self, key, samples: list) -> list:
        if len(samples) > 1:
            raise DataFileError(
                f"{self.dataset.where(key)} gave {len(samples)} samples (a document longer than max_seq_len is cut "
                "into several windows), but FixedBatchDataLoader takes exactly one sample per record. Use "
                "DynamicBatchDataLoader, which packs every window, or raise data_transform.max_seq_len"
            )
        return samples

    def __getitem__(self, key) -> list:
        return self._checked(key, self.dataset[key])

    def __getitems__(self, keys: list) -> list[list]:
        fetched = (
            self.dataset.__getitems__(keys)
            if hasattr(self.dataset, "__getitems__")
            else map(self.dataset.__getitem__, keys)
        )
        return [self._checked(key, samples) for key, samples in zip(keys, fetched, strict=True)]


class _CollateRecords:
    """Collate the samples of a fixed batch; records rejected by the transform (no sample) are left out."""

    def __init__(self, collate_fn: Callable) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: list[list]):
        samples = [sample for samples in items for sample in samples]
        return self.collate_fn(samples) if samples else None


# Loaders --------------------------------------------------------------------------------------------------------


# The arguments both loaders take and hand to ``_Loader`` unchanged.
_SHARED_OPTIONS = (
    "micro_batch_size",
    "global_batch_size",
    "dp_rank",
    "dp_world_size",
    "sampler_type",
    "data_sharding",
    "data_rearrange_map",
    "drop_last",
    "seed",
    "num_workers",
    "prefetch_factor",
    "pin_memory",
    "persistent_workers",
    "multiprocessing_context",
)


def _shared_options(arguments: dict) -> dict:
    """The shared arguments out of a loader constructor's ``locals()``."""
    return {name: arguments[name] for name in _SHARED_OPTIONS}


def _is_online(dataset) -> bool:
    return isinstance(dataset, (TransformDataset, IterableTransformDataset))


class _Loader:
    """What both loaders share: the key source, the tracked torch DataLoader and the state envelope."""

    def __init__(
        self,
        dataset,
        *,
        micro_batch_size: int,
        global_batch_size: int | None,
        dp_rank: int,
        dp_world_size: int,
        sampler_type: str,
        data_sharding: bool,
        data_rearrange_map,
        drop_last: bool,
        seed: int,
        num_workers: int,
        prefetch_factor: int | None,
        pin_memory: bool,
        persistent_workers: bool,
        multiprocessing_context,
        worker_collate_fn: Callable,
        one_sample_per_record: bool = False,
        batches_per_read: int = 1,
    ) -> None:
        if not isinstance(micro_batch_size, int) or micro_batch_size <= 0:
            raise DataConfigError(f"micro_batch_size is {micro_batch_size!r}; use a positive integer")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        if isinstance(dataset, IterableTransformDataset):
            if (dataset.stream.dp_rank, dataset.stream.dp_world_size) != (dp_rank, dp_world_size):
                raise DataConfigError(
                    f"the streaming dataset was built for DP rank {dataset.stream.dp_rank} of "
                    f"{dataset.stream.dp_world_size}, but the loader is for rank {dp_rank} of {dp_world_size}; "
                    "build the dataset with the loader's dp_rank and dp_world_size"
                )
            source = StreamKeys(dataset, micro_batch_size, drop_last)
        else:
            sampler = build_dataset_batch_sampler(
                total_samples=len(dataset),
                micro_batch_size=micro_batch_size,
                global_batch_size=global_batch_size,
                dp_rank=dp_rank,
                dp_world_size=dp_world_size,
                drop_last=drop_last,
                data_rearrange_map=data_rearrange_map,
                sampler_type=sampler_type,
                data_sharding=data_sharding,
                seed=seed,
            )
            source = MappingKeys(dataset, sampler)
        options = {
            "num_workers": num_workers,
            "pin_memory": pin_memory,
            "generator": torch.Generator().manual_seed(seed),
        }
        if num_workers > 0:
            options.update(persistent_workers=persistent_workers, multiprocessing_context=multiprocessing_context)
            if prefetch_factor is not None:
                options["prefetch_factor"] = prefetch_factor
        worker_dataset = _OneSamplePerRecord(source.dataset) if one_sample_per_record else source.dataset
        if num_workers > 0:  # the library's errors reach the caller as they would without workers
            worker_dataset, worker_collate_fn = FetchInWorker(worker_dataset), CollateInWorker(worker_collate_fn)
        self._tracked = TrackedDataLoader(source, worker_dataset, worker_collate_fn, options, batches_per_read)

    @property
    def source_type(self) -> str:
        return self._tracked.source.kind

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (no-op when already in it)."""
        self._tracked.set_epoch(epoch)

    @cached_property
    def _identities(self) -> tuple[dict | None, dict | None]:
        """What this loader reads (its data identity) and how records become samples (the transform's identity)."""
        transform = transform_identity(self.dataset.transform) if _is_online(self.dataset) else None
        return dataset_identity(self.dataset), transform

    def _state(self, source_state: dict, **extra) -> dict:
        data, transform = self._identities
        return {
            "version": _STATE_VERSION,
            "loader": type(self).__name__,
            "source_type": self.source_type,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "micro_batch_size": self.micro_batch_size,
            "data": data,
            "transform": transform,
            "source": source_state,
            **extra,
        }

    def _check_state(self, state: Mapping, fields: tuple[tuple[str, type | tuple], ...] = ()) -> None:
        """Check the loader's part of a state: the envelope, the data it was saved over, and ``fields``. The read
        tracker checks its part (and has the sampler or the stream check theirs) before anything is restored."""
        version = state.get("version") if isinstance(state, Mapping) else None
        if isinstance(version, bool) or version not in _READABLE_VERSIONS:
            raise ResumeStateError(
                f"loader state version {version!r} is not supported (expected {_STATE_VERSION}); it was not saved "
                "by this loader or by a compatible release"
            )
        where = "the loader state"
        for key, expected in (("loader", type(self).__name__), ("source_type", self.source_type)):
            if state_field(state, key, str, where) != expected:
                raise ResumeStateError(
                    f"the state was saved by a {state[key]} loader but this is a {expected} one; resume with the "
                    "same loader and source type, or start without the state"
                )
        for key, expected in (*_ENVELOPE_FIELDS, *fields):
            state_field(state, key, expected, where)
        data, transform = self._identities
        if version == _STATE_VERSION:
            check_same_data(state_field(state, "data", (Mapping, None), where), data, f"{where}['data']")
            saved_transform = state_field(state, "transform", (Mapping, None), where)
            changes = transform_changes(saved_transform, transform or {}, f"{where}['transform']")
            if transform and changes:
                logger.warning(
                    "%r: the data transform changed since the state was saved (%s); batches from here on follow the "
                    "new one",
                    self,
                    "; ".join(changes),
                )
        else:
            logger.warning(
                "%r: the state was saved by an older release (version %s) that did not record the data it read, so "
                "it cannot be checked against this data; save a new state to get the check",
                self,
                version,
            )

    def _nothing_delivered(self, records: int, epoch: int) -> ValueError:
        """The error for a whole epoch without a batch: iterating on would yield nothing, epoch after epoch."""
        source = getattr(self.dataset, "description", None) or repr(self.dataset)
        rank = f"DP rank {self.dp_rank} of {self.dp_world_size}"
        if records:
            return DataFileError(
                f"every one of the {records} records of {source} that {rank} read in epoch {epoch} was skipped as "
                "invalid or gave no sample (the warnings name them), so no batch would ever come; fix the data, or "
                "the data_transform settings that reject the records (text_keys, data_type, text_template)"
            )
        return DataConfigError(
            f"{rank} got no batch of {source} in epoch {epoch}: its share of the data is smaller than one "
            f"micro-batch of {self.micro_batch_size} records; use fewer DP ranks, a smaller micro_batch_size, "
            "drop_last false, or more data"
        )


class FixedBatchDataLoader(_Loader):
    """Batches of exactly ``micro_batch_size`` samples (the last may be smaller without ``drop_last``).

    Works with Online datasets (mapping or iterable; each record must give one ModelSample, packed by the collator)
    and with any map-style dataset such as the Indexed GPTDataset (stacked by ``build_indexed_collate_fn``).

    Args:
        dataset: the dataset of this DP rank (an iterable source must be built with the same DP rank and size).
        collate_fn: turns the samples into a batch; default: packing for Online datasets, stacking otherwise.
        micro_batch_size: samples per batch.
        global_batch_size: samples per optimizer step over all DP ranks (default ``micro * dp``).
        dp_rank, dp_world_size: this rank and the number of data-parallel ranks.
        sampler_type, data_sharding, data_rearrange_map, drop_last, seed: see ``build_dataset_batch_sampler``
            (mapping sources); ``drop_last`` also drops a stream's incomplete last batch.
        num_workers, prefetch_factor, pin_memory, persistent_workers, multiprocessing_context: as for
            ``torch.utils.data.DataLoader``; batches and resume do not depend on them.
    """

    def __init__(
        self,
        dataset,
        collate_fn: Callable | None = None,
        *,
        micro_batch_size: int = 1,
        global_batch_size: int | None = None,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        sampler_type: str = "single",
        data_sharding: bool = False,
        data_rearrange_map=None,
        drop_last: bool = True,
        seed: int = 1234,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        multiprocessing_context=None,
    ) -> None:
        online = _is_online(dataset)
        if collate_fn is None:
            collate_fn = build_online_text_collate_fn() if online else build_indexed_collate_fn()
        self.collate_fn = collate_fn
        super().__init__(
            dataset,
            worker_collate_fn=_CollateRecords(collate_fn) if online else collate_fn,
            one_sample_per_record=online,
            **_shared_options(locals()),
        )

    def __iter__(self) -> Iterator:
        whole_epoch, epoch = self._tracked.reads_whole_epoch(), self._tracked.source.epoch
        records = delivered = 0
        for pulled, batch in self._tracked.batches():
            records += len(pulled.keys)
            if batch is not None:
                delivered += 1
                yield batch
        if whole_epoch and not delivered:
            raise self._nothing_delivered(records, epoch)

    def __len__(self) -> int:
        """Batches left in the current epoch (mapping sources)."""
        return len(self._tracked)

    def state_dict(self) -> dict:
        """The position after the last batch delivered (plain Python containers, safe for ``torch.save``)."""
        return self._state(self._tracked.state_dict())

    def load_state_dict(self, state: Mapping) -> None:
        """Continue after the batches ``state`` describes; a refused state changes nothing.

        With a mapping source the DP size may differ from the saved one when the global batch size is the same
        and the state is at an optimizer-step boundary (the sampler checks both and says why when it refuses).
        """
        self._check_state(state)
        self._tracked.load_state_dict(state["source"])
        logger.info("%r restored: %d key batches to read again", self, len(state["source"]["replay"]))

    def __repr__(self) -> str:
        return (
            f"FixedBatchDataLoader({self.dataset!r}, micro_batch_size={self.micro_batch_size}, "
            f"dp {self.dp_rank}/{self.dp_world_size})"
        )


# The dynamic loader's own state fields, and their types.
_DYNAMIC_FIELDS = (
    ("token_budget", int),
    ("min_buffered_samples", int),
    ("flushing", bool),
    ("buffer", list),
    ("buffer_tokens", int),
)


def _saved_sample(sample, name: str) -> dict:
    """A buffered stream sample from a state: ``input_ids`` and ``labels``, integer lists of one non-zero length."""
    check_state_type(sample, Mapping, name)
    arrays = {}
    for key in ("input_ids", "labels"):
        values = state_field(sample, key, list, name)
        array = np.asarray(values)
        if array.ndim != 1 or not len(array) or array.dtype.kind not in "iu":
            raise ResumeStateError(
                f"{name}['{key}'] must be a non-empty list of token ids; the checkpoint is damaged: restore the "
                "state as saved, or start without it"
            )
        arrays[key] = array.astype(np.int64)
    if len(arrays["input_ids"]) != len(arrays["labels"]):
        raise ResumeStateError(f"{name} has {len(arrays['input_ids'])} input_ids but {len(arrays['labels'])} labels")
    return arrays


class TextTokenBatcher:
    """Choose micro-batches from a buffer of samples under a token budget.

    ``pop_micro_batch`` makes one pass over the buffer in arrival order and takes every sample that still fits
    (the first one always: a sample longer than the budget forms its own batch and is never cut). Samples left
    behind keep their order for the next batch.

    Args:
        token_budget: most tokens per micro-batch (``micro_batch_size * max_seq_len``).
        min_buffered_samples: samples to hold before a batch is chosen, so that small samples can fill gaps.
    """

    def __init__(self, token_budget: int, min_buffered_samples: int) -> None:
        for name, value in (("token_budget", token_budget), ("min_buffered_samples", min_buffered_samples)):
            if not isinstance(value, int) or value <= 0:
                raise DataConfigError(f"{name} is {value!r}; use a positive integer")
        self.token_budget = token_budget
        self.min_buffered_samples = min_buffered_samples
        self._entries: list[tuple[object, dict, int]] = []
        self.buffered_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[tuple[object, dict, int]]:
        """The buffered ``(key, sample, length)`` triples in arrival order."""
        return list(self._entries)

    def put(self, key, sample: Mapping) -> None:
        length = len(sample["input_ids"])
        if length == 0:
            raise DataFileError(f"sample {key!r} has no tokens; a transform must not return empty samples")
        self._entries.append((key, sample, length))
        self.buffered_tokens += length

    def is_ready(self) -> bool:
        return len(self._entries) >= self.min_buffered_samples and self.buffered_tokens >= self.token_budget

    def pop_micro_batch(self) -> list[tuple[object, dict, int]]:
        taken, kept, used = [], [], 0
        for position, entry in enumerate(self._entries):
            if not taken or used + entry[2] <= self.token_budget:
                taken.append(entry)
                used += entry[2]
                if used == self.token_budget:
                    kept.extend(self._entries[position + 1 :])
                    break
            else:
                kept.append(entry)
        self._entries = kept
        self.buffered_tokens -= used
        return taken

    def clear(self) -> None:
        self._entries = []
        self.buffered_tokens = 0


class DynamicBatchDataLoader(_Loader):
    """Micro-batches of as many samples as fit ``token_budget = micro_batch_size * max_seq_len`` tokens.

    Records are read about 32 at a time (whole micro-batches of the DP batch sampler for mapping sources) and
    enter the buffer one by one; a micro-batch is chosen by ``TextTokenBatcher`` whenever the buffer holds at least
    ``min_buffered_samples`` samples and a budget's worth of tokens, and at the end of the epoch the buffer is
    flushed. The batches therefore depend only on the record order, not on reads or workers. Each DP rank packs
    its own share, so ranks may deliver different numbers of micro-batches per epoch.

    Args:
        max_seq_len: tokens per sequence slot; default: the dataset transform's ``max_seq_len``.
        min_buffered_samples: buffer size that triggers a choice (more gives fuller batches).
        Other arguments: as for ``FixedBatchDataLoader`` (``drop_last`` applies to the sampler; the token buffer
        is always flushed).
    """

    def __init__(
        self,
        dataset,
        collate_fn: Callable | None = None,
        *,
        micro_batch_size: int = 1,
        max_seq_len: int | None = None,
        min_buffered_samples: int = 200,
        global_batch_size: int | None = None,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        sampler_type: str = "single",
        data_sharding: bool = False,
        data_rearrange_map=None,
        drop_last: bool = True,
        seed: int = 1234,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        multiprocessing_context=None,
    ) -> None:
        if not _is_online(dataset):
            raise DataConfigError(
                f"DynamicBatchDataLoader reads Online datasets (from build_online_text_dataset), not "
                f"{type(dataset).__name__}; use FixedBatchDataLoader for fixed-length Indexed samples"
            )
        max_seq_len = max_seq_len if max_seq_len is not None else dataset.max_seq_len
        if not isinstance(max_seq_len, int) or max_seq_len <= 0:
            raise DataConfigError(
                f"DynamicBatchDataLoader needs max_seq_len (got {max_seq_len!r}): set it on the loader or on the "
                "data transform; the token budget is micro_batch_size * max_seq_len"
            )
        self.max_seq_len = max_seq_len
        self.collate_fn = collate_fn if collate_fn is not None else build_online_text_collate_fn()
        self.batcher = TextTokenBatcher(micro_batch_size * max_seq_len, min_buffered_samples)
        super().__init__(
            dataset,
            worker_collate_fn=_as_lists,
            batches_per_read=max(1, _RECORDS_PER_READ // micro_batch_size),
            **_shared_options(locals()),
        )
        self._reading: KeyBatch | None = None  # the read being absorbed into the buffer
        self._absorbed = 0  # how many of them are in the buffer
        self._flushing = False  # the source's epoch is over; the buffer is being emptied
        self._epoch: int | None = None  # the epoch being iterated

    @property
    def token_budget(self) -> int:
        return self.batcher.token_budget

    def _collate(self, entries: list) -> object:
        return self.collate_fn([sample for _, sample, _ in entries])

    def _unabsorbed(self) -> KeyBatch | None:
        if self._reading is None or self._absorbed == len(self._reading.keys):
            return None
        return KeyBatch(self._reading.keys[self._absorbed :], self._reading.epoch, replayed=True)

    def __iter__(self) -> Iterator:
        batcher, mapping = self.batcher, self.source_type == "mapping"
        self._tracked.rewind(self._unabsorbed())
        self._reading = None
        tracked = self._tracked
        self._epoch = tracked.replay_epoch if tracked.replay else tracked.source.epoch
        whole_epoch = not self._flushing and not len(batcher) and tracked.reads_whole_epoch()
        epoch, records, delivered = self._epoch, 0, 0
        if not self._flushing:
            while batcher.is_ready():  # a restored buffer may already hold whole batches
                delivered += 1
                yield self._collate(batcher.pop_micro_batch())
            # Records enter the buffer one at a time, so the batches do not depend on how records are read.
            for pulled, per_record in self._tracked.batches():
                self._reading, self._absorbed = pulled, 0
                records += len(pulled.keys)
                for key, samples in zip(pulled.keys, per_record, strict=True):
                    for window, sample in enumerate(samples):
                        batcher.put((key, window) if mapping else None, sample)
                    self._absorbed += 1
                    while batcher.is_ready():
                        delivered += 1
                        yield self._collate(batcher.pop_micro_batch())
                self._reading = None
            self._flushing = True
        while len(batcher):
            delivered += 1
            yield self._collate(batcher.pop_micro_batch())
        self._flushing, self._epoch = False, None
        if whole_epoch and not delivered:
            raise self._nothing_delivered(records, epoch)

    def state_dict(self) -> dict:
        """The source position plus the unconsumed token buffer (plain Python containers)."""
        if self.source_type == "mapping":
            buffer = [[int(key[0]), int(key[1])] for key, _, _ in self.batcher.entries()]
        else:
            buffer = [
                {"input_ids": np.asarray(s["input_ids"]).tolist(), "labels": np.asarray(s["labels"]).tolist()}
                for _, s, _ in self.batcher.entries()
            ]
        source = self._tracked.state_dict(self._unabsorbed())
        # A mapping source moves to the next epoch as it hands out its last batch: then only the buffer is left.
        source_moved_on = not source["replay"] and self._epoch not in (None, source["position"]["epoch"])
        return self._state(
            source,
            flushing=self._flushing or source_moved_on,
            token_budget=self.token_budget,
            min_buffered_samples=self.batcher.min_buffered_samples,
            buffer=buffer,
            buffer_tokens=self.batcher.buffered_tokens,
        )

    def load_state_dict(self, state: Mapping) -> None:
        """Continue exactly where ``state`` was saved, buffer included; a refused state changes nothing.

        The DP size may change only at an epoch boundary with an empty buffer: each rank packs its own share of
        the data, so the packs of a different DP size are different batches.
        """
        self._check_state(state, _DYNAMIC_FIELDS)
        for key in ("token_budget", "min_buffered_samples"):
            if state[key] != getattr(self.batcher, key):
                raise ResumeStateError(
                    f"the state was saved with {key}={state[key]} but this loader has {getattr(self.batcher, key)}; "
                    "the choice of samples per micro-batch depends on it, so resume with the same micro_batch_size, "
                    "max_seq_len and min_buffered_samples"
                )
        if state["dp_world_size"] != self.dp_world_size and (
            state["buffer"] or not self._tracked.at_epoch_start(state["source"])
        ):
            raise ResumeStateError(
                f"cannot resume a DynamicBatchDataLoader saved with dp_world_size={state['dp_world_size']} on "
                f"dp_world_size={self.dp_world_size} mid-epoch: each DP rank packs its own share of the data into "
                "token-budget batches, so a different DP size gives different batches. Resume with the saved DP "
                "size, or from a state saved at an epoch boundary"
            )
        if state["dp_world_size"] == self.dp_world_size and state["dp_rank"] != self.dp_rank:
            raise ResumeStateError(
                f"the state belongs to DP rank {state['dp_rank']} but this loader is rank {self.dp_rank}; each "
                "rank must load its own state"
            )
        self._tracked.check_state(state["source"])
        entries = list(self._restore_buffer(state["buffer"]))
        tokens = sum(len(sample["input_ids"]) for _, sample in entries)
        if tokens != state["buffer_tokens"]:
            raise ResumeStateError(
                f"the restored token buffer holds {tokens} tokens but the state recorded {state['buffer_tokens']}: "
                "the data files or the transform changed since the state was saved"
            )
        # Everything is checked: restore.
        self._tracked.load_state_dict(state["source"])
        self._reading, self._flushing, self._epoch = None, state["flushing"], None
        self.batcher.clear()
        for entry in entries:
            self.batcher.put(*entry)
        logger.info(
            "%r restored: %d buffered samples, %d key batches to read again",
            self,
            len(self.batcher),
            len(state["source"]["replay"]),
        )

    def _restore_buffer(self, buffer: list) -> Iterator[tuple]:
        """The buffered ``(key, sample)`` pairs ``buffer`` describes, checked; reads the records of a mapping
        source again."""
        where = "the loader state['buffer']"
        if self.source_type != "mapping":
            for position, sample in enumerate(buffer):
                yield None, _saved_sample(sample, f"{where}[{position}]")
            return
        for position, key in enumerate(buffer):
            check_state_type(key, (list, tuple), f"{where}[{position}]")
            if len(key) != 2 or not all(isinstance(part, int) and not isinstance(part, bool) for part in key):
                raise ResumeStateError(
                    f"{where}[{position}] must be a [record index, window] pair of integers, got {key!r}; the "
                    "checkpoint is damaged: restore the state as saved, or start without it"
                )
        source = self._tracked.source
        source.check_keys([index for index, _ in buffer], where)
        indices = list(dict.fromkeys(index for index, _ in buffer))  # each buffered record once, in order
        records = dict(zip(indices, source.dataset.__getitems__(indices), strict=True)) if indices else {}
        for position, (index, window) in enumerate(buffer):
            if not 0 <= window < len(records[index]):
                raise ResumeStateError(
                    f"{where}[{position}] is window {window} of record {index}, which now gives "
                    f"{len(records[index])} windows: the data files or the transform changed since the state was "
                    "saved; resume with the same data and data_transform, or start without the state"
                )
            yield (index, window), records[index][window]

    def __repr__(self) -> str:
        return (
            f"DynamicBatchDataLoader({self.dataset!r}, token_budget={self.token_budget}, "
            f"min_buffered_samples={self.batcher.min_buffered_samples}, dp {self.dp_rank}/{self.dp_world_size})"
        )
