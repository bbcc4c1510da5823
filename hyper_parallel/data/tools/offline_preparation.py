"""Offline preparation: raw text files to Megatron-compatible ``.bin``/``.idx`` pairs.

Usage::

    python -m hyper_parallel.data.tools.offline_preparation \\
        --dataset-name-or-path /data/train.jsonl --output-prefix /data/train \\
        --json-keys text --tokenizer-name-or-path /models/tokenizer --append-eod true [--pack-to-seq-len 4096]

writes ``/data/train_text_document.{bin,idx}``. Without ``--pack-to-seq-len`` every record becomes one
document (one sequence per string, several for a list of strings), for GPTDataset. With it, tokens are
concatenated and cut into records of N + 1 tokens, for GPTFromMRDataset; each partition packs on its own and
drops its own tail.

With ``--chat-template NAME`` the records are conversations (the one json key holds the messages) or, with
``--instruction-key FIELD``, instruction records; beside the tokens the run writes their loss mask
``<prefix>_<key>_document_loss_mask.{bin,idx}``, packed into the same records with ``--pack-to-seq-len``.

With ``--distributed`` under torchrun, the ranks split the input and rank 0 merges their partitions into the same
bytes as one process writes (see docs/offline.md, "Across processes").

An fsspec URL as ``--output-prefix`` (``s3://bucket/dir/name``) builds the outputs in a local staging directory,
then uploads and publishes them through ``indexed.object_upload`` (see docs/object_storage.md).

Existing outputs are replaced only with ``--overwrite``. Ctrl-C (SIGINT) or SIGTERM stops the workers, removes
the temporary files and exits with 130 or 143; a second signal exits at once, and the next run of the same
prefix removes what was left. Workers also stop by themselves when the main process dies.

Owns: orchestration (the tokenizer, the worker pool, progress, the summary) and the command line, including
what signals do.
Not responsible for: parsing records (``offline_encoding``), finding files (``text.records``),
output names, partitions and publication (``offline_outputs``), the file format (``indexed.io``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.idx_format import optimal_token_dtype
from hyper_parallel.data.indexed.indexed_data_reader import is_object_url
from hyper_parallel.data.indexed.pair_metadata import PairMetadata
from hyper_parallel.data.text.build_data_transform import InstructionTransform, TextConversationTransform
from hyper_parallel.data.text.build_tokenizer import build_tokenizer
from hyper_parallel.data.text.records import (
    RecordChunk,
    count_records,
    iter_record_chunks,
    resolve_data_files,
)
from hyper_parallel.data.tools.cli import command_parser
from hyper_parallel.data.tools.distributed_preparation import DistributedRunError
from hyper_parallel.data.tools.offline_config import (
    OfflinePreparationConfig,
    add_preparation_arguments,
    config_from_args,
)
from hyper_parallel.data.tools.offline_encoding import (
    EncodedChunk,
    EncodingSettings,
    encode_chunk_in_worker,
    init_worker,
)
from hyper_parallel.data.tools.offline_outputs import (
    OutputPlan,
    Outputs,
    output_name,
    plan_outputs,
    publication_order,
    staged_url,
    staging_prefix,
)
from hyper_parallel.data.tools.worker_pool import OrderedWorkerPool, WorkerPoolError

__all__ = [
    "Interrupted",
    "PreparationSummary",
    "RecordSource",
    "default_workers",
    "main",
    "preparation_parser",
    "run_cli",
    "run_offline_preparation",
]

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
    columns = config.record_fields
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


def run_offline_preparation(
    config: OfflinePreparationConfig,
    source: RecordSource | None = None,
    *,
    plan: OutputPlan | None = None,
    progress=None,
    before_publish: Callable[[PreparationSummary], None] | None = None,
) -> PreparationSummary:
    """Tokenize every record of the input and write one ``.bin``/``.idx`` pair (and its metadata) per json key.

    Args:
        config: the validated options.
        source: where records come from; default: the files named by ``config.dataset_name_or_path``.
        plan: the checked outputs; default: ``plan_outputs(config)``.
        progress: what ``update(bytes_read, documents, tokens)`` and ``close()`` report progress to; default: a
            progress bar and log lines.
        before_publish: called with the summary once every file is complete under its temporary name; if it
            raises, nothing is published.

    Returns:
        What was written and how fast.
    """
    if is_object_url(config.output_prefix):
        return _run_to_object_storage(config, source, progress)
    started = time.perf_counter()
    plan = plan or plan_outputs(config)
    tokenizer = build_tokenizer(config.tokenizer_name_or_path)
    if config.append_eod and tokenizer.eod is None:
        raise DataConfigError(
            f"tokenizer {tokenizer.name_or_path} has no EOS token to append; {tokenizer.eos_help()}; "
            "or pass --append-eod false"
        )
    if config.pack_to_seq_len is not None and not config.append_eod:
        logger.warning(
            "packing to %d without --append-eod: document boundaries cannot be recovered from the packed records",
            config.pack_to_seq_len,
        )
    dtype = _token_dtype(config, tokenizer.vocab_size)
    conversation = None
    if config.is_instruction:
        conversation = InstructionTransform(
            tokenizer,
            chat_template=config.chat_template,
            instruction_key=config.instruction_key,
            input_key=config.input_key,
            output_key=config.output_key,
        )
    elif config.chat_template is not None:
        conversation = TextConversationTransform(
            tokenizer, chat_template=config.chat_template, text_keys=config.json_keys, role_map=config.role_map
        )
    source = source or _local_source(config)
    settings = EncodingSettings(
        json_keys=config.json_keys,
        text_template=config.template,
        append_eod=config.append_eod,
        eod_id=tokenizer.eod,
        add_special_tokens=config.add_special_tokens,
        token_dtype=dtype.str,
        conversation=conversation,
    )
    metadata = PairMetadata(
        tokenizer_fingerprint=tokenizer.fingerprint,
        vocab_size=tokenizer.vocab_size,
        eod_id=tokenizer.eod,
        token_dtype=str(dtype),
        tokenizer=tokenizer.name_or_path,  # a loaded tokenizer object is named by its path, not its repr
    )
    summary = PreparationSummary(
        outputs={
            output_name(key, suffix): config.output_prefix_for(key, suffix)
            for key in config.json_keys
            for suffix in config.output_suffixes
        },
        token_dtype=str(dtype),
        packed_to=config.pack_to_seq_len,
    )
    progress = progress or _Progress(source.total_bytes, config.log_interval)
    outputs = Outputs(config, plan, dtype, source.total_records, metadata)  # removes its files if it fails
    try:
        initargs = (tokenizer.backend.to_str(), settings, config.skip_bad_records)
        with OrderedWorkerPool(config.workers, encode_chunk_in_worker, init_worker, initargs) as pool:
            for chunk, encoded in pool.imap(source.chunks):
                _count_bad_records(encoded, config.skip_bad_records, summary)
                outputs.add(encoded)
                summary.records += encoded.records
                summary.empty_documents += encoded.empty_documents
                summary.input_bytes = chunk.bytes_read
                progress.update(chunk.bytes_read, outputs.total("documents"), outputs.total("tokens"))
        summary.dropped_tail_tokens = outputs.seal()
        summary.documents = outputs.total("documents")
        summary.tokens = outputs.total("tokens")
        summary.sequences = outputs.total("sequences")
        if before_publish is not None:
            before_publish(summary)
        outputs.publish()
    except BaseException:
        outputs.abort()
        raise
    finally:
        progress.close()
    summary.seconds = time.perf_counter() - started
    if summary.documents == 0 and before_publish is None:  # otherwise the caller knows what the run is part of
        logger.warning("no documents were written: every record was empty, malformed or shorter than one record")
    return summary


def _run_to_object_storage(
    config: OfflinePreparationConfig, source: RecordSource | None, progress
) -> PreparationSummary:
    """Check the destination, build the outputs in a local staging directory, then upload and publish them."""
    from hyper_parallel.data.indexed.object_upload import ObjectUpload, check_destination, staging_directory

    with staging_directory() as staging:
        local = replace(config, output_prefix=staging_prefix(config, staging))
        files = publication_order(local, config.partitions)
        urls = [staged_url(path, local.output_prefix, config.output_prefix) for path in files]
        check_destination(config.output_prefix, urls, config.overwrite)
        summary = run_offline_preparation(local, source, progress=progress)
        with ObjectUpload(config.upload_part_bytes) as upload:
            upload.upload(list(zip(files, urls, strict=True)))
            upload.publish(urls)
    summary.outputs = {
        name: staged_url(prefix, local.output_prefix, config.output_prefix) for name, prefix in summary.outputs.items()
    }
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


def preparation_parser(command: str, doc: str, input_help: str) -> argparse.ArgumentParser:
    """The parser of the preparation command ``hp-data <command>``, described by the module docstring ``doc`` (up
    to its "Owns:"), with its input flag; the caller adds the rest."""
    parser = command_parser(command, doc.split("Owns:")[0])
    parser.add_argument("--dataset-name-or-path", required=True, help=input_help)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = preparation_parser(
        "prepare",
        __doc__,
        "a file, a glob or a directory of .json/.jsonl(.gz), .parquet, .csv(.gz), .arrow or .txt(.gz) files, local "
        "or at an fsspec URL such as 's3://bucket/dir/*.jsonl'",
    )
    add_preparation_arguments(parser)
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="under torchrun: split the input across the ranks by file and byte range (records never cut), each "
        "rank writes one partition with its own --workers, rank 0 merges them; the output is byte-identical to a "
        "single-process run. Not with --pack-to-seq-len or --partitions",
    )
    parser.add_argument(
        "--distributed-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="with --distributed: how long the ranks wait for one that stopped answering before failing (default 60)",
    )
    return parser


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the main thread so that the run stops its workers and removes its files."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_stop_the_run() -> Iterator[None]:
    """The first SIGINT/SIGTERM raises ``Interrupted``; a second one exits at once, without cleaning up.

    After an interrupt the second signal keeps exiting at once with 128 + its number until the process ends, also
    while it reports the first one or shuts down (the previous handlers would end it by the signal instead).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum, frame) -> None:
        os.write(2, b"interrupted again: exiting now; the next run of this prefix removes the temporary files\n")
        os._exit(128 + signum)

    def stop(signum, frame) -> None:
        for name in _STOP_SIGNALS:
            signal.signal(name, exit_now)
        raise Interrupted(signum)

    previous = {name: signal.signal(name, stop) for name in _STOP_SIGNALS}
    try:
        yield
    finally:
        if signal.getsignal(_STOP_SIGNALS[0]) is stop:  # not interrupted: give the signals back
            for name, handler in previous.items():
                signal.signal(name, handler)


def run_cli(run, summary_header: str) -> int:
    """Shared tail of the preparation commands: run, print the summary, turn bad input into exit code 2.

    Interrupts exit with 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM) once the workers are stopped
    and the temporary files removed.
    """
    with _signals_stop_the_run():
        try:
            summary = run()
        except (DataFileError, DataConfigError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        except (WorkerPoolError, DistributedRunError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as interrupt:
            print("interrupted: no output was published (temporary files removed)", file=sys.stderr, flush=True)
            return 128 + getattr(interrupt, "signum", signal.SIGINT)
    print(summary_header)
    print(summary.table())
    return 0


def default_workers(distributed: bool) -> int:
    """One worker per CPU, shared among the ranks of this host under ``--distributed`` (torchrun sets
    ``LOCAL_WORLD_SIZE``)."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if distributed else 1
    return max(1, (os.cpu_count() or 1) // max(1, ranks_here))


def main(argv: list[str] | None = None) -> int:
    from hyper_parallel.data.dataset_logging import enable_dataset_logging

    parser = build_parser()
    parser.set_defaults(workers=None)  # the default depends on --distributed
    args = parser.parse_args(argv)
    if args.workers is None:
        args.workers = default_workers(args.distributed)
    enable_dataset_logging("info", ranks=None)

    if not args.distributed:
        return run_cli(lambda: run_offline_preparation(config_from_args(args)), "offline preparation finished:")
    from hyper_parallel.data.tools.distributed_preparation import run_distributed_preparation

    rank = int(os.environ.get("RANK", "0"))
    header = "offline preparation finished:" if rank == 0 else f"rank {rank} finished its part:"
    return run_cli(lambda: run_distributed_preparation(config_from_args(args), args.distributed_timeout), header)


if __name__ == "__main__":
    raise SystemExit(main())
