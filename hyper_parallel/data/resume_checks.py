"""Checks on a saved state before anything is restored from it: its fields, and that it was saved over this data.

Owns: reading a field of a saved state with its expected type (a ``ResumeStateError`` naming the key and the type
otherwise), the data identity that loader states record (a fingerprint of what a loader reads, plus short readable
entries that name what changed), the identity of data files (path, size, modification time) and of a transform,
and the message that compares two identities. Not responsible for: what each dataset's identity covers (the
datasets say it) or what each state holds (every stateful layer checks its own part with these helpers).

A data identity is a plain dict, stored in loader states::

    {"source": "/data/train.jsonl",                 what is read, for messages
     "fingerprint": "<md5 hex>",                    equal if and only if the data is the same
     "entries": {"/data/train.jsonl": "4096 bytes, modified 2025-01-02T03:04:05.123456789Z", ...}}

``entries`` only explain a difference; the fingerprint decides it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from numbers import Integral

from hyper_parallel.data.errors import ResumeStateError

__all__ = [
    "check_same_data",
    "check_state_type",
    "data_identity",
    "dataset_identity",
    "file_entries",
    "stable_hash",
    "state_field",
    "transform_changes",
    "transform_identity",
]

# Entries longer than this are shown by their hash; identities with more entries keep only a summary, so that a
# state over thousands of files stays small (the fingerprint still covers every one).
_MAX_ENTRY_CHARS = 96
_MAX_ENTRIES = 64
_TYPE_NAMES = {int: "an integer", bool: "a bool", str: "a string", list: "a list", Mapping: "a dict"}
_FIX = (
    "the checkpoint is damaged or was not written by this library; restore the state as it was saved, or start "
    "without it"
)


# Fields of a saved state ---------------------------------------------------------------------------------------


def check_state_type(value, expected: type | tuple[type | None, ...], name: str) -> None:
    """Raise a ``ResumeStateError`` unless ``value`` is of ``expected`` (``int`` means any integer but a bool).

    ``name`` says where the value sits, e.g. ``"loader state['flushing']"``; ``None`` in ``expected`` allows None.
    """
    kinds = expected if isinstance(expected, tuple) else (expected,)
    if value is None and None in kinds:
        return
    types = tuple(Integral if kind is int else kind for kind in kinds if kind is not None)
    if isinstance(value, types) and (bool in types or not isinstance(value, bool)):
        return
    wanted = " or ".join("None" if kind is None else _TYPE_NAMES.get(kind, kind.__name__) for kind in kinds)
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise ResumeStateError(f"{name} must be {wanted}, got {type(value).__name__} {shown}; {_FIX}")


def state_field(state: Mapping, key: str, expected: type | tuple[type | None, ...], where: str):
    """``state[key]``, checked to be there and of ``expected`` type; ``where`` names the state in messages."""
    if key not in state:
        raise ResumeStateError(f"{where} has no '{key}'; {_FIX}")
    value = state[key]
    check_state_type(value, expected, f"{where}['{key}']")
    return value


# Identities ----------------------------------------------------------------------------------------------------


def stable_hash(value) -> str:
    """The MD5 of ``value``'s compact JSON with sorted keys (values JSON cannot hold are written as ``str``)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


def _readable(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= _MAX_ENTRY_CHARS else f"md5 {stable_hash(value)[:12]}"


def _flattened(values: Mapping, prefix: str = "") -> Iterable[tuple[str, str]]:
    """Nested settings as ``("datasets[0].random_seed", "1234")`` pairs, so that a message can name the one that
    changed."""
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flattened(value, f"{name}.")
        elif isinstance(value, list) and value and all(isinstance(item, Mapping) for item in value):
            for index, item in enumerate(value):
                yield from _flattened(item, f"{name}[{index}].")
        else:
            yield name, _readable(value)


def _readable_entries(entries: Mapping) -> dict[str, str]:
    """Every nested setting when there are few, else the top-level ones, else a summary (states stay small)."""
    flat = dict(_flattened(entries))
    if len(flat) <= _MAX_ENTRIES:
        return flat
    if len(entries) <= _MAX_ENTRIES:
        return {str(key): _readable(value) for key, value in entries.items()}
    return {f"{len(entries)} entries": f"md5 {stable_hash(entries)[:12]}"}


def data_identity(source: str, entries: Mapping[str, object], fingerprint: str | None = None) -> dict:
    """The identity of what a dataset reads.

    Args:
        source: what is read, for messages (files, a prefix).
        entries: what the data consists of; the state keeps them readable (or hashed when long or many).
        fingerprint: decides sameness; default: the hash of ``entries``.
    """
    return {
        "source": source,
        "fingerprint": fingerprint or stable_hash(entries),
        "entries": _readable_entries(entries),
    }


def file_entries(files: Iterable[str | os.PathLike]) -> dict[str, str]:
    """``{path: "<size> bytes, modified <UTC time to the nanosecond>"}`` of each file, or ``"missing"``."""
    entries = {}
    for path in files:
        try:
            status = os.stat(path)
        except OSError:
            entries[os.fspath(path)] = "missing"
            continue
        seconds, nanoseconds = divmod(status.st_mtime_ns, 10**9)
        when = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        entries[os.fspath(path)] = f"{status.st_size} bytes, modified {when}.{nanoseconds:09d}Z"
    return entries


def _indexed_source(identifiers: Mapping) -> str:
    kind = identifiers.get("class", "Indexed dataset")
    if identifiers.get("dataset_path") is not None:
        return f"{kind} of {identifiers['dataset_path']} ({identifiers.get('index_split', 'all')} split)"
    members = identifiers.get("datasets")
    if isinstance(members, list):
        return f"{kind} of {len(members)} datasets ({identifiers.get('split', 'all')} split)"
    return str(kind)


def dataset_identity(dataset) -> dict | None:
    """What ``dataset`` reads: its own ``data_identity()`` (Online datasets), or for Indexed datasets their cache
    identity (``unique_identifiers``: files, seed, split, sizes, tokenizer); None for a dataset without either."""
    own = getattr(dataset, "data_identity", None)
    if callable(own):
        return own()
    identifiers = getattr(dataset, "unique_identifiers", None)
    if isinstance(identifiers, Mapping):
        return data_identity(_indexed_source(identifiers), identifiers, stable_hash(identifiers))
    return None


def transform_identity(transform) -> dict[str, str]:
    """The transform's settings (its ``repr``, when it defines one) and its tokenizer's content fingerprint."""
    named = transform if inspect.isroutine(transform) else type(transform)
    if named is transform or named.__repr__ is object.__repr__:  # a default repr would hold a memory address
        entries = {"transform": f"{named.__module__}.{named.__qualname__}"}
    else:
        entries = {"transform": repr(transform)}
    tokenizer = getattr(getattr(transform, "tokenizer", None), "fingerprint", None)
    if isinstance(tokenizer, str):
        entries["tokenizer"] = tokenizer
    return entries


# Comparing -----------------------------------------------------------------------------------------------------


def _differences(saved: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    found = []
    for key in sorted(set(saved) | set(current)):
        before, after = saved.get(key), current.get(key)
        if before == after:
            continue
        if before is None:
            found.append(f"{key} is new ({after})")
        elif after is None:
            found.append(f"{key} is no longer read (was {before})")
        else:
            found.append(f"{key} was {before}, is now {after}")
    return found


def _check_identity_fields(identity: Mapping, name: str) -> None:
    check_state_type(identity, Mapping, name)
    for key in ("source", "fingerprint"):
        state_field(identity, key, str, name)
    entries = state_field(identity, "entries", Mapping, name)
    for key, value in entries.items():
        check_state_type(value, str, f"{name}['entries'][{key!r}]")


def check_same_data(saved: Mapping | None, current: Mapping | None, name: str) -> None:
    """Refuse a state saved over other data than ``current``, naming what changed.

    Args:
        saved: the identity in the state (checked for its fields first); None when the state recorded none.
        current: the identity of what this loader reads; None when the dataset has none (nothing to compare).
        name: where ``saved`` sits in the state, for messages.
    """
    if saved is None or current is None:
        return
    _check_identity_fields(saved, name)
    if saved["fingerprint"] == current["fingerprint"]:
        return
    changes = "; ".join(_differences(saved["entries"], current["entries"]) or ["their fingerprints differ"])
    before, after = saved["fingerprint"][:12], current["fingerprint"][:12]
    if saved["source"] == current["source"]:
        what = f"{saved['source']} (fingerprint {before}), which has changed since (fingerprint now {after})"
    else:
        what = f"{saved['source']} (fingerprint {before}) but this loader reads {current['source']} ({after})"
    raise ResumeStateError(
        f"the state was saved over {what}: {changes}. Resume with the same data, or start without the state"
    )


def transform_changes(saved: Mapping | None, current: Mapping[str, str], name: str) -> list[str]:
    """What differs between the saved transform identity and ``current`` (checked for its fields first)."""
    if saved is None:
        return []
    check_state_type(saved, Mapping, name)
    for key, value in saved.items():
        check_state_type(value, str, f"{name}[{key!r}]")
    return _differences(saved, current)
