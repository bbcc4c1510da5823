"""Read-only directories for tests, also when the suite runs as root (as CI does).

Owns: ``read_only(directory)``, a context in which creating a file in ``directory`` fails with the kernel's own
``PermissionError``, as it does for a normal user in a directory without write permission. Not responsible for:
what the code under test does about it.

Root ignores permission bits through one capability, ``CAP_DAC_OVERRIDE``. Inside the context the directory is
mode 0o555 and, for root, that capability is lowered from the calling thread's effective set (``capset``, which
needs no privilege to lower a capability or to raise it back within the permitted set). ``CAP_DAC_READ_SEARCH``
stays, so root still reads everything it could. Capabilities belong to a thread: the code under test must run in
the calling thread (it does: the caches are written by the caller).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["read_only"]

_CAPABILITY_VERSION_3 = 0x20080522  # linux/capability.h: 64-bit sets, two 32-bit words each
_CAP_DAC_OVERRIDE = 1


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _call(name: str, header: _Header, data) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(ctypes.byref(header), data) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{name} failed: {os.strerror(error)}")


@contextmanager
def _without_dac_override() -> Iterator[None]:
    """Lower ``CAP_DAC_OVERRIDE`` from this thread's effective set for the duration; a no-op for other users."""
    if os.geteuid() != 0:
        yield
        return
    header, data = _Header(_CAPABILITY_VERSION_3, 0), (_Data * 2)()
    _call("capget", header, data)
    effective = data[0].effective
    data[0].effective = effective & ~(1 << _CAP_DAC_OVERRIDE)
    _call("capset", header, data)
    try:
        yield
    finally:
        data[0].effective = effective
        _call("capset", header, data)


def _assert_unwritable(directory: Path) -> None:
    probe = directory / ".probe"
    try:
        probe.touch(exist_ok=False)
    except PermissionError:
        return
    probe.unlink()
    raise AssertionError(f"{directory} is still writable: the read-only simulation does not work on this system")


@contextmanager
def read_only(directory: Path) -> Iterator[Path]:
    """``directory`` (which must exist) made read-only for this thread, root included; restored on exit."""
    mode = directory.stat().st_mode & 0o7777
    directory.chmod(0o555)
    try:
        with _without_dac_override():
            _assert_unwritable(directory)
            yield directory
    finally:
        directory.chmod(mode)
