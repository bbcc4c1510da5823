"""Elastic resume of a mixture with a streaming source: the cursors of every old DP rank merged, source by source,
and the cursor a rank of the new DP size continues from.

Owns: checking the old ranks' mixture cursors (``MixtureStream.state_dict()``) against each other, merging them
into what is left of every source's current pass, and the cursor of one new rank. Not responsible for: the loader's
part of an elastic state (its records read but not delivered, its buffered samples, the tally: ``batching.elastic``),
reading a stream's handover (``OnlineIterableDataset``) or a handed-over mapping pass (``MixtureStream``).

What the new ranks continue, ``D`` old ranks to ``D'`` new ones. The promise is set semantics over each old rank's
current pass of each source (the ranks may be in different passes: their shares differ in size): across the change
no record of it is lost and none is given twice. The new ranks give those rests together as one handed-over pass,
then go on with the pass after the furthest one.

    draws          from the furthest old rank's sample number on, with the weights and phase of the mixture (the
                   sources still drawn: those that any old rank still in the epoch draws)
    epoch          the old ranks' epoch (one may be at the very start of the next: its part of the epoch is over);
                   its position is the furthest old rank's, so ``num_samples`` ends it no later than any old rank
    stream source  its old ranks' shares handed over as a plain stream's are (``stream_handover``); the records
                   they had read and not given out (those waiting for a draw, then the stream's current block and
                   shuffle buffer), in rank order, dealt round-robin: record i waits on new rank i mod D'
    mapping source the sample counts of their passes that no old rank has given (rank r of D gives r, r + D, ... of
                   pass p's counts ``p * budget + offset``: those from its count on), kept as a bitmap; new rank r'
                   gives every D'-th of them from the r'-th, in order

A rank past the lowest pass that has taken nothing of its own has ended the pass before and begun nothing: it hands
over nothing. A streaming source with ``max_samples`` gives that many samples of each rank's share per pass: the
samples the old ranks had left (``max_samples`` less each one's count) are dealt as counts, new rank r' giving
``len(range(r', left, D'))`` of its handover (fewer if it runs out first).

Merged cursor (``mixture_stream`` of an elastic state)::

    {"seed", "epoch", "position", "sample", "epoch_over", "active",
     "sources" and "retired": {name: {"passes", "stream": null for a mapping source, else {"epoch", "seed",
                                      "shuffle_buffer_size", "ended": no old rank reads its share any more,
                                      "shares", "base_world_size", "levels" (not when ended)}, "records": [...],
                                      "samples_left": a stream with max_samples},
                                      "left" and "left_from": a mapping source's bitmap and its first count}}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from hyper_parallel.data.errors import ResumeStateError
from hyper_parallel.data.mixture.mixture_stream import CURSOR_VERSION, handed_over_counts
from hyper_parallel.data.parallel.batch_sampler import remaining_bitmap
from hyper_parallel.data.resume_checks import check_state_type, state_field
from hyper_parallel.data.text.online.online_iterable_dataset import epoch_start_cursor, handover_cursor
from hyper_parallel.data.text.online.stream_handover import checked_cursor, cursor_at_start, merged_handover

__all__ = ["merged_cursors", "rank_cursor"]


def merged_cursors(cursors: Sequence[Mapping], plan: Mapping, epoch: int) -> dict:
    """The cursors of every old DP rank (rank order), saved at one step of ``epoch``, merged (module docstring).

    Args:
        cursors: each old rank's ``state['source']['position']``.
        plan: their mixture plan (``state['mixture']['plan']``, the same on every rank): each source's budget.
        epoch: the epoch the ranks are in (``batching.elastic``: a rank may be at the very start of the next).

    Raises:
        ResumeStateError: a malformed cursor, cursors of other ranks, seeds or sources, or a stream read partly
            from a handed-over share and partly from the ranks' own.
    """
    dp_world_size = len(cursors)
    for rank, cursor in enumerate(cursors):
        _check_cursor(cursor, rank, dp_world_size, cursors[0])
    # A cursor past the epoch is at the very start of the next (``batching.elastic``): its part of the epoch is over.
    in_epoch = [cursor for cursor in cursors if cursor["epoch"] == epoch]
    epoch_over = all(cursor["epoch_over"] for cursor in in_epoch)
    names = list(cursors[0]["sources"])
    drawn = {name for cursor in in_epoch if not cursor["epoch_over"] for name in cursor["active"]}
    budgets = _budgets(plan)
    merged = {
        "seed": cursors[0]["seed"],
        "epoch": epoch,
        "position": max((cursor["position"] for cursor in in_epoch), default=0),
        "sample": max(cursor["sample"] for cursor in cursors),
        "epoch_over": epoch_over,
        "active": [] if epoch_over else [name for name in names if name in drawn],
    }
    for part in ("sources", "retired"):
        merged[part] = {
            name: _merged_source(name, [cursor[part][name] for cursor in cursors], budgets, f"['{part}'][{name!r}]")
            for name in cursors[0].get(part, {})
        }
    return merged


def rank_cursor(merged: Mapping, dp_rank: int, dp_world_size: int) -> dict:
    """The mixture cursor of new DP rank ``dp_rank`` of ``dp_world_size`` from a merged one (``merged_cursors``);
    the loader checks it as any saved cursor."""
    where = "the elastic state['mixture_stream']"
    check_state_type(merged, Mapping, where)
    active = state_field(merged, "active", list, where)
    cursor = {
        "version": CURSOR_VERSION,
        "dp_rank": dp_rank,
        "dp_world_size": dp_world_size,
        **{key: state_field(merged, key, int, where) for key in ("seed", "epoch", "position", "sample")},
        "epoch_over": state_field(merged, "epoch_over", bool, where),
        "active": active,
        "phase_start": merged["sample"] if active else None,
    }
    for part in ("sources", "retired"):
        entries = state_field(merged, part, Mapping, where)
        cursor[part] = {
            name: _rank_entry(entry, dp_rank, dp_world_size, f"{where}[{part!r}][{name!r}]")
            for name, entry in entries.items()
        }
    if not cursor["retired"]:
        del cursor["retired"]
    return cursor


# Merging ---------------------------------------------------------------------------------------------------------


def _check_cursor(cursor, rank: int, dp_world_size: int, first) -> None:
    where = f"DP rank {rank}'s mixture stream cursor"
    check_state_type(cursor, Mapping, where)
    if cursor.get("version") != CURSOR_VERSION:
        raise ResumeStateError(
            f"{where} has version {cursor.get('version')!r}, not {CURSOR_VERSION}; it was saved by an incompatible "
            "release: resume with the saved DP size, or start without the states"
        )
    for key in ("dp_rank", "dp_world_size", "seed", "epoch", "position", "sample"):
        state_field(cursor, key, int, where)
    if (cursor["dp_rank"], cursor["dp_world_size"]) != (rank, dp_world_size) or cursor["seed"] != first["seed"]:
        raise ResumeStateError(
            f"{where} is of DP rank {cursor['dp_rank']} of {cursor['dp_world_size']} with seed {cursor['seed']}, not "
            f"of rank {rank} of {dp_world_size} with DP rank 0's seed: the states are not of one run"
        )
    state_field(cursor, "epoch_over", bool, where)
    state_field(cursor, "active", list, where)
    for part in ("sources", "retired"):
        entries = state_field(cursor, part, Mapping, where) if part in cursor or part == "sources" else {}
        if sorted(entries) != sorted(first.get(part, {})):
            raise ResumeStateError(
                f"{where} holds the {part} {sorted(entries)}, DP rank 0's {sorted(first.get(part, {}))}: the states "
                "are not of one run at one step"
            )
        for name, entry in entries.items():
            name_where = f"{where}[{part!r}][{name!r}]"
            check_state_type(entry, Mapping, name_where)
            for key in ("taken", "passes"):
                if state_field(entry, key, int, name_where) < 0:
                    raise ResumeStateError(f"{name_where}[{key!r}] is {entry[key]}; it counts from 0")
            state_field(entry, "ended", bool, name_where)
            for index, waiting in enumerate(state_field(entry, "pending", list, name_where)):
                check_state_type(waiting, Mapping, f"{name_where}['pending'][{index}]")
                state_field(waiting, "record", Mapping, f"{name_where}['pending'][{index}]")
            state_field(entry, "stream", (Mapping, None), name_where)
            if "left" in entry:
                state_field(entry, "left", bytes, name_where)
                state_field(entry, "left_from", int, name_where)


def _budgets(plan) -> dict[str, int | None]:
    """Each source's budget per pass, mixed now or before, from the plan."""
    where = "the states' mixture plan"
    check_state_type(plan, Mapping, where)
    entries = {**(state_field(plan, "known", Mapping, where) if "known" in plan else {})}
    entries.update(state_field(plan, "sources", Mapping, where))
    budgets = {}
    for name, entry in entries.items():
        check_state_type(entry, Mapping, f"{where}[{name!r}]")
        budgets[name] = state_field(entry, "budget", (int, None), f"{where}[{name!r}]")
    return budgets


def _merged_source(name: str, entries: list[Mapping], budgets: Mapping, part: str) -> dict:
    """One source's entries on every old rank merged: the furthest pass, and what each rank had left of its own."""
    if name not in budgets:
        raise ResumeStateError(f"the mixture source {name!r} of the cursors is not in their plan; the state is damaged")
    streamed = entries[0]["stream"] is not None
    if any((entry["stream"] is not None) != streamed for entry in entries):
        raise ResumeStateError(
            f"the mixture source {name!r} is a streaming source on some DP ranks and a mapping source on others: the "
            "states are not of one run"
        )
    cursors = []
    for rank, entry in enumerate(entries):
        if streamed:
            where = f"DP rank {rank}'s mixture stream cursor{part}['stream']"
            first = cursors[0] if cursors else None
            cursors.append(checked_cursor(entry["stream"], rank, len(entries), first, where))
    low = min(entry["passes"] for entry in entries)
    # Each rank gives the rest of its current pass; a rank past the lowest pass that has taken nothing of its own
    # has ended the pass before and begun nothing.
    giving = [entry["passes"] == low or not _at_pass_start(entry) for entry in entries]
    passes = max(entry["passes"] for entry, gives in zip(entries, giving, strict=True) if gives)
    if not streamed:
        return {"passes": passes, "stream": None, **_left_counts(name, entries, giving, budgets[name])}
    merged = {"passes": passes, **_merged_stream(entries, cursors, giving, passes)}
    if budgets[name] is not None:  # max_samples: the samples the old ranks had left of their passes
        sizes = [entry.get("pass_samples", budgets[name]) for entry in entries]
        merged["samples_left"] = sum(
            size - entry["taken"] for size, entry, gives in zip(sizes, entries, giving, strict=True) if gives
        )
    return merged


def _at_pass_start(entry: Mapping) -> bool:
    """Whether a source's entry (its stream cursor checked) has begun its pass and taken nothing of it (nothing
    read ahead either)."""
    stream = entry["stream"]
    fresh = stream is None or (not entry["ended"] and stream["epoch"] == entry["passes"] and cursor_at_start(stream))
    return entry["taken"] == 0 and not entry["pending"] and not entry.get("handed_over") and fresh


def _left_counts(name: str, entries: list[Mapping], giving: list[bool], budget: int) -> dict:
    """The sample counts of a mapping source (pass ``p``'s are ``p * budget + offset``) that the old ranks had left
    of their passes: ``{"left": a bitmap of them, "left_from": the count of its first bit}``."""
    dp_world_size = len(entries)
    left = []
    for rank, (entry, gives) in enumerate(zip(entries, giving, strict=True)):
        if not gives:
            continue
        if "left" in entry:
            share = handed_over_counts(entry["left"], entry["left_from"], rank, dp_world_size)
        else:
            share = entry["passes"] * budget + np.arange(rank, budget, dp_world_size)
        if entry["taken"] > len(share):
            raise ResumeStateError(f"DP rank {rank}'s entry of {name!r} took more than its share; the state is damaged")
        left.append(share[entry["taken"] :])
    counts = np.concatenate(left).astype(np.int64)
    start = int(counts.min()) if len(counts) else 0
    return {
        "left": remaining_bitmap(counts - start, int(counts.max()) - start + 1 if len(counts) else 0),
        "left_from": start,
    }


def _merged_stream(entries: list[Mapping], cursors: list[Mapping], giving: list[bool], passes: int) -> dict:
    """A streaming source's entries (with their checked stream cursors) merged: the handover of what the ranks had
    left of their passes, and the records read and not given out."""
    reading = []
    for rank, (entry, cursor, gives) in enumerate(zip(entries, cursors, giving, strict=True)):
        reads = gives and not entry["ended"]
        # Reading: its stream is in the pass; ended: at the next one's start; past the lowest, not begun: at its own.
        expected = entry["passes"] + (0 if reads or not gives else 1)
        if cursor["epoch"] != expected or (not reads and not cursor_at_start(cursor)):
            raise ResumeStateError(
                f"DP rank {rank}'s stream cursor of a mixture source is in epoch {cursor['epoch']}, which does not "
                f"fit the source's pass {entry['passes']}; the state is damaged"
            )
        reading.append(reads)
    stream, unread = merged_handover(cursors, reading)
    ended = not any(reading)
    records = []
    for entry, gives, rank_unread in zip(entries, giving, unread, strict=True):
        if gives:
            records += [waiting["record"] for waiting in entry["pending"]] + rank_unread
    if ended:
        stream = {key: stream[key] for key in ("seed", "shuffle_buffer_size")}
    return {"stream": {**stream, "epoch": passes + 1 if ended else passes, "ended": ended}, "records": records}


# A new rank's cursor ---------------------------------------------------------------------------------------------


def _rank_entry(entry, dp_rank: int, dp_world_size: int, where: str) -> dict:
    """A source's entry on new rank ``dp_rank``: its pass, nothing taken, its share of what is left."""
    check_state_type(entry, Mapping, where)
    passes = state_field(entry, "passes", int, where)
    stream = state_field(entry, "stream", (Mapping, None), where)
    fresh = {"taken": 0, "passes": passes, "pending": [], "handed_over": True}
    if stream is None:
        left = {
            "left": state_field(entry, "left", bytes, where),
            "left_from": state_field(entry, "left_from", int, where),
        }
        return {**fresh, "ended": False, "stream": None, **left}
    placement = {
        "epoch": state_field(stream, "epoch", int, f"{where}['stream']"),
        "dp_rank": dp_rank,
        "dp_world_size": dp_world_size,
        "seed": state_field(stream, "seed", int, f"{where}['stream']"),
        "shuffle_buffer_size": state_field(stream, "shuffle_buffer_size", int, f"{where}['stream']"),
    }
    ended = state_field(stream, "ended", bool, f"{where}['stream']")
    if ended:
        cursor = epoch_start_cursor(**placement)
    else:
        handover = {key: stream[key] for key in ("shares", "base_world_size", "levels")}
        cursor = handover_cursor(**handover, **placement)
    records = state_field(entry, "records", list, where)
    shared = list(enumerate(records))[dp_rank::dp_world_size]
    pending = [{"position": position, "record": record} for position, record in shared]
    rank_entry = {**fresh, "ended": ended, "pending": pending, "stream": cursor}
    if "samples_left" in entry:
        rank_entry["pass_samples"] = len(range(dp_rank, state_field(entry, "samples_left", int, where), dp_world_size))
    return rank_entry
