"""Catch ranks that were given different settings: every rank raises the same error, naming what differs where.

Owns: comparing the settings that shape a batch across the ranks of a group (``check_ranks_agree``), the canonical
digest of such settings (``settings_digest``), and the one message that names, for every differing field, the
value on every rank.
Not responsible for: which settings shape a batch (the callers: ``build_dataloaders``, ``wrap_data_iterator``), or
waiting for a rank that hangs (``collective_watch.watched``, through which both of its collectives go).

``check_ranks_agree(settings, group=None, what=..., timeout_s=None)``: ``settings`` maps a node name ("dataset",
"collate_fn", "get_batch", "packing_scheduler", "dataloader") to its fields and their values. Values are plain
JSON values (mappings, lists, strings, numbers, None); tuples count as lists, sets are sorted, mappings are
compared field by field (``dataset.data_config.split``), and anything else by its ``repr``, which must then be the
same text on every rank (no memory addresses). Every rank of ``group`` calls it; each all-gathers a fixed-size
digest of its settings (32 bytes and a length: cheap) and only when the digests differ all-gathers the settings
themselves, so that every rank builds the same ``DataConfigError``: ``the ranks disagree on <what>:
get_batch.seq_length: ranks 0-2 have 256, rank 3 has 512; ...`` (at most five fields, then how many more).
Without an initialised process group, inside ``without_rank_collectives``, or over a group of one rank it returns
at once.

A caller that already makes a collective over the group can carry ``settings_digest(settings)`` in it instead, and
call ``check_ranks_agree`` only when the digests it gathered differ, for the message.

``gather_rank_numbers(numbers, what=...)``: every rank's few integers (a loader's epoch and position, so that the
ranks agree on where to resume), through the same watched all-gather; None without an initialised process group,
where each rank decides alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.parallel.build_barrier import ABSENT, gather_device, process_group_ready, short_value
from hyper_parallel.data.parallel.collective_watch import format_ranks, group_ranks, watched

__all__ = ["check_ranks_agree", "gather_rank_numbers", "settings_digest"]

_SHOWN_FIELDS = 5
_DIGEST_BYTES = 32  # sha256


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it, the same on every rank: mappings with text keys, lists, sorted sets."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, set | frozenset):
        return sorted((_plain(item) for item in value), key=repr)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def _canonical(settings: Mapping[str, Mapping[str, Any]]) -> str:
    if not isinstance(settings, Mapping) or not all(isinstance(node, Mapping) for node in settings.values()):
        raise TypeError("check_ranks_agree takes a mapping from node names to mappings of their fields")
    return json.dumps(_plain(settings), sort_keys=True, separators=(",", ":"))


def settings_digest(settings: Mapping[str, Mapping[str, Any]]) -> bytes:
    """32 bytes that are equal on two ranks exactly when their ``settings`` are (key order does not count)."""
    return _digest(_canonical(settings).encode("utf-8"))


def _digest(encoded: bytes) -> bytes:
    return hashlib.sha256(encoded).digest()


def _all_gather(what: str, mine, group, timeout_s: float | None) -> list:
    """Every rank's ``mine`` (a tensor of the same shape everywhere), in group-rank order, through ``watched``."""
    import torch
    import torch.distributed as dist

    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    watched(what, lambda: dist.all_gather(gathered, mine, group=group, async_op=True), group=group, timeout_s=timeout_s)
    return [tensor.cpu() for tensor in gathered]


def _gather_settings(text: str, lengths: list[int], what: str, group, timeout_s: float | None) -> list[dict]:
    """Every rank's settings, decoded from its canonical text."""
    import torch

    encoded = text.encode("utf-8")
    padded = bytearray(encoded) + bytearray(max(lengths) - len(encoded))
    mine = torch.frombuffer(padded, dtype=torch.uint8).to(gather_device(group))
    gathered = _all_gather(f"{what} (the settings)", mine, group, timeout_s)
    return [
        json.loads(bytes(tensor[:length].tolist()).decode("utf-8"))
        for tensor, length in zip(gathered, lengths, strict=True)
    ]


def _flatten(value: Any, path: str, into: dict[str, Any]) -> dict[str, Any]:
    """Every leaf of nested mappings under its dotted path; an empty mapping is a leaf."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{path}.{key}" if path else key, into)
    else:
        into[path] = value
    return into


def _text(value: Any) -> str:
    """A value's canonical text: equal texts are equal values (NaN too), and an absent field has its own."""
    return "(absent)" if value is ABSENT else json.dumps(value, sort_keys=True)


def _field_line(path: str, values: list, ranks: list[int]) -> str:
    """``"<path>: ranks 0-2 have 256, rank 3 has 512"``, ranks with equal values together, first rank first."""
    groups: dict[str, list[int]] = {}
    shown: dict[str, str] = {}
    for rank, value in zip(ranks, values, strict=True):
        key = _text(value)
        groups.setdefault(key, []).append(rank)
        shown[key] = short_value(value)
    parts = [f"{format_ranks(who)} {'has' if len(who) == 1 else 'have'} {shown[key]}" for key, who in groups.items()]
    return f"{path}: " + ", ".join(parts)


def _disagreement(what: str, everyone: list[dict], ranks: list[int]) -> DataConfigError:
    """The one error every rank raises: each differing field with its value on every rank."""
    flat = [_flatten(settings, "", {}) for settings in everyone]
    paths = sorted({path for fields in flat for path in fields})
    lines = []
    for path in paths:
        values = [fields.get(path, ABSENT) for fields in flat]
        if len({_text(value) for value in values}) > 1:
            lines.append(_field_line(path, values, ranks))
    shown = lines[:_SHOWN_FIELDS]
    if len(lines) > _SHOWN_FIELDS:
        shown.append(f"and {len(lines) - _SHOWN_FIELDS} more fields differ")
    return DataConfigError(
        f"the ranks disagree on {what}: " + "; ".join(shown) + ". Every rank must shape the same batches: give "
        "every rank the same config, arguments and environment (the same YAML and overrides on every node)"
    )


def check_ranks_agree(
    settings: Mapping[str, Mapping[str, Any]], *, group=None, what: str, timeout_s: float | None = None
) -> None:
    """Raise the same ``DataConfigError`` on every rank of ``group`` unless all were given equal ``settings``.

    Args:
        settings: node name -> field -> value (see the module docstring for the values it takes).
        group: the process group whose ranks must agree; None for the world.
        what: what is compared, for the messages and the collectives' names ("the batch-shaping settings").
        timeout_s: seconds to wait for the other ranks; None for ``collective_timeout()``.

    Raises:
        DataConfigError: the ranks disagree; names every differing node field and its value on every rank.
        CollectiveTimeout: a rank did not join within the timeout; names it.
    """
    text = _canonical(settings)
    if not process_group_ready():
        return
    ranks = group_ranks(group)
    if len(ranks) == 1:
        return
    import torch

    encoded = text.encode("utf-8")
    header = torch.tensor([*_digest(encoded), *len(encoded).to_bytes(8, "little")], dtype=torch.uint8)
    rows = _all_gather(f"{what} (digests)", header.to(gather_device(group)), group, timeout_s)
    if all(torch.equal(row, rows[0]) for row in rows):
        return
    lengths = [int.from_bytes(bytes(row[_DIGEST_BYTES:].tolist()), "little") for row in rows]
    raise _disagreement(what, _gather_settings(text, lengths, what, group, timeout_s), ranks)


def gather_rank_numbers(
    numbers: Sequence[int], *, what: str, group=None, timeout_s: float | None = None
) -> list[list[int]] | None:
    """Every rank's ``numbers`` (as many integers on every rank of ``group``), in group-rank order.

    Returns:
        One list per rank; None without an initialised process group of more than one rank, or inside
        ``without_rank_collectives``: then there is no one to agree with.

    Raises:
        CollectiveTimeout: a rank did not join within the timeout; names it.
    """
    if not process_group_ready():
        return None
    import torch

    mine = torch.tensor([int(number) for number in numbers], dtype=torch.int64).to(gather_device(group))
    return [row.tolist() for row in _all_gather(what, mine, group, timeout_s)]
