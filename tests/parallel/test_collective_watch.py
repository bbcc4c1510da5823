"""Specification of ``collective_watch``: a rank that hangs is named by the others after the collective timeout.

The timeout's settings are checked in this process. The collectives run in real gloo processes started by
``parallel.launch``: four ranks all-gather their rank numbers; a rank that sleeps far longer than the timeout
(2 s here) before joining makes the others raise ``CollectiveTimeout`` naming the collective, the group and that
rank; it then joins, so that the collective the others left issued completes and every process exits. A rank that
fails and leaves instead makes the others raise at once, naming the collective. The assertions are on the
messages, never on times.
"""

from __future__ import annotations

import functools
import pickle
import time

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.parallel.build_barrier import default_store
from hyper_parallel.data.parallel.collective_watch import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    TIMEOUT_VARIABLE,
    CollectiveTimeout,
    collective_timeout,
    format_ranks,
    watched,
)
from parallel.launch import launch

WORLD_SIZE = 4
TIMEOUT_S = 2.0
LATE_S = TIMEOUT_S + 2.5  # how much later than the others a hung rank joins


# -- the timeout's settings ---------------------------------------------------------------------------------------


def test_the_timeout_is_the_callers_then_the_environment_variable_then_300_s(monkeypatch):
    monkeypatch.delenv(TIMEOUT_VARIABLE, raising=False)
    assert DEFAULT_COLLECTIVE_TIMEOUT_S == 300.0  # well under torch's 1800 s process-group default
    assert collective_timeout() == 300.0
    monkeypatch.setenv(TIMEOUT_VARIABLE, "2.5")
    assert collective_timeout() == 2.5
    assert collective_timeout(7) == 7.0


@pytest.mark.parametrize("raw", ["", "soon", "0", "-3", "nan", "inf"])
def test_a_bad_environment_variable_is_refused_naming_it(monkeypatch, raw):
    monkeypatch.setenv(TIMEOUT_VARIABLE, raw)
    with pytest.raises(DataConfigError) as caught:
        collective_timeout()
    message = str(caught.value)
    assert message.startswith(f"the environment variable {TIMEOUT_VARIABLE} must be a number of seconds > 0, got ")
    assert repr(raw) in message and "leave it unset for the default of 300 s" in message


@pytest.mark.parametrize("value", [0, -1.0, True, "ten", float("inf")])
def test_a_bad_timeout_argument_is_refused_naming_it(value):
    with pytest.raises(DataConfigError, match=r"^timeout_s must be a number of seconds > 0, got "):
        collective_timeout(value)


def test_ranks_are_listed_sorted_with_runs_shortened():
    assert format_ranks([3]) == "rank 3"
    assert format_ranks([2, 0, 1]) == "ranks 0-2"
    assert format_ranks([7, 0, 2, 5, 6]) == "ranks 0, 2, 5-7"


def test_the_timeout_error_pickles_with_what_it_names():
    """Errors cross process boundaries (DataLoader workers, launchers) with their fields."""
    error = CollectiveTimeout("the collective 'x' ...", what="x", ranks=[0, 1], missing=[1], timeout_s=2.0)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is CollectiveTimeout and str(copy) == "the collective 'x' ..."
    assert (copy.what, copy.ranks, copy.missing, copy.timeout_s) == ("x", [0, 1], [1], 2.0)
    assert isinstance(copy, DataFileError)


# -- collectives on real ranks -------------------------------------------------------------------------------------


def _gather_ranks(group, what: str = "the rank gather") -> list[int]:
    mine = torch.tensor([dist.get_rank()])
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    watched(what, lambda: dist.all_gather(out, mine, group=group, async_op=True), group=group)
    return [int(t) for t in out]


def gather_and_count_keys(rank: int, world_size: int) -> dict:
    """Watched all-gathers, then the store's key count after 3 calls and after 23 (a barrier before each count)."""
    del rank, world_size
    store = default_store()
    results = [_gather_ranks(None) for _ in range(3)]
    dist.barrier()
    after_3 = store.num_keys()
    dist.barrier()  # nobody adds keys before everyone counted
    results += [_gather_ranks(None) for _ in range(20)]
    dist.barrier()
    return {"results": results, "after_3": after_3, "after_23": store.num_keys()}


def test_watched_gathers_complete_and_the_store_does_not_grow(tmp_path, monkeypatch):
    monkeypatch.setenv(TIMEOUT_VARIABLE, str(TIMEOUT_S))
    reports = launch(gather_and_count_keys, tmp_path, WORLD_SIZE)

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    for report in reports:
        assert report["value"]["results"] == [list(range(WORLD_SIZE))] * 23
        assert report["value"]["after_23"] == report["value"]["after_3"]  # one key per rank, overwritten


def one_rank_joins_late(rank: int, world_size: int, late: int, group_ranks: list[int] | None) -> list[int]:
    """Every rank of the group gathers once together, then ``late`` sleeps far past the timeout before the second
    gather: the others give up, then it joins (so that their issued collective completes and all can exit)."""
    del world_size
    group = None if group_ranks is None else dist.new_group(group_ranks)
    if group_ranks is not None and rank not in group_ranks:
        time.sleep(LATE_S + 1)  # rank 0 hosts the store: it stays until the others are done with it
        return []
    _gather_ranks(group)
    if rank == late:
        time.sleep(LATE_S)
    return _gather_ranks(group)


@pytest.mark.parametrize(("group_ranks", "late", "named"), [(None, 3, "ranks 0-3"), ([1, 2, 3], 2, "ranks 1-3")])
def test_a_rank_that_joins_far_too_late_is_named_by_the_others(tmp_path, monkeypatch, group_ranks, late, named):
    monkeypatch.setenv(TIMEOUT_VARIABLE, str(TIMEOUT_S))
    worker = functools.partial(one_rank_joins_late, late=late, group_ranks=group_ranks)
    reports = launch(worker, tmp_path, WORLD_SIZE)

    members = group_ranks or list(range(WORLD_SIZE))
    expected = (
        f"the collective 'the rank gather' over {named} did not complete within 2 s: rank {late} has not reached "
        "it: it hangs, or runs something else (see its log, or its stack with `py-spy dump --pid <pid>`). If the "
        f"ranks are only slow, give {TIMEOUT_VARIABLE} more seconds than 2"
    )
    for rank in members:
        if rank == late:
            assert reports[rank] == {**reports[rank], "value": members}  # its gather found the others' parts
        else:
            assert reports[rank]["error"] == {"type": "CollectiveTimeout", "message": expected}


def collective_without_work(rank: int, world_size: int) -> None:
    del rank, world_size
    watched("a blocking barrier", lambda: dist.barrier())


def test_a_collective_issued_without_async_op_is_a_programming_error(tmp_path):
    reports = launch(collective_without_work, tmp_path, 2)

    for report in reports:
        assert report["error"] == {
            "type": "TypeError",
            "message": "the collective 'a blocking barrier' was issued without async_op=True: watched needs its work",
        }


def rank_1_leaves(rank: int, world_size: int) -> list[int]:
    """Rank 1 fails before the gather and leaves the process group (the launcher destroys it); rank 0, which hosts
    the store, waits for the others' reports before it leaves too."""
    del world_size
    if rank == 1:
        raise RuntimeError("rank 1 fails")
    try:
        return _gather_ranks(None)
    finally:
        if rank == 0:
            time.sleep(1.0)


def test_a_rank_that_leaves_makes_the_others_raise_naming_the_collective(tmp_path, monkeypatch):
    monkeypatch.setenv(TIMEOUT_VARIABLE, "20")  # a leaving rank is reported by gloo at once, not at the timeout
    reports = launch(rank_1_leaves, tmp_path, 3)

    assert reports[1]["error"] == {"type": "RuntimeError", "message": "rank 1 fails"}
    for rank in (0, 2):
        assert reports[rank]["error"]["type"] == "DataFileError"
        message = reports[rank]["error"]["message"]
        assert message.startswith("the collective 'the rank gather' over ranks 0-2 failed (")
        assert message.endswith("): a rank left; see the other ranks' logs")
