"""Public entry points that build datasets from configs (the ``dataset._target_`` of 001 section 11).

Owns: turning a YAML-friendly ``data_config`` mapping and a tokenizer (or its path) into datasets. Not
responsible for: how the datasets are built (``indexed.indexed_split_builder``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.indexed_data_config import IndexedDataConfig
from hyper_parallel.data.indexed.indexed_split_builder import IndexedSplitBuilder
from hyper_parallel.data.text.build_tokenizer import build_tokenizer

__all__ = ["build_indexed_text_dataset"]

logger = get_logger("hyper_parallel.data.text.build_dataset")


def _as_config(data_config: IndexedDataConfig | Mapping) -> IndexedDataConfig:
    if isinstance(data_config, IndexedDataConfig):
        return data_config
    if isinstance(data_config, Mapping):
        return IndexedDataConfig.from_mapping(dict(data_config))
    raise DataConfigError(f"data_config must be a mapping or IndexedDataConfig, got {type(data_config).__name__}")


def build_indexed_text_dataset(
    data_path=None,
    data_config: IndexedDataConfig | Mapping | None = None,
    train_valid_test_num_samples: Sequence[int | None] | None = None,
    tokenizer=None,
    synchronize: bool = True,
):
    """Build the ``(train, valid, test)`` datasets of the Indexed path (None for an empty split).

    Args:
        data_path: a prefix, a directory of ``.bin``/``.idx`` pairs, or a Megatron blend list such as
            ``["30", "/data/a_text_document", "70", "/data/b_text_document"]``. Not needed with ``mock_data``
            or per-split paths.
        data_config: an ``IndexedDataConfig`` or a mapping of its fields (as in YAML); ``seq_length`` is required.
        train_valid_test_num_samples: samples per split; None, or a None entry, means one epoch of that split.
        tokenizer: a loaded tokenizer (anything with ``eod``/``eos_token_id`` and ``pad``/``pad_token_id``), or the
            path of a local Hugging Face tokenizer.
        synchronize: with a process group, rank 0 builds the index caches while the others wait; every rank must
            call this function.

    Returns:
        ``(train, valid, test)``; each sample is a dict with ``tokens``, ``labels``, ``loss_mask`` (and the LTR
        fields when configured, and ``dataset_id`` for blends).
    """
    if data_config is None:
        raise DataConfigError("data_config is required (at least seq_length)")
    config = _as_config(data_config)
    if tokenizer is None:
        raise DataConfigError(
            "a tokenizer is required: the samples' EOD and pad ids come from it. Pass tokenizer=<path of a Hugging "
            "Face tokenizer directory> or a loaded tokenizer"
        )
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = build_tokenizer(tokenizer)
    splits = IndexedSplitBuilder(config, tokenizer, synchronize).build(data_path, train_valid_test_num_samples)
    for name, dataset in zip(("train", "valid", "test"), splits, strict=True):
        if dataset is not None:
            logger.info("%s: %s", name, type(dataset).__name__)
    return tuple(splits)
