"""Build a trainer's pipeline from a config: its DataLoaders (dataset, collate_fn, dataloader) and get_batch.

Owns: checking every top-level node (``pipeline_nodes.NODE_TABLE``) before the first is built, comparing the
settings that shape a batch across the ranks of the mesh before any data is read (with a ``parallel_context`` over
several ranks: the same ``DataConfigError`` on every rank, naming the node, the field and each rank's value), the
order in which the nodes are built (a trainer's: model assets, then get_batch and the collator, then datasets and
loaders), one state over all the loaders, and the ``PipelineContext`` of runtime values (the tokenizer and chat
template, batch sizes, the seed, the rank layout, the batch layout): each node receives only the values its row of
the node table names, and ``instantiate`` passes each to the targets of that node that name it. With a
``DataLoaderParallelContext`` the rank layout comes from it: datasets and loaders are built on the data ranks only
(``build_on_data_ranks``; the other ranks get None), and the ``get_batch`` node (``ParallelBatch``) is built on every
rank with the context and the tokenizer's EOD id. The batch layout (``DeliveryLayout``) is decided once, from the
``get_batch`` node or else from the CP/TP sizes, and handed to the collator, the dataset and the loader, which check
and pad for it themselves. The ``dataset`` node may return one dataset or ``(train, valid, test)``; a loader is
built for each non-empty split. The optional ``packing_scheduler`` node (a ``PackingSchedulerConfig``) is built on
every rank, given to the ``get_batch`` node as its ``scheduler`` (without a get_batch node, a packed
``ParallelBatch`` is built with it) and handed back for ``wrap_data_iterator``: the scheduler then pads each
micro-batch for its own CP size, so the collator is given a layout without CP/TP padding. A dynamic loader over
several DP ranks without a scheduler is warned about once: its ranks may deliver different numbers of micro-batches
per step. Not responsible for: what any node builds, or the per-step delivery itself (``get_batch``).

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
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

from hyper_parallel.data.batching.build_collate_fn import check_pad_token_id
from hyper_parallel.data.batching.build_dataloader import DynamicBatchDataLoader
from hyper_parallel.data.batching.get_batch import ParallelBatch
from hyper_parallel.data.batching.loader_options import LoaderOptions, WorkerOptions
from hyper_parallel.data.batching.pipeline_nodes import NODES, PipelineContext, built_nodes, required_nodes
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
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.parallel.process_groups import ProcessGroupCollection
from hyper_parallel.data.parallel.rank_agreement import check_ranks_agree
from hyper_parallel.data.text.build_tokenizer import build_tokenizer, is_transformers_tokenizer
from hyper_parallel.data.text.chat_template import build_chat_template
from hyper_parallel.data.tokenizer_protocol import read_tokenizer

__all__ = ["NODES", "DataLoaders", "build_dataloaders"]

logger = get_logger(__name__)

SPLITS = ("train", "valid", "test")
_MODEL_ASSET_KEYS = ("tokenizer", "chat_template")
_REQUIRED = required_nodes()
_DEBUG_KEYS = ("check_dataset",)
_LOG_LEVELS = ("debug", "info", "warn", "warning", "error")
_RANK_DEFAULTS = {"dp_rank": 0, "dp_world_size": 1, "cp_size": 1, "tp_size": 1}
_SCHEDULER_TARGET = f"{PackingSchedulerConfig.__module__}.{PackingSchedulerConfig.__qualname__}"
# The nodes that are built, each with a target it may name (for the message of a node of the wrong shape).
_BUILT_NODE_EXAMPLES = built_nodes()
# How the torch DataLoader fetches: a build_dataloaders keyword of each name overrides the dataloader node's value.
_WORKER_DEFAULTS = {option.name: option.default for option in fields(WorkerOptions)}
# The nodes whose settings shape a batch, compared across the ranks of a mesh (model_assets may name local paths;
# debug and variables shape nothing, and variables are already resolved into the nodes).
_AGREED_NODES = ("dataset", "collate_fn", "dataloader", "get_batch", "packing_scheduler")
# A placeholder for what is built later: during the checks only the names of the values matter.
_BUILT_LATER = "<built later>"
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


def _did_you_mean(key, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(key), choices, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_nodes(config: Mapping, runtime: PipelineContext, allowed_prefixes: Sequence[str]) -> None:
    """Refuse unknown or missing top-level nodes, then check every node as ``instantiate`` would, building nothing,
    so that a typo anywhere fails before the dataset is read. Each node is checked with the values its row of the
    node table receives (only their names matter here)."""
    for key in config:
        if key not in NODES:
            raise DataConfigError(
                f"{key}: the pipeline config has no node '{key}'{_did_you_mean(key, NODES)}; its top-level nodes are "
                f"{', '.join(NODES)}. Rename or remove it"
            )
    for key in _REQUIRED:
        if key not in config:
            raise DataConfigError(
                f"the pipeline config has no '{key}' node; it needs {' and '.join(map(repr, _REQUIRED))}"
            )
    _check_node_shapes(config)
    _check_debug(config.get("debug"))
    _check_model_assets(config.get("model_assets"), runtime, allowed_prefixes)
    built_later = {
        "dataloader": {"dataset": _BUILT_LATER, "collate_fn": _BUILT_LATER},
        "get_batch": {"scheduler": _BUILT_LATER} if config.get("packing_scheduler") is not None else {},
    }
    for name in _AGREED_NODES:
        check_config(
            config.get(name),
            context=runtime.for_node(name, **built_later.get(name, {})),
            allowed_prefixes=allowed_prefixes,
            path=name,
        )


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


def _check_model_assets(node, runtime: PipelineContext, allowed_prefixes: Sequence[str]) -> None:
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
    if given is not None and runtime.tokenizer is not None:
        raise DataConfigError(
            "model_assets.tokenizer: the tokenizer is given twice, by this key and by the tokenizer argument of "
            "build_dataloaders; keep one"
        )
    if node.get("chat_template") is not None and given is None and runtime.tokenizer is None:
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
                value,
                context=runtime.for_node("model_assets"),
                allowed_prefixes=allowed_prefixes,
                path=f"model_assets.{key}",
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
            context=PipelineContext(tokenizer=tokenizer).for_node("model_assets"),
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
    seed: int | None = None,
    train_valid_test_num_samples: Sequence[int | None] | None = None,
    allowed_prefixes: Sequence[str] = DEFAULT_ALLOWED_PREFIXES,
    parallel_context: DataLoaderParallelContext | None = None,
    pg_collection: ProcessGroupCollection | None = None,
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
        config: the pipeline mapping, or the path of a YAML file holding it. Its top-level nodes are those of
            ``pipeline_nodes.NODE_TABLE``: ``dataset`` and ``dataloader`` (required), ``model_assets``
            (``tokenizer``: a path or a ``_target_`` node, instead of the ``tokenizer`` argument; ``chat_template``:
            a name such as ``chatml`` or a ``_target_`` node, built with the tokenizer and handed to the dataset
            node's targets with a ``chat_template`` parameter), ``collate_fn``, ``get_batch`` (a ``ParallelBatch``),
            ``packing_scheduler`` (a ``PackingSchedulerConfig``, given to the ``get_batch`` node as ``scheduler``;
            without a get_batch node a packed ``ParallelBatch`` is built; the collator is then given a layout
            without CP/TP padding), ``debug`` (``check_dataset``: a log level for this
            package's logs on rank 0, or null) and ``variables`` (values for ``${variables.name}``
            interpolations); any other is refused.
        tokenizer: anything ``build_tokenizer`` takes: a loaded tokenizer, a ``transformers`` tokenizer object, or
            the path of a local Hugging Face tokenizer or tiktoken file.
        micro_batch_size, global_batch_size, dp_rank, dp_world_size, cp_size, tp_size, sequence_parallel:
            runtime values, handed to the nodes whose row of ``pipeline_nodes.NODE_TABLE`` names them (each to the
            targets of that node with a parameter of that name); the batch sizes and ranks are checked first, as
            the loaders check them. With a ``parallel_context``, leave the ranks and sizes out: they come from it.
        seed: the seed of the pipeline, or None (not given: every target keeps its own default, 1234, and the
            Indexed order its ``data_config.random_seed``). Given, it seeds the samplers and Online streams and is
            the Indexed ``data_config.random_seed``: a ``random_seed`` written in the config that differs from it is
            refused, naming both.
        train_valid_test_num_samples: the samples the trainer takes from each split, as megatron-core's trainer
            computes them (train iterations x global batch, evaluation iterations x global batch; see
            ``tools.prepare_cache.num_samples_from_schedule``), offered like the facts above: the Indexed
            builder then repeats a split's epochs until it holds that many samples. None, or a None entry, is one
            epoch of the split; a count the config's dataset node sets wins. A split the trainer takes 0 samples
            from gets no loader (its dataset is still built, as megatron-core builds it), on either path.
        allowed_prefixes: module prefixes that ``_target_`` may name.
        pg_collection: this rank's ``ProcessGroupCollection`` (needed by a packing scheduler's dynamic CP groups),
            instead of ``parallel_context``: the context is then ``pg_collection.parallel_context()``, and the
            collection is handed to the ``get_batch`` node.
        parallel_context: this rank's ``DataLoaderParallelContext``. It gives the DP rank and size, the CP and TP
            sizes, and it is handed to the ``get_batch`` node with the tokenizer's EOD id (``eod_token_id``). Over
            several ranks, every rank of the world compares the batch-shaping settings (the dataset, collate_fn,
            dataloader, get_batch and packing_scheduler nodes, and the runtime values but the DP rank) before
            anything is checked or built.
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
            option, a rank layout given twice and differently, ranks of the mesh that disagree on a batch-shaping
            setting (the same error on every rank, naming the node, the field and each rank's value), any error
            ``instantiate`` finds in a node (before anything is built), a ``packing_scheduler`` node that builds
            something else than a ``PackingSchedulerConfig``, both ``parallel_context`` and ``pg_collection``; and
            what the nodes refuse when built (an Indexed ``seq_length`` the layout cannot cut, a ``random_seed``
            other than the given seed).

    Example (a packing scheduler; every rank, each step)::

        loaders = build_dataloaders("pipeline.yaml", pg_collection=groups, ...)
        train_iterator = iter(loaders.train) if groups.is_data_rank else None
        for step in range(num_steps):
            for model_inputs, loss_inputs in loaders.get_batch.schedule(train_iterator, num_microbatches):
                ...
    """
    if isinstance(config, str | os.PathLike):
        config = load_config(config)
    elif not isinstance(config, Mapping):
        raise DataConfigError(
            f"config must be a pipeline mapping (dataset:, dataloader:, ...) or the path of a YAML file holding it, "
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
    parallel_context = _parallel_context(parallel_context, pg_collection)
    ranks = _rank_layout(
        parallel_context, {"dp_rank": dp_rank, "dp_world_size": dp_world_size, "cp_size": cp_size, "tp_size": tp_size}
    )
    runtime = PipelineContext(
        tokenizer=tokenizer,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        **ranks,
        sequence_parallel=sequence_parallel,
        seed=seed,
        train_valid_test_num_samples=train_valid_test_num_samples,
        parallel_context=parallel_context,
        pg_collection=pg_collection,
    )
    overridden = _override_worker_options(config, worker_overrides)
    _check_ranks_agree_on(config, runtime)  # before anything that could fail on one rank only
    LoaderOptions.from_keywords(
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        dp_rank=ranks["dp_rank"],
        dp_world_size=ranks["dp_world_size"],
        **({} if seed is None else {"seed": seed}),
        **worker_overrides,
    )
    wanted = [count != 0 for count in sample_counts(train_valid_test_num_samples)]
    assets = config.get("model_assets") or {}
    sets_template = isinstance(assets, Mapping) and assets.get("chat_template") is not None
    _check_nodes(overridden, replace(runtime, chat_template=_BUILT_LATER if sets_template else None), allowed_prefixes)
    _log_worker_overrides(config, worker_overrides)
    config = overridden
    level = (config.get("debug") or {}).get("check_dataset")
    if level is not None:
        enable_dataset_logging(str(level))  # rank 0 logs, as enable_dataset_logging does by default
    built_tokenizer, chat_template = _build_model_assets(assets, tokenizer, allowed_prefixes)
    runtime = replace(
        runtime,
        tokenizer=built_tokenizer,
        chat_template=chat_template,
        eod_token_id=None if built_tokenizer is None else read_tokenizer(built_tokenizer).eod,
    )
    scheduler = _build_scheduler(config.get("packing_scheduler"), runtime, allowed_prefixes)
    get_batch = _build_get_batch(config.get("get_batch"), scheduler, runtime, allowed_prefixes)
    runtime = replace(
        runtime,
        layout=_loader_layout(get_batch, scheduler, runtime),
        delivery_plan=get_batch.delivery_plan if isinstance(get_batch, ParallelBatch) and scheduler is None else None,
    )
    collate_fn = None
    if config.get("collate_fn") is not None:
        collate_fn = instantiate(
            config["collate_fn"],
            context=runtime.for_node("collate_fn"),
            allowed_prefixes=allowed_prefixes,
            path="collate_fn",
        )

    def build_readers() -> tuple:
        datasets = _as_splits(
            instantiate(
                config["dataset"],
                context=runtime.for_node("dataset"),
                allowed_prefixes=allowed_prefixes,
                path="dataset",
            )
        )
        loaders = _build_loaders(
            config, runtime, datasets, wanted, collate_fn, allowed_prefixes, scheduled=scheduler is not None
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
        tokenizer=runtime.tokenizer,
        chat_template=chat_template,
        datasets=datasets,
        collate_fn=collate_fn,
    )


def _parallel_context(parallel_context, pg_collection) -> DataLoaderParallelContext | None:
    """This rank's place: the ``parallel_context`` argument, or the ``pg_collection``'s (one of them, not both)."""
    if pg_collection is None:
        return parallel_context
    if not isinstance(pg_collection, ProcessGroupCollection):
        raise DataConfigError(
            f"pg_collection must be a ProcessGroupCollection (ProcessGroupCollection.from_mesh), got "
            f"{type(pg_collection).__name__}"
        )
    if parallel_context is not None:
        raise DataConfigError(
            "parallel_context and pg_collection are both given; pass pg_collection alone (the pipeline reads "
            "pg_collection.parallel_context()), or parallel_context alone without a packing scheduler's groups"
        )
    return pg_collection.parallel_context()


def _build_get_batch(node, scheduler, runtime: PipelineContext, allowed_prefixes):
    """The built ``get_batch`` node (given the scheduler's settings); under a packing scheduler without the node, a
    packed ``ParallelBatch``, since the scheduler's micro-batches are THD rows; else None."""
    if node is not None:
        return instantiate(
            node, context=runtime.for_node("get_batch", scheduler=scheduler), allowed_prefixes=allowed_prefixes,
            path="get_batch",
        )  # fmt: skip
    if scheduler is None:
        return None
    return ParallelBatch(attention_mode="packed", **runtime.for_node("get_batch", scheduler=scheduler))


def _loader_layout(get_batch, scheduler, runtime: PipelineContext) -> DeliveryLayout:
    """The layout the collator, the dataset and the loaders are given: the ``get_batch`` node's one layout; under a
    packing scheduler none with CP/TP padding (the scheduler unpacks every micro-batch into its sequences and pads
    each group for its own CP size, with ``get_batch.layout``); without a get_batch node, one from the CP/TP sizes."""
    if scheduler is not None:
        return DeliveryLayout()
    if isinstance(get_batch, ParallelBatch):
        return get_batch.layout
    return DeliveryLayout(cp_size=runtime.cp_size, tp_size=runtime.tp_size, sequence_parallel=runtime.sequence_parallel)


def _build_scheduler(node, runtime: PipelineContext, allowed_prefixes):
    """The built ``packing_scheduler`` node, or None without it; anything but a ``PackingSchedulerConfig`` is
    refused."""
    if node is None:
        return None
    built = instantiate(
        node, context=runtime.for_node("packing_scheduler"), allowed_prefixes=allowed_prefixes, path="packing_scheduler"
    )
    if not isinstance(built, PackingSchedulerConfig):
        raise DataConfigError(
            f"packing_scheduler: the node built a {type(built).__name__}, but it must build the scheduler's settings; "
            f"set its _target_ to {_SCHEDULER_TARGET}"
        )
    tokens = None if runtime.tokenizer is None else read_tokenizer(runtime.tokenizer)
    check_pad_token_id(built.pad_token_id, tokens, "packing_scheduler")
    return built


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
    runtime: PipelineContext,
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
            context=runtime.for_node("dataloader", dataset=dataset, collate_fn=collate_fn),
            allowed_prefixes=allowed_prefixes,
            path="dataloader",
        )
        logger.info("%s loader: %r", split, loader)
        if not scheduled and all(built is None for built in loaders):  # the same settings for every split: once
            _warn_uneven_micro_batches(loader)
        loaders.append(loader)
    return loaders


# -- the settings every rank of a mesh must share --------------------------------------------------------------------


def _check_ranks_agree_on(config: Mapping, runtime: PipelineContext) -> None:
    """With a parallel context over several ranks, raise the same ``DataConfigError`` on every rank when the ranks
    disagree on a setting that shapes a batch: a batch-shaping node's resolved config (its worker options aside:
    batches never depend on them) or a runtime value every rank must share (``PipelineContext.agreed_values``)."""
    if runtime.parallel_context is None:
        return
    settings = {name: _flattened(config.get(name)) for name in _AGREED_NODES}
    for option in _WORKER_DEFAULTS:
        settings["dataloader"].pop(option, None)
    settings["build_dataloaders"] = dict(runtime.agreed_values())
    check_ranks_agree(settings, what="the batch-shaping settings of build_dataloaders")


def _flattened(node, prefix: str = "") -> dict:
    """A config node as ``{dotted.key: plain value}``; a value that is not plain data (an object passed in a config
    mapping) is shown by its type, whose text is the same on every rank."""
    if isinstance(node, Mapping):
        flat = {}
        for key, value in node.items():
            flat.update(_flattened(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(node, list | tuple):
        return {prefix: [value if _is_plain(value) else _flattened(value) for value in node]}
    return {prefix: node if _is_plain(node) else f"<{type(node).__name__}>"}


def _is_plain(value) -> bool:
    return value is None or isinstance(value, bool | int | float | str)
