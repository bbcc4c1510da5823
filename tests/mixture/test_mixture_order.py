"""The mixture's order as a pure function: the realised mix, positions without replay, the round robin, and what
happens when a source runs out. Expected values are counted here, sample by sample, or written out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.mixture.mixture_order import BLOCK, MixtureOrder, interleave_period


def order(weights, budgets=None, strategy="weighted", on_exhausted="stop", seed=7, num_samples=None):
    budgets = budgets if budgets is not None else [None] * len(weights)
    return MixtureOrder(
        weights, budgets, strategy=strategy, on_exhausted=on_exhausted, seed=seed, num_samples=num_samples
    )


def replayed_positions(sources: np.ndarray) -> np.ndarray:
    """Each sample's count among the earlier samples of its source, counted one by one."""
    seen: dict[int, int] = {}
    positions = []
    for source in sources.tolist():
        positions.append(seen.get(source, 0))
        seen[source] = seen.get(source, 0) + 1
    return np.array(positions)


@pytest.mark.parametrize("strategy", ["weighted", "interleave"])
def test_the_mix_over_ten_thousand_samples_is_within_one_percent_of_each_weight(strategy):
    weights = [0.5, 0.3, 0.2]
    sources, _ = order(weights, strategy=strategy, on_exhausted="restart", num_samples=10_000).plan(0, 10_000)
    shares = np.bincount(sources, minlength=3) / 10_000
    assert np.abs(shares - weights).max() < 0.01


def test_weights_of_any_scale_mix_as_their_ratio():
    sources, _ = order([5, 3, 2], on_exhausted="restart", num_samples=10_000).plan(0, 10_000)
    assert np.abs(np.bincount(sources) / 10_000 - [0.5, 0.3, 0.2]).max() < 0.01


def test_positions_count_the_earlier_samples_of_each_source_and_need_no_replay():
    planned = order([0.6, 0.4], on_exhausted="restart", num_samples=3 * BLOCK + 100)
    sources, positions = planned.plan(0, len(planned))
    assert np.array_equal(positions, replayed_positions(sources))
    # Any range, and any numbers in any order, plan as the whole does.
    middle = planned.plan(BLOCK - 5, 2 * BLOCK + 7)
    assert np.array_equal(middle[0], sources[BLOCK - 5 : 2 * BLOCK + 7])
    assert np.array_equal(middle[1], positions[BLOCK - 5 : 2 * BLOCK + 7])
    picked = np.random.default_rng(0).permutation(len(planned))[:500]
    at = planned.plan_at(picked)
    assert np.array_equal(at[0], sources[picked]) and np.array_equal(at[1], positions[picked])


def test_the_order_is_the_seeds():
    first = order([1, 1], on_exhausted="restart", num_samples=5000, seed=1).plan(0, 5000)[0]
    again = order([1, 1], on_exhausted="restart", num_samples=5000, seed=1).plan(0, 5000)[0]
    other = order([1, 1], on_exhausted="restart", num_samples=5000, seed=2).plan(0, 5000)[0]
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_interleave_is_the_smooth_weighted_round_robin():
    # nginx's smooth weighted round robin over a=5, b=1, c=1 picks a a b a c a a.
    assert interleave_period([5, 1, 1]).tolist() == [0, 0, 1, 0, 2, 0, 0]
    # 7 : 3, step by step: credits (7, 3) take 0; (4, 6) take 1; (11, -1) take 0; (8, 2) take 0; (5, 5), a tie,
    # take 0; (2, 8) take 1; (9, 1) take 0; (6, 4) take 0; (3, 7) take 1; (10, 0) take 0.
    assert interleave_period([0.7, 0.3]).tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]
    planned = order([2, 1], strategy="interleave", on_exhausted="restart", num_samples=9)
    assert planned.plan(0, 9)[0].tolist() == [0, 1, 0] * 3


def test_an_interleave_period_too_long_is_refused_with_the_fix():
    with pytest.raises(DataConfigError, match="round-robin period .* integer ratio"):
        interleave_period([40_000, 30_000, 1])


@pytest.mark.parametrize("strategy", ["weighted", "interleave"])
def test_stop_ends_the_mixture_after_the_first_source_s_last_sample(strategy):
    planned = order([1, 1], budgets=[100, 1000], strategy=strategy)
    sources, _ = planned.plan(0, len(planned))
    counts = np.bincount(sources, minlength=2)
    assert counts[0] == 100 and counts[1] < 1000
    assert sources[-1] == 0  # the mixture ends with source 0's last sample
    assert planned.exhausted_at == len(planned)


@pytest.mark.parametrize("strategy", ["weighted", "interleave"])
def test_reweight_goes_on_without_an_exhausted_source_until_every_source_is_spent(strategy):
    planned = order([1, 1, 2], budgets=[50, 3000, 400], strategy=strategy, on_exhausted="reweight")
    sources, _ = planned.plan(0, len(planned))
    assert len(planned) == 3450
    assert np.bincount(sources).tolist() == [50, 3000, 400]
    for spent in (0, 2):
        last = np.flatnonzero(sources == spent)[-1]
        assert (sources[last + 1 :] != spent).all()
    # Before source 0 ran out, sources 1 and 2 were drawn 1 : 2; after, the rest follows the renormalised weights.
    before = sources[: np.flatnonzero(sources == 0)[-1]]
    assert abs(np.mean(before[before > 0] == 2) - 2 / 3) < 0.15


def test_restart_never_removes_a_source_and_needs_num_samples():
    planned = order([1, 1], budgets=[10, 10], on_exhausted="restart", num_samples=5000)
    assert len(planned) == 5000 and planned.exhausted_at is None
    with pytest.raises(DataConfigError, match="no end.*set num_samples"):
        order([1, 1], budgets=[10, 10], on_exhausted="restart")


def test_num_samples_cuts_the_mixture_or_is_refused_past_where_the_sources_run_out():
    assert len(order([1, 1], budgets=[500, 500], num_samples=300)) == 300
    with pytest.raises(DataConfigError, match="run out after .* set on_exhausted: restart"):
        order([1, 1], budgets=[500, 500], num_samples=5000)
