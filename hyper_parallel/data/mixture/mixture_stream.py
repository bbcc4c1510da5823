"""A mixture with a streaming source, read in order: ``StreamMixture`` (the dataset) and ``MixtureStream`` (its cursor).

Owns: reading the samples of a mixture with at least one streaming (iterable) Online source in the loader's main
process, as a loader reads any stream (``key_sources.StreamKeys``: the records travel to the workers, which only
transform them); what a source's end does (``on_exhausted``); the cursor a loader state keeps, checked and
restored exactly, and continued over a changed mixture (``mixture_change: allow``); and the ``where`` of each
record. Not responsible for: the draws (``mixture_order.SourceDraws``),
which record a mapping source's ``c``-th sample is (``build_mixture.MixedSources``), reading or shuffling a stream
(``OnlineIterableDataset``), or batching (the loaders).

How it reads. Sample ``n`` of the mixture (``n`` counts every sample of the run, across its epochs) draws its
source as a planned mixture's sample ``n`` does (weighted: a Philox uniform keyed by the seed and ``n // 4096``;
interleave: the smooth weighted round robin), and takes that source's next sample:

* a stream: the next record of its own cursor (this DP rank's share, its shuffle buffer, its passes as the
  stream's epochs), read ahead as needed; records read for samples after a source's end wait in the cursor;
* a mapping or Indexed source: on DP rank ``r`` of ``D``, the records ``r, r + D, ...`` of each pass (its budget:
  ``epochs`` or ``max_samples``), each pass in its own shuffled order, as in a planned mixture.

Every DP rank draws the same sources and reads its own share of each, so the order depends on the config, the seed
and the DP size, never on the workers. A source's pass ends where a stream's share ends (or after its
``max_samples``) and where a mapping source's pass is read; the sample that finds it empty decides, by
``on_exhausted``: ``stop`` ends the mixture's epoch there; ``reweight`` goes on without that source, the other
weights renormalised (the draws' new phase starts at that sample), and ends the epoch when every source has ended;
``restart`` goes on. In every mode the source that ended begins its next pass (a stream its next epoch, with its
own shuffle), and the next epoch of the mixture continues every source where it is. ``num_samples`` ends an epoch
after that many samples (required with ``restart``).

A changed mixture (other weights, a source added or removed) continues a cursor from its sample number: the draws
from there use the new weights, every source mixed before keeps its entry, an added source starts at its
beginning, and a removed one's entry waits in ``retired`` until it is added back. The loader leaves out the
samples of a removed source it had read before the resume point (said with their count).

Cursor (``state['source']['position']`` of a loader state)::

    {"version", "dp_rank", "dp_world_size", "seed", "epoch", "position": samples given in the epoch,
     "sample": the next sample number, "epoch_over": the epoch ended with the last read,
     "phase_start": where the draws' phase began, "active": the sources it draws,
     "sources": {name: {"taken": samples given in its pass, "passes": passes ended, "ended": its stream's share
                        has ended (after the records still waiting), "pending": [{"position", "record"}] read ahead,
                        "stream": its stream's cursor (None for a mapping source),
                        "handed_over": true when its pass was handed over by a DP change (only then), "left" and
                        "left_from": a mapping source's handed-over sample counts, a bitmap from that count, of
                        which this rank gives every dp_world_size-th, "pass_samples": a stream with max_samples:
                        this rank's samples of the handed-over pass}},
     "retired": {name: the entry of a source mixed before and no longer (only after such a change)}}
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError, ResumeStateError
from hyper_parallel.data.mixture.build_mixture import MixedSources, MixtureSource
from hyper_parallel.data.mixture.mixture_order import SourceDraws, ranks_within
from hyper_parallel.data.mixture.mixture_plan import check_change, check_reading, check_settings, mixture_differences
from hyper_parallel.data.parallel.batch_sampler import bitmap_positions
from hyper_parallel.data.resume_checks import check_state_type, data_identity, state_field
from hyper_parallel.data.text.transform_dataset import RecordReading

__all__ = ["CURSOR_VERSION", "MixtureRecords", "MixtureStream", "StreamMixture", "StreamPlan", "handed_over_counts"]

logger = get_logger(__name__)

CURSOR_VERSION = 1
_WHERE = "the mixture stream cursor"
_PLAN = "state['mixture']['plan']"
# Cursor fields that must equal this mixture's settings, and why.
_SETTINGS = (
    ("dp_rank", "the state holds another rank's share of every source"),
    ("dp_world_size", "each DP rank reads its own share of every source, so the shares would differ"),
    ("seed", "the draws and the shuffles depend on it"),
)


class StreamMixture(MixedSources):
    """A mixture with a streaming source: its samples are read in order by ``MixtureStream`` (module docstring).

    Args:
        sources, seed, shuffle, log_every, num_samples: as for ``MixedSources``; ``num_samples`` is each epoch's
            length (None: where a source's end ends it).
        draws: the sources' draws (``SourceDraws`` over their weights, the strategy and the seed).
        on_exhausted: ``stop``, ``reweight`` or ``restart``.
        mixture_change: ``allow``: a loader state saved over other weights or sources continues with these
            (``resumed_plan``); ``refuse``: such a state is refused.
    """

    def __init__(
        self,
        sources: Sequence[MixtureSource],
        draws: SourceDraws,
        *,
        on_exhausted: str,
        seed: int,
        shuffle: bool,
        log_every: int,
        num_samples: int | None,
        mixture_change: str = "refuse",
    ) -> None:
        super().__init__(sources, seed=seed, shuffle=shuffle, log_every=log_every, num_samples=num_samples)
        if on_exhausted == "restart" and num_samples is None:
            raise DataConfigError(
                "the mixture has no end: with on_exhausted: restart no source ever runs out; set num_samples (the "
                "samples of each epoch)"
            )
        self.draws = draws
        self.on_exhausted = on_exhausted
        self.mixture_change = mixture_change
        placements = {(stream.dp_rank, stream.dp_world_size) for stream in self.streams if stream is not None}
        if len(placements) > 1:
            raise DataConfigError(
                "the streaming sources of the mixture were built for different DP ranks or sizes "
                f"{sorted(placements)}; build every source with the pipeline's dp_rank and dp_world_size"
            )
        self.dp_rank, self.dp_world_size = placements.pop()
        self.stream = MixtureStream(self)
        self.plan = StreamPlan({})
        self._identity = data_identity(self.description, self.plan_state())

    @property
    def settings(self) -> dict:
        return {
            "strategy": self.draws.strategy,
            "on_exhausted": self.on_exhausted,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }

    def record_reading(self) -> RecordReading:
        """Read as a stream in the loader's main process; the workers read or transform each sample's record."""
        readers = [
            source.dataset if stream is None else source.dataset.record_reading().records
            for source, stream in zip(self.sources, self.streams, strict=True)
        ]
        converters = [self.converter(source) for source in range(len(self.sources))]
        return RecordReading(self._mixture_transform(), self.stream, MixtureRecords(self.names, readers, converters))

    def data_identity(self) -> dict:
        """The sources' identities and the mixture's settings: a state resumes only over the same mixture."""
        return self._identity

    def plan_state(self) -> dict:
        """What a loader state keeps of the mixture: its settings, each source's weight, budget and data, and
        (after a change) ``known``: the budget and data of each source mixed before and no longer."""
        sources = {
            name: {"weight": self.weights[name], **entry, "stream": stream is not None}
            for (name, entry), stream in zip(self._known.items(), self.streams, strict=True)
        }
        return {**self.settings, "sources": sources, **({"known": self.plan.known} if self.plan.known else {})}

    def resumed_plan(self, saved, resume_at, allow_change: bool) -> StreamPlan | None:
        """The plan a loader state's mixture part ``saved`` continues with here, or None when it is this one's.

        Other weights or sources (or ``num_samples``) are refused, naming each difference, unless ``allow_change``
        or this mixture's ``mixture_change: allow``: the cursor is then continued at its sample number with these
        (``continued_cursor``). Another strategy, ``on_exhausted``, ``shuffle`` or seed, and a source whose data or
        budget changed, are always refused. ``resume_at`` is not used: the cursor holds the resume point.
        """
        if saved == self.plan_state():
            return None
        check_state_type(saved, Mapping, _PLAN)
        check_reading(saved, in_order=True)
        check_settings(saved, self.settings)
        mixed = state_field(saved, "sources", Mapping, _PLAN)
        retired_before = state_field(saved, "known", Mapping, _PLAN) if "known" in saved else {}
        for part, entries in (("sources", mixed), ("known", retired_before)):
            for name, entry in entries.items():
                where = f"{_PLAN}[{part!r}][{name!r}]"
                check_state_type(entry, Mapping, where)
                state_field(entry, "budget", (int, None), where)
                state_field(entry, "data", str, where)
                if part == "sources":
                    state_field(entry, "weight", (int, float), where)
        known_before = {**retired_before, **mixed}
        last = {name: entry["weight"] for name, entry in mixed.items()}
        changes, refusals = mixture_differences(last, known_before, self.weights, self._known)
        if saved.get("num_samples") != self.num_samples:
            changes.append(f"num_samples was {saved.get('num_samples')!r}, is {self.num_samples!r}")
        check_change(changes, refusals, allow_change or self.mixture_change == "allow")
        if changes:
            logger.info("%r continues a state saved over another mixture: %s", self, "; ".join(changes))
        retired = {
            name: {"budget": entry["budget"], "data": entry["data"]}
            for name, entry in known_before.items()
            if name not in self.names
        }
        return StreamPlan(retired, changed=bool(changes))

    def adopt(self, plan: StreamPlan) -> None:
        """Continue the cursors of ``plan`` (``resumed_plan``) from here on; ``continued_cursor`` reads them."""
        self.plan = plan

    def continued_cursor(self, cursor):
        """The cursor ``cursor``, saved over the mixture the adopted plan continues, as this mixture's.

        After a change of weights or sources: the draws from its sample number use this mixture's weights; a
        source mixed before keeps its entry (its samples in the pass, its stream's cursor and the records read
        ahead), a new one starts at its beginning, and a source no longer mixed keeps its entry in ``retired``, so
        that adding it back continues it. A malformed cursor is given back as it is, for its check to name.
        """
        if not self.plan.changed or not isinstance(cursor, Mapping):
            return cursor
        mixed, retired = cursor.get("sources"), cursor.get("retired", {})
        if (
            not isinstance(mixed, Mapping)
            or not isinstance(retired, Mapping)
            or not isinstance(cursor.get("active"), list)
        ):
            return cursor
        entries = {**retired, **mixed}
        fresh = self.stream.fresh_entries()
        active = [name for name in self.names if name in cursor["active"] or name not in mixed]
        if cursor.get("epoch_over") or not active:  # the next read begins the next epoch, drawing every source
            active = []
        return {
            **cursor,
            "epoch_over": not active,
            "active": active,
            "phase_start": cursor.get("sample") if active else None,
            "sources": {name: entries.get(name, fresh[name]) for name in self.names},
            "retired": {name: entry for name, entry in entries.items() if name not in self.names},
        }

    def readable(self, keys) -> np.ndarray:
        """Whether each key (a loader key or a buffered sample's saved entry) is of a source mixed now (bool); a
        key of no known form counts as readable, for its check to name."""
        names = set(self.names)
        return np.array([_key_source(key) in names or _key_source(key) is None for key in keys], dtype=bool)

    def sources_of(self, keys) -> np.ndarray:
        """The source id of each key: a loader key ``(n, {"source": name, ...})`` or a buffered sample's
        ``(n, name)``."""
        ids = {name: position for position, name in enumerate(self.names)}
        return np.array([ids[key[1] if isinstance(key[1], str) else key[1]["source"]] for key in keys], dtype=np.int64)

    def __repr__(self) -> str:
        return f"StreamMixture({self.description}, {self.draws.strategy}, {self.on_exhausted})"


@dataclass(frozen=True)
class StreamPlan:
    """What a ``StreamMixture`` continues from a loader state: the sources it no longer mixes (their budget and
    data, so that adding one back with other data is refused), and whether the weights or sources changed."""

    known: dict[str, dict]
    changed: bool = False


def _key_source(key) -> str | None:
    """The source a loader key ``(n, {"source", ...})``, a buffered sample's ``(n, name)`` or its saved entry
    ``{"source", ...}`` names; None for anything else."""
    if isinstance(key, Mapping):
        name = key.get("source")
    elif isinstance(key, list | tuple) and len(key) == 2:
        name = key[1] if isinstance(key[1], str) else key[1].get("source") if isinstance(key[1], Mapping) else None
    else:
        name = None
    return name if isinstance(name, str) else None


class MixtureStream:
    """The cursor of a ``StreamMixture`` on this DP rank: "give me the next samples" as ``(n, payload)`` keys.

    A stream source's payload is ``{"source", "position", "record"}`` (its record, read here), a mapping source's
    ``{"source", "index"}`` (its record, read in the workers).
    """

    mixed = True  # its keys name their source: the loaders read it with ``key_sources.MixtureStreamKeys``

    def __init__(self, mixture: StreamMixture) -> None:
        self.mixture = mixture
        self.description = mixture.description
        self.dp_rank, self.dp_world_size, self.seed = mixture.dp_rank, mixture.dp_world_size, mixture.seed
        self._streams = mixture.streams
        self._budgets = mixture.budgets
        self._pass_sizes = [
            budget if stream is not None else len(range(self.dp_rank, budget, self.dp_world_size))
            for stream, budget in zip(self._streams, self._budgets, strict=True)
        ]
        for source, size in zip(mixture.sources, self._pass_sizes, strict=True):
            if size == 0:
                raise DataConfigError(
                    f"the mixture source {source.name!r} gives {source.budget} samples per pass, fewer than the "
                    f"{self.dp_world_size} DP ranks that share it; raise its epochs or max_samples, or use fewer DP "
                    "ranks"
                )
        count = len(mixture.sources)
        self.sample = 0
        self._taken = [0] * count
        self._passes = [0] * count
        self._ended = [False] * count
        self._pending: list[deque] = [deque() for _ in range(count)]
        # A pass handed over by a DP change (``mixture_handover``) may give this rank nothing; for a mapping
        # source, the sample counts the old ranks left (a bitmap from a count) and this rank's share of them,
        # every dp_world_size-th (None: its own share); for a stream with max_samples, this rank's part of the
        # samples the old ranks had left of their passes.
        self._handed_over = [False] * count
        self._left: list[tuple[bytes, int] | None] = [None] * count
        self._left_share: list[np.ndarray | None] = [None] * count
        self._pass_samples: list[int | None] = [None] * count  # a stream's samples left of a handed-over pass
        self._retired: dict[str, dict] = {}  # the entries of sources mixed before and no longer
        self._fresh_streams = [None if stream is None else stream.state_dict() for stream in self._streams]
        self._start_epoch(0)

    def fresh_entries(self) -> dict[str, dict]:
        """Each source's entry of the cursor at its beginning (a source added to a mixture starts there)."""
        return {
            name: {"taken": 0, "passes": 0, "ended": False, "pending": [], "stream": copy.deepcopy(stream)}
            for name, stream in zip(self.mixture.names, self._fresh_streams, strict=True)
        }

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0
        self._epoch_over = False
        self._draw_from(self.sample, list(range(len(self.mixture.sources))))

    def _draw_from(self, start: int, active: list[int]) -> None:
        self._active = active
        self._phase = self.mixture.draws.phase(start, np.array(active, dtype=np.int64)) if active else None

    def read(self, max_records: int) -> list[tuple[int, dict]]:
        """Up to ``max_records`` next ``(n, payload)`` keys; an empty list ends the epoch and starts the next."""
        if self._epoch_over:
            self._start_epoch(self.epoch + 1)
            return []
        taken: list = []
        num_samples = self.mixture.num_samples
        while len(taken) < max_records and not self._epoch_over:
            wanted = max_records - len(taken)
            if num_samples is not None:  # a changed num_samples may be behind the position
                wanted = max(0, min(wanted, num_samples - self.position))
            if wanted:
                taken += self._take(wanted)
            else:
                self._epoch_over = True
        if not taken:
            self._start_epoch(self.epoch + 1)
        return taken

    def _take(self, wanted: int) -> list[tuple[int, dict]]:
        """The next samples, up to ``wanted``: all of them, or those before the first that finds its source
        ended (whose end is then taken: ``_source_ended``)."""
        drawn = self.mixture.draws.sources(self._phase, np.arange(self.sample, self.sample + wanted, dtype=np.int64))
        ranks = ranks_within(drawn)
        available = np.zeros(len(self._streams), dtype=np.int64)
        fetched: dict[int, list] = {}
        for source, need in zip(*np.unique(drawn, return_counts=True), strict=True):
            source, need = int(source), int(need)
            if self._budgets[source] is not None:
                need = min(need, self._pass_size(source) - self._taken[source])
            if self._streams[source] is not None:
                fetched[source] = self._stream_records(source, need)
                need = len(fetched[source])
            available[source] = need
        short = np.flatnonzero(ranks >= available[drawn])
        cut = int(short[0]) if len(short) else wanted
        keys: list = [None] * cut
        name_of = self.mixture.names
        for source in range(len(self._streams)):
            slots = np.flatnonzero(drawn[:cut] == source)
            if self._streams[source] is not None:
                records = fetched.get(source, [])
                self._pending[source].extendleft(reversed(records[len(slots) :]))  # read ahead: wait for later
                for slot, (position, record) in zip(slots.tolist(), records, strict=False):
                    keys[slot] = (
                        self.sample + slot,
                        {"source": name_of[source], "position": position, "record": record},
                    )
            elif len(slots):
                within = self._taken[source] + np.arange(len(slots))
                share = self._left_share[source]
                if share is None:
                    counts = self._passes[source] * self._budgets[source] + within * self.dp_world_size + self.dp_rank
                else:
                    counts = share[within]
                for slot, index in zip(slots.tolist(), self.mixture.records_of(source, counts).tolist(), strict=True):
                    keys[slot] = (self.sample + slot, {"source": name_of[source], "index": index})
            self._taken[source] += len(slots)
        self.sample += cut
        self.position += cut
        if cut < wanted:
            self._source_ended(int(drawn[cut]))
        return keys

    def _stream_records(self, source: int, need: int) -> list:
        """Up to ``need`` next ``(position, record)`` pairs of a stream source: those read ahead, then its cursor's;
        fewer when its share ends (its stream then begins its next pass; the records still waiting end this one)."""
        pending = self._pending[source]
        records = [pending.popleft() for _ in range(min(need, len(pending)))]
        if len(records) < need and not self._ended[source]:
            stream = self._streams[source]
            read = stream.read(need - len(records))
            if len(read) < need - len(records):
                self._ended[source] = True
                if read:  # an empty read has begun the next epoch already
                    stream.set_epoch(stream.epoch + 1)
            records += read
        return records

    def _source_ended(self, source: int) -> None:
        """A source's pass has ended: it begins its next pass, and ``on_exhausted`` says what the mixture does."""
        if not self._taken[source] and not self._handed_over[source]:
            name = self.mixture.names[source]
            raise DataFileError(
                f"the mixture source {name!r} gave no sample in its pass {self._passes[source]} on DP rank "
                f"{self.dp_rank} of {self.dp_world_size}: its share of the data is empty; give it more data, use "
                "fewer DP ranks, or remove it from the mixture"
            )
        stream = self._streams[source]
        if stream is not None and not self._ended[source]:  # it gave max_samples: its pass is cut there
            stream.set_epoch(stream.epoch + 1)
            # As the stream's shuffle buffer, the records a handed-over pass dealt here beyond its count end with it.
            self._pending[source].clear()
        self._ended[source], self._taken[source] = False, 0
        self._handed_over[source] = False
        self._left[source] = self._left_share[source] = self._pass_samples[source] = None
        self._passes[source] += 1
        mode = self.mixture.on_exhausted
        if mode == "stop":
            self._epoch_over = True
        elif mode == "reweight":
            self._draw_from(self.sample, [active for active in self._active if active != source])
            self._epoch_over = not self._active

    def _pass_size(self, source: int) -> int | None:
        """The samples this rank gives of ``source`` in its current pass (None: a stream's share, to its end)."""
        share = self._left_share[source]
        if share is not None:
            return len(share)
        return self._pass_sizes[source] if self._pass_samples[source] is None else self._pass_samples[source]

    @property
    def handing_over(self) -> bool:
        """Whether a source reads a pass handed over by a DP change (``mixture_handover``)."""
        return any(self._handed_over)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` where the mixture is (every source continues), unless it is already in it."""
        if epoch != self.epoch:
            self._start_epoch(epoch)

    # Resume --------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The cursor (module docstring): plain containers, each stream's cursor included."""
        names = self.mixture.names
        return {
            "version": CURSOR_VERSION,
            **{key: getattr(self, key) for key, _ in _SETTINGS},
            "epoch": self.epoch,
            "position": self.position,
            "sample": self.sample,
            "epoch_over": self._epoch_over,
            "phase_start": None if self._phase is None else int(self._phase.start),
            "active": [names[source] for source in self._active],
            "sources": {
                name: {
                    "taken": self._taken[source],
                    "passes": self._passes[source],
                    "ended": self._ended[source],
                    "pending": [{"position": position, "record": record} for position, record in self._pending[source]],
                    "stream": None if stream is None else stream.state_dict(),
                    **self._handover_entry(source),
                }
                for source, (name, stream) in enumerate(zip(names, self._streams, strict=True))
            },
            **({"retired": copy.deepcopy(self._retired)} if self._retired else {}),
        }

    def _handover_entry(self, source: int) -> dict:
        """The fields of a source's cursor entry while it reads a pass handed over by a DP change (none else)."""
        if not self._handed_over[source]:
            return {}
        entry = {"handed_over": True}
        if self._left[source] is not None:
            entry["left"], entry["left_from"] = self._left[source]
        if self._pass_samples[source] is not None:
            entry["pass_samples"] = self._pass_samples[source]
        return entry

    def check_state(self, state: Mapping) -> None:
        """Refuse a cursor this mixture cannot continue: malformed, of another version, rank, seed or sources."""
        check_state_type(state, Mapping, _WHERE)
        if state.get("version") != CURSOR_VERSION:
            raise ResumeStateError(
                f"{_WHERE} has version {state.get('version')!r}, not {CURSOR_VERSION}; it was saved by an "
                "incompatible release: start without the state"
            )
        for key, why in _SETTINGS:
            if state_field(state, key, int, _WHERE) != getattr(self, key):
                raise ResumeStateError(
                    f"cannot resume the {self.description}: the state has {key}={state[key]!r} but this run has "
                    f"{getattr(self, key)!r}, and {why}; resume with the same value, or start without the state"
                )
        for key in ("epoch", "position", "sample"):
            if state_field(state, key, int, _WHERE) < 0:
                raise ResumeStateError(f"{_WHERE}['{key}'] is {state[key]}; it counts from 0")
        epoch_over = state_field(state, "epoch_over", bool, _WHERE)
        active = state_field(state, "active", list, _WHERE)
        start = state_field(state, "phase_start", (int, None), _WHERE)
        names = self.mixture.names
        if not set(active) <= set(names) or (not active and not epoch_over) or (start is None) != (not active):
            raise ResumeStateError(f"{_WHERE}['active'] {active!r} does not fit the mixture's sources {names}")
        if start is not None and start > state["sample"]:
            raise ResumeStateError(f"{_WHERE}['phase_start'] {start} is after its sample {state['sample']}")
        sources = state_field(state, "sources", Mapping, _WHERE)
        if sorted(sources) != sorted(names):
            raise ResumeStateError(
                f"{_WHERE} holds the sources {sorted(sources)}, but this mixture has {sorted(names)}; resume with "
                "the mixture the state was saved with, or start without the state"
            )
        for source, name in enumerate(names):
            self._check_source(state_field(sources, name, Mapping, _WHERE), source, f"{_WHERE}['sources'][{name!r}]")
        retired = state_field(state, "retired", Mapping, _WHERE) if "retired" in state else {}
        for name, entry in retired.items():
            where = f"{_WHERE}['retired'][{name!r}]"
            check_state_type(entry, Mapping, where)
            if name in names:
                raise ResumeStateError(f"{where} is a source the mixture mixes; the state is damaged")
            for key, kind in (("taken", int), ("passes", int), ("ended", bool), ("pending", list)):
                state_field(entry, key, kind, where)
            state_field(entry, "stream", (Mapping, None), where)

    def _check_source(self, entry: Mapping, source: int, where: str) -> None:
        taken = state_field(entry, "taken", int, where)
        most = self._pass_sizes[source]
        handed_over = state_field(entry, "handed_over", bool, where) if "handed_over" in entry else False
        if handed_over and self._streams[source] is None or "left" in entry:
            if self._streams[source] is not None or not handed_over:
                raise ResumeStateError(f"{where}['left'] belongs to a handed-over mapping source; the state is damaged")
            left, start = state_field(entry, "left", bytes, where), state_field(entry, "left_from", int, where)
            if start < 0:
                raise ResumeStateError(f"{where}['left_from'] is {start}; it counts from 0")
            most = len(handed_over_counts(left, start, self.dp_rank, self.dp_world_size))
        if "pass_samples" in entry:
            most = state_field(entry, "pass_samples", int, where)
            if not handed_over or self._streams[source] is None or self._budgets[source] is None or most < 0:
                raise ResumeStateError(
                    f"{where}['pass_samples'] belongs to a handed-over pass of a stream with max_samples; the state "
                    "is damaged"
                )
        if state_field(entry, "passes", int, where) < 0 or taken < 0 or (most is not None and taken > most):
            raise ResumeStateError(f"{where}['taken'] or ['passes'] is out of range; the state is damaged")
        state_field(entry, "ended", bool, where)
        for position, waiting in enumerate(state_field(entry, "pending", list, where)):
            name = f"{where}['pending'][{position}]"
            check_state_type(waiting, Mapping, name)
            state_field(waiting, "position", int, name)
            state_field(waiting, "record", Mapping, name)
        stream = self._streams[source]
        cursor = state_field(entry, "stream", (Mapping, None), where)
        if (cursor is None) != (stream is None) or (stream is None and entry["pending"]):
            raise ResumeStateError(
                f"{where} was saved over a {'mapping' if cursor is None else 'streaming'} source, but this "
                "mixture's is not; resume with the mixture the state was saved with, or start without the state"
            )
        if stream is not None:
            stream.check_state(cursor)

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from the cursor ``state`` (checked whole first: a refused state changes nothing)."""
        self.check_state(state)
        names = self.mixture.names
        self.epoch, self.position, self.sample = state["epoch"], state["position"], state["sample"]
        self._epoch_over = state["epoch_over"]
        active = [names.index(name) for name in state["active"]]
        self._draw_from(state["phase_start"], active)
        for source, name in enumerate(names):
            entry = state["sources"][name]
            self._taken[source], self._passes[source] = entry["taken"], entry["passes"]
            self._ended[source] = entry["ended"]
            self._pending[source] = deque((waiting["position"], waiting["record"]) for waiting in entry["pending"])
            self._handed_over[source] = entry.get("handed_over", False)
            self._left[source] = (entry["left"], entry["left_from"]) if "left" in entry else None
            self._pass_samples[source] = entry.get("pass_samples")
            self._left_share[source] = (
                None
                if "left" not in entry
                else handed_over_counts(*self._left[source], self.dp_rank, self.dp_world_size)
            )
            if self._streams[source] is not None:
                self._streams[source].load_state_dict(entry["stream"])
        self._retired = copy.deepcopy(dict(state.get("retired", {})))

    def __repr__(self) -> str:
        return f"MixtureStream({self.description}, dp {self.dp_rank}/{self.dp_world_size}, epoch {self.epoch})"


def handed_over_counts(left: bytes, left_from: int, dp_rank: int, dp_world_size: int) -> np.ndarray:
    """Rank ``dp_rank``'s share of the sample counts a DP change left of a mapping source (``left``: a bitmap of
    them from the count ``left_from``): every ``dp_world_size``-th."""
    return left_from + bitmap_positions(left, len(left) * 8)[dp_rank::dp_world_size].astype(np.int64)


class MixtureRecords:
    """The worker-side half of a ``StreamMixture``: a key ``(n, payload)`` in, that sample's record's samples out
    (a stream's record transformed; a mapping source's record read, transformed and put in the mixture's form)."""

    def __init__(self, names: Sequence[str], readers: Sequence, converters: Sequence) -> None:
        self.sources = {
            name: (reader, convert) for name, reader, convert in zip(names, readers, converters, strict=True)
        }

    def __getitem__(self, key) -> list:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list) -> list[list]:
        """Each source's records of ``keys`` read in one call."""
        items: list = [None] * len(keys)
        by_source: dict[str, list[int]] = {}
        for slot, (_, payload) in enumerate(keys):
            by_source.setdefault(payload["source"], []).append(slot)
        for name, slots in by_source.items():
            reader, convert = self.sources[name]
            payloads = [keys[slot][1] for slot in slots]
            if "record" in payloads[0]:
                wanted = [(payload["position"], payload["record"]) for payload in payloads]
            else:
                wanted = [payload["index"] for payload in payloads]
            getitems = getattr(reader, "__getitems__", None)
            fetched = getitems(wanted) if getitems is not None else [reader[one] for one in wanted]
            for slot, item in zip(slots, fetched, strict=True):
                items[slot] = convert(item)
        return items

    def where(self, key) -> str:
        number, payload = key
        reader, _ = self.sources[payload["source"]]
        inner = (payload["position"], payload["record"]) if "record" in payload else payload["index"]
        described = reader.where(inner) if hasattr(reader, "where") else f"sample {inner}"
        return f"sample {number} of the mixture: source {payload['source']!r}, {described}"
