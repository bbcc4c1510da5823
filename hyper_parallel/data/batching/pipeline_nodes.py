"""The pipeline's node table and the runtime values handed to its nodes, each written once.

Owns: ``NODE_TABLE``, the top-level nodes of a pipeline config (name, required or not, built or not, a ``_target_``
it may name, which runtime values it receives, and its line of documentation), ``RUNTIME_VALUES`` (what each of
those values is), and ``PipelineContext``, the frozen value that carries them from ``build_dataloaders`` to the
nodes: each node receives only the values its row names (``PipelineContext.for_node``), and ``instantiate`` passes
each to the targets of that node whose signature names it. ``batching.dataloader`` and ``tools.config_reference``
both read this table; nothing else lists nodes. Not responsible for: building or checking the nodes
(``batching.dataloader``, ``instantiate``) or rendering the reference (``tools.config_reference``).

Example::

    context = PipelineContext(tokenizer=tok, micro_batch_size=4, seed=7)
    context.for_node("dataloader", dataset=train, collate_fn=collate)
    # {'micro_batch_size': 4, 'global_batch_size': None, 'dp_rank': 0, ..., 'seed': 7, 'dataset': ..., ...}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hyper_parallel.data.parallel.data_schedule_utils import PackingSchedulerConfig

__all__ = [
    "NODES",
    "NODE_TABLE",
    "RUNTIME_VALUES",
    "PipelineContext",
    "PipelineNode",
    "RuntimeValue",
    "built_nodes",
    "node",
    "required_nodes",
]


@dataclass(frozen=True)
class RuntimeValue:
    """One value the pipeline hands to nodes.

    Attributes:
        name: the parameter name a target receives it under.
        when: when it is given (the reference's "Given by the pipeline" column), e.g. ``"yes"``.
        source: what the pipeline passes, for the reference.
    """

    name: str
    when: str
    source: str


@dataclass(frozen=True)
class PipelineNode:
    """One top-level node of a pipeline config.

    Attributes:
        name: its key in the config.
        required: a config without it is refused.
        built: a mapping with ``_target_`` (``example`` names one); else a mapping of plain keys.
        example: a ``_target_`` the node may name (for messages and the reference), or None.
        receives: the runtime values (``RUNTIME_VALUES``) handed to the node's targets, by parameter name.
        docs: what it holds, one line for the reference.
    """

    name: str
    required: bool
    built: bool
    example: str | None
    receives: tuple[str, ...]
    docs: str


_SCHEDULER_TARGET = f"{PackingSchedulerConfig.__module__}.{PackingSchedulerConfig.__qualname__}"
_FROM_CONTEXT = "the `{name}` argument of `build_dataloaders`, or its `parallel_context`"

RUNTIME_VALUES: dict[str, RuntimeValue] = {
    value.name: value
    for value in (
        RuntimeValue(
            "tokenizer",
            "yes",
            "the pipeline's tokenizer (`model_assets.tokenizer` or the `tokenizer` argument), loaded once",
        ),
        RuntimeValue(
            "chat_template",
            "with model_assets.chat_template",
            "the `model_assets.chat_template` node, built with the tokenizer; offered only when it is set",
        ),
        RuntimeValue("micro_batch_size", "yes", "the `micro_batch_size` argument of `build_dataloaders`"),
        RuntimeValue("global_batch_size", "yes", "the `global_batch_size` argument of `build_dataloaders`"),
        RuntimeValue("dp_rank", "yes", _FROM_CONTEXT.format(name="dp_rank")),
        RuntimeValue("dp_world_size", "yes", _FROM_CONTEXT.format(name="dp_world_size")),
        RuntimeValue("sequence_parallel", "yes", "the `sequence_parallel` argument of `build_dataloaders`"),
        RuntimeValue(
            "seed",
            "when given",
            "the `seed` argument of `build_dataloaders`, offered only when it is given (the targets' own default, "
            "1234, otherwise); it is also the Indexed `data_config.random_seed`",
        ),
        RuntimeValue(
            "train_valid_test_num_samples",
            "yes",
            "the `train_valid_test_num_samples` argument of `build_dataloaders`",
        ),
        RuntimeValue(
            "layout",
            "yes",
            "the batch layout over the CP and TP ranks (`DeliveryLayout`): the `get_batch` node's, else one from the "
            "CP/TP sizes (without CP/TP padding under a packing_scheduler, which pads itself)",
        ),
        RuntimeValue(
            "parallel_context",
            "yes",
            "the `parallel_context` argument of `build_dataloaders` (or `pg_collection.parallel_context()`), or null",
        ),
        RuntimeValue("pg_collection", "yes", "the `pg_collection` argument of `build_dataloaders`, or null"),
        RuntimeValue("eod_token_id", "yes", "the tokenizer's EOD id, or null without a tokenizer"),
        RuntimeValue("dataset", "yes", "each split's dataset in turn: one loader per non-empty split"),
        RuntimeValue("collate_fn", "yes", "the built `collate_fn` node, or null without one"),
        RuntimeValue("scheduler", "with a packing_scheduler node", "the built `packing_scheduler` node, or null"),
        RuntimeValue(
            "delivery_plan",
            "with a get_batch node",
            "this data rank's `get_batch.delivery_plan`, so each batch carries its CP rank's delivery metadata, "
            "computed in the DataLoader workers; offered with a `ParallelBatch` node and no packing_scheduler (which "
            "re-packs every micro-batch)",
        ),
    )
}

NODE_TABLE: tuple[PipelineNode, ...] = (
    PipelineNode(
        "model_assets",
        required=False,
        built=False,
        example=None,
        receives=("tokenizer",),
        docs="the tokenizer (`tokenizer`: a path or a build_tokenizer node, instead of the `tokenizer` argument) and "
        "the chat template (`chat_template`: a name or a build_chat_template node, given the tokenizer), built "
        "first, once",
    ),
    PipelineNode(
        "dataset",
        required=True,
        built=True,
        example="hyper_parallel.data.text.build_dataset.build_online_text_dataset",
        receives=(
            "tokenizer",
            "chat_template",
            "dp_rank",
            "dp_world_size",
            "seed",
            "train_valid_test_num_samples",
            "layout",
        ),
        docs="the dataset, or `(train, valid, test)`; built on the ranks that read data",
    ),
    PipelineNode(
        "collate_fn",
        required=False,
        built=True,
        example="hyper_parallel.data.batching.build_online_text_collate_fn",
        receives=("tokenizer", "layout", "delivery_plan"),
        docs="turns the samples of a micro-batch into a batch, padded for the pipeline's `layout`; built on every rank",
    ),
    PipelineNode(
        "dataloader",
        required=True,
        built=True,
        example="hyper_parallel.data.batching.FixedBatchDataLoader",
        receives=(
            "dataset",
            "collate_fn",
            "micro_batch_size",
            "global_batch_size",
            "dp_rank",
            "dp_world_size",
            "seed",
            "layout",
        ),
        docs="one loader per non-empty split, built on the ranks that read data",
    ),
    PipelineNode(
        "get_batch",
        required=False,
        built=True,
        example="hyper_parallel.data.batching.ParallelBatch",
        receives=("parallel_context", "pg_collection", "eod_token_id", "sequence_parallel", "scheduler"),
        docs="delivers each batch as `(model_inputs, loss_inputs)` on every rank, and with a packing_scheduler each "
        "scheduled step (`get_batch.schedule`); its layout is the pipeline's. Built on every rank; without the node "
        "but with a packing_scheduler, a packed ParallelBatch is built",
    ),
    PipelineNode(
        "packing_scheduler",
        required=False,
        built=True,
        example=_SCHEDULER_TARGET,
        receives=("sequence_parallel",),
        docs="the packing scheduler's settings, given to the get_batch node (`scheduler`) and returned as "
        "`DataLoaders.packing_scheduler` (the config of `wrap_data_iterator`)",
    ),
    PipelineNode(
        "debug",
        required=False,
        built=False,
        example=None,
        receives=(),
        docs="`check_dataset`: the level of this package's logs on rank 0 (debug, info, warn, error), or null",
    ),
    PipelineNode(
        "variables",
        required=False,
        built=False,
        example=None,
        receives=(),
        docs="free values for `${variables.name}` interpolations elsewhere in the file; never built",
    ),
)

NODES = tuple(row.name for row in NODE_TABLE)
_ROWS = {row.name: row for row in NODE_TABLE}


def node(name: str) -> PipelineNode:
    """The row of node ``name`` (a ``KeyError`` for a name that is not a node: callers check ``NODES`` first)."""
    return _ROWS[name]


def required_nodes() -> tuple[str, ...]:
    """The nodes a config must have, in table order."""
    return tuple(row.name for row in NODE_TABLE if row.required)


def built_nodes() -> dict[str, str]:
    """``{node: an example _target_}`` for the nodes built from a ``_target_``, in table order."""
    return {row.name: row.example for row in NODE_TABLE if row.built}


# The values offered only when set: offering None would replace a target's own default (``seed``: 1234).
_OFFERED_WHEN_SET = ("chat_template", "seed", "delivery_plan")


@dataclass(frozen=True)
class PipelineContext:
    """The runtime values of one pipeline, decided once in ``build_dataloaders`` and handed out per node.

    Attributes:
        tokenizer: the pipeline's tokenizer (loaded once), or None.
        chat_template: the built chat template, or None.
        micro_batch_size, global_batch_size: the batch sizes.
        dp_rank, dp_world_size, cp_size, tp_size: the rank layout (from the parallel context when there is one).
        sequence_parallel: activations are split along the sequence across the TP ranks.
        seed: the seed given to ``build_dataloaders``, or None when none was given.
        train_valid_test_num_samples: the samples the trainer takes from each split, or None.
        layout: the batch layout over the CP and TP ranks (a ``DeliveryLayout``), once decided.
        parallel_context: this rank's ``DataLoaderParallelContext``, or None.
        pg_collection: this rank's ``ProcessGroupCollection`` (the scheduler's groups), or None.
        eod_token_id: the tokenizer's EOD id, or None.
        delivery_plan: the ``get_batch`` node's ``DeliveryPlan`` for the collator, or None.
    """

    tokenizer: Any = None
    chat_template: Any = None
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    dp_rank: int = 0
    dp_world_size: int = 1
    cp_size: int = 1
    tp_size: int = 1
    sequence_parallel: bool = False
    seed: int | None = None
    train_valid_test_num_samples: Any = None
    layout: Any = None
    parallel_context: Any = None
    pg_collection: Any = None
    eod_token_id: int | None = None
    delivery_plan: Any = None

    def for_node(self, name: str, **built: Any) -> dict[str, Any]:
        """The values node ``name`` receives (its row's ``receives``), by parameter name.

        Args:
            name: a node of ``NODE_TABLE``.
            built: the values the pipeline built for this node (``dataset``, ``collate_fn``, ``scheduler``); each
                must be one the row receives.

        Raises:
            ValueError: a built value the row does not receive (a bug of the caller, not of a config).
        """
        receives = node(name).receives
        stray = sorted(set(built) - set(receives))
        if stray:
            raise ValueError(f"the {name} node receives no {', '.join(stray)} (pipeline_nodes.NODE_TABLE)")
        own = {field.name for field in fields(self)}
        values = {key: getattr(self, key) for key in receives if key in own}
        values.update(built)
        return {key: value for key, value in values.items() if not (key in _OFFERED_WHEN_SET and value is None)}

    def agreed_values(self) -> Mapping[str, Any]:
        """The values every rank of a mesh must share (the rank's own position, ``dp_rank``, left out)."""
        shared = ("micro_batch_size", "global_batch_size", "dp_world_size", "cp_size", "tp_size", "sequence_parallel")
        values = {key: getattr(self, key) for key in shared}
        values["seed"] = self.seed
        values["train_valid_test_num_samples"] = _plain(self.train_valid_test_num_samples)
        return values


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple | list) else value
