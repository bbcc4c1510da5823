"""ParallelBatch: the one delivery stage, ``(model_inputs, loss_inputs)`` on every rank of a DP x CP x TP x PP mesh.

Owns: the last step of the pipeline, in two modes with one output.

* Plain: ``get_batch(data_iterator)``. On a data rank (TP rank 0 of PP stage 0 of its (DP, CP) coordinate) it
  pulls the next ``Batch``, keeps this CP rank's columns (one gather per token field) and relays the CP-local tokens and
  labels with the checked global ``cu_seq_lens`` to its TP peers and PP stages.
* Scheduled (a ``scheduler=PackingSchedulerConfig``): once per step on every rank, ``step =
  get_batch.schedule(data_iterator, num_microbatches)`` fetches the step's micro-batches on the data ranks, all-gathers
  one header over the DP x CP domain (failures, counts, and ``num_microbatches`` and every scheduler field, compared
  so that ranks that disagree raise the same ``DataConfigError``), plans the step (``plan``: the planner of
  ``parallel.data_schedule_utils``, arithmetic on lengths), packs this rank's groups
  (``batching.scheduled_packing``) and relays the plan's count and statistics. ``len(step)``, ``step.stats`` are the
  same on every rank; ``get_batch(step)`` (or ``next(step)``, or iterating the step) delivers the next scheduled
  micro-batch, cut across its own CP group (dynamic CP), exactly as the plain mode delivers a batch.

Every rank then builds the same position ids and attention metadata from what it received, so peers agree without
sending them (``batching.delivery_plan.delivery_metadata``, the one function of the boundaries); on the data rank a
collator given ``.delivery_plan`` has already computed them in the DataLoader worker (``Batch.delivery``), so the
training process only checks the plan and gathers. The end of the data and a reader's failure reach every rank of the TP
group and every PP stage in the same call (``_relay``, the one place that moves a data rank's outcome). The layout of
every batch is decided once, as ``.layout`` (a ``DeliveryLayout``), which the pipeline hands to the collator and the
loaders. ``source_type`` is accepted for the design's configs; nothing depends on it: every boundary is the ``Batch``'s
``cu_seq_lens``, computed once by the collator (``build_collate_fn.indexed_batch`` converts a megatron-style dict, at
the edge). Not responsible for: reading files or choosing samples (the loaders), the layouts' arithmetic and the
collectives (``parallel``), the schedule's algorithms (``parallel.data_schedule_utils``), packing groups
(``batching.scheduled_packing``), the masks themselves (``batching.attention_runtime``), Megatron's names and keys
(``batching.data_schedule``).

Outputs, for ``R`` rows of ``T`` tokens and ``s = T // c`` local columns (``c`` the batch's CP size; docs/
distributed.md states the conventions once)::

    model_inputs = {"input_ids": [R, s], "labels": [R, s], "position_ids": [R, s],
                    "attention_mask": bool [R, 1, s, T] (dense: True = may attend) | BlockMask (flex) | None,
                    "swa_mask": bool [R, 1, s, T] (dense with sliding_window) | None,
                    "packed_seq_params": PackedSeqParams (packed) | None}
    loss_inputs = {"labels": [R, s], "loss_mask": float32 [R, s]}

With pipeline parallelism each stage gets the fields it owns, the others are None under the same keys: the first
stage (and ``mtp_stages``) ``input_ids`` and ``position_ids``, the last stage ``labels`` and ``loss_mask``, every
stage the attention metadata.

Example (every rank)::

    get_batch = ParallelBatch(attention_mode="packed", cp_layout="zigzag_thd", scheduler=config, pg_collection=groups)
    step = get_batch.schedule(iter(loader) if groups.is_data_rank else None, num_microbatches=8)
    for model_inputs, loss_inputs in step:
        ...
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from hyper_parallel.data.batching.attention_runtime import PackedSeqParams
from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.delivery_plan import DeliveryMetadata, DeliveryPlan, delivery_metadata
from hyper_parallel.data.batching.scheduled_packing import exchange_sequences, fetch_sequences, pack_rank_groups
from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError, require_choice, require_flag, require_int
from hyper_parallel.data.parallel.batch_parallel import BatchRelay, gather_columns, stage_fields
from hyper_parallel.data.parallel.data_schedule_utils import (
    FlopsStats,
    PackingSchedulerConfig,
    Schedule,
    build_schedule,
    schedule_stats,
)
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext
from hyper_parallel.data.parallel.delivery_layout import CP_LAYOUTS, DeliveryLayout
from hyper_parallel.data.parallel.process_groups import ProcessGroupCollection, group_size_rank

__all__ = [
    "ATTENTION_MODES",
    "LOSS_INPUT_KEYS",
    "MODEL_INPUT_KEYS",
    "SOURCE_TYPES",
    "ParallelBatch",
    "ScheduledStep",
    "dynamic_group_lookup",
]

logger = get_logger(__name__)

SOURCE_TYPES = ("online", "indexed")
ATTENTION_MODES = ("dense", "packed", "flex", "none")
MODEL_INPUT_KEYS = ("input_ids", "labels", "position_ids", "attention_mask", "swa_mask", "packed_seq_params")
LOSS_INPUT_KEYS = ("labels", "loss_mask")
# What a data rank relays (each PP stage receives the fields it owns, PIPELINE_FIELD_OWNERS); the rest is rebuilt.
_SENT = ("input_ids", "labels", "loss_mask", "cu_seq_lens", "cu_seq_lens_real", "local_cp_size", "local_shape")
_OUTCOME = ("outcome",)  # a scheduled step's count and statistics


def _shape_of(value: Any) -> str:
    """A model input's type and shape for a log line (never its values): ``bool[2, 1, 8, 16]``, ``None``."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, PackedSeqParams):
        return f"PackedSeqParams({len(value.cu_seqlens_q) - 1} sequences)"
    shape = getattr(value, "shape", None)  # a FlexAttention BlockMask
    return type(value).__name__ + ("" if shape is None else str(list(shape)))


# -- where this rank sits -------------------------------------------------------------------------------------------


def _local_cp_size(batch: Batch) -> int | None:
    value = batch.extras.get("local_cp_size")
    if value is None:
        return None
    return require_int("the batch's local_cp_size", int(torch.as_tensor(value).reshape(-1)[0]), 1, DataFileError)


class ScheduledStep:
    """One scheduled step on this rank: its micro-batch count and statistics, and the delivery of each micro-batch.

    Built by ``ParallelBatch.schedule`` on every rank. ``next(step)`` (or ``get_batch(step)``, or iterating it)
    delivers the next micro-batch as ``(model_inputs, loss_inputs)``; after ``len(step)`` micro-batches it raises
    ``StopIteration`` on every rank.

    Attributes:
        num_micro_batches: the step's micro-batch count, the same on every rank.
        stats: the step's ``FlopsStats``, the same on every rank.
        micro_batches: the data rank's packed ``Batch`` es (``[1, P]`` each, with the extra ``local_cp_size``); None
            on the other ranks.
    """

    def __init__(self, stage: ParallelBatch, micro_batches: list[Batch] | None, count: int, stats: FlopsStats):
        self.num_micro_batches, self.stats, self.micro_batches = count, stats, micro_batches
        self._stage = stage
        self._batches = None if micro_batches is None else iter(micro_batches)

    def __len__(self) -> int:
        return self.num_micro_batches

    def __iter__(self) -> ScheduledStep:
        return self

    def __next__(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self._stage.deliver(self._batches)

    def packed_iterator(self) -> Iterator[Batch] | None:
        """A fresh iterator over the data rank's packed micro-batches (None elsewhere), for ``deliver``."""
        return None if self.micro_batches is None else iter(self.micro_batches)


class ParallelBatch:
    """Deliver each micro-batch as ``(model_inputs, loss_inputs)`` on every rank: ``get_batch(data_iterator)``.

    Args:
        source_type: ``"online"`` or ``"indexed"``, as the design's configs write it; every boundary comes from the
            ``Batch``'s ``cu_seq_lens`` whatever it is.
        parallel_context: this rank's ``DataLoaderParallelContext``; None is a single process (or the context of
            ``pg_collection``).
        attention_mode: ``"dense"`` (a bool mask of the local queries against all keys), ``"packed"``
            (``PackedSeqParams`` for THD kernels), ``"flex"`` (a FlexAttention ``BlockMask``) or ``"none"``.
        cp_layout: which columns each CP rank holds: ``"contiguous"`` (the default), ``"zigzag"`` or ``"zigzag_thd"``
            (with a scheduler, its ``cp_partition_mode`` decides, and a different ``cp_layout`` is refused); with
            more than one CP rank, ``"packed"`` needs ``"zigzag_thd"`` (the layout Transformer Engine's THD
            attention expects), which needs every sequence padded to ``2 * cp`` (the Online collator does).
        causal: queries see only keys at or before their own column.
        sliding_window: ``w``, with dense or flex attention: a query also sees only itself and the ``w`` keys
            before it (Transformer Engine's window ``(w, 0)``; a Hugging Face ``sliding_window`` is ``w + 1``).
        reset_position_ids: position ids restart at 0 at every sequence (else the global columns).
        eod_mask_loss: the loss mask is also 0 where the input is the EOD token.
        eod_token_id: the EOD id; needed by ``eod_mask_loss``.
        sequence_parallel: the CP-local part is split again over the TP ranks (the layout's alignment; with
            ``pg_collection``, ``packed_seq_params.tp_cp_group``).
        scheduler: the packing scheduler's settings: ``schedule`` plans, packs and delivers each step.
        pg_collection: this rank's groups (covering PP, and the dynamic CP groups); needed by ``scheduler``.
        dynamic_cp_group_func: runtime CP size -> this rank's group of that size: a micro-batch carrying a
            ``local_cp_size`` is cut across that group (default with the ``dynamic_cp`` scheduler:
            ``pg_collection.dynamic_cp``).
        mtp_stages: PP stages that also get ``input_ids`` and ``position_ids`` (multi-token prediction).

    Attributes:
        layout: the ``DeliveryLayout`` of every delivered batch, decided here once (hand it to the collator).
        stage_fields: the relayed fields this PP stage receives (``batch_parallel.stage_fields``).
        device: where the returned tensors are (and where the relay runs: ``"cuda"`` with NCCL).

    Raises:
        DataConfigError: an unknown name (with the closest one), a flag that is not a bool, a window that is not a
            positive integer, a missing ``eod_token_id``, a layout the attention mode cannot use, or a scheduler
            without the groups it needs.
    """

    def __init__(
        self,
        source_type: str = "online",
        *,
        parallel_context: DataLoaderParallelContext | None = None,
        attention_mode: str = "dense",
        cp_layout: str | None = None,
        causal: bool = True,
        sliding_window: int | None = None,
        reset_position_ids: bool = False,
        eod_mask_loss: bool = False,
        eod_token_id: int | None = None,
        sequence_parallel: bool = False,
        scheduler: PackingSchedulerConfig | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        dynamic_cp_group_func: Callable[[int], Any] | None = None,
        mtp_stages: Sequence[int] = (),
        device: torch.device | str = "cpu",
    ) -> None:
        self.source_type = require_choice("source_type", source_type, SOURCE_TYPES, "the kind of loader feeding it")
        self.attention_mode = require_choice(
            "attention_mode", attention_mode, ATTENTION_MODES, "the attention metadata the model takes"
        )
        if cp_layout is not None:
            require_choice("cp_layout", cp_layout, CP_LAYOUTS, "how a row is cut across context-parallel ranks")
        self.causal = require_flag("causal", causal)
        self.reset_position_ids = require_flag("reset_position_ids", reset_position_ids)
        self.eod_mask_loss = require_flag("eod_mask_loss", eod_mask_loss)
        self.sequence_parallel = require_flag("sequence_parallel", sequence_parallel)
        self.sliding_window = self._window(sliding_window)
        self.eod_token_id = self._eod(eod_token_id)
        self.device = torch.device(device)
        self.pg_collection = self._collection(pg_collection)
        self.context = self._context(parallel_context)
        self.scheduler = self._scheduler(scheduler)
        self._group_of = self._dynamic_groups(dynamic_cp_group_func)
        self._groups: dict[int, tuple[Any, int, int]] = {}  # runtime CP size -> (group, size, rank)
        self.stage_fields = stage_fields(_SENT, self.context.pp_rank, self.context.pp_size, mtp_stages=mtp_stages)
        self.mtp_stages = tuple(mtp_stages)
        self.layout = self._layout(cp_layout)
        self.cp_layout = self.layout.cp_layout
        self._check_layout()
        self.delivery_plan = self._delivery_plan()
        self._plans = {(self.delivery_plan.cp_size, self.delivery_plan.cp_rank): self.delivery_plan}
        self._metadata: DeliveryMetadata | None = None  # the data rank's metadata of the batch being delivered
        self._relay: BatchRelay | None = None  # built at the first delivery: a context from integers takes none
        self._outcome_relay: BatchRelay | None = None  # relays a step's count and statistics
        self._shapes: tuple | None = None  # the shape signature of the last batch logged
        self._log_start()

    # -- settings --------------------------------------------------------------------------------------------------

    def _window(self, sliding_window: Any) -> int | None:
        if sliding_window is None:
            return None
        try:
            window = require_int("sliding_window", sliding_window, 1)
        except DataConfigError as error:
            raise DataConfigError(
                f"{error}; set it to how many keys before its own a query sees (Transformer Engine's window (w, 0)), "
                "or null for no window"
            ) from None
        if self.attention_mode in ("packed", "none"):
            raise DataConfigError(
                f"sliding_window {window} has no effect with attention_mode {self.attention_mode!r}: only dense and "
                "flex masks carry a window. Give the window to the attention kernel instead (Transformer Engine: "
                f"window_size=({window}, 0)), and set sliding_window to null"
            )
        return window

    def _eod(self, eod_token_id: Any) -> int | None:
        if eod_token_id is not None:
            return require_int("eod_token_id", eod_token_id, 0)
        if self.eod_mask_loss:
            raise DataConfigError(
                "eod_token_id is not set, but eod_mask_loss needs it; set eod_token_id to the tokenizer's EOD (EOS) "
                "id, or build the pipeline with a tokenizer (build_dataloaders offers its EOD id)"
            )
        return None

    @staticmethod
    def _collection(pg_collection: Any) -> ProcessGroupCollection | None:
        if pg_collection is None or isinstance(pg_collection, ProcessGroupCollection):
            return pg_collection
        raise DataConfigError(
            f"pg_collection must be a ProcessGroupCollection (ProcessGroupCollection.from_mesh), got "
            f"{type(pg_collection).__name__}"
        )

    def _context(self, parallel_context: Any) -> DataLoaderParallelContext:
        if parallel_context is None:
            if self.pg_collection is not None:
                return self.pg_collection.parallel_context()
            return DataLoaderParallelContext.standalone()
        if not isinstance(parallel_context, DataLoaderParallelContext):
            raise DataConfigError(
                f"parallel_context must be a DataLoaderParallelContext (from_mesh, from_groups or standalone), got "
                f"{type(parallel_context).__name__}"
            )
        return parallel_context

    def _scheduler(self, scheduler: Any) -> PackingSchedulerConfig | None:
        if scheduler is None:
            return None
        if not isinstance(scheduler, PackingSchedulerConfig):
            raise DataConfigError(
                f"scheduler must be a PackingSchedulerConfig, got {type(scheduler).__name__}; build one with "
                "PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=...)"
            )
        context = self.context
        if self.pg_collection is None and context.dp_size * context.cp_size * context.tp_size * context.pp_size == 1:
            self.pg_collection = ProcessGroupCollection(dynamic_cp={1: None}, dynamic_tp_cp={1: None})  # one rank
        if self.pg_collection is None:
            raise DataConfigError(
                "a scheduler re-schedules every step over the DP x CP ranks, so it needs their groups: pass "
                "pg_collection=ProcessGroupCollection.from_mesh(mesh, dynamic_cp_sizes=...) (to build_dataloaders, "
                "instead of parallel_context)"
            )
        if scheduler.scheduler == "dynamic_cp" and not self.pg_collection.dynamic_cp:
            raise DataConfigError(
                "the dynamic_cp scheduler chooses among the runtime CP sizes of pg_collection.dynamic_cp, which is "
                "empty; build the collection with ProcessGroupCollection.from_mesh(mesh, dynamic_cp_sizes=(1, 2, ...))"
            )
        return scheduler

    def _dynamic_groups(self, group_func: Any) -> Callable[[int], Any] | None:
        if group_func is not None:
            if not callable(group_func):
                raise DataConfigError(
                    "dynamic_cp_group_func must be callable (runtime CP size -> group), got "
                    f"{type(group_func).__name__}"
                )
            return group_func
        if self.scheduler is not None and self.scheduler.scheduler == "dynamic_cp":
            return dynamic_group_lookup(self.pg_collection.dynamic_cp, "dynamic_cp")
        return None

    def _layout(self, cp_layout: str | None) -> DeliveryLayout:
        """The one layout value: from the scheduler config when there is one (its ``cp_partition_mode`` decides the
        CP layout), else from ``cp_layout`` (default contiguous)."""
        config, context = self.scheduler, self.context
        if config is None:
            return DeliveryLayout(
                cp_size=context.cp_size, cp_layout=cp_layout or "contiguous", tp_size=context.tp_size,
                sequence_parallel=self.sequence_parallel,
            )  # fmt: skip
        layout = config.layout(cp_size=context.cp_size, tp_size=context.tp_size)
        if cp_layout is not None and cp_layout != layout.cp_layout:
            raise DataConfigError(
                f"cp_layout {cp_layout!r} contradicts the scheduler's cp_partition_mode {config.cp_partition_mode!r} "
                f"(the {layout.cp_layout} layout); set one of them, the scheduler's decides the layout"
            )
        return replace(layout, sequence_parallel=layout.sequence_parallel or self.sequence_parallel)

    def _check_layout(self) -> None:
        cp = max(self.context.cp_size, *(self.pg_collection.dynamic_cp_sizes if self._group_of else (1,)))
        if cp > 1 and self.attention_mode == "packed" and self.cp_layout != "zigzag_thd":
            raise DataConfigError(
                f"attention_mode 'packed' with cp_size {cp} needs cp_layout 'zigzag_thd', got {self.cp_layout!r}: "
                "THD attention with context parallelism (Transformer Engine) expects every sequence cut in 2 * cp "
                "chunks. Set cp_layout: zigzag_thd, or use attention_mode dense or flex"
            )
        if self.scheduler is not None and cp > 1 and self.cp_layout == "zigzag":
            raise DataConfigError(
                "the packing scheduler packs whole sequences per CP group, which the row-wise zigzag layout cannot "
                "cut; use cp_layout zigzag_thd (Megatron's) or contiguous"
            )

    def _delivery_plan(self) -> DeliveryPlan:
        """This rank's plan for the static CP group (a collator given it computes the metadata in the workers)."""
        return DeliveryPlan(
            cp_size=self.context.cp_size, cp_rank=self.context.cp_rank, cp_layout=self.cp_layout,
            attention_mode=self.attention_mode, causal=self.causal, sliding_window=self.sliding_window,
            reset_position_ids=self.reset_position_ids, eod_mask_loss=self.eod_mask_loss,
            eod_token_id=self.eod_token_id,
            capacity=None if self.scheduler is None else self.scheduler.thd_max_packed_sequences,
        )  # fmt: skip

    def _relay_of(self, field_names: tuple[str, ...]) -> BatchRelay:
        """The one way a data rank's outcome reaches its TP peers and PP stages (each stage its own fields)."""
        return BatchRelay(self.context, field_names, mtp_stages=self.mtp_stages, device=self.device)

    def _log_start(self) -> None:
        context = self.context
        reads = "reads the loader" if context.is_data_rank else f"receives global rank {context.tp_src}'s batches"
        logger.info(
            "ParallelBatch: %s attention, CP rank %d of %d (%s layout), TP rank %d of %d, PP stage %d of %d, %s, "
            "%s, on %s",
            self.attention_mode,
            context.cp_rank,
            context.cp_size,
            self.cp_layout,
            context.tp_rank,
            context.tp_size,
            context.pp_rank,
            context.pp_size,
            "scheduled delivery" if self.scheduler is not None else "plain delivery",
            reads,
            self.device,
        )

    def __repr__(self) -> str:
        context = self.context
        return (
            f"{type(self).__name__}(source_type={self.source_type!r}, attention_mode={self.attention_mode!r}, "
            f"cp_layout={self.cp_layout!r}, causal={self.causal}, sliding_window={self.sliding_window}, "
            f"reset_position_ids={self.reset_position_ids}, eod_mask_loss={self.eod_mask_loss}, "
            f"eod_token_id={self.eod_token_id}, scheduler={getattr(self.scheduler, 'scheduler', None)!r}, "
            f"device={str(self.device)!r}, cp={context.cp_rank}/{context.cp_size}, "
            f"tp={context.tp_rank}/{context.tp_size}, pp={context.pp_rank}/{context.pp_size})"
        )

    # -- one micro-batch -------------------------------------------------------------------------------------------

    def __call__(self, data_iterator: Iterator | ScheduledStep | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The next micro-batch on this rank: ``(model_inputs, loss_inputs)``, this PP stage's fields.

        Args:
            data_iterator: the loader's iterator (``iter(loader)``) on data ranks, other ranks may pass None; or the
                step ``schedule`` returned (its next micro-batch, on every rank).

        Raises:
            StopIteration: the data rank's iterator (or the step) is exhausted; every rank of its TP group and every
                PP stage raises it in the same call.
            DataFileError, DataConfigError: the batch breaks the contract, or its boundaries cannot be cut into this
                layout; a reader's error is raised on the data rank and on its TP peers and PP stages.
        """
        if isinstance(data_iterator, ScheduledStep):
            return next(data_iterator)
        return self.deliver(data_iterator)

    def deliver(self, data_iterator: Iterator | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Read the next ``Batch`` on the data rank, relay it, and build this rank's outputs (see ``__call__``)."""
        if self._relay is None:
            self._relay = self._relay_of(_SENT)
        received = self._relay.relay(lambda: self._read(data_iterator))
        if received is None:
            raise StopIteration
        return self._build(received)

    def _read(self, data_iterator: Iterator | None) -> dict[str, torch.Tensor] | None:
        """On the data rank: the CP-local fields and the global boundaries of the next batch; None at the end."""
        if data_iterator is None or not isinstance(data_iterator, Iterator):
            raise DataConfigError(
                f"get_batch on a data rank (TP rank 0 of PP stage 0) needs the loader's iterator, got "
                f"{type(data_iterator).__name__}; call get_batch(iter(loader)) with one iterator kept across steps"
            )
        try:
            batch = next(data_iterator)
        except StopIteration:
            return None
        if not isinstance(batch, Batch):
            raise DataFileError(
                f"get_batch received a {type(batch).__name__} from the loader; it takes a Batch (the collators' "
                "output). Use build_online_text_collate_fn or build_indexed_collate_fn as the loader's collate_fn, "
                "or convert a megatron-style dict once with build_collate_fn.indexed_batch"
            )
        self._check_loss_tokens(batch)
        rows, row_length = batch.input_ids.shape
        size = _local_cp_size(batch)
        _, cp_size, cp_rank = self._cp_group(size)
        plan = self._plan(cp_size, cp_rank)
        self._metadata = self._prepared(batch, plan)
        if self._metadata is None:  # the boundaries were checked once, when the Batch was built
            self._metadata = delivery_metadata(
                plan, batch.cu_seq_lens, batch.cu_seq_lens_real, rows, row_length, batch=batch, device=self.device
            )
        local = self._cut(batch, self._metadata, cp_size)
        shape = torch.tensor([rows, row_length // cp_size], dtype=torch.int64)
        sent = {**local, "cu_seq_lens": batch.cu_seq_lens, "local_shape": shape}
        if batch.cu_seq_lens_real is not None:  # the real tokens of padded sequences (thd: cu_seqlens_q/kv)
            sent["cu_seq_lens_real"] = batch.cu_seq_lens_real
        if size is not None:
            sent["local_cp_size"] = torch.tensor([size], dtype=torch.int64)
        return sent

    def _cut(self, batch: Batch, metadata: DeliveryMetadata, cp_size: int) -> dict[str, torch.Tensor]:
        """The rank's ``input_ids`` and ``labels`` (one gather each) and its loss mask (the metadata's, cut from the
        batch's own, ``delivery_plan._loss_mask``): bool when the relay has receivers, else float32 as delivered."""
        ids, labels = batch.input_ids, batch.labels
        if cp_size > 1:
            columns = metadata.columns.to(ids.device)
            ids, labels = gather_columns(ids, columns), gather_columns(labels, columns)
        loss_mask = metadata.loss_mask
        if self.context.tp_size > 1 or self.context.pp_size > 1:
            loss_mask = loss_mask > 0  # a quarter of the bytes on the wire; every rank converts what it receives
        return {"input_ids": ids, "labels": labels, "loss_mask": loss_mask}

    def _plan(self, cp_size: int, cp_rank: int) -> DeliveryPlan:
        """This rank's plan for a micro-batch cut across ``cp_size`` ranks (the static one is kept)."""
        plan = self._plans.get((cp_size, cp_rank))
        if plan is None:  # built and validated once per runtime CP size
            plan = self._plans[cp_size, cp_rank] = replace(self.delivery_plan, cp_size=cp_size, cp_rank=cp_rank)
        return plan

    def _prepared(self, batch: Batch, plan: DeliveryPlan) -> DeliveryMetadata | None:
        """The metadata the collator computed for ``plan`` (moved to the device), or None when it computed none."""
        metadata = batch.delivery
        if metadata is None:
            return None
        if metadata.plan != plan:
            raise DataConfigError(
                f"the micro-batch's delivery metadata was computed for {metadata.plan}, but this rank delivers "
                f"{plan}; give the collator this stage's delivery_plan (ParallelBatch.delivery_plan), or none"
            )
        return metadata if self.device.type == "cpu" else metadata.to(self.device)

    def _check_loss_tokens(self, batch: Batch) -> None:
        """Under ``eod_mask_loss``, which masks the EOD inputs here, refuse a micro-batch left without a token that
        carries a loss (its mean loss would be NaN on every CP rank): the mask is taken over the whole batch before
        it is cut. Without it the loader's rule stands (a transform refuses a record without a loss token)."""
        if not self.eod_mask_loss or bool(((batch.labels >= 0) & (batch.input_ids != self.eod_token_id)).any()):
            return
        raise DataFileError(
            f"get_batch: no token of the micro-batch of {batch.input_ids.shape[0]} row(s) carries a loss (each has an "
            "IGNORE_INDEX label or an EOD input, masked by eod_mask_loss), so its loss would be NaN; remove the "
            "documents that hold only EOD tokens from the data, or set eod_mask_loss to false"
        )

    def _cp_group(self, local_cp_size: int | None) -> tuple[Any, int, int]:
        """``(group, size, rank)`` a micro-batch of ``local_cp_size`` (None: the static one) is cut across."""
        if local_cp_size is not None and self._group_of is not None:
            found = self._groups.get(local_cp_size)
            if found is None:  # a group's size and this rank's place in it do not change: asked once per size
                group = self._group_of(local_cp_size)
                found = self._groups[local_cp_size] = (group, *group_size_rank(group))
            group, size, rank = found
        else:
            group, size, rank = self.context.cp_group, self.context.cp_size, self.context.cp_rank
        if local_cp_size is not None and local_cp_size != size:
            raise DataConfigError(
                f"the micro-batch was packed for a CP size of {local_cp_size}, but its CP group holds {size} ranks; "
                "under dynamic CP pass dynamic_cp=True (the scheduler 'dynamic_cp'), otherwise the static CP group "
                "the scheduler packed for"
            )
        return group, size, rank

    def _tp_cp_group(self, size: int) -> Any:
        groups = self.pg_collection
        if groups is None or not self.layout.sequence_parallel:
            return None
        if self._group_of is not None:
            return dynamic_group_lookup(groups.dynamic_tp_cp, "dynamic_tp_cp")(size)
        return groups.tp_cp

    def _build(self, received: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Every rank: its stage's fields, with position ids and attention metadata rebuilt from the global
        boundaries; a field this PP stage does not own is None."""
        cu_seq_lens, local_cp_size = received["cu_seq_lens"], received.get("local_cp_size")
        group, cp_size, cp_rank = self._cp_group(None if local_cp_size is None else int(local_cp_size[0]))
        rows, local = received["local_shape"].tolist()
        row_length = local * cp_size
        metadata, self._metadata = self._metadata, None
        if metadata is None:  # a TP peer or a later PP stage: the same metadata from the same boundaries
            plan = self._plan(cp_size, cp_rank)
            metadata = delivery_metadata(plan, cu_seq_lens, received.get("cu_seq_lens_real"), rows, row_length,
                                         device=self.device)  # fmt: skip
        packed = metadata.packed_seq_params
        if packed is not None and self.pg_collection is not None:
            packed = replace(packed, cp_group=group, local_cp_size=cp_size, tp_cp_group=self._tp_cp_group(cp_size))
        flex = metadata.flex_tables
        model_inputs = {
            "input_ids": self._on_device(received.get("input_ids")),
            "labels": self._on_device(received.get("labels")),
            "position_ids": metadata.position_ids if "input_ids" in received else None,
            "attention_mask": metadata.attention_mask if flex is None else flex.block_mask(),
            "swa_mask": metadata.swa_mask,
            "packed_seq_params": packed,
        }
        mask = received.get("loss_mask")
        loss_inputs = {
            "labels": model_inputs["labels"],
            "loss_mask": None if mask is None else mask.to(self.device, torch.float32),
        }
        if logger.isEnabledFor(logging.DEBUG):
            self._log_shapes(model_inputs, row_length, cp_size, cp_rank)
        return model_inputs, loss_inputs

    def _on_device(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(self.device)

    def _log_shapes(self, model_inputs: dict[str, Any], row_length: int, cp_size: int, cp_rank: int) -> None:
        """Log the delivered shapes at the first batch and whenever they change, never per batch."""
        shapes = tuple((name, _shape_of(value)) for name, value in model_inputs.items())
        if shapes == self._shapes:
            return
        first, self._shapes = self._shapes is None, shapes
        logger.debug(
            "get_batch %s: %s; rows of %d tokens, %d columns on CP rank %d of %d (%s), TP rank %d of %d",
            "first batch" if first else "shapes changed",
            ", ".join(f"{name} {shape}" for name, shape in shapes),
            row_length,
            row_length // cp_size,
            cp_rank,
            cp_size,
            self.cp_layout,
            self.context.tp_rank,
            self.context.tp_size,
        )

    # -- one scheduled step ------------------------------------------------------------------------------------------

    def plan(self, lengths: np.ndarray) -> Schedule:
        """The schedule of a step's sequences from their lengths in global id order (the same on every rank)."""
        config, groups = self._require_scheduler(), self.pg_collection
        vpp_size = config.vpp_size or 1
        vpp_group = (config.microbatch_group_size_per_vp_stage or groups.pp_size) if vpp_size > 1 else 1
        return build_schedule(
            config,
            np.asarray(lengths, dtype=np.int64),
            layout=self.layout,
            dp_size=groups.dp_size,
            dynamic_cp_sizes=groups.dynamic_cp_sizes if config.scheduler == "dynamic_cp" else (),
            vpp_group=vpp_group,
        )

    def schedule(self, data_iterator: Iterator | None, num_microbatches: int) -> ScheduledStep:
        """Fetch, plan, pack and relay one step; every rank gets the same count and statistics.

        Args:
            data_iterator: on data ranks, the loader's iterator (``Batch`` es of the Online collator, alignment 1:
                the scheduler pads); the CP ranks of a DP replica must yield identical micro-batches. Ignored
                elsewhere.
            num_microbatches: how many micro-batches each data rank fetches (fewer when its data ends).

        Raises:
            StopIteration: every DP rank's iterator was exhausted before yielding anything, on every rank (the end
                of an evaluation).
            DataConfigError: ranks that disagree on ``num_microbatches`` or a scheduler field (the same message on
                every rank, naming the field and the values per rank), or a sequence no allowed CP size can hold.
            DataFileError: the step holds no sequence, or a micro-batch is malformed (a DP rank whose own micro-batch
                is malformed raises its own error, the others name it).
        """
        config = self._require_scheduler()
        num_microbatches = require_int("num_microbatches", num_microbatches, 1)
        packed: list[Batch] = []

        def produce() -> dict[str, torch.Tensor] | None:
            step = self._exchange(data_iterator, num_microbatches)
            if step is None:
                return None
            schedule = self.plan(step.lengths)
            packed.extend(pack_rank_groups(schedule, step, position=self._position, layout=self.layout,
                                           pad_token_id=config.pad_token_id,
                                           tail_padding=config.thd_tail_padding_policy))  # fmt: skip
            stats = schedule_stats(schedule, step.lengths, config, layout=self.layout)
            count = torch.tensor([schedule.num_micro_batches], dtype=torch.float64)
            return {"outcome": torch.cat([count, stats.as_tensor().to(torch.float64)])}

        if self._outcome_relay is None:
            self._outcome_relay = self._relay_of(_OUTCOME)
        outcome = self._outcome_relay.relay(produce, "schedule the step")
        if outcome is None:
            raise StopIteration
        values = outcome["outcome"].cpu()
        micro_batches = packed if self.context.is_data_rank else None
        return ScheduledStep(self, micro_batches, int(values[0]), FlopsStats.from_tensor(values[1:]))

    def _exchange(self, data_iterator: Iterator | None, count: int):
        try:
            fetched = fetch_sequences(data_iterator, count)
        except Exception as error:
            fetched = error
        group, size = self._domain()
        return exchange_sequences(
            fetched,
            config=self.scheduler,
            num_microbatches=count,
            domain_group=group,
            domain_size=size,
            dp_group=self.context.dp_group,
            dp_size=self.context.dp_size,
            position=self._position,
            cp_size=self.context.cp_size,
        )

    @property
    def _position(self) -> int:
        """This rank's place in the DP x CP domain: ``dp_rank * cp_size + cp_rank``."""
        return self.context.dp_rank * self.context.cp_size + self.context.cp_rank

    def _domain(self) -> tuple[Any, int]:
        """The DP x CP group of this rank's (TP, PP) coordinate, which the step header is gathered over."""
        size = self.context.dp_size * self.context.cp_size
        group = self.pg_collection.dp_cp
        if group is None and size > 1:
            raise DataConfigError(
                "the packing scheduler gathers over the DP x CP ranks, but the collection has no dp_cp group; build "
                "it with ProcessGroupCollection.from_mesh"
            )
        return group, size

    def _require_scheduler(self) -> PackingSchedulerConfig:
        if self.scheduler is None:
            raise DataConfigError(
                "this ParallelBatch has no scheduler, so it cannot plan a step; build it with "
                "scheduler=PackingSchedulerConfig(...) and pg_collection=..., or call get_batch(iterator)"
            )
        return self.scheduler


def dynamic_group_lookup(groups: Mapping[int, Any], name: str) -> Callable[[int], Any]:
    """Runtime CP size -> group from ``pg_collection.<name>``, refusing a size without a group (naming it)."""

    def lookup(size: int):
        if size not in groups:
            raise DataConfigError(
                f"the micro-batch uses a runtime CP size of {size}, but pg_collection.{name} has groups of sizes "
                f"{sorted(groups)} only; create that size's groups (from_mesh(mesh, dynamic_cp_sizes=...))"
            )
        return groups[size]

    return lookup
