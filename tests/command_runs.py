"""Running a command's ``main`` in a test: its exit code and output, with the package logger put back as it was."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

__all__ = ["package_logger_kept", "run_command"]


@contextlib.contextmanager
def package_logger_kept() -> Iterator[logging.Logger]:
    """A command's ``main`` configures the package logger (own handler, no propagation); undo that on leaving, so
    that caplog keeps working."""
    logger = logging.getLogger("hyper_parallel.data")
    saved = logger.level, logger.propagate, list(logger.handlers)
    try:
        yield logger
    finally:
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
        logger.handlers[:] = saved[2]


def run_command(main: Callable[[list[str]], int], capsys, *argv) -> tuple[int, str, str]:
    """``main(argv)`` with every argument as text: ``(exit code, stdout, stderr)``."""
    with package_logger_kept():
        code = main([str(argument) for argument in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err
