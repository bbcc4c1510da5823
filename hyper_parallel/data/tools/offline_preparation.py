"""Offline preparation: raw text files to Megatron-compatible ``.bin``/``.idx`` pairs.

Usage::

    python -m hyper_parallel.data.tools.offline_preparation \\
        --dataset-name-or-path /data/train.jsonl --output-prefix /data/train \\
        --json-keys text --tokenizer-name-or-path /models/tokenizer --append-eod true [--pack-to-seq-len 4096]

writes ``/data/train_text_document.{bin,idx}``. Without ``--pack-to-seq-len`` every record becomes one
document (one sequence per string, several for a list of strings), for GPTDataset. With it, tokens are
concatenated and cut into records of N + 1 tokens, for GPTFromMRDataset; each partition packs on its own and
drops its own tail.

Owns: orchestration (worker processes, partitions, packing, merging, progress and the summary).
Not responsible for: parsing records (``offline_encoding``), finding files (``text.online.online_utils``),
the file format (``indexed.io``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.idx_format import optimal_token_dtype
from hyper_parallel.data.indexed.indexed_data_reader import data_file_paths
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.text.build_tokenizer import build_tokenizer
from hyper_parallel.data.text.online.online_utils import (
    RecordChunk,
    count_records,
    iter_record_chunks,
    resolve_data_files,
)
from hyper_parallel.data.tools.offline_config import (
    OfflinePreparationConfig,
    add_preparation_arguments,
    config_from_args,
)
from hyper_parallel.data.tools.offline_encoding import (
    EncodedChunk,
    EncodedDocuments,
    EncodingSettings,
    encode_chunk_in_worker,
    init_worker,
    template_fields,
)

__all__ = ["PreparationSummary", "RecordSource", "main", "run_offline_preparation"]

logger = get_logger("hyper_parallel.data.tools.offline_preparation")
_MAX_LOGGED_BAD_RECORDS = 5


@dataclass
class RecordSource:
    """Where the raw records come from: chunks, their total size for progress, and how many records."""

    chunks: Iterable[RecordChunk]
    total_bytes: int | None = None
    total_records: int | None = None


@dataclass
class PreparationSummary:
    """What a run wrote. ``documents``, ``sequences`` and ``tokens`` are summed over the json keys."""

    outputs: dict[str, str]
    token_dtype: str
    records: int = 0
    documents: int = 0
    sequences: int = 0
    tokens: int = 0
    empty_documents: int = 0
    bad_records: int = 0
    dropped_tail_tokens: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    packed_to: int | None = None

    def table(self) -> str:
        rate = lambda n: f"{n / self.seconds:,.0f}/s" if self.seconds else "-"  # noqa: E731
        rows = [
            ("records read", f"{self.records:,}", rate(self.records)),
            ("documents written", f"{self.documents:,}", rate(self.documents)),
            ("sequences written", f"{self.sequences:,}", ""),
            ("tokens written", f"{self.tokens:,}", rate(self.tokens)),
            ("empty documents skipped", f"{self.empty_documents:,}", ""),
            ("bad records skipped", f"{self.bad_records:,}", ""),
            (
                "input",
                f"{self.input_bytes / 1e6:,.1f} MB",
                f"{self.input_bytes / 1e6 / max(self.seconds, 1e-9):,.1f} MB/s",
            ),
            ("time", f"{self.seconds:,.2f} s", ""),
            ("token dtype", self.token_dtype, ""),
        ]
        if self.packed_to is not None:
            rows.insert(
                3, (f"tail tokens dropped (records of {self.packed_to + 1})", f"{self.dropped_tail_tokens:,}", "")
            )
        width = max(len(r[0]) for r in rows)
        lines = [f"  {name:<{width}}  {value:>16}  {extra}".rstrip() for name, value, extra in rows]
        lines += [f"  output [{key}]: {prefix}.{{bin,idx}}" for key, prefix in self.outputs.items()]
        return "\n".join(lines)


# -- writing: one writer per (key, partition) --------------------------------------------------------------------


class _PartitionWriter:
    """Writes one partition of one key; with packing, keeps the token carry-over of this partition only."""

    def __init__(self, prefix: str, dtype: np.dtype, pack_to_seq_len: int | None) -> None:
        self.prefix = prefix
        idx_path, bin_path = data_file_paths(prefix)
        self.idx_path = idx_path
        self.builder = IndexedDatasetBuilder(bin_path, dtype=dtype)
        self.record_length = None if pack_to_seq_len is None else pack_to_seq_len + 1
        self.carry = np.empty(0, dtype=dtype)
        self.documents = 0
        self.tokens = 0

    def add(self, documents: EncodedDocuments) -> None:
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

    def finalize(self) -> int:
        """Publish the files; returns the tail tokens dropped by packing."""
        self.builder.finalize(self.idx_path)
        return len(self.carry)

    def abort(self) -> None:
        self.builder.abort()


class _KeyOutput:
    """All partitions of one json key, merged into ``final_prefix`` at the end."""

    def __init__(self, config: OfflinePreparationConfig, key: str, dtype: np.dtype) -> None:
        self.final_prefix = config.output_prefix_for(key)
        self.dtype = dtype
        self.keep_partition_files = config.keep_partition_files
        if config.partitions == 1:
            prefixes = [self.final_prefix]
        else:
            prefixes = [f"{config.output_prefix}_{p}_{key}_document" for p in range(config.partitions)]
        self.partitions = [_PartitionWriter(prefix, dtype, config.pack_to_seq_len) for prefix in prefixes]
        self.published: list[str] = []

    def add(self, documents: EncodedDocuments, partition_of_document: np.ndarray | None) -> None:
        if partition_of_document is None:
            self.partitions[0].add(documents)
            return
        for p in np.unique(partition_of_document):
            self.partitions[p].add(documents.select(partition_of_document == p))

    def finalize(self) -> int:
        dropped = 0
        for writer in self.partitions:
            dropped += writer.finalize()
            self.published.append(writer.prefix)
        if len(self.partitions) > 1:
            merged = IndexedDatasetBuilder(data_file_paths(self.final_prefix)[1], dtype=self.dtype)
            with merged:
                for prefix in self.published:
                    merged.add_index(prefix)
                merged.finalize(data_file_paths(self.final_prefix)[0])
            if not self.keep_partition_files:
                for prefix in self.published:
                    for path in data_file_paths(prefix):
                        path.unlink(missing_ok=True)
        return dropped

    def abort(self) -> None:
        for writer in self.partitions:
            if writer.prefix not in self.published:
                writer.abort()

    @property
    def documents(self) -> int:
        return sum(w.documents for w in self.partitions)

    @property
    def tokens(self) -> int:
        return sum(w.tokens for w in self.partitions)

    @property
    def sequences(self) -> int:
        return sum(w.builder.num_sequences for w in self.partitions)


class _Outputs:
    """Every key's output, and the assignment of records (by global index) to partitions."""

    def __init__(self, config: OfflinePreparationConfig, dtype: np.dtype, total_records: int | None) -> None:
        self.by_key = {key: _KeyOutput(config, key, dtype) for key in config.json_keys}
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

    def finalize(self) -> int:
        """Publish every output; returns the tail tokens dropped by packing."""
        return sum(out.finalize() for out in self.by_key.values())

    def abort(self) -> None:
        for out in self.by_key.values():
            out.abort()

    def total(self, attribute: str) -> int:
        return sum(getattr(out, attribute) for out in self.by_key.values())


# -- progress ---------------------------------------------------------------------------------------------------


class _Progress:
    """A tqdm bar (on a terminal) plus a log line every ``log_interval`` documents."""

    def __init__(self, total_bytes: int | None, log_interval: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1000,
            desc="tokenizing",
            disable=None,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self.start = time.perf_counter()
        self.log_interval = log_interval
        self.next_log = log_interval
        self.bytes = 0

    def update(self, bytes_read: int, documents: int, tokens: int) -> None:
        self.bar.update(bytes_read - self.bytes)
        self.bytes = bytes_read
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix(docs_s=f"{documents / elapsed:,.0f}", tok_s=f"{tokens / elapsed:,.0f}", refresh=False)
        if documents >= self.next_log:
            logger.info(
                "processed %d documents (%.0f docs/s, %.0f tokens/s, %.2f MB/s)",
                documents,
                documents / elapsed,
                tokens / elapsed,
                bytes_read / elapsed / 1e6,
            )
            self.next_log = (documents // self.log_interval + 1) * self.log_interval

    def close(self) -> None:
        self.bar.close()


# -- the run ----------------------------------------------------------------------------------------------------


def _local_source(config: OfflinePreparationConfig) -> RecordSource:
    files, fmt = resolve_data_files(config.dataset_name_or_path)
    columns = template_fields(config.text_template) if config.text_template else list(config.json_keys)
    total_records = None
    if config.partitions > 1 and config.keep_sequential_samples:
        total_records = count_records(files, fmt, columns)
    logger.info("reading %d %s file(s) from %s", len(files), fmt, config.dataset_name_or_path)
    return RecordSource(
        chunks=iter_record_chunks(files, fmt, config.chunk_size, columns),
        total_bytes=sum(p.stat().st_size for p in files),
        total_records=total_records,
    )


def _token_dtype(config: OfflinePreparationConfig, vocab_size: int) -> np.dtype:
    dtype = optimal_token_dtype(vocab_size) if config.token_dtype is None else np.dtype(config.token_dtype)
    if not np.issubdtype(dtype, np.integer) or np.iinfo(dtype).max < vocab_size - 1:
        raise DataConfigError(
            f"token dtype {dtype} cannot hold the {vocab_size} token ids of the tokenizer; "
            "omit --dtype to let it be chosen from the vocabulary size"
        )
    return dtype


def _submit_in_order(pool, chunks: Iterable[RecordChunk], window: int) -> Iterator[tuple[RecordChunk, EncodedChunk]]:
    """Encode chunks on the pool, at most ``window`` in flight (bounded memory), yielding results in order.

    If the consumer stops early (an error), chunks not yet started are cancelled; running ones finish, so no
    worker is killed mid-write (killing one can leave the pool's result queue locked).
    """
    pending: deque = deque()
    try:
        for chunk in chunks:
            pending.append((chunk, pool.submit(encode_chunk_in_worker, chunk)))
            if len(pending) >= window:
                chunk, future = pending.popleft()
                yield chunk, future.result()
        while pending:
            chunk, future = pending.popleft()
            yield chunk, future.result()
    finally:
        for _, future in pending:
            future.cancel()


def run_offline_preparation(config: OfflinePreparationConfig, source: RecordSource | None = None) -> PreparationSummary:
    """Tokenize every record of the input and write one ``.bin``/``.idx`` pair per json key.

    Args:
        config: the validated options.
        source: where records come from; default: the files named by ``config.dataset_name_or_path``.

    Returns:
        What was written and how fast.
    """
    started = time.perf_counter()
    tokenizer = build_tokenizer(config.tokenizer_name_or_path)
    if config.append_eod and tokenizer.eod is None:
        raise DataConfigError(
            f"tokenizer {config.tokenizer_name_or_path} has no EOS token to append; set eos_token in its "
            "tokenizer_config.json, or pass --append-eod false"
        )
    if config.pack_to_seq_len is not None and not config.append_eod:
        logger.warning(
            "packing to %d without --append-eod: document boundaries cannot be recovered from the packed records",
            config.pack_to_seq_len,
        )
    dtype = _token_dtype(config, tokenizer.vocab_size)
    source = source or _local_source(config)
    settings = EncodingSettings(
        json_keys=config.json_keys,
        text_template=config.text_template,
        append_eod=config.append_eod,
        eod_id=tokenizer.eod,
        add_special_tokens=config.add_special_tokens,
        token_dtype=dtype.str,
    )
    Path(config.output_prefix).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
    outputs = _Outputs(config, dtype, source.total_records)
    summary = PreparationSummary(
        outputs={key: out.final_prefix for key, out in outputs.by_key.items()},
        token_dtype=str(dtype),
        packed_to=config.pack_to_seq_len,
    )
    progress = _Progress(source.total_bytes, config.log_interval)
    try:
        with ProcessPoolExecutor(
            config.workers,
            mp_context=multiprocessing.get_context("spawn"),  # forking after tokenizer threads start can deadlock
            initializer=init_worker,
            initargs=(tokenizer.backend.to_str(), settings, config.skip_bad_records),
        ) as pool:
            encoded_chunks = _submit_in_order(pool, source.chunks, window=2 * config.workers + 2)
            try:
                for chunk, encoded in encoded_chunks:
                    _count_bad_records(encoded, config.skip_bad_records, summary)
                    outputs.add(encoded)
                    summary.records += encoded.records
                    summary.empty_documents += encoded.empty_documents
                    summary.input_bytes = chunk.bytes_read
                    progress.update(chunk.bytes_read, outputs.total("documents"), outputs.total("tokens"))
            finally:
                encoded_chunks.close()  # cancel queued work before the pool shuts down
        summary.dropped_tail_tokens = outputs.finalize()
    except BaseException:
        outputs.abort()
        raise
    finally:
        progress.close()
    summary.documents = outputs.total("documents")
    summary.tokens = outputs.total("tokens")
    summary.sequences = outputs.total("sequences")
    summary.seconds = time.perf_counter() - started
    if summary.documents == 0:
        logger.warning("no documents were written: every record was empty, malformed or shorter than one record")
    return summary


def _count_bad_records(encoded: EncodedChunk, skip: bool, summary: PreparationSummary) -> None:
    """Stop at the first malformed record, or count it and log the first few."""
    if not encoded.bad_records:
        return
    if not skip:
        raise DataFileError(encoded.bad_records[0])
    for message in encoded.bad_records[: max(0, _MAX_LOGGED_BAD_RECORDS - summary.bad_records)]:
        logger.warning("skipped: %s", message)
    summary.bad_records += len(encoded.bad_records)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hyper_parallel.data.tools.offline_preparation",
        description=__doc__.split("Owns:")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dataset-name-or-path",
        required=True,
        help="a file, a glob or a directory of .json/.jsonl(.gz), .parquet, .csv(.gz), .arrow or .txt(.gz) files",
    )
    add_preparation_arguments(parser)
    return parser


def run_cli(run, summary_header: str) -> int:
    """Shared tail of the preparation commands: run, print the summary, turn bad input into exit code 2."""
    try:
        summary = run()
    except (DataFileError, DataConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no output was published (temporary files removed)", file=sys.stderr)
        return 130
    print(summary_header)
    print(summary.table())
    return 0


def main(argv: list[str] | None = None) -> int:
    from hyper_parallel.data.dataset_logging import enable_dataset_logging

    args = build_parser().parse_args(argv)
    enable_dataset_logging("info", ranks=None)

    def run() -> PreparationSummary:
        return run_offline_preparation(config_from_args(args))

    return run_cli(run, "offline preparation finished:")


if __name__ == "__main__":
    raise SystemExit(main())
