"""Public entry points that build datasets from configs (the ``dataset._target_`` of a pipeline config).

Owns: turning a YAML-friendly ``data_config`` mapping and a tokenizer (or its path) into datasets, for the Online
path (``build_online_text_dataset``) and the Indexed path (``build_indexed_text_dataset``); a config error in
``data_config`` or a ``data_transform`` mapping names that key as its YAML path (``instantiate`` prefixes the
node's own path, e.g. ``dataset.data_config: ...``); the Indexed path also takes the pipeline's seed as its
``random_seed`` and checks its rows against the batch layout. Not responsible for: how the datasets are built
(``text.online`` sources, ``indexed.indexed_split_builder``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, require_int
from hyper_parallel.data.indexed.indexed_data_config import IndexedDataConfig
from hyper_parallel.data.indexed.indexed_split_builder import IndexedSplitBuilder
from hyper_parallel.data.parallel.build_barrier import failures_shared
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.text.build_data_transform import build_llm_data_transform
from hyper_parallel.data.text.build_tokenizer import build_tokenizer
from hyper_parallel.data.text.online.online_dataset import OnlineDataConfig, open_online_source
from hyper_parallel.data.text.online.online_mapping_dataset import OnlineMappingDataset
from hyper_parallel.data.text.transform_dataset import IterableTransformDataset, TransformDataset
from hyper_parallel.data.torch_samples import check_return_tensors, with_return_tensors

__all__ = ["build_indexed_text_dataset", "build_online_text_dataset"]

logger = get_logger("hyper_parallel.data.text.build_dataset")


@contextmanager
def _located(key: str) -> Iterator[None]:
    """A ``DataConfigError`` raised inside is about the argument ``key``: place it there (``data_config: ...``)."""
    try:
        yield
    except DataConfigError as error:
        error.within(key)
        raise


def _as_config(data_config, config_class: type[IndexedDataConfig | OnlineDataConfig]):
    """``data_config`` as ``config_class``, from an instance or a mapping of its fields (as in YAML)."""
    if isinstance(data_config, config_class):
        return data_config
    if data_config is not None and not isinstance(data_config, Mapping):
        raise DataConfigError(
            f"data_config must be a mapping of {config_class.__name__} fields, got {type(data_config).__name__}"
        )
    with _located("data_config"):
        return config_class.from_mapping(dict(data_config or {}))


@failures_shared("build the Indexed datasets")  # a rank that fails here makes the waiting ranks fail
def build_indexed_text_dataset(
    data_path=None,
    data_config: IndexedDataConfig | Mapping | None = None,
    train_valid_test_num_samples: Sequence[int | None] | None = None,
    tokenizer=None,
    synchronize: bool = True,
    seed: int | None = None,
    layout: DeliveryLayout | None = None,
):
    """Build the ``(train, valid, test)`` datasets of the Indexed path (None for an empty split).

    Args:
        data_path: a prefix, a directory of ``.bin``/``.idx`` pairs, or a Megatron blend list such as
            ``["30", "/data/a_text_document", "70", "/data/b_text_document"]``. Not needed with ``mock_data``
            or per-split paths.
        data_config: an ``IndexedDataConfig`` or a mapping of its fields (as in YAML); ``seq_length`` is required.
        train_valid_test_num_samples: samples per split; None, or a None entry, means one epoch of that split.
        tokenizer: a loaded tokenizer (a ``TextTokenizer``, or any object ``tokenizer_protocol.read_tokenizer``
            reads, such as a Megatron tokenizer with ``eod`` and ``pad``), or the path of a local Hugging Face
            tokenizer.
        synchronize: with a process group, rank 0 builds the index caches while the others wait; every rank must
            call this function. A failure on any rank then raises on every rank.
        seed: the pipeline's seed (``build_dataloaders(seed=...)``), or None. Given, it is ``random_seed``, the seed
            of every index shuffle: a ``random_seed`` in a ``data_config`` mapping, or of an ``IndexedDataConfig``
            instance (which always states one), that differs from it is refused. None keeps ``random_seed``.
        layout: the batch layout over the CP and TP ranks (``DeliveryLayout``; the pipeline gives its own), or
            None. Rows are never padded, so ``seq_length`` must be a multiple of ``layout.row_multiple()``.

    Returns:
        ``(train, valid, test)``; each sample is a dict of torch tensors, as megatron-core's: ``tokens``,
        ``labels``, ``loss_mask`` (and the LTR fields when configured, and ``dataset_id`` for blends).
    """
    if data_config is None:
        raise DataConfigError("data_config is required (at least seq_length)")
    config = _with_seed(_as_config(data_config, IndexedDataConfig), data_config, seed)
    if layout is not None:
        with _located("data_config"):
            layout.check_row_length(config.seq_length)  # before any file is read: rows are never padded
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


def _with_seed(config: IndexedDataConfig, written, seed: int | None) -> IndexedDataConfig:
    """``config`` with ``random_seed`` set to the pipeline's ``seed``; a different one written is refused."""
    if seed is None:
        return config
    seed = require_int("seed", seed, 0)
    stated = written.get("random_seed") if isinstance(written, Mapping) else config.random_seed
    if stated is not None and stated != seed:
        raise DataConfigError(
            f"data_config.random_seed is {stated!r}, but the pipeline's seed (build_dataloaders(seed=...)) is {seed}; "
            "the Indexed order follows the pipeline's seed: remove random_seed from data_config, set it to "
            f"{seed}, or leave seed out of build_dataloaders to keep random_seed {stated!r}"
        )
    with _located("data_config"):
        return dataclasses.replace(config, random_seed=seed)


def build_online_text_dataset(
    data_path=None,
    data_transform=None,
    data_config: OnlineDataConfig | Mapping | None = None,
    tokenizer=None,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    seed: int = 1234,
    return_tensors: str = "np",
):
    """Build the Online dataset: data files read with Hugging Face ``datasets``, tokenized when read.

    Args:
        data_path: a JSON/JSONL/Parquet/CSV/Arrow file, a glob, a directory of such files, a list of those (read in
            the order given, each entry's files sorted by path), or a local ``save_to_disk`` directory; files, globs
            and directories may be fsspec URLs (``s3://bucket/dir/*.jsonl``).
        data_transform: a transform (e.g. from ``build_llm_data_transform``) or a mapping of its arguments.
        data_config: an ``OnlineDataConfig`` or a mapping of its fields; ``dataset_type`` picks ``mapping``
            (``streaming=False``) or ``iterable`` (``streaming=True``).
        tokenizer: a loaded tokenizer or its path; needed when ``data_transform`` is a mapping.
        dp_rank, dp_world_size: this rank's share of an iterable source (a mapping source is shared; the batch
            sampler assigns its indices).
        seed: seeds an iterable source's shuffle buffer.
        return_tensors: ``"np"``: each sample holds numpy arrays; ``"pt"``: torch tensors sharing their memory
            (``torch_samples``), for code that reads samples itself. The loaders give the same batches either way.

    Returns:
        A ``TransformDataset`` (mapping) or ``IterableTransformDataset`` (iterable), or ``(train, valid, test)``
        when ``data_config`` names a validation or test path.
    """
    if data_path is None:
        raise DataConfigError("data_path is required: a data file, glob, directory or save_to_disk directory")
    if data_transform is None:
        raise DataConfigError(
            "data_transform is required, e.g. {_target_: hyper_parallel.data.text.build_data_transform."
            "build_llm_data_transform, data_type: plaintext, max_seq_len: 4096}"
        )
    config = _as_config(data_config, OnlineDataConfig)
    seed = require_int("seed", seed, 0)  # seeds numpy generators, which take non-negative seeds
    if isinstance(data_transform, Mapping):
        with _located("data_transform"):
            data_transform = build_llm_data_transform(**{"tokenizer": tokenizer, **data_transform})
    if not callable(data_transform):
        raise DataConfigError(
            f"data_transform must be a transform or a mapping of build_llm_data_transform options (data_type, "
            f"max_seq_len, ...), got {type(data_transform).__name__} {data_transform!r}"
        )

    def build(path):
        source = open_online_source(path, config, dp_rank=dp_rank, dp_world_size=dp_world_size, seed=seed)
        if isinstance(source, OnlineMappingDataset):
            dataset = TransformDataset(source, data_transform)
        else:
            dataset = IterableTransformDataset(source, data_transform)
        logger.info("online dataset: %r", dataset)
        return dataset

    check_return_tensors(return_tensors)  # before any file is read
    train = build(data_path)
    if config.valid_data_path is None and config.test_data_path is None:
        return with_return_tensors(train, return_tensors)
    others = (config.valid_data_path, config.test_data_path)
    return with_return_tensors((train, *(None if path is None else build(path) for path in others)), return_tensors)
