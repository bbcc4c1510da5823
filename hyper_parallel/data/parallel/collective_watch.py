"""Run a collective with a watchdog: a rank that stops answering is reported by the others, by rank, in minutes.

Owns: the timeout of the step-level collectives (``collective_timeout``), waiting for one with that timeout
(``watched``), telling which ranks of the group never reached it, and the ``CollectiveTimeout`` error that says so.
Not responsible for: what the collective carries (the callers: ``rank_agreement``, the scheduler step, the config
checks), a rank that fails rather than hangs (``build_barrier.failures_shared`` relays its error), or the
process-group timeout itself (torch's, 30 minutes by default).

Usage::

    out = [torch.empty_like(mine) for _ in range(group_size)]
    watched("the scheduler's step plan", lambda: dist.all_gather(out, mine, group=group, async_op=True), group=group)

``watched(what, issue, group=None, timeout_s=None)`` records this rank's arrival, calls ``issue()`` (which issues the
collective with ``async_op=True`` and returns its work) and waits for the work to complete. After
``collective_timeout(timeout_s)`` seconds it raises ``CollectiveTimeout`` naming the collective (``what``), the
group's global ranks, the ranks that have not reached it and the setting to raise if they are only slow. Errors the
collective itself raises (a rank left) become a ``DataFileError`` naming the collective.

Who has not arrived: each rank writes its call count under one key per (group, ``what``, rank) in the default
process group's store (``build_barrier.default_store``). Call counts per (group, ``what``) are counted locally, so
they match across ranks without communication as long as every rank of the group makes the same calls, as
collectives require anyway. A rank whose key holds a smaller count (or none) has not reached this call. Each key is
overwritten by the next call, so the store holds one key per (group, ``what``, rank) whatever the number of calls:
``what`` must be a fixed name, not one that changes from call to call (no step numbers in it).

Cost on the fast path: one store write per call, plus the wait: a gloo work is waited on with the timeout (it
wakes its rank the moment it completes), any other backend's work is polled every few milliseconds at most. That
suits step-level collectives (a scheduler step, a config check), not per-micro-batch broadcasts: those stay plain.

The timeout: ``timeout_s`` when the caller gives one, else the environment variable ``HP_DATA_COLLECTIVE_TIMEOUT``
(seconds), else ``DEFAULT_COLLECTIVE_TIMEOUT_S`` (300 s, well under torch's 30-minute process-group timeout).
A collective that timed out stays issued: the error is for the job's log, and the job is expected to end.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.parallel.build_barrier import default_store

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "TIMEOUT_VARIABLE",
    "CollectiveTimeout",
    "collective_timeout",
    "format_ranks",
    "group_ranks",
    "watched",
]

logger = get_logger("hyper_parallel.data.parallel.collective_watch")

TIMEOUT_VARIABLE = "HP_DATA_COLLECTIVE_TIMEOUT"
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0  # well under torch's default process-group timeout of 30 minutes

_STORE_PREFIX = "hyper_parallel.data/arrival"
_LONGEST_PAUSE_S = 0.005  # the most a completed, polled (not gloo) collective waits before its rank notices
_SHORTEST_WAIT_S = 0.001  # a wait's timeout in whole milliseconds: 0 would mean no timeout to torch

_calls: dict[tuple[str, str], int] = {}  # (group key, what) -> collectives this process issued


class CollectiveTimeout(DataFileError):
    """A collective did not complete within its timeout: some rank of the group hangs or runs something else.

    Attributes:
        what: the collective, as the caller named it.
        ranks: the group's global ranks.
        missing: the global ranks that have not reached it (empty when all have; None when unknown).
        timeout_s: the timeout it was given.
    """

    def __init__(
        self,
        message: str,
        *,
        what: str = "",
        ranks: list[int] | None = None,
        missing: list[int] | None = None,
        timeout_s: float = 0.0,
    ) -> None:  # the defaults let pickle rebuild it from the message; its attributes come back with its __dict__
        super().__init__(message)
        self.what = what
        self.ranks = ranks or []
        self.missing = missing
        self.timeout_s = timeout_s


def _seconds(raw, name: str) -> float:
    """``raw`` as a positive, finite number of seconds, or a DataConfigError naming ``name``."""
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(raw, bool) or not (math.isfinite(seconds) and seconds > 0):
        raise DataConfigError(
            f"{name} must be a number of seconds > 0, got {raw!r}; give it e.g. 600 to wait longer for slow ranks, "
            f"or leave it unset for the default of {DEFAULT_COLLECTIVE_TIMEOUT_S:g} s"
        )
    return seconds


def _timeout_and_setting(timeout_s: float | None) -> tuple[float, str]:
    """The timeout, and the setting that decides it (for the message that says what to raise)."""
    if timeout_s is not None:
        return _seconds(timeout_s, "timeout_s"), "the caller's timeout_s"
    raw = os.environ.get(TIMEOUT_VARIABLE)
    if raw is not None:
        return _seconds(raw, f"the environment variable {TIMEOUT_VARIABLE}"), TIMEOUT_VARIABLE
    return DEFAULT_COLLECTIVE_TIMEOUT_S, TIMEOUT_VARIABLE


def collective_timeout(timeout_s: float | None = None) -> float:
    """Seconds a watched collective waits: ``timeout_s``, else ``HP_DATA_COLLECTIVE_TIMEOUT``, else 300.

    Raises:
        DataConfigError: ``timeout_s`` or the environment variable is not a positive, finite number; names it.
    """
    return _timeout_and_setting(timeout_s)[0]


def group_ranks(group=None) -> list[int]:
    """The global ranks of ``group`` (None: the world), in group-rank order."""
    import torch.distributed as dist

    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def format_ranks(ranks: Iterable[int]) -> str:
    """``"rank 3"``, ``"ranks 0-2"`` or ``"ranks 0, 2, 5-7"``: sorted, with runs of consecutive ranks shortened."""
    ordered = sorted(set(ranks))
    runs: list[list[int]] = []
    for rank in ordered:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)
    return f"rank {text}" if len(ordered) == 1 else f"ranks {text}"


def _key(group_key: str, what: str, rank: int) -> str:
    return f"{_STORE_PREFIX}/{group_key}/{what}/{rank}"


def _arrive(store, group_key: str, what: str, rank: int, call: int) -> None:
    """Record that ``rank`` reached call number ``call``; a store that went away only costs the diagnosis."""
    if store is None:
        return
    try:
        store.set(_key(group_key, what, rank), str(call))
    except RuntimeError as error:
        logger.warning("could not record this rank's arrival at %s in the process group's store (%s)", what, error)


def _missing(store, group_key: str, what: str, ranks: list[int], call: int) -> list[int] | None:
    """The ranks whose recorded call count is below ``call``, or None when the store cannot say."""
    if store is None:
        return None
    missing = []
    try:
        for rank in ranks:
            key = _key(group_key, what, rank)
            if not store.check([key]) or int(store.get(key)) < call:
                missing.append(rank)
    except (RuntimeError, ValueError):
        return None
    return missing


def _completes(work, deadline: float, blocking: bool) -> bool:
    """Whether ``work`` completes before ``deadline`` (``time.monotonic()``): waited on with that timeout when
    ``blocking`` (gloo's work wakes its waiter at once, and stays issued after a timed-out wait), else polled."""
    if blocking:
        left = max(deadline - time.monotonic(), _SHORTEST_WAIT_S)
        with contextlib.suppress(RuntimeError):  # timed out, or failed: ``watched``'s own wait raises that again
            work.wait(timeout=timedelta(seconds=left))
        return work.is_completed()
    pause = 1e-4
    while not work.is_completed():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, _LONGEST_PAUSE_S)
    return True


def _timeout_message(what: str, ranks: list[int], missing: list[int] | None, timeout_s: float, setting: str) -> str:
    if missing is None:
        who = (
            "which ranks have not reached it is unknown (the process group's store cannot be read: its host, rank 0, "
            "may have exited)"
        )
    elif missing:
        verb = "has" if len(missing) == 1 else "have"
        who = (
            f"{format_ranks(missing)} {verb} not reached it: it hangs, or runs something else (see its log, or its "
            "stack with `py-spy dump --pid <pid>`)"
        )
    else:
        who = "every rank reached it, yet it did not complete (the network, or ranks issuing other collectives)"
    return (
        f"the collective {what!r} over {format_ranks(ranks)} did not complete within {timeout_s:g} s: {who}. If the "
        f"ranks are only slow, give {setting} more seconds than {timeout_s:g}"
    )


def watched(what: str, issue: Callable[[], object], *, group=None, timeout_s: float | None = None) -> None:
    """Issue a collective with ``issue()`` and wait for it, reporting the ranks that never reach it.

    Every rank of ``group`` calls ``watched`` with the same ``what`` for the same collective.

    Args:
        what: the collective's fixed name, for the messages and the arrival keys ("the scheduler config check").
        issue: issues the collective with ``async_op=True`` and returns its work.
        group: the process group it runs on; None for the world.
        timeout_s: seconds to wait; None for ``collective_timeout()``.

    Raises:
        CollectiveTimeout: the collective did not complete in time; names it, the group and the missing ranks.
        DataFileError: the collective failed (a rank left); names it.
        DataConfigError: a bad timeout (see ``collective_timeout``).
    """
    import torch.distributed as dist

    seconds, setting = _timeout_and_setting(timeout_s)
    ranks = group_ranks(group)
    group_key = hashlib.md5(",".join(map(str, ranks)).encode(), usedforsecurity=False).hexdigest()[:16]
    call = _calls[group_key, what] = _calls.get((group_key, what), 0) + 1
    store = default_store()
    _arrive(store, group_key, what, dist.get_rank(), call)
    work = issue()
    if work is None or not hasattr(work, "is_completed"):
        raise TypeError(f"the collective {what!r} was issued without async_op=True: watched needs its work")
    if not _completes(work, time.monotonic() + seconds, dist.get_backend(group) == "gloo"):
        missing = _missing(store, group_key, what, ranks, call)
        message = _timeout_message(what, ranks, missing, seconds, setting)
        raise CollectiveTimeout(message, what=what, ranks=ranks, missing=missing, timeout_s=seconds)
    try:
        work.wait()
    except RuntimeError as error:
        raise DataFileError(
            f"the collective {what!r} over {format_ranks(ranks)} failed ({error}): a rank left; see the other "
            "ranks' logs"
        ) from None
