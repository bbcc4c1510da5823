"""Specification of the ordered worker pool behind offline preparation: order, errors, and dead workers."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import time

import pytest

from hyper_parallel.data.tools.worker_pool import OrderedWorkerPool, WorkerPoolError


def test_results_come_back_in_task_order():
    """Results follow the task order whatever each task costs; each comes with its task."""
    tasks = [3000, 1, 2000, 5, 0, 1500, 7, 10]  # uneven work across three workers
    with OrderedWorkerPool(3, math.factorial) as pool:
        results = list(pool.imap(tasks))
    assert results == [(n, math.factorial(n)) for n in tasks]


def test_a_task_error_is_raised_in_the_parent_with_the_worker_traceback():
    """An exception raised by a task reaches the caller as itself, noting the worker's traceback; the pool stops."""
    with pytest.raises(ValueError, match="factorial") as error, OrderedWorkerPool(2, math.factorial) as pool:
        list(pool.imap([3, 4, -1, 5]))
    assert any("raised in worker process" in note and "Traceback" in note for note in error.value.__notes__)


def test_a_worker_that_dies_is_an_error_naming_it_not_a_hang():
    """A worker killed from outside (as the out-of-memory killer would) is a WorkerPoolError naming its process."""
    expected = r"worker process \d+ exited with code -9 before answering"
    with pytest.raises(WorkerPoolError, match=expected), OrderedWorkerPool(2, time.sleep) as pool:
        first = next(p for p in multiprocessing.active_children() if p.name == "hp-data-worker-0")
        os.kill(first.pid, signal.SIGKILL)
        next(pool.imap([30.0, 30.0]))
