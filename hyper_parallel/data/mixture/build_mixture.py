"""Mix any dataset nodes by weight: the ``dataset`` node ``build_mixture_dataset`` and the ``MixtureDataset``.

Owns: checking a mixture's sources and settings, what every mixture shares (``MixedSources``: its sources'
identities and transforms, each source's epochs and their shuffles, the common form of its samples), turning a
sample number of the mixture into a record of one of
its sources (``mixture_order`` plans the source and its count; here each source's count becomes a record: a
source is read in epochs, each in an order drawn from ``(seed, source name, epoch)``), reading records of several
sources in one call, the common form of the samples of a mix (below), what a loader keeps of a mixture
(``mixture_tally``), and taking a loader state's plan (``mixture_plan``: its segments, continued with new weights
or sources when ``mixture_change: allow``). Not responsible for: the order itself (``mixture_order``), reading
files or tokenizing (the sources), batching (the loaders; the DP batch sampler orders the mixture's samples as any
dataset's).

Sample forms. A mix of ready-sample sources only (Indexed GPTDatasets or blends, of one ``seq_length`` and EOD id)
gives their samples as they are, stacked by the Indexed collator. A mix with an Online mapping source gives
ModelSamples, packed by the Online collator: an Indexed sample enters as one ModelSample of ``seq_length`` tokens
(its labels ``IGNORE_INDEX`` where its loss mask is 0) carrying ``document_lengths``, the lengths of its
EOD-separated documents by the Indexed rule (``sequence_boundaries``), so each stays a sequence of its own in
``cu_seq_lens``. A mix with a streaming (iterable) source is read in order instead, each stream from its own
cursor (``mixture_stream.StreamMixture``, which this builder returns for it).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.utils.data

from hyper_parallel.data.batching.sequence_boundaries import eod_sequence_ends
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, require_choice, require_int
from hyper_parallel.data.mixture.mixture_order import EXHAUSTION_MODES, STRATEGIES, MixtureOrder, SourceDraws
from hyper_parallel.data.mixture.mixture_plan import MixturePlan, check_change, check_reading
from hyper_parallel.data.mixture.mixture_tally import MixtureTally
from hyper_parallel.data.resume_checks import data_identity, dataset_identity, transform_identity
from hyper_parallel.data.text.transform_dataset import RecordReading

__all__ = ["MixtureDataset", "MixtureSource", "build_mixture_dataset"]

logger = get_logger(__name__)

_SOURCE_KEYS = ("name", "weight", "dataset", "epochs", "max_samples")
_EPOCH_WORD = 1 << 32  # a source's shuffle key: its name's CRC above, its epoch below


@dataclass(frozen=True)
class MixtureSource:
    """One source of a mixture.

    Attributes:
        name: names the source in logs, states and errors; unique within the mixture.
        weight: its share of the mixture (any positive scale; the weights are normalised).
        dataset: the built dataset node: an Online mapping or streaming dataset (``build_online_text_dataset``) or
            an Indexed dataset or blend (``build_indexed_text_dataset``; of ``(train, valid, test)``, the train
            split).
        epochs: how many passes over the dataset it gives before it is exhausted (may be fractional); default 1.
            A stream gives one pass, ended where its share ends (its length is not known before).
        max_samples: how many samples it gives before it is exhausted, instead of ``epochs``.
    """

    name: str
    weight: float
    dataset: object
    epochs: float | None = None
    max_samples: int | None = None

    @property
    def budget(self) -> int | None:
        """The samples it gives before it is exhausted (with ``restart``: before it begins a new epoch); None for a
        stream without ``max_samples``: it is exhausted where it ends."""
        if self.max_samples is not None:
            return self.max_samples
        if stream_of(self.dataset) is not None:
            return None
        return max(1, round((1.0 if self.epochs is None else self.epochs) * len(self.dataset)))


def _checked_source(entry, position: int) -> MixtureSource:
    where = f"sources[{position}]"
    if isinstance(entry, MixtureSource):  # a node with this _target_
        entry = {field.name: getattr(entry, field.name) for field in fields(entry)}
    if not isinstance(entry, Mapping):
        raise DataConfigError(
            f"{where} must be a mapping with name, weight and dataset (a dataset node), got {type(entry).__name__}"
        )
    unknown = sorted(set(entry) - set(_SOURCE_KEYS))
    if unknown:
        raise DataConfigError(f"{where} has unknown keys {unknown}; a source takes {list(_SOURCE_KEYS)}")
    for key in ("name", "weight", "dataset"):
        if entry.get(key) is None:
            raise DataConfigError(f"{where} has no {key}; a source takes name, weight and dataset")
    name = entry["name"]
    if not isinstance(name, str) or not name:
        raise DataConfigError(f"{where}.name must be a non-empty string, got {name!r}")
    weight = entry["weight"]
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
        raise DataConfigError(
            f"{where} ({name!r}) has weight {weight!r}; a weight is a positive number (its share of the mixture, "
            "normalised over the sources); remove a source to leave it out"
        )
    epochs, max_samples = entry.get("epochs"), entry.get("max_samples")
    if epochs is not None and max_samples is not None:
        raise DataConfigError(f"{where} ({name!r}) sets both epochs and max_samples; set one of them")
    if epochs is not None and (
        isinstance(epochs, bool) or not isinstance(epochs, int | float) or not math.isfinite(epochs) or epochs <= 0
    ):
        raise DataConfigError(f"{where} ({name!r}) has epochs {epochs!r}; epochs is a positive number, such as 2.5")
    if max_samples is not None:
        max_samples = require_int(f"{where}.max_samples", max_samples, 1)
    dataset = _train_split(entry["dataset"], where, name)
    if epochs is not None and stream_of(dataset) is not None:
        raise DataConfigError(
            f"{where} ({name!r}) is a streaming (iterable) source and sets epochs {epochs!r}, but a stream's length "
            "is not known before it ends: leave epochs out (one pass, to the stream's end) or set max_samples"
        )
    return MixtureSource(name, float(weight), dataset, epochs, max_samples)


def _train_split(dataset, where: str, name: str):
    """The dataset a source node built: its train split when it built ``(train, valid, test)``."""
    if isinstance(dataset, tuple | list):
        dataset = dataset[0] if dataset else None
        if dataset is None:
            raise DataConfigError(f"{where} ({name!r}): its dataset node built no train split")
    if stream_of(dataset) is not None:
        return dataset
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise DataConfigError(
            f"{where} ({name!r}): its dataset node built a {type(dataset).__name__}, not a dataset read by index; "
            "give a build_online_text_dataset or build_indexed_text_dataset node"
        )
    if not len(dataset):
        raise DataConfigError(f"{where} ({name!r}): its dataset is empty")
    return dataset


def stream_of(dataset):
    """The stream of a streaming (iterable) Online dataset, read in the loader's main process; None for others."""
    reading = getattr(dataset, "record_reading", None)
    described = reading() if callable(reading) else None
    return described.stream if isinstance(described, RecordReading) else None


def _transform_of(dataset):
    """The transform that turns the source's records into ModelSamples, or None for ready samples (Indexed)."""
    reading = getattr(dataset, "record_reading", None)
    described = reading() if callable(reading) else None
    return described.transform if isinstance(described, RecordReading) else None


class _MixtureTransform:
    """What turns a mixture's records into ModelSamples, for loader states: each source's transform by name."""

    def __init__(self, parts: Mapping[str, str], max_seq_len: int | None) -> None:
        self.parts = dict(parts)
        self.max_seq_len = max_seq_len

    def __repr__(self) -> str:
        return "MixtureTransform(" + ", ".join(f"{name}={part}" for name, part in self.parts.items()) + ")"


class MixedSources:
    """What every mixture keeps of its sources: their names, weights, identities and transforms, the records of
    each source's ``c``-th sample (its epochs, each in its own shuffled order) and the common form of the samples.

    Args:
        sources: the checked sources, in order.
        seed: keys each source's epoch shuffles.
        shuffle: read each source's epochs in a shuffled order (false: in record order, every epoch).
        log_every: a loader over the mixture logs what it has taken from each source every this many batches.
        num_samples: the length asked for (None: where the sources run out).

    Attributes:
        streams: per source, its stream (``stream_of``), or None for a source read by index.
        budgets: per source, its ``MixtureSource.budget``.
    """

    def __init__(
        self, sources: Sequence[MixtureSource], *, seed: int, shuffle: bool, log_every: int, num_samples: int | None
    ) -> None:
        self.sources = list(sources)
        self.seed = seed
        self.shuffle = shuffle
        self.log_every = log_every
        self.num_samples = num_samples
        self.names = [source.name for source in self.sources]
        self.known_names = list(self.names)
        self.streams = [stream_of(source.dataset) for source in self.sources]
        self._lengths = [0 if stream else len(s.dataset) for s, stream in zip(self.sources, self.streams, strict=True)]
        self.budgets = [source.budget for source in self.sources]
        self._transforms = [_transform_of(source.dataset) for source in self.sources]
        self.model_samples = any(transform is not None for transform in self._transforms)
        self.eod_token_id = self._common_eod()
        self._permutations: dict[tuple[int, int], np.ndarray] = {}
        self._known = self._source_entries()

    def _common_eod(self) -> int | None:
        ready = [s for s, t in zip(self.sources, self._transforms, strict=True) if t is None]
        eods = {source.name: getattr(source.dataset, "eod_token_id", None) for source in ready}
        if len(set(eods.values())) > 1:
            raise DataConfigError(
                f"the Indexed sources end their documents with different EOD ids {eods}; mix datasets tokenized "
                "with one tokenizer"
            )
        lengths = {source.name: _seq_length(source.dataset) for source in ready}
        if not self.model_samples and len(set(lengths.values())) > 1:
            raise DataConfigError(
                f"the Indexed sources have samples of different lengths {lengths}; stacked rows need one "
                "seq_length: build them with the same data_config.seq_length"
            )
        return next(iter(eods.values()), None)

    @property
    def weights(self) -> dict[str, float]:
        return {source.name: source.weight for source in self.sources}

    @property
    def description(self) -> str:
        return "mixture of " + ", ".join(f"{s.name} ({s.weight:g})" for s in self.sources)

    @property
    def max_seq_len(self) -> int | None:
        lengths = [getattr(t, "max_seq_len", None) for t in self._transforms if t is not None]
        lengths += [_seq_length(s.dataset) for s, t in zip(self.sources, self._transforms, strict=True) if t is None]
        known = [length for length in lengths if length is not None]
        return max(known) if known else None

    def _mixture_transform(self) -> _MixtureTransform:
        parts = {
            source.name: ("ready samples" if t is None else transform_identity(t)["transform"])
            for source, t in zip(self.sources, self._transforms, strict=True)
        }
        return _MixtureTransform(parts, self.max_seq_len)

    def _source_entries(self) -> dict[str, dict]:
        """Each source's budget and data fingerprint, as a plan knows them (computed once, at construction)."""
        return {
            source.name: {
                "budget": None if budget is None else int(budget),
                "data": (dataset_identity(source.dataset) or {}).get("fingerprint", type(source.dataset).__name__),
            }
            for source, budget in zip(self.sources, self.budgets, strict=True)
        }

    def mixture_tally(self) -> MixtureTally:
        """What a loader over this mixture keeps: the samples and tokens it delivered from each source."""
        return MixtureTally(self, self.log_every)

    def records_of(self, source: int, counts: np.ndarray) -> np.ndarray:
        """The records of the ``counts``-th samples of ``source``: its budget is a cycle of epochs (``restart``
        begins the next cycle with new epochs), each read in its own shuffled order."""
        length, budget = int(self._lengths[source]), int(self.budgets[source])
        cycle, within = np.divmod(counts, budget)
        epochs = cycle * -(-budget // length) + within // length
        offsets = within % length
        if not self.shuffle:
            return offsets
        records = np.empty(len(counts), dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            chosen = epochs == epoch
            records[chosen] = self._permutation(source, epoch)[offsets[chosen]]
        return records

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        permutation = self._permutations.get(key)
        if permutation is None:
            if len(self._permutations) >= 2 * len(self.sources):
                del self._permutations[next(iter(self._permutations))]
            name_word = zlib.crc32(self.sources[source].name.encode("utf-8"))
            words = np.array([self.seed, name_word * _EPOCH_WORD + epoch], dtype=np.uint64)
            generator = np.random.Generator(np.random.Philox(key=words))
            permutation = self._permutations[key] = generator.permutation(int(self._lengths[source]))
        return permutation

    def converter(self, source: int):
        """What turns a record of ``source`` as its dataset gives it into the mixture's form of it."""
        if not self.model_samples or self._transforms[source] is not None:
            return _same  # ready samples, or already the record's list of ModelSamples
        return IndexedAsModelSample(self.eod_token_id)


class IndexedAsModelSample:
    """An Indexed sample as the record of one ModelSample, its documents kept apart by ``document_lengths``."""

    def __init__(self, eod_token_id: int | None) -> None:
        self.eod_token_id = eod_token_id

    def __call__(self, sample: Mapping) -> list[dict]:
        tokens = torch.as_tensor(sample["tokens"]).reshape(1, -1)
        labels = torch.as_tensor(sample["labels"]).reshape(1, -1)
        loss_mask = sample.get("loss_mask")
        if loss_mask is not None:
            labels = torch.where(torch.as_tensor(loss_mask).reshape(1, -1) > 0, labels, IGNORE_INDEX)
        model_sample = {"input_ids": tokens[0].numpy().astype(np.int64), "labels": labels[0].numpy().astype(np.int64)}
        if self.eod_token_id is not None:
            ends = np.flatnonzero(eod_sequence_ends(tokens, labels, self.eod_token_id)[0]) + 1
            bounds = np.unique(np.concatenate(([0], ends, [tokens.shape[1]])))
            model_sample["document_lengths"] = np.diff(bounds)
        return [model_sample]


class MixtureDataset(MixedSources, torch.utils.data.Dataset):
    """A dataset whose sample ``n`` is the sample ``MixtureOrder`` plans for ``n``, read from its source.

    Args:
        sources, seed, shuffle, log_every, num_samples: as for ``MixedSources`` (``num_samples`` is kept for a
            changed mixture's plan).
        order: their order (``MixtureOrder`` over their weights and budgets).
        mixture_change: ``allow``: a loader state saved over other weights or sources continues with these
            (``mixture_plan``); ``refuse``: such a state is refused.
    """

    def __init__(
        self,
        sources: Sequence[MixtureSource],
        order: MixtureOrder,
        *,
        seed: int,
        shuffle: bool,
        log_every: int,
        num_samples: int | None = None,
        mixture_change: str = "refuse",
    ) -> None:
        super().__init__(sources, seed=seed, shuffle=shuffle, log_every=log_every, num_samples=num_samples)
        self.order = order
        self.mixture_change = mixture_change
        self.adopt(MixturePlan.single(order, self.weights, self._known, self._settings()))
        self._identity = self._built_identity()  # of the mixture as configured, whatever plan it later adopts

    # What loaders ask ----------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.plan)

    def record_reading(self) -> RecordReading | None:
        """Read by index; records of a mix with an Online source become ModelSamples (None: ready samples)."""
        return RecordReading(self._mixture_transform()) if self.model_samples else None

    def data_identity(self) -> dict:
        """The sources' identities and the mixture's settings: a state resumes only over the same mixture (or,
        with ``mixture_change: allow``, over a changed one the plan continues)."""
        return self._identity

    def _built_identity(self) -> dict:
        entries = {
            "strategy": self.order.strategy,
            "on_exhausted": self.order.on_exhausted,
            "length": len(self),
            "shuffle": self.shuffle,
            "sources": [
                {
                    "name": source.name,
                    "weight": source.weight,
                    "budget": int(budget),
                    "data": self._known[source.name]["data"],
                }
                for source, budget in zip(self.sources, self.budgets, strict=True)
            ],
        }
        return data_identity(self.description, entries)

    # The plan, and a state's plan -----------------------------------------------------------------------------

    def plan_state(self) -> dict:
        """The plan as a loader state keeps it."""
        return self.plan.state_dict()

    def _settings(self) -> dict:
        return {
            "strategy": self.order.strategy,
            "on_exhausted": self.order.on_exhausted,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def adopt(self, plan: MixturePlan) -> None:
        """Read the samples of ``plan`` (as built, or from ``resumed_plan``) from here on; its length is this
        dataset's."""
        self.plan = plan
        # The sources mixed now, then those a state still counts (mixed before): the ids sources_of gives.
        self.known_names = self.names + [name for name in plan.known if name not in self.names]
        ids = {name: position for position, name in enumerate(self.known_names)}
        self._segment_ids = [np.array([ids[name] for name in s.drawn], dtype=np.int64) for s in plan.segments]
        self._segment_offsets = [
            np.array([s.offsets.get(name, 0) for name in s.drawn], dtype=np.int64) for s in plan.segments
        ]

    def resumed_plan(self, saved, resume_at, allow_change: bool) -> MixturePlan | None:
        """The plan a loader state's ``saved`` plan continues with here, or None when it is this mixture's own.

        A plan whose last segment has this mixture's weights is taken as it is (a run resumed after a change).
        Other weights or sources are refused, naming each difference, unless ``allow_change`` or this mixture's
        ``mixture_change: allow``: then the plan is continued from ``resume_at()`` (the sample number the loader
        resumes at) with this mixture's weights. A changed source's data or budget is always refused.
        """
        if saved == self.plan.state_dict():  # the common case: this very plan, its orders not planned again
            return None
        check_reading(saved, in_order=False)
        plan = MixturePlan.from_state(saved, self._settings())
        changes, refusals = plan.differences(self.weights, self._known)
        check_change(changes, refusals, allow_change or self.mixture_change == "allow")
        if changes:
            plan = plan.continued(resume_at(), self.weights, self._known, self.num_samples)
            logger.info("%r continues a state saved over another mixture: %s", self, "; ".join(changes))
        elif len(plan.segments) == 1:
            return None
        return plan

    def readable(self, indices) -> np.ndarray:
        """Whether each sample number is of a source mixed now (bool), not of one no longer mixed."""
        return self.sources_of(indices) < len(self.sources)

    def sources_of(self, indices) -> np.ndarray:
        """The source id (a position in ``known_names``) of each sample number."""
        return self.planned(indices)[0]

    def planned(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """The source id and that source's count (its samples before it) of each sample number."""
        numbers = np.asarray(indices, dtype=np.int64)
        if len(numbers) and (numbers.min() < 0 or numbers.max() >= len(self)):
            raise IndexError(f"sample numbers must lie in [0, {len(self)}), got {numbers.min()}..{numbers.max()}")
        segments = np.searchsorted(self.plan.starts, numbers, side="right") - 1
        sources = np.empty(len(numbers), dtype=np.int64)
        counts = np.empty(len(numbers), dtype=np.int64)
        for index in np.unique(segments).tolist():
            chosen = segments == index
            segment = self.plan.segments[index]
            drawn, positions = segment.order.plan_at(numbers[chosen] - segment.start)
            sources[chosen] = self._segment_ids[index][drawn]
            counts[chosen] = positions + self._segment_offsets[index][drawn]
        return sources, counts

    def locate(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """The source id and the record within it of each sample number."""
        return self._records(*self.planned(indices))

    def _records(self, sources: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        records = np.empty(len(sources), dtype=np.int64)
        for source in np.unique(sources).tolist():
            chosen = sources == source
            if source >= len(self.sources):
                raise DataConfigError(
                    f"sample {int(np.flatnonzero(chosen)[0])} of the {self.description} is of the source "
                    f"{self.known_names[source]!r}, which is no longer mixed"
                )
            records[chosen] = self.records_of(source, counts[chosen])
        return sources, records

    def where(self, index: int) -> str:
        (source,), (record,) = self.locate([index])
        dataset = self.sources[source].dataset
        inner = dataset.where(int(record)) if hasattr(dataset, "where") else f"sample {record}"
        return f"sample {index} of the {self.description}: source {self.names[source]!r}, {inner}"

    def __getitem__(self, index: int):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list:
        """The samples of several sample numbers, each source's records read in one call. In a mix of ModelSamples,
        a sample of a source no longer mixed gives none, as a record its transform rejects: samples before the
        point where the mixture changed are read as the earlier plan drew them (by a dynamic loader's DP rank that
        had not read to that point, and in every later epoch), and the loader counts them."""
        sources, counts = self.planned(indices)
        items: list = [[] for _ in range(len(sources))]
        mixed = np.flatnonzero(sources < len(self.sources)) if self.model_samples else np.arange(len(sources))
        sources, records = self._records(sources[mixed], counts[mixed])
        for source in np.unique(sources).tolist():
            chosen = np.flatnonzero(sources == source)
            dataset = self.sources[source].dataset
            wanted = records[chosen].tolist()
            getitems = getattr(dataset, "__getitems__", None)
            fetched = getitems(wanted) if getitems is not None else [dataset[record] for record in wanted]
            convert = self.converter(source)
            for slot, item in zip(mixed[chosen].tolist(), fetched, strict=True):
                items[slot] = convert(item)
        return items

    def __repr__(self) -> str:
        return f"MixtureDataset({self.description}, {self.order.strategy}, {len(self):,} samples)"


def _same(item):
    return item


def _seq_length(dataset) -> int | None:
    config = getattr(dataset, "config", None)
    return getattr(config, "seq_length", None) if config is not None else getattr(dataset, "seq_length", None)


def build_mixture_dataset(
    sources: Sequence[Mapping] | None = None,
    strategy: str = "weighted",
    on_exhausted: str = "stop",
    num_samples: int | None = None,
    seed: int | None = None,
    shuffle: bool = True,
    log_every: int = 100,
    mixture_change: str = "refuse",
) -> MixtureDataset:
    """Mix dataset nodes by weight into one dataset, usable wherever a dataset node is.

    Args:
        sources: the sources, each a mapping of ``MixtureSource`` fields: ``name``, ``weight``, ``dataset`` (a
            dataset node), and at most one of ``epochs`` and ``max_samples``.
        strategy: ``weighted`` (each sample's source drawn by weight, keyed by the seed and the sample number) or
            ``interleave`` (a smooth weighted round robin in the weights' proportion).
        on_exhausted: when a source has given its epochs or max_samples: ``stop`` (the default: the mixture ends,
            keeping the weights exact), ``reweight`` (it goes on without that source, the other weights
            renormalised, until every source is exhausted) or ``restart`` (that source begins a new epoch with a
            new shuffle; the mixture is ``num_samples`` long).
        num_samples: the mixture's length; required with ``restart``, otherwise at most where the sources run out
            (default: there).
        seed: the pipeline's seed (given by the pipeline), keying the draws and the sources' epoch shuffles;
            default 1234.
        shuffle: read each source's epochs in a shuffled order; false reads them in record order.
        log_every: a loader logs the samples and tokens it took from each source every this many batches.
        mixture_change: ``refuse`` (the default): a loader state saved over other weights or sources is refused,
            naming each difference; ``allow``: it continues with this mixture, every source from its own position
            and these weights from the resume point (docs/mixtures.md).

    Returns:
        A ``MixtureDataset``: its order is fixed by the config and the seed, whatever the workers or DP size. With a
        streaming (iterable) source, a ``mixture_stream.StreamMixture``, read in order: its order is fixed by the
        config, the seed and the DP size, whatever the workers; ``num_samples`` is then each epoch's length, and a
        changed mixture continues from the cursor's sample number.
    """
    if not isinstance(sources, Sequence) or isinstance(sources, str) or not sources:
        raise DataConfigError(
            f"sources must be a non-empty list of {{name, weight, dataset}} mappings, got {sources!r}"[:300]
        )
    strategy = require_choice(
        "strategy", strategy, STRATEGIES, "'weighted' (sources drawn by weight) or 'interleave' (round robin)"
    )
    on_exhausted = require_choice(
        "on_exhausted", on_exhausted, EXHAUSTION_MODES, "'stop', 'reweight' or 'restart' (docs/mixtures.md)"
    )
    seed = require_int("seed", 1234 if seed is None else seed, 0)
    log_every = require_int("log_every", log_every, 1)
    if not isinstance(shuffle, bool):
        raise DataConfigError(f"shuffle must be true or false, got {shuffle!r}")
    if num_samples is not None:
        num_samples = require_int("num_samples", num_samples, 1)
    mixture_change = require_choice(
        "mixture_change", mixture_change, ("refuse", "allow"), "'refuse' or 'allow' (docs/mixtures.md)"
    )
    checked = [_checked_source(entry, position) for position, entry in enumerate(sources)]
    names = [source.name for source in checked]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise DataConfigError(f"sources names {duplicates} more than once; give every source its own name")
    settings = {
        "seed": seed,
        "shuffle": shuffle,
        "log_every": log_every,
        "num_samples": num_samples,
        "mixture_change": mixture_change,
    }
    if any(stream_of(source.dataset) is not None for source in checked):
        return _stream_mixture(checked, strategy, on_exhausted, settings)
    budgets = [source.budget for source in checked]
    order = MixtureOrder(
        [source.weight for source in checked],
        budgets,
        strategy=strategy,
        on_exhausted=on_exhausted,
        seed=seed,
        num_samples=num_samples,
    )
    dataset = MixtureDataset(checked, order, **settings)
    logger.info(
        "%r: %s; sources run out at %s",
        dataset,
        ", ".join(f"{s.name} {len(s.dataset):,} samples, budget {b:,}" for s, b in zip(checked, budgets, strict=True)),
        "never" if order.exhausted_at is None else f"sample {order.exhausted_at:,}",
    )
    return dataset


def _stream_mixture(checked, strategy: str, on_exhausted: str, settings: dict):
    """The mixture of sources of which at least one is a stream, read in order (``mixture_stream``); ``settings``
    are the keywords both mixtures take."""
    from hyper_parallel.data.mixture.mixture_stream import StreamMixture  # it builds on MixedSources, defined here

    draws = SourceDraws([source.weight for source in checked], strategy, settings["seed"])
    dataset = StreamMixture(checked, draws, on_exhausted=on_exhausted, **settings)
    logger.info(
        "%r: read in order, each stream from its own cursor; %s",
        dataset,
        ", ".join(
            f"{s.name} " + ("streamed" if budget is None else f"budget {budget:,}")
            for s, budget in zip(checked, dataset.budgets, strict=True)
        ),
    )
    return dataset
