"""Logging for ``hyper_parallel.data``: one logger tree, rank-aware switches, never sample text.

Owns: the ``hyper_parallel.data`` logger, ``enable_dataset_logging`` and ``brief_list`` (a list shortened for a log
line). Library code logs through ``get_logger(__name__)``; it never configures the root logger. What is logged at
which level is listed in docs/tools.md ("Logging").
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable

__all__ = ["brief_list", "enable_dataset_logging", "get_logger"]

_ROOT = "hyper_parallel.data"


def get_logger(name: str = _ROOT) -> logging.Logger:
    """The logger for a module of this package."""
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


def brief_list(values: Iterable, spec: str = "", limit: int = 8) -> str:
    """``[a, b, c]`` for a log line, each value formatted with ``spec``; past ``limit`` values, the first ``limit``
    and how many more, so that a blend of thousands of sources still logs one short line.

    Example: ``brief_list([0.25, 0.75], ".2f") == "[0.25, 0.75]"``; ``brief_list(range(10), limit=3) ==
    "[0, 1, 2, ... (7 more)]"``.
    """
    values = list(values)
    shown = ", ".join(format(value, spec) for value in values[:limit])
    more = f", ... ({len(values) - limit} more)" if len(values) > limit else ""
    return f"[{shown}{more}]"


def _current_rank() -> int:
    """The global rank of torch.distributed once initialised, else the launcher's environment, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for variable in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        if variable in os.environ:
            return int(os.environ[variable])
    return 0


def enable_dataset_logging(
    level: str | int = "info", ranks: tuple[int, ...] | None = (0,), rank: int | None = None
) -> None:
    """Send this package's logs at ``level`` to stderr on the given ranks (``None``: every rank).

    Args:
        level: ``debug``, ``info``, ``warn``/``warning`` or a logging level number.
        ranks: ranks that log; others are silenced.
        rank: this process's rank; when not given, torch.distributed's global rank once it is initialised, else
            ``RANK`` (or the SLURM/OpenMPI variables), else 0.
    """
    if isinstance(level, str):
        name = {"warn": "WARNING"}.get(level.lower(), level.upper())
        if not isinstance(logging.getLevelName(name), int):
            raise ValueError(f"unknown log level {level!r}; use debug, info, warn or error")
        level = logging.getLevelName(name)
    logger = logging.getLogger(_ROOT)
    this_rank = _current_rank() if rank is None else rank
    if ranks is not None and this_rank not in ranks:
        logger.setLevel(logging.CRITICAL + 1)
        return
    logger.setLevel(level)
    if not any(getattr(h, "_hyper_parallel_data", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank {this_rank}] %(levelname)s %(name)s: %(message)s"))
        handler._hyper_parallel_data = True
        logger.addHandler(handler)
    logger.propagate = False
