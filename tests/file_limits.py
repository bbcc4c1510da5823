"""A write that fails part-way for tests, without mounting a file system or writing through a link.

Owns: ``file_size_limit(limit)``, a context in which this process may not write a file past ``limit`` bytes: the
kernel then fails the write with ``EFBIG``, as a full disk fails it with ``ENOSPC`` (``RLIMIT_FSIZE``, with the
``SIGXFSZ`` that would end the process ignored). Not responsible for: what the code under test does about it.
"""

from __future__ import annotations

import resource
import signal
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["file_size_limit"]


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes of this process that would make a file longer than ``limit`` bytes fail with ``EFBIG``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
