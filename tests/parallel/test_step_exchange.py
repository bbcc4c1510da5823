"""Specification of ``step_exchange``: the packing scheduler's step header and sequence exchange on real gloo ranks.

Three ranks gather a header and tensors of uneven widths (one rank contributes nothing); the expectations are
written out here from how each rank builds its part. A rank that stops before the step header (it sleeps far past
a 2 s ``HP_DATA_COLLECTIVE_TIMEOUT``) makes the others' ``exchange_sequences`` raise ``CollectiveTimeout`` naming
the step header and that rank; it then joins, so that the header the others issued completes and every process
exits after one plain barrier (rank 0, which hosts the store, is never the late one). No assertion is on times.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch
import torch.distributed as dist

from hyper_parallel.data.batching.scheduled_packing import FetchedStep, exchange_sequences
from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.parallel.collective_watch import TIMEOUT_VARIABLE
from hyper_parallel.data.parallel.data_schedule_utils import PackingSchedulerConfig
from hyper_parallel.data.parallel.step_exchange import all_gather_parts, gather_step_headers
from parallel.launch import launch

WORLD_SIZE = 3
WIDTHS = [2, 0, 3]  # rank 1 has nothing to send
TIMEOUT_S = 2.0
LATE_S = TIMEOUT_S + 2.5  # how much later than the others the late rank reaches the step header


def _part(rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``[2, WIDTHS[rank]]`` part: ``10 * rank + k`` and its negation."""
    row = torch.arange(WIDTHS[rank], dtype=torch.int64) + 10 * rank
    return torch.stack([row, -row])


def gather_both(rank: int, world_size: int) -> dict:
    del world_size
    header = torch.tensor([rank, 100 + rank, -rank], dtype=torch.int64)
    headers = gather_step_headers(header, group=None, size=WORLD_SIZE)
    exchanged = torch.cat(all_gather_parts(_part(rank), WIDTHS, group=None), dim=1)
    return {"headers": headers.tolist(), "exchanged": exchanged.tolist()}


def test_headers_stack_by_rank_and_uneven_parts_concatenate_in_rank_order(tmp_path):
    reports = launch(gather_both, tmp_path, WORLD_SIZE)

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    for report in reports:
        assert report["value"] == {
            "headers": [[0, 100, 0], [1, 101, -1], [2, 102, -2]],
            "exchanged": [[0, 1, 20, 21, 22], [0, -1, -20, -21, -22]],
        }


def test_a_group_of_one_rank_gathers_without_a_process_group():
    header = torch.tensor([4, 5], dtype=torch.int64)
    assert gather_step_headers(header, group=None, size=1).tolist() == [[4, 5]]
    part = torch.tensor([[1, 2, 3]])
    assert torch.cat(all_gather_parts(part, [3], group=None), dim=1).tolist() == [[1, 2, 3]]


def _one_sequence(rank: int) -> FetchedStep:
    tokens = torch.full((4,), rank + 1, dtype=torch.int64)
    return FetchedStep(1, tokens, tokens, np.array([4], np.int64))


def one_rank_stops_before_the_header(rank: int, world_size: int, late: int) -> dict:
    """Every rank runs one step's exchange; ``late`` sleeps far past the timeout first, then joins with a failure
    of its own (so it makes no further collective), and all meet at a plain barrier before exiting."""
    config = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=64)
    fetched: FetchedStep | BaseException = _one_sequence(rank)
    if rank == late:
        time.sleep(LATE_S)
        fetched = DataFileError("the late rank's own failure")
    found: dict = {}
    try:
        exchange_sequences(fetched, config=config, num_microbatches=1, domain_group=None, domain_size=world_size,
                           dp_group=None, dp_size=world_size, position=rank, cp_size=1)  # fmt: skip
    except DataFileError as error:
        found = {"type": type(error).__name__, "message": str(error), "missing": getattr(error, "missing", None)}
    dist.barrier()  # rank 0 hosts the store: it stays until the others are done with it
    return found


def test_a_rank_that_stops_before_the_step_header_is_named_by_the_others(tmp_path, monkeypatch):
    monkeypatch.setenv(TIMEOUT_VARIABLE, str(TIMEOUT_S))
    late = 2
    reports = launch(functools.partial(one_rank_stops_before_the_header, late=late), tmp_path, WORLD_SIZE)

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    expected = (
        'the collective "the packing scheduler\'s step header" over ranks 0-2 did not complete within 2 s: rank 2 '
        "has not reached it: it hangs, or runs something else (see its log, or its stack with `py-spy dump --pid "
        f"<pid>`). If the ranks are only slow, give {TIMEOUT_VARIABLE} more seconds than 2"
    )
    for report in reports:
        if report["rank"] == late:
            assert report["value"]["message"] == "the late rank's own failure"
        else:
            assert report["value"] == {"type": "CollectiveTimeout", "message": expected, "missing": [late]}
