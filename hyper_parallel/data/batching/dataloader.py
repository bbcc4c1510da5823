"""Build a trainer's DataLoaders from a pipeline config (``dataset``, ``collate_fn`` and ``dataloader`` nodes).

Owns: the order in which the pipeline is built and the runtime facts handed to it: the tokenizer, batch sizes, the
seed and the rank layout reach every ``_target_`` that names them as a parameter (see ``instantiate``). The
``dataset`` node may return one dataset or ``(train, valid, test)``; a loader is built for each non-empty split.
Not responsible for: what any node builds, or per-step delivery to model ranks (``get_batch``, built by the
parallel layer).

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

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, require_int
from hyper_parallel.data.instantiate import DEFAULT_ALLOWED_PREFIXES, instantiate, load_config
from hyper_parallel.data.text.build_tokenizer import build_tokenizer

__all__ = ["DataLoaders", "build_dataloaders"]

logger = get_logger(__name__)

SPLITS = ("train", "valid", "test")
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's largest seed; numpy's generators take any seed >= 0


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
        config: the pipeline mapping, or the path of a YAML file holding it.
        tokenizer: a loaded tokenizer or the path of a local Hugging Face tokenizer.
        micro_batch_size, global_batch_size, dp_rank, dp_world_size, cp_size, tp_size, sequence_parallel, seed:
            runtime facts offered to every node that has a parameter of that name.
        allowed_prefixes: module prefixes that ``_target_`` may name.
    """
    if not isinstance(config, Mapping):
        config = load_config(config)
    if require_int("seed", seed, 0) > MAX_SEED:
        raise DataConfigError(f"seed must be an integer in [0, 2**64 - 1] (it seeds torch generators), got {seed}")
    for key in ("dataset", "dataloader"):
        if key not in config:
            raise DataConfigError(f"the pipeline config has no '{key}' node; it needs 'dataset' and 'dataloader'")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = build_tokenizer(tokenizer)
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
