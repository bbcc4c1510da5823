"""Multi-process specification of ``build_once``: one process builds each shared cache, everyone agrees.

Each test starts real processes (spawn): four gloo ranks on CPU, or four plain processes sharing only the cache
directory. They all build the same datasets at once; every process reports, through a JSON file, the
"building the ... indices" messages it logged and a digest of its index arrays (or the error it raised).
``launch`` is the one helper that starts the processes, enforces a deadline and collects the reports.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from indexed.test_index_cache import write_corpus

from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH

WORLD_SIZE = 4
DEADLINE_S = 60
SETTINGS = {"seq_length": 32, "split": "90, 8, 2"}
NUM_SAMPLES = [200, 30, 10]
ENTRIES = 9  # 3 splits x (2 sources + 1 blend)


# -- launching ----------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _BuildingRecorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("building the"):
            self.messages.append(record.getMessage())


def _rank_main(worker, rank: int, world_size: int, port: int | None, start, report: str) -> None:
    """Body of one spawned process: join the group (or wait for the others), run ``worker``, write the report."""
    logger = logging.getLogger("hyper_parallel.data")
    logger.setLevel(logging.INFO)
    recorder = _BuildingRecorder()
    logger.addHandler(recorder)
    result: dict = {"rank": rank}
    if port is not None:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=DEADLINE_S),
        )
    else:
        start.wait(DEADLINE_S)  # start building together, as ranks of one job would
    try:
        result["value"] = worker(rank)
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["error"] = {"type": type(error).__name__, "message": str(error)}
    finally:
        if port is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
    result["building"] = recorder.messages
    Path(report).write_text(json.dumps(result), encoding="utf-8")


def launch(
    worker: Callable[[int], object], directory: Path, world_size: int = WORLD_SIZE, gloo: bool = True
) -> list[dict]:
    """Run ``worker(rank)`` in ``world_size`` spawned processes and return their reports, by rank.

    Args:
        worker: a picklable callable (a module-level function or a ``functools.partial`` of one).
        directory: where the reports are written.
        world_size: processes to start.
        gloo: join a gloo process group (``torch.distributed`` initialised); otherwise the processes share
            nothing but the file system.

    Every report holds ``building`` (the "building the ... indices" messages of that process) and ``value`` (the
    worker's return value) or ``error`` (``type`` and ``message``). The test fails if any process is still
    running after ``DEADLINE_S`` seconds or exits without a report.
    """
    context = multiprocessing.get_context("spawn")
    port = _free_port() if gloo else None
    start = context.Barrier(world_size)
    reports = [directory / f"rank{rank}.json" for rank in range(world_size)]
    processes = [
        context.Process(target=_rank_main, args=(worker, rank, world_size, port, start, str(reports[rank])))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + DEADLINE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for rank in hung:
        processes[rank].kill()
        processes[rank].join()
    if hung:
        pytest.fail(f"ranks {hung} were still running after {DEADLINE_S} s: a rank is waiting for one that gave up")
    missing = [(rank, p.exitcode) for rank, p in enumerate(processes) if not reports[rank].is_file()]
    if missing:
        pytest.fail(f"ranks exited without a report (rank, exit code): {missing}")
    return [json.loads(report.read_text(encoding="utf-8")) for report in reports]


# -- what the ranks build -----------------------------------------------------------------------------------------


def _digest(dataset, hasher) -> None:
    if dataset is None:
        hasher.update(b"none")
        return
    hasher.update(f"{type(dataset).__name__}:{len(dataset)}".encode())
    for name in ("document_index", "sample_index", "shuffle_index", "dataset_index", "dataset_sample_index"):
        if hasattr(dataset, name):
            hasher.update(np.ascontiguousarray(getattr(dataset, name)).tobytes())
    for source in getattr(dataset, "datasets", []):
        _digest(source, hasher)


def build_and_digest(rank: int, data_path, cache: str, num_samples=NUM_SAMPLES, split: str = SETTINGS["split"]) -> str:
    """Build the datasets (every rank the same call) and return a digest of every index array."""
    del rank
    config = {**SETTINGS, "split": split, "data_cache_path": cache}
    datasets = build_indexed_text_dataset(data_path, config, num_samples, str(BUNDLED_TOKENIZER_PATH))
    hasher = hashlib.sha256()
    for dataset in datasets:
        _digest(dataset, hasher)
    return hasher.hexdigest()


@pytest.fixture
def blend(tmp_path) -> list[str]:
    a = write_corpus(tmp_path / "a_text_document", num_documents=250, seed=1)
    b = write_corpus(tmp_path / "b_text_document", num_documents=400, seed=2)
    return ["30", a, "70", b]


def _stems(messages: list[str]) -> list[str]:
    return [m.split()[2] for m in messages]  # "building the <key>-<kind>-<split> indices in <dir>"


# -- tests --------------------------------------------------------------------------------------------------------


def test_rank_0_builds_every_index_while_the_other_ranks_wait(tmp_path, blend):
    """Four gloo ranks build the same blend at once: rank 0 builds each entry once, all ranks get the same indices."""
    reports = launch(functools.partial(build_and_digest, data_path=blend, cache=str(tmp_path / "cache")), tmp_path)
    reference = build_and_digest(0, blend, str(tmp_path / "reference"))

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    assert len(set(_stems(reports[0]["building"]))) == ENTRIES
    assert [len(r["building"]) for r in reports] == [ENTRIES, 0, 0, 0]
    assert [r["value"] for r in reports] == [reference] * WORLD_SIZE


def test_without_a_process_group_a_file_lock_lets_one_process_build(tmp_path, blend):
    """Four independent processes sharing the cache directory: each entry is built exactly once, by someone."""
    reports = launch(
        functools.partial(build_and_digest, data_path=blend, cache=str(tmp_path / "cache")), tmp_path, gloo=False
    )
    reference = build_and_digest(0, blend, str(tmp_path / "reference"))

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    stems = [stem for r in reports for stem in _stems(r["building"])]
    assert len(stems) == ENTRIES and len(set(stems)) == ENTRIES
    assert [r["value"] for r in reports] == [reference] * WORLD_SIZE


def test_a_failed_build_on_rank_0_raises_on_every_rank(tmp_path):
    """Rank 0's build fails after earlier entries succeeded; every rank raises instead of waiting for ever."""
    # 40 documents, the last 8 empty: the valid split ("80, 20, 0") holds no tokens but 5 samples are asked for
    prefix = write_corpus(tmp_path / "corpus", num_documents=32, seed=3, empty_tail=8)
    worker = functools.partial(
        build_and_digest, data_path=prefix, cache=str(tmp_path / "cache"), num_samples=[10, 5, None], split="80, 20, 0"
    )
    reports = launch(worker, tmp_path)

    assert [len(r["building"]) for r in reports] == [2, 0, 0, 0]  # train, then the failing valid split
    assert reports[0]["error"]["type"] == "DataConfigError"
    assert "the split holds no tokens" in reports[0]["error"]["message"]
    for report in reports[1:]:
        assert report["error"]["type"] == "DataFileError"
        assert report["error"]["message"].startswith("rank 0 failed to build a shared cache (DataConfigError: ")
    assert not list((tmp_path / "cache").glob("*-GPTDataset-valid-description.txt"))
    assert os.listdir(tmp_path / "cache")  # the train entry was published
