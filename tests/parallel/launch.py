"""The one launcher of the multi-process tests: real processes, real gloo ranks, a deadline, JSON reports.

Owns: starting ``world_size`` processes that each run ``worker(rank, world_size)``, joined to one gloo process
group (or sharing nothing but the file system), collecting what each returned or raised, and turning a hang or a
crash into a test failure with every process killed. Also the rank-grid arithmetic that DP x CP x TP tests need to
place a rank and build its sub-groups. Not responsible for: what the workers do, or asserting on their reports.

Writing a test::

    def all_reduce_over_my_cp_group(rank: int, world_size: int) -> dict:  # module level, so it pickles
        shape = (2, 2, 2)  # DP x CP x TP; TP varies fastest, as in Megatron's rank order
        dp, cp, tp = grid_coordinates(rank, world_size, shape)
        mine = None
        for ranks in grid_groups(world_size, shape, axis=1):  # every rank creates every group, in the same order
            group = torch.distributed.new_group(ranks)
            mine = group if rank in ranks else mine
        ...
        return {"cp": cp, ...}  # anything JSON can hold

    reports = launch(all_reduce_over_my_cp_group, tmp_path, world_size=8)
    assert [r.get("error") for r in reports] == [None] * 8

Each report holds ``rank``, ``logs`` (the ``[level, message]`` pairs the process logged on the package logger at
INFO and above) and either ``value`` (the worker's return value) or ``error`` (``type`` and ``message``): an
exception is a result the test asserts on, not a failure of the launch.

Processes come from a fork server that has imported torch and the package once, so each launch costs
milliseconds instead of seconds of imports; like spawned processes, they inherit nothing from the test process
but its working directory, ``sys.path`` and environment variables (as they are at the launch, except what torch
and the package read when imported). The process-group timeout is far longer than the deadline: a rank left
waiting in a collective fails the test at the deadline instead of timing out into an error that could look like
an expected one.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import numpy as np
import pytest

__all__ = ["DEADLINE_S", "grid_coordinates", "grid_groups", "launch"]

DEADLINE_S = 60.0
_PROCESS_GROUP_TIMEOUT_FACTOR = 20  # a rank still waiting at the deadline is a hang, never a timeout error
_PRELOAD = ["torch.distributed", "hyper_parallel.data.text.build_dataset"]  # the imports that take seconds


# -- rank grids ---------------------------------------------------------------------------------------------------


def _grid(world_size: int, shape: tuple[int, ...]) -> np.ndarray:
    if math.prod(shape) != world_size:
        raise ValueError(f"a grid of shape {shape} holds {math.prod(shape)} ranks, not the world size {world_size}")
    return np.arange(world_size).reshape(shape)


def grid_coordinates(rank: int, world_size: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``rank``'s coordinates in a grid of ``shape`` (for example DP x CP x TP), the last axis varying fastest.

    Example: ``grid_coordinates(5, 8, (2, 2, 2)) == (1, 0, 1)``: rank 5 is dp 1, cp 0, tp 1.
    """
    _grid(world_size, shape)
    return tuple(int(i) for i in np.unravel_index(rank, shape))


def grid_groups(world_size: int, shape: tuple[int, ...], axis: int) -> list[list[int]]:
    """Every group of ranks that differ only along ``axis``, in the same order on every rank.

    Example: ``grid_groups(8, (2, 2, 2), axis=1) == [[0, 2], [1, 3], [4, 6], [5, 7]]``: the CP groups.
    """
    grid = np.moveaxis(_grid(world_size, shape), axis, -1)
    return grid.reshape(-1, shape[axis]).tolist()


# -- launching ----------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.logs: list[list[str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.logs.append([record.levelname, record.getMessage()])


def _rank_main(
    worker, rank: int, world_size: int, port: int | None, start, deadline_s: float, environ: dict, report: str
) -> None:
    """Body of one process: join the group (or wait for the others), run ``worker``, write the report."""
    os.environ.clear()
    os.environ.update(environ)  # the fork server holds the environment of the first launch
    logger = logging.getLogger("hyper_parallel.data")
    logger.setLevel(logging.INFO)
    recorder = _Recorder()
    logger.addHandler(recorder)
    result: dict = {"rank": rank}
    if port is None:
        start.wait(deadline_s)  # start together, as the processes of one job would
    else:
        import torch.distributed as dist

        timeout = timedelta(seconds=_PROCESS_GROUP_TIMEOUT_FACTOR * deadline_s)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timeout
        )
    try:
        result["value"] = worker(rank, world_size)
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["error"] = {"type": type(error).__name__, "message": str(error)}
    finally:
        if port is not None:
            dist.destroy_process_group()
    result["logs"] = recorder.logs
    temporary = Path(f"{report}.tmp")
    temporary.write_text(json.dumps(result), encoding="utf-8")
    temporary.rename(report)  # a process that dies while writing leaves no report, so it counts as crashed


def _context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def launch(
    worker: Callable[[int, int], object],
    directory: Path,
    world_size: int,
    *,
    process_group: bool = True,
    deadline_s: float = DEADLINE_S,
) -> list[dict]:
    """Run ``worker(rank, world_size)`` in ``world_size`` processes and return their reports, by rank.

    Args:
        worker: a picklable callable (a module-level function or a ``functools.partial`` of one) returning
            something JSON can hold.
        directory: where the reports are written.
        world_size: processes to start.
        process_group: join a gloo process group (``torch.distributed`` initialised); otherwise the processes
            share nothing but the file system and start together.
        deadline_s: the test fails if any process is still running this many seconds after the start.

    The test also fails, at once, if a process exits without a report (it crashed). Either way every process
    still running is killed before the failure is raised.
    """
    context = _context()
    port = _free_port() if process_group else None
    start = context.Barrier(world_size)
    reports = [directory / f"rank{rank}.json" for rank in range(world_size)]
    for report in reports:
        report.unlink(missing_ok=True)  # left by an earlier launch into the same directory
    processes = [
        context.Process(
            target=_rank_main,
            args=(worker, rank, world_size, port, start, deadline_s, dict(os.environ), str(reports[rank])),
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        _supervise(processes, reports, time.monotonic() + deadline_s, deadline_s)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            if process.pid is not None:
                process.join()
    return [json.loads(report.read_text(encoding="utf-8")) for report in reports]


def _supervise(processes: list, reports: list[Path], deadline: float, deadline_s: float) -> None:
    """Wait for every process; fail at the deadline, or as soon as one exits without its report."""
    running = set(range(len(processes)))
    while running:
        wait([processes[rank].sentinel for rank in running], timeout=max(0.0, deadline - time.monotonic()))
        for rank in sorted(running):
            if processes[rank].exitcode is None:
                continue
            running.discard(rank)
            if not reports[rank].is_file():
                pytest.fail(f"rank {rank} exited with code {processes[rank].exitcode} without a report: it crashed")
        if running and time.monotonic() >= deadline:
            pytest.fail(
                f"ranks {sorted(running)} were still running after {deadline_s:g} s: a rank is waiting for one that "
                "gave up, or hangs"
            )
