"""Our dynamic_cp schedule against Megatron-LM's published dynamic-CP rule (``benchmarks/megatron_dynamic_cp.py``).

The reference's expected groups are worked out by hand from the rule's description (module docstring of
``benchmarks.megatron_dynamic_cp``); the side-by-side tests run the benchmark's seeded lognormal steps through both.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from benchmarks.bench_schedule import MEGATRON_CAPACITY, SEED, megatron_lengths, megatron_reference, ours_dynamic_cp
from benchmarks.megatron_dynamic_cp import (
    ReferenceGroup,
    check_reference_schedule,
    megatron_dynamic_cp,
    schedule_quality,
)


def _groups(*triples):
    return tuple(ReferenceGroup(first, size, ids) for first, size, ids in triples)


@pytest.mark.parametrize(
    ("lengths", "ranks", "expected"),
    [
        # 16 needs cp 2 (cost 256 / 2 = 128 per rank; cap 1.05 * 16 * 8). The first 4 cannot join (20 > 16 tokens);
        # opening cp 1 (cost 16) and cp 2 (cost 8) both leave the maximum at 128, so the first candidate, cp 1 on
        # rank 2, wins. The second 4 joins it (again a tie at 128, and joining is tried before opening). Rank 3 is
        # empty, so the cp-1 group grows to cp 2.
        ([16, 4, 4], 4, [_groups((0, 2, (0,)), (2, 2, (1, 2)))]),
        # The third 8 has no room (both ranks full, no free rank): it waits, and alone grows to cp 2.
        ([8, 8, 8], 2, [_groups((0, 1, (0,)), (1, 1, (1,))), _groups((0, 2, (2,)))]),
        # Opening on a free rank (cost 16) beats joining rank 0 (32): one sequence per rank.
        ([4, 4, 4], 3, [_groups((0, 1, (0,)), (1, 1, (1,)), (2, 1, (2,)))]),
        # cp 2 leaves rank 2 empty and cannot grow to 4 within 3 ranks: one full 3-rank group.
        ([16], 3, [_groups((0, 3, (0,)))]),
    ],
)
def test_reference_follows_the_described_rule(lengths, ranks, expected):
    micro_batches = megatron_dynamic_cp(np.array(lengths), ranks=ranks, max_seqlen_per_rank=8)
    assert micro_batches == expected
    check_reference_schedule(micro_batches, np.array(lengths), ranks=ranks, max_seqlen_per_rank=8)


@pytest.mark.parametrize("ranks", [4, 8, 12, 64])
def test_reference_keeps_its_invariants_on_lognormal_steps(ranks):
    for step in range(3):
        lengths = megatron_lengths(ranks, SEED + step)
        micro_batches = megatron_dynamic_cp(lengths, ranks=ranks, max_seqlen_per_rank=MEGATRON_CAPACITY)
        check_reference_schedule(micro_batches, lengths, ranks=ranks, max_seqlen_per_rank=MEGATRON_CAPACITY)
        for groups in micro_batches:
            for group in groups:
                assert group.sequence_ids, f"Megatron's rule leaves no rank empty, got {group}"
                real = int(lengths[list(group.sequence_ids)].sum())
                assert real <= MEGATRON_CAPACITY * group.cp_size


def test_reference_checker_catches_broken_schedules():
    lengths = np.array([16, 4, 4])
    good = megatron_dynamic_cp(lengths, ranks=4, max_seqlen_per_rank=8)
    duplicated = [(*good[0][:1], dataclasses.replace(good[0][1], sequence_ids=(1, 1)))]
    over = [_groups((0, 1, (0,)), (1, 3, (1, 2)))]
    short = [good[0][:1]]
    for broken in (duplicated, over, short):
        with pytest.raises(AssertionError):
            check_reference_schedule(broken, lengths, ranks=4, max_seqlen_per_rank=8)


def test_schedule_quality_counts_cost_per_rank_and_empty_groups():
    lengths = np.array([8, 2, 4])
    micro_batches = [_groups((0, 2, (0,)), (2, 1, (1, 2)), (3, 1, ())), _groups((0, 4, ()))]
    quality = schedule_quality(micro_batches, lengths, ranks=4)
    # Rank costs: ranks 0-1 carry 64 / 2 = 32, rank 2 carries 4 + 16 = 20, rank 3 nothing.
    assert quality.max_rank_cost == 32.0
    assert quality.mean_rank_cost == (32 + 32 + 20) / 4
    assert quality.critical_path == 32.0
    assert (quality.num_micro_batches, quality.num_groups) == (2, 4)
    assert (quality.empty_groups, quality.empty_micro_batches) == (2, 1)


@pytest.mark.parametrize("ranks", [4, 8, 12, 64])
def test_ours_is_at_least_as_good_as_megatrons_rule(ranks):
    """The benchmark's goals: the mean over the steps of max/mean rank cost, and never more empty groups or
    micro-batches in any step."""
    ours_imbalance, reference_imbalance = [], []
    for step in range(3):
        lengths = megatron_lengths(ranks, SEED + 100 * ranks + step)
        ours, reference = ours_dynamic_cp(lengths, ranks), megatron_reference(lengths, ranks)
        assert ours.mean_rank_cost == pytest.approx(reference.mean_rank_cost)  # the same sequences, all placed
        assert ours.empty_groups <= reference.empty_groups, (step, ours, reference)
        assert ours.empty_micro_batches <= reference.empty_micro_batches, (step, ours, reference)
        ours_imbalance.append(ours.imbalance)
        reference_imbalance.append(reference.imbalance)
    assert np.mean(ours_imbalance) <= np.mean(reference_imbalance), (ours_imbalance, reference_imbalance)
