"""The worker-side wrappers of ``worker_errors``: the allocator setting they make in each DataLoader worker.

(That a library error raised in a worker reaches the caller as without workers is tested in
``test_resume_checks.py``.)
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np
import pytest
import torch.utils.data

from hyper_parallel.data.batching.worker_errors import CollateInWorker, FetchInWorker, pin_mmap_threshold

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the mmap threshold is glibc's")

_BLOCKS = 32
_BLOCK = 1 << 16  # float64 entries: 512 KiB, a batch buffer's size
_KEPT = 1 << 13  # 64 KiB, under any threshold: always from the heap, so it holds the heap's top in place


def _anonymous_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


class _LargeBlocks(torch.utils.data.Dataset):
    """Frees an 8 MiB block (as a worker does once torch has sent a batch), then allocates and frees 32 batch-sized
    blocks, each followed by a small block that is kept; reports the anonymous memory the worker kept."""

    def __getitem__(self, index: int) -> int:
        del index
        np.ones(1 << 20)  # 8 MiB, allocated and freed at once
        before, kept, blocks = _anonymous_bytes(), [], []
        for _ in range(_BLOCKS):
            blocks.append(np.ones(_BLOCK))
            kept.append(np.ones(_KEPT))
        del blocks
        return _anonymous_bytes() - before - _BLOCKS * _KEPT * 8


def _first(items: list):
    return items[0]


def _kept_in_worker(dataset, collate_fn) -> int:
    """The bytes of the freed blocks that a DataLoader worker running ``dataset`` still holds."""
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=[[0]], num_workers=1, collate_fn=collate_fn)
    return int(next(iter(loader)))


@glibc_only
def test_a_plain_worker_keeps_freed_batch_sized_blocks_after_a_larger_one_was_freed():
    # Why the pin exists: glibc raises its threshold to the freed 8 MiB, so the 512 KiB blocks come from the heap,
    # which cannot give them back below the kept blocks: at least half of the 16 MiB stays.
    assert _kept_in_worker(_LargeBlocks(), _first) > _BLOCKS * _BLOCK * 8 // 2


@glibc_only
def test_a_worker_gives_freed_batch_sized_blocks_back_to_the_system():
    # The first fetch pins the threshold: each 512 KiB block is its own mapping, unmapped when freed.
    assert _kept_in_worker(FetchInWorker(_LargeBlocks()), CollateInWorker(_first)) < 4 * _BLOCK * 8


@glibc_only
def test_the_threshold_is_pinned_once_per_process():
    pin_mmap_threshold.cache_clear()
    assert pin_mmap_threshold(os.getpid()) is True
    assert pin_mmap_threshold(os.getpid()) is True
    assert pin_mmap_threshold.cache_info().misses == 1
