"""Offline preparation split across the processes of ``torchrun``: one partition per rank, merged by rank 0.

Usage (from the repository root)::

    .venv/bin/torchrun --standalone --nproc-per-node 2 -m hyper_parallel.data.tools.offline_preparation \\
        --dataset-name-or-path data/ --output-prefix out/corpus --tokenizer-name-or-path tok/ --distributed

Every rank reads ``RANK``, ``WORLD_SIZE`` and the rendezvous from the environment and joins a gloo process group.
The input is split by ``text.records.split_record_ranges`` into one consecutive part per rank (records never
cut); rank ``r`` tokenizes its part with its own worker pool into the partition pair ``<prefix>_<r>_<key>_document``.
When every rank has sealed its partition, the ranks publish them, and rank 0 merges them in rank order into
``<prefix>_<key>_document``: the same bytes as a single-process run, for any number of ranks. With
``--keep-partition-files`` the partition pairs stay, listed by a manifest written last.

A background thread on every rank all-reduces a small counter tensor every ``_TICK_SECONDS``: the progress of every
rank (rank 0 shows one bar for the whole run) and whether a rank failed. A failed rank's message is gathered by
every rank, which then stops, removes its temporary files and exits non-zero; a rank that dies is noticed through
the collective failing (at the latest after ``--distributed-timeout`` seconds). Nothing final is published unless
every rank succeeded; the next run removes the temporaries of dead ranks.

With a URL ``--output-prefix`` (``s3://bucket/dir/name``) every rank builds its partition in a local staging
directory of its own and uploads it under temporary keys (``indexed.object_upload``); rank 0 fetches the other
parts, merges them and publishes every output, the ``.idx`` of each pair last. The ranks share no file system:
the hosts of a multi-node run need only reach the object store.

Owns: the process group, the split of the input across ranks, the progress and failure exchange, the merge, and
who uploads what for a URL prefix.
Not responsible for: tokenizing a part (``offline_preparation``), output names and checks (``offline_outputs``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.file_writes import write_atomically
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader, data_file_paths, is_object_url
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.indexed.pair_metadata import manifest_json, manifest_path, metadata_path
from hyper_parallel.data.text.records import iter_range_chunks, resolve_data_files, split_record_ranges
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
from hyper_parallel.data.tools.offline_outputs import (
    _outputs,
    output_name,
    pair_in_publication_order,
    partition_prefix,
    plan_outputs,
    publication_order,
    staged_url,
    staging_prefix,
)

__all__ = ["DistributedRunError", "run_distributed_preparation"]

logger = get_logger("hyper_parallel.data.tools.distributed_preparation")

_TICK_SECONDS = 0.5
# Test hook "RANK:RECORDS": that rank exits at once (os._exit, as a killed process would) after reading RECORDS.
EXIT_HOOK_VARIABLE = "HP_DATA_TEST_EXIT_RANK_AT_RECORD"
# The counters exchanged at every tick, summed over ranks.
_FAILED, _DONE, _BYTES, _RECORDS, _DOCUMENTS, _TOKENS, _SEQUENCES, _EMPTY, _BAD = range(9)
# The summary fields that the run's summary sums over ranks, by counter.
_SUMMED = {
    _BYTES: "input_bytes",
    _RECORDS: "records",
    _DOCUMENTS: "documents",
    _TOKENS: "tokens",
    _SEQUENCES: "sequences",
    _EMPTY: "empty_documents",
    _BAD: "bad_records",
}


class DistributedRunError(RuntimeError):
    """Another rank failed or stopped answering; this rank stopped without publishing anything."""


def check_distributed_config(config: OfflinePreparationConfig) -> None:
    """Refuse the options whose output would depend on the number of ranks."""
    if config.pack_to_seq_len is not None:
        raise DataConfigError(
            "--pack-to-seq-len cannot be combined with --distributed: each rank would pack and drop its own tail, "
            "so the records would depend on the number of ranks; prepare without packing, or in one process"
        )
    if config.partitions > 1:
        raise DataConfigError(
            f"--partitions {config.partitions} cannot be combined with --distributed: every rank writes one "
            "partition of its own; drop --partitions (and --keep-sequential-samples)"
        )


class _Exchange:
    """The tick thread: sums every rank's counters, gathers failure messages, and drives rank 0's progress bar."""

    def __init__(self, dist, rank: int, world_size: int, total_bytes: int) -> None:
        import torch

        self.torch = torch
        self.dist = dist
        self.rank = rank
        self.world_size = world_size
        self.counts = [0] * 9
        self.message: str | None = None
        self.peer_error: str | None = None  # set when another rank failed or the group broke
        self.totals = [0] * 9
        self.changed = threading.Event()
        self.bar = None
        if rank == 0:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                desc=f"tokenizing on {world_size} ranks",
                disable=None,
                file=sys.stderr,
                dynamic_ncols=True,
            )
        self.started = time.perf_counter()
        self.thread = threading.Thread(target=self._run, name="hp-data-rank-exchange", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                self.changed.wait(_TICK_SECONDS)
                self.changed.clear()
                tensor = self.torch.tensor(self.counts, dtype=self.torch.int64)
                self.dist.all_reduce(tensor)
                self.totals = tensor.tolist()
                self._show()
                if self.totals[_FAILED]:
                    self.peer_error = _gather_failures(self.dist, self.world_size, self.message)
                    return
                if self.totals[_DONE] == self.world_size:
                    return
        except Exception as error:  # noqa: BLE001 - a collective fails the same way for every cause
            self.peer_error = (
                f"the other ranks stopped answering ({type(error).__name__}: {str(error).splitlines()[0]}); a rank "
                "was killed or its host is unreachable: see its own output"
            )

    def _show(self) -> None:
        if self.bar is None:
            return
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.update(self.totals[_BYTES] - self.bar.n)
        self.bar.set_postfix(
            docs_s=f"{self.totals[_DOCUMENTS] / elapsed:,.0f}", tok_s=f"{self.totals[_TOKENS] / elapsed:,.0f}"
        )

    def finish(self, message: str | None = None) -> str | None:
        """Report this rank done (or failed with ``message``) and wait for the last tick; returns the peer error."""
        if message is not None:
            self.message = message
            self.counts[_FAILED] = 1
        else:
            self.counts[_DONE] = 1
        self.changed.set()
        self.thread.join()
        if self.bar is not None:
            self.bar.close()
        return self.peer_error


class _RankProgress:
    """``run_offline_preparation``'s progress on one rank: counters for the exchange, and the stop of this rank
    when another one failed."""

    def __init__(self, exchange: _Exchange, exit_at_record: int | None) -> None:
        self.exchange = exchange
        self.exit_at_record = exit_at_record

    def update(self, bytes_read: int, documents: int, tokens: int) -> None:
        counts = self.exchange.counts
        counts[_BYTES], counts[_DOCUMENTS], counts[_TOKENS] = bytes_read, documents, tokens
        if self.exchange.peer_error is not None:
            raise DistributedRunError(self.exchange.peer_error)

    def count_records(self, records: int) -> None:
        self.exchange.counts[_RECORDS] += records
        if self.exit_at_record is not None and self.exchange.counts[_RECORDS] >= self.exit_at_record:
            os._exit(1)

    def close(self) -> None:
        pass


def _exit_hook(rank: int) -> int | None:
    value = os.environ.get(EXIT_HOOK_VARIABLE)
    if not value:
        return None
    hook_rank, _, records = value.partition(":")
    return int(records) if int(hook_rank) == rank else None


def _gather_failures(dist, world_size: int, message: str | None) -> str | None:
    """Every rank's failure message (None: it did not fail), as ``rank R failed: ...``; None when none failed."""
    messages = [None] * world_size
    dist.all_gather_object(messages, message)
    failed = [f"rank {rank} failed: {text}" for rank, text in enumerate(messages) if text is not None]
    return "; ".join(failed) or None


def _agree(dist, world_size: int, error: BaseException | None) -> None:
    """A barrier that fails on every rank when one raised ``error`` before it, with that rank's message."""
    failures = _gather_failures(dist, world_size, None if error is None else str(error) or type(error).__name__)
    if error is not None:
        raise error
    if failures is not None:
        raise DistributedRunError(failures)


def _merge(config: OfflinePreparationConfig, world_size: int, outputs: list[tuple[str, str]]) -> None:
    """Rank 0: merge the published partition pairs of every key in rank order, then publish the merged pairs."""
    builders: list[IndexedDatasetBuilder] = []
    partitions = _partition_prefixes(config, world_size, outputs)
    try:
        for (key, suffix), prefixes in zip(outputs, partitions, strict=True):
            final = config.output_prefix_for(key, suffix)
            idx_path, bin_path = data_file_paths(final)
            readers = [IndexedDataReader(prefix) for prefix in prefixes]
            builder = IndexedDatasetBuilder(bin_path, dtype=readers[0].dtype)
            builders.append(builder)
            for prefix in prefixes:
                builder.add_index(prefix)
            builder.seal(idx_path, {metadata_path(final): metadata_path(prefixes[0]).read_bytes()})
            if config.keep_partition_files:
                counts = [
                    (p, len(r.sequence_lengths), len(r.document_indices) - 1)
                    for p, r in zip(prefixes, readers, strict=True)
                ]
                manifest = manifest_path(final)
                manifest.unlink(missing_ok=True)
                write_atomically(manifest, manifest_json(final, counts))
        for builder in builders:
            builder.publish()
    except BaseException:
        for builder in builders:
            builder.abort()
        for key, suffix in outputs:
            manifest_path(config.output_prefix_for(key, suffix)).unlink(missing_ok=True)
        _remove_partitions(partitions)
        raise
    if not config.keep_partition_files:
        _remove_partitions(partitions)


def _partition_prefixes(
    config: OfflinePreparationConfig, world_size: int, outputs: list[tuple[str, str]]
) -> list[list[str]]:
    """Per output, the prefix of every rank's partition pair, in rank order."""
    return [
        [partition_prefix(config.output_prefix, rank, key, suffix) for rank in range(world_size)]
        for key, suffix in outputs
    ]


def _remove_partitions(partitions: list[list[str]]) -> None:
    for prefixes in partitions:
        for prefix in prefixes:
            for path in (*data_file_paths(prefix), metadata_path(prefix)):
                path.unlink(missing_ok=True)


def _publish_to_object_storage(
    dist, rank: int, world_size: int, config: OfflinePreparationConfig, local: OfflinePreparationConfig, token: str
) -> None:
    """Once every rank has its partition under ``local`` (its own staging directory): each rank uploads its part
    under the temporary keys of the run's ``token``; rank 0 fetches the others' parts, merges them and publishes
    every output in order. Ranks need no shared file system: the parts travel through the object store."""
    from hyper_parallel.data.indexed.object_upload import ObjectUpload

    outputs = _outputs(config)
    partitions = _partition_prefixes(local, world_size, outputs)

    def url(path) -> str:
        return staged_url(path, local.output_prefix, config.output_prefix)

    with ObjectUpload(config.upload_part_bytes, token) as upload:
        error = None
        try:
            if rank != 0 or config.keep_partition_files:  # rank 0 merges its own part from its disk
                files = [path for prefixes in partitions for path in pair_in_publication_order(prefixes[rank])]
                upload.upload([(path, url(path)) for path in files], f"rank {rank} uploading its part")
        except DataFileError as failure:
            error = failure
        _agree(dist, world_size, error)
        if rank != 0:
            return
        for prefixes in partitions:
            for other in prefixes[1:]:
                for path in pair_in_publication_order(other):
                    upload.fetch(url(path), path)
        _merge(local, world_size, outputs)
        published = publication_order(local, world_size)
        parts = {path for prefixes in partitions for prefix in prefixes for path in pair_in_publication_order(prefix)}
        merged = [path for path in published if path not in parts]  # the kept parts are uploaded already
        upload.upload([(path, url(path)) for path in merged], "uploading the merged outputs")
        upload.publish([url(path) for path in published])


def run_distributed_preparation(config: OfflinePreparationConfig, timeout_seconds: float):
    """Run this rank's part of a ``torchrun`` preparation; rank 0 returns the summary of the whole run, the other
    ranks theirs.

    Raises:
        DistributedRunError: another rank failed (its message is part of this one) or stopped answering.
        DataConfigError: a combination whose output would depend on the number of ranks, or no torchrun.
    """
    check_distributed_config(config)
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise DataConfigError(
            f"--distributed needs the environment that torchrun sets; {', '.join(missing)} missing: start with "
            "`torchrun --nproc-per-node N -m hyper_parallel.data.tools.offline_preparation ... --distributed`"
        )
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_seconds))
    try:
        if not is_object_url(config.output_prefix):
            return _run_rank(dist, config, config, None)
        from hyper_parallel.data.indexed.object_upload import staging_directory

        with staging_directory() as staging:
            return _run_rank(dist, config, replace(config, output_prefix=staging_prefix(config, staging)), staging)
    finally:
        dist.destroy_process_group()


def _run_rank(dist, config: OfflinePreparationConfig, local: OfflinePreparationConfig, staging):
    """``run_distributed_preparation`` once the group is up; ``local`` is ``config`` with the prefix that this
    rank writes its files under (``config``'s own, or in its ``staging`` directory for a URL prefix)."""
    from hyper_parallel.data.tools.offline_preparation import RecordSource, run_offline_preparation

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rank_config = replace(local, output_prefix=f"{local.output_prefix}_{rank}", overwrite=True)
    error = None
    token = None
    try:
        if rank == 0:  # the checks and the sweep of dead runs' temporaries, once, before any rank writes
            plan_outputs(replace(local, partitions=world_size))
            if staging is not None:
                from hyper_parallel.data.indexed.object_upload import check_destination, new_upload_token

                urls = [
                    staged_url(path, local.output_prefix, config.output_prefix)
                    for path in publication_order(local, world_size)
                ]
                check_destination(config.output_prefix, urls, config.overwrite)
                token = new_upload_token()
    except (DataConfigError, DataFileError) as failure:
        error = failure
    _agree(dist, world_size, error)
    shared = [token]
    dist.broadcast_object_list(shared, src=0)  # the temporary keys' token: rank 0 publishes what the others upload
    files, fmt = resolve_data_files(config.dataset_name_or_path)
    ranges = split_record_ranges(files, fmt, world_size)[rank]
    logger.info("rank %d of %d: %d part(s) of %d %s file(s)", rank, world_size, len(ranges), len(files), fmt)
    exchange = _Exchange(dist, rank, world_size, sum(p.stat().st_size for p in files))
    progress = _RankProgress(exchange, _exit_hook(rank))

    def chunks():
        for chunk in iter_range_chunks(ranges, fmt, config.chunk_size, config.record_fields):
            progress.count_records(len(chunk.items))
            yield chunk

    def wait_for_every_rank(summary) -> None:
        for counter, name in _SUMMED.items():
            exchange.counts[counter] = getattr(summary, name)
        peer_error = exchange.finish()
        if peer_error is not None:
            raise DistributedRunError(peer_error)

    try:
        summary = run_offline_preparation(
            rank_config,
            RecordSource(chunks()),
            plan=plan_outputs(rank_config),
            progress=progress,
            before_publish=wait_for_every_rank,
        )
    except DistributedRunError:
        raise
    except BaseException as failure:
        if exchange.counts[_DONE]:  # failed publishing its partition: the others wait in the agreement below
            _agree(dist, world_size, failure)
        peer_error = exchange.finish(str(failure) or type(failure).__name__)
        if peer_error is not None and isinstance(failure, Exception):
            failure.add_note(peer_error)
        raise
    totals = exchange.totals
    outputs = _outputs(config)
    try:
        _agree(dist, world_size, None)  # every partition is published
    except DistributedRunError:
        if rank == 0:
            _remove_partitions(_partition_prefixes(local, world_size, outputs))
        raise
    summary.outputs = {}  # this rank's partition is merged into rank 0's outputs
    if staging is not None:
        _publish_to_object_storage(dist, rank, world_size, config, local, shared[0])
    elif rank == 0:
        _merge(local, world_size, outputs)
    if rank == 0:
        summary.outputs = {output_name(key, suffix): config.output_prefix_for(key, suffix) for key, suffix in outputs}
        for counter, name in _SUMMED.items():
            setattr(summary, name, totals[counter])
        if summary.documents == 0:
            logger.warning("no documents were written: every record was empty or malformed")
    return summary
