"""The size-1 placement of the cost-balanced schedulers (the C helper ``_placement.place_singles``) against a naive
reference written here.

The reference does what the placement promises with no heap and no parking: each sequence, in order, goes to the
position with the least ``(load, position)`` among those with a micro-batch whose room is at least its need, the
first such micro-batch; its cost is added to that position's load (plain float addition, so the loads must agree
bit for bit); when no position has room every position gets ``grow`` fresh micro-batches; a group that reaches
``max_num_seqs`` has no room left (-1). Seeded random cases cover growth, tied loads and costs, ``max_num_seqs``,
positions taken by wider groups (-1 rooms), needs equal to the room and one position; whole ``dynamic_cp`` and
``compute_balanced`` schedules are checked for their guarantees.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.parallel.data_schedule_utils import PackingSchedulerConfig, build_schedule
from hyper_parallel.data.parallel.scheduling import _placement
from hyper_parallel.data.parallel.scheduling.balanced import _Step

SEED = 20261204
KINDS = ("mixed", "ties", "growth", "max_num_seqs", "wide", "full_room", "one_position")


def naive_place(needs, weights, loads, rooms, fresh, limit, grow):
    """``(position, micro_batch, loads, count)`` by the rule, checking every position for every sequence."""
    rooms = [list(row) for row in np.asarray(rooms).tolist()]
    members = [[0] * len(row) for row in rooms]
    loads = [float(load) for load in loads]
    count = len(rooms[0])
    positions, micro_batches = [], []
    for need, weight in zip(np.asarray(needs).tolist(), np.asarray(weights).tolist(), strict=True):
        fitting = [(loads[u], u) for u, row in enumerate(rooms) if any(room >= need for room in row)]
        while not fitting:
            assert need <= fresh, "the reference would grow for ever"
            for row, counts in zip(rooms, members, strict=True):
                row.extend([fresh] * grow)
                counts.extend([0] * grow)
            count += grow
            fitting = [(loads[u], u) for u, row in enumerate(rooms) if any(room >= need for room in row)]
        load, u = min(fitting)
        m = next(m for m, room in enumerate(rooms[u]) if room >= need)
        loads[u] = load + weight
        members[u][m] += 1
        rooms[u][m] = -1 if limit is not None and members[u][m] >= limit else rooms[u][m] - need
        positions.append(u)
        micro_batches.append(m)
    return positions, micro_batches, loads, count


def random_case(rng: np.random.Generator, kind: str):
    """``(needs, weights, loads, rooms, fresh, limit, grow)`` of one kind of case."""
    positions = 1 if kind == "one_position" else int(rng.integers(1, 9))
    count = int(rng.integers(1, 2 if kind == "growth" else 5))
    fresh = int(rng.integers(1, 24))
    n = int(rng.integers(0, 41)) if kind != "growth" else int(rng.integers(10, 60))
    rooms = np.full((positions, count), fresh, dtype=np.int64)
    if kind in ("wide", "mixed"):  # positions of wider groups, and rooms already partly used
        rooms[rng.random(rooms.shape) < 0.35] = -1
        used = rng.random(rooms.shape) < 0.2
        rooms[used] = rng.integers(0, fresh + 1, size=int(used.sum()))
    if kind == "full_room":
        needs = np.where(rng.random(n) < 0.6, fresh, rng.integers(1, fresh + 1, size=n))
    elif kind == "growth":
        needs = rng.integers(max(1, fresh // 2), fresh + 1, size=n)
    else:
        needs = rng.integers(1, fresh + 1, size=n)
    if kind in ("ties", "one_position") or rng.random() < 0.3:  # a few distinct costs and loads: ties everywhere
        weights = rng.choice([0.0, 0.5, 1.0, 2.0], size=n)
        loads = rng.choice([0.0, 1.0, 1.5], size=positions)
    else:
        weights = rng.lognormal(0.0, 1.0, size=n) * float(rng.choice([1e-3, 1.0, 1e6]))
        loads = np.zeros(positions) if rng.random() < 0.5 else rng.random(positions)
    limit = int(rng.integers(1, 5)) if kind == "max_num_seqs" or rng.random() < 0.2 else None
    grow = int(rng.integers(1, 5))
    return needs.astype(np.int64), weights.astype(np.float64), loads.astype(np.float64), rooms, fresh, limit, grow


@pytest.mark.parametrize("kind", KINDS)
def test_the_helper_places_as_the_naive_rule_does(kind):
    rng = np.random.default_rng([SEED, KINDS.index(kind)])
    grew = closed = tied = 0
    for _ in range(500):
        needs, weights, loads, rooms, fresh, limit, grow = case = random_case(rng, kind)
        positions, micro_batches, final, count = _placement.place_singles(*case)
        expected = naive_place(*case)
        assert positions.tolist() == expected[0] and micro_batches.tolist() == expected[1], case
        assert final.tolist() == expected[2] and count == expected[3], case
        assert final.dtype == np.float64 and positions.dtype == micro_batches.dtype == np.int64
        grew += count > rooms.shape[1]
        if limit is not None and len(positions):
            closed += int(np.bincount(positions * count + micro_batches).max()) >= limit
        tied += len(set(loads.tolist())) < len(loads)
    assert kind != "growth" or grew > 400
    assert kind != "max_num_seqs" or closed > 300
    assert kind not in ("ties", "mixed") or tied > 100


def test_a_step_takes_the_helpers_placement_into_its_arrays():
    """``_Step.place_singles`` after wide groups: owner, size, members, loads and the grown count by the rule."""
    rng = np.random.default_rng(SEED)
    for _ in range(300):
        units = int(rng.choice([1, 2, 4, 8]))
        count, room, grow = int(rng.integers(1, 4)), int(rng.integers(2, 30)), int(rng.integers(1, 4))
        limit = int(rng.integers(1, 4)) if rng.random() < 0.3 else None
        step = _Step(count, units, room, limit)
        tokens, weights, index = [], [], 0
        for _ in range(int(rng.integers(0, 4)) if units > 1 else 0):  # a few wide groups of 2 on free blocks
            micro_batch, first = int(rng.integers(0, count)), 2 * int(rng.integers(0, units // 2))
            if step.owner[micro_batch, first] < 0:
                tokens.append(int(rng.integers(1, 2 * room + 1)))
                weights.append(float(rng.choice([1.0, 3.0])))
                step.place_wide(index, micro_batch, first, 2, tokens[-1], weights[-1])
                index += 1
        wide = index
        singles = int(rng.integers(0, 30))
        tokens += rng.integers(1, room + 1, size=singles).tolist()
        weights += rng.choice([0.5, 1.0, 2.0, 7.25], size=singles).tolist()
        tokens, weights = np.array(tokens, dtype=np.int64), np.array(weights)
        indices = wide + rng.permutation(singles)
        rooms = np.where(step.owner.T < 0, room, -1)
        expected = naive_place(tokens[indices], weights[indices], step.load, rooms, room, limit, grow)
        owner, size, members = step.owner.copy(), step.size.copy(), dict(step.members)
        step.place_singles(indices, tokens, weights, grow)
        assert step.count == expected[3] and step.load.tolist() == expected[2]
        grown = expected[3] - count
        owner = np.concatenate([owner, np.full((grown, units), -1)])
        size = np.concatenate([size, np.zeros((grown, units), dtype=np.int64)])
        for sequence, u, m in zip(indices.tolist(), expected[0], expected[1], strict=True):
            owner[m, u], size[m, u] = u, 1
            members.setdefault((m, u), []).append(sequence)
        assert (step.owner == owner).all() and (step.size == size).all() and step.members == members
        assert list(step.members) == list(members)[:wide] + sorted(list(members)[wide:], key=lambda k: (k[1], k[0]))


def _dynamic_sizes(rng, positions):
    sizes = [1]
    while options := [k for k in (2, 3) if positions % (sizes[-1] * k) == 0]:
        if rng.random() < 0.25:
            break
        sizes.append(sizes[-1] * int(rng.choice(options)))
    return tuple(sizes)


@pytest.mark.parametrize("scheduler", ["dynamic_cp", "compute_balanced"])
def test_whole_schedules_keep_their_guarantees(scheduler):
    rng = np.random.default_rng([SEED, len(scheduler)])
    planned = 0
    for index in range(150):
        dp, cp = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        sizes = _dynamic_sizes(rng, dp * cp) if scheduler == "dynamic_cp" else ()
        largest = max(sizes) if sizes else cp
        max_seqlen = int(rng.choice([32, 64, 256]))
        limits = {"max_num_seqs": int(rng.integers(1, 5))} if index % 3 == 1 else {}
        alignment = int(rng.choice([1, 1, 2, 4]))
        cfg = PackingSchedulerConfig(
            max_seqlen_per_dp_cp_rank=max_seqlen, scheduler=scheduler, pad_packed_seq_alignment=alignment, **limits
        )
        cap = max_seqlen * largest - 4 * largest
        count = int(rng.integers(1, 10 * dp * cp))
        if index % 2:
            lengths = np.clip(np.round(rng.lognormal(np.log(max(2, cap // 8)), 1.0, size=count)), 1, cap)
        else:
            lengths = rng.choice(rng.integers(1, cap + 1, size=2), size=count)  # tied lengths
        lengths = lengths.astype(np.int64)
        layout = cfg.layout(cp_size=cp, tp_size=1)
        vpp_group = int(rng.integers(1, 4))
        try:
            schedule = build_schedule(
                cfg, lengths, layout=layout, dp_size=dp, dynamic_cp_sizes=sizes, vpp_group=vpp_group
            )
        except DataConfigError as error:  # only a VPP group the step cannot fill may be refused
            assert vpp_group > 1 and "cannot fill its" in str(error)
            continue
        seen = sorted(i for groups in schedule.micro_batches for group in groups for i in group.sequence_ids)
        assert seen == list(range(count)), "every sequence exactly once"
        for groups in schedule.micro_batches:
            for group in groups:
                ids = list(group.sequence_ids)
                tokens = int(layout.padded_lengths(lengths[ids], group.cp_size).sum())
                if ids:
                    assert layout.local_length(tokens, group.cp_size) <= max_seqlen, "no rank holds more than its room"
                assert len(ids) <= (cfg.group_sequence_limit or len(ids))
        planned += 1
    assert planned > 120


def test_the_arguments_are_checked():
    needs, weights, loads = np.array([3, 2]), np.array([1.0, 2.0]), np.zeros(2)
    rooms = np.full((2, 1), 4, dtype=np.int64)
    place = _placement.place_singles
    with pytest.raises(TypeError, match="needs must be int64"):
        place(needs.astype(np.int32), weights, loads, rooms, 4, None, 1)
    with pytest.raises(TypeError, match="weights must be a numpy array of float64, got list"):
        place(needs, [1.0, 2.0], loads, rooms, 4, None, 1)
    with pytest.raises(TypeError, match="rooms must be int64"):
        place(needs, weights, loads, rooms.astype(">i8"), 4, None, 1)
    with pytest.raises(ValueError, match="needs and weights must have one entry a sequence, got 2 and 1"):
        place(needs, weights[:1], loads, rooms, 4, None, 1)
    with pytest.raises(ValueError, match=r"got rooms of shape \(2, 1\) and 3 loads"):
        place(needs, weights, np.zeros(3), rooms, 4, None, 1)
    with pytest.raises(ValueError, match="rooms must be 2-D"):
        place(needs, weights, loads, rooms[:, 0], 4, None, 1)
    with pytest.raises(ValueError, match="needs\\[1\\] is 0"):
        place(np.array([3, 0]), weights, loads, rooms, 4, None, 1)
    with pytest.raises(ValueError, match="weights\\[0\\] is NaN"):
        place(needs, np.array([np.nan, 1.0]), loads, rooms, 4, None, 1)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        place(needs, weights, loads, rooms, 4, 0, 1)
    with pytest.raises(TypeError, match="max_num_seqs must be an int or None"):
        place(needs, weights, loads, rooms, 4, 1.5, 1)
    with pytest.raises(ValueError, match="grow must be >= 1"):
        place(needs, weights, loads, rooms, 4, None, 0)
    # a need above a fresh micro-batch's room, with no room left for it: growth could never place it
    with pytest.raises(ValueError, match="sequence 2 needs 5 tokens, more than a fresh micro-batch's room 4"):
        place(np.array([4, 4, 5]), np.ones(3), loads, rooms, 4, None, 1)
    positions, _, _, count = place(np.array([4, 4, 5]), np.ones(3), loads, np.array([[5], [9]]), 4, None, 1)
    assert positions.tolist() == [0, 1, 1] and count == 1  # a starting room holds it: no growth


def test_strided_inputs_and_threads_give_the_same_placement():
    rng = np.random.default_rng(SEED + 1)
    needs, weights = rng.integers(1, 9, size=4000), rng.random(4000)
    loads, rooms = np.zeros(16), np.full((16, 3), 8, dtype=np.int64)
    expected = _placement.place_singles(needs[::2], weights[::2], loads, rooms, 8, 3, 2)
    contiguous = _placement.place_singles(needs[::2].copy(), weights[::2].copy(), loads, rooms, 8, 3, 2)
    assert all(np.array_equal(a, b) for a, b in zip(expected[:3], contiguous[:3], strict=True))
    assert expected[3] == contiguous[3] > 3
    results = []

    def run():
        for _ in range(20):
            results.append(_placement.place_singles(needs[::2], weights[::2], loads, rooms, 8, 3, 2))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 80
    for result in results:
        assert all(np.array_equal(a, b) for a, b in zip(result[:3], expected[:3], strict=True))
        assert result[3] == expected[3]
