"""Fixtures shared by the command tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def restore_package_logger():
    """``main`` configures the package logger (own handler, no propagation); undo that after the test."""
    logger = logging.getLogger("hyper_parallel.data")
    saved = logger.level, logger.propagate, list(logger.handlers)
    yield
    logger.setLevel(saved[0])
    logger.propagate = saved[1]
    logger.handlers[:] = saved[2]
