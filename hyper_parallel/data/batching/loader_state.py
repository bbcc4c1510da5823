"""A loader state's envelope: its version, the migration of older versions, and the checks of the loader's fields.

Owns: the fields every loader state has (version, loader, DP placement, micro batch size, the data and transform
it was saved over), building and checking them, and bringing a state saved by an older release to the current
layout (``migrate_loader_state``, the one place that knows old layouts). Not responsible for: the parts other
layers own and check themselves: ``state['source']`` (the read tracker and the key source) and
``state['packing']`` (the dynamic loader's packing policy).

Layout (version 3)::

    {"version": 3, "loader": "FixedBatchDataLoader" | "DynamicBatchDataLoader",
     "dp_rank", "dp_world_size", "micro_batch_size",
     "data": the identity of the data read (or None), "transform": the transform's identity (or None),
     "source": {"kind", "position", "replay", "replay_epoch"},
     dynamic loader only: "flushing", "buffered_samples", "packing": the packing policy's state}

Version 2 kept the source's kind as ``source_type`` beside the envelope and the token batcher's fields
(``token_budget``, ``min_buffered_samples``, ``buffer``, ``buffer_tokens``) at the top level; version 1 is version 2
without ``data`` and ``transform``.
"""

from __future__ import annotations

from collections.abc import Mapping

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import ResumeStateError
from hyper_parallel.data.parallel.batch_sampler import BatchLayout
from hyper_parallel.data.resume_checks import check_same_data, state_field, transform_changes

__all__ = ["STATE_VERSION", "check_envelope", "envelope", "migrate_loader_state"]

logger = get_logger(__name__)

STATE_VERSION = 3
_WHERE = "the loader state"
# The envelope fields every loader state has, and their types (the version and the loader are checked first).
_FIELDS = (("dp_rank", int), ("dp_world_size", int), ("micro_batch_size", int), ("source", Mapping))
# Version 2's token batcher fields, now the policy's own state.
_BATCHER_FIELDS = ("token_budget", "min_buffered_samples", "buffer", "buffer_tokens")


def migrate_loader_state(state, owner: object) -> dict:
    """``state`` in the current layout: a new dict, the saved one unchanged; ``owner`` names the loader in the
    warning a version 1 state gets (it recorded no data to check against).

    Only the layout changes: values are moved as they are, and checked afterwards by the layers that own them.

    Raises:
        ResumeStateError: not a dict, or of a version this release cannot read.
    """
    version = state.get("version") if isinstance(state, Mapping) else None
    if isinstance(version, bool) or version not in (1, 2, STATE_VERSION):
        raise ResumeStateError(
            f"loader state version {version!r} is not supported (expected {STATE_VERSION}, or 1 or 2 of earlier "
            "releases); it was not saved by this loader or by a compatible release"
        )
    state = dict(state)
    if version == 1:
        logger.warning(
            "%r: the state was saved by an older release (version 1) that did not record the data it read, so it "
            "cannot be checked against this data; save a new state to get the check",
            owner,
        )
        state.update(data=None, transform=None)
    if version in (1, 2):
        kind = state.pop("source_type", None)
        if isinstance(state.get("source"), Mapping) and kind is not None:
            state["source"] = {"kind": kind, **state["source"]}
        if state.get("loader") == "DynamicBatchDataLoader":
            packing = {"policy": "TextTokenBatcher"}
            packing.update((key, state.pop(key)) for key in _BATCHER_FIELDS if key in state)
            buffer = packing.get("buffer")
            state.update(packing=packing, buffered_samples=len(buffer) if isinstance(buffer, list) else 0)
        state["version"] = STATE_VERSION
    return state


def envelope(loader: str, layout: BatchLayout, identities: tuple) -> dict:
    """The envelope of a new state; ``identities`` are the data's and the transform's (or None)."""
    data, transform = identities
    return {
        "version": STATE_VERSION,
        "loader": loader,
        "dp_rank": layout.dp_rank,
        "dp_world_size": layout.dp_world_size,
        "micro_batch_size": layout.micro_batch_size,
        "data": data,
        "transform": transform,
    }


def check_envelope(state: Mapping, loader: str, identities: tuple, fields: tuple, owner: object) -> None:
    """Check a migrated state's envelope, the loader's own ``fields`` (``(name, type)`` pairs) and the data it was
    saved over; a changed transform is logged, not refused (``owner`` names the loader in the warning)."""
    if state_field(state, "loader", str, _WHERE) != loader:
        raise ResumeStateError(
            f"the state was saved by a {state['loader']} loader but this is a {loader} one; resume with the same "
            "loader and source type, or start without the state"
        )
    for key, expected in (*_FIELDS, *fields):
        state_field(state, key, expected, _WHERE)
    data, transform = identities
    check_same_data(state_field(state, "data", (Mapping, None), _WHERE), data, f"{_WHERE}['data']")
    saved_transform = state_field(state, "transform", (Mapping, None), _WHERE)
    changes = transform_changes(saved_transform, transform or {}, f"{_WHERE}['transform']")
    if transform and changes:
        logger.warning(
            "%r: the data transform changed since the state was saved (%s); batches from here on follow the new one",
            owner,
            "; ".join(changes),
        )
