"""Specification of ``enable_dataset_logging``: which ranks log, at which level, under real gloo ranks; a
``ParallelBatch`` shape log then appears on the chosen rank only."""

from __future__ import annotations

import logging
import os

import pytest
from batching.test_get_batch import EOD, indexed_batches
from command_runs import package_logger_kept

from hyper_parallel.data.batching import ParallelBatch
from hyper_parallel.data.dataset_logging import enable_dataset_logging, get_logger
from parallel.launch import grid_coordinates, launch
from parallel.test_get_batch import grid_context


@pytest.fixture
def package_logger():
    with package_logger_kept() as logger:
        yield logger


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


class _DebugRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.DEBUG:
            self.messages.append(record.getMessage())


def deliver_with_debug_logs(rank: int, world_size: int) -> dict:
    """CP2 x TP2: every rank enables debug logs for rank 0 (the default) and delivers three Indexed batches of 2
    rows of 16 tokens; the data ranks (TP rank 0) read them, their TP peers receive them."""
    for variable in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        os.environ.pop(variable, None)
    enable_dataset_logging("debug")
    debug = _DebugRecords()
    logging.getLogger("hyper_parallel.data").addHandler(debug)
    context = grid_context(rank, world_size, (1, 2, 2))
    get_batch = ParallelBatch("indexed", parallel_context=context, eod_token_id=EOD)
    iterator = iter(indexed_batches(rows=2, width=16, count=3)) if context.is_data_rank else None
    delivered = 0
    while True:
        try:
            get_batch(iterator)
        except StopIteration:
            return {"delivered": delivered, "debug": debug.messages}
        delivered += 1


def test_a_parallel_batch_shape_log_appears_on_rank_0_only(tmp_path):
    reports = launch(deliver_with_debug_logs, tmp_path, world_size=4)
    assert [report.get("error") for report in reports] == [None] * 4
    assert [report["value"]["delivered"] for report in reports] == [3] * 4
    by_rank = {report["rank"]: report for report in reports}
    # rank 0 is CP rank 0 and TP rank 0: its 8 columns of each 16-token row, its dense mask against all 16 keys
    assert grid_coordinates(0, 4, (1, 2, 2)) == (0, 0, 0)
    assert by_rank[0]["value"]["debug"] == [  # three batches of one shape: one line
        "get_batch first batch: input_ids int64[2, 8], labels int64[2, 8], position_ids int64[2, 8], attention_mask "
        "bool[2, 1, 8, 16], swa_mask None, packed_seq_params None; rows of 16 tokens, 8 columns on CP rank 0 of 2 "
        "(contiguous), TP rank 0 of 2"
    ]
    assert [message for _, message in by_rank[0]["logs"]] == [
        "ParallelBatch: dense attention, CP rank 0 of 2 (contiguous layout), TP rank 0 of 2, PP stage 0 of 1, plain "
        "delivery, reads the loader, on cpu"
    ]
    for rank in (1, 2, 3):
        assert by_rank[rank]["value"]["debug"] == [] and by_rank[rank]["logs"] == [], rank


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
