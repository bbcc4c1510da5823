"""Elastic resume: the loader states of every DP rank merged into one, and restored at any DP size.

Owns: ``merge_rank_states`` (the states of all ``D`` ranks of one run, checked against each other and merged into
an elastic state: what of the epoch none of them has delivered) and ``rank_state`` (the elastic state as the
ordinary state of one rank of the new DP size ``D'``, which the loader then loads and checks like any other). Not
responsible for: the per-rank state and its checks (``loader_state``, ``read_tracking``, ``key_sources``, the
sampler and the packing policy), or gathering the states (the caller saves every rank's state).

The promise is set semantics over the epoch the ranks were in: across the change no record (no window of a record
for the dynamic loader) is lost and none is delivered twice. What the new ranks read, for a mapping source::

    left to read   every old rank's positions of the epoch not yet read (its remaining micro-step slices) and its
                   records read but not yet put into a batch (the rest of a read, the replay), in epoch order
    new ranks      read the left positions as the epoch's micro-steps at D': micro-step b gives rank r the left
                   positions [b*M' + r*mbs', b*M' + (r+1)*mbs') of M' = mbs' * D' (the sampler's ``remaining``)
    buffered       the dynamic loader's buffered samples ([record index, window]) of the old ranks, in rank order
                   then buffer order, dealt round-robin: sample i goes to new rank i mod D', packed first

So the order after the change depends only on ``(D, D', states)``. The elastic state is compact: the positions left
as a bitmap of the epoch (one bit per position), the replayed records and the buffered samples as short lists.

Layout::

    {"version": 1, "kind": "elastic", "loader", "dp_world_size" (D), "micro_batch_size", "data", "transform",
     "epoch": the epoch merged, "sampler": the sampler state with the positions left as its ``remaining`` bitmap,
     "replay": record indices read but not batched, dynamic loader only: "packing": the packing policy's settings
     with every old rank's ``buffer``, in rank order, and their ``buffer_tokens``}

The packing policy's state must keep its buffered samples, encoded by the key source, under ``buffer`` and their
cost under ``buffer_tokens`` (as ``TextTokenBatcher`` does). Streams (iterable sources) are not merged: each rank
resumes its own state, with the saved DP size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from hyper_parallel.data.batching.loader_state import envelope, migrate_loader_state
from hyper_parallel.data.errors import ResumeStateError
from hyper_parallel.data.parallel.batch_sampler import (
    bitmap_positions,
    epoch_length,
    pending_positions,
    remaining_bitmap,
)
from hyper_parallel.data.resume_checks import check_same_data, check_state_type, state_field

__all__ = ["ELASTIC_VERSION", "is_elastic", "merge_rank_states", "rank_state"]

ELASTIC_VERSION = 1
_WHERE = "the elastic state"
# The sampler state's fields that move with the position; every other one must be the same on every rank.
_POSITION_KEYS = ("epoch", "consumed_samples", "remaining")
# The packing state's fields that hold the buffer; every other one is a setting, the same on every rank.
_BUFFER_KEYS = ("buffer", "buffer_tokens")


def is_elastic(state) -> bool:
    """Whether ``state`` is an elastic state (from ``merge_rank_states``) rather than one rank's."""
    return isinstance(state, Mapping) and state.get("kind") == "elastic"


def merge_rank_states(states: Sequence[Mapping]) -> dict:
    """Merge the loader states of every DP rank of one run, saved at the same step, into one elastic state.

    Give the result to ``load_state_dict`` of every loader of the new DP size: each takes its share of what is left
    of the epoch (see the module's description of the order).

    Raises:
        ResumeStateError: not exactly one state of each rank ``0..D-1``; states of another loader kind, DP size,
            data, transform, sampler or packing settings than the others; ranks in epochs that do not meet (one
            mid-epoch, another past its end); a stream's states; data sharding.
    """
    if isinstance(states, Mapping) or not isinstance(states, Sequence) or not states:
        raise ResumeStateError(
            "merge_rank_states takes the list of the loader states of every DP rank (rank 0 to D-1), got "
            f"{type(states).__name__}; gather every rank's loader.state_dict() and pass them all"
        )
    states = [migrate_loader_state(state, "merge_rank_states") for state in states]
    first = _common_envelope(states)
    by_rank = _states_by_rank(states, first["dp_world_size"])
    samplers = [_sampler_state(state, rank) for rank, state in enumerate(by_rank)]
    settings = _sampler_settings(samplers[0])
    for rank, sampler in enumerate(samplers[1:], start=1):
        changed = [key for key, value in _sampler_settings(sampler).items() if settings.get(key) != value]
        if changed:
            shown = ", ".join(f"{key} {settings.get(key)!r} and {sampler[key]!r}" for key in changed)
            raise ResumeStateError(
                f"the batch sampler settings of DP rank 0 and DP rank {rank} differ ({shown}): the states are not of "
                "one run; give every rank's state saved at the same step"
            )
    epoch = _merged_epoch(by_rank, samplers)
    left, replay = [], []
    for rank, (state, sampler) in enumerate(zip(by_rank, samplers, strict=True)):
        source = state["source"]
        if source["replay"] and source["replay_epoch"] == epoch:
            replay += [index for keys in source["replay"] for index in keys]
        if sampler["epoch"] == epoch:
            plan = _sampler_plan(sampler)
            left.append(
                pending_positions(
                    plan,
                    sampler["consumed_samples"],
                    micro_batch_size=sampler["micro_batch_size"],
                    dp_rank=rank,
                    dp_world_size=sampler["dp_world_size"],
                )
            )
    positions = np.sort(np.concatenate(left)) if left else np.zeros(0, dtype=np.int64)
    merged_sampler = {**samplers[0], "epoch": epoch, "consumed_samples": 0}
    merged_sampler["remaining"] = remaining_bitmap(positions, samplers[0]["total_samples"])
    merged = {
        "version": ELASTIC_VERSION,
        "kind": "elastic",
        **{key: first[key] for key in ("loader", "dp_world_size", "micro_batch_size", "data", "transform")},
        "epoch": epoch,
        "sampler": merged_sampler,
        "replay": replay,
    }
    if first["loader"] == "DynamicBatchDataLoader":
        merged["packing"] = _merged_packing(by_rank, epoch)
    return merged


def rank_state(merged: Mapping, source, layout, policy=None) -> dict:
    """This rank's ordinary loader state from an elastic one: its share of what is left of the merged epoch.

    Args:
        merged: from ``merge_rank_states``.
        source: the loader's key source (a ``MappingKeys``): its sampler places the replayed records in the
            epoch and reads the buffered samples again.
        layout: the loader's ``BatchLayout`` (this rank and the new DP size).
        policy: the dynamic loader's packing policy (its ``cost`` of the buffered samples); None for the fixed one.

    Raises:
        ResumeStateError: a malformed elastic state, other data, sampler settings this loader does not have, or a
            replayed record that is not left in the epoch.
    """
    check_state_type(merged, Mapping, _WHERE)
    if state_field(merged, "version", int, _WHERE) != ELASTIC_VERSION:
        raise ResumeStateError(
            f"elastic state version {merged['version']!r} is not supported (expected {ELASTIC_VERSION}); merge the "
            "ranks' states again with this release"
        )
    sampler = getattr(source, "sampler", None)
    if sampler is None:
        raise ResumeStateError(
            "an elastic state restores loaders over a mapping source, but this loader reads a stream: resume each "
            "rank with its own state, with the saved DP size"
        )
    check_same_data(state_field(merged, "data", (Mapping, None), _WHERE), source.identities[0], f"{_WHERE}['data']")
    saved = state_field(merged, "sampler", Mapping, _WHERE)
    epoch = state_field(merged, "epoch", int, _WHERE)
    # The same order (sampler type, seed, records, map); the global batch size may change with the DP size, as the
    # positions left are given, not cut by it.
    saved = {**saved, "global_batch_size": sampler.global_batch_size}
    sampler.check_state(saved)
    positions = sampler.saved_remaining(saved)
    if positions is None:
        raise ResumeStateError(f"{_WHERE}['sampler'] has no 'remaining' positions; merge the ranks' states again")
    replay = state_field(merged, "replay", list, _WHERE)
    source.check_keys(replay, f"{_WHERE}['replay']")
    positions = _with_replayed(positions, replay, sampler, epoch, _epoch_len(saved))
    position = {
        **sampler.state_dict(),
        "epoch": epoch if len(positions) else epoch + 1,
        "consumed_samples": 0,
    }
    position.pop("remaining", None)
    if len(positions):
        position["remaining"] = remaining_bitmap(positions, sampler.total_samples)
    state = {
        **envelope(state_field(merged, "loader", str, _WHERE), layout, (merged["data"], merged["transform"])),
        "source": {"kind": source.kind, "position": position, "replay": [], "replay_epoch": None},
    }
    if policy is not None:
        packing = state_field(merged, "packing", Mapping, _WHERE)
        buffer = state_field(packing, "buffer", list, f"{_WHERE}['packing']")
        entries = source.decode_samples(buffer, f"{_WHERE}['packing']['buffer']")
        costs = [policy.cost(sample) for _, sample in entries]
        if sum(costs) != state_field(packing, "buffer_tokens", int, f"{_WHERE}['packing']"):
            raise ResumeStateError(
                f"the buffered samples of the elastic state hold {sum(costs)} tokens but the ranks' states recorded "
                f"{packing['buffer_tokens']}: the data files or the transform changed since they were saved"
            )
        share = slice(layout.dp_rank, None, layout.dp_world_size)
        state.update(
            flushing=not len(positions),
            buffered_samples=len(buffer[share]),
            packing={**packing, "buffer": buffer[share], "buffer_tokens": sum(costs[share])},
        )
    return state


# Merging ---------------------------------------------------------------------------------------------------------


def _common_envelope(states: list[dict]) -> dict:
    """The envelope fields every state must share, from the first state, checked against the others."""
    first = states[0]
    for key, expected in (("loader", str), ("dp_world_size", int), ("micro_batch_size", int), ("source", Mapping)):
        for state in states:
            state_field(state, key, expected, "a rank's loader state")
    if first["source"].get("kind") != "mapping":
        raise ResumeStateError(
            f"merge_rank_states merges states of loaders over a mapping source, got a source of kind "
            f"{first['source'].get('kind')!r}: a stream is split between the DP ranks, so resume each rank with its "
            "own state, with the saved DP size"
        )
    for position, state in enumerate(states[1:], start=1):
        for key in ("loader", "dp_world_size", "micro_batch_size", "data", "transform"):
            if state.get(key) != first.get(key):
                raise ResumeStateError(
                    f"the loader states given to merge_rank_states differ in {key!r} (state 0 has "
                    f"{_shown(first.get(key))}, state {position} has {_shown(state.get(key))}): they are not the "
                    "states of one run; give every rank's state saved at the same step"
                )
        if state["source"].get("kind") != "mapping":
            raise ResumeStateError(f"state {position} given to merge_rank_states is not over a mapping source")
    return first


def _states_by_rank(states: list[dict], dp_world_size: int) -> list[dict]:
    """The states in rank order: exactly one of each rank ``0..dp_world_size-1``."""
    by_rank: dict[int, dict] = {}
    for position, state in enumerate(states):
        rank = state_field(state, "dp_rank", int, f"state {position} given to merge_rank_states")
        if rank in by_rank:
            raise ResumeStateError(f"merge_rank_states got two states of DP rank {rank}; give each rank's state once")
        if not 0 <= rank < dp_world_size:
            raise ResumeStateError(
                f"merge_rank_states got a state of DP rank {rank}, but the states were saved with dp_world_size "
                f"{dp_world_size}"
            )
        by_rank[rank] = state
    missing = sorted(set(range(dp_world_size)) - set(by_rank))
    if missing:
        raise ResumeStateError(
            f"merge_rank_states got {len(states)} states of a run with dp_world_size {dp_world_size}; the states of "
            f"DP ranks {missing} are missing: every rank's state is needed to know what the epoch has delivered"
        )
    return [by_rank[rank] for rank in range(dp_world_size)]


def _sampler_state(state: Mapping, rank: int) -> Mapping:
    """A rank's sampler state, with the fields the merge computes with checked; the settings equal rank 0's are
    checked by the new loader's sampler."""
    where = f"DP rank {rank}'s loader state['source']['position']"
    source = state["source"]
    sampler = state_field(source, "position", Mapping, f"DP rank {rank}'s loader state['source']")
    for key in ("epoch", "consumed_samples", "total_samples", "global_batch_size", "micro_batch_size"):
        if state_field(sampler, key, int, where) < 0:
            raise ResumeStateError(f"{where}['{key}'] is {sampler[key]}; it counts from 0")
    if state_field(sampler, "dp_world_size", int, where) != state["dp_world_size"]:
        raise ResumeStateError(f"{where}['dp_world_size'] is not the state's dp_world_size; the state is damaged")
    state_field(sampler, "drop_last", bool, where)
    if state_field(sampler, "data_sharding", bool, where):
        raise ResumeStateError(
            "merge_rank_states cannot merge states saved with data_sharding: each rank walks its own bucket of the "
            "data, which depends on the DP size; resume with the saved DP size, or turn data_sharding off for "
            "elastic resumption"
        )
    if "remaining" in sampler:
        state_field(sampler, "remaining", (bytes, None), where)
    replay = state_field(source, "replay", list, f"DP rank {rank}'s loader state['source']")
    for index, keys in enumerate(replay):
        check_state_type(keys, list, f"DP rank {rank}'s loader state['source']['replay'][{index}]")
        for key in keys:
            check_state_type(key, int, f"DP rank {rank}'s loader state['source']['replay'][{index}]")
    state_field(source, "replay_epoch", (int, None), f"DP rank {rank}'s loader state['source']")
    return sampler


def _sampler_settings(sampler: Mapping) -> dict:
    """What fixes a sampler's order and layout: everything but its position."""
    return {key: value for key, value in sampler.items() if key not in _POSITION_KEYS}


def _epoch_len(sampler: Mapping) -> int:
    return epoch_length(sampler["total_samples"], sampler["global_batch_size"], sampler["drop_last"])


def _sampler_plan(sampler: Mapping) -> np.ndarray:
    """The positions the sampler's epoch covers: its ``remaining`` ones, or the whole epoch."""
    bitmap, total = sampler.get("remaining"), sampler["total_samples"]
    if bitmap is None:
        return np.arange(_epoch_len(sampler))
    if len(bitmap) != -(-total // 8):
        raise ResumeStateError(f"a sampler state's remaining bitmap does not cover its {total} positions")
    return bitmap_positions(bitmap, total)


def _open_epoch(state: Mapping, sampler: Mapping) -> tuple[int, bool]:
    """The epoch a rank's state is in, and whether it is at that epoch's very start (nothing read or buffered)."""
    source = state["source"]
    flushing = state.get("flushing", False)
    if source["replay"]:
        return source["replay_epoch"], False
    if flushing:
        return sampler["epoch"] - 1, False
    fresh = sampler["consumed_samples"] == 0 and sampler.get("remaining") is None and not state.get("buffered_samples")
    return sampler["epoch"], fresh


def _merged_epoch(states: list[dict], samplers: list[Mapping]) -> int:
    """The epoch the ranks are in: the earliest; a rank may only be past it at the very start of the next."""
    opened = [_open_epoch(state, sampler) for state, sampler in zip(states, samplers, strict=True)]
    epoch = min(rank_epoch for rank_epoch, _ in opened)
    for rank, (rank_epoch, fresh) in enumerate(opened):
        if rank_epoch != epoch and not (rank_epoch == epoch + 1 and fresh):
            raise ResumeStateError(
                f"DP rank {rank}'s state is in epoch {rank_epoch}, past epoch {epoch} of another rank's: the states "
                "must be saved at the same step, with every rank in the same epoch (or at the start of the next)"
            )
    return epoch


def _merged_packing(states: list[dict], epoch: int) -> dict:
    """The packing settings (the same on every rank) and every rank's buffered samples, in rank order."""
    buffer, tokens, settings = [], 0, None
    for rank, state in enumerate(states):
        where = f"DP rank {rank}'s loader state['packing']"
        packing = state_field(state, "packing", Mapping, f"DP rank {rank}'s loader state")
        rank_settings = {key: value for key, value in packing.items() if key not in _BUFFER_KEYS}
        if settings is None:
            settings = rank_settings
        elif rank_settings != settings:
            raise ResumeStateError(
                f"the packing settings of DP rank {rank} ({_shown(rank_settings)}) differ from DP rank 0's "
                f"({_shown(settings)}): the states are not of one run"
            )
        buffer += state_field(packing, "buffer", list, where)
        tokens += state_field(packing, "buffer_tokens", int, where)
    return {**settings, "buffer": buffer, "buffer_tokens": tokens}


def _with_replayed(positions: np.ndarray, replay: list[int], sampler, epoch: int, epoch_len: int) -> np.ndarray:
    """``positions`` with those of the replayed records added, in epoch order; each record must be left once
    (``epoch_len``: the positions of the merged epoch, at the saved global batch size)."""
    if not replay:
        return positions
    everything = sampler.physical_indices(np.arange(epoch_len), epoch)
    if len(np.unique(everything)) != len(everything):
        raise ResumeStateError(
            "the epoch's order holds some records twice (the data_rearrange_map repeats entries), so the records "
            "read but not yet batched cannot be placed in the epoch; resume with the saved DP size"
        )
    where = np.full(sampler.total_samples, -1, dtype=np.int64)
    where[everything] = np.arange(len(everything))
    replayed = where[np.asarray(replay, dtype=np.int64)]
    taken = np.zeros(sampler.total_samples, dtype=bool)
    taken[positions] = True
    clash = (replayed < 0) | taken[np.maximum(replayed, 0)]
    if clash.any() or len(np.unique(replayed)) != len(replayed):
        record = replay[int(np.flatnonzero(clash)[0])] if clash.any() else replay[0]
        raise ResumeStateError(
            f"record {record}, read again by one rank's state, is not left in epoch {epoch} of the others (or is "
            "read again twice): the states are not the states of one run at one step"
        )
    return np.sort(np.concatenate([positions, replayed]))


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
