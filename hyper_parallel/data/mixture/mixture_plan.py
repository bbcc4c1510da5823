"""A mixture's plan: the segments of its order, so that a run may change its weights or sources and continue.

Owns: ``MixturePlan``, the segments a mixture's sample numbers fall in (each ``[start, start + length)`` drawn by
its own ``MixtureOrder`` over the weights it began with, and every source's count of samples before it), the plan
as a loader state keeps it (``state['mixture']['plan']``) and reading it back, what differs between a saved plan
and the mixture built now, and the plan that continues a saved one from a resume point with the new weights. Not
responsible for: which record a source's ``c``-th sample is (``build_mixture``), or where a loader resumes (the
loaders: the sample number their sampler has reached).

A source's ``c``-th sample is the same record in every segment (its epochs are keyed by its name), so a source
that keeps its count across a change continues its own order: no sample of it repeats or is skipped. A source no
longer mixed keeps its count in every later segment's offsets, so adding it back continues it; a new source
starts at 0. State layout::

    {"strategy", "on_exhausted", "shuffle", "seed",
     "known": {name: {"budget": samples before it is exhausted, "data": its data fingerprint}},
     "segments": [{"start", "length", "weights": {name: weight}, "budgets": {name: samples left | None},
                   "offsets": {name: samples before start}}]}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hyper_parallel.data.errors import DataConfigError, ResumeStateError
from hyper_parallel.data.mixture.mixture_order import MixtureOrder
from hyper_parallel.data.resume_checks import check_state_type, state_field

__all__ = ["MixturePlan", "MixtureSegment", "check_change", "check_reading", "check_settings", "mixture_differences"]

_WHERE = "state['mixture']['plan']"
SETTINGS = ("strategy", "on_exhausted", "shuffle", "seed")


@dataclass(frozen=True)
class MixtureSegment:
    """The sample numbers ``[start, start + len(order))``, drawn by ``order`` over the sources still to give."""

    start: int
    weights: dict[str, float]  # the mixture's sources from ``start`` on and their weights
    budgets: dict[str, int | None]  # what each may still give from ``start`` (None: it restarts, never runs out)
    offsets: dict[str, int]  # every source known so far: its samples before ``start``
    order: MixtureOrder  # over ``drawn``, the sources of ``weights`` with samples left

    @property
    def drawn(self) -> list[str]:
        return _drawn(self.budgets)

    @property
    def stop(self) -> int:
        return self.start + len(self.order)

    def counts_at(self, number: int) -> dict[str, int]:
        """Every known source's samples before sample number ``number`` (in this segment, or at its end)."""
        counts = dict(self.offsets)
        for name, count in zip(self.drawn, self.order.counts_before(number - self.start).tolist(), strict=True):
            counts[name] = counts.get(name, 0) + count
        return counts

    def state(self) -> dict:
        return {
            "start": self.start,
            "length": len(self.order),
            "weights": dict(self.weights),
            "budgets": dict(self.budgets),
            "offsets": dict(self.offsets),
        }


def _drawn(budgets: Mapping[str, int | None]) -> list[str]:
    """The sources with samples left to give (a budget of None never runs out)."""
    return [name for name, left in budgets.items() if left is None or left > 0]


def _segment(start, weights, budgets, offsets, settings: Mapping, num_samples: int | None) -> MixtureSegment:
    drawn = _drawn(budgets)
    if not drawn:
        raise DataConfigError(
            f"from sample {start:,} on, no source of the mixture has samples left to give (every one has given its "
            "epochs or max_samples); raise a source's epochs or max_samples, or add a source"
        )
    order = MixtureOrder(
        [weights[name] for name in drawn],
        [budgets[name] for name in drawn],
        strategy=settings["strategy"],
        on_exhausted=settings["on_exhausted"],
        seed=settings["seed"],
        num_samples=num_samples,
    )
    return MixtureSegment(start, dict(weights), dict(budgets), dict(offsets), order)


class MixturePlan:
    """The segments of a mixture's order and what is known of each source it has mixed.

    Args:
        segments: in order of their starts, the first at 0, each starting where the one before is cut.
        known: per source ever mixed, its budget and data fingerprint (``{"budget", "data"}``).
        settings: the mixture's ``strategy``, ``on_exhausted``, ``shuffle`` and ``seed``.
    """

    def __init__(self, segments: Sequence[MixtureSegment], known: Mapping[str, Mapping], settings: Mapping) -> None:
        self.segments = list(segments)
        self.known = {name: dict(entry) for name, entry in known.items()}
        self.settings = dict(settings)
        self.starts = np.array([segment.start for segment in self.segments], dtype=np.int64)

    @classmethod
    def single(cls, order: MixtureOrder, weights: Mapping[str, float], known: Mapping, settings: Mapping):
        """The plan of a mixture as built: one segment from 0."""
        budgets = {name: None if order.budgets[i] is None else int(order.budgets[i]) for i, name in enumerate(weights)}
        segment = MixtureSegment(0, dict(weights), budgets, dict.fromkeys(weights, 0), order)
        return cls([segment], known, settings)

    def __len__(self) -> int:
        return self.segments[-1].stop

    def state_dict(self) -> dict:
        return {
            **self.settings,
            "known": {name: dict(entry) for name, entry in self.known.items()},
            "segments": [segment.state() for segment in self.segments],
        }

    # Resuming ---------------------------------------------------------------------------------------------------

    @classmethod
    def from_state(cls, saved, settings: Mapping) -> MixturePlan:
        """The plan a state holds, checked and its orders planned again (with ``settings``, checked equal)."""
        check_state_type(saved, Mapping, _WHERE)
        check_settings(saved, settings)
        known = state_field(saved, "known", Mapping, _WHERE)
        for name, entry in known.items():
            where = f"{_WHERE}['known'][{name!r}]"
            check_state_type(entry, Mapping, where)
            state_field(entry, "budget", int, where)
            state_field(entry, "data", str, where)
        segments, start = [], 0
        for position, entry in enumerate(state_field(saved, "segments", list, _WHERE)):
            where = f"{_WHERE}['segments'][{position}]"
            check_state_type(entry, Mapping, where)
            if state_field(entry, "start", int, where) != start:
                raise ResumeStateError(f"{where} starts at {entry['start']}, not at {start}; the checkpoint is damaged")
            weights = state_field(entry, "weights", Mapping, where)
            budgets = state_field(entry, "budgets", Mapping, where)
            offsets = state_field(entry, "offsets", Mapping, where)
            if set(budgets) != set(weights) or not set(offsets) <= set(known) or not set(weights) <= set(known):
                raise ResumeStateError(f"{where} names sources it does not know; the checkpoint is damaged")
            for name in weights:
                check_state_type(weights[name], (int, float), f"{where}['weights'][{name!r}]")
                check_state_type(budgets[name], (int, None), f"{where}['budgets'][{name!r}]")
            for name in offsets:
                check_state_type(offsets[name], int, f"{where}['offsets'][{name!r}]")
            length = state_field(entry, "length", int, where)
            segments.append(_segment(start, weights, budgets, offsets, settings, length))
            start += length
        if not segments:
            raise ResumeStateError(f"{_WHERE}['segments'] is empty; the checkpoint is damaged")
        return cls(segments, known, settings)

    def differences(self, weights: Mapping[str, float], known: Mapping[str, Mapping]) -> tuple[list, list]:
        """What the mixture built now (``weights``, ``known``) changes of this plan's last segment
        (``mixture_differences``)."""
        return mixture_differences(self.segments[-1].weights, self.known, weights, known)

    def continued(
        self, resume_at: int, weights: Mapping[str, float], known: Mapping[str, Mapping], num_samples: int | None
    ) -> MixturePlan:
        """The plan that keeps this one before sample number ``resume_at`` and draws ``weights`` from there, every
        source continuing from its count at ``resume_at``.

        Args:
            num_samples: the new mixture's length (None: where its sources run out).
        """
        if not 0 <= resume_at <= len(self):
            raise ResumeStateError(
                f"the state resumes at sample {resume_at:,} of a mixture of {len(self):,}; the checkpoint is damaged"
            )
        index = int(np.searchsorted(self.starts, resume_at, side="right")) - 1
        counts = self.segments[index].counts_at(resume_at)
        kept = [segment for segment in self.segments[:index] if segment.start < resume_at]
        if self.segments[index].start < resume_at:
            cut = self.segments[index]
            kept.append(
                _segment(cut.start, cut.weights, cut.budgets, cut.offsets, self.settings, resume_at - cut.start)
            )
        all_known = {**self.known, **{name: dict(entry) for name, entry in known.items()}}
        offsets = {name: counts.get(name, 0) for name in all_known}
        restart = self.settings["on_exhausted"] == "restart"
        budgets = {name: None if restart else known[name]["budget"] - offsets[name] for name in weights}
        if num_samples is not None and num_samples <= resume_at:
            raise DataConfigError(
                f"the mixture's num_samples is {num_samples:,}, but the state resumes at sample {resume_at:,}; raise "
                "num_samples to continue with the new mixture"
            )
        length = None if num_samples is None else num_samples - resume_at
        segment = _segment(resume_at, weights, budgets, offsets, self.settings, length)
        return MixturePlan([*kept, segment], all_known, self.settings)


def check_reading(saved, in_order: bool) -> None:
    """Refuse a saved mixture read the other way: in order (with a streaming source) or by plan (without one)."""
    if not isinstance(saved, Mapping) or ("segments" in saved) != in_order:
        return
    saved_as, built_as = ("planned", "read in order") if in_order else ("read in order", "planned")
    raise ResumeStateError(
        f"the state was saved over a mixture {saved_as} ({'with' if saved_as != 'planned' else 'without'} a "
        f"streaming source), but this one is {built_as}; a change keeps the way a mixture is read: keep a "
        "streaming source in a mixture that had one (and none in one that had none), or start without the state"
    )


def check_settings(saved: Mapping, settings: Mapping) -> None:
    """Refuse a saved mixture of another ``strategy``, ``on_exhausted``, ``shuffle`` or seed than ``settings``."""
    for key in SETTINGS:
        if saved.get(key) != settings[key]:
            raise ResumeStateError(
                f"the state was saved over a mixture with {key} {saved.get(key)!r}, but this one has "
                f"{settings[key]!r}; the mixture's order depends on it: resume with {key} "
                f"{saved.get(key)!r}, or start without the state"
            )


def mixture_differences(
    last: Mapping[str, float], known_before: Mapping[str, Mapping], weights: Mapping[str, float], known: Mapping
) -> tuple[list, list]:
    """What a mixture of ``weights`` (its sources' ``known`` budgets and data) changes of one that mixed ``last``
    and knew ``known_before`` (every source it ever mixed).

    Returns:
        ``(changes, refusals)``: new weights, added and removed sources, which a resume may take with the opt-in;
        and changes of a source's data or budget, which no resume takes (its count would name other records).
    """
    changes = [f"{name} is new (weight {weight:g})" for name, weight in weights.items() if name not in last]
    changes += [
        f"{name} is no longer mixed (weight {weight:g})" for name, weight in last.items() if name not in weights
    ]
    changes += [
        f"{name} had weight {last[name]:g}, has {weight:g}"
        for name, weight in weights.items()
        if name in last and last[name] != weight
    ]
    refusals = []
    for name, entry in known.items():
        before = known_before.get(name)
        if before is None:
            continue
        if before["data"] != entry["data"]:
            refusals.append(f"the data of {name} changed (fingerprint {before['data'][:12]}, now {entry['data'][:12]})")
        if before["budget"] != entry["budget"]:
            refusals.append(f"the budget of {name} was {_budget(before['budget'])}, is {_budget(entry['budget'])}")
    return changes, refusals


def _budget(samples: int | None) -> str:
    return "its stream's end" if samples is None else f"{samples:,} samples"


def check_change(changes: Sequence[str], refusals: Sequence[str], allowed: bool) -> None:
    """Refuse a resume over a mixture that changed a source's data or budget (``refusals``), or that changed
    weights or sources (``changes``) without the opt-in (``allowed``), naming each difference."""
    if refusals:
        raise ResumeStateError(
            f"the state was saved over a mixture whose sources were other data: {'; '.join(refusals)}; a "
            "changed mixture may change weights and add or remove sources, not change a source: give the "
            "changed data a new name, resume with the data it was saved with, or start without the state"
        )
    if changes and not allowed:
        raise ResumeStateError(
            f"the state was saved over another mixture: {'; '.join(changes)}; to continue it with this one "
            "(every source from its own position, the new weights from the resume point), set mixture_change: "
            "allow on the mixture node or call load_state_dict(state, allow_mixture_change=True); otherwise "
            "resume with the mixture it was saved with, or start without the state"
        )
