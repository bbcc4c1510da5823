"""Multi-process specification of ``build_once``: one process builds each shared cache, everyone agrees.

Each test starts real processes (spawn): four gloo ranks on CPU, or plain processes sharing only the cache
directory. They all build the same datasets at once; every process reports, through a JSON file, the
"building the ... indices" messages it logged and a digest of its index arrays (or the error it raised).
``launch`` is the one helper that starts the processes, enforces a deadline and collects the reports; the
process-group timeout is far longer than that deadline, so a rank left waiting fails the test instead of timing
out into an error that looks like a pass.

Failures cross ranks: a rank that fails (before, during or after the collectives) makes every rank raise its
message within seconds; ranks that disagree on the config say so, naming the entry and the fields; a process
waiting for another's lock says so once and gives up after ``cache_lock_timeout``.
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

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.indexed.index_cache import IndexCache
from hyper_parallel.data.parallel.build_barrier import exclusive_file_lock, rank_zero_first
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH

WORLD_SIZE = 4
DEADLINE_S = 60
PROCESS_GROUP_TIMEOUT_S = 20 * DEADLINE_S  # a rank still waiting at the deadline is a hang, not a timeout error
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
            timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
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


# -- failures cross ranks -----------------------------------------------------------------------------------------


def fail_on_rank_2(rank: int, data_path: list[str], cache: str, when: str) -> str:
    """Rank 2 fails before any collective (its first source is missing) or after the first one (its cache directory
    is not the one rank 0 builds in, as on storage the ranks do not share); the other ranks build as usual."""
    if rank == 2 and when == "before":
        data_path = [data_path[0], f"{data_path[1]}_missing", *data_path[2:]]
    if rank == 2 and when == "during":
        cache = f"{cache}_rank2"
    return build_and_digest(rank, data_path, cache)


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_failing_rank_makes_every_rank_fail_with_its_message(tmp_path, blend, when):
    """Rank 2 raises while the others wait for it in a collective: they raise its message, well before the
    process-group timeout."""
    worker = functools.partial(fail_on_rank_2, data_path=blend, cache=str(tmp_path / "cache"), when=when)
    reports = launch(worker, tmp_path)

    own = reports[2]["error"]
    assert own["type"] == "DataFileError"
    assert ("_missing" if when == "before" else "but this rank cannot see it") in own["message"]
    relayed = f"rank 2 failed to build the Indexed datasets ({own['type']}: {own['message']}); see rank 2's log"
    assert [reports[rank]["error"] for rank in (0, 1, 3)] == [{"type": "DataFileError", "message": relayed}] * 3


def differ_on_ranks_1_and_2(rank: int, data_path: list[str], cache: str) -> None:
    """Rank 1 asks for longer samples and rank 2 for another seed than ranks 0 and 3."""
    settings = {1: {"seq_length": 40}, 2: {"random_seed": 99}}.get(rank, {})
    config = {**SETTINGS, "data_cache_path": cache, **settings}
    build_indexed_text_dataset(data_path, config, NUM_SAMPLES, str(BUNDLED_TOKENIZER_PATH))


def test_ranks_that_disagree_on_the_config_say_so(tmp_path, blend):
    """Every rank raises the same DataConfigError naming the entry and the differing fields, rather than blaming
    the file system for a cache it cannot see."""
    reports = launch(
        functools.partial(differ_on_ranks_1_and_2, data_path=blend, cache=str(tmp_path / "cache")), tmp_path
    )

    errors = [report["error"] for report in reports]
    assert [error["type"] for error in errors] == ["DataConfigError"] * WORLD_SIZE
    assert len({error["message"] for error in errors}) == 1
    message = errors[0]["message"]
    assert message.startswith("the ranks disagree on the dataset config: rank 0 builds the cache entry ")
    assert "-GPTDataset-train" in message
    assert "sequence_length: rank 0 has 32, rank 1 has 40" in message
    assert "random_seed: rank 0 has 1234, rank 2 has 99" in message
    assert "rank 3" not in message and "shared by all ranks" not in message


def load_fails_on_rank_1(rank: int) -> int:
    def load() -> int:
        if rank == 1:
            raise DataFileError("rank 1 cannot read its copy of the data")
        return rank

    return rank_zero_first(load)


def test_a_rank_that_fails_after_rank_0_loaded_fails_every_rank(tmp_path):
    """``rank_zero_first``: rank 0 loads first, then the others; rank 1's failure raises everywhere."""
    reports = launch(load_fails_on_rank_1, tmp_path)

    assert reports[1]["error"] == {"type": "DataFileError", "message": "rank 1 cannot read its copy of the data"}
    relayed = (
        "rank 1 failed to load the data (DataFileError: rank 1 cannot read its copy of the data); see rank 1's log"
    )
    assert [reports[rank]["error"] for rank in (0, 2, 3)] == [{"type": "DataFileError", "message": relayed}] * 3


# -- lock waits ---------------------------------------------------------------------------------------------------


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


class _WarningRecorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _lock_entry(directory: str) -> IndexCache:
    return IndexCache(directory, "GPTDataset", "train", {"case": "a lock held by another process"})


def hold_or_wait_for_the_lock(rank: int, directory: str) -> dict:
    """Process 0 holds the entry's lock until process 1 is done; process 1 tries to build it with a 1 s timeout."""
    cache = _lock_entry(directory)
    held, done = Path(directory) / "held", Path(directory) / "done"
    if rank == 0:
        with exclusive_file_lock(Path(directory) / f"{cache.key}-GPTDataset-train.lock"):
            held.touch()
            _wait_for(done)
        return {"pid": os.getpid()}
    _wait_for(held)
    recorder = _WarningRecorder()
    logging.getLogger("hyper_parallel.data").addHandler(recorder)
    try:
        cache.get_or_build(("values",), lambda: {"values": np.arange(3)}, lock_timeout=1.0)
        error = None
    except DataFileError as raised:
        error = str(raised)
    finally:
        done.touch()
    return {"warnings": recorder.messages, "error": error}


def test_a_process_waiting_for_a_held_lock_says_so_once_and_gives_up(tmp_path):
    """Two processes: one holds an entry's lock (a stale builder); the other logs once what it waits for, then
    raises a DataFileError naming the lock, its holder and the fix."""
    directory = tmp_path / "cache"
    holder, waiter = (
        r["value"]
        for r in launch(
            functools.partial(hold_or_wait_for_the_lock, directory=str(directory)), tmp_path, world_size=2, gloo=False
        )
    )
    cache = _lock_entry(str(directory))
    lock = directory / f"{cache.key}-GPTDataset-train.lock"

    [warning] = waiter["warnings"]
    assert warning.startswith(f"waiting for the lock {lock}: pid {holder['pid']} on ")
    assert f"is building the cache entry {cache.key}-GPTDataset-train; giving up after 1 s" in warning
    error = waiter["error"]
    assert error.startswith(f"gave up after 1 s waiting for the lock {lock}, held by pid {holder['pid']} on ")
    assert "raise data_config.cache_lock_timeout" in error and "Do not delete the lock file" in error
    assert not cache.is_complete(("values",))
