"""Build something once and let everyone else wait: across ranks with torch.distributed, across jobs with a lock.

Owns: the "one builds, the others wait, then everyone loads" protocol for shared caches. With an initialised
process group, rank 0 builds (under the file lock too, in case another job shares the directory) while the other
ranks wait in a broadcast that also carries rank 0's failure, so a failed build raises everywhere instead of
hanging. Without one, an exclusive ``flock`` on a lock file serialises concurrent processes. Not responsible
for: what is built, or where (``indexed.index_cache``).
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from hyper_parallel.data.errors import DataFileError

T = TypeVar("T")

__all__ = ["build_once", "exclusive_file_lock", "process_group_ready", "rank_zero_first"]


def process_group_ready() -> bool:
    """Whether a torch.distributed process group of more than one rank is initialised."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch always ships distributed on supported platforms
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextmanager
def exclusive_file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(
    is_complete: Callable[[], bool], build: Callable[[], None], lock_path: Path, synchronize: bool = True
) -> None:
    """Make sure ``build`` has run once for everyone sharing ``lock_path``'s directory.

    Args:
        is_complete: whether the result already exists (checked under the lock, so builds are never repeated).
        build: writes the result; it must publish atomically (temporary names, then renames).
        lock_path: the lock file, next to the result.
        synchronize: with a process group, hold the other ranks until rank 0 is done. Every rank must call
            ``build_once`` the same number of times, as with any collective.
    """

    def build_under_lock() -> None:
        with exclusive_file_lock(lock_path):
            if not is_complete():
                build()

    if not (synchronize and process_group_ready()):
        build_under_lock()
        return
    if _rank_zero_then_others(build_under_lock, "build a shared cache") is _OTHER_RANK and not is_complete():
        raise DataFileError(
            f"rank 0 built the cache beside {lock_path}, but this rank cannot see it; the cache directory must be "
            "on a file system shared by all ranks (set data_cache_path to one)"
        )


_OTHER_RANK = object()


def _rank_zero_then_others(action: Callable[[], T], what: str):
    """Run ``action`` on rank 0 while the other ranks wait; a failure on rank 0 raises everywhere.

    Returns ``action``'s result on rank 0 and ``_OTHER_RANK`` elsewhere.
    """
    import torch.distributed as dist

    failure: list[str | None] = [None]
    result = _OTHER_RANK
    if dist.get_rank() == 0:
        try:
            result = action()
        except Exception as error:  # noqa: BLE001 - relayed to every rank below, then re-raised here
            failure[0] = f"{type(error).__name__}: {error}"
            dist.broadcast_object_list(failure, src=0)
            raise
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise DataFileError(f"rank 0 failed to {what} ({failure[0]}); see rank 0's log")
    return result


def rank_zero_first(load: Callable[[], T]) -> T:
    """Run ``load`` on rank 0, then on the other ranks, so that a cache it writes is written once.

    Without a process group this is just ``load()``. A failure on rank 0 raises on every rank instead of hanging.
    """
    if not process_group_ready():
        return load()
    result = _rank_zero_then_others(load, "load the data")
    return load() if result is _OTHER_RANK else result
