"""Specification of ``check_ranks_agree``: ranks given different settings all raise the same error, naming them;
and of ``gather_rank_numbers``, every rank's few integers in rank order.

The digest is checked in this process. The comparisons run in real gloo processes started by ``parallel.launch``:
four ranks compare the settings of a small pipeline, one or more of them changed on some ranks. Every expected
message is written out here by hand, and the test checks that every rank raised exactly that text.
"""

from __future__ import annotations

import copy
import functools
import time

import pytest
import torch.distributed as dist

from hyper_parallel.data.parallel.collective_watch import TIMEOUT_VARIABLE
from hyper_parallel.data.parallel.rank_agreement import check_ranks_agree, gather_rank_numbers, settings_digest
from parallel.launch import launch

WORLD_SIZE = 4
WHAT = "the batch-shaping settings"
FIX = (
    ". Every rank must shape the same batches: give every rank the same config, arguments and environment (the same "
    "YAML and overrides on every node)"
)
SETTINGS = {
    "dataset": {"data_config": {"split": "90,8,2", "seq_length": 256, "random_seed": 1234}, "source_type": "indexed"},
    "collate_fn": {"pad_to": None, "cp_layout": "zigzag"},
    "get_batch": {"seq_length": 256, "options": {"micro_batch_size": 2, "cp_sizes": [1, 2]}},
    "packing_scheduler": {"scheduler": "dp_balanced", "max_seqlen_per_dp_cp_rank": 4096, "extra": None},
}


def _changed(changes: dict[str, dict]) -> dict:
    """SETTINGS with ``{"node.field[.sub]": value}`` set (or removed, for the value ``"<absent>"``)."""
    settings = copy.deepcopy(SETTINGS)
    for path, value in changes.items():
        *parents, name = path.split(".")
        node = settings
        for parent in parents:
            node = node.setdefault(parent, {})
        if value == "<absent>":
            del node[name]
        else:
            node[name] = value
    return settings


def compare(rank: int, world_size: int, changes: dict, group_ranks: list[list[int]] | None = None) -> None:
    """Compare SETTINGS, changed on the ranks ``changes`` names (as text keys: JSON), over the world or a subgroup."""
    del world_size
    group = None
    for ranks in group_ranks or []:  # every rank creates every group, in the same order
        created = dist.new_group(ranks)
        group = created if rank in ranks else group
    check_ranks_agree(_changed(changes.get(str(rank), {})), group=group, what=WHAT)


def _errors(reports: list[dict]) -> list:
    return [report.get("error") for report in reports]


# -- in this process ----------------------------------------------------------------------------------------------


def test_the_digest_ignores_key_order_and_container_kinds_but_not_values():
    reordered = {node: dict(reversed(fields.items())) for node, fields in reversed(SETTINGS.items())}
    as_tuple = _changed({"get_batch.options.cp_sizes": (1, 2)})
    assert settings_digest(reordered) == settings_digest(SETTINGS) == settings_digest(as_tuple)
    assert settings_digest({"a": {"s": {3, 1, 2}}}) == settings_digest({"a": {"s": [1, 2, 3]}})
    assert settings_digest(_changed({"get_batch.seq_length": 512})) != settings_digest(SETTINGS)
    assert settings_digest(_changed({"collate_fn.pad_to": 0})) != settings_digest(SETTINGS)  # None is not 0


def test_without_a_process_group_it_returns_at_once_but_still_checks_its_argument():
    assert not dist.is_initialized()
    check_ranks_agree(SETTINGS, what=WHAT)
    with pytest.raises(TypeError, match="a mapping from node names to mappings of their fields"):
        check_ranks_agree({"get_batch": 256}, what=WHAT)


def test_without_a_process_group_there_are_no_numbers_to_gather():
    assert not dist.is_initialized()
    assert gather_rank_numbers((1, 2), what="the test's numbers") is None


# -- on real ranks ------------------------------------------------------------------------------------------------


def test_ranks_with_equal_settings_go_on(tmp_path):
    reports = launch(functools.partial(compare, changes={}), tmp_path, WORLD_SIZE)

    assert _errors(reports) == [None] * WORLD_SIZE


def test_one_rank_of_four_with_another_seq_length_makes_all_four_raise_the_same_error(tmp_path):
    reports = launch(functools.partial(compare, changes={"3": {"get_batch.seq_length": 512}}), tmp_path, WORLD_SIZE)

    message = f"the ranks disagree on {WHAT}: get_batch.seq_length: ranks 0-2 have 256, rank 3 has 512{FIX}"
    assert _errors(reports) == [{"type": "DataConfigError", "message": message}] * WORLD_SIZE


def test_nested_none_and_absent_values_are_named_field_by_field(tmp_path):
    changes = {
        "1": {"dataset.data_config.split": "98,2,0"},
        "2": {"collate_fn.pad_to": 64},
        "3": {"packing_scheduler.extra": "<absent>"},
    }
    reports = launch(functools.partial(compare, changes=changes), tmp_path, WORLD_SIZE)

    message = (
        f"the ranks disagree on {WHAT}: collate_fn.pad_to: ranks 0-1, 3 have None, rank 2 has 64; "
        "dataset.data_config.split: ranks 0, 2-3 have '90,8,2', rank 1 has '98,2,0'; "
        f"packing_scheduler.extra: ranks 0-2 have None, rank 3 has (absent){FIX}"
    )
    assert _errors(reports) == [{"type": "DataConfigError", "message": message}] * WORLD_SIZE


def test_many_differing_fields_are_capped_at_five_with_a_count_of_the_rest(tmp_path):
    changes = {"1": {f"dataloader.option_{i}": i for i in range(8)}}
    reports = launch(functools.partial(compare, changes=changes), tmp_path, WORLD_SIZE)

    shown = "; ".join(f"dataloader.option_{i}: ranks 0, 2-3 have (absent), rank 1 has {i}" for i in range(5))
    message = f"the ranks disagree on {WHAT}: {shown}; and 3 more fields differ{FIX}"
    assert _errors(reports) == [{"type": "DataConfigError", "message": message}] * WORLD_SIZE


def test_a_subgroup_compares_its_own_ranks_only_and_names_their_global_ranks(tmp_path):
    worker = functools.partial(compare, changes={"2": {"get_batch.seq_length": 512}}, group_ranks=[[0, 2], [1, 3]])
    reports = launch(worker, tmp_path, WORLD_SIZE)

    message = f"the ranks disagree on {WHAT}: get_batch.seq_length: rank 0 has 256, rank 2 has 512{FIX}"
    error = {"type": "DataConfigError", "message": message}
    assert _errors(reports) == [error, None, error, None]


def join_late(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(4.5)  # far past the 2 s timeout
    compare(rank, world_size, changes={})


def test_a_rank_that_joins_far_too_late_is_named_by_the_others(tmp_path, monkeypatch):
    monkeypatch.setenv(TIMEOUT_VARIABLE, "2")
    reports = launch(join_late, tmp_path, WORLD_SIZE)

    errors = _errors(reports)
    assert errors[1] is None  # the others had issued their part; its gather completed and all agreed
    for error in (errors[0], errors[2], errors[3]):
        assert error["type"] == "CollectiveTimeout"
        assert error["message"].startswith(
            f"the collective '{WHAT} (digests)' over ranks 0-3 did not complete within 2 s: rank 1 has not reached it"
        )


def numbers_of_rank(rank: int, world_size: int) -> list[list[int]]:
    del world_size
    return gather_rank_numbers((rank, 10 * rank, 2**40 + rank), what="the test's numbers")


def test_every_rank_gathers_every_rank_s_numbers_in_rank_order(tmp_path):
    reports = launch(numbers_of_rank, tmp_path, WORLD_SIZE)
    expected = [[rank, 10 * rank, 2**40 + rank] for rank in range(WORLD_SIZE)]
    assert [report.get("value") for report in reports] == [expected] * WORLD_SIZE
