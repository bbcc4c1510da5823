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

and for a stream (old rank ``s`` streamed ``split_dataset_by_node(s, D)``)::

    old shares     every new rank reads each old share in turn from the old rank's Hugging Face state on (a share
                   read to its end is skipped) and keeps the j-th record read of share s when (j + s) % D' == r
                   (``OnlineIterableDataset``'s handover)
    read, not      the records the old ranks had read but not delivered (replayed, in the cursor's block or
    delivered      shuffle buffer), in rank order, dealt round-robin: record i to new rank i mod D', read first
    buffered       as for a mapping source (the samples' tokens)

and for a mixture with a streaming source, source by source (``mixture.mixture_handover``): each stream hands over
its pass as above, each mapping or Indexed source the offsets of its pass no old rank gave, the draws continue from
the furthest old rank's sample number, and the keys the loaders had read but not delivered are dealt round-robin as
whole keys, read first.

So the order after the change depends only on ``(D, D', states)``. The elastic state is compact: the positions left
as a bitmap of the records (one bit each), the replayed records and the buffered samples as short lists; for a
stream, one Hugging Face state per old rank and the records read but not delivered.

Layout::

    {"version": 1, "kind": "elastic", "loader", "dp_world_size" (D), "micro_batch_size", "data", "transform",
     "source_kind": "mapping" | "iterable", "epoch": the epoch merged,
     mapping: "sampler": the sampler state with the positions left as its ``remaining`` bitmap,
              "replay": record indices read but not batched,
     iterable: "stream": {"seed", "shuffle_buffer_size", "base_world_size", "shares": [{"source_state", "done"}]
               per rank of the first split, "levels": the frontiers of each later change},
               "records": the records read but not delivered,
     iterable over a mixture: "mixture_stream": the ranks' mixture cursors merged (``mixture_handover``),
               "records": the keys read but not delivered,
     dynamic loader only: "packing": the packing policy's settings with every old rank's ``buffer``, in rank
     order, and their ``buffer_tokens``,
     over a mixture: "mixture": the ranks' plan (the same on every rank) and their tallies summed, which new rank 0
     continues while the other new ranks count from 0}

The packing policy's state must keep its buffered samples, encoded by the key source, under ``buffer`` and their
cost under ``buffer_tokens`` (as ``TextTokenBatcher`` does). Stream states still reading a handed-over epoch merge
into one more level of the same handover (``OnlineIterableDataset``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from hyper_parallel.data.batching.loader_state import envelope, migrate_loader_state
from hyper_parallel.data.errors import ResumeStateError
from hyper_parallel.data.mixture.mixture_handover import merged_cursors, rank_cursor
from hyper_parallel.data.parallel.batch_sampler import (
    bitmap_positions,
    epoch_length,
    pending_positions,
    remaining_bitmap,
)
from hyper_parallel.data.resume_checks import check_same_data, check_state_type, state_field
from hyper_parallel.data.text.online.online_iterable_dataset import handover_cursor
from hyper_parallel.data.text.online.stream_handover import checked_cursor, cursor_at_start, merged_handover

__all__ = ["ELASTIC_VERSION", "DecodedSamples", "is_elastic", "merge_rank_states", "rank_state"]

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
            data, transform, sampler, stream or packing settings or mixture plan than the others; ranks in epochs
            that do not meet (one mid-epoch, another past its end); data sharding; over a mixture with a streaming
            source, what ``mixture_handover.merged_cursors`` refuses.
    """
    if isinstance(states, Mapping) or not isinstance(states, Sequence) or not states:
        raise ResumeStateError(
            "merge_rank_states takes the list of the loader states of every DP rank (rank 0 to D-1), got "
            f"{type(states).__name__}; gather every rank's loader.state_dict() and pass them all"
        )
    states = [migrate_loader_state(state, "merge_rank_states") for state in states]
    first = _common_envelope(states)
    by_rank = _states_by_rank(states, first["dp_world_size"])
    if first["source"]["kind"] == "mapping":
        source = _merge_mapping(by_rank)
    else:
        source = _merge_mixture_streams(by_rank) if "mixture" in first else _merge_streams(by_rank)
    merged = {
        "version": ELASTIC_VERSION,
        "kind": "elastic",
        **{key: first[key] for key in ("loader", "dp_world_size", "micro_batch_size", "data", "transform")},
        **source,
    }
    if first["loader"] == "DynamicBatchDataLoader":
        merged["packing"] = _merged_packing(by_rank)
    if any("mixture" in state for state in by_rank):
        merged["mixture"] = _merged_mixture(by_rank)
    return merged


def rank_state(merged: Mapping, source, layout, policy=None) -> tuple[dict, DecodedSamples | None]:
    """This rank's ordinary loader state from an elastic one: its share of what is left of the merged epoch, and
    (with a policy) its buffered samples as read again, the codec for the policy's load.

    Args:
        merged: from ``merge_rank_states``.
        source: the loader's key source: a mapping source's sampler places the replayed records in the epoch and
            its dataset reads the buffered samples again; a stream's cursor reads the old ranks' shares.
        layout: the loader's ``BatchLayout`` (this rank and the new DP size).
        policy: the dynamic loader's packing policy (its ``cost`` of the buffered samples); None for the fixed one.

    Raises:
        ResumeStateError: a malformed elastic state, other data, another source kind, sampler or stream settings
            this loader does not have, or a replayed record that is not left in the epoch.
    """
    check_state_type(merged, Mapping, _WHERE)
    if state_field(merged, "version", int, _WHERE) != ELASTIC_VERSION:
        raise ResumeStateError(
            f"elastic state version {merged['version']!r} is not supported (expected {ELASTIC_VERSION}); merge the "
            "ranks' states again with this release"
        )
    source.check_kind(state_field(merged, "source_kind", str, _WHERE), _WHERE)
    check_same_data(state_field(merged, "data", (Mapping, None), _WHERE), source.identities[0], f"{_WHERE}['data']")
    epoch = state_field(merged, "epoch", int, _WHERE)
    if source.kind == "mapping":
        source_state, reads_on = _mapping_source_state(merged, source, epoch)
    elif "mixture_stream" in merged:
        source_state, reads_on = _mixture_stream_source_state(merged, layout, epoch)
    else:
        source_state, reads_on = _stream_source_state(merged, source, layout, epoch)
    state = {
        **envelope(state_field(merged, "loader", str, _WHERE), layout, (merged["data"], merged["transform"])),
        "source": source_state,
    }
    if "mixture" in merged:
        state["mixture"] = _rank_mixture(merged, layout)
    if policy is not None:
        packing = state_field(merged, "packing", Mapping, _WHERE)
        buffer = state_field(packing, "buffer", list, f"{_WHERE}['packing']")
        share = buffer[layout.dp_rank :: layout.dp_world_size]
        entries = source.decode_samples(share, f"{_WHERE}['packing']['buffer']")
        tokens = sum(policy.cost(sample) for _, sample in entries)
        state.update(
            flushing=not reads_on,
            buffered_samples=len(share),
            packing={**packing, "buffer": share, "buffer_tokens": tokens},
        )
        return state, DecodedSamples(share, entries)
    return state, None


def _rank_mixture(merged: Mapping, layout) -> dict:
    """This rank's ``mixture`` part of an elastic state over a mixture: the plan, and the old ranks' tally on new
    rank 0 only (the others count from 0), so that the new ranks' tallies still sum to what the run delivered."""
    mixture = state_field(merged, "mixture", Mapping, _WHERE)
    if layout.dp_rank == 0:
        return dict(mixture)
    sources = state_field(mixture, "sources", Mapping, f"{_WHERE}['mixture']")
    zero = {}
    for name, counts in sources.items():
        check_state_type(counts, Mapping, f"{_WHERE}['mixture']['sources'][{name!r}]")
        zero[name] = {"weight": counts.get("weight"), "samples": 0, "tokens": 0}
    return {**mixture, "batches": 0, "sources": zero}


class DecodedSamples:
    """A codec that gives back samples already read again (this rank's share, read to count its tokens), so that
    the packing policy's load does not read them a second time."""

    def __init__(self, saved: list, entries: list) -> None:
        self.saved, self.entries = saved, entries

    def decode_samples(self, saved: list, where: str) -> list:
        if saved != self.saved:
            raise ResumeStateError(f"{where} is not the buffer share of the elastic state")
        return self.entries


def _mapping_source_state(merged: Mapping, source, epoch: int) -> tuple[dict, bool]:
    """A mapping source's state for this rank, and whether it has positions of the epoch left to read."""
    sampler = source.sampler
    # The same order (sampler type, seed, records, map); the global batch size may change with the DP size, as the
    # positions left are given, not cut by it.
    saved = {**state_field(merged, "sampler", Mapping, _WHERE), "global_batch_size": sampler.global_batch_size}
    sampler.check_state(saved)
    positions = sampler.saved_remaining(saved)
    if positions is None:
        raise ResumeStateError(f"{_WHERE}['sampler'] has no 'remaining' positions; merge the ranks' states again")
    replay = state_field(merged, "replay", list, _WHERE)
    source.check_keys(replay, f"{_WHERE}['replay']")
    positions = _with_replayed(positions, replay, sampler, epoch, _epoch_len(saved))
    position = {**sampler.state_dict(), "epoch": epoch if len(positions) else epoch + 1, "consumed_samples": 0}
    position.pop("remaining", None)
    if len(positions):
        position["remaining"] = remaining_bitmap(positions, sampler.total_samples)
    return {"kind": source.kind, "position": position, "replay": [], "replay_epoch": None}, bool(len(positions))


def _stream_source_state(merged: Mapping, source, layout, epoch: int) -> tuple[dict, bool]:
    """A stream's state for this rank: a handover cursor over the old ranks' shares, and its share of the records
    they had read but not delivered, read again first."""
    stream, where = source.stream, f"{_WHERE}['stream']"
    saved = state_field(merged, "stream", Mapping, _WHERE)
    for key in ("seed", "shuffle_buffer_size"):
        if state_field(saved, key, int, where) != getattr(stream, key):
            raise ResumeStateError(
                f"cannot resume the stream of {stream.description}: the elastic state has {key}={saved[key]!r} but "
                f"this run has {getattr(stream, key)!r}; resume with the same value, or start without the state"
            )
    position = handover_cursor(
        epoch=epoch,
        dp_rank=layout.dp_rank,
        dp_world_size=layout.dp_world_size,
        seed=stream.seed,
        shuffle_buffer_size=stream.shuffle_buffer_size,
        shares=state_field(saved, "shares", list, where),
        base_world_size=state_field(saved, "base_world_size", int, where),
        levels=state_field(saved, "levels", list, where),
    )
    records = state_field(merged, "records", list, _WHERE)[layout.dp_rank :: layout.dp_world_size]
    return _read_again_first(position, [[index, record] for index, record in enumerate(records)], layout, epoch), True


def _mixture_stream_source_state(merged: Mapping, layout, epoch: int) -> tuple[dict, bool]:
    """A mixture stream's state for this rank: its cursor over every source's handed-over pass
    (``mixture_handover``), and its share of the keys the old ranks had read but not delivered, read again first."""
    position = rank_cursor(state_field(merged, "mixture_stream", Mapping, _WHERE), layout.dp_rank, layout.dp_world_size)
    keys = state_field(merged, "records", list, _WHERE)[layout.dp_rank :: layout.dp_world_size]
    return _read_again_first(position, keys, layout, epoch), True


def _read_again_first(position: dict, keys: list, layout, epoch: int) -> dict:
    """A stream's source state: its cursor, and ``keys`` to read again first, in micro-batches."""
    size = layout.micro_batch_size
    replay = [keys[start : start + size] for start in range(0, len(keys), size)]
    return {"kind": "iterable", "position": position, "replay": replay, "replay_epoch": epoch if replay else None}


# Merging ---------------------------------------------------------------------------------------------------------


def _common_envelope(states: list[dict]) -> dict:
    """The envelope fields every state must share, from the first state, checked against the others."""
    first = states[0]
    for key, expected in (("loader", str), ("dp_world_size", int), ("micro_batch_size", int), ("source", Mapping)):
        for state in states:
            state_field(state, key, expected, "a rank's loader state")
    if first["source"].get("kind") not in ("mapping", "iterable"):
        raise ResumeStateError(
            f"merge_rank_states merges states of loaders over a mapping or iterable source, got a source of kind "
            f"{first['source'].get('kind')!r}"
        )
    for position, state in enumerate(states[1:], start=1):
        for key in ("loader", "dp_world_size", "micro_batch_size", "data", "transform"):
            if state.get(key) != first.get(key):
                raise ResumeStateError(
                    f"the loader states given to merge_rank_states differ in {key!r} (state 0 has "
                    f"{_shown(first.get(key))}, state {position} has {_shown(state.get(key))}): they are not the "
                    "states of one run; give every rank's state saved at the same step"
                )
        if state["source"].get("kind") != first["source"]["kind"]:
            raise ResumeStateError(
                f"state {position} given to merge_rank_states is over a source of another kind than state 0's"
            )
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
    for keys in _replay(state, rank):
        for index, key in enumerate(keys):
            check_state_type(key, int, f"DP rank {rank}'s replayed key {index}")
    return sampler


def _replay(state: Mapping, rank: int) -> list[list]:
    """A rank's replayed key batches, checked to be lists, and its ``replay_epoch``."""
    where = f"DP rank {rank}'s loader state['source']"
    replay = state_field(state["source"], "replay", list, where)
    for index, keys in enumerate(replay):
        check_state_type(keys, list, f"{where}['replay'][{index}]")
    state_field(state["source"], "replay_epoch", (int, None), where)
    return replay


def _merge_mapping(states: list[dict]) -> dict:
    """The mapping part of an elastic state: the positions left as the sampler's bitmap, the replayed records."""
    samplers = [_sampler_state(state, rank) for rank, state in enumerate(states)]
    settings = _sampler_settings(samplers[0])
    for rank, sampler in enumerate(samplers[1:], start=1):
        changed = [key for key, value in _sampler_settings(sampler).items() if settings.get(key) != value]
        if changed:
            shown = ", ".join(f"{key} {settings.get(key)!r} and {sampler[key]!r}" for key in changed)
            raise ResumeStateError(
                f"the batch sampler settings of DP rank 0 and DP rank {rank} differ ({shown}): the states are not of "
                "one run; give every rank's state saved at the same step"
            )
    epoch = _merged_epoch(
        states,
        [(s["epoch"], s["consumed_samples"] == 0 and s.get("remaining") is None) for s in samplers],
    )
    left, replay = [], []
    for rank, (state, sampler) in enumerate(zip(states, samplers, strict=True)):
        replay += [index for keys in _replayed_in(state, epoch) for index in keys]
        if sampler["epoch"] == epoch:
            left.append(
                pending_positions(
                    _sampler_plan(sampler),
                    sampler["consumed_samples"],
                    micro_batch_size=sampler["micro_batch_size"],
                    dp_rank=rank,
                    dp_world_size=sampler["dp_world_size"],
                )
            )
    positions = np.sort(np.concatenate(left)) if left else np.zeros(0, dtype=np.int64)
    merged_sampler = {**samplers[0], "epoch": epoch, "consumed_samples": 0}
    merged_sampler["remaining"] = remaining_bitmap(positions, samplers[0]["total_samples"])
    return {"source_kind": "mapping", "epoch": epoch, "sampler": merged_sampler, "replay": replay}


def _merge_streams(states: list[dict]) -> dict:
    """The stream part of an elastic state: each old rank's share from its cursor on, and the records the ranks
    had read but not delivered (the replayed ones, the cursor's current block and shuffle buffer), in rank order."""
    cursors = []
    for rank, state in enumerate(states):
        where = f"DP rank {rank}'s loader state['source']"
        cursor = state_field(state["source"], "position", Mapping, where)
        cursors.append(
            checked_cursor(
                cursor, rank, state["dp_world_size"], cursors[0] if cursors else None, f"{where}['position']"
            )
        )
        _check_replayed_pairs(state, rank)
    epoch = _merged_epoch(states, [(c["epoch"], cursor_at_start(c)) for c in cursors])
    stream, unread = merged_handover(cursors, [cursor["epoch"] == epoch for cursor in cursors])
    records = []
    for state, rank_unread in zip(states, unread, strict=True):
        records += [record for keys in _replayed_in(state, epoch) for _, record in keys] + rank_unread
    return {"source_kind": "iterable", "epoch": epoch, "stream": stream, "records": records}


def _merge_mixture_streams(states: list[dict]) -> dict:
    """The part of an elastic state over a mixture with a streaming source: the ranks' mixture cursors merged
    source by source (``mixture_handover``), and the keys they had read but not delivered, in rank order."""
    cursors = []
    for rank, state in enumerate(states):
        cursors.append(state_field(state["source"], "position", Mapping, f"DP rank {rank}'s loader state['source']"))
        _check_replayed_pairs(state, rank)
        state_field(cursors[-1], "epoch", int, f"DP rank {rank}'s mixture stream cursor")
        state_field(cursors[-1], "position", int, f"DP rank {rank}'s mixture stream cursor")
    epoch = _merged_epoch(states, [(cursor["epoch"], cursor["position"] == 0) for cursor in cursors])
    plan = state_field(state_field(states[0], "mixture", Mapping, "DP rank 0's loader state"), "plan", Mapping, _WHERE)
    keys = [key for state in states for batch in _replayed_in(state, epoch) for key in batch]
    return {
        "source_kind": "iterable",
        "epoch": epoch,
        "mixture_stream": merged_cursors(cursors, plan, epoch),
        "records": keys,
    }


def _check_replayed_pairs(state: Mapping, rank: int) -> None:
    """A stream rank's replayed keys: (position or sample number, record or payload) pairs."""
    for keys in _replay(state, rank):
        for index, key in enumerate(keys):
            check_state_type(key, (list, tuple), f"DP rank {rank}'s replayed key {index}")
            if len(key) != 2 or not isinstance(key[1], Mapping):
                raise ResumeStateError(f"DP rank {rank}'s replayed key {index} is not a (position, record) pair")


def _replayed_in(state: Mapping, epoch: int) -> list[list]:
    """The key batches a rank had read but not delivered in ``epoch``."""
    source = state["source"]
    return source["replay"] if source["replay"] and source["replay_epoch"] == epoch else []


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


def _open_epoch(state: Mapping, source_epoch: int, at_start: bool) -> tuple[int, bool]:
    """The epoch a rank's state is in, and whether it is at that epoch's very start (nothing read or buffered);
    ``source_epoch`` and ``at_start``: where its sampler or stream cursor is."""
    source = state["source"]
    if source["replay"]:
        return source["replay_epoch"], False
    if state.get("flushing", False):  # the source has moved on; the buffer is the end of the epoch before
        return source_epoch - 1, False
    return source_epoch, at_start and not state.get("buffered_samples")


def _merged_epoch(states: list[dict], positions: list[tuple[int, bool]]) -> int:
    """The epoch the ranks are in: the earliest; a rank may only be past it at the very start of the next
    (``positions``: each rank's source epoch and whether its source is at that epoch's start)."""
    opened = [_open_epoch(state, *position) for state, position in zip(states, positions, strict=True)]
    epoch = min(rank_epoch for rank_epoch, _ in opened)
    for rank, (rank_epoch, fresh) in enumerate(opened):
        if rank_epoch != epoch and not (rank_epoch == epoch + 1 and fresh):
            raise ResumeStateError(
                f"DP rank {rank}'s state is in epoch {rank_epoch}, past epoch {epoch} of another rank's: the states "
                "must be saved at the same step, with every rank in the same epoch (or at the start of the next)"
            )
    return epoch


def _merged_packing(states: list[dict]) -> dict:
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


def _merged_mixture(states: list[dict]) -> dict:
    """The ranks' ``mixture`` parts as one: their plan (the same on every rank) and their tallies summed."""
    plan, batches, sources = None, 0, {}
    for rank, state in enumerate(states):
        where = f"DP rank {rank}'s loader state['mixture']"
        if "mixture" not in state:
            raise ResumeStateError(
                f"DP rank {rank}'s loader state has no mixture part, the state of another rank has one: the states are "
                "not of one run"
            )
        mixture = state_field(state, "mixture", Mapping, f"DP rank {rank}'s loader state")
        rank_plan = state_field(mixture, "plan", Mapping, where)
        if plan is None:
            plan = rank_plan
        elif rank_plan != plan:
            raise ResumeStateError(
                f"the mixture plan of DP rank {rank} differs from DP rank 0's (their segments or sources differ): "
                "the states are not of one run at one step; give every rank's state saved at the same step"
            )
        batches += state_field(mixture, "batches", int, where)
        for name, counts in state_field(mixture, "sources", Mapping, where).items():
            check_state_type(counts, Mapping, f"{where}['sources'][{name!r}]")
            total = sources.setdefault(name, {"weight": counts.get("weight"), "samples": 0, "tokens": 0})
            for key in ("samples", "tokens"):
                total[key] += state_field(counts, key, int, f"{where}['sources'][{name!r}]")
    return {"batches": batches, "sources": sources, "plan": plan}


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
