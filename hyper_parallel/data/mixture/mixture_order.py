"""The order of a mixture: which source, and which of its samples, each sample number of the mixture takes.

Owns: ``SourceDraws``, the source each sample number draws in a phase of the sources drawn (also read in order
by a mixture with a streaming source, ``mixture_stream``), and ``MixtureOrder``, a pure function of the weights,
each source's budget, the strategy, what happens when a source runs out, and the seed, planning sample numbers
``[a, b)`` (``plan``) or any sample numbers (``plan_at``) in vectorised numpy, without replaying the numbers
before them; and the mixture's length. Not responsible for:
which record a source's ``c``-th sample is (``build_mixture``: its epochs and their shuffles), reading sources, or
batching.

Strategies:

* ``weighted``: sample ``n`` draws its source by weight from one uniform number of a Philox generator keyed by
  ``(seed, n // 4096)``, so any sample's source is computable from its number alone.
* ``interleave``: a smooth weighted round robin over the weights as small integers (``0.7, 0.3`` is ``7, 3``): one
  period of ``sum(weights)`` samples holds each source its weight's count, spread as evenly as it can be, and
  repeats.

A source's position (how many of its samples come before sample ``n``) is its count at the start of ``n``'s block
of 4096 (computed once at construction, per block) plus its count within the block. When a source's budget is
spent (its last sample is taken), ``on_exhausted`` decides: ``stop`` ends the mixture there; ``reweight`` goes on
without it, the other weights renormalised (a new *phase* starts at the next sample); ``restart`` never removes a
source (``build_mixture`` starts its next epoch), so the mixture is as long as ``num_samples``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from hyper_parallel.data.errors import DataConfigError

__all__ = ["BLOCK", "EXHAUSTION_MODES", "STRATEGIES", "MixtureOrder", "SourceDraws", "ranks_within"]

BLOCK = 4096  # sample numbers per Philox key; positions are kept per block
STRATEGIES = ("weighted", "interleave")
EXHAUSTION_MODES = ("stop", "reweight", "restart")
_MAX_PERIOD = 1 << 16  # an interleave period is computed once, one step per sample
_BLOCK_KEY = np.uint64(1 << 63)  # the Philox key word of source draws; source shuffles use words below it
_CACHED_BLOCKS = 64


@dataclass(frozen=True)
class _Phase:
    """A run of sample numbers from ``start`` on in which the same sources are drawn with the same weights."""

    start: int
    active: np.ndarray  # the source ids drawn in this phase
    thresholds: np.ndarray  # weighted: cumulative normalised weights of ``active``
    period: np.ndarray  # interleave: the source ids of one round-robin period


def interleave_period(weights: Sequence[float]) -> np.ndarray:
    """One period of the smooth weighted round robin over ``weights`` as the smallest integers of their ratios.

    Each step adds every weight to its source's credit and takes the source of the largest credit (the first on a
    tie), which then pays the period's length: ``[2, 1]`` gives ``[0, 1, 0]``.
    """
    ratios = [Fraction(float(weight)).limit_denominator(1000) for weight in weights]
    scale = math.lcm(*(ratio.denominator for ratio in ratios))
    integers = [int(ratio * scale) for ratio in ratios]
    divisor = math.gcd(*integers)
    integers = [value // divisor for value in integers]
    total = sum(integers)
    if total > _MAX_PERIOD:
        raise DataConfigError(
            f"the interleave weights {list(weights)} are {integers} as integers, a round-robin period of {total:,} "
            f"samples (more than {_MAX_PERIOD:,}); write weights of a smaller integer ratio, such as 7 and 3"
        )
    step = np.asarray(integers, dtype=np.int64)
    credit = np.zeros(len(step), dtype=np.int64)
    period = np.empty(total, dtype=np.int64)
    for position in range(total):
        credit += step
        chosen = int(np.argmax(credit))
        credit[chosen] -= total
        period[position] = chosen
    return period


class SourceDraws:
    """The source each sample number draws, by the strategy, in a phase of the sources drawn from its start on.

    Args:
        weights: one positive weight per source (any scale; a phase normalises those of its sources).
        strategy: ``weighted`` or ``interleave`` (module docstring).
        seed: keys the weighted draws.
    """

    def __init__(self, weights: Sequence[float], strategy: str, seed: int) -> None:
        self.weights = np.asarray(weights, dtype=np.float64)
        self.strategy, self.seed = strategy, seed
        self._uniforms: tuple[int, np.ndarray] | None = None  # the last block's, read again by reads in order

    def phase(self, start: int, active: np.ndarray) -> _Phase:
        """The phase drawing the sources ``active`` (ids) from sample number ``start`` on."""
        active = np.asarray(active, dtype=np.int64)
        weights = self.weights[active] / self.weights[active].sum()
        thresholds = np.cumsum(weights)
        thresholds[-1] = 1.0
        period = interleave_period(weights) if self.strategy == "interleave" else np.empty(0, dtype=np.int64)
        return _Phase(start, active, thresholds, active[period] if len(period) else period)

    def sources(self, phase: _Phase, numbers: np.ndarray) -> np.ndarray:
        """The source ids that sample ``numbers`` (at or after ``phase.start``) draw in ``phase``."""
        if self.strategy == "interleave":
            return phase.period[(numbers - phase.start) % len(phase.period)]
        drawn = np.searchsorted(phase.thresholds, self._uniforms_of(numbers), side="right")
        return phase.active[np.minimum(drawn, len(phase.active) - 1)]

    def _uniforms_of(self, numbers: np.ndarray) -> np.ndarray:
        blocks, offsets = np.divmod(numbers, BLOCK)
        uniforms = np.empty(len(numbers), dtype=np.float64)
        for block in np.unique(blocks).tolist():
            chosen = blocks == block
            uniforms[chosen] = self._block_uniforms(block)[offsets[chosen]]
        return uniforms

    def _block_uniforms(self, block: int) -> np.ndarray:
        if self._uniforms is None or self._uniforms[0] != block:
            key = np.array([self.seed, _BLOCK_KEY | np.uint64(block)], dtype=np.uint64)
            self._uniforms = (block, np.random.Generator(np.random.Philox(key=key)).random(BLOCK))
        return self._uniforms[1]


class MixtureOrder:
    """Which source, and which of its samples, each sample number of a mixture takes.

    Args:
        weights: one positive weight per source (any scale; normalised here).
        budgets: per source, how many samples it gives before it is exhausted; None: never exhausted.
        strategy: ``weighted`` or ``interleave`` (module docstring).
        on_exhausted: ``stop``, ``reweight`` or ``restart`` (module docstring); ``restart`` ignores the budgets.
        seed: keys the weighted draws.
        num_samples: the mixture's length; needed when no source can run out (``restart``, or no budget).
            With budgets, at most the samples the sources hold before the mixture ends.
    """

    def __init__(
        self,
        weights: Sequence[float],
        budgets: Sequence[int | None],
        *,
        strategy: str,
        on_exhausted: str,
        seed: int,
        num_samples: int | None = None,
    ) -> None:
        self.weights = np.asarray(weights, dtype=np.float64)
        self.budgets = [None if on_exhausted == "restart" else budget for budget in budgets]
        self.strategy, self.on_exhausted, self.seed = strategy, on_exhausted, seed
        self.draws = SourceDraws(weights, strategy, seed)
        self.phases: list[_Phase] = [self.draws.phase(0, np.arange(len(self.weights)))]
        self._prefix: list | np.ndarray = [np.zeros(len(self.weights), dtype=np.int64)]  # counts before each block
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # the sources of recently planned blocks
        natural = self._scan(num_samples)
        self._prefix = np.stack(self._prefix)  # one array, small to pickle for the DataLoader workers
        self.exhausted_at = natural  # where the sources ran out, or None
        if num_samples is None:
            self.length = natural
        elif natural is not None and natural < num_samples:
            raise DataConfigError(
                f"num_samples is {num_samples:,}, but the sources run out after {natural:,} samples "
                f"(on_exhausted: {on_exhausted}); raise a source's epochs or max_samples, lower num_samples, or "
                "set on_exhausted: restart"
            )
        else:
            self.length = num_samples

    # Planning ---------------------------------------------------------------------------------------------------

    def _block_plan(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """The source of every sample number of ``block`` and its count within the block before it (the last
        blocks asked for are kept)."""
        planned = self._blocks.get(block)
        if planned is None:
            if len(self._blocks) >= _CACHED_BLOCKS:
                del self._blocks[next(iter(self._blocks))]
            sources = self._drawn(block)
            planned = self._blocks[block] = (sources, ranks_within(sources))
        return planned

    def _drawn(self, block: int) -> np.ndarray:
        numbers = np.arange(block * BLOCK, (block + 1) * BLOCK, dtype=np.int64)
        starts = np.array([phase.start for phase in self.phases], dtype=np.int64)
        which = np.searchsorted(starts, numbers, side="right") - 1
        sources = np.empty(BLOCK, dtype=np.int64)
        for index in np.unique(which):
            chosen = which == index
            sources[chosen] = self.draws.sources(self.phases[index], numbers[chosen])
        return sources

    def _positions(self, block: int) -> np.ndarray:
        """Each sample's count within its source over the whole mixture, for the samples of ``block``."""
        sources, ranks = self._block_plan(block)
        return ranks + self._prefix[block][sources]

    def _scan(self, num_samples: int | None) -> int | None:
        """Walk the blocks once, keeping each block's starting counts and finding where sources run out.

        Returns where the mixture ends by exhaustion, or None when it does not before ``num_samples``.
        """
        budgets = np.array([np.iinfo(np.int64).max if b is None else b for b in self.budgets], dtype=np.int64)
        if num_samples is None and all(budget is None for budget in self.budgets):
            raise DataConfigError(
                "the mixture has no end: no source can run out (on_exhausted: restart, or no source with epochs or "
                "max_samples); set num_samples"
            )
        block = 0
        while num_samples is None or block * BLOCK < num_samples:
            sources = self._drawn(block)  # the ranks within the block only where a budget may end in it
            after = self._prefix[block] + np.bincount(sources, minlength=len(self.weights))
            if (after >= budgets).any():  # some source's last sample may lie in this block
                positions = self._positions(block)
                in_phase = np.arange(block * BLOCK, (block + 1) * BLOCK) >= self.phases[-1].start
                spent = np.flatnonzero(in_phase & (positions == budgets[sources] - 1))
                if len(spent):
                    end = block * BLOCK + int(spent[0]) + 1
                    source = int(sources[spent[0]])
                    remaining = self.phases[-1].active[self.phases[-1].active != source]
                    if self.on_exhausted == "stop" or not len(remaining):
                        return end
                    self.phases.append(self.draws.phase(end, remaining))
                    self._blocks.clear()  # this block and the next are drawn anew from the new phase
                    continue
            self._prefix.append(after)
            block += 1
        return None

    def plan(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """The sources and the positions within them (counts over the whole mixture) of sample numbers
        ``[start, stop)``: two int64 arrays."""
        return self.plan_at(np.arange(start, stop, dtype=np.int64))

    def plan_at(self, numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sources and the positions within them of any sample numbers (int64 arrays of their length)."""
        numbers = np.asarray(numbers, dtype=np.int64)
        if len(numbers) and (numbers.min() < 0 or numbers.max() >= self.length):
            raise IndexError(f"sample numbers must lie in [0, {self.length}), got {numbers.min()}..{numbers.max()}")
        blocks, offsets = np.divmod(numbers, BLOCK)
        if len(numbers) and blocks[0] == blocks[-1] and (blocks == blocks[0]).all():  # a read in order: one block
            block = int(blocks[0])
            in_block, ranks = self._block_plan(block)
            sources = in_block[offsets]
            return sources, ranks[offsets] + self._prefix[block][sources]
        sources = np.empty(len(numbers), dtype=np.int64)
        positions = np.empty(len(numbers), dtype=np.int64)
        order = np.argsort(blocks, kind="stable")
        unique, starts = np.unique(blocks[order], return_index=True)
        for block, chosen in zip(unique.tolist(), np.split(order, starts[1:]), strict=True):
            in_block, ranks = self._block_plan(block)
            picked = offsets[chosen]
            sources[chosen] = in_block[picked]
            positions[chosen] = ranks[picked] + self._prefix[block][in_block[picked]]
        return sources, positions

    def counts_before(self, number: int) -> np.ndarray:
        """How many samples of each source the sample numbers ``[0, number)`` take (int64, one per source)."""
        if not 0 <= number <= self.length:
            raise IndexError(f"a sample number must lie in [0, {self.length}], got {number}")
        if number == 0:
            return np.zeros(len(self.weights), dtype=np.int64)
        block = (number - 1) // BLOCK  # the block of the last sample counted: its starting counts always exist
        sources, _ = self._block_plan(block)
        within = np.bincount(sources[: number - block * BLOCK], minlength=len(self.weights))
        return self._prefix[block] + within

    def __len__(self) -> int:
        return self.length


def ranks_within(sources: np.ndarray) -> np.ndarray:
    """Each entry's count of equal entries before it: ``[0, 1, 0, 0]`` gives ``[0, 0, 1, 2]``."""
    order = np.argsort(sources, kind="stable")
    ranked = sources[order]
    ranks = np.empty(len(sources), dtype=np.int64)
    ranks[order] = np.arange(len(sources)) - np.searchsorted(ranked, ranked, side="left")
    return ranks
