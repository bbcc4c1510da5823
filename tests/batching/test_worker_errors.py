"""The worker-side wrappers of ``worker_errors``: the allocator setting they make in each DataLoader worker.

(That a library error raised in a worker reaches the caller as without workers is tested in
``test_resume_checks.py``.)

The setting is observed directly, not through a process's memory figures (which depend on what the heap a worker
inherits already holds): a worker allocates and frees a block larger than all the free space its heap has, then
allocates a block of the same size again, and reports whether that second block got a mapping of its own (outside
the ``[heap]`` region of ``/proc/self/maps``) or came from the heap. glibc's dynamic threshold serves it from the
heap (the freed size became the threshold); a pinned threshold gives it a mapping of its own, which ``free`` returns
to the system.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from pathlib import Path

import pytest
import torch.utils.data

from hyper_parallel.data.batching.worker_errors import CollateInWorker, FetchInWorker

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the mmap threshold is glibc's")

_MARGIN = 1 << 20  # the block is this much larger than the heap's free space
_DYNAMIC_MAX = 32 << 20  # glibc raises its threshold only to blocks up to 32 MiB (64-bit DEFAULT_MMAP_THRESHOLD_MAX)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    libc.mallinfo2.restype = _MallInfo2
    return libc


def _in_heap(address: int) -> bool:
    """Whether ``address`` lies in the main arena's ``[heap]`` region (not in a mapping of its own)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("[heap]"):
            start, end = (int(bound, 16) for bound in line.split()[0].split("-"))
            return start <= address < end
    return False


class _ReallocateAfterFree(torch.utils.data.Dataset):
    """In the worker: the block size and whether the same-sized block allocated after a free was mapped on its own."""

    def __getitem__(self, index: int) -> tuple[int, bool]:
        del index
        libc = _libc()
        size = libc.mallinfo2().fordblks + _MARGIN  # no free chunk and not the heap's top can hold it
        libc.free(libc.malloc(size))
        block = libc.malloc(size)
        mapped = not _in_heap(block)
        libc.free(block)
        return size, mapped


def _first(items: list):
    return items[0]


def _in_worker(dataset, collate_fn, context: str | None = None) -> tuple[int, bool]:
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=[[0]], num_workers=1, collate_fn=collate_fn, multiprocessing_context=context
    )
    return next(iter(loader))


@glibc_only
def test_a_plain_worker_serves_a_block_from_the_heap_once_a_block_of_its_size_was_freed():
    # Why the pin exists: the freed block raised glibc's threshold, so the next batch-sized block comes from the heap,
    # which keeps it once freed. A spawned worker starts from a fresh heap, whose free space is under the 32 MiB up
    # to which glibc raises the threshold (a forked one inherits the parent's heap and any threshold it set).
    size, mapped = _in_worker(_ReallocateAfterFree(), _first, context="spawn")
    assert size <= _DYNAMIC_MAX
    assert mapped is False


@glibc_only
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_worker_maps_each_block_above_the_threshold_on_its_own(context):
    # The first fetch pinned the threshold: the freed block did not raise it, so the second block is a mapping of
    # its own again, whatever heap the worker started from.
    assert _in_worker(FetchInWorker(_ReallocateAfterFree()), CollateInWorker(_first), context)[1] is True
