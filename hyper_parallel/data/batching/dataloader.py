"""Build a trainer's pipeline from a config: its DataLoaders (dataset, collate_fn, dataloader) and get_batch.

Owns: which top-level nodes a pipeline has, checking them all before the first is built, the order in which they
are built (a trainer's: model assets, then get_batch and the collator, then datasets and loaders), one state over
all the loaders, and the runtime facts handed to the nodes: the tokenizer and chat template (the ``model_assets``
node or the ``tokenizer`` argument), batch sizes, the seed and the rank layout (checked
as the loaders' ``BatchLayout`` and ``SamplerOptions`` check them) reach every ``_target_`` that names them as a
parameter (see ``instantiate``). With a ``DataLoaderParallelContext`` the rank layout comes from it: datasets and
loaders are built on the data ranks only (``build_on_data_ranks``; the other ranks get None), the collator's
alignment follows the CP size, the TP size with sequence parallelism and the ``get_batch`` node's CP layout, and
the ``get_batch`` node (``ParallelBatch``) is built on every rank with the context and the tokenizer's EOD id. A
layout the collator's alignment (or the Indexed row length) cannot serve is refused while the pipeline is built.
The ``dataset`` node may return one dataset or ``(train, valid, test)``; a loader is built for each non-empty
split. The optional ``packing_scheduler`` node (a ``PackingSchedulerConfig``) is built on every rank and handed back
for ``wrap_data_iterator``: the scheduler then pads each micro-batch for its own CP size, so the collator is built
without padding, and a ``get_batch`` node beside it is refused (the scheduler's micro-batches are delivered by
``get_batch_on_this_rank_for_sequence_packing``). A dynamic loader over several DP ranks without a scheduler is
warned about once: its ranks may deliver different numbers of micro-batches per step. Not responsible for: what any
node builds, or the per-step delivery itself (``get_batch``, ``parallel.data_schedule``).

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
    get_batch:
      _target_: hyper_parallel.data.batching.ParallelBatch
      source_type: online
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from hyper_parallel.data.batching.build_collate_fn import check_pad_token_id, sequence_alignment
from hyper_parallel.data.batching.build_dataloader import DynamicBatchDataLoader
from hyper_parallel.data.batching.get_batch import ParallelBatch
from hyper_parallel.data.batching.loader_options import LoaderOptions, WorkerOptions
from hyper_parallel.data.dataset_logging import enable_dataset_logging, get_logger
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.indexed_data_config import sample_counts
from hyper_parallel.data.instantiate import (
    DEFAULT_ALLOWED_PREFIXES,
    TARGET_KEY,
    check_config,
    instantiate,
    load_config,
)
from hyper_parallel.data.parallel.data_schedule_utils import PackingSchedulerConfig
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext, build_on_data_ranks
from hyper_parallel.data.text.build_tokenizer import build_tokenizer, is_transformers_tokenizer
from hyper_parallel.data.text.chat_template import build_chat_template
from hyper_parallel.data.tokenizer_protocol import read_tokenizer

__all__ = ["NODES", "DataLoaders", "build_dataloaders"]

logger = get_logger(__name__)

SPLITS = ("train", "valid", "test")
# The top-level nodes of a pipeline config: the built ones (built model_assets, packing_scheduler, get_batch,
# collate_fn, then dataset and dataloader on the data ranks), then ``debug`` (``check_dataset``: the dataset log
# level) and ``variables`` (free values for ``${variables.x}`` interpolations, never built).
NODES = (
    "model_assets",
    "dataset",
    "collate_fn",
    "dataloader",
    "get_batch",
    "packing_scheduler",
    "debug",
    "variables",
)
_MODEL_ASSET_KEYS = ("tokenizer", "chat_template")
_REQUIRED = ("dataset", "dataloader")
_DEBUG_KEYS = ("check_dataset",)
_LOG_LEVELS = ("debug", "info", "warn", "warning", "error")
_RANK_DEFAULTS = {"dp_rank": 0, "dp_world_size": 1, "cp_size": 1, "tp_size": 1}
# What the collate_fn node is offered under a packing scheduler: no CP or TP alignment (the scheduler aligns).
_UNPADDED_COLLATOR = {"cp_size": 1, "tp_size": 1, "sequence_parallel": False}
_SCHEDULER_TARGET = f"{PackingSchedulerConfig.__module__}.{PackingSchedulerConfig.__qualname__}"
# The nodes that are built, each with a target it may name (for the message of a node of the wrong shape).
_BUILT_NODE_EXAMPLES = {
    "dataset": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
    "dataloader": "hyper_parallel.data.batching.FixedBatchDataLoader",
    "collate_fn": "hyper_parallel.data.batching.build_online_text_collate_fn",
    "get_batch": "hyper_parallel.data.batching.ParallelBatch",
    "packing_scheduler": _SCHEDULER_TARGET,
}
# How the torch DataLoader fetches: a build_dataloaders keyword of each name overrides the dataloader node's value.
_WORKER_DEFAULTS = {option.name: option.default for option in fields(WorkerOptions)}
_PIPELINE_STATE_VERSION = 1


@dataclass(frozen=True)
class DataLoaders:
    """Everything one pipeline built, in the order it built them, with one state over all its loaders.

    ``tokenizer`` and ``chat_template`` are the model assets (from the ``model_assets`` node or the ``tokenizer``
    argument; None when neither was given). ``datasets`` is ``(train, valid, test)`` and ``collate_fn`` the built
    ``collate_fn`` node. ``train``, ``valid`` and ``test`` are the loaders: None for a split without data or one the
    trainer takes no samples from (``train_valid_test_num_samples``), and for every split on a rank that reads no
    data (a TP rank other than 0), where ``datasets`` is ``(None, None, None)`` too. ``get_batch`` is the built
    ``get_batch`` node (a ``ParallelBatch``) on every rank, or None without the node. ``packing_scheduler`` is the
    built ``packing_scheduler`` node (a ``PackingSchedulerConfig``, the ``config`` of ``wrap_data_iterator``) on
    every rank, or None without the node. Iterating gives the three loaders, so ``train, valid, test =
    build_dataloaders(...)`` keeps working.

    Example (a checkpoint holds every split's position)::

        loaders = build_dataloaders("pipeline.yaml", parallel_context=context)
        torch.save({"model": model.state_dict(), "data": loaders.state_dict()}, path)
        ...
        loaders.load_state_dict(torch.load(path)["data"])  # the same config, on the same rank
    """

    train: object | None
    valid: object | None
    test: object | None
    get_batch: object | None = None
    packing_scheduler: object | None = None
    tokenizer: object | None = None
    chat_template: object | None = None
    datasets: tuple = (None, None, None)
    collate_fn: object | None = None

    def __iter__(self):
        return iter((self.train, self.valid, self.test))

    def _loaders(self) -> dict:
        return dict(zip(SPLITS, self, strict=True))

    def state_dict(self) -> dict:
        """Every split's loader position (None for a split without a loader on this rank), as plain containers."""
        return {
            "version": _PIPELINE_STATE_VERSION,
            "splits": {
                split: None if loader is None else loader.state_dict() for split, loader in self._loaders().items()
            },
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Continue every split where ``state`` left it; a refused state changes no loader.

        Raises:
            DataConfigError: a state that is not this method's, or whose splits do not match this rank's loaders
                (a split saved without a loader here, or a loader here that the state lacks); a loader's own
                refusal (another config, another dataset) is raised as the loader raises it.
        """
        if (
            not isinstance(state, Mapping)
            or state.get("version") != _PIPELINE_STATE_VERSION
            or not isinstance(state.get("splits"), Mapping)
        ):
            raise DataConfigError(
                "the pipeline state is not one DataLoaders.state_dict() saved (it needs 'version' "
                f"{_PIPELINE_STATE_VERSION} and 'splits'); to restore a single loader, call that loader's "
                "load_state_dict"
            )
        saved, loaders = state["splits"], self._loaders()
        for split, loader in loaders.items():
            if (loader is None) != (saved.get(split) is None):
                have = "has no loader" if loader is None else "has a loader"
                holds = "holds" if saved.get(split) is not None else "holds no"
                raise DataConfigError(
                    f"{split}: this rank {have} for the {split} split, but the saved state {holds} position for it; "
                    "restore the state this rank saved, with the same config (each rank saves and loads its own)"
                )
        before = {split: loader.state_dict() for split, loader in loaders.items() if loader is not None}
        restored = []
        try:
            for split, loader in loaders.items():
                if loader is not None:
                    loader.load_state_dict(saved[split])
                    restored.append(split)
        except Exception:
            for split in restored:  # all or nothing: put back the splits already moved
                loaders[split].load_state_dict(before[split])
            raise


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


def _rank_layout(parallel_context, given: dict[str, int]) -> dict[str, int]:
    """The DP rank and size, CP size and TP size: the context's when there is one (a value also given by keyword
    must agree with it), else the keywords."""
    if parallel_context is None:
        return given
    if not isinstance(parallel_context, DataLoaderParallelContext):
        raise DataConfigError(
            f"parallel_context must be a DataLoaderParallelContext (from_mesh, from_groups or standalone), got "
            f"{type(parallel_context).__name__}"
        )
    derived = {
        "dp_rank": parallel_context.dp_rank,
        "dp_world_size": parallel_context.dp_size,
        "cp_size": parallel_context.cp_size,
        "tp_size": parallel_context.tp_size,
    }
    for name, value in given.items():
        if value != _RANK_DEFAULTS[name] and value != derived[name]:
            raise DataConfigError(
                f"{name} is {value!r}, but the parallel_context gives {derived[name]}; pass the rank layout once: "
                f"drop {name}, which the context gives"
            )
    return derived


def _get_batch_context(context: dict, parallel_context, tokenizer) -> dict:
    """What the get_batch node is offered beyond the runtime facts: the parallel context and the EOD id."""
    eod = None if tokenizer is None else read_tokenizer(tokenizer).eod
    return {**context, "parallel_context": parallel_context, "eod_token_id": eod}


def _did_you_mean(key, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(key), choices, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_nodes(config: Mapping, context: dict, allowed_prefixes: Sequence[str]) -> None:
    """Refuse unknown or missing top-level nodes, then check every node as ``instantiate`` would, building nothing,
    so that a typo anywhere fails before the dataset is read."""
    for key in config:
        if key not in NODES:
            raise DataConfigError(
                f"{key}: the pipeline config has no node '{key}'{_did_you_mean(key, NODES)}; its top-level nodes are "
                f"{', '.join(NODES)}. Rename or remove it"
            )
    for key in _REQUIRED:
        if key not in config:
            raise DataConfigError(f"the pipeline config has no '{key}' node; it needs 'dataset' and 'dataloader'")
    _check_node_shapes(config)
    _check_debug(config.get("debug"))
    _check_model_assets(config.get("model_assets"), context, allowed_prefixes)
    check_config(config["dataset"], context=context, allowed_prefixes=allowed_prefixes, path="dataset")
    check_config(config.get("collate_fn"), context=context, allowed_prefixes=allowed_prefixes, path="collate_fn")
    loader_context = {**context, "dataset": None, "collate_fn": None}  # built later: only their names matter here
    check_config(config["dataloader"], context=loader_context, allowed_prefixes=allowed_prefixes, path="dataloader")
    get_batch_context = _get_batch_context(context, None, None)
    check_config(
        config.get("get_batch"), context=get_batch_context, allowed_prefixes=allowed_prefixes, path="get_batch"
    )
    scheduler = config.get("packing_scheduler")
    if scheduler is not None and config.get("get_batch") is not None:
        raise DataConfigError(
            "get_batch: the pipeline has a packing_scheduler, whose micro-batches are delivered per rank by "
            "get_batch_on_this_rank_for_sequence_packing (after wrap_data_iterator), not by a get_batch node; remove "
            "the get_batch node, or the packing_scheduler node to deliver with ParallelBatch"
        )
    check_config(scheduler, context=context, allowed_prefixes=allowed_prefixes, path="packing_scheduler")


def _described(value) -> str:
    """What a config node holds, for a message: its type and a short form of its value."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return f"a mapping without {TARGET_KEY} (keys {', '.join(map(str, value)) or 'none'})"
    shown = repr(value)
    return f"the {type(value).__name__} {shown if len(shown) <= 60 else shown[:57] + '...'}"


def _check_node_shapes(config: Mapping) -> None:
    """Every built node is a mapping with a _target_ (the optional ones may be null), and variables a mapping."""
    for key, example in _BUILT_NODE_EXAMPLES.items():
        node = config.get(key)
        if key not in config or (node is None and key not in _REQUIRED):
            continue
        if isinstance(node, Mapping) and TARGET_KEY in node:
            continue
        optional = "" if key in _REQUIRED else ", or null to leave the node out"
        raise DataConfigError(
            f"{key}: the node holds {_described(node)}, but it must be a mapping with {TARGET_KEY}, such as "
            f"'{key}: {{{TARGET_KEY}: {example}}}'{optional}"
        )
    variables = config.get("variables")
    if variables is not None and not isinstance(variables, Mapping):
        raise DataConfigError(
            f"variables: the node holds {_described(variables)}, but it must be a mapping of names to values, such "
            "as 'variables: {seq_len: 4096}', read as ${variables.seq_len}"
        )


def _override_worker_options(config: Mapping, overrides: dict) -> Mapping:
    """The config with the worker options given to build_dataloaders set on its dataloader node (a node of the
    wrong shape is left for the node checks to refuse)."""
    node = config.get("dataloader")
    if not overrides or not isinstance(node, Mapping):
        return config
    return {**config, "dataloader": {**node, **overrides}}


def _log_worker_overrides(config: Mapping, overrides: dict) -> None:
    if overrides:
        node = config["dataloader"]
        changes = ", ".join(
            f"{name} {node.get(name, _WORKER_DEFAULTS[name])!r} -> {value!r}" for name, value in overrides.items()
        )
        logger.info("loader options given to build_dataloaders override the dataloader node: %s", changes)


def _check_model_assets(node, context: dict, allowed_prefixes: Sequence[str]) -> None:
    if node is None:
        return
    if not isinstance(node, Mapping):
        raise DataConfigError(
            f"model_assets: must be a mapping such as '{{tokenizer: /models/tokenizer, chat_template: chatml}}', got "
            f"{node!r}"
        )
    for key in node:
        if key not in _MODEL_ASSET_KEYS:
            raise DataConfigError(
                f"model_assets.{key}: unknown key{_did_you_mean(key, _MODEL_ASSET_KEYS)}; the model_assets node takes "
                f"{', '.join(_MODEL_ASSET_KEYS)}"
            )
    given = node.get("tokenizer")
    if given is not None and context.get("tokenizer") is not None:
        raise DataConfigError(
            "model_assets.tokenizer: the tokenizer is given twice, by this key and by the tokenizer argument of "
            "build_dataloaders; keep one"
        )
    if node.get("chat_template") is not None and given is None and context.get("tokenizer") is None:
        raise DataConfigError(
            "model_assets.chat_template: a chat template needs a tokenizer; set model_assets.tokenizer, or pass "
            "tokenizer= to build_dataloaders"
        )
    for key in _MODEL_ASSET_KEYS:
        value = node.get(key)
        if value is not None and not isinstance(value, (str, Mapping)):
            raise DataConfigError(
                f"model_assets.{key}: must be a name or path, or a _target_ node, got {type(value).__name__} {value!r}"
            )
        if isinstance(value, Mapping):
            check_config(
                value, context={"tokenizer": None}, allowed_prefixes=allowed_prefixes, path=f"model_assets.{key}"
            )


def _build_model_assets(node, tokenizer, allowed_prefixes: Sequence[str]) -> tuple:
    """The pipeline's tokenizer (loaded or converted once, for every node) and chat template (or None)."""
    node = node or {}
    tokenizer = node.get("tokenizer", tokenizer)
    if isinstance(tokenizer, Mapping):
        tokenizer = instantiate(tokenizer, allowed_prefixes=allowed_prefixes, path="model_assets.tokenizer")
    if isinstance(tokenizer, (str, os.PathLike)) or is_transformers_tokenizer(tokenizer):
        tokenizer = build_tokenizer(tokenizer)
    template = node.get("chat_template")
    if isinstance(template, Mapping):
        template = instantiate(
            template,
            context={"tokenizer": tokenizer},
            allowed_prefixes=allowed_prefixes,
            path="model_assets.chat_template",
        )
    elif template is not None:
        template = build_chat_template(template, tokenizer)
    if tokenizer is not None:
        logger.info(
            "model assets: tokenizer %s, chat template %s",
            getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
            template,
        )
    return tokenizer, template


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
    train_valid_test_num_samples: Sequence[int | None] | None = None,
    allowed_prefixes: Sequence[str] = DEFAULT_ALLOWED_PREFIXES,
    parallel_context: DataLoaderParallelContext | None = None,
    num_workers: int | None = None,
    prefetch_factor: int | None = None,
    pin_memory: bool | None = None,
    persistent_workers: bool | None = None,
    multiprocessing_context=None,
    timeout: float | None = None,
) -> DataLoaders:
    """Build the pipeline a config describes: its ``get_batch``, its collator, and a loader per non-empty split.

    Every rank calls it. The model assets come first (the tokenizer, loaded or converted once, and the chat
    template). The ``get_batch`` and ``collate_fn`` nodes are built next, on every rank (they are
    cheap, and a layout the collator cannot serve fails before any data is read); then the ``dataset`` node and a
    ``dataloader`` per split, on the data ranks only when a ``parallel_context`` is given (rank 0 first, through
    ``build_on_data_ranks``; a failure on any rank raises on every rank).

    Args:
        config: the pipeline mapping, or the path of a YAML file holding it. Its top-level nodes are ``dataset``
            and ``dataloader`` (required), ``model_assets`` (``tokenizer``: a path or a ``_target_`` node, instead
            of the ``tokenizer`` argument; ``chat_template``: a name such as ``chatml`` or a ``_target_`` node, built
            with the tokenizer and offered to every node with a ``chat_template`` parameter), ``collate_fn``,
            ``get_batch`` (a ``ParallelBatch``),
            ``packing_scheduler`` (a ``PackingSchedulerConfig``; not together with ``get_batch``; the collator is
            then built without padding), ``debug`` (``check_dataset``: a log level for this package's logs on
            rank 0, or null) and ``variables`` (values for ``${variables.name}`` interpolations); any other is
            refused.
        tokenizer: anything ``build_tokenizer`` takes: a loaded tokenizer, a ``transformers`` tokenizer object, or
            the path of a local Hugging Face tokenizer or tiktoken file.
        micro_batch_size, global_batch_size, dp_rank, dp_world_size, cp_size, tp_size, sequence_parallel, seed:
            runtime facts offered to every node that has a parameter of that name; the batch sizes, ranks and seed
            are checked first, as the loaders check them. With a ``parallel_context``, leave the ranks and sizes
            out: they come from it.
        train_valid_test_num_samples: the samples the trainer takes from each split, as megatron-core's trainer
            computes them (train iterations x global batch, evaluation iterations x global batch; see
            ``tools.prepare_cache.num_samples_from_schedule``), offered like the facts above: the Indexed
            builder then repeats a split's epochs until it holds that many samples. None, or a None entry, is one
            epoch of the split; a count the config's dataset node sets wins. A split the trainer takes 0 samples
            from gets no loader (its dataset is still built, as megatron-core builds it), on either path.
        allowed_prefixes: module prefixes that ``_target_`` may name.
        parallel_context: this rank's ``DataLoaderParallelContext``. It gives the DP rank and size, the CP and TP
            sizes, and it is offered to the ``get_batch`` node with the tokenizer's EOD id (``eod_token_id``); the
            ``get_batch`` node's ``cp_layout`` is offered to the ``collate_fn`` node.
        num_workers, prefetch_factor, pin_memory, persistent_workers, multiprocessing_context, timeout: how the
            torch DataLoader fetches (``WorkerOptions``; batches and resume never depend on them). Each one given
            (not None) overrides the ``dataloader`` node's value, is checked as that value would be, and the
            override is logged at info (``num_workers 0 -> 4``); None keeps the node's value.

    Returns:
        ``DataLoaders``: the loaders (None on ranks that read no data), ``get_batch``, ``packing_scheduler``,
        ``tokenizer``, ``chat_template``, ``datasets`` and ``collate_fn``, with ``state_dict``/``load_state_dict``
        over every loader.

    Raises:
        DataConfigError: a config that is neither a mapping nor a path, an unknown or missing node, a node of the
            wrong shape (a built node that is not a mapping with ``_target_``), a bad runtime fact or worker
            option, a rank layout given twice and differently, any error ``instantiate`` finds in a node (before
            anything is built), a collator alignment or Indexed row length that the ``get_batch`` node's CP layout
            cannot cut, a ``packing_scheduler`` node beside a ``get_batch`` node or one that builds something else
            than a ``PackingSchedulerConfig``, or, with it, a collator that pads.

    Example (a packing scheduler; every rank, each step)::

        loaders = build_dataloaders("pipeline.yaml", parallel_context=groups.parallel_context(), ...)
        iterator, count, stats = wrap_data_iterator(
            train_iterator, loaders.packing_scheduler, num_microbatches, pg_collection=groups
        )
    """
    if isinstance(config, str | os.PathLike):
        config = load_config(config)
    elif not isinstance(config, Mapping):
        raise DataConfigError(
            f"config must be a pipeline mapping (dataset:, dataloader:, ...) or the path of a YAML file holding one, "
            f"got {_described(config)}"
        )
    worker_overrides = {
        name: value
        for name, value in {
            "num_workers": num_workers,
            "prefetch_factor": prefetch_factor,
            "pin_memory": pin_memory,
            "persistent_workers": persistent_workers,
            "multiprocessing_context": multiprocessing_context,
            "timeout": timeout,
        }.items()
        if value is not None
    }
    ranks = _rank_layout(
        parallel_context, {"dp_rank": dp_rank, "dp_world_size": dp_world_size, "cp_size": cp_size, "tp_size": tp_size}
    )
    LoaderOptions.from_keywords(
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        dp_rank=ranks["dp_rank"],
        dp_world_size=ranks["dp_world_size"],
        seed=seed,
        **worker_overrides,
    )
    wanted = [count != 0 for count in sample_counts(train_valid_test_num_samples)]
    context = {
        "tokenizer": tokenizer,
        "micro_batch_size": micro_batch_size,
        "global_batch_size": global_batch_size,
        **ranks,
        "sequence_parallel": sequence_parallel,
        "seed": seed,
        "train_valid_test_num_samples": train_valid_test_num_samples,
    }
    assets = config.get("model_assets") or {}
    if isinstance(assets, Mapping) and assets.get("chat_template") is not None:
        context["chat_template"] = None  # built with the model assets: only its name matters to the checks
    overridden = _override_worker_options(config, worker_overrides)
    _check_nodes(overridden, context, allowed_prefixes)
    _log_worker_overrides(config, worker_overrides)
    config = overridden
    level = (config.get("debug") or {}).get("check_dataset")
    if level is not None:
        enable_dataset_logging(str(level))  # rank 0 logs, as enable_dataset_logging does by default
    context["tokenizer"], chat_template = _build_model_assets(assets, tokenizer, allowed_prefixes)
    if chat_template is not None:
        context["chat_template"] = chat_template
    scheduler = _build_scheduler(config.get("packing_scheduler"), context, allowed_prefixes)
    get_batch = None
    if config.get("get_batch") is not None:
        get_batch = instantiate(
            config["get_batch"],
            context=_get_batch_context(context, parallel_context, context["tokenizer"]),
            allowed_prefixes=allowed_prefixes,
            path="get_batch",
        )
    collate_fn = None
    if config.get("collate_fn") is not None:
        layout = {"cp_layout": get_batch.cp_layout} if isinstance(get_batch, ParallelBatch) else {}
        unpadded = _UNPADDED_COLLATOR if scheduler is not None else {}
        collate_fn = instantiate(
            config["collate_fn"],
            context={**context, **layout, **unpadded},
            allowed_prefixes=allowed_prefixes,
            path="collate_fn",
        )
        _check_collator_layout(get_batch, collate_fn)
        if scheduler is not None:
            _check_unpadded_collator(collate_fn)

    def build_readers() -> tuple:
        datasets = _as_splits(
            instantiate(config["dataset"], context=context, allowed_prefixes=allowed_prefixes, path="dataset")
        )
        _check_row_length(get_batch, datasets)
        loaders = _build_loaders(
            config, context, datasets, wanted, collate_fn, allowed_prefixes, scheduled=scheduler is not None
        )
        return datasets, loaders

    if parallel_context is None:
        datasets, loaders = build_readers()
    else:
        datasets, loaders = build_on_data_ranks(parallel_context, build_readers) or ((None,) * 3, [None] * 3)
    return DataLoaders(
        *loaders,
        get_batch=get_batch,
        packing_scheduler=scheduler,
        tokenizer=context["tokenizer"],
        chat_template=chat_template,
        datasets=datasets,
        collate_fn=collate_fn,
    )


def _build_scheduler(node, context: dict, allowed_prefixes):
    """The built ``packing_scheduler`` node, or None without it; anything but a ``PackingSchedulerConfig`` is
    refused."""
    if node is None:
        return None
    built = instantiate(node, context=context, allowed_prefixes=allowed_prefixes, path="packing_scheduler")
    if not isinstance(built, PackingSchedulerConfig):
        raise DataConfigError(
            f"packing_scheduler: the node built a {type(built).__name__}, but it must build the scheduler's settings; "
            f"set its _target_ to {_SCHEDULER_TARGET}"
        )
    tokens = None if context["tokenizer"] is None else read_tokenizer(context["tokenizer"])
    check_pad_token_id(built.pad_token_id, tokens, "packing_scheduler")
    return built


def _check_unpadded_collator(collate_fn) -> None:
    """Refuse a collator that pads under a packing scheduler: its padding would be scheduled as sequences."""
    alignment = getattr(collate_fn, "alignment", 1)
    per_sequence = getattr(collate_fn, "pad_each_sequence_to", 1)
    if alignment != 1 or per_sequence != 1:
        raise DataConfigError(
            f"collate_fn: with a packing_scheduler the collator must not pad (it has alignment {alignment} and "
            f"pad_each_sequence_to {per_sequence}): the scheduler unpacks every micro-batch into its sequences and "
            "pads each packed micro-batch for its own CP size, so padding here would be scheduled as sequences; "
            "remove sequence_multiple, cp_layout and the CP/TP sizes from the collate_fn node"
        )


def _warn_uneven_micro_batches(loader) -> None:
    """Say once how to keep micro-batch counts equal across DP ranks when a dynamic loader packs per rank."""
    if not isinstance(loader, DynamicBatchDataLoader) or loader.dp_world_size == 1:
        return
    logger.warning(
        "DynamicBatchDataLoader with dp_world_size %d: each DP rank packs its own share under the token budget, so "
        "ranks may deliver different numbers of micro-batches in a step, and a gradient all-reduce would wait for "
        "the rank that ran out; add a packing_scheduler node (_target_: %s) and wrap each step's iterator with "
        "wrap_data_iterator, which takes the same number of micro-batches from every rank and re-schedules them "
        "(docs/distributed.md, 'Packing scheduler')",
        loader.dp_world_size,
        _SCHEDULER_TARGET,
    )


def _build_loaders(
    config: Mapping,
    context: dict,
    datasets: tuple,
    wanted: list[bool],
    collate_fn,
    allowed_prefixes,
    *,
    scheduled: bool,
) -> list:
    loaders = []
    for split, dataset, want in zip(SPLITS, datasets, wanted, strict=True):
        if dataset is None or not want:
            loaders.append(None)
            continue
        loader = instantiate(
            config["dataloader"],
            context={**context, "dataset": dataset, "collate_fn": collate_fn},
            allowed_prefixes=allowed_prefixes,
            path="dataloader",
        )
        logger.info("%s loader: %r", split, loader)
        if all(built is None for built in loaders):  # the same loader settings for every split: say it once
            _check_alignment(loader, collate_fn)
            if not scheduled:
                _warn_uneven_micro_batches(loader)
        loaders.append(loader)
    return loaders


def _layout_parts(get_batch: ParallelBatch) -> int:
    """Into how many equal parts the get_batch node's CP layout cuts a row (each sequence, for zigzag_thd)."""
    return sequence_alignment(cp_size=get_batch.context.cp_size, cp_layout=get_batch.cp_layout)


def _check_collator_layout(get_batch, collate_fn) -> None:
    """Refuse an Online collator whose rows (or sequences, for zigzag_thd) the CP layout cannot cut evenly."""
    if not isinstance(get_batch, ParallelBatch) or get_batch.context.cp_size == 1 or get_batch.source_type != "online":
        return
    layout, cp, parts = get_batch.cp_layout, get_batch.context.cp_size, _layout_parts(get_batch)
    alignment = getattr(collate_fn, "alignment", None)
    if alignment is not None and alignment % parts:
        raise DataConfigError(
            f"collate_fn: the packing alignment {alignment} does not make every row a multiple of {parts}, which "
            f"get_batch's cp_layout {layout!r} with cp_size {cp} needs (it cuts a row into {parts} equal parts); "
            f"remove alignment settings from the collate_fn node so that build_online_text_collate_fn derives it "
            f"(cp_size and cp_layout come from the pipeline), or set its cp_layout to {layout!r}"
        )
    per_sequence = getattr(collate_fn, "pad_each_sequence_to", None)
    if layout == "zigzag_thd" and per_sequence is not None and per_sequence % parts:
        raise DataConfigError(
            f"collate_fn: sequences are padded to a multiple of {per_sequence} (pad_each_sequence_to), but "
            f"get_batch's cp_layout 'zigzag_thd' with cp_size {cp} cuts every sequence into {parts} chunks, so each "
            f"must be a multiple of {parts}; set the collate_fn node's cp_layout to zigzag_thd (or remove it: the "
            "pipeline offers the get_batch node's), or use another cp_layout"
        )


def _check_row_length(get_batch, datasets: tuple) -> None:
    """Refuse Indexed rows whose length the CP layout cannot cut evenly (read from the first sample)."""
    if not isinstance(get_batch, ParallelBatch) or get_batch.context.cp_size == 1 or get_batch.source_type != "indexed":
        return
    dataset = next((d for d in datasets if d is not None and hasattr(d, "__getitem__") and len(d) > 0), None)
    sample = dataset[0] if dataset is not None else None
    if not isinstance(sample, Mapping) or "tokens" not in sample:
        return
    length, parts = len(sample["tokens"]), _layout_parts(get_batch)
    if length % parts:
        lower = length - length % parts
        such_as = " or ".join(str(value) for value in (lower, lower + parts) if value > 0)
        raise DataConfigError(
            f"dataset: Indexed rows hold {length} tokens (seq_length), but get_batch's cp_layout "
            f"{get_batch.cp_layout!r} with cp_size {get_batch.context.cp_size} cuts every row into {parts} equal parts;"
            f" set data_config.seq_length to a multiple of {parts}, such as {such_as}"
        )
