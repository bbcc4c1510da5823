"""One scenario suite run for every scheduler: Megatron-Core's packing-scheduler guarantees over random steps.

Each scheduler's class runs the same invariants (Grain's BasePackIterDatasetTest pattern) on seeded random steps:
lognormal and uniform lengths, DP 1..8, CP sizes powers of two and not, VPP groups, ``max_num_seqs`` and
``thd_max_packed_sequences``. Expectations are checked with plain loops, independent of the planner: every sequence
exactly once, each group's padded tokens within its ranks' capacity, aligned blocks tiling every position, a VPP
multiple of micro-batches, no micro-batch empty on every rank, no idle rank where the package docstring says none
may be, and determinism. Megatron's regression scenarios (tests/unit_tests/data/test_packed_schedule_regressions.py)
are ported where they apply: "Not enough samples to move" becomes a ``DataConfigError``, and dynamic CP leaves no
rank of a micro-batch empty.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.parallel.scheduling import PackingSchedulerConfig, Schedule, build_schedule

SEED = 20261202


def padded(length: int, size: int, pad: bool) -> int:
    """A sequence's tokens in a group of ``size`` ranks: up to ``2 * size`` with per-sequence padding."""
    return length + (-length % (2 * size) if pad and size > 1 else 0)


def draw_lengths(rng: np.random.Generator, count: int, cap: int, kind: str) -> np.ndarray:
    if kind == "lognormal":
        values = np.round(rng.lognormal(math.log(max(2, cap // 8)), 1.0, size=count))
    else:
        values = rng.integers(1, cap + 1, size=count)
    return np.clip(values, 1, cap).astype(np.int64)


class ScheduleGuarantees:
    """The invariants every scheduler keeps; subclasses name the scheduler and its grids."""

    scheduler = ""
    # (dp, cp, dynamic sizes or (), max_seqlen_per_dp_cp_rank)
    grids: list[tuple[int, int, tuple[int, ...], int]] = []
    steps = 1000

    def sizes(self, grid) -> tuple[int, ...]:
        dp, cp, dynamic, _ = grid
        return dynamic if dynamic else (cp,)

    def scenarios(self):
        """Seeded random steps: ``(config, lengths, grid, vpp_group)``."""
        rng = np.random.default_rng(SEED + len(self.scheduler))
        for index in range(self.steps):
            grid = self.grids[index % len(self.grids)]
            dp, cp, dynamic, max_seqlen = grid
            largest = max(self.sizes(grid))
            vpp_group = int(rng.choice([1, 1, 2, 3]))
            limits = {}
            if index % 5 == 1:
                limits["max_num_seqs"] = int(rng.integers(1, 6))
            if index % 5 == 2:
                limits["thd_max_packed_sequences"] = int(rng.integers(2, 7))
            cfg = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=max_seqlen, scheduler=self.scheduler, **limits)
            count = int(rng.integers(1, 12 * dp * cp))
            cap = max_seqlen * largest - 2 * largest
            kind = "lognormal" if index % 2 else "uniform"
            yield cfg, draw_lengths(rng, count, cap, kind), grid, vpp_group

    def plan(self, cfg, lengths, grid, vpp_group) -> Schedule:
        dp, cp, dynamic, _ = grid
        return build_schedule(
            cfg,
            lengths,
            layout=cfg.layout(cp_size=cp, tp_size=1),
            dp_size=dp,
            dynamic_cp_sizes=dynamic,
            vpp_group=vpp_group,
        )

    def ranks(self, grid) -> int:
        """The "ranks" of the guarantees: DP replicas for static CP, DP x CP positions for dynamic CP."""
        dp, cp, dynamic, _ = grid
        return dp * cp if dynamic else dp

    def test_invariants_over_random_steps(self):
        refused = 0
        for cfg, lengths, grid, vpp_group in self.scenarios():
            try:
                schedule = self.plan(cfg, lengths, grid, vpp_group)
            except DataConfigError as error:
                # only a VPP group the step cannot fill may be refused: fewer sequences than micro-batches
                message = str(error)
                assert "cannot fill its" in message and vpp_group > 1, error
                count = int(message.split("cannot fill its ")[1].split()[0])
                tokens = sum(padded(int(x), grid[1], True) for x in lengths)
                assert count % vpp_group == 0 and len(lengths) < count
                assert count >= math.ceil(tokens / (grid[0] * grid[1] * grid[3]))
                refused += 1
                continue
            self.check(schedule, cfg, lengths, grid, vpp_group)
            assert self.plan(cfg, lengths.copy(), grid, vpp_group) == schedule, "the same input, the same schedule"
        assert refused < self.steps // 10

    def check(self, schedule: Schedule, cfg, lengths, grid, vpp_group) -> None:
        dp, cp, dynamic, max_seqlen = grid
        positions, sizes, limit = dp * cp, self.sizes(grid), cfg.group_sequence_limit
        self.limit = limit
        seen = sorted(i for groups in schedule.micro_batches for group in groups for i in group.sequence_ids)
        assert seen == list(range(len(lengths))), "every sequence exactly once"
        assert schedule.num_micro_batches % vpp_group == 0, "a multiple of the VPP group"
        for groups in schedule.micro_batches:
            covered = []
            for group in groups:
                assert group.cp_size in sizes and group.first_position % group.cp_size == 0
                covered.extend(range(group.first_position, group.first_position + group.cp_size))
                tokens = sum(padded(int(x), group.cp_size, True) for x in lengths[list(group.sequence_ids)])
                local = max(1, math.ceil(tokens / group.cp_size))
                local += local % 2 if group.cp_size > 1 else 0
                assert local <= max_seqlen, "padded tokens per rank within the capacity"
                if limit is not None:
                    assert len(group.sequence_ids) <= limit
            assert covered == list(range(positions)), "aligned blocks tile every position: equal counts per rank"
            assert any(group.sequence_ids for group in groups), "no micro-batch is empty on every rank"
        self.check_idle(schedule, lengths, grid)

    def check_idle(self, schedule: Schedule, lengths, grid) -> None:
        """Static CP: a replica idles only when every group holds one sequence and S < M * dp."""
        groups = [group for groups in schedule.micro_batches for group in groups]
        if any(not group.sequence_ids for group in groups):
            assert all(len(group.sequence_ids) <= 1 for group in groups)
            assert len(lengths) < schedule.num_micro_batches * self.ranks(grid)


class TestDpBalanced(ScheduleGuarantees):
    scheduler = "dp_balanced"
    grids = [(1, 1, (), 512), (2, 2, (), 256), (4, 1, (), 300), (3, 2, (), 512), (8, 1, (), 128), (2, 3, (), 384)]


class TestComputeBalanced(ScheduleGuarantees):
    scheduler = "compute_balanced"
    grids = [(1, 1, (), 512), (2, 2, (), 256), (4, 1, (), 300), (3, 2, (), 512), (8, 1, (), 128), (2, 3, (), 384)]


class TestDynamicCP(ScheduleGuarantees):
    scheduler = "dynamic_cp"
    grids = [
        (4, 2, (1, 2, 4, 8), 256),
        (2, 2, (1, 2, 4), 512),
        (8, 1, (1, 2, 4, 8), 128),
        (2, 3, (1, 2, 6), 384),  # dp x cp = 6, not a power of two
        (2, 3, (1, 3, 6), 384),
        (1, 3, (1, 3), 256),  # cp 3
        (5, 1, (1,), 200),
    ]

    def check_idle(self, schedule: Schedule, lengths, grid) -> None:
        """An idle position only where no neighbour can grow over it, no group of two can give it a sequence,
        and the micro-batch does not fit one group of every position."""
        dp, cp, sizes, max_seqlen = grid
        positions = dp * cp
        least = {}
        for i, length in enumerate(lengths.tolist()):
            least[i] = next((c for c in sizes if padded(length, c, True) <= c * max_seqlen), sizes[-1])
        for groups in schedule.micro_batches:
            idle = {
                p for g in groups if not g.sequence_ids for p in range(g.first_position, g.first_position + g.cp_size)
            }
            if not idle:
                continue
            members = [i for g in groups for i in g.sequence_ids]
            limit = self.limit
            if sizes[-1] == positions and (limit is None or len(members) <= limit):
                tokens = sum(padded(int(lengths[i]), positions, True) for i in members)
                assert tokens > positions * max_seqlen, "the fallback would have made one group of every position"
            for donor in (g for gs in schedule.micro_batches for g in gs if len(g.sequence_ids) >= 2):
                for i in donor.sequence_ids:
                    for p in idle:
                        start = p - p % least[i]
                        assert not set(range(start, start + least[i])) <= idle, f"{i} of {donor} could fill {p}"

    def test_megatrons_random_trials_leave_no_rank_of_a_power_of_two_grid_idle(self):
        # Megatron's random trials: 2,304 micro-batches, 252 empty on every rank before; every rank busy now.
        rng = np.random.default_rng(SEED)
        cfg = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=1024, scheduler="dynamic_cp")
        busy = total = 0
        for _ in range(200):
            lengths = draw_lengths(rng, int(rng.integers(8, 64)), 8 * 1024 - 16, "lognormal")
            schedule = build_schedule(
                cfg, lengths, layout=cfg.layout(cp_size=2, tp_size=1), dp_size=4, dynamic_cp_sizes=(1, 2, 4, 8)
            )
            for groups in schedule.micro_batches:
                total += 1
                busy += all(group.sequence_ids for group in groups)
        assert total > 200 and busy == total


def test_dp_balanced_refuses_a_vpp_group_it_cannot_fill_like_megatron():
    # Megatron asserts "Not enough samples to move"; here one sequence cannot make two micro-batches.
    cfg = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=64, vpp_size=2, microbatch_group_size_per_vp_stage=2)
    with pytest.raises(DataConfigError, match="microbatch_group_size_per_vp_stage"):
        build_schedule(cfg, np.array([10]), layout=cfg.layout(cp_size=1, tp_size=1), dp_size=1, vpp_group=2)
    schedule = build_schedule(cfg, np.array([10, 10]), layout=cfg.layout(cp_size=1, tp_size=1), dp_size=1, vpp_group=2)
    assert [[g.sequence_ids for g in groups] for groups in schedule.micro_batches] == [[(0,)], [(1,)]]


def test_dynamic_cp_fills_a_vpp_group_by_splitting_groups():
    # four short sequences fit one micro-batch; a VPP group of 2 splits them so that neither is empty
    cfg = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=64, scheduler="dynamic_cp")
    lengths = np.array([10, 9, 8, 7])
    schedule = build_schedule(
        cfg, lengths, layout=cfg.layout(cp_size=1, tp_size=1), dp_size=2, dynamic_cp_sizes=(1, 2), vpp_group=2
    )
    assert schedule.num_micro_batches == 2
    assert all(group.sequence_ids for groups in schedule.micro_batches for group in groups)
    with pytest.raises(DataConfigError, match="cannot fill its 4 micro-batches"):
        build_schedule(
            cfg, lengths[:2], layout=cfg.layout(cp_size=1, tp_size=1), dp_size=2, vpp_group=4, dynamic_cp_sizes=(1, 2)
        )


def test_compute_balanced_moves_a_sequence_to_an_idle_replica():
    # two replicas, two micro-batches by tokens; LPT alone would leave replica 1's second micro-batch idle
    cfg = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=100, scheduler="compute_balanced")
    lengths = np.array([90, 60, 50, 40, 5, 5])
    schedule = build_schedule(cfg, lengths, layout=cfg.layout(cp_size=1, tp_size=1), dp_size=2)
    assert all(group.sequence_ids for groups in schedule.micro_batches for group in groups)


def test_thd_max_packed_sequences_reserves_the_dummy_slot():
    lengths = np.full(12, 3)
    for policy, per_group in (("append_dummy_seq", 3), ("extend_last", 4)):
        cfg = PackingSchedulerConfig(
            max_seqlen_per_dp_cp_rank=64, thd_max_packed_sequences=4, thd_tail_padding_policy=policy
        )
        assert cfg.group_sequence_limit == per_group
        schedule = build_schedule(cfg, lengths, layout=cfg.layout(cp_size=1, tp_size=1), dp_size=1)
        assert max(len(g.sequence_ids) for groups in schedule.micro_batches for g in groups) == per_group
    both = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=64, thd_max_packed_sequences=8, max_num_seqs=2)
    assert both.group_sequence_limit == 2


def test_contiguous_partition_without_per_sequence_padding_packs_real_tokens_only():
    cfg = PackingSchedulerConfig(
        max_seqlen_per_dp_cp_rank=8, cp_partition_mode="contiguous", pad_sequences_for_cp=False
    )
    # cp 2 gives 16 tokens per group: 5 + 5 + 6 fit exactly without padding; with padding to 4 they would not
    schedule = build_schedule(cfg, np.array([5, 5, 6]), layout=cfg.layout(cp_size=2, tp_size=1), dp_size=1)
    assert [[g.sequence_ids for g in groups] for groups in schedule.micro_batches] == [[(0, 1, 2)]]
    padded_cfg = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=8)
    schedule = build_schedule(
        padded_cfg, np.array([5, 5, 6]), layout=padded_cfg.layout(cp_size=2, tp_size=1), dp_size=1
    )
    assert schedule.num_micro_batches == 2
