"""Memory of a DataLoader worker: how much it grows while it reads, against the bytes of one batch it delivers.

One row per path, each measured in a fresh subprocess (so the worker is forked from a small parent, not from the
benchmark process) with ``num_workers=1``:

* **Indexed**: ``FixedBatchDataLoader`` over a GPTDataset (seq 4096, micro-batch 8) built with
  ``build_indexed_text_dataset`` from a seeded synthetic ``uint16`` corpus written in the scratch folder. The worker
  reads the samples and stacks them with ``build_indexed_collate_fn``.
* **Online**: ``DynamicBatchDataLoader`` (micro-batch 8 x max_seq_len 4096: a token budget of 32k) over the mapping
  source of a JSONL of the bundled corpus paragraphs, plaintext transform with the bundled tokenizer. The worker
  reads and tokenizes the records; the main process packs and collates.

What is measured. A thread of the subprocess's main process reads the worker's ``/proc/<pid>/status`` every few
milliseconds. The worker's memory is its private and shared anonymous memory (``RssAnon + RssShmem``: the Python
heap, numpy and torch buffers, the shared-memory segments batches travel in); its file-backed pages (``RssFile``:
the memory-mapped ``.bin``, the Arrow cache, shared libraries) are page cache, shared and reclaimable, and are
reported in the note only. The **baseline** is the worker's memory when the main process has received ``W``
batches (the warm-up: the worker is started, its imports and dataset opened, its bounded caches filled); the
**peak** is the largest value seen until the main process has received ``N`` more batches. The row's figure is the
growth, peak minus baseline, against the mean bytes of the delivered batches' tensors. Each path runs ``repeats``
subprocesses and reports the smallest growth (the suite's best repetition), every run's ratio in the note. A worker
that kept a copy of every batch it sent would grow by ``N`` batches; one that holds only the batch it is building
and those in flight (the prefetch) stays within a few.

Why the warm-up. Measured from the first batch, the Online worker grew by 5-6 MB (8x a batch) over 120 batches,
levelling off after about 60: the tokenizer's BPE word cache (10,000 words, about 4 MB; with the cache resized to
0 the same reads grow by 2.3 MB instead of 6.4 MB) and the heap and Python arenas settling as ever more distinct
records are tokenized; Arrow reads alone grow by 0.1 MB (the records are taken from the memory-mapped table, file
pages). That is bounded, not a copy of what was sent, and how much of it fell after the baseline depended on how far
the worker had run ahead when the first batch arrived, hence runs from 1.3 to 9.0.

What it found: no copies are kept, but glibc raises its mmap threshold to the size of each large block freed, so
once a worker had sent its first batch (torch copies it into shared memory and frees it), later batch buffers came
from the heap, which kept the freed ones: the Indexed worker grew by 1-10 MB (typically ~8 MB, 12 batches) before
levelling off. Workers now pin the threshold at its default on their first fetch (``worker_errors``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import BenchContext, Row, log

NAME = "memory"
TITLE = "DataLoader worker memory growth over N batches vs one batch's bytes"

SEQ_LENGTH = 4096
MICRO_BATCH = 8
BATCHES_FULL = 120
BATCHES_QUICK = 50
# Batches read before the baseline: the worker's bounded caches fill first. The Online worker's tokenizer keeps a
# word cache of 10,000 entries (about 4 MB), full after about 22,000 random records, some 60 batches of 32k tokens.
WARMUP_FULL = 120
WARMUP_QUICK = 50
GOAL = 3.0  # growth of at most three batches' bytes
POLL_SECONDS = 0.002
INDEXED_SEED = 20
INDEXED_DOCUMENTS = 20_000  # about 20M tokens: every sample of the N batches is a fresh window of the file
VOCAB_SIZE = 50_257
PATHS = ("indexed", "online")
_STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


# -- the worker's memory, read from the main process --------------------------------------------------------------


def worker_pid() -> int:
    """The one child process of this process: the DataLoader worker (``num_workers=1``)."""
    children = []
    for task in Path("/proc/self/task").iterdir():
        children += (task / "children").read_text().split()
    if len(children) != 1:
        raise RuntimeError(f"expected exactly one DataLoader worker process, found children {children}")
    return int(children[0])


def read_status(pid: int) -> dict[str, int]:
    """The memory fields of ``/proc/<pid>/status``, in bytes."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in _STATUS_FIELDS:
            values[key] = int(rest.split()[0]) * 1024
    return values


def has_memory_status() -> bool:
    """Whether this system reports a process's anonymous memory (Linux's ``/proc/<pid>/status``)."""
    status = Path("/proc/self/status")
    return status.exists() and "RssAnon" in status.read_text()


def private_bytes(status: dict[str, int]) -> int:
    return status["RssAnon"] + status["RssShmem"]


class WorkerSampler:
    """Polls the worker's status in a thread; keeps the largest private memory and every field's last value."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.baseline = read_status(pid)
        self.peak = dict(self.baseline)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self._take(read_status(self.pid))

    def _take(self, status: dict[str, int]) -> None:
        if private_bytes(status) > private_bytes(self.peak):
            self.peak = {**status, "VmHWM": self.peak["VmHWM"]}
        self.peak["VmHWM"] = status["VmHWM"]
        self.peak["RssFile"] = max(self.peak["RssFile"], status["RssFile"])

    def stop(self) -> dict[str, int]:
        """Stop polling (after one last reading) and return the peak fields."""
        self._stop.set()
        self._thread.join()
        self._take(read_status(self.pid))
        return self.peak


def batch_bytes(batch) -> int:
    """Bytes of the batch's tensors (a ``Batch`` is a mapping over the fields it holds)."""
    return sum(tensor.nbytes for tensor in dict(batch).values())


def measure_worker(loader, warmup: int, batches: int) -> dict[str, Any]:
    """The worker's baseline after ``warmup`` batches, its peak over ``batches`` more, and the batches' bytes."""
    iterator = iter(loader)
    for _ in range(warmup):
        next(iterator)
    sampler = WorkerSampler(worker_pid())
    sizes = [batch_bytes(next(iterator)) for _ in range(batches)]
    peak = sampler.stop()
    return {
        "baseline": sampler.baseline,
        "peak": peak,
        "batch_bytes": sum(sizes) / len(sizes),
        "warmup": warmup,
        "batches": batches,
    }


# -- the two loaders, built in the subprocess ---------------------------------------------------------------------


class _Tokenizer:
    """The ids the synthetic corpus needs: vocabulary size, EOD and pad."""

    vocab_size = VOCAB_SIZE
    eod = 0
    pad = 1

    @property
    def unique_identifiers(self) -> dict:
        return {"class": type(self).__name__, "vocab_size": self.vocab_size, "eod": self.eod, "pad": self.pad}


def indexed_loader(work: Path, batches: int):
    from hyper_parallel.data.batching import FixedBatchDataLoader
    from hyper_parallel.data.batching.build_collate_fn import build_indexed_collate_fn
    from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset

    data_config = {
        "seq_length": SEQ_LENGTH,
        "random_seed": 1234,
        "data_cache_path": str(work / "cache"),
        "split": "100,0,0",
        "create_ltor_fields_in_dataloader": False,
    }
    samples = (batches + 1) * MICRO_BATCH
    train = build_indexed_text_dataset(str(work / "corpus"), data_config, [samples, 0, 0], _Tokenizer())[0]
    collate = build_indexed_collate_fn(eod_token_id=_Tokenizer.eod)
    return FixedBatchDataLoader(train, collate, micro_batch_size=MICRO_BATCH, num_workers=1, seed=1234)


def online_loader(work: Path, batches: int):
    from hyper_parallel.data.batching import DynamicBatchDataLoader
    from hyper_parallel.data.text.build_data_transform import build_llm_data_transform
    from hyper_parallel.data.text.build_dataset import build_online_text_dataset
    from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH

    del batches  # the JSONL is written long enough by the parent
    transform = build_llm_data_transform("plaintext", str(BUNDLED_TOKENIZER_PATH), max_seq_len=SEQ_LENGTH)
    data_config = {"dataset_type": "mapping", "cache_dir": str(work / "hf_cache")}
    dataset = build_online_text_dataset(str(work / "corpus.jsonl"), transform, data_config)
    return DynamicBatchDataLoader(
        dataset, micro_batch_size=MICRO_BATCH, max_seq_len=SEQ_LENGTH, num_workers=1, seed=1234, drop_last=True
    )


def child(kind: str, work: Path, warmup: int, batches: int) -> dict[str, Any]:
    """Build the ``kind`` loader in this (fresh) process and measure its worker after ``warmup`` batches."""
    import logging

    logging.getLogger("hyper_parallel").setLevel(logging.WARNING)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    loader = (indexed_loader if kind == "indexed" else online_loader)(work, warmup + batches)
    return measure_worker(loader, warmup, batches)


# -- the parent: data, subprocesses, rows -------------------------------------------------------------------------


def write_indexed_corpus(work: Path) -> None:
    import numpy as np

    from benchmarks.bench_indexed_dataset import write_prefix
    from benchmarks.bench_indexed_io import make_corpus

    corpus = make_corpus(INDEXED_DOCUMENTS, np.dtype(np.uint16), seed=INDEXED_SEED)
    write_prefix(work / "corpus", corpus.tokens, corpus.lengths)


def write_online_corpus(work: Path, batches: int) -> None:
    """Corpus paragraphs repeated to 1.5 x the tokens of ``batches + 1`` full micro-batches."""
    from tokenizers import Tokenizer

    from benchmarks.bench_offline import corpus_path, load_paragraphs, repeat_to_tokens, write_jsonl
    from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH

    tokenizer = Tokenizer.from_file(str(BUNDLED_TOKENIZER_PATH / "tokenizer.json"))
    paragraphs = load_paragraphs(corpus_path())
    counts = [len(e.ids) for e in tokenizer.encode_batch_fast(paragraphs, add_special_tokens=False)]
    target = int(1.5 * (batches + 1) * MICRO_BATCH * SEQ_LENGTH)
    write_jsonl(repeat_to_tokens(paragraphs, counts, target), work / "corpus.jsonl")


def run_child(kind: str, work: Path, warmup: int, batches: int) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "benchmarks.bench_memory", kind, str(work), str(warmup), str(batches)]
    result = subprocess.run(command, cwd=root, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"the {kind} memory subprocess failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def growth_bytes(measured: dict[str, Any]) -> int:
    return private_bytes(measured["peak"]) - private_bytes(measured["baseline"])


def memory_row(kind: str, runs: list[dict[str, Any]], seconds: float) -> Row:
    """The row of the run with the smallest growth; the note gives every run's ratio."""
    measured = min(runs, key=growth_bytes)
    base, peak, size = measured["baseline"], measured["peak"], measured["batch_bytes"]
    ratios = sorted(growth_bytes(run) / run["batch_bytes"] for run in runs)
    what = (
        f"FixedBatchDataLoader over a GPTDataset, seq {SEQ_LENGTH}, micro-batch {MICRO_BATCH}"
        if kind == "indexed"
        else f"DynamicBatchDataLoader, Online mapping source, token budget {MICRO_BATCH * SEQ_LENGTH:,} (the worker "
        "reads and tokenizes; the main process packs)"
    )
    mb = 1e6
    note = (
        f"{what}, num_workers=1, {measured['batches']} batches after {measured['warmup']} of warm-up, best of "
        f"{len(runs)} subprocesses "
        f"({seconds:.0f} s; ratios {', '.join(f'{r:.2f}' for r in ratios)}); ours: growth of the worker's RssAnon + "
        "RssShmem (sampled every 2 ms from the main process) from the baseline, when the warm-up's last batch was "
        "received "
        f"({private_bytes(base) / mb:.0f} MB), to its peak ({private_bytes(peak) / mb:.0f} MB); ref: the mean bytes "
        f"of one delivered batch's tensors. File-backed pages (RssFile, page cache) went from "
        f"{base['RssFile'] / mb:.0f} to {peak['RssFile'] / mb:.0f} MB; total RSS peak (VmHWM) "
        f"{peak['VmHWM'] / mb:.0f} MB against {base['VmRSS'] / mb:.0f} MB at the baseline"
    )
    return Row.compare(
        f"{kind} worker memory: growth over {measured['batches']} batches after {measured['warmup']}",
        growth_bytes(measured) / mb,
        size / mb,
        "MB",
        goal=GOAL,
        higher_is_better=False,
        note=note,
    )


def run(context: BenchContext) -> list[Row]:
    if not has_memory_status():
        return [Row.skipped(f"{kind} worker memory", "needs Linux's /proc/<pid>/status", "MB") for kind in PATHS]
    batches = BATCHES_QUICK if context.quick else BATCHES_FULL
    warmup = WARMUP_QUICK if context.quick else WARMUP_FULL
    work = context.workdir / "memory"
    work.mkdir()
    write_indexed_corpus(work)
    write_online_corpus(work, warmup + batches)
    rows = []
    for kind in PATHS:
        log(f"{kind}: worker memory over {batches} batches after {warmup}, in {context.repeats} subprocesses")
        start = time.perf_counter()
        runs = [run_child(kind, work, warmup, batches) for _ in range(context.repeats)]
        rows.append(memory_row(kind, runs, time.perf_counter() - start))
    return rows


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
