"""Writing files safely: temporary names, atomic renames, and never a write through a symbolic link.

Owns: the name a file is written under until it is complete (``<name>.tmp-<host>-<pid>``), creating it without
following a link (``O_CREAT | O_EXCL | O_NOFOLLOW``), renaming it into place only when complete, refusing a link
found at a temporary or final name with a ``DataFileError`` naming it (``link_refusal``; a link is never written
through, replaced or removed), the ``DataFileError`` of a failed write with its fix (``output_error``), and
removing the temporaries of dead processes of this host (``remove_stale_temporaries``). A regular file at a
temporary name of this host and process id is a leftover of a dead process that had the same id, and is replaced.
Every writer of the package (pair builders, index caches and their locks, offline outputs, tools) goes through it,
so it sits at the ground floor beside ``errors``.
Not responsible for: what the files contain, or which names a writer chooses.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from hyper_parallel.data.errors import DataFileError

__all__ = [
    "NO_FOLLOW",
    "atomic_file",
    "atomic_output",
    "create_temporary",
    "link_refusal",
    "output_error",
    "refuse_links",
    "remove_stale_temporaries",
    "reopen_for_append",
    "temporary_path",
    "write_atomically",
]

# The host is part of temporary names: on a shared file system a process id says nothing about other machines.
_HOST = re.sub(r"[^A-Za-z0-9.]+", "_", socket.gethostname())[:40] or "host"
_TEMPORARY_MARK = ".tmp-"
NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # 0 where the system has no such flag (Windows has no symlink attacks)
_CLOSE_ON_EXEC = getattr(os, "O_CLOEXEC", 0)
_NEW_FILE = os.O_RDWR | os.O_CREAT | os.O_EXCL | NO_FOLLOW | _CLOSE_ON_EXEC

_FIXES = {
    errno.ENOSPC: "free space on that file system or write the output elsewhere",
    errno.EDQUOT: "free space within your disk quota or write the output elsewhere",
    errno.EACCES: "make the directory writable or write the output elsewhere",
    errno.EPERM: "make the directory writable or write the output elsewhere",
    errno.EROFS: "the file system is read-only: write the output elsewhere",
    errno.EMFILE: "raise the open-file limit (ulimit -n)",
    errno.ENOTDIR: "a parent of the path is a file: choose another output location",
    errno.EFBIG: "the file is larger than this process may write (ulimit -f): raise the limit or write less",
    errno.ELOOP: "a symbolic link was put at the name being written: remove it and run again",
}


def temporary_path(path: str | os.PathLike) -> Path:
    """The name a file is written under until it is complete: ``<name>.tmp-<host>-<pid>``."""
    path = Path(path)
    return path.with_name(f"{path.name}{_TEMPORARY_MARK}{_HOST}-{os.getpid()}")


def output_error(path: str | os.PathLike, error: OSError) -> DataFileError:
    """A ``DataFileError`` for a failed write of ``path``, saying what to do about the cause."""
    fix = _FIXES.get(error.errno, "check that the output location is writable and has space")
    return DataFileError(f"cannot write {path}: {error.strerror or error}; {fix}")


def link_refusal(path: str | os.PathLike) -> DataFileError:
    """The ``DataFileError`` for a symbolic link found at a name the library writes: it names the link, its target
    and the fix."""
    try:
        target = os.readlink(path)
    except OSError:
        target = "an unknown target"
    return DataFileError(
        f"{path} is a symbolic link to {target}: files are never written through a link, and one at the name of a "
        f"file this library writes was put there by something else; remove the link (rm '{path}') and run again, "
        "or write the output elsewhere"
    )


def refuse_links(*paths: str | os.PathLike) -> None:
    """Raise ``link_refusal`` for the first of ``paths`` that is a symbolic link (dangling ones included)."""
    for path in paths:
        if os.path.islink(path):
            raise link_refusal(path)


def create_temporary(temporary: str | os.PathLike) -> int:
    """Create the temporary name ``temporary`` as a new, empty file and return a descriptor open for reading and
    writing. A link there is refused (``link_refusal``), never followed or removed; a regular file there carries
    this host and process id, so it was left by a dead process that had the same id: it is replaced.

    Raises:
        DataFileError: a symbolic link is at ``temporary``.
        OSError: the file cannot be created (the callers turn it into ``output_error``).
    """
    replaced = False
    while True:
        try:
            return os.open(temporary, _NEW_FILE, 0o666)
        except FileExistsError:
            if os.path.islink(temporary):
                raise link_refusal(temporary) from None
            if replaced:
                raise
        os.unlink(temporary)
        replaced = True


def reopen_for_append(temporary: str | os.PathLike) -> int:
    """A descriptor appending to ``temporary``, a file ``create_temporary`` made, without following a link that
    replaced it since."""
    return os.open(temporary, os.O_WRONLY | os.O_APPEND | NO_FOLLOW | _CLOSE_ON_EXEC)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[bytes]]:
    """Yield a new file (``mode`` ``"wb"`` or ``"w+b"``) under ``path``'s temporary name; rename it into place when
    the block ends, remove it if the block fails.

    Raises:
        DataFileError: a symbolic link is at ``path`` or at its temporary name (nothing is written), or a write or
            the rename failed (``output_error``).
    """
    path = Path(path)
    temporary = temporary_path(path)
    created = False
    try:
        refuse_links(path)
        with os.fdopen(create_temporary(temporary), mode) as file:
            created = True
            yield file
        refuse_links(path)  # again just before the rename: a link planted while the file was written
        os.replace(temporary, path)
    except OSError as error:
        raise output_error(path, error) from None
    finally:
        if created:  # never a link at the temporary name: create_temporary refused it
            temporary.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """``atomic_file`` for writers that take a file name (a plot's ``savefig``): yields the temporary name, created
    empty (without following a link) before the block, so that a link planted there beforehand is refused."""
    with atomic_file(path) as file:
        file.close()
        yield temporary_path(path)


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` under its temporary name, then rename it into place."""
    with atomic_file(path) as file:
        file.write(data)


def _process_is_alive(pid: int) -> bool:
    if os.name == "nt":
        return True  # os.kill would terminate the process there, not probe it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(final_paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Remove the temporaries of ``final_paths`` left by dead processes of this host; returns what was removed.

    A temporary is stale when its name is ``<final name>.tmp-<this host>-<pid>`` and no process ``pid`` runs.
    Temporaries of live processes (a concurrent run) and of other hosts are left alone, and so are symbolic links
    (never written by this library, so never its temporaries).
    """
    wanted: dict[Path, set[str]] = {}
    for path in map(Path, final_paths):
        wanted.setdefault(path.parent, set()).add(path.name)
    removed = []
    for directory, names in wanted.items():
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            continue
        for entry in entries:
            final, mark, owner = entry.name.rpartition(_TEMPORARY_MARK)
            host, _, pid = owner.rpartition("-")
            if not mark or final not in names or host != _HOST or not pid.isdigit() or entry.is_symlink():
                continue
            if _process_is_alive(int(pid)):
                continue
            Path(entry.path).unlink(missing_ok=True)
            removed.append(Path(entry.path))
    return removed
