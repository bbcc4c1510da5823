"""Multi-process specification of ``build_once``: one process builds each shared cache, everyone agrees.

Each test starts real processes with ``parallel.launch``: four gloo ranks on CPU, or plain processes sharing only
the cache directory. They all build the same datasets at once; every process reports the "building the ...
indices" messages it logged and a digest of its index arrays (or the error it raised). A rank left waiting fails
the test at the launcher's deadline.

Failures cross ranks: a rank that fails (before, during or after the collectives) makes every rank raise its
message within seconds; ranks that disagree on the config say so, naming the entry and the fields; a process
waiting for another's lock says so once and gives up after ``cache_lock_timeout``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from pathlib import Path

import numpy as np
import pytest
from indexed.test_index_cache import write_corpus

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.indexed.index_cache import CacheOptions, IndexCache
from hyper_parallel.data.parallel.build_barrier import (
    exclusive_file_lock,
    process_group_ready,
    rank_zero_first,
    without_rank_collectives,
)
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from parallel.launch import DEADLINE_S, launch

WORLD_SIZE = 4
SETTINGS = {"seq_length": 32, "split": "90, 8, 2"}
NUM_SAMPLES = [200, 30, 10]
ENTRIES = 9  # 3 splits x (2 sources + 1 blend)


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


def build_and_digest(
    rank: int, world_size: int, data_path, cache: str, num_samples=NUM_SAMPLES, split: str = SETTINGS["split"]
) -> str:
    """Build the datasets (every rank the same call) and return a digest of every index array."""
    del rank, world_size
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


def _building(report: dict) -> list[str]:
    """The "building the ... indices" messages a process logged."""
    return [message for _, message in report["logs"] if message.startswith("building the")]


def _stems(messages: list[str]) -> list[str]:
    return [m.split()[2] for m in messages]  # "building the <key>-<kind>-<split> indices in <dir>"


# -- tests --------------------------------------------------------------------------------------------------------


def test_rank_0_builds_every_index_while_the_other_ranks_wait(tmp_path, blend):
    """Four gloo ranks build the same blend at once: rank 0 builds each entry once, all ranks get the same indices."""
    worker = functools.partial(build_and_digest, data_path=blend, cache=str(tmp_path / "cache"))
    reports = launch(worker, tmp_path, WORLD_SIZE)
    reference = build_and_digest(0, 1, blend, str(tmp_path / "reference"))

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    assert len(set(_stems(_building(reports[0])))) == ENTRIES
    assert [len(_building(r)) for r in reports] == [ENTRIES, 0, 0, 0]
    assert [r["value"] for r in reports] == [reference] * WORLD_SIZE


def test_without_a_process_group_a_file_lock_lets_one_process_build(tmp_path, blend):
    """Four independent processes sharing the cache directory: each entry is built exactly once, by someone."""
    worker = functools.partial(build_and_digest, data_path=blend, cache=str(tmp_path / "cache"))
    reports = launch(worker, tmp_path, WORLD_SIZE, process_group=False)
    reference = build_and_digest(0, 1, blend, str(tmp_path / "reference"))

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    stems = [stem for r in reports for stem in _stems(_building(r))]
    assert len(stems) == ENTRIES and len(set(stems)) == ENTRIES
    assert [r["value"] for r in reports] == [reference] * WORLD_SIZE


def test_a_failed_build_on_rank_0_raises_on_every_rank(tmp_path):
    """Rank 0's build fails after earlier entries succeeded (a link planted at a file name of the valid entry,
    which is never written through); every rank raises instead of waiting for ever."""
    prefix = write_corpus(tmp_path / "corpus", num_documents=40, seed=3)
    worker = functools.partial(build_and_digest, data_path=prefix, cache=str(tmp_path / "cache"))
    build_and_digest(0, 1, prefix, str(tmp_path / "reference"))  # the same keys: the cache directory is not in them
    [valid] = (tmp_path / "reference").glob("*-GPTDataset-valid-document_index.npy")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not an index")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / valid.name).symlink_to(outside)

    reports = launch(worker, tmp_path, WORLD_SIZE)

    assert [len(_building(r)) for r in reports] == [2, 0, 0, 0]  # train, then the failing valid split
    assert reports[0]["error"]["type"] == "DataFileError"
    assert reports[0]["error"]["message"].startswith(f"{tmp_path / 'cache' / valid.name} is a symbolic link to ")
    for report in reports[1:]:
        assert report["error"]["type"] == "DataFileError"
        assert report["error"]["message"].startswith("rank 0 failed to build a shared cache (DataFileError: ")
    assert not list((tmp_path / "cache").glob("*-GPTDataset-valid-description.txt"))
    assert list((tmp_path / "cache").glob("*-GPTDataset-train-description.txt"))  # the train entry was published
    assert outside.read_bytes() == b"not an index"


def test_a_split_without_tokens_for_its_samples_is_refused_on_every_rank_before_any_build(tmp_path):
    """A split that holds no tokens but is asked for samples is a DataConfigError every rank finds itself, from
    the settings alone, before it builds (or waits for) that split's entry."""
    # 40 documents, the last 8 empty: the valid split ("80, 20, 0") holds no tokens but 5 samples are asked for
    prefix = write_corpus(tmp_path / "corpus", num_documents=32, seed=3, empty_tail=8)
    worker = functools.partial(
        build_and_digest, data_path=prefix, cache=str(tmp_path / "cache"), num_samples=[10, 5, None], split="80, 20, 0"
    )
    reports = launch(worker, tmp_path, WORLD_SIZE)

    assert [len(_building(r)) for r in reports] == [1, 0, 0, 0]  # train only
    for report in reports:
        assert report["error"]["type"] == "DataConfigError"
        assert "(valid split, sequences [32, 40]): the split holds no tokens" in report["error"]["message"]
    assert not list((tmp_path / "cache").glob("*-GPTDataset-valid-description.txt"))


# -- failures cross ranks -----------------------------------------------------------------------------------------


def fail_on_rank_2(rank: int, world_size: int, data_path: list[str], cache: str, when: str) -> str:
    """Rank 2 fails before any collective (its first source is missing) or after the first one (its cache directory
    is not the one rank 0 builds in, as on storage the ranks do not share); the other ranks build as usual."""
    if rank == 2 and when == "before":
        data_path = [data_path[0], f"{data_path[1]}_missing", *data_path[2:]]
    if rank == 2 and when == "during":
        cache = f"{cache}_rank2"
    return build_and_digest(rank, world_size, data_path, cache)


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_failing_rank_makes_every_rank_fail_with_its_message(tmp_path, blend, when):
    """Rank 2 raises while the others wait for it in a collective: they raise its message, well before the
    process-group timeout."""
    worker = functools.partial(fail_on_rank_2, data_path=blend, cache=str(tmp_path / "cache"), when=when)
    reports = launch(worker, tmp_path, WORLD_SIZE)

    own = reports[2]["error"]
    assert own["type"] == "DataFileError"
    assert ("_missing" if when == "before" else "but this rank cannot see it") in own["message"]
    relayed = f"rank 2 failed to build the Indexed datasets ({own['type']}: {own['message']}); see rank 2's log"
    assert [reports[rank]["error"] for rank in (0, 1, 3)] == [{"type": "DataFileError", "message": relayed}] * 3


def differ_on_ranks_1_and_2(rank: int, world_size: int, data_path: list[str], cache: str) -> None:
    """Rank 1 asks for longer samples and rank 2 for another seed than ranks 0 and 3."""
    del world_size
    settings = {1: {"seq_length": 40}, 2: {"random_seed": 99}}.get(rank, {})
    config = {**SETTINGS, "data_cache_path": cache, **settings}
    build_indexed_text_dataset(data_path, config, NUM_SAMPLES, str(BUNDLED_TOKENIZER_PATH))


def test_ranks_that_disagree_on_the_config_say_so(tmp_path, blend):
    """Every rank raises the same DataConfigError naming the entry and the differing fields, rather than blaming
    the file system for a cache it cannot see."""
    worker = functools.partial(differ_on_ranks_1_and_2, data_path=blend, cache=str(tmp_path / "cache"))
    reports = launch(worker, tmp_path, WORLD_SIZE)

    errors = [report["error"] for report in reports]
    assert [error["type"] for error in errors] == ["DataConfigError"] * WORLD_SIZE
    assert len({error["message"] for error in errors}) == 1
    message = errors[0]["message"]
    assert message.startswith("the ranks disagree on the dataset config: rank 0 builds the cache entry ")
    assert "-GPTDataset-train" in message
    assert "sequence_length: rank 0 has 32, rank 1 has 40" in message
    assert "random_seed: rank 0 has 1234, rank 2 has 99" in message
    assert "rank 3" not in message and "shared by all ranks" not in message


def load_fails_on_rank_1(rank: int, world_size: int) -> int:
    del world_size

    def load() -> int:
        if rank == 1:
            raise DataFileError("rank 1 cannot read its copy of the data")
        return rank

    return rank_zero_first(load)


def test_a_rank_that_fails_after_rank_0_loaded_fails_every_rank(tmp_path):
    """``rank_zero_first``: rank 0 loads first, then the others; rank 1's failure raises everywhere."""
    reports = launch(load_fails_on_rank_1, tmp_path, WORLD_SIZE)

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


def _lock_entry(directory: str) -> IndexCache:
    return IndexCache(directory, "GPTDataset", "train", {"case": "a lock held by another process"})


def hold_or_wait_for_the_lock(rank: int, world_size: int, directory: str) -> dict:
    """Process 0 holds the entry's lock until process 1 is done; process 1 tries to build it with a 1 s timeout."""
    del world_size
    cache = _lock_entry(directory)
    held, done = Path(directory) / "held", Path(directory) / "done"
    if rank == 0:
        with exclusive_file_lock(Path(directory) / f"{cache.key}-GPTDataset-train.lock"):
            held.touch()
            _wait_for(done)
        return {"pid": os.getpid()}
    _wait_for(held)
    try:
        cache.get_or_build(("values",), lambda: {"values": np.arange(3)}, CacheOptions(lock_timeout=1.0))
        error = None
    except DataFileError as raised:
        error = str(raised)
    finally:
        done.touch()
    return {"error": error}


def test_a_process_waiting_for_a_held_lock_says_so_once_and_gives_up(tmp_path):
    """Two processes: one holds an entry's lock (a stale builder); the other logs once what it waits for, then
    raises a DataFileError naming the lock, its holder and the fix."""
    directory = tmp_path / "cache"
    worker = functools.partial(hold_or_wait_for_the_lock, directory=str(directory))
    holder, waiter = launch(worker, tmp_path, 2, process_group=False)
    cache = _lock_entry(str(directory))
    lock = directory / f"{cache.key}-GPTDataset-train.lock"

    [warning] = [message for level, message in waiter["logs"] if level != "INFO"]  # warnings and errors
    assert warning.startswith(f"waiting for the lock {lock}: pid {holder['value']['pid']} on ")
    assert f"is building the cache entry {cache.key}-GPTDataset-train; giving up after 1 s" in warning
    error = waiter["value"]["error"]
    assert error.startswith(f"gave up after 1 s waiting for the lock {lock}, held by pid {holder['value']['pid']} on ")
    assert "raise data_config.cache_lock_timeout" in error and "Do not delete the lock file" in error
    assert not cache.is_complete(("values",))


# -- ranks that take no part --------------------------------------------------------------------------------------


def load_on_even_ranks(rank: int, world_size: int, directory: str) -> dict:
    """Ranks 0 and 2 load (rank 2 checks that rank 0 finished first); ranks 1 and 3 take no part. Inside each load
    the ranks take no collective, so a builder's ``process_group_ready()`` is False there."""
    del world_size
    done = Path(directory) / "rank0_done"

    def load() -> dict:
        seen = {"rank 0 done before": done.exists(), "process group ready": process_group_ready()}
        if rank == 0:
            done.touch()
        return seen

    def load_alone() -> dict:
        with without_rank_collectives():
            return load()

    return {"result": rank_zero_first(load_alone, takes_part=rank % 2 == 0), "after": process_group_ready()}


def test_ranks_that_take_no_part_wait_for_those_that_load_and_get_none(tmp_path):
    reports = launch(functools.partial(load_on_even_ranks, directory=str(tmp_path)), tmp_path, WORLD_SIZE)

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    assert [r["value"]["result"] for r in reports] == [
        {"rank 0 done before": False, "process group ready": False},
        None,
        {"rank 0 done before": True, "process group ready": False},
        None,
    ]
    assert [r["value"]["after"] for r in reports] == [True] * WORLD_SIZE


def rank_0_takes_no_part(rank: int, world_size: int) -> int | None:
    del world_size
    return rank_zero_first(lambda: rank, takes_part=rank != 0, what="build the datasets")


def test_rank_0_must_take_part_and_every_rank_says_so(tmp_path):
    reports = launch(rank_0_takes_no_part, tmp_path, WORLD_SIZE)

    own = reports[0]["error"]
    assert own["type"] == "DataConfigError"
    assert own["message"].startswith("rank 0 must build the datasets first (it writes the caches the other ranks")
    relayed = f"rank 0 failed to build the datasets (DataConfigError: {own['message']}); see rank 0's log"
    assert [reports[rank]["error"] for rank in (1, 2, 3)] == [{"type": "DataFileError", "message": relayed}] * 3
