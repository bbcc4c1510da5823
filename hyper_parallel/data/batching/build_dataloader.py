"""Fixed and dynamic (token-budget) DataLoaders with exact, worker-count-independent resume.

Owns: choosing the ModelSamples of each micro-batch (a fixed count, or a packing policy's choice), DataLoader
workers and prefetch, composing the loader state from its parts, the sample number where a changed mixture's new
plan begins (a dynamic loader's DP ranks agree on one), and what a loader says of its epochs (at
construction, what it delivers per epoch and the Online records ``drop_last`` leaves out; at each epoch's end, at
debug, the micro-batches it delivered; a dynamic loader's token budget that is not a multiple of its layout's row
multiple is warned about). Not responsible for: where keys come from and
what each kind of source keeps (``key_sources``), which keys the caller consumed (``read_tracking``), the state's
envelope and older versions (``loader_state``), the options (``loader_options``), reading files (sources),
tokenizing (transforms), packing the chosen samples (collators) or parallel delivery (``ParallelBatch``).

How a loader reads, whatever the source::

    main process: source keys, in order                  workers (or the main process)
      mapping:  index lists from the DP batch sampler  ->  dataset[index] -> transform -> ModelSamples
      iterable: (position, record) lists read from the  ->  transform(record) -> ModelSamples
                stream (sharded by DP rank, buffer-shuffled)
    torch DataLoader returns the results in key order, so the batches never depend on ``num_workers``.

Every record gives a list of samples (an Indexed sample is a record of one). Resume: ``TrackedDataLoader`` knows
which fetched keys the caller has not consumed (the prefetch) and describes the position after what it consumed.
The dynamic loader adds its packing policy's state (the buffered samples encoded by the key source) and the
unabsorbed rest of the read in progress. A restored loader therefore yields exactly the batches an uninterrupted
run would yield. The loaders never ask what kind of source they read: the key source answers for itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch.distributed
import torch.utils.data

from hyper_parallel.data.batching.build_collate_fn import build_online_text_collate_fn
from hyper_parallel.data.batching.elastic import DecodedSamples, is_elastic, rank_state
from hyper_parallel.data.batching.key_sources import KeyBatch, key_source_for
from hyper_parallel.data.batching.loader_options import LoaderOptions, takes_loader_options
from hyper_parallel.data.batching.loader_state import check_envelope, envelope, migrate_loader_state
from hyper_parallel.data.batching.packing_policy import PackingPolicy, checked_policy
from hyper_parallel.data.batching.read_tracking import TrackedDataLoader
from hyper_parallel.data.batching.token_batcher import TextTokenBatcher
from hyper_parallel.data.batching.worker_errors import CollateInWorker, FetchInWorker
from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError, ResumeStateError, require_int
from hyper_parallel.data.mixture.mixture_tally import record_tokens
from hyper_parallel.data.parallel.batch_sampler import DatasetBatchSampler
from hyper_parallel.data.parallel.build_barrier import process_group_ready
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.parallel.rank_agreement import gather_rank_numbers
from hyper_parallel.data.resume_checks import state_field

__all__ = ["DynamicBatchDataLoader", "FixedBatchDataLoader", "calculate_num_micro_batches"]

logger = get_logger(__name__)

# The dynamic loader reads about this many records at a time (amortising per-read costs); a state holds at most one
# read that is partly packed.
_RECORDS_PER_READ = 32
# Without workers, the dynamic loader fetches this many reads in one call, so that the transform tokenizes them in one
# call: between two calls the loader's own work leaves the tokenizer's tables cold, which costs more than that work
# (benchmarks/README.md, online). The reads are still consumed, and saved, one at a time. A mixture read in order
# fetches one read at a time: the records it hands out are drawn under its weights, and a changed mixture applies
# after the draws a state holds.
_READS_PER_FETCH_IN_PROCESS = 4
_DEFAULT_MIN_BUFFERED_SAMPLES = 200
# Micro-steps whose sample numbers are planned at once when counting those of sources no longer mixed.
_STEPS_PER_COUNT = 1 << 16


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
    """The fixed loader's view of a dataset: at most one sample per record."""

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
    """Collate the samples of a fixed batch; records rejected by the transform (no sample) are left out.

    With ``count_tokens`` (a mixture's loader tallies each source's tokens) it returns the batch and the tokens
    of each record's samples.
    """

    def __init__(self, collate_fn: Callable, count_tokens: bool = False) -> None:
        self.collate_fn = collate_fn
        self.count_tokens = count_tokens

    def __call__(self, items: list[list]):
        samples = [sample for samples in items for sample in samples]
        batch = self.collate_fn(samples) if samples else None
        return (batch, record_tokens(items)) if self.count_tokens else batch


def _dataset_name(dataset) -> str:
    """The dataset's class, and its source for Online datasets, for log lines."""
    description = getattr(dataset, "description", None)
    return type(dataset).__name__ + (f" of {description}" if isinstance(description, str) else "")


# Loaders --------------------------------------------------------------------------------------------------------


class _Loader:
    """What both loaders share: the options, the key source, the tracked torch DataLoader and the state envelope."""

    def __init__(self, dataset, options: LoaderOptions) -> None:
        self.dataset = dataset
        self.options = options
        self._source = key_source_for(dataset, options)
        tally = getattr(dataset, "mixture_tally", None)  # a mixture: what was delivered from each source
        self._tally = tally() if callable(tally) else None
        self._before_mixture_change = None  # while a state that changes the mixture is checked: what to go back to

    def _log_construction(self, batching: str) -> None:
        """Say once, at construction, what this loader reads, how it batches, and where its keys come from."""
        workers = self.options.workers
        fetching = f"{workers.num_workers} workers" if workers.num_workers else "no workers (main process)"
        if workers.num_workers and workers.prefetch_factor is not None:
            fetching += f", prefetch_factor {workers.prefetch_factor}"
        logger.info(
            "%s over %s: %s, global_batch_size %d, DP rank %d of %d, %s",
            type(self).__name__,
            _dataset_name(self.dataset),
            batching,
            self.options.layout.global_batch_size,
            self.dp_rank,
            self.dp_world_size,
            fetching,
        )
        sampler = getattr(self._source, "sampler", None)  # a stream has none: it is sharded and shuffled as read
        if sampler is None:
            logger.info(
                "sampler: none, the stream is split between DP ranks and shuffled as read (%r)", self._source.stream
            )
            return
        ordering = sampler.sampler_type + (", data_sharding" if sampler.data_sharding else "")
        if sampler.rearrange_map is not None:
            ordering += ", data_rearrange_map"
        logger.info(
            "sampler: DatasetBatchSampler %s, seed %d, DP rank %d of %d, %s samples, epochs of %s (drop_last %s), %s",
            ordering,
            sampler.seed,
            sampler.dp_rank,
            sampler.dp_world_size,
            f"{sampler.total_samples:,}",
            f"{sampler.epoch_len:,}",
            sampler.drop_last,
            self._batches_per_epoch(len(sampler)),
        )
        dropped = sampler.total_samples - sampler.epoch_len
        if dropped and self._source.transform is not None:  # Online records; Indexed samples follow megatron-core
            logger.warning(
                "%s over %s leaves out %s of its %s records every epoch (the last %s of each epoch's order): "
                "drop_last, the default, keeps whole global batches of %d. Set drop_last: false on the dataloader "
                "to read every record (the last step of an epoch is then smaller, and DP ranks may get different "
                "numbers of batches in it)",
                type(self).__name__,
                _dataset_name(self.dataset),
                f"{dropped:,}",
                f"{sampler.total_samples:,}",
                f"{dropped:,}",
                sampler.global_batch_size,
            )

    def _batches_per_epoch(self, sampler_batches: int) -> str:
        """What this loader delivers per epoch, for the sampler's log line: ``sampler_batches`` micro-batches."""
        return f"{sampler_batches:,} micro-batches of {self.micro_batch_size} on this rank per epoch"

    def _log_epoch_end(self, epoch: int, delivered: int, records: int, whole_epoch: bool) -> None:
        """Say (at debug) how many micro-batches an epoch delivered: the count a packing loader cannot know before."""
        logger.debug(
            "%s over %s, DP rank %d of %d: epoch %d ended, %s micro-batches from %s records %s",
            type(self).__name__,
            _dataset_name(self.dataset),
            self.dp_rank,
            self.dp_world_size,
            epoch,
            f"{delivered:,}",
            f"{records:,}",
            "in the whole epoch" if whole_epoch else "since it was resumed",
        )

    def _track(
        self,
        worker_collate_fn: Callable,
        *,
        one_sample_per_record: bool = False,
        batches_per_read: int = 1,
        reads_per_fetch_in_process: int = 1,
    ):
        """Start the tracked torch DataLoader that fetches the source's keys (in workers when there are any)."""
        worker_dataset = _OneSamplePerRecord(self._source.dataset) if one_sample_per_record else self._source.dataset
        reads_per_fetch = reads_per_fetch_in_process
        if self.options.workers.num_workers > 0:  # the library's errors reach the caller as they would without workers
            worker_dataset, worker_collate_fn = FetchInWorker(worker_dataset), CollateInWorker(worker_collate_fn)
            reads_per_fetch = 1  # workers fetch ahead anyway; bigger fetches would only hold more records in flight
        loader_options = self.options.workers.dataloader_kwargs(self.options.sampler.seed)
        self._tracked = TrackedDataLoader(
            self._source, worker_dataset, worker_collate_fn, loader_options, batches_per_read, reads_per_fetch
        )

    @property
    def micro_batch_size(self) -> int:
        return self.options.layout.micro_batch_size

    @property
    def dp_rank(self) -> int:
        return self.options.layout.dp_rank

    @property
    def dp_world_size(self) -> int:
        return self.options.layout.dp_world_size

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (no-op when already in it)."""
        self._tracked.set_epoch(epoch)

    def _state(self, source_state: dict, **extra) -> dict:
        head = envelope(type(self).__name__, self.options.layout, self._source.identities)
        if self._tally is not None:
            extra["mixture"] = self._tally.state_dict()
        return {**head, "source": source_state, **extra}

    def _checked(
        self, state, fields: tuple = (), *, packs_per_rank: bool = False, allow_mixture_change: bool = False
    ) -> dict:
        """The state in the current layout, after checking every part but the packing policy's: the envelope and
        the loader's ``fields``, the data it was saved over, the read tracker's and the key source's parts, and the
        DP placement (``packs_per_rank``: the loader packs each rank's share on its own). Over a mixture, the
        mixture's plan is followed first (``_follow_mixture``); ``_refused`` undoes it if a check then fails."""
        state = migrate_loader_state(state, self)
        if self._tally is not None:
            state = self._follow_mixture(state, allow_mixture_change, packs_per_rank)
        check_envelope(state, type(self).__name__, self._source.identities, fields, self)
        self._tracked.check_state(
            state["source"],
            (state["dp_rank"], state["dp_world_size"]),
            packs_per_rank=packs_per_rank,
            holds_samples=state.get("buffered_samples", 0) > 0,  # the dynamic loader's field, checked above
        )
        if self._tally is not None:
            self._tally.check_state(state.get("mixture"))  # a state without one, named after the envelope's checks
        return state

    def _follow_mixture(self, state: dict, allow_change: bool, packs_per_rank: bool) -> dict:
        """Take the plan of the state's mixture (the mixture checks it against its own sources and weights, and
        continues it with new ones if allowed): the dataset reads it, the sampler covers its length, and keys
        of sources no longer mixed are left out of the replay (said with their count)."""
        if "mixture" not in state or not self._take_plan(state, allow_change, packs_per_rank):
            return state
        source = dict(state_field(state, "source", Mapping, "the loader state"))
        position = state_field(source, "position", Mapping, "the loader state['source']")
        if hasattr(self._source, "sampler"):
            if position.get("consumed_samples"):  # mid-epoch: a whole epoch is counted as it begins
                self._warn_dropped(self._removed_ahead(position), "this rank reads before the mixture's last change")
            source["position"] = {**position, "total_samples": len(self.dataset.plan)}
        else:  # a mixture read in order: its cursor continues over the sources mixed now
            source["position"] = self.dataset.continued_cursor(position)
        replay = source.get("replay")
        if isinstance(replay, list) and replay:
            readable = iter(self.dataset.readable([key for keys in replay for key in keys]).tolist())
            kept = [[key for key in keys if next(readable)] for keys in replay]
            self._warn_dropped(
                sum(map(len, replay)) - sum(map(len, kept)), "read but not yet packed at the resume point"
            )
            source["replay"] = [keys for keys in kept if keys]
            source["replay_epoch"] = source.get("replay_epoch") if source["replay"] else None
        return {**state, "source": source, "data": self._source.identities[0]}

    def _take_plan(self, state: Mapping, allow_change: bool, packs_per_rank: bool) -> bool:
        """Read the plan of the state's mixture from here on (the dataset, the sampler over its length, a tally
        of its sources); False when it is the plan read already."""
        self._tally.check_state(state["mixture"])
        plan = self.dataset.resumed_plan(
            state["mixture"]["plan"], lambda: self._mixture_resume_point(state, packs_per_rank), allow_change
        )
        if plan is None:
            return False
        sampler = getattr(self._source, "sampler", None)  # a mixture read in order has none
        if self._before_mixture_change is None:  # the loader as it was before this state, for ``_refused``
            self._before_mixture_change = (self.dataset.plan, sampler, self._tally)
        self.dataset.adopt(plan)
        if sampler is not None:
            self._source.sampler = DatasetBatchSampler.from_options(
                len(plan), self.options.layout, self.options.sampler
            )
        self._tally = self.dataset.mixture_tally()
        return True

    def _rank_state(self, merged: Mapping, allow_change: bool, policy=None) -> tuple[dict, DecodedSamples | None]:
        """This rank's state from an elastic one (``elastic.rank_state``); over a mixture, the plan the old ranks
        read is taken first, so that the positions left are placed in the same mixture."""
        if self._tally is not None:
            if not isinstance(merged.get("mixture"), Mapping):  # an elastic state is a Mapping (``is_elastic``)
                raise ResumeStateError(
                    f"{self!r} reads a mixture, but the elastic state has no mixture part: merge the states of "
                    "every rank again with merge_rank_states of this release, which keeps their mixture parts"
                )
            self._take_plan(merged, allow_change, False)  # a changed mixture is refused: no resume point in order
        return rank_state(merged, self._source, self.options.layout, policy)

    def _reads_in_order(self, position) -> bool:
        """Whether the sampler reads the mixture's sample numbers in order from ``position`` (a state's), so that the
        samples before a resume point are exactly the ones read: ``single``, without data sharding, a rearrange map
        or an elastic hand-over in progress."""
        sampler = getattr(self._source, "sampler", None)
        return (
            sampler is not None
            and isinstance(position, Mapping)
            and position.get("sampler_type") == sampler.sampler_type == "single"
            and not sampler.data_sharding
            and sampler.rearrange_map is None
            and position.get("remaining") is None
        )

    def _mixture_resume_point(self, state: Mapping, packs_per_rank: bool) -> int:
        """The sample number a state resumes at, where a changed mixture's new plan begins; refused where the
        samples before it are not exactly the ones delivered or buffered. DP ranks that pack their own shares
        (``packs_per_rank``) have each read to their own sample number: they agree on one
        (``_agreed_resume_point``)."""
        source = state.get("source")
        position = source.get("position") if isinstance(source, Mapping) else None
        if not self._reads_in_order(position):
            raise ResumeStateError(
                "a mixture can change only where the loader reads it in order, so that the samples before the "
                "resume point are the ones delivered: sampler_type single, without data_sharding, "
                "data_rearrange_map or an elastic hand-over in progress; resume with the mixture the state was saved "
                "with"
            )
        resume_at = state_field(position, "consumed_samples", int, "the loader state['source']['position']")
        keys = [key for keys in source.get("replay") or () for key in keys]
        packing = state.get("packing")
        if isinstance(packing, Mapping):
            keys += [entry[0] for entry in packing.get("buffer") or () if isinstance(entry, list | tuple) and entry]
        ended = any(not isinstance(key, int) or key >= resume_at for key in keys)
        if packs_per_rank and self.dp_world_size > 1:
            epoch = state_field(position, "epoch", int, "the loader state['source']['position']")
            return self._agreed_resume_point(epoch, resume_at, ended)
        if ended:
            raise ResumeStateError(f"the state resumes at sample {resume_at:,} of the mixture, but {_ENDED_EPOCH}")
        return resume_at

    def _agreed_resume_point(self, epoch: int, consumed: int, ended: bool) -> int:
        """Where every DP rank's changed mixture begins: the furthest sample number any rank has read. Each rank
        resumes at its own position, so a rank behind reads the rest of its share before that point under the
        saved plan (every rank's plan is the same), and no sample is read twice or left out. The ranks agree in
        one all-gather over the default process group, one process per DP rank; without it, only a state at an
        epoch's start changes (every rank resumes at sample 0)."""
        world = torch.distributed.get_world_size() if process_group_ready() else 1
        if world != self.dp_world_size:
            if consumed == 0 and not ended:
                return 0
            where = (
                "torch.distributed is not initialised"
                if world == 1
                else f"the default process group holds {world} processes, not one per DP rank"
            )
            raise ResumeStateError(
                f"a {type(self).__name__} over {self.dp_world_size} DP ranks changes its mixture mid-epoch (this "
                f"rank resumes at sample {consumed:,}) only once its ranks agree on where the new mixture begins, "
                f"but {where}: call torch.distributed.init_process_group with one process per DP rank before "
                "load_state_dict, or resume with the mixture the state was saved with and change it at an "
                "epoch's start"
            )
        rows = gather_rank_numbers((self.dp_rank, epoch, consumed, ended), what="the resume point of a changed mixture")
        if sorted(row[0] for row in rows) != list(range(self.dp_world_size)):
            raise ResumeStateError(
                f"the default process group's ranks are DP ranks {[row[0] for row in rows]} of "
                f"{self.dp_world_size}, not each DP rank once: give every process its own dp_rank"
            )
        epochs = {row[1] for row in rows}
        if len(epochs) > 1:
            raise ResumeStateError(
                "the DP ranks resume in different epochs ("
                + ", ".join(f"DP rank {rank} in epoch {row_epoch}" for rank, row_epoch, _, _ in sorted(rows))
                + "), so no one sample number of the mixture is where all of them change it; resume with the "
                "mixture the states were saved with, and change it at a later state, once they read one epoch"
            )
        flushing = [rank for rank, _, _, rank_ended in sorted(rows) if rank_ended]
        if flushing:
            raise ResumeStateError(f"the state of DP rank {flushing[0]} {_ENDED_EPOCH}")
        resume_at = max(row[2] for row in rows)
        logger.info(
            "%r: the DP ranks resume at samples %s of the mixture; the changed mixture begins at sample %s on "
            "every rank, and each rank reads its share before it as the saved mixture planned",
            self,
            ", ".join(f"{row[2]:,}" for row in sorted(rows)),
            f"{resume_at:,}",
        )
        return resume_at

    def _removed_ahead(self, position: Mapping) -> int:
        """How many samples of sources no longer mixed this rank still reads in the epoch it resumes in. Only samples
        before the plan's last segment can be (they are read as the plan before a change drew them); each gives no
        sample (``MixtureDataset.__getitems__``)."""
        if not self._removed_a_source():
            return 0
        stop = min(int(self.dataset.plan.starts[-1]), self._source.sampler.epoch_len)
        consumed = position.get("consumed_samples")
        if not self._reads_in_order(position) or not isinstance(consumed, int) or consumed >= stop:
            return 0
        micro_step = self.micro_batch_size * self.dp_world_size
        within = self.dp_rank * self.micro_batch_size + np.arange(self.micro_batch_size)
        removed, last_step = 0, -(-stop // micro_step)
        for first in range(consumed // micro_step, last_step, _STEPS_PER_COUNT):
            steps = np.arange(first, min(first + _STEPS_PER_COUNT, last_step), dtype=np.int64)
            keys = (steps[:, None] * micro_step + within).ravel()
            removed += int(np.count_nonzero(~self.dataset.readable(keys[keys < stop])))
        return removed

    def _warn_removed_in_epoch(self, epoch: int) -> None:
        """At the start of a whole epoch over a mixture that dropped a source: how many of its samples this rank
        reads again before the change (each gives no sample)."""
        if self._removed_a_source():
            removed = self._removed_ahead(self._source.sampler.state_dict())
            self._warn_dropped(removed, f"this rank reads in epoch {epoch} before the mixture's last change")

    def _removed_a_source(self) -> bool:
        """Whether the mixture's plan knows a source it no longer mixes (a change removed it)."""
        return self._tally is not None and len(self.dataset.known_names) > len(self.dataset.names)

    def _warn_dropped(self, dropped: int, what: str) -> None:
        if dropped:
            logger.warning(
                "%r: %d samples %s are of sources no longer mixed and are dropped; their "
                "sources' positions count them, so a source added back later continues after them",
                self,
                dropped,
                what,
            )

    def _refused(self) -> None:
        """Undo ``_follow_mixture`` after a refused state: a refused state changes nothing."""
        if self._before_mixture_change is not None:
            plan, sampler, self._tally = self._before_mixture_change
            if sampler is not None:
                self._source.sampler = sampler
            self.dataset.adopt(plan)
        self._before_mixture_change = None

    def _restore_tally(self, state: Mapping) -> None:
        self._before_mixture_change = None  # the state is taken
        if self._tally is not None:
            self._tally.load_state_dict(state["mixture"])

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
        **options: the loader options by name, as a YAML ``dataloader`` node writes them (see
            ``loader_options``):"""

    @takes_loader_options
    def __init__(self, dataset, collate_fn: Callable | None = None, **options) -> None:
        super().__init__(dataset, LoaderOptions.from_keywords(**options))
        self.collate_fn = collate_fn if collate_fn is not None else self._source.default_collate_fn()
        self._track(_CollateRecords(self.collate_fn, self._tally is not None), one_sample_per_record=True)
        self._log_construction(f"micro_batch_size {self.micro_batch_size}")

    def __iter__(self) -> Iterator:
        whole_epoch, epoch = self._tracked.reads_whole_epoch(), self._tracked.next_epoch()
        if whole_epoch:
            self._warn_removed_in_epoch(epoch)
        records = delivered = 0
        for pulled, batch in self._tracked.batches():
            records += len(pulled.keys)
            if self._tally is not None:
                batch, tokens = batch
            if batch is not None:
                self._source.check_loss_tokens(pulled.keys, batch)
                if self._tally is not None:
                    self._tally.count_records(pulled.keys, tokens)
                delivered += 1
                yield batch
        if whole_epoch and not delivered:
            raise self._nothing_delivered(records, epoch)
        self._log_epoch_end(epoch, delivered, records, whole_epoch)

    def __len__(self) -> int:
        """Batches left in the current epoch (mapping sources)."""
        return len(self._tracked)

    def state_dict(self) -> dict:
        """The position after the last batch delivered (plain Python containers, safe for ``torch.save``)."""
        return self._state(self._tracked.state_dict())

    def load_state_dict(self, state: Mapping, *, allow_mixture_change: bool = False) -> None:
        """Continue after the batches ``state`` describes; a refused state changes nothing.

        Over a mixture, ``allow_mixture_change`` continues a state saved over other weights or sources
        (``mixture_change: allow`` on the mixture node does too; docs/mixtures.md).

        With a mapping source the DP size may differ from the saved one when the global batch size is the same
        and the state is at an optimizer-step boundary (the sampler checks both and says why when it refuses);
        anywhere else, give every loader of the new DP size the elastic state ``merge_rank_states`` makes of all
        the ranks' states.
        """
        try:
            if is_elastic(state):
                state, _ = self._rank_state(state, allow_mixture_change)
            state = self._checked(state, allow_mixture_change=allow_mixture_change)
        except BaseException:
            self._refused()
            raise
        self._tracked.load_state_dict(state["source"])
        self._restore_tally(state)
        logger.info("%r restored: %d key batches to read again", self, len(self._tracked.replay))

    def __repr__(self) -> str:
        return (
            f"FixedBatchDataLoader({self.dataset!r}, micro_batch_size={self.micro_batch_size}, "
            f"dp {self.dp_rank}/{self.dp_world_size})"
        )


class DynamicBatchDataLoader(_Loader):
    """Micro-batches of as many samples as a packing policy chooses under its budget.

    Records are read about 32 at a time (whole micro-batches of the DP batch sampler for mapping sources) and
    their samples are put into the policy one by one; a micro-batch is taken whenever the policy is ready, and at
    the end of the epoch until the policy is empty. The batches therefore depend only on the record order, not on
    reads or workers. Each DP rank packs its own share, so ranks may deliver different numbers of micro-batches
    per epoch, and per step if each rank trains on every micro-batch it is given. For equal counts, wrap each
    step's iterator with the packing scheduler (``batching.data_schedule.wrap_data_iterator``; the pipeline's
    ``packing_scheduler`` node): it takes the same number of micro-batches from every rank and re-schedules their
    sequences, so every rank runs the same number (``build_dataloaders`` warns when a dynamic loader over several
    DP ranks has no scheduler). The default policy, ``TextTokenBatcher``, takes every sample that still fits
    ``token_budget = micro_batch_size * max_seq_len`` tokens once ``min_buffered_samples`` are buffered.

    Args:
        max_seq_len: tokens per sequence slot of the default policy; default: the dataset transform's
            ``max_seq_len``.
        min_buffered_samples: buffer size that triggers a choice in the default policy (more gives fuller batches);
            default 200.
        packing_policy: a ``PackingPolicy`` instead of the default one (then set its budget and buffer on it, not
            with ``max_seq_len`` or ``min_buffered_samples``).
        layout: the batch layout over the CP and TP ranks (``parallel.delivery_layout.DeliveryLayout``; the
            pipeline gives its own). The default policy charges each sample its padded length
            (``layout.sequence_multiple()``), and a token budget that is not a multiple of ``layout.row_multiple()``
            is warned about, naming the fix. None: no CP/TP layout.
        Other arguments: as for ``FixedBatchDataLoader`` (``drop_last`` applies to the sampler; the policy is
            always emptied at the end of the epoch).
    """

    @takes_loader_options
    def __init__(
        self,
        dataset,
        collate_fn: Callable | None = None,
        *,
        max_seq_len: int | None = None,
        min_buffered_samples: int | None = None,
        packing_policy: PackingPolicy | None = None,
        layout: DeliveryLayout | None = None,
        **options,
    ) -> None:
        super().__init__(dataset, LoaderOptions.from_keywords(**options))
        self.delivery_layout = layout if layout is not None else DeliveryLayout()
        self._source.require_model_samples(type(self).__name__)
        self.max_seq_len = max_seq_len if max_seq_len is not None else dataset.max_seq_len
        self.collate_fn = collate_fn if collate_fn is not None else build_online_text_collate_fn()
        if packing_policy is None:
            packing_policy = self._default_policy(min_buffered_samples)
        elif max_seq_len is not None or min_buffered_samples is not None:
            raise DataConfigError(
                "max_seq_len and min_buffered_samples set up the default packing policy; with packing_policy, set "
                "the budget and the buffer on the policy and leave them out"
            )
        self.policy = checked_policy(packing_policy)
        self._track(
            _as_lists,
            batches_per_read=max(1, _RECORDS_PER_READ // self.micro_batch_size),
            reads_per_fetch_in_process=1 if self._draws_in_order() else _READS_PER_FETCH_IN_PROCESS,
        )
        self._log_construction(f"token budget {self.token_budget:,} per micro-batch, packed by {self.policy!r}")
        self._warn_off_layout()
        self._reading: KeyBatch | None = None  # the read being absorbed into the policy
        self._absorbed = 0  # how many of its records are in the policy
        self._flushing = False  # the source's epoch is over; the policy is being emptied
        self._epoch: int | None = None  # the epoch being iterated

    def _draws_in_order(self) -> bool:
        """Whether the loader reads a mixture in order (a stream among its sources): keys read are drawn for good."""
        return self._tally is not None and not hasattr(self._source, "sampler")

    def _default_policy(self, min_buffered_samples: int | None) -> TextTokenBatcher:
        if self.max_seq_len is None:
            raise DataConfigError(
                "DynamicBatchDataLoader needs max_seq_len (got None): set it on the loader or on the data "
                "transform; the token budget is micro_batch_size * max_seq_len"
            )
        budget = self.micro_batch_size * require_int("max_seq_len", self.max_seq_len, 1)
        if min_buffered_samples is None:
            min_buffered_samples = _DEFAULT_MIN_BUFFERED_SAMPLES
        # A layout that pads every sequence (zigzag_thd) fills the budget with that padding too.
        multiple = self.delivery_layout.sequence_multiple()
        return TextTokenBatcher(budget, min_buffered_samples, sequence_multiple=multiple)

    def _warn_off_layout(self) -> None:
        """Warn when the token budget is not a multiple of the layout's row multiple: padded rows would exceed it."""
        budget, multiple = self.token_budget, self.delivery_layout.row_multiple()
        if budget % multiple == 0:
            return
        at_most = budget - budget % multiple + multiple
        if self.max_seq_len is None or budget != self.micro_batch_size * self.max_seq_len:
            logger.warning(
                "the packing policy's token budget %d is not a multiple of the layout's row multiple %d (%s), so a "
                "padded micro-batch can hold up to %d tokens; set the policy's token_budget to a multiple of %d",
                budget,
                multiple,
                self.delivery_layout.describe(),
                at_most,
                multiple,
            )
            return
        # budget = micro_batch_size * max_seq_len is a multiple when max_seq_len is a multiple of step
        step = multiple // math.gcd(multiple, self.micro_batch_size)
        lower = self.max_seq_len - self.max_seq_len % step
        suggestions = " or ".join(str(v) for v in (lower, lower + step) if v > 0)
        logger.warning(
            "the token budget %d (micro_batch_size %d x max_seq_len %d) is not a multiple of the layout's row "
            "multiple %d (%s), so a padded micro-batch can hold up to %d tokens; set max_seq_len (of the data "
            "transform or the dataloader) to a multiple of %d, such as %s",
            budget,
            self.micro_batch_size,
            self.max_seq_len,
            multiple,
            self.delivery_layout.describe(),
            at_most,
            step,
            suggestions,
        )

    @property
    def token_budget(self) -> int:
        return self.policy.token_budget

    def _batches_per_epoch(self, sampler_batches: int) -> str:
        # The sampler's batches are groups of records; how many micro-batches they pack into depends on their tokens.
        return (
            f"{sampler_batches:,} batches of {self.micro_batch_size} records on this rank per epoch, packed into "
            "micro-batches under the token budget (how many is known once the epoch is read)"
        )

    def _collate(self, entries: list) -> object:
        if self._tally is not None:
            self._tally.count_samples(entries)
        return self.collate_fn([sample for _, sample in entries])

    def _unabsorbed(self) -> KeyBatch | None:
        if self._reading is None or self._absorbed == len(self._reading.keys):
            return None
        return KeyBatch(self._reading.keys[self._absorbed :], self._reading.epoch, replayed=True)

    def __iter__(self) -> Iterator:
        policy, source = self.policy, self._source
        self._tracked.rewind(self._unabsorbed())
        self._reading = None
        self._epoch = epoch = self._tracked.next_epoch()
        whole_epoch = not self._flushing and not len(policy) and self._tracked.reads_whole_epoch()
        if whole_epoch:
            self._warn_removed_in_epoch(epoch)
        records = delivered = 0
        if not self._flushing:
            while policy.ready():  # a restored policy may already hold whole batches
                delivered += 1
                yield self._collate(policy.pop())
            # Samples enter the policy one at a time, so the batches do not depend on how records are read.
            put, ready, sample_key = policy.put, policy.ready, source.sample_key
            for pulled, per_record in self._tracked.batches():
                self._reading, self._absorbed = pulled, 0
                records += len(pulled.keys)
                for key, samples in zip(pulled.keys, per_record, strict=True):
                    for window, sample in enumerate(samples):
                        put(sample_key(key, window), sample)
                    self._absorbed += 1
                    while ready():
                        delivered += 1
                        yield self._collate(policy.pop())
                self._reading = None
            self._flushing = True
        while len(policy):
            delivered += 1
            yield self._collate(policy.pop())
        self._flushing, self._epoch = False, None
        if whole_epoch and not delivered:
            raise self._nothing_delivered(records, epoch)
        self._log_epoch_end(epoch, delivered, records, whole_epoch)

    def state_dict(self) -> dict:
        """The source position plus the packing policy's state (plain Python containers)."""
        unabsorbed = self._unabsorbed()
        # A source may move to the next epoch as it hands out its last keys (a mapping source does): then only the
        # policy's buffer is left of this epoch.
        source_moved_on = self._epoch is not None and self._tracked.next_epoch(unabsorbed) != self._epoch
        return self._state(
            self._tracked.state_dict(unabsorbed),
            flushing=self._flushing or source_moved_on,
            buffered_samples=len(self.policy),
            packing=self.policy.state_dict(self._source),
        )

    def load_state_dict(self, state: Mapping, *, allow_mixture_change: bool = False) -> None:
        """Continue exactly where ``state`` was saved, buffer included; a refused state changes nothing.

        Over a mixture, ``allow_mixture_change`` continues a state saved over other weights or sources
        (``mixture_change: allow`` on the mixture node does too); buffered samples of a source no longer mixed
        are dropped, with a warning giving their count (docs/mixtures.md). Over several DP ranks, mid-epoch, every
        rank must load its state at once under an initialised process group: the ranks agree on where the changed
        mixture begins (``_agreed_resume_point``).

        The DP size may change only at an epoch boundary with nothing buffered: each rank packs its own share of
        the data, so the packs of a different DP size are different batches. To change it anywhere else, give
        every loader of the new DP size the elastic state ``merge_rank_states`` makes of all the ranks' states
        (a mapping source): together they deliver the rest of the epoch, each record once.
        """
        codec = self._source
        try:
            if is_elastic(state):
                state, codec = self._rank_state(state, allow_mixture_change, self.policy)
            state = self._checked(
                state, _DYNAMIC_FIELDS, packs_per_rank=True, allow_mixture_change=allow_mixture_change
            )
            if self._before_mixture_change is not None:
                state, codec = self._without_removed_buffer(state)
            self.policy.load_state_dict(state["packing"], codec)  # checked whole first, like the parts above
        except BaseException:
            self._refused()
            raise
        self._tracked.load_state_dict(state["source"])
        self._restore_tally(state)
        self._reading, self._flushing, self._epoch = None, state["flushing"], None
        logger.info(
            "%r restored: %d buffered samples, %d key batches to read again",
            self,
            len(self.policy),
            len(self._tracked.replay),
        )

    def _without_removed_buffer(self, state: dict) -> tuple[dict, object]:
        """The state without the buffered samples of sources a changed mixture no longer mixes, and the codec
        that gives the policy the kept ones (read here once, to count their cost)."""
        packing = state["packing"]
        buffer = state_field(packing, "buffer", list, "the loader state['packing']")
        if not buffer or not all(isinstance(entry, list | tuple | Mapping) and entry for entry in buffer):
            return state, self._source  # nothing to leave out, or a damaged buffer the policy's load names
        # A mapping source's entry is [key, window]; a stream's is the sample itself, naming its source.
        readable = self.dataset.readable([entry if isinstance(entry, Mapping) else entry[0] for entry in buffer])
        kept = [entry for entry, keep in zip(buffer, readable.tolist(), strict=True) if keep]
        if len(kept) == len(buffer):
            return state, self._source
        self._warn_dropped(len(buffer) - len(kept), "buffered at the resume point")
        entries = self._source.decode_samples(kept, "the loader state['packing']['buffer']")
        tokens = sum(self.policy.cost(sample) for _, sample in entries)
        packing = {**packing, "buffer": kept, "buffer_tokens": tokens}
        return {**state, "packing": packing, "buffered_samples": len(kept)}, DecodedSamples(kept, entries)

    def __repr__(self) -> str:
        return f"DynamicBatchDataLoader({self.dataset!r}, {self.policy!r}, dp {self.dp_rank}/{self.dp_world_size})"


# Why a changed mixture is refused for a state saved while an epoch's last batches were delivered.
_ENDED_EPOCH = (
    "holds samples still to deliver from an epoch that has ended (it was saved while the last batches of an epoch "
    "were delivered); resume it with the mixture it was saved with, and change the mixture at a later state"
)
# The dynamic loader's own state fields, and their types.
_DYNAMIC_FIELDS = (("flushing", bool), ("buffered_samples", int), ("packing", Mapping))
