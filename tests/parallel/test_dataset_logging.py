"""Specification of ``enable_dataset_logging``: which ranks log, at which level, under real gloo ranks."""

from __future__ import annotations

import logging
import os

import pytest

from hyper_parallel.data.dataset_logging import enable_dataset_logging, get_logger
from parallel.launch import launch


@pytest.fixture
def package_logger():
    logger = logging.getLogger("hyper_parallel.data")
    saved = logger.level, logger.propagate, list(logger.handlers)
    yield logger
    logger.setLevel(saved[0])
    logger.propagate = saved[1]
    logger.handlers[:] = saved[2]


def log_on_chosen_ranks(rank: int, world_size: int) -> dict:
    """Every rank enables logging for ranks 1 and 3 at info, with no rank variable in the environment: the rank
    must come from torch.distributed."""
    for variable in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        os.environ.pop(variable, None)
    enable_dataset_logging("info", ranks=(1, 3))
    get_logger(__name__).info("dataset built on rank %d", rank)
    get_logger(__name__).debug("below the level on rank %d", rank)
    return {"level": logging.getLogger("hyper_parallel.data").level}


def test_only_the_chosen_ranks_log_under_gloo(tmp_path):
    reports = launch(log_on_chosen_ranks, tmp_path, world_size=4)
    assert [report.get("error") for report in reports] == [None] * 4
    for report in reports:
        messages = [message for _, message in report["logs"]]
        chosen = report["rank"] in (1, 3)
        assert messages == ([f"dataset built on rank {report['rank']}"] if chosen else [])
        assert (report["value"]["level"] == logging.INFO) is chosen


@pytest.mark.parametrize(("level", "expected"), [("debug", logging.DEBUG), ("warn", logging.WARNING), (40, 40)])
def test_levels_by_name_or_number(package_logger, level, expected):
    enable_dataset_logging(level, ranks=None)
    assert package_logger.level == expected and not package_logger.propagate


def test_an_unknown_level_is_refused(package_logger):
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        enable_dataset_logging("loud")


def test_ranks_none_logs_everywhere_and_other_ranks_are_silenced(package_logger):
    enable_dataset_logging("info", ranks=None, rank=5)
    assert package_logger.isEnabledFor(logging.INFO)
    enable_dataset_logging("info", ranks=(0,), rank=5)
    assert not package_logger.isEnabledFor(logging.CRITICAL)
