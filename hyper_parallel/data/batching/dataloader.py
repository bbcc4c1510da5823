"""Build a trainer's DataLoaders from a pipeline config (``dataset``, ``collate_fn`` and ``dataloader`` nodes).

Owns: which top-level nodes a pipeline has, checking them all before the first is built, the order in which they
are built, and the runtime facts handed to them: the tokenizer, batch sizes, the seed and the rank layout (checked
as the loaders' ``BatchLayout`` and ``SamplerOptions`` check them) reach every ``_target_`` that names them as a
parameter (see ``instantiate``). The ``dataset`` node may return one dataset or ``(train, valid, test)``; a loader is
built for each non-empty split. Not responsible for: what any node builds, or per-step delivery to model ranks
(``get_batch``: its node is checked, but this library does not build it yet).

Example (the Online mapping + dynamic batch pipeline)::

    dataset:
      _target_: hyper_parallel.data.text.build_dataset.build_online_text_dataset
      data_path: /data/train.jsonl
      data_transform:
        _target_: hyper_parallel.data.text.build_data_transform.build_llm_data_transform
        data_type: plaintext
        text_keys: text
        max_seq_len: 4096
      data_config:
        dataset_type: mapping
    dataloader:
      _target_: hyper_parallel.data.batching.DynamicBatchDataLoader
      min_buffered_samples: 200
    collate_fn:
      _target_: hyper_parallel.data.batching.build_online_text_collate_fn
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hyper_parallel.data.batching.loader_options import LoaderOptions
from hyper_parallel.data.dataset_logging import enable_dataset_logging, get_logger
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.instantiate import (
    DEFAULT_ALLOWED_PREFIXES,
    TARGET_KEY,
    check_config,
    instantiate,
    load_config,
)
from hyper_parallel.data.text.build_tokenizer import build_tokenizer

__all__ = ["NODES", "DataLoaders", "build_dataloaders"]

logger = get_logger(__name__)

SPLITS = ("train", "valid", "test")
# The top-level nodes of a pipeline config: the built ones in build order (get_batch is checked but not built yet),
# then ``debug`` (``check_dataset``: the dataset log level) and ``variables`` (free values for ``${variables.x}``
# interpolations, never built).
NODES = ("dataset", "collate_fn", "dataloader", "get_batch", "debug", "variables")
_REQUIRED = ("dataset", "dataloader")
_DEBUG_KEYS = ("check_dataset",)
_LOG_LEVELS = ("debug", "info", "warn", "warning", "error")


@dataclass(frozen=True)
class DataLoaders:
    """The loaders of one pipeline; a split without data has None."""

    train: object | None
    valid: object | None
    test: object | None

    def __iter__(self):
        return iter((self.train, self.valid, self.test))


def _as_splits(built) -> tuple:
    if isinstance(built, (tuple, list)):
        if len(built) != 3:
            raise DataConfigError(
                f"the dataset node returned {len(built)} datasets; it must return one dataset or (train, valid, test)"
            )
        return tuple(built)
    return (built, None, None)


def _check_alignment(loader, collate_fn) -> None:
    """Warn when a token budget is not a multiple of the packing alignment: padded rows would then exceed it."""
    budget, alignment = getattr(loader, "token_budget", None), getattr(collate_fn, "alignment", None)
    if budget is None or alignment is None or budget % alignment == 0:
        return
    if loader.max_seq_len is None or budget != loader.micro_batch_size * loader.max_seq_len:
        logger.warning(
            "the packing policy's token budget %d is not a multiple of the packing alignment %d, so a padded "
            "micro-batch can hold up to %d tokens; set the policy's token_budget to a multiple of %d",
            budget,
            alignment,
            budget - budget % alignment + alignment,
            alignment,
        )
        return
    # budget = micro_batch_size * max_seq_len is a multiple of the alignment when max_seq_len is a multiple of step
    step = alignment // math.gcd(alignment, loader.micro_batch_size)
    lower = loader.max_seq_len - loader.max_seq_len % step
    suggestions = " or ".join(str(v) for v in (lower, lower + step) if v > 0)
    logger.warning(
        "the token budget %d (micro_batch_size %d x max_seq_len %d) is not a multiple of the packing alignment %d "
        "(lcm of cp_size x tp_size with sequence_parallel, else cp_size, and sequence_multiple), so a padded "
        "micro-batch can hold up to %d tokens; set max_seq_len (of the data transform or the dataloader) to a "
        "multiple of %d, such as %s",
        budget,
        loader.micro_batch_size,
        loader.max_seq_len,
        alignment,
        budget - budget % alignment + alignment,
        step,
        suggestions,
    )


def _check_nodes(config: Mapping, context: dict, allowed_prefixes: Sequence[str]) -> None:
    """Refuse unknown or missing top-level nodes, then check every node as ``instantiate`` would, building nothing,
    so that a typo anywhere fails before the dataset is read."""
    for key in config:
        if key not in NODES:
            close = difflib.get_close_matches(str(key), NODES, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise DataConfigError(
                f"{key}: the pipeline config has no node '{key}'{hint}; its top-level nodes are {', '.join(NODES)}. "
                "Rename or remove it"
            )
    for key in _REQUIRED:
        if key not in config:
            raise DataConfigError(f"the pipeline config has no '{key}' node; it needs 'dataset' and 'dataloader'")
    _check_debug(config.get("debug"))
    check_config(config["dataset"], context=context, allowed_prefixes=allowed_prefixes, path="dataset")
    check_config(config.get("collate_fn"), context=context, allowed_prefixes=allowed_prefixes, path="collate_fn")
    loader_context = {**context, "dataset": None, "collate_fn": None}  # built later: only their names matter here
    check_config(config["dataloader"], context=loader_context, allowed_prefixes=allowed_prefixes, path="dataloader")
    if config.get("get_batch") is not None:
        get_batch = config["get_batch"]
        if isinstance(get_batch, Mapping) and TARGET_KEY in get_batch:
            get_batch = {**get_batch, "_partial_": True}  # its runtime arguments come from the trainer
        check_config(get_batch, context=context, allowed_prefixes=allowed_prefixes, path="get_batch")
        logger.warning(
            "get_batch: per-step delivery to model ranks (ParallelBatch: CP sharding, TP broadcast) is not built by "
            "this library yet; the node is checked but not built, and the loaders deliver whole micro-batches"
        )


def _check_debug(debug) -> None:
    if debug is None:
        return
    if not isinstance(debug, Mapping):
        raise DataConfigError(f"debug: must be a mapping such as 'check_dataset: info', got {debug!r}")
    for key in debug:
        if key not in _DEBUG_KEYS:
            raise DataConfigError(f"debug.{key}: unknown key; the debug node takes {', '.join(_DEBUG_KEYS)}")
    level = debug.get("check_dataset")
    if level is not None and str(level).lower() not in _LOG_LEVELS:
        raise DataConfigError(
            f"debug.check_dataset: {level!r} is not a log level; use one of {', '.join(_LOG_LEVELS)}, or null to "
            "follow the global level"
        )


def build_dataloaders(
    config: Mapping | str | os.PathLike,
    *,
    tokenizer=None,
    micro_batch_size: int = 1,
    global_batch_size: int | None = None,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    cp_size: int = 1,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    seed: int = 1234,
    allowed_prefixes: Sequence[str] = DEFAULT_ALLOWED_PREFIXES,
) -> DataLoaders:
    """Instantiate ``config['dataset']``, ``config['collate_fn']`` and a ``config['dataloader']`` per split.

    Args:
        config: the pipeline mapping, or the path of a YAML file holding it. Its top-level nodes are ``dataset``
            and ``dataloader`` (required), ``collate_fn``, ``get_batch`` (checked, not built yet), ``debug``
            (``check_dataset``: a log level for this package's logs on rank 0, or null) and ``variables`` (values
            for ``${variables.name}`` interpolations); any other is refused.
        tokenizer: a loaded tokenizer or the path of a local Hugging Face tokenizer.
        micro_batch_size, global_batch_size, dp_rank, dp_world_size, cp_size, tp_size, sequence_parallel, seed:
            runtime facts offered to every node that has a parameter of that name; the batch sizes, ranks and seed
            are checked first, as the loaders check them.
        allowed_prefixes: module prefixes that ``_target_`` may name.

    Raises:
        DataConfigError: an unknown or missing node, a bad runtime fact, or any error ``instantiate`` finds in a
            node, before anything is built.
    """
    if not isinstance(config, Mapping):
        config = load_config(config)
    LoaderOptions.from_keywords(
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=seed,
    )
    context = {
        "tokenizer": tokenizer,
        "micro_batch_size": micro_batch_size,
        "global_batch_size": global_batch_size,
        "dp_rank": dp_rank,
        "dp_world_size": dp_world_size,
        "cp_size": cp_size,
        "tp_size": tp_size,
        "sequence_parallel": sequence_parallel,
        "seed": seed,
    }
    _check_nodes(config, context, allowed_prefixes)
    level = (config.get("debug") or {}).get("check_dataset")
    if level is not None:
        enable_dataset_logging(str(level))  # rank 0 logs, as enable_dataset_logging does by default
    if isinstance(tokenizer, (str, os.PathLike)):
        context["tokenizer"] = build_tokenizer(tokenizer)
    datasets = _as_splits(
        instantiate(config["dataset"], context=context, allowed_prefixes=allowed_prefixes, path="dataset")
    )
    collate_fn = None
    if config.get("collate_fn") is not None:
        collate_fn = instantiate(
            config["collate_fn"], context=context, allowed_prefixes=allowed_prefixes, path="collate_fn"
        )
    loaders = []
    for split, dataset in zip(SPLITS, datasets, strict=True):
        if dataset is None:
            loaders.append(None)
            continue
        loader = instantiate(
            config["dataloader"],
            context={**context, "dataset": dataset, "collate_fn": collate_fn},
            allowed_prefixes=allowed_prefixes,
            path="dataloader",
        )
        logger.info("%s loader: %r", split, loader)
        if all(built is None for built in loaders):
            _check_alignment(loader, collate_fn)  # the same loader settings for every split: say it once
        loaders.append(loader)
    return DataLoaders(*loaders)
