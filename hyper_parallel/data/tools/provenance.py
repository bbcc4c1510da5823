"""Where every sequence of a micro-batch comes from: the file, the record and the token range of each.

Usage::

    hp-data provenance pipeline.yaml --batch 3
    hp-data provenance pipeline.yaml --batch 0 --dp-rank 1 --dp-size 2 --state loader_state.json --json
    hp-data provenance pipeline.yaml --step 10 --num-micro-batches 4
    hp-data provenance scheduled.yaml --step 0 --num-micro-batches 4 --rank 3 --dp-size 2 --cp-size 2

For every sequence of the N-th micro-batch (0-based) that a DP rank's loader delivers, it names the ``source`` and
``path`` (the ``.bin`` prefix or the data file), the ``record`` (the document of the ``.bin`` for Indexed data, the
row of a mapping source, the position in the rank's stream for an iterable source), ``tokens`` (the ``[start, end)``
range within that document, or within the tokenized record) and ``span`` (the ``[start, end)`` range within the
micro-batch's flattened rows, as ``cu_seq_lens`` delimits them). Micro-batches are counted from the start of the
epoch, or from the position of a saved loader state (``--state``).

Indexed answers are computed from the sampler's position and the dataset's index arrays (``shuffle_index``,
``sample_index``, ``document_index``; a blend's ``dataset_index`` and ``dataset_sample_index``): nothing before the
micro-batch is read. Online answers replay the loader's choices over the records' window lengths, tokenizing each
record once; a mapping source keeps those lengths in a cache beside its Arrow cache, so a second query tokenizes
nothing it has seen. A mixture's sample numbers are located in its sources by its plan (``MixtureDataset.locate``),
each sequence named by its source: an Indexed row packed among Online records is one window of its row length
(known without reading it), cut into its documents as the collator cuts it. A mixture with a streaming source
(``StreamMixture``) is replayed like a stream, from its cursor: its keys name their source and that source's record
(a stream's position, a mapping source's row, an Indexed sample); a sample a state buffered keeps only its source
and tokens. The loaders are built exactly as a trainer builds them (``batching.dataloader.build_dataloaders``), in
this process. Not responsible for: delivering batches (the loaders) or the packing scheduler's own delivery
(``scheduled_provenance`` plans a step as every rank does, from the traced lengths).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from hyper_parallel.data.batching.build_dataloader import DynamicBatchDataLoader, FixedBatchDataLoader
from hyper_parallel.data.batching.dataloader import SPLITS, build_dataloaders
from hyper_parallel.data.batching.key_sources import MappingKeys
from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError, ResumeStateError
from hyper_parallel.data.file_writes import write_atomically
from hyper_parallel.data.indexed.indexed_blended_dataset import BlendedDataset
from hyper_parallel.data.indexed.indexed_lazy_dataset import LazyDatasetProxy
from hyper_parallel.data.indexed.indexed_pretrain_dataset import GPTDataset, GPTFromMRDataset
from hyper_parallel.data.instantiate import load_config
from hyper_parallel.data.mixture.build_mixture import MixtureDataset
from hyper_parallel.data.mixture.mixture_stream import StreamMixture
from hyper_parallel.data.parallel.scheduling.plan import build_schedule
from hyper_parallel.data.resume_checks import dataset_identity, stable_hash, transform_identity
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer
from hyper_parallel.data.tools.cli import command_parser

__all__ = ["SequenceProvenance", "batch_provenance", "main", "scheduled_provenance", "step_provenance"]

logger = get_logger(__name__)

_LENGTH_CACHE_VERSION = 1


@dataclass(frozen=True)
class SequenceProvenance:
    """One sequence of a micro-batch and where its tokens come from.

    Attributes:
        batch: the micro-batch's number, counted from the loader's position (0-based); for a scheduled rank
            (``scheduled_provenance``), the scheduled micro-batch within the step.
        source: the source the sequence was drawn from: the ``.bin`` prefix or the data file; a mixture's source
            name.
        path: the ``.bin`` prefix or the data file that holds the tokens.
        record: the document of the ``.bin`` (Indexed), the row of a mapping source or the position in this DP
            rank's stream (Online); None for a stream sample restored from a state, or any sample of a mixture with a
            streaming source restored from one (the state keeps its tokens).
        tokens: ``[start, end)`` within that document, or within the record's tokens (EOS appended) as the
            transform makes them; None where the record is None.
        span: ``[start, end)`` of the sequence's tokens within the micro-batch's rows flattened one after another
            (for a scheduled rank, within its group's packed row before the cut over the group's CP ranks).
    """

    batch: int
    source: str
    path: str
    record: int | None
    tokens: tuple[int, int] | None
    span: tuple[int, int]

    def as_dict(self) -> dict:
        return asdict(self)


def batch_provenance(
    config,
    *,
    batch: int,
    split: str = "train",
    dp_rank: int = 0,
    dp_size: int = 1,
    state=None,
    micro_batch_size: int = 1,
    global_batch_size: int | None = None,
    tokenizer=None,
) -> list[SequenceProvenance]:
    """Every sequence of the ``batch``-th micro-batch (0-based) DP rank ``dp_rank`` of ``dp_size`` delivers.

    Args:
        config: the pipeline config (a mapping, or the path of its YAML).
        batch: the micro-batch, counted from the start of the epoch, or from ``state``'s position.
        split: the loader asked about.
        state: a loader state (``DataLoaders.state_dict()`` or one loader's ``state_dict()``), or the path of one
            saved as JSON or with ``torch.save``.
        micro_batch_size, global_batch_size, tokenizer: as ``build_dataloaders`` takes them.

    Raises:
        DataConfigError: a bad split, rank or batch number; a batch past the end of the epoch; a dataset whose
            samples cannot be traced.
        ResumeStateError: a missing or unreadable state file, or a state the loader refuses.
    """
    options = (split, dp_rank, dp_size, state, micro_batch_size, global_batch_size, tokenizer)
    return _provenance(config, batch, 1, *options)[0]


def step_provenance(
    config,
    *,
    step: int,
    num_micro_batches: int,
    split: str = "train",
    dp_rank: int = 0,
    dp_size: int = 1,
    state=None,
    micro_batch_size: int = 1,
    global_batch_size: int | None = None,
    tokenizer=None,
) -> list[list[SequenceProvenance]]:
    """``batch_provenance`` of each of the ``num_micro_batches`` micro-batches of step ``step`` (0-based, counted
    like the micro-batches), in order."""
    _check_count("num_micro_batches", num_micro_batches, 1)
    _check_count("step", step, 0)
    options = (split, dp_rank, dp_size, state, micro_batch_size, global_batch_size, tokenizer)
    return _provenance(config, step * num_micro_batches, num_micro_batches, *options)


def _check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DataConfigError(f"{name} is {value!r}; use an integer >= {minimum}")


def _provenance(config, first, count, split, dp_rank, dp_size, state, micro_batch_size, global_batch_size, tokenizer):
    _check_count("batch", first, 0)
    if split not in SPLITS:
        raise DataConfigError(f"split is {split!r}; use one of {', '.join(SPLITS)}")
    _check_count("dp_size", dp_size, 1)
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise DataConfigError(f"dp_rank is {dp_rank!r}, but the DP ranks of dp_size {dp_size} are 0 to {dp_size - 1}")
    saved = _read_state(state) if isinstance(state, str | Path) else state
    loader = _build_loader(config, split, dp_rank, dp_size, micro_batch_size, global_batch_size, tokenizer)
    if saved is not None:
        _restore(loader, saved, split)
    found = _tracer(loader, split).micro_batches(first, count)
    if len(found) < count:
        delivered = first + len(found)
        raise DataConfigError(
            f"micro-batch {delivered} is past the end of the epoch: DP rank {dp_rank} of {dp_size} delivers "
            f"{delivered} micro-batches of the {split} split from {'the saved position' if saved else 'its start'}; "
            f"ask for a micro-batch below {delivered}"
        )
    return [[provenance_of(first + number) for provenance_of in sequences] for number, sequences in enumerate(found)]


def _tracer(loader, split: str):
    if isinstance(loader, DynamicBatchDataLoader):
        return _DynamicTracer(loader)
    if isinstance(loader, FixedBatchDataLoader):
        return _FixedTracer(loader)
    raise DataConfigError(
        f"the {split} loader is a {type(loader).__name__}; provenance follows FixedBatchDataLoader and "
        "DynamicBatchDataLoader"
    )


def scheduled_provenance(
    config,
    *,
    step: int,
    num_micro_batches: int,
    rank: int,
    dp_size: int = 1,
    cp_size: int = 1,
    tp_size: int = 1,
    dynamic_cp_sizes: Sequence[int] = (),
    split: str = "train",
    micro_batch_size: int = 1,
    global_batch_size: int | None = None,
    tokenizer=None,
) -> list[list[SequenceProvenance]]:
    """The sequences of every micro-batch the packing scheduler gives rank ``rank`` of the DP x CP domain
    (``dp_rank * cp_size + cp_rank``) in step ``step`` (0-based, from the start of the epoch), when each DP rank's
    loader gives the scheduler ``num_micro_batches`` micro-batches per step (``wrap_data_iterator``).

    Every DP rank's micro-batches of the step are traced, their sequences numbered in DP-rank order, and the step is
    planned from their lengths as every rank plans it (``build_schedule``). ``batch`` is the scheduled micro-batch
    within the step and ``span`` the range within the group's packed row, before it is cut over the group's CP
    ranks (each sequence padded to the group's CP multiple inside its own span).

    Raises:
        DataConfigError: a config without a ``packing_scheduler`` node, a bad rank or size, a step past the end of
            the epoch, ``dynamic_cp`` without ``dynamic_cp_sizes``, or VPP without
            ``microbatch_group_size_per_vp_stage``.
    """
    _check_count("step", step, 0)
    _check_count("num_micro_batches", num_micro_batches, 1)
    _check_count("dp_size", dp_size, 1)
    _check_count("cp_size", cp_size, 1)
    _check_count("tp_size", tp_size, 1)
    positions = dp_size * cp_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < positions:
        raise DataConfigError(
            f"rank is {rank!r}, but the DP x CP domain of {dp_size} x {cp_size} holds ranks 0 to {positions - 1}"
        )
    traced: list[SequenceProvenance] = []
    for dp_rank in range(dp_size):
        sizes = (dp_rank, dp_size, micro_batch_size, global_batch_size)
        loaders = _build_loaders(config, split, *sizes, tokenizer, cp_size=cp_size)
        scheduler = loaders.packing_scheduler
        if scheduler is None:
            raise DataConfigError(
                "the config has no packing_scheduler node, so no rank of the DP x CP domain re-schedules the "
                "loaders' micro-batches; trace a DP rank's own micro-batches with --batch or --step and --dp-rank"
            )
        found = _tracer(_split_loader(loaders, split), split).micro_batches(step * num_micro_batches, num_micro_batches)
        traced += [sequence(-1) for sequences in found for sequence in sequences]
    if not traced:
        raise DataConfigError(
            f"step {step} is past the end of the epoch: no DP rank's loader has a micro-batch left for it with "
            f"{num_micro_batches} micro-batches per step"
        )
    layout = scheduler.layout(cp_size=cp_size, tp_size=tp_size)  # what every rank's ParallelBatch plans with
    lengths = np.array([sequence.span[1] - sequence.span[0] for sequence in traced], dtype=np.int64)
    planning = {"dp_size": dp_size, "dynamic_cp_sizes": dynamic_cp_sizes, "vpp_group": _vpp_group(scheduler)}
    schedule = build_schedule(scheduler, lengths, layout=layout, **planning)
    micro_batches = []
    for micro_batch in range(schedule.num_micro_batches):
        group = schedule.group_at(micro_batch, rank)
        chosen = list(group.sequence_ids)
        starts = np.cumsum([0, *layout.padded_lengths(lengths[chosen], group.cp_size)[:-1]]).tolist()
        micro_batches.append(
            [
                replace(traced[k], batch=micro_batch, span=(start, start + int(lengths[k])))
                for k, start in zip(chosen, starts, strict=True)
            ]
        )
    return micro_batches


def _vpp_group(scheduler) -> int:
    """The multiple of the step's micro-batch count under VPP, as ``ParallelBatch.plan`` takes it."""
    if (scheduler.vpp_size or 1) == 1:
        return 1
    if scheduler.microbatch_group_size_per_vp_stage is None:
        raise DataConfigError(
            "the packing_scheduler has vpp_size > 1 without microbatch_group_size_per_vp_stage, whose default is the "
            "PP size the mesh gives; set microbatch_group_size_per_vp_stage to trace its steps"
        )
    return scheduler.microbatch_group_size_per_vp_stage


def _read_state(path: str | Path):
    path = Path(path)
    if not path.is_file():
        raise ResumeStateError(f"the state file {path} does not exist; pass the path of a saved loader state")
    try:
        if path.suffix == ".json":
            return json.loads(path.read_text())
        return torch.load(path, weights_only=True)
    except Exception as error:  # noqa: BLE001 - json and torch raise many types; all name the file
        raise ResumeStateError(
            f"{path}: cannot read a loader state ({error}); save it with json.dump (a .json file) or torch.save"
        ) from error


def _restore(loader, saved, split: str) -> None:
    """Restore a ``DataLoaders`` state (its ``split`` entry) or a single loader's state."""
    if isinstance(saved, Mapping) and isinstance(saved.get("splits"), Mapping):
        saved = saved["splits"].get(split)
        if saved is None:
            raise ResumeStateError(f"the saved state holds no position for the {split} split; choose another --split")
    loader.load_state_dict(saved)


def _build_loader(config, split, dp_rank, dp_size, micro_batch_size, global_batch_size, tokenizer):
    loaders = _build_loaders(config, split, dp_rank, dp_size, micro_batch_size, global_batch_size, tokenizer)
    if loaders.packing_scheduler is not None:
        logger.warning(
            "the config has a packing_scheduler: the micro-batches traced are the loader's, before the scheduler "
            "re-schedules their sequences over the DP x CP ranks of each step (trace those with --rank)"
        )
    return _split_loader(loaders, split)


def _split_loader(loaders, split: str):
    loader = getattr(loaders, split)
    if loader is None:
        raise DataConfigError(f"the config builds no {split} split; choose another with --split")
    return loader


def _build_loaders(config, split, dp_rank, dp_size, micro_batch_size, global_batch_size, tokenizer, cp_size=1):
    if isinstance(config, str | Path):
        config = load_config(config)
    if isinstance(tokenizer, str | Path):
        tokenizer = build_tokenizer(tokenizer)
    # Only the split asked about gets a loader (a small other split cannot refuse the micro-batch size).
    wanted = [None if name == split else 0 for name in SPLITS]
    loaders = build_dataloaders(
        config,
        tokenizer=tokenizer,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_size,
        cp_size=cp_size,
        train_valid_test_num_samples=wanted,
        num_workers=0,
    )
    return loaders


# -- Indexed samples ---------------------------------------------------------------------------------------------


def _indexed_pieces(dataset, index: int) -> list[tuple[str, int, int, int]]:
    """``(prefix, document, start, end)`` of each piece of the input tokens of sample ``index``, in row order (an
    offline-packed record is one piece: the documents packed into it are not told apart without reading it)."""
    if isinstance(dataset, LazyDatasetProxy):
        dataset = dataset.dataset
    if isinstance(dataset, BlendedDataset):
        inner = dataset.datasets[int(dataset.dataset_index[index])]
        return _indexed_pieces(inner, int(dataset.dataset_sample_index[index]))
    if isinstance(dataset, GPTFromMRDataset):  # an offline-packed record is one sample, read from its start
        record = int(dataset.indices[index])
        return [
            (
                dataset.dataset_path,
                record,
                0,
                min(int(dataset.dataset.sequence_lengths[record]), dataset.config.seq_length),
            )
        ]
    if not isinstance(dataset, GPTDataset):
        raise DataConfigError(
            f"provenance traces GPTDataset and GPTFromMRDataset samples and weighted blends of them, not "
            f"{type(dataset).__name__}; use simple_blend: 'no' in data_config"
        )
    j = int(dataset.shuffle_index[index])
    (d0, o0), (d1, o1) = dataset.sample_index[j].tolist(), dataset.sample_index[j + 1].tolist()
    documents = dataset.document_index[d0 : d1 + 1].tolist()
    lengths = dataset.dataset.sequence_lengths
    pieces, filled, row = [], 0, dataset.config.seq_length  # the inputs are the text's first seq_length tokens
    for position, document in enumerate(documents):
        start = o0 if position == 0 else 0
        end = o1 + dataset.config.extra_token if position == len(documents) - 1 else int(lengths[document])
        end = min(end, start + row - filled)
        if end > start:
            pieces.append((dataset.dataset_path, document, start, end))
            filled += end - start
    return pieces


def _indexed_path(dataset) -> str:
    """The prefix of an Indexed dataset; a blend's prefixes, comma-separated."""
    if isinstance(dataset, LazyDatasetProxy):
        dataset = dataset.dataset
    if isinstance(dataset, BlendedDataset):
        return ", ".join(_indexed_path(inner) for inner in dataset.datasets)
    return str(dataset.dataset_path)


def _sample_pieces(dataset, index: int) -> list[tuple[str, str, int, int, int]]:
    """``(source, path, document, start, end)`` of each piece of Indexed sample ``index``; a mixture's sample is
    its source's record, named by the source."""
    if isinstance(dataset, MixtureDataset):
        (source,), (record,) = dataset.locate([index])
        inner = dataset.sources[int(source)]
        return [(inner.name, *piece[1:]) for piece in _sample_pieces(inner.dataset, int(record))]
    return [(prefix, prefix, document, start, end) for prefix, document, start, end in _indexed_pieces(dataset, index)]


def _indexed_sequences(dataset, indices: Sequence[int], row_length: int) -> list:
    sequences = []
    for row, index in enumerate(indices):
        offset = row * row_length
        for source, prefix, document, start, end in _sample_pieces(dataset, index):
            span = (offset, offset + end - start)
            sequences.append(_maker(source, prefix, document, (start, end), span))
            offset = span[1]
    return sequences


def _seq_length(dataset) -> int:
    """The row length of an Indexed dataset, a blend of them, or a mixture of them."""
    while isinstance(dataset, LazyDatasetProxy | BlendedDataset | MixtureDataset):
        if isinstance(dataset, LazyDatasetProxy):
            dataset = dataset.dataset
        else:
            dataset = dataset.sources[0].dataset if isinstance(dataset, MixtureDataset) else dataset.datasets[0]
    return dataset.config.seq_length


def _maker(source, path, record, tokens, span):
    return lambda batch: SequenceProvenance(batch, str(source), str(path), record, tokens, span)


# -- Online records ----------------------------------------------------------------------------------------------


class _RecordLengths:
    """The window lengths each record of one Online dataset gives, from its transform, kept in a cache for a mapping
    source.

    The cache is one ``.npz`` beside the source's Arrow cache, named by the data and transform identities (so
    other files or other transform settings never read it), written to a temporary name and renamed.
    """

    def __init__(self, records, cache: Path | None) -> None:
        self._records = records  # a key in, the record's samples out
        self._lengths: dict[int, list[int]] = {}
        self._cache = cache
        self._new = False
        if self._cache is not None and self._cache.is_file():
            self._lengths = _read_length_cache(self._cache)

    def of(self, keys: list) -> list[list[int]]:
        """Each key's window lengths (a mapping source's keys are record indices, a stream's (position, record))."""
        if self._cache is None:
            return [[len(s["input_ids"]) for s in samples] for samples in self._records.__getitems__(keys)]
        missing = [key for key in dict.fromkeys(keys) if key not in self._lengths]
        if missing:
            for key, samples in zip(missing, self._records.__getitems__(missing), strict=True):
                self._lengths[key] = [len(sample["input_ids"]) for sample in samples]
            self._new = True
        return [self._lengths[key] for key in keys]

    @staticmethod
    def record(key) -> int:
        return _record_key(key)

    def restored(self, key, sample) -> list:
        """``[((record, token start), length)]`` of a policy entry a restored state holds: a mapping source's
        ``(record, window)``; a stream's None, whose record the state does not keep."""
        return [((None, 0), len(sample["input_ids"]))] if key is None else [_restored_window(key, self)]

    def save(self) -> None:
        if not self._new:
            return
        records = sorted(self._lengths)
        counts = np.array([len(self._lengths[r]) for r in records], dtype=np.int64)
        flat = np.fromiter((n for r in records for n in self._lengths[r]), dtype=np.int64, count=int(counts.sum()))
        indices = np.array(records, np.int64)
        write_atomically(
            self._cache, _npz_bytes(version=_LENGTH_CACHE_VERSION, records=indices, counts=counts, lengths=flat)
        )
        self._new = False


class _MixtureLengths:
    """The window lengths of a mixture's samples: an Indexed sample is one window of its row length (known without
    reading it), an Online sample its source record's windows (``_RecordLengths``, cached per mapping source).

    A planned mixture's keys are its sample numbers, located by its plan; a ``StreamMixture``'s are its
    ``(n, payload)`` keys, which name their source and its record (a stream's ``(position, record)``, read here).
    """

    def __init__(self, mixture: MixtureDataset | StreamMixture) -> None:
        self._mixture = mixture
        streams = getattr(mixture, "streams", [None] * len(mixture.sources))
        self._sources = [
            [_seq_length(source.dataset)]
            if not _is_online(source.dataset)
            else _RecordLengths(source.dataset.record_reading().records, None)
            if stream is not None
            else _RecordLengths(source.dataset, _cache_path(source.dataset, _source_identities(source.dataset)))
            for source, stream in zip(mixture.sources, streams, strict=True)
        ]

    def _located(self, keys: list) -> tuple[np.ndarray, list]:
        """Each key's source id and the key its source reads it by."""
        if isinstance(self._mixture, MixtureDataset):
            sources, records = self._mixture.locate(keys)
            return sources, records.tolist()
        inner = [(p["position"], p["record"]) if "record" in p else p["index"] for _, p in keys]
        return self._mixture.sources_of(keys), inner

    def record(self, key) -> int | tuple[int, int]:
        """What a sequence's ``record`` is found from: a planned mixture's sample number, or a ``StreamMixture``
        key's ``(source id, record)`` (a stream's record is its position in this rank's stream)."""
        if isinstance(self._mixture, MixtureDataset):
            return int(key)
        (source,), (inner,) = self._located([key])
        return int(source), _record_key(inner)

    def restored(self, key, sample) -> list:
        """``((record, token start), length)`` of each sequence of a policy entry a restored state holds: a planned
        mixture's ``(sample, window)``; a ``StreamMixture``'s ``((n, source name), window)``, whose record the state
        does not keep (an Indexed row's documents, each a sequence, are known by their lengths alone)."""
        if isinstance(self._mixture, MixtureDataset):
            return [_restored_window(key, self)]
        (_, name), _ = key
        source = self._mixture.names.index(name)
        sizes = sample.get("document_lengths", [len(sample["input_ids"])])
        return [(((source, None), 0), int(size)) for size in sizes]

    def of(self, keys: list) -> list[list[int]]:
        sources, records = self._located(keys)
        lengths: list = [None] * len(keys)
        for source in np.unique(sources).tolist():
            chosen = np.flatnonzero(sources == source).tolist()
            of_source = self._sources[source]
            found = of_source.of([records[k] for k in chosen]) if isinstance(of_source, _RecordLengths) else None
            for slot, position in enumerate(chosen):
                lengths[position] = of_source if found is None else found[slot]
        return lengths

    def save(self) -> None:
        for of_source in self._sources:
            if isinstance(of_source, _RecordLengths):
                of_source.save()


def _is_online(dataset) -> bool:
    reading = getattr(dataset, "record_reading", None)
    return callable(reading) and reading() is not None


def _source_identities(dataset) -> list:
    return [dataset_identity(dataset), transform_identity(dataset.record_reading().transform)]


def _restored_window(key, lengths) -> tuple:
    """``((record, token start), length)`` of window ``window`` of a restored ``(record, window)`` key."""
    record, window = key
    return _windows(lengths.record(record), lengths.of([record])[0])[window]


def _window_lengths(loader) -> _RecordLengths | _MixtureLengths:
    if isinstance(loader.dataset, MixtureDataset | StreamMixture):
        return _MixtureLengths(loader.dataset)
    mapping = isinstance(loader._source, MappingKeys)
    cache = _cache_path(loader.dataset, [*loader._source.identities]) if mapping else None
    return _RecordLengths(loader._source.dataset, cache)  # the worker-side dataset


def _read_length_cache(path: Path) -> dict[int, list[int]]:
    """The cached window lengths by record; an unreadable or older cache is ignored (and rewritten once)."""
    try:
        with np.load(path) as saved:
            if int(saved["version"]) != _LENGTH_CACHE_VERSION:
                return {}
            splits = np.split(saved["lengths"], np.cumsum(saved["counts"])[:-1])
            return {record: lengths.tolist() for record, lengths in zip(saved["records"].tolist(), splits, strict=True)}
    except (OSError, ValueError, KeyError) as error:
        logger.warning("ignored the unreadable provenance length cache %s (%s); it is written again", path, error)
        return {}


def _npz_bytes(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _cache_path(dataset, identities: list) -> Path | None:
    """The length cache of a mapping source, beside its Arrow cache; None for a source held in memory."""
    cache_files = getattr(getattr(dataset, "source", None), "hf_dataset", None)
    cache_files = getattr(cache_files, "cache_files", None)
    if not cache_files:
        return None
    return Path(cache_files[0]["filename"]).parent / f"provenance_lengths-{stable_hash(identities)}.npz"


def _window_pieces(dataset):
    """What a packed window ``(record, token start, length)`` of the loader's dataset holds: a list of
    ``(source, path, record, tokens, length)``, one per sequence the collator makes of it."""
    if not isinstance(dataset, MixtureDataset | StreamMixture):
        path = str(dataset.description)
        return lambda record, start, length: [
            (path, path, record, None if record is None else (start, start + length), length)
        ]

    def pieces(record, start: int, length: int) -> list:
        """A planned mixture's record is its sample number, a ``StreamMixture``'s ``(source id, record)``."""
        if isinstance(dataset, MixtureDataset):
            (source,), (record,) = dataset.locate([record])
        else:
            source, record = record
        inner = dataset.sources[int(source)]
        online = _is_online(inner.dataset)
        if record is None:  # a sample a restored state buffered: its tokens only (of an Indexed row, one document)
            path = str(inner.dataset.description) if online else _indexed_path(inner.dataset)
            return [(inner.name, path, None, None, length)]
        if online:
            path = str(inner.dataset.description)
            return [(inner.name, path, int(record), (start, start + length), length)]
        # An Indexed row enters whole and is cut into its documents (``document_lengths``): one sequence each.
        return [
            (inner.name, prefix, document, (begin, end), end - begin)
            for _, prefix, document, begin, end in _sample_pieces(inner.dataset, int(record))
        ]

    return pieces


def _online_sequences(entries: list, pieces, pad_each_sequence_to: int) -> list:
    """The sequences of a packed row: ``entries`` are ``((record, token start), length)``, in packing order."""
    sequences, offset = [], 0
    for (record, start), length in entries:
        for source, path, inner, tokens, size in pieces(record, start, length):
            sequences.append(_maker(source, path, inner, tokens, (offset, offset + size)))
            offset += size + -size % pad_each_sequence_to
    return sequences


def _record_key(key) -> int:
    return key[0] if isinstance(key, tuple | list) else int(key)  # a stream's (position, record), a mapping's index


def _windows(record, lengths: list[int]) -> list[tuple[tuple, int]]:
    """``((record, token start), length)`` of a record's windows: consecutive ranges of its tokens."""
    starts = np.cumsum([0, *lengths[:-1]]).tolist()
    return [((record, start), length) for start, length in zip(starts, lengths, strict=True)]


@dataclass(frozen=True)
class _Window:
    """The key of a stand-in sample in the dynamic loader's policy: its record and first token."""

    record: int | tuple[int, int]  # a StreamMixture's (source id, record)
    start: int


# -- the loaders -------------------------------------------------------------------------------------------------


class _FixedTracer:
    """Micro-batches of a ``FixedBatchDataLoader``: one source batch of keys each."""

    def __init__(self, loader: FixedBatchDataLoader) -> None:
        self.loader = loader
        self._source = loader._source
        self._pad = getattr(loader.collate_fn, "pad_each_sequence_to", 1)

    def micro_batches(self, first: int, count: int) -> list[list]:
        if self._source.transform is None:
            return self._indexed(first, count)
        lengths, found, number = _window_lengths(self.loader), [], 0
        pieces = _window_pieces(self.loader.dataset)
        for pulled in self.loader._tracked._pulls():
            per_record = lengths.of(pulled.keys)
            entries = []
            for key, windows in zip(pulled.keys, per_record, strict=True):
                if len(windows) > 1:
                    raise DataFileError(
                        f"{self._source.dataset.where(key)} gave {len(windows)} samples, but FixedBatchDataLoader "
                        "takes exactly one sample per record; use DynamicBatchDataLoader or raise max_seq_len"
                    )
                entries += _windows(lengths.record(key), windows)
            if not entries:  # every record of the batch was skipped: the loader delivers no batch for it
                continue
            if number >= first:
                found.append(_online_sequences(entries, pieces, self._pad))
                if len(found) == count:
                    break
            number += 1
        lengths.save()
        return found

    def _indexed(self, first: int, count: int) -> list[list]:
        """From the sampler's position, without reading any sample: a mapping source's batches are a pure function
        of the micro-step."""
        tracked, sampler = self.loader._tracked, self._source.sampler
        row_length = _seq_length(self.loader.dataset)
        if tracked.replay:  # a restored state with key batches to read first: walk them in order
            batches = (pulled.keys for pulled in tracked._pulls())
            keys = [batch for _, batch in zip(range(first + count), batches, strict=False)][first:]
        else:
            micro_step = sampler.consumed_samples // (sampler.micro_batch_size * sampler.dp_world_size)
            steps = range(first, min(first + count, len(sampler)))
            keys = [sampler.batch_indices(micro_step + step) for step in steps]
        return [_indexed_sequences(self.loader.dataset, batch, row_length) for batch in keys]


class _DynamicTracer:
    """Micro-batches of a ``DynamicBatchDataLoader``: its packing policy replayed over the records' window lengths.

    The loader's own policy (restored with the state, buffer included) is given stand-in samples of each window's
    length, keyed by their ``_Window``; the policy chooses by cost alone, as the loader's does.
    """

    def __init__(self, loader: DynamicBatchDataLoader) -> None:
        self.loader = loader
        self._pad = getattr(loader.collate_fn, "pad_each_sequence_to", 1)
        self._pieces = _window_pieces(loader.dataset)

    @staticmethod
    def _entries(key, sample, lengths: _RecordLengths | _MixtureLengths) -> list:
        """``((record, token start), length)`` of each sequence of a policy entry: one put here, or one a restored
        state holds."""
        if isinstance(key, _Window):
            return [((key.record, key.start), len(sample["input_ids"]))]
        return lengths.restored(key, sample)

    def micro_batches(self, first: int, count: int) -> list[list]:
        loader, policy = self.loader, self.loader.policy
        found, number = [], 0
        lengths = _window_lengths(loader)

        def take() -> bool:
            nonlocal number
            chosen = [entry for key, sample in policy.pop() for entry in self._entries(key, sample, lengths)]
            if number >= first:
                found.append(_online_sequences(chosen, self._pieces, self._pad))
            number += 1
            return len(found) == count

        done = False
        if not loader._flushing:
            while policy.ready() and not done:
                done = take()
            pulls = loader._tracked._pulls()
            while not done:
                pulled = next(pulls, None)
                if pulled is None:
                    break
                for key, windows in zip(pulled.keys, lengths.of(pulled.keys), strict=True):
                    for entry_key, length in _windows(lengths.record(key), windows):
                        stand_in = np.zeros(length, np.int64)
                        policy.put(_Window(*entry_key), {"input_ids": stand_in, "labels": stand_in})
                    while policy.ready() and not done:
                        done = take()
                    if done:
                        break
        while len(policy) and not done:
            done = take()
        lengths.save()
        return found


# -- the command -------------------------------------------------------------------------------------------------

_EXAMPLES = """examples:
  hp-data provenance examples/indexed_documents.yaml --batch 3
  hp-data provenance pipeline.yaml --batch 0 --dp-rank 1 --dp-size 2 --state state.json --json
  hp-data provenance pipeline.yaml --step 10 --num-micro-batches 4 --micro-batch-size 2
  hp-data provenance scheduled.yaml --step 0 --num-micro-batches 4 --rank 3 --dp-size 2 --cp-size 2"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(
        "provenance",
        "Name the file, record and token range of every sequence of a micro-batch a DP rank's loader delivers.",
        _EXAMPLES,
    )
    parser.add_argument("config", help="the pipeline YAML (dataset, dataloader and collate_fn nodes)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--batch", type=int, help="the micro-batch, 0-based, counted from the start or from --state")
    which.add_argument("--step", type=int, help="every micro-batch of this step (0-based); needs --num-micro-batches")
    parser.add_argument("--num-micro-batches", type=int, help="micro-batches per step, with --step")
    parser.add_argument("--split", choices=SPLITS, default="train", help="which loader (default: train)")
    parser.add_argument("--dp-rank", type=int, default=0, help="the DP rank whose loader is traced (default: 0)")
    parser.add_argument("--dp-size", type=int, default=1, help="the number of DP ranks (default: 1)")
    parser.add_argument("--state", help="a saved loader state (JSON or torch.save) to count micro-batches from")
    parser.add_argument(
        "--rank",
        type=int,
        help="with --step and a packing_scheduler node: the DP x CP rank (dp_rank * cp_size + cp_rank) whose "
        "scheduled micro-batches are traced",
    )
    parser.add_argument("--cp-size", type=int, default=1, help="the CP size, with --rank (default: 1)")
    parser.add_argument("--tp-size", type=int, default=1, help="the TP size, with --rank (default: 1)")
    parser.add_argument(
        "--dynamic-cp-sizes", type=int, nargs="+", default=(), help="the dynamic CP sizes of a dynamic_cp scheduler"
    )
    parser.add_argument("--micro-batch-size", type=int, default=1, help="micro batch size (default: 1)")
    parser.add_argument("--global-batch-size", type=int, help="global batch size (default: micro x DP size)")
    parser.add_argument(
        "--tokenizer",
        help="local Hugging Face tokenizer directory or tokenizer.json (default: the config's model_assets.tokenizer, "
        "else the bundled one)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per sequence instead of text")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 2 error)."""
    args = parse_args(argv)
    try:
        for sequences in _query(args):
            for sequence in sequences:
                if args.json:
                    print(json.dumps(sequence.as_dict()))
                    continue
                tokens = "record unknown (a sample the state buffered)"
                if sequence.tokens is not None:
                    tokens = f"record {sequence.record} tokens [{sequence.tokens[0]}, {sequence.tokens[1]})"
                span = f"[{sequence.span[0]}, {sequence.span[1]})"
                source = "" if sequence.source == sequence.path else f"{sequence.source} "  # a mixture's source
                print(f"batch {sequence.batch} span {span}: {source}{sequence.path} {tokens}")
    except (DataConfigError, DataFileError, ResumeStateError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _query(args: argparse.Namespace) -> list[list[SequenceProvenance]]:
    config = load_config(args.config)
    assets = config.get("model_assets")
    tokenizer = args.tokenizer
    if tokenizer is None and not (isinstance(assets, Mapping) and assets.get("tokenizer") is not None):
        tokenizer = BUNDLED_TOKENIZER_PATH
    common = {
        "split": args.split,
        "dp_rank": args.dp_rank,
        "dp_size": args.dp_size,
        "state": args.state,
        "micro_batch_size": args.micro_batch_size,
        "global_batch_size": args.global_batch_size,
        "tokenizer": tokenizer,
    }
    if args.step is not None and args.num_micro_batches is None:
        raise DataConfigError("--step needs --num-micro-batches (the micro-batches of one step on a DP rank)")
    if args.rank is not None:
        if args.step is None or args.state is not None or args.dp_rank != 0:
            raise DataConfigError(
                "--rank traces one step of the packing scheduler from the start of the epoch: give it with --step "
                "and --num-micro-batches, without --batch, --dp-rank or --state"
            )
        del common["state"], common["dp_rank"]
        return scheduled_provenance(
            config,
            step=args.step,
            num_micro_batches=args.num_micro_batches,
            rank=args.rank,
            cp_size=args.cp_size,
            tp_size=args.tp_size,
            dynamic_cp_sizes=tuple(args.dynamic_cp_sizes),
            **common,
        )
    if args.step is not None:
        return step_provenance(config, step=args.step, num_micro_batches=args.num_micro_batches, **common)
    if args.num_micro_batches is not None:
        raise DataConfigError("--num-micro-batches goes with --step; with --batch, leave it out")
    return [batch_provenance(config, batch=args.batch, **common)]


if __name__ == "__main__":
    sys.exit(main())
