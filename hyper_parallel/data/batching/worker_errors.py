"""The library's errors raised in DataLoader workers, raised in the caller exactly as without workers.

Owns: catching ``DataFileError``, ``DataConfigError`` and ``ResumeStateError`` in a worker, returning them as the
worker's result, and raising them again in the main process with the same type and message. Without this, torch
re-raises them as "Caught DataFileError in DataLoader worker process 0. Original Traceback ...", thirty lines
around the one that says what to fix. The worker's traceback goes to the debug log. Other exceptions are left to
torch, whose report carries the worker traceback that debugging them needs.
Not responsible for: what the workers compute (datasets, transforms, collators) or the DataLoader itself.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch.utils.data

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError, ResumeStateError

__all__ = ["CollateInWorker", "FetchInWorker", "WorkerFailure", "raise_worker_failure"]

logger = get_logger(__name__)

_REPORTED = (DataFileError, DataConfigError, ResumeStateError)


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
    """The worker-side dataset: fetches a batch of keys, returning a ``WorkerFailure`` instead of raising one."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __getitems__(self, keys: list):
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
