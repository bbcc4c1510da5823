"""A stream's elastic handover made from the cursors of every rank of the old DP size, as pure functions of them.

Owns: checking the old ranks' stream cursors (``OnlineIterableDataset.state_dict()``) against each other, whether a
cursor is at the very start of its epoch, and merging the cursors of one epoch into what a handover reads: the old
shares from each cursor on (or one more level of a handover already under way) and the records read but not yet
given out (each cursor's current block and shuffle buffer). Not responsible for: reading a handover or the cursor
a new rank starts it from (``online_iterable_dataset``), the loader's records read but not delivered or the
epoch the ranks are in (``batching.elastic``), or a mixture's sources (``mixture.mixture_handover``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hyper_parallel.data.errors import ResumeStateError
from hyper_parallel.data.resume_checks import check_state_type, state_field

__all__ = ["checked_cursor", "cursor_at_start", "merged_handover"]


def checked_cursor(cursor, rank: int, dp_world_size: int, first: Mapping | None, where: str) -> Mapping:
    """Old DP rank ``rank``'s stream cursor with the fields a merge reads checked: its placement, and the seed and
    shuffle of ``first`` (rank 0's cursor; None for rank 0 itself)."""
    check_state_type(cursor, Mapping, where)
    for key in ("epoch", "position", "dp_rank", "dp_world_size", "seed", "shuffle_buffer_size"):
        state_field(cursor, key, int, where)
    if (cursor["dp_rank"], cursor["dp_world_size"]) != (rank, dp_world_size):
        raise ResumeStateError(f"{where} is the stream cursor of another DP rank; the state is damaged")
    first = cursor if first is None else first
    if (cursor["seed"], cursor["shuffle_buffer_size"]) != (first["seed"], first["shuffle_buffer_size"]):
        raise ResumeStateError(
            f"the stream seed or shuffle_buffer_size of DP rank {rank} differ from DP rank 0's: the states are not of "
            "one run"
        )
    if cursor.get("handover") is not None:
        handover = state_field(cursor, "handover", Mapping, where)
        state_field(handover, "share", int, f"{where}['handover']")
        dealt = state_field(handover, "dealt", list, f"{where}['handover']")
        if not dealt or not all(isinstance(count, int) for count in dealt):
            raise ResumeStateError(f"{where}['handover']['dealt'] must be a list of counts; the state is damaged")
    state_field(cursor, "source_exhausted", bool, where)
    state_field(cursor, "source_state", (Mapping, None), where)
    for key in ("buffer", "block"):
        for index, record in enumerate(state_field(cursor, key, list, where) if key in cursor else []):
            check_state_type(record, Mapping, f"{where}['{key}'][{index}]")
    return cursor


def cursor_at_start(cursor: Mapping) -> bool:
    """Whether a checked cursor has read nothing of its epoch (a handover's cursor is never at the start: it reads
    what the old ranks left)."""
    return (
        cursor["position"] == 0
        and cursor["source_state"] is None
        and not cursor["buffer"]
        and not cursor.get("block")
        and cursor.get("handover") is None
    )


def merged_handover(cursors: Sequence[Mapping], reading: Sequence[bool]) -> tuple[dict, list[list[dict]]]:
    """What the new ranks read from the checked cursors of every old rank, each ``reading`` its share or one done
    with it: ``{"seed", "shuffle_buffer_size", "base_world_size", "shares", "levels"}`` (the arguments of
    ``handover_cursor``), and per cursor the records it had read but not given out."""
    records = []
    for cursor, reads in zip(cursors, reading, strict=True):
        # A handover's block holds records not yet dealt, which the next level deals again: not handed over.
        block = cursor.get("block", []) if cursor.get("handover") is None else []
        records.append([*block, *cursor["buffer"]] if reads else [])
    read_by = [cursor for cursor, reads in zip(cursors, reading, strict=True) if reads]
    handovers = [cursor["handover"] for cursor in read_by if cursor.get("handover") is not None]
    if handovers and len(handovers) != len(read_by):
        raise ResumeStateError(
            "some ranks' streams read a share handed over by a DP change and others their own share: the states are "
            "not of one run at one step; resume with the saved DP size, or save the states at another step"
        )
    stream = {key: cursors[0][key] for key in ("seed", "shuffle_buffer_size")}
    if handovers:
        stream.update(_next_level(handovers[0], cursors, reading))
    else:
        shares = []
        for cursor, reads in zip(cursors, reading, strict=True):
            if reads:
                shares.append({"source_state": cursor["source_state"], "done": cursor["source_exhausted"]})
            else:
                shares.append({"source_state": None, "done": True})
        stream.update(base_world_size=len(cursors), shares=shares, levels=[])
    return stream, records


def _next_level(handover: Mapping, cursors: Sequence[Mapping], reading: Sequence[bool]) -> dict:
    """A handover of a handover: the same old shares, and one more level whose frontiers say, per share and per rank
    of the current DP size, how many of the records dealt to that rank it had read (None: all of them)."""
    frontiers = []
    for share in range(handover["base_world_size"]):
        counts = []
        for cursor, reads in zip(cursors, reading, strict=True):
            if not reads:  # the rank has read its whole part of the handed-over epoch
                counts.append(None)
                continue
            current = cursor["handover"]
            reached = current["share"]
            counts.append(None if share < reached else current["dealt"][-1] if share == reached else 0)
        frontiers.append(counts)
    level = {"deal_world_size": len(cursors), "frontiers": frontiers}
    return {
        "base_world_size": handover["base_world_size"],
        "shares": handover["shares"],
        "levels": [*handover["levels"], level],
    }
