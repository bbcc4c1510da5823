"""Indexed prefixes in object storage: GPTDataset batches and sequential reads from an S3 endpoint vs local files.

One seeded corpus (the one of ``indexed_io``: lognormal document lengths, uint16 tokens) is written as a local
``.bin``/``.idx`` pair and uploaded to moto's standalone S3 server on the loopback address; both sides then read
the same bytes with the default block and cache sizes. The server is moto in this process's machine, so the
figures measure moto's ranged GETs and s3fs's client, never a real bucket's latency or bandwidth: the rows are
information. The block cache is emptied before every timed remote round, so each round fetches its blocks again.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_indexed_dataset import GPT_SPLIT, SEQ_LENGTH, BenchTokenizer, build_ours, write_prefix
from benchmarks.bench_indexed_io import SEED, make_corpus
from benchmarks.common import BenchContext, Row, log, measure

NAME = "object_storage"
TITLE = "Indexed prefixes at s3:// URLs (moto on loopback) vs the same local files"

DOCUMENTS = {True: 20_000, False: 50_000}  # about 20M and 50M tokens
RANDOM_BATCHES = {True: 100, False: 300}
BATCH = 32
BUCKET = "hp-data-bench"
ROW_NAMES = (
    "GPTDataset __getitems__(32) from s3 vs local",
    "sequential reader[i] from s3 vs local",
)


def _missing_modules() -> str | None:
    """Why the rows cannot run (s3fs or moto's server not installed), or None."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as error:
        return f"{error.name} is not installed (pip install 'hyper-parallel-data[s3]' moto[server])"
    return None


@contextlib.contextmanager
def s3_server() -> Iterator[Any]:
    """An S3 file system over moto's server on 127.0.0.1 with the empty bucket ``BUCKET``; the ``AWS_*``
    environment points at it for the duration of the block and is restored afterwards."""
    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    settings = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    s3fs.S3FileSystem.clear_instance_cache()  # instances remember the endpoint they were made with
    try:
        fs = s3fs.S3FileSystem()
        fs.mkdir(BUCKET)
        yield fs
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def _cache() -> Any:
    """The process-wide block cache that readers with the default settings share."""
    from hyper_parallel.data.indexed.object_storage import DEFAULT_BLOCK_BYTES, DEFAULT_CACHE_BYTES, block_cache

    return block_cache(DEFAULT_BLOCK_BYTES, DEFAULT_CACHE_BYTES)


class HitCounter:
    """``before``/``after`` hooks of ``measure``: empty the cache before each remote call, count its lookups."""

    def __init__(self, remote: str) -> None:
        self.remote = remote
        self.hits = self.misses = 0
        self._start = (0, 0)

    def before(self, name: str) -> None:
        if name == self.remote:
            cache = _cache()
            cache.clear()
            self._start = (cache.hits, cache.misses)

    def after(self, name: str, result: Any) -> None:
        if name == self.remote:
            cache = _cache()
            self.hits += cache.hits - self._start[0]
            self.misses += cache.misses - self._start[1]

    @property
    def text(self) -> str:
        lookups = self.hits + self.misses
        rate = self.hits / lookups if lookups else 0.0
        return f"block cache hit rate {rate:.2%} ({self.hits:,} hits, {self.misses:,} misses over the timed rounds)"


def _assert_same_samples(remote: list[dict], local: list[dict]) -> None:
    for k, (got, want) in enumerate(zip(remote, local, strict=True)):
        for key in ("tokens", "labels", "loss_mask"):
            assert np.array_equal(got[key].numpy(), want[key].numpy()), f"s3 sample {k}: {key} differs from local"


def _bench_random_batches(context: BenchContext, local_prefix: str, url: str, lengths: np.ndarray) -> Row:
    tokenizer = BenchTokenizer()
    samples = (int(lengths.sum()) - 1) // SEQ_LENGTH  # about one epoch of the train split
    sizes = [samples, None, None]
    local = build_ours(tokenizer, local_prefix, sizes, context.workdir / "cache-local", split=GPT_SPLIT)[0]
    remote = build_ours(tokenizer, url, sizes, context.workdir / "cache-s3", split=GPT_SPLIT)[0]
    assert len(remote) == len(local), f"s3 dataset: {len(remote)} samples, local {len(local)}"
    count = RANDOM_BATCHES[context.quick]
    indices = np.random.default_rng(SEED + 3).integers(0, len(local), count * BATCH).tolist()
    batches = [indices[b : b + BATCH] for b in range(0, len(indices), BATCH)]
    _assert_same_samples(remote.__getitems__(batches[0]), local.__getitems__(batches[0]))

    def read(dataset: Any) -> None:
        for batch in batches:
            dataset.__getitems__(batch)

    counter = HitCounter("s3")
    rounds = max(context.repeats, 3)
    log(f"GPTDataset random batches: {count} x {BATCH} samples x {rounds} rounds")
    timings = measure(
        {"local": lambda: read(local), "s3": lambda: read(remote)}, rounds, before=counter.before, after=counter.after
    )
    read_samples = count * BATCH
    note = (
        f"train split of 1 prefix ({len(lengths):,} docs, {int(lengths.sum()) / 1e6:.0f}M uint16 tokens), seq "
        f"{SEQ_LENGTH}, {count} seeded random batches of {BATCH}; ref the same local pair memory-mapped; s3: moto's "
        "server on 127.0.0.1 in this process, so this measures moto and s3fs, not a real bucket; default 4 MiB "
        f"blocks, cache emptied before each s3 round; first batch asserted equal; {counter.text}; best of {rounds}"
    )
    return Row.compare(
        ROW_NAMES[0], read_samples / timings["s3"].best, read_samples / timings["local"].best, "samples/s", note=note
    )


def _bench_sequential(context: BenchContext, local_prefix: str, url: str) -> Row:
    from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
    from hyper_parallel.data.indexed.object_storage import ObjectIndexedDataReader

    local, remote = IndexedDataReader(local_prefix), ObjectIndexedDataReader(url)
    documents = len(local)
    assert len(remote) == documents
    np.testing.assert_array_equal(remote[0], local[0])
    np.testing.assert_array_equal(remote[documents - 1], local[documents - 1])

    def read(reader: Any) -> None:
        for i in range(documents):
            np.array(reader[i])  # a copy, so the local side touches its pages too

    counter = HitCounter("s3")
    rounds = max(context.repeats, 3)
    log(f"sequential reads: {documents:,} documents x {rounds} rounds")
    timings = measure(
        {"local": lambda: read(local), "s3": lambda: read(remote)}, rounds, before=counter.before, after=counter.after
    )
    gigabytes = Path(local_prefix + ".bin").stat().st_size / 1e9
    note = (
        f"reader[i] for i in 0..{documents - 1:,}, each copied out ({gigabytes * 1e3:.0f} MB of tokens); ref "
        "IndexedDataReader on the local pair (memory-mapped, page-cached); s3: ObjectIndexedDataReader through "
        "moto's server on 127.0.0.1 in this process (measures moto and s3fs, not a real bucket), default 4 MiB "
        f"blocks, cache emptied before each s3 round; first and last documents asserted equal; {counter.text}; "
        f"best of {rounds}"
    )
    return Row.compare(
        ROW_NAMES[1], gigabytes / timings["s3"].best, gigabytes / timings["local"].best, "GB/s", note=note
    )


def run(context: BenchContext) -> list[Row]:
    missing = _missing_modules()
    if missing is not None:
        return [Row.skipped(name, missing) for name in ROW_NAMES]
    corpus = make_corpus(DOCUMENTS[context.quick], np.dtype(np.uint16))
    local_prefix = write_prefix(context.workdir / "corpus", corpus.tokens, corpus.lengths)
    with s3_server() as fs:
        for extension in (".idx", ".bin"):
            fs.put(local_prefix + extension, f"{BUCKET}/corpus{extension}")
        url = f"s3://{BUCKET}/corpus"
        log(f"uploaded {corpus.nbytes / 1e6:.0f} MB to {url}")
        return [
            _bench_random_batches(context, local_prefix, url, corpus.lengths),
            _bench_sequential(context, local_prefix, url),
        ]
