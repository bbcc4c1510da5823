"""Specification of the multi-process launcher: ranks know their place, and no run can hang the suite.

A worker gets its rank and the world size, and places itself in a DP x CP grid; a rank that hangs fails the test at
the deadline, and one that crashes fails it at once; either way no process outlives the launch.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parallel.launch import grid_coordinates, grid_groups, launch

SHAPE = (2, 2)  # DP x CP


def sum_over_my_cp_group(rank: int, world_size: int) -> dict:
    """Every rank creates every CP group, then all-reduces its rank over its own."""
    mine = None
    for ranks in grid_groups(world_size, SHAPE, axis=1):
        group = dist.new_group(ranks)
        mine = group if rank in ranks else mine
    total = torch.tensor([rank])
    dist.all_reduce(total, group=mine)
    return {"world_size": world_size, "coordinates": grid_coordinates(rank, world_size, SHAPE), "sum": total.item()}


def test_each_rank_gets_its_rank_and_its_place_in_a_grid(tmp_path):
    reports = launch(sum_over_my_cp_group, tmp_path, 4)

    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    assert [r["value"]["world_size"] for r in reports] == [4] * 4
    assert [r["value"]["coordinates"] for r in reports] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert [r["value"]["sum"] for r in reports] == [0 + 1, 0 + 1, 2 + 3, 2 + 3]


def test_grids_put_the_last_axis_fastest_and_check_their_size():
    assert grid_coordinates(5, 8, (2, 2, 2)) == (1, 0, 1)
    assert grid_groups(8, (2, 2, 2), axis=1) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid_groups(8, (2, 2, 2), axis=0) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match=r"a grid of shape \(2, 3\) holds 6 ranks, not the world size 8"):
        grid_coordinates(0, 8, (2, 3))


def _write_pid(directory: str, rank: int) -> None:
    temporary = Path(directory, f"pid{rank}.tmp")
    temporary.write_text(str(os.getpid()))
    temporary.rename(temporary.with_suffix(""))  # whole, even if the process is killed right after


def _pids(directory: Path, world_size: int) -> list[int]:
    return [int((directory / f"pid{rank}").read_text()) for rank in range(world_size)]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def rank_1_never_joins(rank: int, world_size: int, directory: str) -> None:
    """Rank 0 waits in a collective for rank 1, which sleeps instead."""
    del world_size
    _write_pid(directory, rank)
    if rank == 1:
        time.sleep(3600)
    dist.barrier()


def test_a_hang_fails_at_the_deadline_and_kills_every_rank(tmp_path):
    with pytest.raises(pytest.fail.Exception, match=r"ranks \[0, 1\] were still running after 2 s"):
        launch(functools.partial(rank_1_never_joins, directory=str(tmp_path)), tmp_path, 2, deadline_s=2)
    assert all(_gone(pid) for pid in _pids(tmp_path, 2))


def rank_1_crashes(rank: int, world_size: int, directory: str) -> None:
    """Rank 0 waits for ever; rank 1 exits without a report once rank 0 is running."""
    del world_size
    _write_pid(directory, rank)
    if rank == 0:
        time.sleep(3600)
    while not Path(directory, "pid0").exists():
        time.sleep(0.01)
    os._exit(3)


def test_a_crash_fails_at_once_and_kills_every_rank(tmp_path):
    """The crash is reported as such, long before the deadline would end rank 0's wait."""
    with pytest.raises(pytest.fail.Exception, match="rank 1 exited with code 3 without a report: it crashed"):
        launch(functools.partial(rank_1_crashes, directory=str(tmp_path)), tmp_path, 2, process_group=False)
    assert all(_gone(pid) for pid in _pids(tmp_path, 2))
