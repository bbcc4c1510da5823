"""Specification of the packing scheduler's pure half: settings, alignment, the three algorithms, statistics, packing.

Expected values come from hand-worked examples (Megatron-Core's DpBalanced examples), a plain-loop reference of the
order-preserving next-fit, and invariants checked over seeded long-tailed (lognormal) lengths: every sequence once,
aligned blocks covering every position, allowed CP sizes, capacity, micro-batch multiples and determinism.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hyper_parallel.data.batching.scheduled_packing import pack_group
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.parallel.data_schedule_utils import (
    SCHEDULERS,
    FlopsStats,
    PackingSchedulerConfig,
    Schedule,
    ScheduledGroup,
    build_schedule,
    schedule_compute_balanced,
    schedule_dp_balanced,
    schedule_dynamic_cp,
    schedule_stats,
    sequence_cost,
)
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout

SEED = 1234


def config(**kwargs) -> PackingSchedulerConfig:
    return PackingSchedulerConfig(**{"max_seqlen_per_dp_cp_rank": 64, **kwargs})


def plan(cfg, lengths, *, dp_size: int, cp_size: int, tp_size: int = 1, **kwargs) -> Schedule:
    """``build_schedule`` on the layout ``cfg`` implies for a grid of ``cp_size`` and ``tp_size``."""
    return build_schedule(cfg, lengths, layout=cfg.layout(cp_size=cp_size, tp_size=tp_size), dp_size=dp_size, **kwargs)


def stats_of(schedule, lengths, cfg):
    return schedule_stats(schedule, lengths, cfg, layout=cfg.layout(cp_size=1, tp_size=1))


def layout(cp: int = 1) -> DeliveryLayout:
    return DeliveryLayout(cp_size=cp, cp_layout="zigzag_thd")


def lognormal_lengths(count: int, seed: int, median: float = 300.0, sigma: float = 1.0, cap: int = 4096):
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, size=count)), 1, cap).astype(np.int64)


def id_lists(schedule: Schedule) -> list[list[list[int]]]:
    return [[list(group.sequence_ids) for group in groups] for groups in schedule.micro_batches]


def check_schedule(
    schedule: Schedule,
    lengths: np.ndarray,
    *,
    positions: int,
    sizes: tuple[int, ...],
    max_seqlen: int,
    alignment: int = 1,
    max_num_seqs: int | None = None,
) -> None:
    """The invariants every schedule holds, checked with plain loops."""
    seen = sorted(i for groups in schedule.micro_batches for group in groups for i in group.sequence_ids)
    assert seen == list(range(len(lengths))), "every sequence is scheduled exactly once"
    for groups in schedule.micro_batches:
        covered = []
        for group in groups:
            assert group.cp_size in sizes
            assert group.first_position % group.cp_size == 0
            covered.extend(range(group.first_position, group.first_position + group.cp_size))
            padded = sum(
                length + (-length % (2 * group.cp_size) if group.cp_size > 1 else 0)
                for length in lengths[list(group.sequence_ids)].tolist()
            )
            local = math.ceil(padded / group.cp_size)
            step = math.lcm(alignment, 2 if group.cp_size > 1 else 1)
            assert max(step, math.ceil(local / step) * step) <= max_seqlen, "the group's padded tokens fit its ranks"
            if max_num_seqs is not None:
                assert len(group.sequence_ids) <= max_num_seqs
        assert covered == list(range(positions)), "the blocks cover every position once, in order"


# -- settings -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_seqlen_per_dp_cp_rank": 0}, "max_seqlen_per_dp_cp_rank must be an integer >= 1"),
        ({"max_seqlen_per_dp_cp_rank": 8.5}, "max_seqlen_per_dp_cp_rank must be an integer"),
        ({"max_seqlen_per_dp_cp_rank": True}, "max_seqlen_per_dp_cp_rank must be an integer"),
        ({"scheduler": "dp_balance"}, "did you mean 'dp_balanced'"),
        ({"scheduler": "default_dynamic_cp"}, "use one of dp_balanced, dynamic_cp, compute_balanced"),
        ({"pad_packed_seq_alignment": "min"}, "pad_packed_seq_alignment is 'min'"),
        ({"pad_packed_seq_alignment": 0}, "pad_packed_seq_alignment must be an integer >= 1"),
        ({"pad_packed_seq_alignment": 2.0}, "pad_packed_seq_alignment must be an integer"),
        ({"pad_packed_seq_alignment": 128}, "pad_packed_seq_alignment 128 is above max_seqlen_per_dp_cp_rank 64"),
        ({"mxfp8": 1}, "mxfp8 must be true or false"),
        ({"sequence_parallel": "yes"}, "sequence_parallel must be true or false"),
        ({"deterministic_mode": None}, "deterministic_mode must be true or false"),
        ({"cuda_graphs": 0}, "cuda_graphs must be true or false"),
        ({"router_z_loss": "false"}, "router_z_loss must be true or false"),
        ({"vpp_size": 0}, "vpp_size must be an integer >= 1"),
        ({"microbatch_group_size_per_vp_stage": -1}, "microbatch_group_size_per_vp_stage must be an integer >= 1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
        ({"pad_token_id": -1}, "pad_token_id must be an integer >= 0"),
        ({"cost_linear": -1.0}, "cost_linear must be a finite number >= 0"),
        ({"cost_quadratic": float("nan")}, "cost_quadratic must be a finite number >= 0"),
        ({"cost_linear": "1"}, "cost_linear must be a number"),
        ({"cost_linear": 0, "cost_quadratic": 0}, "both 0"),
        ({"scheduler": "dynamic_cp", "deterministic_mode": True}, "dynamic_cp' cannot run with deterministic_mode"),
        (
            {"scheduler": "dynamic_cp", "cuda_graphs": True, "pad_packed_seq_alignment": "max"},
            "dynamic_cp' cannot run with cuda_graphs",
        ),
        ({"scheduler": "dynamic_cp", "router_z_loss": True}, "dynamic_cp' cannot run with router_z_loss"),
        ({"cuda_graphs": True}, "cuda_graphs=True needs fixed shapes"),
        ({"cuda_graphs": True, "pad_packed_seq_alignment": 32}, "set pad_packed_seq_alignment to 'max'"),
        ({"pad_sequences_for_cp": 0}, "pad_sequences_for_cp must be true or false"),
        ({"pad_sequences_for_cp": False}, "set cp_partition_mode='contiguous', or pad_sequences_for_cp=True"),
        ({"cp_partition_mode": "zigzg"}, "cp_partition_mode is 'zigzg' (did you mean 'zigzag'"),
        ({"thd_tail_padding_policy": "pad"}, "use one of append_dummy_seq, extend_last"),
        ({"thd_max_packed_sequences": 1}, "thd_max_packed_sequences must be an integer >= 2"),
        ({"thd_max_packed_sequences": 0, "thd_tail_padding_policy": "extend_last"}, "must be an integer >= 1"),
        ({"min_dynamic_context_parallel_size": 0}, "min_dynamic_context_parallel_size must be an integer >= 1"),
    ],
)
def test_config_rejects_each_bad_setting(kwargs, message):
    with pytest.raises(DataConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(**kwargs)


def test_min_dynamic_cp_size_is_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="use min_dynamic_context_parallel_size"):
        old = config(min_dynamic_cp_size=2)
    assert old.min_dynamic_context_parallel_size == 2 and old.min_dynamic_cp_size is None
    assert old == config(min_dynamic_context_parallel_size=2)
    with pytest.warns(DeprecationWarning):
        assert config(min_dynamic_cp_size=2, min_dynamic_context_parallel_size=2).min_dynamic_context_parallel_size == 2
    with pytest.raises(DataConfigError, match="min_dynamic_context_parallel_size is 4 but its deprecated alias"):
        config(min_dynamic_cp_size=2, min_dynamic_context_parallel_size=4)
    assert config().min_dynamic_context_parallel_size == 1


def test_config_accepts_the_documented_settings():
    for scheduler in SCHEDULERS:
        assert config(scheduler=scheduler).scheduler == scheduler
    for name in ("deterministic_mode", "cuda_graphs", "router_z_loss"):
        for scheduler in ("dp_balanced", "compute_balanced"):  # static packing keeps these
            assert getattr(config(scheduler=scheduler, pad_packed_seq_alignment="max", **{name: True}), name)
    assert config(cuda_graphs=True, pad_packed_seq_alignment=64).cuda_graphs  # == max_seqlen is fixed too
    assert config(pad_packed_seq_alignment=64, vpp_size=2, microbatch_group_size_per_vp_stage=4).vpp_size == 2
    assert config(cost_linear=0, cost_quadratic=2.5).cost_quadratic == 2.5
    assert config(cp_partition_mode="contiguous", pad_sequences_for_cp=False).pad_sequences_for_cp is False
    assert config(thd_tail_padding_policy="extend_last", thd_max_packed_sequences=1).group_sequence_limit == 1
    with pytest.raises(DataConfigError):
        config(max_seqlen_per_dp_cp_rank=None)


# -- the layout value ---------------------------------------------------------------------------------------------


def test_config_builds_the_layout_value_of_its_settings():
    cfg = config(max_seqlen_per_dp_cp_rank=4096, pad_packed_seq_alignment=8, sequence_parallel=True, mxfp8=True)
    assert cfg.layout(cp_size=2, tp_size=4) == DeliveryLayout(
        cp_size=2,
        cp_layout="zigzag_thd",
        tp_size=4,
        sequence_parallel=True,
        mxfp8=True,
        alignment=8,
        pad_sequences=True,
        max_seqlen_per_rank=4096,
    )
    plain = config(cp_partition_mode="contiguous", pad_sequences_for_cp=False).layout(cp_size=4, tp_size=1)
    assert (plain.cp_layout, plain.pad_sequences, plain.padded_lengths(np.array([5])).tolist()) == (
        "contiguous",
        False,
        [5],
    )
    assert config(cp_partition_mode="contiguous").layout(cp_size=2, tp_size=1).padded_lengths(
        np.array([5])
    ).tolist() == [8]


def test_capacity_rounds_down_to_the_layout_multiple_and_refuses_what_cannot_fit():
    # alignment 7: capacity 98 of 100, so two sequences of 49 share a rank but 50 and 49 do not
    cfg = config(max_seqlen_per_dp_cp_rank=100, pad_packed_seq_alignment=7)
    assert len(plan(cfg, np.array([49, 49]), dp_size=1, cp_size=1).micro_batches) == 1
    assert len(plan(cfg, np.array([50, 49]), dp_size=1, cp_size=1).micro_batches) == 2
    with pytest.raises(DataConfigError, match=r"max_seqlen_per_rank 16 is below the CP-local multiple 32"):
        plan(config(max_seqlen_per_dp_cp_rank=16, mxfp8=True), np.array([3]), dp_size=1, cp_size=1)
    odd = config(scheduler="dynamic_cp", max_seqlen_per_dp_cp_rank=101, pad_packed_seq_alignment="max")
    with pytest.raises(DataConfigError, match=r"not a multiple of the CP-local multiple 2 of CP size 2"):
        plan(odd, np.array([3]), dp_size=2, cp_size=1, dynamic_cp_sizes=(1, 2))


def test_sequence_cost():
    cost = sequence_cost(np.array([1, 10, 100000]), config(cost_linear=3.0, cost_quadratic=0.5))
    assert cost.dtype == np.float64
    assert cost.tolist() == [3.5, 80.0, 3.0 * 100000 + 0.5 * 1e10]


# -- dp_balanced --------------------------------------------------------------------------------------------------


def test_dp_balanced_reproduces_megatrons_worked_examples():
    lengths = np.array([6, 3, 5, 4, 2])
    two_replicas = schedule_dp_balanced(lengths, layout=layout(), dp_size=2, cp_sizes=(1,), capacity=10)
    assert id_lists(two_replicas) == [[[0, 1], [2]], [[4], [3]]]
    # dp 1, cp 2, 5 tokens per rank; lengths x4 so that zigzag padding (multiples of 4) changes nothing
    cp_two = schedule_dp_balanced(lengths * 4, layout=layout(2), dp_size=1, cp_sizes=(2,), capacity=20)
    assert id_lists(cp_two) == [[[0, 1]], [[2, 3]], [[4]]]
    assert {(group.first_position, group.cp_size) for groups in cp_two.micro_batches for group in groups} == {(0, 2)}
    assert [cp_two.group_at(m, 1).sequence_ids for m in range(3)] == [(0, 1), (2, 3), (4,)]
    vpp = schedule_dp_balanced(
        np.array([6, 3, 5, 4, 2, 1, 1]), layout=layout(), dp_size=2, cp_sizes=(1,), capacity=10, vpp_group=2
    )
    assert id_lists(vpp) == [[[0, 1], [2, 3]], [[4, 5], [6]]]


def test_build_schedule_dispatches_dp_balanced_with_the_vpp_multiple():
    lengths = np.array([6, 3, 5, 4, 2, 1, 1])
    cfg = config(max_seqlen_per_dp_cp_rank=10, vpp_size=2, microbatch_group_size_per_vp_stage=2)
    schedule = plan(cfg, lengths, dp_size=2, cp_size=1, tp_size=1, vpp_group=2)
    assert id_lists(schedule) == [[[0, 1], [2, 3]], [[4, 5], [6]]]


def next_fit_reference(lengths, limit, multiple, max_num_seqs=None):
    """B.3 written with plain loops: next-fit in order, then singletons split off the back."""
    bins, current, total = [], [], 0
    for index, length in enumerate(lengths):
        full = max_num_seqs is not None and len(current) == max_num_seqs
        if current and (total + length > limit or full):
            bins.append(current)
            current, total = [], 0
        current.append(index)
        total += length
    bins.append(current)
    index = len(bins) - 1
    while len(bins) % multiple and index >= 0:
        if len(bins[index]) > 1:
            bins.append([bins[index].pop()])
        else:
            index -= 1
    while len(bins) % multiple:
        bins.append([])
    return bins


@pytest.mark.parametrize(
    ("dp", "cp", "vpp_group", "max_num_seqs"), [(4, 2, 1, None), (2, 1, 2, None), (3, 2, 1, 8), (1, 4, 3, None)]
)
def test_dp_balanced_properties_on_long_tailed_lengths(dp, cp, vpp_group, max_num_seqs):
    cfg = config(max_seqlen_per_dp_cp_rank=4096, pad_packed_seq_alignment=16, max_num_seqs=max_num_seqs)
    for seed in range(5):
        lengths = lognormal_lengths(int(np.random.default_rng(seed).integers(1, 400)), SEED + seed)
        schedule = plan(cfg, lengths, dp_size=dp, cp_size=cp, tp_size=1, vpp_group=vpp_group)
        check_schedule(
            schedule,
            lengths,
            positions=dp * cp,
            sizes=(cp,),
            max_seqlen=4096,
            alignment=16,
            max_num_seqs=max_num_seqs,
        )
        assert schedule.num_micro_batches % vpp_group == 0
        for groups in schedule.micro_batches:
            assert [group.first_position for group in groups] == [d * cp for d in range(dp)]
        padded = [length + (-length % (2 * cp) if cp > 1 else 0) for length in lengths.tolist()]
        bins = [list(group.sequence_ids) for groups in schedule.micro_batches for group in groups]
        assert bins == next_fit_reference(padded, 4096 * cp, dp * vpp_group, max_num_seqs)
        assert plan(cfg, lengths, dp_size=dp, cp_size=cp, tp_size=1, vpp_group=vpp_group) == schedule


def test_dp_balanced_gives_every_dp_rank_work_when_sequences_are_few():
    schedule = plan(config(), np.array([5]), dp_size=4, cp_size=1, tp_size=1)
    assert id_lists(schedule) == [[[0], [], [], []]]
    schedule = plan(config(), np.array([5, 5]), dp_size=2, cp_size=2, tp_size=1, vpp_group=2)
    assert id_lists(schedule) == [[[0], []], [[1], []]]  # no micro-batch of padding only on every rank
    with pytest.raises(
        DataConfigError, match=r"cannot fill its 2 micro-batches: the VPP alignment needs a multiple of 2"
    ):
        plan(config(), np.array([5]), dp_size=2, cp_size=2, vpp_group=2)


# -- dynamic_cp ---------------------------------------------------------------------------------------------------


def position_costs(schedule: Schedule, lengths: np.ndarray, linear: float, quadratic: float) -> list[float]:
    """Each position's cost over the step, with plain loops: its groups' padded cost divided by their size."""
    totals = [0.0] * schedule.num_positions
    for groups in schedule.micro_batches:
        for group in groups:
            cost = 0.0
            for length in lengths[list(group.sequence_ids)].tolist():
                padded = length + (-length % (2 * group.cp_size) if group.cp_size > 1 else 0)
                cost += linear * padded + quadratic * padded * padded
            for position in range(group.first_position, group.first_position + group.cp_size):
                totals[position] += cost / group.cp_size
    return totals


def check_no_coverable_empty_position(schedule: Schedule, lengths: np.ndarray, sizes, max_seqlen: int) -> None:
    """No padding-only block sits where a neighbouring group could double over free positions and still fit."""
    for groups in schedule.micro_batches:
        empty = {
            p
            for group in groups
            if not group.sequence_ids
            for p in range(group.first_position, group.first_position + group.cp_size)
        }
        for group in groups:
            if not group.sequence_ids or 2 * group.cp_size not in sizes:
                continue
            larger = 2 * group.cp_size
            start = group.first_position - group.first_position % larger
            others = set(range(start, start + larger)) - set(
                range(group.first_position, group.first_position + group.cp_size)
            )
            padded = sum(length + -length % (2 * larger) for length in lengths[list(group.sequence_ids)].tolist())
            assert not (others <= empty and padded <= larger * max_seqlen), f"{group} could double over {others}"


DYNAMIC_CASES = [
    # dp, cp, sizes, max_seqlen, max_num_seqs, vpp_group
    (4, 2, (1, 2, 4, 8), 1024, None, 1),
    (2, 2, (1, 2, 4), 600, 6, 2),
    (8, 1, (2, 4, 8), 512, None, 1),
    (3, 2, (1, 2), 2048, None, 3),
]


@pytest.mark.parametrize(("dp", "cp", "sizes", "max_seqlen", "max_num_seqs", "vpp_group"), DYNAMIC_CASES)
def test_dynamic_cp_properties_on_long_tailed_lengths(dp, cp, sizes, max_seqlen, max_num_seqs, vpp_group):
    cfg = config(
        scheduler="dynamic_cp",
        max_seqlen_per_dp_cp_rank=max_seqlen,
        max_num_seqs=max_num_seqs,
        min_dynamic_context_parallel_size=sizes[0],
    )
    used = set()
    for seed in range(4):
        count = int(np.random.default_rng(seed).integers(1, 300))
        lengths = lognormal_lengths(count, SEED + seed, median=200, cap=max_seqlen * sizes[-1] - 2 * sizes[-1])
        schedule = plan(
            cfg, lengths, dp_size=dp, cp_size=cp, tp_size=1, dynamic_cp_sizes=(1, *sizes), vpp_group=vpp_group
        )
        check_schedule(
            schedule,
            lengths,
            positions=dp * cp,
            sizes=sizes,
            max_seqlen=max_seqlen,
            alignment=1,
            max_num_seqs=max_num_seqs,
        )
        assert schedule.num_micro_batches % vpp_group == 0
        check_no_coverable_empty_position(schedule, lengths, sizes, max_seqlen)
        used |= {group.cp_size for groups in schedule.micro_batches for group in groups if group.sequence_ids}
        again = plan(
            cfg, lengths.copy(), dp_size=dp, cp_size=cp, tp_size=1, dynamic_cp_sizes=(1, *sizes), vpp_group=vpp_group
        )
        assert again == schedule
    assert len(used) > 1, "long-tailed lengths use more than one CP size"


def test_dynamic_cp_on_megatrons_example_keeps_long_sequences_on_cp_groups():
    # B.4's example: 4 ranks of 4096 tokens. Upstream's greedy gives two micro-batches ({8000} CP2, {5000, 3000}
    # CP2; {2500} CP2, {1200, 900, 600} CP2); this scheduler balances the step's cost instead, so only the
    # invariants are checked: the two sequences longer than a rank get CP groups, and no rank is ever idle.
    lengths = np.array([8000, 5000, 3000, 2500, 1200, 900, 600])
    cfg = config(scheduler="dynamic_cp", max_seqlen_per_dp_cp_rank=4096)
    schedule = plan(cfg, lengths, dp_size=2, cp_size=2, tp_size=1, dynamic_cp_sizes=(1, 2, 4))
    check_schedule(schedule, lengths, positions=4, sizes=(1, 2, 4), max_seqlen=4096)
    size_of = {i: group.cp_size for groups in schedule.micro_batches for group in groups for i in group.sequence_ids}
    assert size_of[0] >= 2 and size_of[1] >= 2
    assert all(group.sequence_ids for groups in schedule.micro_batches for group in groups)


def test_dynamic_cp_spreads_a_dominant_sequence_to_balance_the_step():
    lengths = np.array([4000, *[100] * 40])  # the long one costs more than a rank's share of the step
    cfg = config(scheduler="dynamic_cp", max_seqlen_per_dp_cp_rank=4096, cost_linear=0.0, cost_quadratic=1.0)
    schedule = plan(cfg, lengths, dp_size=4, cp_size=1, tp_size=1, dynamic_cp_sizes=(1, 2, 4))
    size_of = {i: group.cp_size for groups in schedule.micro_batches for group in groups for i in group.sequence_ids}
    assert size_of[0] == 4
    costs = position_costs(schedule, lengths, 0.0, 1.0)
    assert max(costs) / (sum(costs) / len(costs)) < 1.05


def test_dynamic_cp_gives_every_rank_work_from_one_sequence():
    cfg = config(scheduler="dynamic_cp", max_seqlen_per_dp_cp_rank=64)
    schedule = plan(cfg, np.array([10]), dp_size=2, cp_size=2, tp_size=1, dynamic_cp_sizes=(1, 2, 4))
    assert id_lists(schedule) == [[[0]]] and schedule.micro_batches[0][0].cp_size == 4


def test_dynamic_cp_settings_errors():
    cfg = config(scheduler="dynamic_cp", max_seqlen_per_dp_cp_rank=100)
    lengths = np.array([50, 790])
    with pytest.raises(DataConfigError) as error:
        plan(cfg, lengths, dp_size=2, cp_size=2, tp_size=1, dynamic_cp_sizes=(1, 2, 4))
    message = str(error.value)
    assert "sequence 1 of the global batch (length 790, padded to 792 for CP size 4)" in message
    assert "max_seqlen_per_dp_cp_rank to at least 198" in message and "larger dynamic CP sizes" in message
    plan(cfg, lengths, dp_size=4, cp_size=2, tp_size=1, dynamic_cp_sizes=(1, 2, 4, 8))  # 8 ranks hold it
    with pytest.raises(DataConfigError, match="has no dynamic CP size to use"):
        plan(cfg, lengths[:1], dp_size=2, cp_size=2, tp_size=1)
    with pytest.raises(DataConfigError, match="has no dynamic CP size to use"):
        plan(
            config(scheduler="dynamic_cp", min_dynamic_context_parallel_size=8),
            lengths[:1],
            dp_size=2,
            cp_size=2,
            tp_size=1,
            dynamic_cp_sizes=(1, 2, 4),
        )
    with pytest.raises(DataConfigError, match="dynamic CP size 3 does not divide the 4"):
        plan(cfg, lengths[:1], dp_size=2, cp_size=2, tp_size=1, dynamic_cp_sizes=(1, 3))
    with pytest.raises(DataConfigError, match="do not nest: 3 is not a multiple of 2"):
        plan(cfg, lengths[:1], dp_size=3, cp_size=2, tp_size=1, dynamic_cp_sizes=(2, 3))


def test_schedule_dynamic_cp_directly_uses_only_the_given_sizes():
    lengths = lognormal_lengths(200, SEED, median=100, cap=1000)
    schedule = schedule_dynamic_cp(
        lengths, layout=layout(), dp_size=4, cp_sizes=(2, 4), capacity=256, vpp_group=2, cost=lambda x: x**2.0
    )
    check_schedule(schedule, lengths, positions=4, sizes=(2, 4), max_seqlen=256)
    assert schedule.num_micro_batches % 2 == 0


# -- compute_balanced -----------------------------------------------------------------------------------------------


def test_compute_balanced_balances_long_tailed_costs_better_than_dp_balanced():
    lengths = lognormal_lengths(3000, SEED, median=1500, cap=60000)
    imbalance = {}
    for scheduler in ("dp_balanced", "compute_balanced"):
        cfg = config(scheduler=scheduler, max_seqlen_per_dp_cp_rank=65536)
        schedule = plan(cfg, lengths, dp_size=4, cp_size=2, tp_size=1)
        check_schedule(schedule, lengths, positions=8, sizes=(2,), max_seqlen=65536)
        costs = position_costs(schedule, lengths, 24576.0, 1.0)
        imbalance[scheduler] = max(costs) / (sum(costs) / len(costs))
        assert stats_of(schedule, lengths, cfg).imbalance == pytest.approx(imbalance[scheduler])
    assert imbalance["compute_balanced"] <= 1.05
    assert imbalance["compute_balanced"] < imbalance["dp_balanced"] - 0.01


@pytest.mark.parametrize(("dp", "cp", "vpp_group", "max_num_seqs"), [(4, 2, 1, None), (3, 1, 2, 5), (2, 4, 1, None)])
def test_compute_balanced_properties_on_long_tailed_lengths(dp, cp, vpp_group, max_num_seqs):
    cfg = config(scheduler="compute_balanced", max_seqlen_per_dp_cp_rank=2048, max_num_seqs=max_num_seqs)
    for seed in range(4):
        lengths = lognormal_lengths(int(np.random.default_rng(seed).integers(1, 400)), SEED + seed, cap=2048 * cp - 8)
        schedule = plan(cfg, lengths, dp_size=dp, cp_size=cp, tp_size=1, vpp_group=vpp_group)
        check_schedule(schedule, lengths, positions=dp * cp, sizes=(cp,), max_seqlen=2048, max_num_seqs=max_num_seqs)
        assert schedule.num_micro_batches % vpp_group == 0
        for groups in schedule.micro_batches:
            assert [group.first_position for group in groups] == [d * cp for d in range(dp)]
        assert plan(cfg, lengths, dp_size=dp, cp_size=cp, tp_size=1, vpp_group=vpp_group) == schedule
        # the fewest micro-batches that hold the padded tokens, unless the greedy had to add some
        padded = sum(length + (-length % (2 * cp) if cp > 1 else 0) for length in lengths.tolist())
        assert schedule.num_micro_batches >= math.ceil(padded / (dp * cp * 2048))


def test_schedule_compute_balanced_puts_the_heaviest_sequences_on_different_replicas():
    lengths = np.array([1, 9, 8, 2, 7, 3])
    schedule = schedule_compute_balanced(
        lengths, layout=layout(), dp_size=3, cp_sizes=(1,), capacity=10, cost=lambda x: x.astype(float)
    )
    # LPT: 9 -> r0, 8 -> r1, 7 -> r2, 3 -> r2 (7), 2 -> r1 (8), 1 -> r0 (9): every replica costs 10, one micro-batch
    assert id_lists(schedule) == [[[1, 0], [2, 3], [4, 5]]]


# -- the dispatcher's errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_an_empty_global_batch_is_a_data_error(scheduler):
    with pytest.raises(DataFileError, match="the global batch holds no sequence"):
        plan(config(scheduler=scheduler), np.zeros(0, np.int64), dp_size=2, cp_size=1, tp_size=1)
    with pytest.raises(DataFileError, match="sequence 1 of the global batch has length 0"):
        plan(config(scheduler=scheduler), np.array([3, 0]), dp_size=2, cp_size=1, tp_size=1)


@pytest.mark.parametrize("scheduler", ["dp_balanced", "compute_balanced"])
def test_a_static_oversize_sequence_names_itself_and_the_setting(scheduler):
    cfg = config(max_seqlen_per_dp_cp_rank=10, scheduler=scheduler)
    # cp 2: 20 tokens per group; length 19 pads to 20 and fits, 21 pads to 24 and does not
    plan(cfg, np.array([19, 3]), dp_size=1, cp_size=2, tp_size=1)
    with pytest.raises(DataConfigError) as error:
        plan(cfg, np.array([3, 21, 4]), dp_size=1, cp_size=2, tp_size=1)
    message = str(error.value)
    assert "sequence 1 of the global batch (length 21, padded to 24" in message
    assert "raise max_seqlen_per_dp_cp_rank to at least 12" in message


def test_dispatcher_rejects_bad_sizes():
    with pytest.raises(DataConfigError, match="dp_size must be an integer >= 1"):
        plan(config(), np.array([3]), dp_size=0, cp_size=1, tp_size=1)
    with pytest.raises(DataConfigError, match="config must be a PackingSchedulerConfig"):
        build_schedule({"max_seqlen_per_dp_cp_rank": 8}, np.array([3]), layout=layout(), dp_size=1)
    with pytest.raises(DataFileError, match="1-D integer"):
        plan(config(), np.array([3.5]), dp_size=1, cp_size=1, tp_size=1)


# -- the schedule ---------------------------------------------------------------------------------------------------


def test_schedule_refuses_blocks_that_do_not_tile_the_positions():
    with pytest.raises(ValueError, match="not the aligned block"):
        Schedule(((ScheduledGroup(0, 1, (0,)), ScheduledGroup(1, 2, (1,)), ScheduledGroup(3, 1, ())),))
    with pytest.raises(ValueError, match="different numbers of positions"):
        Schedule(((ScheduledGroup(0, 2, (0,)),), (ScheduledGroup(0, 4, (1,)),)))
    schedule = Schedule(((ScheduledGroup(0, 2, (0,)), ScheduledGroup(2, 1, ()), ScheduledGroup(3, 1, (1,))),))
    assert schedule.num_positions == 4
    assert schedule.group_at(0, 1) == ScheduledGroup(0, 2, (0,))
    with pytest.raises(IndexError):
        schedule.group_at(0, 4)


# -- statistics ---------------------------------------------------------------------------------------------------


def test_schedule_stats_of_a_hand_worked_schedule():
    lengths = np.array([6, 3, 5, 4, 2])
    cfg = config(max_seqlen_per_dp_cp_rank=10)
    schedule = plan(cfg, lengths, dp_size=2, cp_size=1, tp_size=1)  # [[0,1],[2]], [[4],[3]]
    stats = stats_of(schedule, lengths, cfg)
    cost = {length: 24576.0 * length + length**2 for length in range(7)}
    rank0, rank1 = cost[6] + cost[3] + cost[2], cost[5] + cost[4]
    assert stats == FlopsStats(2, 20.0, 90.0, 20, 20, 1.0, rank0, (rank0 + rank1) / 2)
    assert stats.imbalance == pytest.approx(rank0 / ((rank0 + rank1) / 2))


def test_schedule_stats_counts_padding_and_alignment():
    # cp 2, alignment 4: lengths 5 and 2 pad to 8 and 4 (12 tokens, 6 per rank, aligned to 8): 16 scheduled
    cfg = config(max_seqlen_per_dp_cp_rank=16, pad_packed_seq_alignment=4, cost_linear=1.0, cost_quadratic=0.0)
    schedule = Schedule(((ScheduledGroup(0, 2, (0, 1)), ScheduledGroup(2, 2, ())),))
    stats = stats_of(schedule, np.array([5, 2]), cfg)
    assert stats.seqlen_sum == 12.0 and stats.seqlen_squared_sum == 80.0
    assert stats.valid_tokens == 7
    assert stats.scheduled_tokens == 2 * 8 + 2 * 4  # the empty group holds one alignment per rank
    assert stats.packing_efficiency == pytest.approx(7 / 24)
    assert stats.max_rank_cost == 6.0 and stats.mean_rank_cost == 3.0 and stats.imbalance == 2.0
    fixed = config(max_seqlen_per_dp_cp_rank=16, pad_packed_seq_alignment="max")
    assert stats_of(schedule, np.array([5, 2]), fixed).scheduled_tokens == 4 * 16


def test_flops_stats_travel_as_a_float64_tensor():
    stats = FlopsStats(3, 12.0, 80.0, 7, 24, 7 / 24, 6.0, 3.0)
    tensor = stats.as_tensor()
    assert tensor.dtype == torch.float64 and tensor.shape == (8,)
    back = FlopsStats.from_tensor(tensor)
    assert back == stats and isinstance(back.num_micro_batches, int) and isinstance(back.valid_tokens, int)
    assert FlopsStats(1, 0.0, 0.0, 0, 0, 0.0, 0.0, 0.0).imbalance == 1.0
    with pytest.raises(ValueError, match="needs 8 values"):
        FlopsStats.from_tensor(torch.zeros(7))


# -- packing ------------------------------------------------------------------------------------------------------


def sequence(start: int, length: int, masked: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(start, start + length, dtype=torch.int64)
    labels = ids + 1000
    labels[:masked] = IGNORE_INDEX
    return ids, labels


def test_pack_group_pads_each_sequence_and_fills_the_row_with_a_masked_tail():
    batch = pack_group([sequence(10, 3, masked=1), sequence(20, 2)], cp_size=2, local_length=6, pad_token_id=7)
    p = IGNORE_INDEX
    assert batch.input_ids.tolist() == [[10, 11, 12, 7, 20, 21, 7, 7, 7, 7, 7, 7]]
    assert batch.labels.tolist() == [[p, 1011, 1012, p, 1020, 1021, p, p, p, p, p, p]]
    assert batch.cu_seq_lens.dtype == torch.int32 and batch.cu_seq_lens.tolist() == [0, 4, 8, 12]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0]]
    assert batch.extras["local_cp_size"].dtype == torch.int64 and batch.extras["local_cp_size"].tolist() == [2]


def test_pack_group_without_cp_padding_and_with_an_exact_fill():
    batch = pack_group([sequence(0, 3), sequence(5, 2)], cp_size=1, local_length=5, pad_token_id=0)
    assert batch.input_ids.tolist() == [[0, 1, 2, 5, 6]] and batch.cu_seq_lens.tolist() == [0, 3, 5]
    batch = pack_group([sequence(0, 3)], cp_size=4, local_length=4, pad_token_id=0)  # 3 -> 8, P = 16
    assert batch.cu_seq_lens.tolist() == [0, 8, 16] and batch.input_ids.shape == (1, 16)


def test_pack_group_of_padding_only_and_its_errors():
    empty = pack_group([], cp_size=2, local_length=4, pad_token_id=3)
    assert empty.input_ids.tolist() == [[3] * 8] and empty.cu_seq_lens.tolist() == [0, 8]
    assert empty.trained_tokens == 0 and empty.extras["local_cp_size"].tolist() == [2]
    assert pack_group([sequence(0, 5)], cp_size=2, local_length=4, pad_token_id=0).num_sequences == 1  # 5 -> 8
    with pytest.raises(DataConfigError, match="more than the 8 of its row"):
        pack_group([sequence(0, 5), sequence(0, 1)], cp_size=2, local_length=4, pad_token_id=0)
    with pytest.raises(DataConfigError, match="use an even local_length"):
        pack_group([sequence(0, 2)], cp_size=2, local_length=3, pad_token_id=0)
    with pytest.raises(DataFileError, match="labels"):
        pack_group([(torch.arange(3), torch.arange(2))], cp_size=1, local_length=4, pad_token_id=0)
