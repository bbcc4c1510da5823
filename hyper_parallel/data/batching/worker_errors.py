"""The library's errors raised in DataLoader workers, raised in the caller exactly as without workers.

Owns: catching ``DataFileError``, ``DataConfigError`` and ``ResumeStateError`` in a worker, returning them as the
worker's result, and raising them again in the main process with the same type and message. Without this, torch
re-raises them as "Caught DataFileError in DataLoader worker process 0. Original Traceback ...", thirty lines
around the one that says what to fix. The worker's traceback goes to the debug log. Other exceptions are left to
torch, whose report carries the worker traceback that debugging them needs. Also owns the worker's allocator
setting: on glibc, the first fetch in each worker pins ``M_MMAP_THRESHOLD`` at its default (128 KiB). glibc
otherwise raises the threshold to the size of each large block freed, so once the first batch has been sent
(torch moves it to shared memory and frees it) every later batch buffer comes from the heap, which keeps the freed
ones: a worker then grows by about ten batches' bytes that it no longer uses. Pinned, a batch buffer that free heap
space cannot hold gets a mapping of its own, returned to the system as soon as it is freed.
Not responsible for: what the workers compute (datasets, transforms, collators) or the DataLoader itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch.utils.data

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError, ResumeStateError

__all__ = ["CollateInWorker", "FetchInWorker", "WorkerFailure", "pin_mmap_threshold", "raise_worker_failure"]

logger = get_logger(__name__)

_REPORTED = (DataFileError, DataConfigError, ResumeStateError)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's default threshold, kept fixed


@functools.cache
def pin_mmap_threshold(pid: int) -> bool:
    """Fix glibc's mmap threshold in process ``pid`` (the caller's), once; False where libc has no ``mallopt``."""
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    pinned = mallopt is not None and mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) == 1
    logger.debug("DataLoader worker %d: mmap threshold %s", pid, "pinned" if pinned else "left to the allocator")
    return pinned


@dataclass
class WorkerFailure:
    """A reported error caught in a worker, travelling to the main process as the worker's result."""

    error: Exception
    worker_id: int
    details: str  # the worker's traceback


def _caught(error: Exception) -> WorkerFailure:
    """The failure to send back; re-raises ``error`` when it cannot travel (then torch reports it as usual)."""
    try:
        pickle.dumps(error)
    except Exception:  # noqa: BLE001 - any pickling failure means: leave the error to torch
        raise error from None
    worker = torch.utils.data.get_worker_info()
    return WorkerFailure(error, -1 if worker is None else worker.id, traceback.format_exc())


def raise_worker_failure(output) -> None:
    """Raise the error a worker returned as ``output``, as it was raised there; no-op for any other output."""
    if isinstance(output, WorkerFailure):
        logger.debug("DataLoader worker %d raised:\n%s", output.worker_id, output.details)
        raise output.error from None


class FetchInWorker(torch.utils.data.Dataset):
    """The worker-side dataset: fetches a batch of keys, returning a ``WorkerFailure`` instead of raising one (the
    first fetch in a worker pins its mmap threshold)."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __getitems__(self, keys: list):
        pin_mmap_threshold(os.getpid())
        try:
            if hasattr(self.dataset, "__getitems__"):
                return self.dataset.__getitems__(keys)
            return [self.dataset[key] for key in keys]
        except _REPORTED as error:
            return _caught(error)


class CollateInWorker:
    """The worker-side collate function: passes a failed fetch on, and catches its own reported errors."""

    def __init__(self, collate_fn: Callable) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items):
        if isinstance(items, WorkerFailure):
            return items
        try:
            return self.collate_fn(items)
        except _REPORTED as error:
            return _caught(error)
