"""The files an offline preparation run writes: their names, the checks before writing, and their publication.

A run publishes, per json key, ``<prefix>_<key>_document.{bin,idx}`` and its ``.meta.json`` (with a chat template
also the loss-mask pair ``<prefix>_<key>_document_loss_mask``, written as a pair of its own); with
``--partitions P --keep-partition-files`` also the partition pairs ``<prefix>_<p>_<key>_document.*`` and the
manifest ``<prefix>_<key>_document.partitions.json``. Before anything is tokenized, the prefix is checked (a
directory is refused), the directory is checked for writing, temporaries left by dead runs of the same names
are removed, and existing outputs are refused unless ``overwrite`` is set.

No output is written through a symbolic link: a link at any name a run writes (an output, a partition pair, a
manifest, or one of their temporary names) is refused before anything is tokenized, naming the link.

Publication is all or nothing: every file of every key is first complete under its temporary name (partitions
merged, indices and metadata written); only then are they renamed, per pair the ``.idx`` last, the manifest
after the partition pairs it lists, the merged pair of each key last.

Owns: output names, the checks above, writing partitions through a bounded number of open files, merging,
packing carry-over per partition, and the publication order (also the order a URL prefix's uploads are copied
into place in, and the URL of each file built in a staging directory).
Not responsible for: the pair format and temporary names (``indexed.io``), the metadata contents
(``indexed.pair_metadata``), tokenizing (``offline_preparation``).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.file_writes import (
    create_temporary,
    output_error,
    refuse_links,
    remove_stale_temporaries,
    temporary_path,
    write_atomically,
)
from hyper_parallel.data.indexed.indexed_data_reader import data_file_paths
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.indexed.pair_metadata import PairMetadata, manifest_json, manifest_path, metadata_path
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
from hyper_parallel.data.tools.offline_encoding import EncodedChunk, EncodedDocuments

__all__ = [
    "OutputPlan",
    "Outputs",
    "output_name",
    "pair_in_publication_order",
    "partition_prefix",
    "plan_outputs",
    "publication_order",
    "staged_url",
    "staging_prefix",
]

logger = get_logger("hyper_parallel.data.tools.offline_outputs")

_MAX_OPEN_PARTITION_FILES = 64
# Descriptors the interpreter, its libraries and the input reader may hold; each worker adds three.
_RESERVED_FILES = 16
_LISTED = 4


def _pair_files(prefix: str) -> list[Path]:
    return [*data_file_paths(prefix), metadata_path(prefix)]


def partition_prefix(output_prefix: str, partition: int, key: str, suffix: str = "") -> str:
    """The prefix of one partition pair of one key (``suffix``: of its loss mask)."""
    return f"{output_prefix}_{partition}_{key}_document{suffix}"


def _listing(paths: list[Path]) -> str:
    """``a, b, c, d and 3 more`` (names only: they share the prefix's directory)."""
    names = ", ".join(p.name for p in paths[:_LISTED])
    return names + (f" and {len(paths) - _LISTED} more" if len(paths) > _LISTED else "")


@dataclass(frozen=True)
class OutputPlan:
    """What a run will write, checked before anything is tokenized.

    Attributes:
        published: every file the run publishes (existing ones are replaced only with ``overwrite``).
        open_files: how many partition files may be open at once within the open-file limit.
    """

    published: list[Path]
    open_files: int


def _open_file_budget(workers: int) -> int:
    try:
        import resource
    except ImportError:  # not a POSIX system: no limit to read
        return _MAX_OPEN_PARTITION_FILES
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return _MAX_OPEN_PARTITION_FILES
    available = soft - _RESERVED_FILES - 3 * workers
    if available < 2:
        needed = _RESERVED_FILES + 3 * workers + 2
        raise DataConfigError(
            f"the open-file limit is {soft}, too low for {workers} workers and the output files; raise it to at "
            f"least {needed} (ulimit -n {needed}) or use fewer --workers"
        )
    return min(_MAX_OPEN_PARTITION_FILES, available)


def _check_prefix(prefix: str) -> None:
    if prefix.endswith(("/", os.sep)) or os.path.isdir(prefix):
        stem = os.path.join(prefix, "corpus")
        raise DataConfigError(
            f"output prefix '{prefix}' is a directory; give a file stem inside it, such as {stem} (outputs are "
            "<stem>_<key>_document.{bin,idx})"
        )


def _prepare_directory(first_output: Path) -> None:
    """Create the directory and make sure a file can be created in it, before hours of tokenizing."""
    directory = first_output.parent
    probe = temporary_path(first_output)  # a name that the next run sweeps if this process dies right now
    try:
        directory.mkdir(parents=True, exist_ok=True)
        os.close(create_temporary(probe))
        probe.unlink()
    except OSError as error:
        raise output_error(directory, error) from None


def _outputs(config: OfflinePreparationConfig) -> list[tuple[str, str]]:
    """``(json key, suffix)`` of every pair a run writes, in the order they are published."""
    return [(key, suffix) for key in config.json_keys for suffix in config.output_suffixes]


def pair_in_publication_order(prefix: str) -> list[Path]:
    """The files of one published pair in the order they are published: metadata, ``.bin``, ``.idx``."""
    idx_path, bin_path = data_file_paths(prefix)
    return [metadata_path(prefix), bin_path, idx_path]


def publication_order(config: OfflinePreparationConfig, partitions: int) -> list[Path]:
    """Every file a finished run of ``partitions`` partitions (or ranks) has published, in the order of
    publication: per output its kept partition pairs, their manifest, then the merged pair."""
    order: list[Path] = []
    for key, suffix in _outputs(config):
        final = config.output_prefix_for(key, suffix)
        if partitions > 1 and config.keep_partition_files:
            for partition in range(partitions):
                order += pair_in_publication_order(partition_prefix(config.output_prefix, partition, key, suffix))
            order.append(manifest_path(final))
        order += pair_in_publication_order(final)
    return order


def staging_prefix(config: OfflinePreparationConfig, staging: Path) -> str:
    """The local prefix in the directory ``staging`` that the outputs of a URL ``output_prefix`` are built under."""
    return str(staging / config.output_prefix.rsplit("/", 1)[-1])


def staged_url(path: str | os.PathLike, staging_prefix: str, url_prefix: str) -> str:
    """The URL of a file built under ``staging_prefix`` for the output prefix ``url_prefix``."""
    return url_prefix + os.fspath(path)[len(staging_prefix) :]


def output_name(key: str, suffix: str) -> str:
    """The name of a pair's documents in ``EncodedChunk.documents``: the json key, plus the suffix of a mask."""
    return f"{key}{suffix}"


def plan_outputs(config: OfflinePreparationConfig) -> OutputPlan:
    """Check the prefix, the directory and existing outputs, and sweep temporaries of dead runs.

    Raises:
        DataConfigError: a directory as prefix, existing outputs without ``overwrite``, or an open-file limit too
            low for the workers.
        DataFileError: the directory cannot be written, or a symbolic link is at a name the run writes.
    """
    _check_prefix(config.output_prefix)
    published: list[Path] = []
    written: list[Path] = []  # every final name a temporary may be written for
    for key, suffix in _outputs(config):
        final = config.output_prefix_for(key, suffix)
        published += [*_pair_files(final), manifest_path(final)]
        if config.partitions > 1:
            parts = [
                f
                for p in range(config.partitions)
                for f in _pair_files(partition_prefix(config.output_prefix, p, key, suffix))
            ]
            written += parts
            if config.keep_partition_files:
                published += parts
    open_files = _open_file_budget(config.workers)
    refuse_links(*published, *written, *map(temporary_path, published + written))
    _prepare_directory(published[0])
    removed = remove_stale_temporaries(published + written)
    if removed:
        logger.warning(
            "removed %d temporary file(s) left in %s by an interrupted run: %s",
            len(removed),
            removed[0].parent,
            _listing(removed),
        )
    existing = [path for path in published if path.exists()]
    if existing and not config.overwrite:
        raise DataConfigError(
            f"output prefix {config.output_prefix} already has outputs in {existing[0].parent}: {_listing(existing)}; "
            "pass --overwrite to replace them (they stay intact until the new outputs are complete), or choose "
            "another --output-prefix"
        )
    return OutputPlan(published, open_files)


# -- writing ----------------------------------------------------------------------------------------------------


class _OpenFiles:
    """Keeps at most ``limit`` builders' files open; the least recently written one is closed first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: OrderedDict[int, IndexedDatasetBuilder] = OrderedDict()

    def use(self, builder: IndexedDatasetBuilder) -> None:
        key = id(builder)
        if key in self._open:
            self._open.move_to_end(key)
            return
        self._open[key] = builder
        if len(self._open) > self.limit:
            self._open.popitem(last=False)[1].release_file()


class _PartitionWriter:
    """Writes one partition of one key; with packing, keeps the token carry-over of this partition only.

    A loss mask's writer gets the same documents of the same lengths as its tokens' writer, so packing cuts both
    at the same places: record r of the mask holds the entries of the tokens of record r.
    """

    def __init__(self, prefix: str, dtype: np.dtype, pack_to_seq_len: int | None, files: _OpenFiles) -> None:
        self.prefix = prefix
        self.files = files
        self.builder = IndexedDatasetBuilder(data_file_paths(prefix)[1], dtype=dtype)
        files.use(self.builder)
        self.record_length = None if pack_to_seq_len is None else pack_to_seq_len + 1
        self.carry = np.empty(0, dtype=dtype)
        self.documents = 0
        self.tokens = 0

    def add(self, documents: EncodedDocuments) -> None:
        self.files.use(self.builder)
        if self.record_length is None:
            self.builder.add_documents(documents.tokens, documents.sequence_lengths, documents.sequences_per_document)
            self.documents += len(documents.sequences_per_document)
            self.tokens += len(documents.tokens)
            return
        stream = np.concatenate((self.carry, documents.tokens)) if len(self.carry) else documents.tokens
        full = len(stream) // self.record_length
        if full:
            used = full * self.record_length
            self.builder.add_documents(stream[:used], np.full(full, self.record_length, np.int64))
            self.documents += full
            self.tokens += used
        self.carry = stream[full * self.record_length :].copy()

    def seal(self, metadata: bytes) -> None:
        self.builder.seal(data_file_paths(self.prefix)[0], {metadata_path(self.prefix): metadata})


class _KeyOutput:
    """All partitions of one json key, merged into ``final_prefix``."""

    def __init__(
        self,
        config: OfflinePreparationConfig,
        key: str,
        suffix: str,
        dtype: np.dtype,
        files: _OpenFiles,
        metadata: bytes,
    ) -> None:
        self.final_prefix = config.output_prefix_for(key, suffix)
        self.is_mask = bool(suffix)  # not counted in the run's documents and tokens
        self.dtype = dtype
        self.metadata = metadata
        self.keep_partition_files = config.keep_partition_files
        if config.partitions == 1:
            prefixes = [self.final_prefix]
        else:
            prefixes = [partition_prefix(config.output_prefix, p, key, suffix) for p in range(config.partitions)]
        self.partitions: list[_PartitionWriter] = []
        self.merged: IndexedDatasetBuilder | None = None
        try:
            for prefix in prefixes:
                self.partitions.append(_PartitionWriter(prefix, dtype, config.pack_to_seq_len, files))
        except BaseException:
            self.abort()
            raise

    def add(self, documents: EncodedDocuments, partition_of_document: np.ndarray | None) -> None:
        if partition_of_document is None:
            self.partitions[0].add(documents)
            return
        for p in np.unique(partition_of_document):
            self.partitions[p].add(documents.select(partition_of_document == p))

    def seal(self) -> int:
        """Complete every file under its temporary name; returns the tail tokens dropped by packing."""
        dropped = sum(len(writer.carry) for writer in self.partitions)
        if len(self.partitions) == 1:
            self.partitions[0].seal(self.metadata)
            return dropped
        idx_path, bin_path = data_file_paths(self.final_prefix)
        self.merged = IndexedDatasetBuilder(bin_path, dtype=self.dtype)
        for writer in self.partitions:
            self.merged.add_builder(writer.builder)
            if self.keep_partition_files:
                writer.seal(self.metadata)
            else:
                writer.builder.abort()  # its tokens are in the merged .bin now: free the space at once
        self.merged.seal(idx_path, {metadata_path(self.final_prefix): self.metadata})
        return dropped

    def publish(self) -> None:
        """Rename the sealed files into place: partition pairs, then their manifest, then the merged pair."""
        manifest = manifest_path(self.final_prefix)
        try:
            manifest.unlink(missing_ok=True)  # an older manifest must not describe the new partition pairs
        except OSError as error:
            raise output_error(manifest, error) from None
        if self.merged is None:
            self.partitions[0].builder.publish()
            return
        if self.keep_partition_files:
            for writer in self.partitions:
                writer.builder.publish()
            counts = [(w.prefix, w.builder.num_sequences, w.documents) for w in self.partitions]
            write_atomically(manifest, manifest_json(self.final_prefix, counts))
        self.merged.publish()

    def abort(self) -> None:
        for writer in self.partitions:
            writer.builder.abort()
        if self.merged is not None:
            self.merged.abort()

    def total(self, attribute: str) -> int:
        if attribute == "sequences":
            return sum(w.builder.num_sequences for w in self.partitions)
        return sum(getattr(w, attribute) for w in self.partitions)


class Outputs:
    """Every key's output, and the assignment of records (by global index) to partitions."""

    def __init__(
        self,
        config: OfflinePreparationConfig,
        plan: OutputPlan,
        dtype: np.dtype,
        total_records: int | None,
        metadata: PairMetadata,
    ) -> None:
        files = _OpenFiles(plan.open_files)
        self.by_key: dict[str, _KeyOutput] = {}
        # A loss mask holds 0/1 per token: a pair of uint8 "ids" of a vocabulary of 2, in its own metadata.
        mask_metadata = replace(metadata, vocab_size=2, eod_id=None, token_dtype="uint8")
        try:
            for key, suffix in _outputs(config):
                self.by_key[output_name(key, suffix)] = _KeyOutput(
                    config,
                    key,
                    suffix,
                    np.dtype(np.uint8) if suffix else dtype,
                    files,
                    (mask_metadata if suffix else metadata).to_json(),
                )
        except BaseException:
            self.abort()
            raise
        self.partitions = config.partitions
        # Contiguous blocks of ceil(records / partitions) with keep_sequential_samples, else round-robin.
        self.block = None
        if config.partitions > 1 and config.keep_sequential_samples:
            self.block = max(1, -(-(total_records or 0) // config.partitions))
        self.next_record = 0

    def _partitions_of(self, documents: EncodedDocuments) -> np.ndarray | None:
        if self.partitions == 1:
            return None
        records = self.next_record + documents.record_positions
        if self.block is None:
            return records % self.partitions
        return np.minimum(records // self.block, self.partitions - 1)

    def add(self, encoded: EncodedChunk) -> None:
        for key, documents in encoded.documents.items():
            self.by_key[key].add(documents, self._partitions_of(documents))
        self.next_record += encoded.records

    def seal(self) -> int:
        """Complete every key's files under their temporary names; returns the tail tokens dropped by packing (a loss
        mask drops the entries of the same tokens, not counted again)."""
        dropped = {key: out.seal() for key, out in self.by_key.items()}
        return sum(count for key, count in dropped.items() if not self.by_key[key].is_mask)

    def publish(self) -> None:
        """Rename every sealed file into place."""
        for out in self.by_key.values():
            out.publish()

    def abort(self) -> None:
        for out in self.by_key.values():
            out.abort()

    def total(self, attribute: str) -> int:
        """``documents``, ``tokens`` or ``sequences`` written, over every key and partition (loss masks aside)."""
        return sum(out.total(attribute) for out in self.by_key.values() if not out.is_mask)
