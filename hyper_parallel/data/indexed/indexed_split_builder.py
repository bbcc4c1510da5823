"""Assembling the Indexed path: low-level readers to train/valid/test mid-level datasets to blends.

Owns: the split ranges of each prefix, how many samples each source builds, which blend (if any) tops each
split (``blend_kind``, decided once per blend), the cache options of the build (decided once, passed to every
dataset), and lazy construction. It follows megatron-core's ``BlendedMegatronDatasetBuilder`` decisions exactly:
a single unweighted prefix (or a single prefix per split) gives a plain mid-level dataset with the requested
sample count; weighted sources build ``ceil(ceil(N * w) * (1 + surplus))`` samples each and are blended to
``sum(ceil(N * w))`` samples; unweighted sources build one epoch each and are blended by their sizes.
Not responsible for: sample contents (``indexed_pretrain_dataset``) or blending order (``indexed_blended_dataset``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from hyper_parallel.data.dataset_logging import brief_list, get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.indexed_blended_dataset import BlendedDataset
from hyper_parallel.data.indexed.indexed_data_config import (
    SPLIT_NAMES,
    Blend,
    IndexedDataConfig,
    parse_blend,
    sample_counts,
    split_matrix,
    split_range,
)
from hyper_parallel.data.indexed.indexed_data_reader import read_sequence_counts
from hyper_parallel.data.indexed.indexed_dataset import dataset_class, open_low_level
from hyper_parallel.data.indexed.indexed_helpers import blended_sample_counts, normalize_weights
from hyper_parallel.data.indexed.indexed_lazy_dataset import LazyDatasetProxy
from hyper_parallel.data.indexed.indexed_simple_blended_dataset import SimpleBlendedDataset
from hyper_parallel.data.indexed.pair_metadata import check_same_tokenizer
from hyper_parallel.data.parallel.build_barrier import process_group_ready
from hyper_parallel.data.tokenizer_protocol import Tokenizer, read_tokenizer

__all__ = ["BlendKind", "IndexedSplitBuilder", "blend_kind"]

logger = get_logger("hyper_parallel.data.indexed.indexed_split_builder")

# What each mid-level dataset class makes of its prefixes, for the log line of a build.
_READS = {
    "GPTDataset": "documents cut into samples across document boundaries",
    "GPTFromMRDataset": "records packed offline, read as they are",
    "MockGPTDataset": "synthetic documents, mock_data",
}

Bookends = list[tuple[float, float] | None]
Sizes = Sequence[int | None]


@dataclass
class _Source:
    """One prefix's low-level data, opened on first use."""

    prefix: str | None
    config: IndexedDataConfig
    tokenizer: Tokenizer
    matrix: Bookends
    sources_checked: bool  # fast_cache_load: the build that wrote the caches checked the sources
    listed: tuple[int, int] | None = None  # (sequence_count, document_count) from per_dataset_sequences_path
    known_count: int | None = None  # no need to open the .idx for splits
    _data: object = None

    @property
    def data(self):
        if self._data is None:
            data = open_low_level(self.prefix, self.config, self.tokenizer)
            self._check_listed_counts(data)  # before anything is sized from them
            self._data = data
            self._check_sample_fits()
        return self._data

    def _check_listed_counts(self, reader) -> None:
        """The counts per_dataset_sequences_path gave must be the header's: splits were cut from them."""
        if self.listed is None:
            return
        actual = (len(reader), len(reader.document_indices))
        if tuple(self.listed) != actual:
            (sequences, documents), path = self.listed, self.config.per_dataset_sequences_path
            raise DataFileError(
                f"per_dataset_sequences_path {path} lists '{self.prefix}' with {sequences} sequences and "
                f"{documents - 1} documents, but {self.prefix}.idx holds {actual[0]} sequences and {actual[1] - 1} "
                "documents: the data changed after the file was written, and its splits would drop or invent "
                "sequences. Rerun `python -m hyper_parallel.data.tools.build_sequences_per_dataset` with this "
                "run's data paths."
            )

    def _check_sample_fits(self) -> None:
        """Before any index is built: some split of a document prefix must hold one sample's tokens.

        Mock documents are plenty, packed records are checked record by record, and fast_cache_load builds no index
        (the ordinary build that wrote its caches checked): start-up with many prefixes pays nothing for it."""
        if self.prefix is None or self.config.is_dataset_from_mr or self.sources_checked:
            return
        lengths = self._data.sequence_lengths
        ranges = {name: split_range(b, len(lengths)) for name, b in zip(SPLIT_NAMES, self.matrix, strict=True) if b}
        tokens = {name: int(lengths[begin:end].sum(dtype=np.int64)) for name, (begin, end) in ranges.items()}
        self.config.check_sample_fits(self.prefix, tokens)

    def __len__(self) -> int:
        """Sequences of the prefix, from the counts file, the header alone, or the mock data."""
        if self.known_count is None and self.listed is not None:
            self.known_count = self.listed[0]  # checked against the header when the reader opens
        if self.known_count is None:
            # A lazy build reads only the header now; an eager one opens the reader it needs anyway.
            lazy = self.config.data_lazy_load and self.prefix is not None
            self.known_count = read_sequence_counts(self.prefix)[0] if lazy else len(self.data)
        return self.known_count


class BlendKind(StrEnum):
    """The dataset that tops a split of a blend."""

    NONE = "none"  # the mid-level dataset itself, with the requested sample count
    WEIGHTED = "weighted"  # BlendedDataset by the normalised weights
    BY_SIZE = "by_size"  # BlendedDataset of one epoch of each source, weighted by their sizes
    INTER = "inter"  # SimpleBlendedDataset: one packed record of each source in turn
    INTRA = "intra"  # SimpleBlendedDataset: every packed record of each source, one source after another


def blend_kind(blend: Blend, simple_blend: str, per_split: bool) -> BlendKind:
    """Which dataset tops a split of ``blend``, as megatron-core's builder decides.

    ``simple_blend`` ``"inter"`` or ``"intra"`` picks that simple blend whatever the weights and the number of
    sources. Otherwise a single prefix gets no blend when it has no weight or comes from a per-split path
    (whatever its weight there); weights give a weighted blend (a single weighted prefix too), no weights a blend
    by the sources' sizes.

    Args:
        blend: the prefixes and weights of ``data_path`` or of one per-split path.
        simple_blend: ``IndexedDataConfig.simple_blend``.
        per_split: ``blend`` comes from ``train_data_path``, ``valid_data_path`` or ``test_data_path``.
    """
    if simple_blend != "no":
        return BlendKind(simple_blend)
    if len(blend.prefixes) == 1 and (per_split or blend.weights is None):
        return BlendKind.NONE
    return BlendKind.BY_SIZE if blend.weights is None else BlendKind.WEIGHTED


class IndexedSplitBuilder:
    """Builds ``(train, valid, test)`` for an Indexed-path config.

    Args:
        config: the settings.
        tokenizer: gives the EOD and pad ids (and ``vocab_size`` for mock data); see ``tokenizer_protocol``.
        synchronize: with a process group, every rank calls ``build`` and rank 0 builds caches first.
    """

    def __init__(self, config: IndexedDataConfig, tokenizer, synchronize: bool = True) -> None:
        self.config = config
        self.tokenizer = read_tokenizer(tokenizer)  # read once for every dataset of the build
        self.cls = dataset_class(config)
        self.cache = config.cache_options(together=synchronize and process_group_ready())
        self._sequences = config.load_sequences_per_dataset()

    def _lazily(self, build: Callable[[], object], description: str):
        """``build()``, or a proxy that calls it on first use under ``data_lazy_load``."""
        return LazyDatasetProxy(build, description) if self.config.data_lazy_load else build()

    # -- mid-level ---------------------------------------------------------------------------------------------

    def _source(self, prefix: str | None, matrix: Bookends) -> _Source:
        listed = None
        if self._sequences is not None and prefix is not None:
            if prefix not in self._sequences:
                raise DataConfigError(
                    f"prefix '{prefix}' is missing from per_dataset_sequences_path "
                    f"{self.config.per_dataset_sequences_path}, which lists {len(self._sequences)} other prefixes "
                    f"(keys are the prefixes as the data paths write them); {self.config.sequences_file_fix}"
                )
            listed = self._sequences[prefix]
        return _Source(prefix, self.config, self.tokenizer, matrix, self.cache.assume_complete, listed)

    def _mid_level(self, source: _Source, bookend, split_index: int, num_samples: int | None):
        split = SPLIT_NAMES[split_index]
        begin, end = split_range(bookend, len(source))

        def build():
            data = source.data  # opening checks the counts the range came from, before it is allocated
            indices = np.arange(begin, end, dtype=np.int32)
            return self.cls(data, source.prefix, indices, num_samples, split, self.config, self.tokenizer, self.cache)

        return self._lazily(build, f"{self.cls.__name__} {source.prefix} {split} [{begin}, {end})")

    def _splits_of(self, prefix: str | None, matrix: Bookends, sizes: Sizes) -> list:
        source = self._source(prefix, matrix)
        return [None if matrix[i] is None else self._mid_level(source, matrix[i], i, sizes[i]) for i in range(3)]

    # -- blends ------------------------------------------------------------------------------------------------

    def _blend(self, kind: BlendKind, datasets: list, prefixes, weights, size: int | None, split_index: int):
        """The split's blend of ``datasets``; ``weights`` are the normalised ones of a ``WEIGHTED`` blend."""
        split = SPLIT_NAMES[split_index]
        if kind in (BlendKind.INTER, BlendKind.INTRA):
            return SimpleBlendedDataset(datasets, kind.value, size)

        def build():
            if kind is BlendKind.WEIGHTED:
                return BlendedDataset(datasets, weights, size, split, self.cache)
            lengths = [len(d) for d in datasets]  # built here, so that a lazy blend opens nothing before use
            empty = [prefix for prefix, length in zip(prefixes, lengths, strict=True) if length == 0]
            if empty:
                raise DataConfigError(
                    f"blend sources {empty} have no {split} samples; give the {split} split a larger share or drop them"
                )
            total = None if size is None else min(size, sum(lengths))
            return BlendedDataset(datasets, lengths, total, split, self.cache)

        return self._lazily(build, f"BlendedDataset of {len(datasets)} sources, {split}")

    def _splits(self, blend: Blend, matrix: Bookends, sizes: Sizes, per_split: bool = False) -> list:
        """The datasets that top each split of ``blend``, as ``blend_kind`` decides."""
        kind = blend_kind(blend, self.config.simple_blend, per_split)
        prefixes = blend.prefixes
        if kind is BlendKind.NONE:
            return self._splits_of(prefixes[0], matrix, sizes)
        if len(prefixes) == 1:
            logger.warning("building a blend of a single source %s", prefixes[0])
        weights = normalize_weights(blend.weights) if kind is BlendKind.WEIGHTED else None
        logger.debug("blend of %d prefixes: %s", len(prefixes), kind.value)
        targets: list[list[int] | None] = [None] * 3
        buffers: list[list[int | None]] = [[None] * len(prefixes) for _ in range(3)]
        if weights is not None:
            for i in range(3):
                if matrix[i] is None:
                    continue
                if sizes[i] is None:
                    raise DataConfigError(
                        f"a weighted blend needs the number of {SPLIT_NAMES[i]} samples; pass "
                        "train_valid_test_num_samples, or drop the weights to use each source once"
                    )
                targets[i], buffers[i], _ = blended_sample_counts(
                    weights, sizes[i], self.config.mid_level_dataset_surplus
                )
                logger.debug(
                    "%s blend plan: samples per prefix %s, each source built with %s (surplus %s)",
                    SPLIT_NAMES[i],
                    brief_list(targets[i]),
                    brief_list(buffers[i]),
                    self.config.mid_level_dataset_surplus,
                )
        per_source = [
            self._splits_of(prefix, matrix, [buffers[i][k] for i in range(3)]) for k, prefix in enumerate(prefixes)
        ]
        result: list = [None] * 3
        for i in range(3):
            if matrix[i] is None:
                continue
            datasets = [splits[i] for splits in per_source]
            size = sum(targets[i]) if weights is not None else sizes[i]
            result[i] = self._blend(kind, datasets, prefixes, weights, size, i)
        return result

    # -- entry -------------------------------------------------------------------------------------------------

    def _check_tokenizers(self, prefixes: Sequence[str]) -> None:
        """Sources must share one tokenizer and dtype. fast_cache_load trusts the caches, and the build that wrote
        them checked; it skips the check to keep start-up with many prefixes cheap."""
        if not self.cache.assume_complete:
            check_same_tokenizer(prefixes)

    def _log_choice(self) -> None:
        config = self.config
        lazy = ", each dataset built on first use (data_lazy_load)" if config.data_lazy_load else ""
        logger.info(
            "Indexed dataset type: %s (%s), samples of %d tokens%s",
            self.cls.__name__,
            _READS[self.cls.kind],
            config.seq_length,
            lazy,
        )

    def _cache_place(self, prefixes: Sequence[str | None]) -> str:
        """Where the index caches of a split over ``prefixes`` are, for its log line."""
        if self.cls.kind == "GPTFromMRDataset":
            return "no index cache (packed records are read in order)"
        if self.cache.directory is not None:
            return f"index cache in {self.cache.directory}"
        if len(prefixes) == 1:
            where = self.cache.directory_for(prefixes[0])
            return "indices in memory (no data_cache_path)" if where is None else f"index cache in {where}"
        return "index caches in <prefix>/cache/GPTDataset_indices, blend indices in memory"

    def _log_splits(self, splits: list, prefixes_of: Sequence[Sequence[str | None] | None], matrix: Bookends) -> None:
        """One line per built split: its share of each prefix, its dataset, its size and its index cache."""
        for i, dataset in enumerate(splits):
            if dataset is None:
                continue
            prefixes = prefixes_of[i]
            begin, end = matrix[i]
            sources = (prefixes[0] or "mock data") if len(prefixes) == 1 else f"{len(prefixes)} prefixes"
            if isinstance(dataset, LazyDatasetProxy) and not dataset.is_built:
                built = f"{dataset.description}, built on first use"
            else:
                name = type(dataset).__name__
                top = name if name == self.cls.__name__ else f"{name} of {self.cls.__name__} sources"
                built = f"{top}, {len(dataset):,} samples of {self.config.seq_length} tokens"
            logger.info(
                "%s split: %s to %s of %s, %s; %s",
                SPLIT_NAMES[i],
                f"{begin:.1%}",
                f"{end:.1%}",
                sources,
                built,
                self._cache_place(prefixes),
            )

    def build(self, data_path, sizes: Sizes | None = None) -> list:
        """Build ``[train, valid, test]`` (None for an absent split).

        Args:
            data_path: a prefix, a directory or a blend list; ignored with per-split paths or mock data.
            sizes: samples per split; None (or a None entry) means one epoch of that split.
        """
        sizes = sample_counts(sizes)
        config = self.config
        self._log_choice()
        if config.mock_data:
            matrix = split_matrix("1,1,1")  # upstream forces this split for mock data
            splits = self._splits_of(None, matrix, sizes)
            self._log_splits(splits, [(None,)] * 3, matrix)
            return splits
        if config.has_per_split_paths:
            result: list = [None] * 3
            paths = (config.train_data_path, config.valid_data_path, config.test_data_path)
            blends = [None if path is None else parse_blend(path) for path in paths]
            self._check_tokenizers([prefix for blend in blends if blend is not None for prefix in blend.prefixes])
            for i, blend in enumerate(blends):
                if blend is None:
                    continue
                matrix: Bookends = [None, None, None]
                matrix[i] = (0.0, 1.0)
                spoofed = [0, 0, 0]
                spoofed[i] = sizes[i]
                result[i] = self._splits(blend, matrix, spoofed, per_split=True)[i]
            self._log_splits(result, [None if b is None else b.prefixes for b in blends], [(0.0, 1.0)] * 3)
            return result
        if data_path is None:
            raise DataConfigError("data_path is required unless mock_data or train/valid/test_data_path are set")
        if config.split is None:
            raise DataConfigError("split is required with data_path, e.g. split: '98, 1, 1'")
        blend = parse_blend(data_path)
        self._check_tokenizers(blend.prefixes)
        matrix = split_matrix(config.split)
        splits = self._splits(blend, matrix, sizes)
        self._log_splits(splits, [blend.prefixes] * 3, matrix)
        return splits
