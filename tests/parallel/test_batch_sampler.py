"""Specification of the DP-aware batch sampler: layout, coverage, invariance under DP changes, exact resumption.

Expected batches come from a reference written with plain loops over the epoch order (identity for ``single``,
``default_rng([seed, epoch]).permutation`` for ``cyclic``), independent of the sampler's own arithmetic.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hyper_parallel.data.errors import DataConfigError, DataFileError, ResumeStateError
from hyper_parallel.data.parallel.batch_sampler import (
    SAMPLER_TYPES,
    BatchLayout,
    DatasetBatchSampler,
    SamplerOptions,
    cyclic_order,
    epoch_length,
    rank_batch_positions,
    sharded_bucket,
)

SEED = 1234


def make(**kwargs) -> DatasetBatchSampler:
    return DatasetBatchSampler(**kwargs)


def reference_order(total, sampler_type, seed=SEED, epoch=0):
    if sampler_type == "single":
        return list(range(total))
    return np.random.default_rng([seed, epoch]).permutation(total).tolist()


def reference_rank_batches(total, mbs, dp, gbs, drop_last, sampler_type, rank, seed=SEED, epoch=0):
    """Rank ``rank``'s batches of one epoch, built position by position."""
    order = reference_order(total, sampler_type, seed, epoch)
    length = total - total % gbs if drop_last else total
    batches, step = [], 0
    while step * mbs * dp < length:
        batch = [
            order[p] for p in range(step * mbs * dp + rank * mbs, step * mbs * dp + (rank + 1) * mbs) if p < length
        ]
        if batch:
            batches.append(batch)
        step += 1
    return batches


def all_rank_batches(**kwargs):
    """One epoch of batches for every rank, keyed by rank."""
    dp = kwargs.get("dp_world_size", 1)
    return [list(make(dp_rank=rank, **kwargs)) for rank in range(dp)]


def global_batches(per_rank, mbs, dp, gbs):
    """Concatenate the ranks' micro-batches, step-major then rank, and cut them into global batches."""
    steps = max(len(batches) for batches in per_rank)
    flat = []
    for step in range(steps):
        for rank in range(dp):
            if step < len(per_rank[rank]):
                flat += per_rank[rank][step]
    return [flat[i : i + gbs] for i in range(0, len(flat), gbs)]


# (total, mbs, dp, gbs) layouts, including ones where the epoch ends mid global batch and mid micro-step.
LAYOUTS = [
    (1, 1, 1, 1),
    (10, 2, 2, 4),
    (17, 2, 2, 8),
    (23, 3, 2, 6),
    (24, 1, 4, 8),
    (31, 2, 3, 12),
    (40, 4, 1, 8),
    (50, 1, 1, 7),
    (64, 2, 4, 16),
    (9, 1, 4, 8),
]


def _valid(total, gbs, drop_last):
    return not drop_last or total >= gbs


@pytest.mark.parametrize("sampler_type", ["single", "cyclic"])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("total", "mbs", "dp", "gbs"), LAYOUTS)
def test_layout_matches_reference(total, mbs, dp, gbs, drop_last, sampler_type):
    if not _valid(total, gbs, drop_last):
        pytest.skip("an epoch shorter than one global batch is refused (see test_constructor_errors)")
    kwargs = dict(total_samples=total, micro_batch_size=mbs, global_batch_size=gbs, dp_world_size=dp)
    for rank in range(dp):
        sampler = make(dp_rank=rank, drop_last=drop_last, sampler_type=sampler_type, **kwargs)
        expected = reference_rank_batches(total, mbs, dp, gbs, drop_last, sampler_type, rank)
        assert len(sampler) == len(expected)
        got = list(sampler)
        assert got == expected
        assert all(type(i) is int for batch in got for i in batch)


@pytest.mark.parametrize("sampler_type", ["single", "cyclic"])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("total", "mbs", "dp", "gbs"), LAYOUTS)
def test_micro_steps_are_split_disjointly_and_epochs_covered_once(total, mbs, dp, gbs, drop_last, sampler_type):
    if not _valid(total, gbs, drop_last):
        pytest.skip("refused layout")
    per_rank = all_rank_batches(
        total_samples=total,
        micro_batch_size=mbs,
        global_batch_size=gbs,
        dp_world_size=dp,
        drop_last=drop_last,
        sampler_type=sampler_type,
    )
    order = reference_order(total, sampler_type)
    length = total - total % gbs if drop_last else total
    for step in range(max(len(b) for b in per_rank)):
        shards = [per_rank[r][step] for r in range(dp) if step < len(per_rank[r])]
        union = [i for shard in shards for i in shard]
        assert len(union) == len(set(union))
        assert union == order[step * mbs * dp : min((step + 1) * mbs * dp, length)]
        assert all(len(shard) == mbs for shard in shards[:-1])
    everything = sorted(i for batches in per_rank for batch in batches for i in batch)
    assert everything == sorted(order[:length])
    if drop_last:
        assert len(everything) % gbs == 0
        assert len({len(b) for b in per_rank}) == 1  # every rank takes part in every step


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("sampler_type", ["single", "cyclic"])
@pytest.mark.parametrize(("total", "gbs"), [(48, 8), (53, 8), (100, 24), (30, 12)])
def test_global_batches_do_not_depend_on_the_layout(total, gbs, sampler_type, drop_last):
    order = reference_order(total, sampler_type)
    length = total - total % gbs if drop_last else total
    expected = [order[i : min(i + gbs, length)] for i in range(0, length, gbs)]
    layouts = [(mbs, dp) for mbs in (1, 2, 3, 4, 8) for dp in (1, 2, 3, 4, 8) if gbs % (mbs * dp) == 0]
    assert len(layouts) >= 4
    for mbs, dp in layouts:
        per_rank = all_rank_batches(
            total_samples=total,
            micro_batch_size=mbs,
            global_batch_size=gbs,
            dp_world_size=dp,
            drop_last=drop_last,
            sampler_type=sampler_type,
        )
        assert global_batches(per_rank, mbs, dp, gbs) == expected, (mbs, dp)


def test_cyclic_orders_are_seeded_and_change_every_epoch():
    kwargs = dict(total_samples=100, micro_batch_size=4, global_batch_size=8, dp_world_size=2, sampler_type="cyclic")
    first = [list(make(dp_rank=r, **kwargs)) for r in range(2)]
    assert first == [list(make(dp_rank=r, **kwargs)) for r in range(2)]
    assert first != [list(make(dp_rank=r, seed=SEED + 1, **kwargs)) for r in range(2)]
    sampler = make(dp_rank=0, **kwargs)
    epochs = [list(sampler) for _ in range(3)]
    assert epochs[0] == first[0]
    assert epochs[0] != epochs[1] != epochs[2]
    for epoch, batches in enumerate(epochs):
        assert batches == reference_rank_batches(100, 4, 2, 8, True, "cyclic", 0, epoch=epoch)
        assert list(make(dp_rank=0, epoch=epoch, **kwargs)) == batches
    for total in (1, 7, 1000):
        assert (cyclic_order(total, seed=3, epoch=2) == np.random.default_rng([3, 2]).permutation(total)).all()


def test_single_order_repeats_every_epoch():
    sampler = make(total_samples=12, micro_batch_size=3, dp_world_size=2, dp_rank=1)
    assert list(sampler) == [[3, 4, 5], [9, 10, 11]]
    assert list(sampler) == [[3, 4, 5], [9, 10, 11]]
    assert sampler.epoch == 2
    assert sampler._order_cache is None  # no order array is ever built for ``single``


def test_single_positions_are_computed_not_materialised():
    assert rank_batch_positions(3, micro_batch_size=4, dp_rank=1, dp_world_size=2, epoch_len=10**12) == range(28, 32)
    assert rank_batch_positions(1, micro_batch_size=4, dp_rank=1, dp_world_size=2, epoch_len=10) == range(10, 10)
    assert rank_batch_positions(1, micro_batch_size=4, dp_rank=0, dp_world_size=2, epoch_len=10) == range(8, 10)
    huge = make(total_samples=10**12, micro_batch_size=2, dp_world_size=4, dp_rank=3, consumed_samples=8 * 10**10)
    assert next(iter(huge)) == [8 * 10**10 + 6, 8 * 10**10 + 7]
    assert len(huge) == (10**12 - 8 * 10**10) // 8 - 1


def test_cyclic_order_is_cached_once_per_epoch_in_int32():
    sampler = make(total_samples=50, micro_batch_size=5, sampler_type="cyclic")
    iterator = iter(sampler)
    next(iterator)
    cached = sampler._order_cache[1]
    assert cached.dtype == np.int32
    next(iterator)
    assert sampler._order_cache[1] is cached
    list(iterator)
    next(iter(sampler))
    assert sampler._order_cache[0] == 1 and sampler._order_cache[1] is not cached


# -- data sharding ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("total", "mbs", "dp", "gbs"), [(40, 2, 2, 8), (45, 2, 2, 8), (37, 3, 3, 9), (20, 1, 4, 4)])
def test_data_sharding_buckets(total, mbs, dp, gbs, drop_last):
    kwargs = dict(
        total_samples=total,
        micro_batch_size=mbs,
        global_batch_size=gbs,
        dp_world_size=dp,
        drop_last=drop_last,
        sampler_type="cyclic",
        data_sharding=True,
    )
    per_rank = all_rank_batches(**kwargs)
    length = total - total % gbs if drop_last else total
    size, extra = divmod(length, dp)
    begin = 0
    for rank, batches in enumerate(per_rank):
        flat = [i for batch in batches for i in batch]
        end = begin + size + (rank < extra)
        assert sorted(flat) == list(range(begin, end))  # a contiguous bucket of the dataset
        expected = (np.arange(begin, end)[np.random.default_rng([SEED, 0, rank]).permutation(end - begin)]).tolist()
        assert flat == expected
        assert all(len(batch) == mbs for batch in batches[:-1])
        begin = end
    assert begin == length
    if drop_last:
        assert len({len(b) for b in per_rank}) == 1
    sampler = make(dp_rank=0, **kwargs)
    list(sampler)
    assert list(sampler) != per_rank[0]  # a new bucket order in the next epoch
    assert sharded_bucket(length, dp_rank=0, dp_world_size=dp, seed=SEED, epoch=1).tolist() == [
        i for batch in list(make(dp_rank=0, epoch=1, **kwargs)) for i in batch
    ]


# -- position, len, set_epoch -------------------------------------------------------------------------------------


def test_state_advances_before_each_batch_is_yielded():
    sampler = make(total_samples=22, micro_batch_size=2, global_batch_size=4, dp_world_size=2, dp_rank=0)
    iterator = iter(sampler)
    assert len(sampler) == 5
    seen = []
    for expected_consumed in (4, 8, 12, 16):
        seen.append(next(iterator))
        assert (sampler.epoch, sampler.consumed_samples) == (0, expected_consumed)
        assert sampler.state_dict()["consumed_samples"] == expected_consumed
        assert len(sampler) == 5 - len(seen)
    next(iterator)  # the last batch: the position after it is the start of the next epoch
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["consumed_samples"] == 0
    with pytest.raises(StopIteration):
        next(iterator)
    assert len(sampler) == 5  # epoch 1 of 20 positions (2 dropped): 5 micro-steps
    assert list(sampler) == [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]]


def test_len_counts_this_ranks_batches_without_drop_last():
    # 13 samples, mbs 2, dp 4: the final micro-step [8, 13) gives rank 0 two, rank 1 two, rank 2 one, rank 3 none.
    kwargs = dict(total_samples=13, micro_batch_size=2, dp_world_size=4, drop_last=False)
    lengths = [len(make(dp_rank=r, **kwargs)) for r in range(4)]
    assert lengths == [2, 2, 2, 1]
    assert [len(list(make(dp_rank=r, **kwargs))) for r in range(4)] == lengths
    rank3 = make(dp_rank=3, consumed_samples=8, **kwargs)
    assert len(rank3) == 0 and list(rank3) == [] and rank3.epoch == 1
    assert make(dp_rank=2, **kwargs).batch_indices(1) == [12]


def test_set_epoch():
    sampler = make(total_samples=16, micro_batch_size=2, dp_world_size=2, dp_rank=0, sampler_type="cyclic")
    iterator = iter(sampler)
    next(iterator)
    sampler.set_epoch(0)  # the current epoch: the position is kept
    assert sampler.consumed_samples == 4
    assert list(iter(sampler)) == reference_rank_batches(16, 2, 2, 4, True, "cyclic", 0)[1:]
    sampler.set_epoch(5)
    assert (sampler.epoch, sampler.consumed_samples) == (5, 0)
    assert list(sampler) == reference_rank_batches(16, 2, 2, 4, True, "cyclic", 0, epoch=5)
    sampler.set_epoch(2)
    assert (sampler.epoch, sampler.consumed_samples) == (2, 0)
    with pytest.raises(DataConfigError):
        sampler.set_epoch(-1)


def test_a_new_iterator_ends_the_previous_one():
    sampler = make(total_samples=12, micro_batch_size=2)
    old = iter(sampler)
    assert next(old) == [0, 1]
    new = iter(sampler)
    assert next(new) == [2, 3]
    assert list(old) == []
    assert sampler.consumed_samples == 4
    sampler.load_state_dict({**sampler.state_dict(), "consumed_samples": 0})
    assert list(new) == []
    assert list(sampler)[0] == [0, 1]


def test_consumed_at_the_epoch_end_starts_the_next_epoch():
    sampler = make(total_samples=10, micro_batch_size=2, global_batch_size=4, consumed_samples=8, epoch=3)
    assert (sampler.epoch, sampler.consumed_samples) == (4, 0)
    assert len(sampler) == 4


def test_dataloader_integration():
    dataset = torch.arange(100, 200)
    sampler = make(total_samples=100, micro_batch_size=4, global_batch_size=16, dp_world_size=2, dp_rank=1)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    batches = [batch.tolist() for batch in loader]
    assert len(batches) == 12
    assert batches[0] == [104, 105, 106, 107] and batches[1] == [112, 113, 114, 115]


# -- resumption ---------------------------------------------------------------------------------------------------

CYCLIC = {"sampler_type": "cyclic"}
SHARDED = {"sampler_type": "cyclic", "data_sharding": True}
RESUME_CASES = [
    dict(total_samples=37, micro_batch_size=2, global_batch_size=8, dp_world_size=2),
    dict(total_samples=37, micro_batch_size=2, global_batch_size=8, dp_world_size=2, drop_last=False),
    dict(total_samples=37, micro_batch_size=3, global_batch_size=9, dp_world_size=3, **CYCLIC),
    dict(total_samples=29, micro_batch_size=1, global_batch_size=4, dp_world_size=4, **CYCLIC),
    dict(total_samples=29, micro_batch_size=1, global_batch_size=4, dp_world_size=4, drop_last=False, **CYCLIC),
    dict(total_samples=40, micro_batch_size=2, global_batch_size=8, dp_world_size=2, **SHARDED),
    dict(total_samples=43, micro_batch_size=2, global_batch_size=4, dp_world_size=2, drop_last=False, **SHARDED),
    dict(total_samples=30, micro_batch_size=2, global_batch_size=4, data_rearrange_map=np.arange(90, 0, -3) // 3 - 1),
]


@pytest.mark.parametrize("case", RESUME_CASES, ids=range(len(RESUME_CASES)))
def test_resume_continues_exactly(case):
    """Stop after k batches (into the second epoch too), restore the state in a new sampler: same batches."""
    for rank in range(case.get("dp_world_size", 1)):
        uninterrupted = make(dp_rank=rank, **case)
        expected = list(uninterrupted) + list(uninterrupted)  # epochs 0 and 1
        for k in range(len(expected) + 1):
            running = make(dp_rank=rank, **case)
            iterator = iter(running)
            done = []
            while len(done) < k:
                batch = next(iterator, None)
                if batch is None:  # end of epoch 0: the next iterator yields epoch 1
                    iterator = iter(running)
                else:
                    done.append(batch)
            resumed = make(dp_rank=rank, **case)
            resumed.load_state_dict(running.state_dict())
            rest = []
            while resumed.epoch < 2:
                rest += list(resumed)
            assert done + rest == expected, (rank, k)


def _run_global_steps(layout, steps, **common):
    """Every rank of ``layout`` consumes ``steps`` optimizer steps; returns rank 0's state."""
    mbs, dp = layout
    states = []
    for rank in range(dp):
        sampler = make(micro_batch_size=mbs, dp_world_size=dp, dp_rank=rank, **common)
        iterator = iter(sampler)
        for _ in range(steps * common["global_batch_size"] // (mbs * dp)):
            next(iterator)
        states.append(sampler.state_dict())
    assert all(
        (s["epoch"], s["consumed_samples"]) == (states[0]["epoch"], states[0]["consumed_samples"]) for s in states
    )
    return states[0]


@pytest.mark.parametrize("sampler_type", ["single", "cyclic"])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("old", "new"), [((2, 2), (2, 4)), ((2, 4), (8, 1)), ((1, 8), (4, 2)), ((4, 2), (1, 1))])
def test_elastic_resume_at_a_step_boundary(old, new, drop_last, sampler_type):
    common = dict(total_samples=61, global_batch_size=16, drop_last=drop_last, sampler_type=sampler_type)
    order = reference_order(61, sampler_type)
    length = 48 if drop_last else 61
    expected = [order[i : min(i + 16, length)] for i in range(0, length, 16)]
    for steps in (0, 1, 2):
        state = _run_global_steps(old, steps, **common)
        assert state["consumed_samples"] == 16 * steps
        mbs, dp = new
        per_rank = []
        for rank in range(dp):
            sampler = make(micro_batch_size=mbs, dp_world_size=dp, dp_rank=rank, **common)
            sampler.load_state_dict(state)
            per_rank.append(list(sampler))
        assert global_batches(per_rank, mbs, dp, 16) == expected[steps:]


def test_elastic_resume_across_the_epoch_end():
    common = dict(total_samples=50, global_batch_size=16, drop_last=False, sampler_type="cyclic")
    old = make(micro_batch_size=2, dp_world_size=2, dp_rank=0, **common)
    list(old)
    state = old.state_dict()
    assert (state["epoch"], state["consumed_samples"]) == (1, 0)
    new = make(micro_batch_size=4, dp_world_size=4, dp_rank=0, **common)
    new.load_state_dict(state)
    assert list(new) == reference_rank_batches(50, 4, 4, 16, False, "cyclic", 0, epoch=1)
    # a state saved at the epoch end itself (a multiple of nothing in particular) is also a boundary
    new.load_state_dict({**state, "epoch": 0, "consumed_samples": 50, "dp_world_size": 5, "micro_batch_size": 1})
    assert (new.epoch, new.consumed_samples) == (1, 0)


def test_data_sharding_resumes_with_another_micro_batch_size_at_a_step_boundary():
    common = dict(total_samples=64, global_batch_size=16, sampler_type="cyclic", data_sharding=True)
    expected = [list(make(micro_batch_size=8, dp_world_size=2, dp_rank=r, **common)) for r in range(2)]
    state = _run_global_steps((2, 2), 1, **common)
    for rank in range(2):
        resumed = make(micro_batch_size=8, dp_world_size=2, dp_rank=rank, **common)
        resumed.load_state_dict(state)
        assert list(resumed) == expected[rank][1:]


BASE = dict(total_samples=40, micro_batch_size=2, global_batch_size=8, dp_world_size=2, sampler_type="cyclic")


def _state(**changes):
    sampler = make(**BASE)
    iterator = iter(sampler)
    next(iterator)
    return {**sampler.state_dict(), **changes}


@pytest.mark.parametrize(
    ("state", "sampler_kwargs", "match"),
    [
        (_state(total_samples=41), {}, r"total_samples=41 .* this run has total_samples=40"),
        (_state(seed=7), {}, r"seed=7 .*different sample order"),
        (_state(sampler_type="single"), {}, r"sampler_type='single'.*'cyclic'"),
        (_state(drop_last=False), {}, r"drop_last=False"),
        (_state(global_batch_size=16), {}, r"global_batch_size=16"),
        (_state(version=2), {}, r"unknown batch sampler state version 2"),
        ({"version": 1, "epoch": 0}, {}, r"lacks \['sampler_type'"),
        ([1, 2], {}, r"must be a dict"),
        (_state(consumed_samples=6), {}, r"not a multiple of micro_batch_size x dp_world_size = 4"),
        (_state(consumed_samples=44), {}, r"beyond the epoch"),
        (_state(consumed_samples=-4), {}, r"consumed_samples must be an integer >= 0"),
        (_state(epoch=-1), {}, r"epoch must be an integer >= 0"),
        (_state(), {"dp_world_size": 4}, r"middle of an optimizer step .*consumed_samples 4 .*global_batch_size 8"),
        (_state(), {"micro_batch_size": 4, "dp_world_size": 1}, r"middle of an optimizer step"),
    ],
)
def test_refusals(state, sampler_kwargs, match):
    sampler = make(**{**BASE, **sampler_kwargs})
    with pytest.raises(ResumeStateError, match=match):
        sampler.load_state_dict(state)
    assert (sampler.epoch, sampler.consumed_samples) == (0, 0)  # a refused state changes nothing


def test_refusals_with_data_sharding():
    sharded = {**BASE, "data_sharding": True}
    state = make(**sharded).state_dict()
    with pytest.raises(ResumeStateError, match=r"data_sharding=True .*data_sharding=False"):
        make(**BASE).load_state_dict(state)
    with pytest.raises(ResumeStateError, match=r"dp_world_size 4: the checkpoint used 2 with data_sharding"):
        make(**{**sharded, "dp_world_size": 4, "micro_batch_size": 1}).load_state_dict(state)


def test_seed_does_not_matter_for_single():
    state = make(total_samples=20, micro_batch_size=2, seed=1).state_dict()
    sampler = make(total_samples=20, micro_batch_size=2, seed=2)
    sampler.load_state_dict(state)
    assert sampler.epoch == 0


def test_state_dict_is_small_and_plain():
    state = make(**BASE).state_dict()
    assert state == {
        "version": 1,
        "sampler_type": "cyclic",
        "epoch": 0,
        "consumed_samples": 0,
        "total_samples": 40,
        "global_batch_size": 8,
        "micro_batch_size": 2,
        "dp_world_size": 2,
        "seed": SEED,
        "data_sharding": False,
        "drop_last": True,
        "data_rearrange_map": None,
    }
    assert all(type(v) in (int, str, bool, type(None)) for v in state.values())


# -- rearrange map ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler_type", ["single", "cyclic"])
def test_rearrange_map_from_array_list_and_file(tmp_path, sampler_type):
    mapping = np.concatenate([np.random.default_rng(0).permutation(25), [99] * 5])  # longer than needed is fine
    kwargs = dict(total_samples=25, micro_batch_size=2, global_batch_size=8, dp_world_size=2, sampler_type=sampler_type)
    path = tmp_path / "rearrange.npy"
    np.save(path, mapping)
    for rank in range(2):
        plain = list(make(dp_rank=rank, **kwargs))
        expected = [[int(mapping[i]) for i in batch] for batch in plain]
        assert list(make(dp_rank=rank, data_rearrange_map=mapping, **kwargs)) == expected
        assert list(make(dp_rank=rank, data_rearrange_map=mapping.tolist(), **kwargs)) == expected
        assert list(make(dp_rank=rank, data_rearrange_map=path, **kwargs)) == expected
        got = list(make(dp_rank=rank, data_rearrange_map=str(path), **kwargs))
        assert got == expected and all(type(i) is int for batch in got for i in batch)


def test_rearrange_map_with_data_sharding():
    mapping = np.arange(40)[::-1].copy()
    kwargs = dict(BASE, data_sharding=True)
    plain = list(make(**kwargs))
    assert list(make(data_rearrange_map=mapping, **kwargs)) == [[39 - i for i in batch] for batch in plain]


def test_rearrange_map_errors(tmp_path):
    kwargs = dict(total_samples=10, micro_batch_size=2)
    with pytest.raises(DataConfigError, match="holds 9 entries but total_samples is 10"):
        make(data_rearrange_map=np.arange(9), **kwargs)
    with pytest.raises(DataConfigError, match="1-D integer"):
        make(data_rearrange_map=np.arange(10.0), **kwargs)
    with pytest.raises(DataConfigError, match="1-D integer"):
        make(data_rearrange_map=np.arange(20).reshape(2, 10), **kwargs)
    short = tmp_path / "short.npy"
    np.save(short, np.arange(5))
    with pytest.raises(DataFileError, match=f"{short} holds 5 entries"):
        make(data_rearrange_map=short, **kwargs)
    floats = tmp_path / "floats.npy"
    np.save(floats, np.zeros(10))
    with pytest.raises(DataFileError, match=f"{floats} must be a 1-D integer array"):
        make(data_rearrange_map=floats, **kwargs)
    with pytest.raises(DataFileError, match="missing.npy cannot be read"):
        make(data_rearrange_map=tmp_path / "missing.npy", **kwargs)
    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"not an array")
    with pytest.raises(DataFileError, match="garbage.npy cannot be read"):
        make(data_rearrange_map=garbage, **kwargs)
    archive = tmp_path / "archive.npy"
    with open(archive, "wb") as handle:
        np.savez(handle, a=np.arange(10))
    with pytest.raises(DataFileError, match="archive.npy holds NpzFile, not one array"):
        make(data_rearrange_map=archive, **kwargs)


# -- construction -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(global_batch_size=6, dp_world_size=2), r"global_batch_size 6 is not a multiple .* = 4"),
        (dict(dp_rank=2, dp_world_size=2), r"dp_rank 2 is out of range"),
        (dict(dp_rank=-1), r"dp_rank must be"),
        (dict(sampler_type="random"), r"unknown sampler_type 'random'; choose one of \['single', 'cyclic'\]"),
        (dict(data_sharding=True), r"data_sharding needs sampler_type 'cyclic'"),
        (dict(total_samples=7, global_batch_size=8), r"smaller than global_batch_size 8 with drop_last"),
        (dict(total_samples=0), r"total_samples must be"),
        (dict(micro_batch_size=0), r"micro_batch_size must be"),
        (dict(consumed_samples=3), r"consumed_samples 3: not a multiple"),
        (dict(consumed_samples=12), r"beyond the epoch"),
        (dict(epoch=-1), r"epoch must be"),
        (dict(seed=-5), r"seed must be an integer in \[0, 2\*\*64 - 1\].*got -5"),
        (dict(seed=2**64), r"seed must be an integer in \[0, 2\*\*64 - 1\]"),
        (dict(seed=True), r"seed must be an integer .*got True"),
        (dict(drop_last="yes"), r"drop_last must be a bool"),
    ],
)
def test_constructor_errors(kwargs, match):
    with pytest.raises(DataConfigError, match=match):
        make(**{"total_samples": 10, "micro_batch_size": 2, **kwargs})


def test_defaults():
    sampler = make(total_samples=10, micro_batch_size=2, dp_world_size=3, dp_rank=2)
    assert sampler.global_batch_size == 6 and sampler.epoch_len == 6 == epoch_length(10, 6, True)
    assert list(sampler) == [[4, 5]]
    assert len(list(itertools.chain(make(total_samples=10, micro_batch_size=2, drop_last=False)))) == 5


def test_the_option_groups_check_themselves_and_build_the_same_sampler():
    layout = BatchLayout(micro_batch_size=2, dp_rank=1, dp_world_size=3)
    assert layout.global_batch_size == 6 and layout.micro_step == 6
    options = SamplerOptions(sampler_type="cyclic", seed=np.uint64(9), drop_last=np.bool_(False))
    assert (options.seed, options.drop_last) == (9, False) and type(options.drop_last) is bool
    built = DatasetBatchSampler.from_options(20, layout, options)
    direct = make(
        total_samples=20, micro_batch_size=2, dp_rank=1, dp_world_size=3, sampler_type="cyclic", seed=9, drop_last=False
    )
    assert list(built) == list(direct) and built.state_dict() == direct.state_dict()
    with pytest.raises(DataConfigError, match="global_batch_size 4 is not a multiple"):
        BatchLayout(micro_batch_size=2, global_batch_size=4, dp_world_size=3)
    with pytest.raises(DataConfigError, match="data_sharding must be a bool, got 'false'; write true or false"):
        SamplerOptions(data_sharding="false")
    with pytest.raises(AttributeError):
        options.seed = 3  # frozen


def test_the_distributed_sampler_type_of_earlier_releases_is_refused_with_what_to_write_instead():
    """Upstream hyper_parallel's ``distributed`` (torch DistributedSampler's padded order) is not available: the
    error names it and the two types that replace it, for the sampler and for the loaders' option group."""
    for build in (
        lambda: make(total_samples=10, micro_batch_size=2, sampler_type="distributed"),
        lambda: SamplerOptions(sampler_type="distributed"),
    ):
        with pytest.raises(DataConfigError) as raised:
            build()
        message = str(raised.value)
        for fragment in ("sampler_type 'distributed'", "DistributedSampler", "'cyclic'", "'single'", "sampler_shuffle"):
            assert fragment in message
    assert "distributed" not in SAMPLER_TYPES
    # a type no release had is still an unknown one
    with pytest.raises(DataConfigError, match=r"unknown sampler_type 'Distributed'"):
        SamplerOptions(sampler_type="Distributed")


# -- rearrange map: values and resume -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 10, 11, 2**40, -(2**40)])
@pytest.mark.parametrize("position", [0, 4, 9])
@pytest.mark.parametrize("given_as", ["array", "list", "file"])
def test_rearrange_map_entries_outside_the_dataset_are_refused_when_the_sampler_is_built(
    tmp_path, bad, position, given_as
):
    mapping = np.arange(10)[::-1].copy()
    mapping[position] = bad
    given = mapping if given_as == "array" else mapping.tolist()
    error, where = DataConfigError, "data_rearrange_map"
    if given_as == "file":
        given = tmp_path / "map.npy"
        np.save(given, mapping)
        error, where = DataFileError, f"data_rearrange_map file {given}"
    with pytest.raises(error) as raised:
        make(total_samples=10, micro_batch_size=2, data_rearrange_map=given)
    message = str(raised.value)
    assert message.startswith(f"{where}: entry {position} is {bad}, which is not an index of the dataset's 10 samples")
    assert "[0, 10)" in message and "rebuild it for this dataset" in message


def test_rearrange_map_checks_find_the_first_bad_entry_of_a_large_memory_mapped_map(tmp_path):
    total = 3 * (1 << 20) + 17  # several chunks, the last one partial
    mapping = np.arange(total, dtype=np.int32)[::-1].copy()
    mapping[[2 * (1 << 20) + 5, total - 1]] = [total, -3]
    np.save(tmp_path / "map.npy", mapping)
    with pytest.raises(DataFileError, match=rf"entry {2 * (1 << 20) + 5} is {total}, "):
        make(total_samples=total, micro_batch_size=4, data_rearrange_map=tmp_path / "map.npy")
    mapping[2 * (1 << 20) + 5] = 0
    np.save(tmp_path / "map.npy", mapping)
    with pytest.raises(DataFileError, match=rf"entry {total - 1} is -3, "):
        make(total_samples=total, micro_batch_size=4, data_rearrange_map=tmp_path / "map.npy")


MAP_KWARGS = dict(total_samples=12, micro_batch_size=2, global_batch_size=4)


def _mid_epoch_state(**kwargs) -> dict:
    sampler = make(**MAP_KWARGS, **kwargs)
    next(iter(sampler))
    return sampler.state_dict()


@pytest.mark.parametrize(
    ("saved", "current"),
    [
        (np.arange(12)[::-1], None),
        (None, np.arange(12)[::-1]),
        (np.arange(12)[::-1], np.roll(np.arange(12), 1)),
        (np.arange(12)[::-1], np.r_[np.arange(12)[::-1][:-1], 11]),  # one entry differs, the last
    ],
    ids=["map-then-none", "none-then-map", "another-map", "last-entry-differs"],
)
@pytest.mark.parametrize("sampler_type", ["single", "cyclic"])
def test_a_state_saved_with_another_rearrange_map_is_refused(saved, current, sampler_type):
    state = _mid_epoch_state(data_rearrange_map=saved, sampler_type=sampler_type)
    sampler = make(**MAP_KWARGS, data_rearrange_map=current, sampler_type=sampler_type)
    with pytest.raises(ResumeStateError, match=r"saved with data_rearrange_map .* but this run has .*different sample"):
        sampler.load_state_dict(state)
    assert (sampler.epoch, sampler.consumed_samples) == (0, 0)


def test_the_same_rearrange_map_resumes_from_a_file_a_list_or_another_dtype(tmp_path):
    mapping = np.random.default_rng(3).permutation(12)
    np.save(tmp_path / "map.npy", mapping.astype(np.int16))
    state = _mid_epoch_state(data_rearrange_map=mapping)
    assert state["data_rearrange_map"].startswith("12 entries, xxh3_64 ")
    for given in (tmp_path / "map.npy", mapping.tolist(), mapping.astype(np.uint32)):
        sampler = make(**MAP_KWARGS, data_rearrange_map=given)
        sampler.load_state_dict(state)
        assert list(sampler) == [[int(mapping[i]) for i in range(p, p + 2)] for p in range(2, 12, 2)]


def test_a_rearrange_map_file_rewritten_with_other_content_is_refused(tmp_path):
    path = tmp_path / "map.npy"
    np.save(path, np.arange(12))
    state = _mid_epoch_state(data_rearrange_map=path)
    np.save(path, np.arange(12)[::-1])  # the same path and size, another order
    with pytest.raises(ResumeStateError, match="data_rearrange_map"):
        make(**MAP_KWARGS, data_rearrange_map=path).load_state_dict(state)


def test_states_that_recorded_no_rearrange_map_resume_without_one_and_refuse_a_map():
    state = _mid_epoch_state()
    del state["data_rearrange_map"]  # as states saved before the map was recorded
    make(**MAP_KWARGS).load_state_dict(state)
    with pytest.raises(ResumeStateError, match="data_rearrange_map none but this run has 12 entries"):
        make(**MAP_KWARGS, data_rearrange_map=np.arange(12)).load_state_dict(state)
    with pytest.raises(ResumeStateError, match="data_rearrange_map must be a string or None, got 5"):
        make(**MAP_KWARGS).load_state_dict({**state, "data_rearrange_map": 5})
