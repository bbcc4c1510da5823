"""``BlendedDataset``: several mid-level datasets of one split mixed by weight, in megatron-core's order.

Owns: the blending indices (``dataset_index`` int16, ``dataset_sample_index`` int64), their cache, and the check
that no source is asked for more samples than it has. Not responsible for: building the sources or choosing
their sizes (``indexed_split_builder``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from hyper_parallel.data.dataset_logging import brief_list, get_logger
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.index_cache import CacheOptions, ExpectedArray, IndexCache, array_property
from hyper_parallel.data.indexed.indexed_helpers import (
    build_blending_indices,
    build_exhaustive_blending_indices,
    normalize_weights,
)

__all__ = ["BlendedDataset"]

logger = get_logger(__name__)

_INDEX_NAMES = ("dataset_index", "dataset_sample_index", "samples_per_dataset")


class BlendedDataset(torch.utils.data.Dataset):
    """Draw samples from ``datasets`` in proportion to ``weights`` until ``size`` samples.

    At each step the source with the largest deficit (``weight * max(step, 1) - drawn``, ties to the lowest
    index) gives its next sample. With ``size=None`` the weights are the sources' sizes and every sample of every
    source is used once. Each sample carries ``dataset_id``, the index of its source.

    Args:
        datasets: mid-level datasets of one split (each with ``unique_identifiers``).
        weights: positive weights (normalised here), or the integer source sizes when ``size`` is None.
        size: samples in the blend, or None for the exhaustive blend.
        split: the split name, for the cache key.
        cache_options: where and how its index cache is read and built (``IndexedDataConfig.cache_options``).
    """

    kind = "BlendedDataset"

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float],
        size: int | None,
        split: str,
        cache_options: CacheOptions,
    ) -> None:
        if not datasets:
            raise DataConfigError("a blend needs at least one dataset")
        if len(datasets) >= 32767:
            raise DataConfigError(f"a blend holds at most 32766 datasets (int16 ids), got {len(datasets)}")
        if len(weights) != len(datasets):
            raise DataConfigError(f"{len(weights)} weights for {len(datasets)} datasets")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights) if size is not None else [int(w) for w in weights]
        self.size = size
        self.split = split
        self.unique_identifiers = {
            "class": self.kind,
            "datasets": [dataset.unique_identifiers for dataset in self.datasets],
            "split": split,
            "weights": self.weights,
            "size": size,
        }
        cache = IndexCache(cache_options.directory, self.kind, split, self.unique_identifiers)
        self._length = size if size is not None else sum(self.weights)
        # A cached entry of other lengths is another entry's, never read.
        expected = {name: ExpectedArray((self._length,)) for name in ("dataset_index", "dataset_sample_index")}
        expected["samples_per_dataset"] = ExpectedArray((len(self.datasets),))
        self._arrays: Mapping[str, np.ndarray] = cache.get_or_build(
            _INDEX_NAMES, self._build_indices, cache_options, expected
        )
        if not cache_options.defer:
            self._check_sources()
        if size is None:  # the weights are the sources' sizes, each taken once
            logger.info(
                "%s blend: %s samples, every sample of %d sources once, samples per source %s",
                split,
                f"{self._length:,}",
                len(self.datasets),
                brief_list(self.weights),
            )
        else:
            per_source = "counted on first use (defer_npy_index_mmap)"
            if not cache_options.defer:
                per_source = brief_list(self._arrays["samples_per_dataset"].tolist())
            logger.info(
                "%s blend: %s samples of %d sources, weights %s, samples per source %s",
                split,
                f"{self._length:,}",
                len(self.datasets),
                brief_list(self.weights, ".3g"),
                per_source,
            )

    def _build_indices(self) -> dict[str, np.ndarray]:
        if self.size is None:
            dataset_index, sample_index = build_exhaustive_blending_indices(self.weights)
        else:
            dataset_index, sample_index = build_blending_indices(self.weights, self.size)
        # Counted once at build time, so that a warm load checks the sources without a pass over the index.
        samples_per_dataset = np.bincount(dataset_index, minlength=len(self.datasets)).astype(np.int64)
        return {
            "dataset_index": dataset_index,
            "dataset_sample_index": sample_index,
            "samples_per_dataset": samples_per_dataset,
        }

    def _check_sources(self) -> None:
        """Every source must hold the samples the blend takes from it."""
        needed = self._arrays["samples_per_dataset"]
        for source, (dataset, count) in enumerate(zip(self.datasets, needed, strict=True)):
            if count > len(dataset):
                raise DataConfigError(
                    f"blend source {source} ({getattr(dataset, 'dataset_path', None)}, {self.split} split) has "
                    f"{len(dataset)} samples but the blend needs {int(count)}; raise mid_level_dataset_surplus, "
                    "lower its weight, or give it more data"
                )

    @property
    def eod_token_id(self) -> int | None:
        """The EOD id of the sources (one tokenizer builds them all)."""
        return getattr(self.datasets[0], "eod_token_id", None) if self.datasets else None

    def __len__(self) -> int:
        return self._length

    dataset_index = array_property("dataset_index")
    dataset_sample_index = array_property("dataset_sample_index")

    def __getitem__(self, idx: int) -> dict:
        dataset_id = int(self.dataset_index[idx])
        sample = self.datasets[dataset_id][int(self.dataset_sample_index[idx])]
        return {"dataset_id": dataset_id, **sample}

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        return [self[i] for i in indices]
