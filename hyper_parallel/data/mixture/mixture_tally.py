"""What a loader over a mixture has delivered from each source: samples and tokens, kept in its state.

Owns: counting the samples and tokens of each delivered batch by source, the loader state's ``mixture`` part
(``{"batches": n, "sources": {name: {"weight", "samples", "tokens"}}, "plan": the mixture's plan}``; a source no
longer mixed keeps its counts, with weight 0) and reading it back, the info line a loader
logs every ``log_every`` batches, and the one-line summary ``hp-data preview`` prints. Not responsible for: which
samples a batch holds (the loaders) or the mixture's order (``mixture_order``).

A sample is a record of the mixture that gave at least one sample to the batch (a record the transform rejected
counts nothing); its tokens are those of all its samples (ModelSamples' ``input_ids``, an Indexed sample's
``tokens``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.resume_checks import check_state_type, state_field

__all__ = ["MixtureTally", "describe_mixture_state", "record_tokens"]

logger = get_logger(__name__)

_WHERE = "state['mixture']"


def record_tokens(items: Sequence[list]) -> np.ndarray:
    """The tokens of each record's samples (int64, one per record), as the workers count them."""
    return np.fromiter(
        (sum(len(sample.get("input_ids", sample.get("tokens", ()))) for sample in samples) for samples in items),
        dtype=np.int64,
        count=len(items),
    )


class MixtureTally:
    """The samples and tokens a loader delivered from each source of ``mixture`` (a ``MixtureDataset``)."""

    def __init__(self, mixture, log_every: int) -> None:
        self.mixture = mixture
        self.log_every = log_every
        self.names = list(mixture.known_names)
        self.weights = [mixture.weights.get(name, 0.0) for name in self.names]
        self.samples = np.zeros(len(self.names), dtype=np.int64)
        self.tokens = np.zeros(len(self.names), dtype=np.int64)
        self.batches = 0

    def count_records(self, keys: Sequence, tokens: np.ndarray) -> None:
        """Count a delivered batch of whole records (a fixed loader's): their keys (sample numbers, or a mixture
        stream's keys) and tokens."""
        given = tokens > 0
        self._count(self.mixture.sources_of(keys)[given], tokens[given])

    def count_samples(self, entries: Iterable[tuple]) -> None:
        """Count a delivered batch of ``((sample key, window), ModelSample)`` entries (a dynamic loader's)."""
        keys, windows, lengths = [], [], []
        for (index, window), sample in entries:
            keys.append(index)
            windows.append(window)
            lengths.append(len(sample["input_ids"]))
        sources = self.mixture.sources_of(keys)
        np.add.at(self.samples, sources[np.asarray(windows) == 0], 1)  # a record counts once, with its first window
        np.add.at(self.tokens, sources, np.asarray(lengths, dtype=np.int64))
        self._delivered()

    def _count(self, sources: np.ndarray, tokens: np.ndarray) -> None:
        np.add.at(self.samples, sources, 1)
        np.add.at(self.tokens, sources, tokens)
        self._delivered()

    def _delivered(self) -> None:
        self.batches += 1
        if self.batches % self.log_every == 0:
            logger.info("%s after %s batches: %s", self.mixture.description, f"{self.batches:,}", self.summary())

    def summary(self) -> str:
        """``name: samples (share), tokens`` for every source, in one line."""
        return describe_mixture_state(self.state_dict())

    def state_dict(self) -> dict:
        return {
            "batches": self.batches,
            "sources": {
                name: {"weight": weight, "samples": int(samples), "tokens": int(tokens)}
                for name, weight, samples, tokens in zip(
                    self.names, self.weights, self.samples, self.tokens, strict=True
                )
            },
            "plan": self.mixture.plan_state(),
        }

    def check_state(self, state) -> None:
        """Refuse a malformed ``mixture`` part (its plan is the mixture's to check: ``resumed_plan``)."""
        check_state_type(state, Mapping, _WHERE)
        state_field(state, "batches", int, _WHERE)
        state_field(state, "plan", Mapping, _WHERE)
        for name, counts in state_field(state, "sources", Mapping, _WHERE).items():
            check_state_type(counts, Mapping, f"{_WHERE}['sources'][{name!r}]")
            for key in ("samples", "tokens"):
                state_field(counts, key, int, f"{_WHERE}['sources'][{name!r}]")

    def load_state_dict(self, state: Mapping) -> None:
        """Continue counting from ``state`` (checked by ``check_state`` first); a source new to it starts at 0."""
        saved = state["sources"]
        none = {"samples": 0, "tokens": 0}
        self.batches = state["batches"]
        self.samples = np.array([saved.get(name, none)["samples"] for name in self.names], dtype=np.int64)
        self.tokens = np.array([saved.get(name, none)["tokens"] for name in self.names], dtype=np.int64)


def describe_mixture_state(state: Mapping) -> str:
    """One line of a ``mixture`` state part: each source's samples, their share, and its tokens."""
    sources = state["sources"]
    total = sum(counts["samples"] for counts in sources.values()) or 1
    return "; ".join(
        f"{name} {counts['samples']:,} samples ({100 * counts['samples'] / total:.1f}%), {counts['tokens']:,} tokens"
        for name, counts in sources.items()
    )
