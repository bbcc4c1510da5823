"""Build something once and let everyone else wait: across ranks with torch.distributed, across jobs with a lock.

Owns: the "one builds, the others wait, then everyone loads" protocol for shared caches, and making a failure on
one rank raise on every rank. With an initialised process group, rank 0 builds each entry (under the file lock
too, in case another job shares the directory) and then every rank takes part in one small all-gather of the
entry it expects, so that ranks whose settings differ raise a ``DataConfigError`` naming the entry and the
differing fields, instead of a misleading "cannot see the cache". A rank that fails inside a ``failures_shared``
block (a whole dataset build) writes its error to the process group's store; ranks waiting in a collective poll
the store and raise that error within about a second instead of waiting for the process-group timeout. Without a
process group, an exclusive ``flock`` on a lock file serialises concurrent processes; a process that has to wait
says once what for, and gives up after a timeout. A lock file is opened without following a symbolic link: a link
planted at its name is refused with a ``DataFileError`` naming it. Inside ``without_rank_collectives`` (what runs
on some ranks only, such as the data ranks' dataset builds) the builders behave as without a process group: file
locks only.
Not responsible for: what is built, or where (``indexed.index_cache``).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.file_writes import NO_FOLLOW, link_refusal, output_error

T = TypeVar("T")

__all__ = [
    "ABSENT",
    "DEFAULT_LOCK_TIMEOUT_S",
    "build_once",
    "description_differences",
    "exclusive_file_lock",
    "default_store",
    "failures_shared",
    "gather_device",
    "process_group_ready",
    "rank_zero_first",
    "short_value",
    "without_rank_collectives",
]

logger = get_logger("hyper_parallel.data.parallel.build_barrier")

# Never through a link; non-blocking so that a FIFO planted at the name cannot hang the open.
_LOCK_FILE = os.O_RDWR | os.O_CREAT | NO_FOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)

DEFAULT_LOCK_TIMEOUT_S = 1800.0  # torch's default process-group timeout: longer waits would fail the job anyway

_STORE_PREFIX = "hyper_parallel.data/failure"
_STORE_POLL_S = 0.5  # a waiting rank asks the store for failures at most this often
_STORE_FIRST_POLL_S = 0.05  # steps that finish sooner (the usual case) cost no store request
_STORE_LINGER_S = 3.0  # how long rank 0, which may host the store, waits for the others to read a failure
_SHOWN_DIFFERENCES = 5


_collectives_off = 0  # depth of ``without_rank_collectives`` blocks this process is in


def process_group_ready() -> bool:
    """Whether the ranks synchronise through torch.distributed here: a process group of more than one rank is
    initialised, and this process is not inside ``without_rank_collectives``."""
    if _collectives_off:
        return False
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch always ships distributed on supported platforms
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextmanager
def without_rank_collectives() -> Iterator[None]:
    """Run a block that only some ranks run as if there were no process group.

    Inside, ``process_group_ready()`` is False, so ``build_once``, ``rank_zero_first``, ``failures_shared`` and the
    dataset builders that ask it take no collective (which would wait for ever for the ranks that do not run the
    block) and coordinate through the file locks only. The caller orders the ranks instead: ``rank_zero_first``
    runs the block on rank 0 before the others, so the caches are written once, by rank 0, and read by the others.
    """
    global _collectives_off
    _collectives_off += 1
    try:
        yield
    finally:
        _collectives_off -= 1


# -- file locks ---------------------------------------------------------------------------------------------------


def _holder(handle) -> str:
    """Who holds the lock, as its holder wrote it into the file."""
    handle.seek(0)
    text = handle.read(200).decode("utf-8", "replace").strip()
    return text or "another process"


def _acquire(handle, path: Path, timeout: float, what: str) -> None:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    holder = _holder(handle)
    logger.warning(
        "waiting for the lock %s: %s is building %s; giving up after %g s (data_config.cache_lock_timeout)",
        path,
        holder,
        what,
        timeout,
    )
    deadline = time.monotonic() + timeout
    pause = 0.01
    while True:
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                break
        pause = min(pause * 2, 1.0)
    raise DataFileError(
        f"gave up after {timeout:g} s waiting for the lock {path}, held by {_holder(handle)} to build {what}. "
        "Either another job sharing the cache directory is still building it, or a stale builder hangs while "
        "holding the lock: stop that process if it is stuck, or raise data_config.cache_lock_timeout if its build "
        "is only slow. Do not delete the lock file: the lock belongs to the open file, so deleting it releases "
        "nothing and lets two builders write the entry at once"
    )


def _open_lock_file(path: Path) -> int:
    """Open (or create) the lock file without following a link, and only if it is a regular file: a link planted
    at its name is refused, so that writing who holds the lock never truncates another file."""
    try:
        descriptor = os.open(path, _LOCK_FILE, 0o666)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise link_refusal(path) from None
        raise output_error(path, error) from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise DataFileError(f"the lock file {path} is not a regular file; remove it (rm '{path}') and run again")
    return descriptor


@contextmanager
def exclusive_file_lock(path: Path, timeout: float = DEFAULT_LOCK_TIMEOUT_S, what: str = "a cache") -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the duration of the block.

    A process that finds the lock held logs once what it waits for (the lock, its holder, ``what``) and polls.

    Args:
        path: the lock file.
        timeout: seconds to wait for the holder.
        what: what the holder builds, for the messages.

    Raises:
        DataFileError: the lock was still held after ``timeout`` seconds; names the lock, its holder and the fix.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(_open_lock_file(path), "r+b") as handle:
        _acquire(handle, path, timeout, what)
        try:
            # For the messages of processes that wait: who holds the lock.
            handle.truncate(0)
            handle.seek(0)
            handle.write(f"pid {os.getpid()} on {socket.gethostname()}".encode())
            handle.flush()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# -- failures shared between ranks --------------------------------------------------------------------------------


def default_store():
    """The default process group's key-value store (every rank's, whatever group it talks in), or None where torch
    does not expose it."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # pragma: no cover - a group without a store
        return None


def gather_device(group=None):
    """Where the tensors of a collective over ``group`` (None: the world) must live: the current CUDA device under
    NCCL, which gathers device tensors only, the CPU otherwise."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


ABSENT = object()  # a field one side of a comparison does not have


def short_value(value) -> str:
    """``value``'s repr for a message, cut to 80 characters; ``(absent)`` for a field a side does not have."""
    text = "(absent)" if value is ABSENT else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def description_differences(reference, other, path: str = "") -> list[tuple[str, str, str]]:
    """Up to ``_SHOWN_DIFFERENCES`` ``(field path, reference value, other value)`` where two descriptions differ."""
    if isinstance(reference, dict) and isinstance(other, dict):
        keys = [*reference, *(key for key in other if key not in reference)]
        pairs = [(f"{path}.{k}" if path else str(k), reference.get(k, ABSENT), other.get(k, ABSENT)) for k in keys]
    elif isinstance(reference, list | tuple) and isinstance(other, list | tuple) and len(reference) == len(other):
        pairs = [(f"{path}[{i}]", a, b) for i, (a, b) in enumerate(zip(reference, other, strict=True))]
    else:
        return [] if reference == other else [(path or "the description", short_value(reference), short_value(other))]
    found: list[tuple[str, str, str]] = []
    for where, a, b in pairs:
        found += description_differences(a, b, where)
        if len(found) >= _SHOWN_DIFFERENCES:
            break
    return found[:_SHOWN_DIFFERENCES]


def _disagreement_message(reference: str, others: list) -> str:
    """One message for every rank: what rank 0 builds, and what each differing rank builds instead, and why."""
    lines = []
    for rank, other in enumerate(others):
        if other is None:
            continue
        expected, differences = other
        fields = "; ".join(f"{path}: rank 0 has {a}, rank {rank} has {b}" for path, a, b in differences)
        lines.append(f"rank {rank} builds {expected}" + (f", differing in {fields}" if fields else ""))
    if len(lines) > 3:
        lines = [*lines[:3], f"and {len(lines) - 3} more ranks differ"]
    return (
        f"the ranks disagree on the dataset config: rank 0 builds {reference}, but " + "; ".join(lines) + ". Every "
        "rank must build the same datasets: give every rank the same data_path, data_config (split, seq_length, "
        "random_seed, ...), sample counts and tokenizer, and the same data files (the index caches record their "
        "sizes and modification times: copies must keep them, as `cp -p` and `rsync -a` do)"
    )


class _Session:
    """One ``failures_shared`` block of every rank: its steps and the store key where a failure goes."""

    used = 0  # blocks of this process that took a step or wrote a failure; the same count on every rank

    def __init__(self) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._store = default_store()
        self._key = f"{_STORE_PREFIX}/{_Session.used}"
        self.steps = 0
        self.wrote = False
        self.settled = False  # this rank wrote a failure or raised one it learnt: it tells nobody anything more
        self._next_poll = 0.0

    def close(self) -> None:
        if self.steps or self.wrote:
            _Session.used += 1

    def fail(self, what: str, error: BaseException) -> None:
        """Tell the other ranks that this rank failed to do ``what`` (once; the first failure of a block wins)."""
        if self.settled:
            return
        self.settled = True
        if self._store is None:
            return
        # the steps it joined: a rank waiting in one of those collectives will see it complete, and goes on to
        # find its own error or the next step's failure (see raise_if_failed)
        error_text = f"{type(error).__name__}: {error}"
        record = json.dumps({"rank": self.rank, "what": what, "error": error_text, "steps": self.steps})
        try:
            self._store.compare_set(self._key, "", record)
            self.wrote = True
            self._known()
        except RuntimeError as store_error:  # the original error is raised by the caller anyway
            logger.warning("could not tell the other ranks that this rank failed (%s)", store_error)

    def _known(self) -> None:
        """Count this rank among those that know of the failure; rank 0, which may host the store (and take it
        away when it exits), waits a little for the others to read it."""
        seen = self._store.add(f"{self._key}/seen", 1)
        deadline = time.monotonic() + _STORE_LINGER_S
        while self.rank == 0 and seen < self.world_size and time.monotonic() < deadline:
            time.sleep(0.02)
            seen = self._store.add(f"{self._key}/seen", 0)

    def raise_if_failed(self, now: bool = False, before_step: int | None = None) -> None:
        """Raise the failure another rank wrote, asking the store at most every ``_STORE_POLL_S`` unless ``now``.

        With ``before_step``, only a failure of a rank that never joined that step's collective is raised: one
        that joined it lets the collective complete, so this rank goes on to the same error of its own (every rank
        checks the same settings) instead of a second-hand one that depends on which rank was faster.
        """
        if self._store is None or (not now and time.monotonic() < self._next_poll):
            return
        self._next_poll = time.monotonic() + _STORE_POLL_S
        try:
            if not self._store.check([self._key]):
                return
            record = json.loads(self._store.get(self._key))
            if before_step is not None and record["steps"] >= before_step:
                return
            self._known()
        except RuntimeError as error:  # the store went away with its host
            self.settled = True
            raise DataFileError(
                f"lost the process group's store while waiting for the other ranks ({error}); the rank that hosts "
                "it (rank 0, or the launcher's agent) failed or exited: see its log"
            ) from None
        self.settled = True
        rank = record["rank"]
        raise DataFileError(f"rank {rank} failed to {record['what']} ({record['error']}); see rank {rank}'s log")

    def _wait(self, work) -> None:
        """Wait for a collective, raising instead when another rank reports a failure."""
        started = time.monotonic()
        pause = 1e-4
        while not work.is_completed():
            if time.monotonic() - started > _STORE_FIRST_POLL_S:
                self.raise_if_failed(before_step=self.steps)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        try:
            work.wait()
        except Exception as error:  # noqa: BLE001 - a rank left; its own message, if it wrote one, comes first
            self.raise_if_failed(now=True)
            self.settled = True
            raise DataFileError(
                f"a rank left while the ranks compared what they build ({error}); see the other ranks' logs"
            ) from None

    def step(self, expected: str, description: dict | None = None) -> None:
        """Every rank says what it expects now (``expected``); all go on if they agree, or all raise.

        Args:
            expected: what this rank builds at this step, e.g. the cache entry; the same text on every rank.
            description: the settings behind ``expected``, compared field by field when the ranks disagree.
        """
        import torch
        import torch.distributed as dist

        self.steps += 1
        digest = hashlib.md5(expected.encode("utf-8"), usedforsecurity=False).digest()
        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(gather_device())
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._wait(dist.all_gather(gathered, mine, async_op=True))
        digests = torch.stack(gathered).cpu()
        differs = (digests != digests[0]).any(dim=1).tolist()
        if any(differs):
            self.settled = True
            raise self._disagreement(expected, description, differs[self.rank])

    def _disagreement(self, expected: str, description: dict | None, differs: bool) -> DataConfigError:
        """Every rank saw the same digests: together they name what differs, and all raise the same error."""
        import torch.distributed as dist

        reference = [(expected, description) if self.rank == 0 else None]
        dist.broadcast_object_list(reference, src=0)
        reference_expected, reference_description = reference[0]
        mine = None
        if differs:
            comparable = description is not None and reference_description is not None
            mine = (expected, description_differences(reference_description, description) if comparable else [])
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        return DataConfigError(_disagreement_message(reference_expected, everyone))

    def finish(self) -> None:
        """At the end of a block that took steps: wait until every rank got through it, or raise a rank's failure."""
        if self.steps:
            self.step("nothing more (it has built every dataset)")


_current: _Session | None = None


@contextmanager
def failures_shared(what: str) -> Iterator[None]:
    """Make a failure on any rank inside the block raise on every rank; every rank must enter the block.

    A rank whose block raises writes its error to the process group's store, then re-raises it. Ranks waiting in
    ``build_once`` or ``rank_zero_first`` inside the block poll the store and raise ``DataFileError("rank r failed
    to <what> (<error>)")``. A block in which the ranks waited for one another ends with one more step, so that no
    rank goes on while another failed. Without a process group, or inside another such block, this does nothing.
    Usable as a decorator.

    Args:
        what: what the block does, for the messages ("build the Indexed datasets").
    """
    global _current
    if _current is not None or not process_group_ready():
        yield
        return
    session = _current = _Session()
    try:
        yield
        session.finish()
    except BaseException as error:  # an interrupt too: the other ranks must not wait for this one
        session.fail(what, error)
        raise
    finally:
        _current = None
        session.close()


# -- one builds, the others wait ----------------------------------------------------------------------------------


def build_once(
    is_complete: Callable[[], bool],
    build: Callable[[], None],
    lock_path: Path,
    synchronize: bool = True,
    *,
    description: dict | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
) -> None:
    """Make sure ``build`` has run once for everyone sharing ``lock_path``'s directory.

    Args:
        is_complete: whether the result already exists and is sound (checked under the lock, so builds are never
            repeated).
        build: writes the result; it must publish atomically (temporary names, then renames).
        lock_path: the lock file, next to the result and named after it.
        synchronize: with a process group, hold the other ranks until rank 0 is done. Every rank must call
            ``build_once`` the same number of times, as with any collective.
        description: the settings that name the result, compared field by field when ranks disagree.
        lock_timeout: seconds to wait for another process holding the lock.

    Raises:
        DataConfigError: the ranks expect different results (their settings differ).
        DataFileError: the lock wait timed out, another rank failed, or this rank cannot see what rank 0 built.
    """
    what = f"the cache entry {lock_path.stem}"

    def build_under_lock() -> None:
        with exclusive_file_lock(lock_path, lock_timeout, what):
            if not is_complete():
                build()

    if not (synchronize and process_group_ready()):
        build_under_lock()
        return
    with failures_shared("build a shared cache"):
        session = _current
        if session.rank == 0:
            session.raise_if_failed(before_step=session.steps + 1)  # a failed rank makes this build useless
            try:
                build_under_lock()
            except Exception as error:
                session.fail("build a shared cache", error)
                raise
        session.step(what, description)
        if session.rank != 0 and not is_complete():
            raise DataFileError(
                f"rank 0 built the cache beside {lock_path}, but this rank cannot see it; the cache directory must "
                "be on a file system shared by all ranks (set data_cache_path to one)"
            )


def rank_zero_first(load: Callable[[], T], *, takes_part: bool = True, what: str = "load the data") -> T | None:
    """Run ``load`` on rank 0, then on the other ranks, so that a cache it writes is written once.

    Every rank of the process group calls it. Without a process group this is just ``load()``. A failure on any rank
    raises on every rank instead of hanging.

    Args:
        load: what to run.
        takes_part: False on a rank that runs nothing and returns None; it still waits with the others, so that it
            goes on only once every rank that loads has loaded, and it raises their failures. Rank 0 must take
            part.
        what: what ``load`` does, for the messages of the other ranks when it fails ("load the data").
    """
    if not process_group_ready():
        return load() if takes_part else None
    with failures_shared(what):
        session = _current
        done = f"rank 0 did {what}"  # the same text on every rank
        if session.rank == 0:
            if not takes_part:
                raise DataConfigError(
                    f"rank 0 must {what} first (it writes the caches the other ranks read), but it was told not to "
                    "take part; let global rank 0 take part (a DataLoaderParallelContext always makes it a data rank)"
                )
            result = load()
            session.step(done)
            return result
        session.step(done)
        return load() if takes_part else None
