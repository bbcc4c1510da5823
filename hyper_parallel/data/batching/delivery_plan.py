"""What one CP rank's delivery of a plain micro-batch derives from the batch's boundaries alone, computed once.

Owns: ``DeliveryPlan`` (the frozen settings of one rank's delivery that the boundaries' metadata depends on: the CP
size, rank and layout, the attention mode and its options, the position-id and EOD loss rules), ``DeliveryMetadata``
(what the plan gives for one batch: the rank's global columns, its position ids, the attention metadata, and on a
data rank its part of the loss mask), ``delivery_metadata``
(the one function that computes it, used by ``ParallelBatch`` and by the collators alike) and ``prepare_delivery``
(a ``Batch`` carrying its metadata, which a collator computes in the DataLoader worker so that the training process
only gathers). Not responsible for: the CP arithmetic (``parallel.batch_parallel.cp_local_columns``), the masks
(``batching.attention_runtime``), or cutting and relaying the tokens (``batching.get_batch``).

Example (the data rank's collator in a DataLoader worker, then the stage)::

    stage = ParallelBatch(parallel_context=context, attention_mode="packed", cp_layout="zigzag_thd")
    collate = build_online_text_collate_fn(layout=stage.layout, delivery_plan=stage.delivery_plan)
    model_inputs, loss_inputs = stage(iter(DataLoader(dataset, collate_fn=collate, num_workers=2)))
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from hyper_parallel.data.batching.attention_runtime import (
    FlexBlockTables,
    PackedSeqParams,
    dense_attention_mask,
    flex_block_tables,
    packed_seq_params,
)
from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.errors import DataConfigError, require_choice, require_flag, require_int
from hyper_parallel.data.indexed.ltor_fields import positions_within_sequences
from hyper_parallel.data.parallel.batch_parallel import cp_local_columns, gather_columns
from hyper_parallel.data.parallel.delivery_layout import CP_LAYOUTS

__all__ = ["PLAN_ATTENTION_MODES", "DeliveryMetadata", "DeliveryPlan", "delivery_metadata", "prepare_delivery"]

PLAN_ATTENTION_MODES = ("dense", "packed", "flex", "none")


@dataclass(frozen=True)
class DeliveryPlan:
    """The settings one CP rank's metadata depends on, validated when built; ``ParallelBatch.delivery_plan``.

    Attributes:
        cp_size, cp_rank: the CP size the batch is cut across and this rank.
        cp_layout: one of ``CP_LAYOUTS``.
        attention_mode: ``"dense"``, ``"packed"``, ``"flex"`` or ``"none"`` (as ``ParallelBatch``).
        causal, sliding_window: the masks' rule (dense and flex).
        reset_position_ids: position ids restart at every sequence (else the global columns).
        eod_mask_loss, eod_token_id: the loss mask is also 0 where the input is the EOD token.
        capacity: the fixed sequence count of the THD boundary tensors, or None.
    """

    cp_size: int = 1
    cp_rank: int = 0
    cp_layout: str = "contiguous"
    attention_mode: str = "dense"
    causal: bool = True
    sliding_window: int | None = None
    reset_position_ids: bool = False
    eod_mask_loss: bool = False
    eod_token_id: int | None = None
    capacity: int | None = None

    def __post_init__(self) -> None:
        require_int("DeliveryPlan.cp_size", self.cp_size, 1)
        if require_int("DeliveryPlan.cp_rank", self.cp_rank, 0) >= self.cp_size:
            raise DataConfigError(f"DeliveryPlan.cp_rank {self.cp_rank} must be below cp_size {self.cp_size}")
        require_choice("DeliveryPlan.cp_layout", self.cp_layout, CP_LAYOUTS, "how a row is cut across CP ranks")
        require_choice("DeliveryPlan.attention_mode", self.attention_mode, PLAN_ATTENTION_MODES, "the attention "
                       "metadata the model takes")  # fmt: skip
        require_flag("DeliveryPlan.causal", self.causal)
        require_flag("DeliveryPlan.reset_position_ids", self.reset_position_ids)
        if require_flag("DeliveryPlan.eod_mask_loss", self.eod_mask_loss) and self.eod_token_id is None:
            raise DataConfigError("DeliveryPlan.eod_mask_loss needs eod_token_id, the tokenizer's EOD id")
        if self.eod_token_id is not None:
            require_int("DeliveryPlan.eod_token_id", self.eod_token_id, 0)
        for name in ("sliding_window", "capacity"):
            if getattr(self, name) is not None:
                require_int(f"DeliveryPlan.{name}", getattr(self, name), 1)


@dataclass(frozen=True)
class DeliveryMetadata:
    """One rank's metadata of one batch, all of it a function of the plan and the batch's boundaries.

    Picklable (plain tensors), so a DataLoader worker can send it with the batch.

    Attributes:
        plan: the plan it was computed for.
        columns: int64 ``[R, s]``, the rank's global columns in local order (``cp_local_columns``).
        position_ids: int64 ``[R, s]``.
        attention_mask, swa_mask: bool ``[R, 1, s, T]`` (dense mode; ``swa_mask`` with a window), else None.
        packed_seq_params: ``PackedSeqParams`` without process groups (packed mode), else None.
        flex_tables: ``FlexBlockTables`` (flex mode), else None.
        loss_mask: float32 ``[R, s]``, the rank's part of the batch's loss mask (less the EOD inputs under
            ``eod_mask_loss``), when computed from the batch (on a data rank); else None.
    """

    plan: DeliveryPlan
    columns: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    swa_mask: torch.Tensor | None = None
    packed_seq_params: PackedSeqParams | None = None
    flex_tables: FlexBlockTables | None = None
    loss_mask: torch.Tensor | None = None

    def map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> DeliveryMetadata:
        """The metadata with ``function`` applied to every tensor (a device move, ``pin_memory``)."""
        moved = {
            name: None if (value := getattr(self, name)) is None else function(value)
            for name in ("columns", "position_ids", "attention_mask", "swa_mask", "loss_mask")
        }
        packed = self.packed_seq_params
        if packed is not None:
            packed = replace(packed, **{f.name: function(getattr(packed, f.name)) for f in fields(packed)
                                        if isinstance(getattr(packed, f.name), torch.Tensor)})  # fmt: skip
        flex = None if self.flex_tables is None else self.flex_tables.map(function)
        return DeliveryMetadata(self.plan, **moved, packed_seq_params=packed, flex_tables=flex)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> DeliveryMetadata:
        """The metadata on ``device``."""
        return self.map(lambda tensor: tensor.to(device, non_blocking=non_blocking))


def _positions(plan: DeliveryPlan, bounds: np.ndarray, columns: np.ndarray, row_length: int) -> np.ndarray:
    """int64 ``[R, s]``: the local tokens' global columns, or their distances from their sequences' starts."""
    if not plan.reset_position_ids:
        return np.ascontiguousarray(columns, dtype=np.int64)
    within = positions_within_sequences(bounds).reshape(len(columns), row_length)
    return np.take_along_axis(within, columns, axis=1)


def _loss_mask(plan: DeliveryPlan, batch: Batch, columns: torch.Tensor) -> torch.Tensor:
    """float32 ``[R, s]``: the batch's own loss mask (``labels != IGNORE_INDEX``) at the rank's columns, less the
    EOD inputs under ``eod_mask_loss``; one gather (two with the EOD rule)."""
    mask = batch.loss_mask if plan.cp_size == 1 else gather_columns(batch.loss_mask, columns)
    if not plan.eod_mask_loss:
        return mask
    ids = batch.input_ids if plan.cp_size == 1 else gather_columns(batch.input_ids, columns)
    return mask * (ids != plan.eod_token_id)


def delivery_metadata(
    plan: DeliveryPlan,
    cu_seq_lens: np.ndarray | torch.Tensor,
    cu_seq_lens_real: torch.Tensor | None,
    rows: int,
    row_length: int,
    *,
    batch: Batch | None = None,
    device: torch.device | str = "cpu",
) -> DeliveryMetadata:
    """The plan's metadata for a batch of ``rows`` rows of ``row_length`` with these boundaries.

    Args:
        plan: the rank's ``DeliveryPlan``.
        cu_seq_lens: the batch's global boundaries (``Batch.cu_seq_lens``).
        cu_seq_lens_real: the real token counts (``Batch.cu_seq_lens_real``) or None.
        rows, row_length: the batch's ``R`` and ``T``.
        batch: the batch itself, on a data rank: its loss mask is cut too (``DeliveryMetadata.loss_mask``).
        device: where the tensors are.

    Raises:
        DataFileError, DataConfigError: boundaries the layout or the attention mode cannot use (as
            ``cp_local_columns``, ``packed_seq_params`` and the masks).
    """
    bounds = cu_seq_lens.cpu().numpy() if isinstance(cu_seq_lens, torch.Tensor) else np.asarray(cu_seq_lens)
    columns = cp_local_columns(plan.cp_layout, bounds, rows, row_length, plan.cp_size, plan.cp_rank)
    local_columns = torch.from_numpy(columns)
    metadata = {
        "columns": local_columns.to(device),
        "position_ids": torch.from_numpy(_positions(plan, bounds, columns, row_length)).to(device),
    }
    if batch is not None:
        metadata["loss_mask"] = _loss_mask(plan, batch, local_columns.to(batch.input_ids.device))
    masks = {"causal": plan.causal, "sliding_window": plan.sliding_window, "device": device}
    if plan.attention_mode == "dense":
        metadata["attention_mask"], metadata["swa_mask"] = dense_attention_mask(bounds, columns, row_length, **masks)
    elif plan.attention_mode == "flex":
        metadata["flex_tables"] = flex_block_tables(bounds, columns, row_length, **masks)
    elif plan.attention_mode == "packed":
        metadata["packed_seq_params"] = packed_seq_params(
            bounds, cu_seq_lens_real=cu_seq_lens_real, cp_size=plan.cp_size, capacity=plan.capacity, device=device
        )
    return DeliveryMetadata(plan, **metadata)


def prepare_delivery(batch: Batch, plan: DeliveryPlan) -> Batch:
    """``batch`` carrying ``plan``'s metadata as ``batch.delivery`` (the collators call it in the workers).

    Raises:
        DataConfigError: ``plan`` is not a ``DeliveryPlan``; as ``delivery_metadata``.
    """
    if not isinstance(plan, DeliveryPlan):
        raise DataConfigError(
            f"delivery_plan must be a DeliveryPlan (ParallelBatch.delivery_plan), got {type(plan).__name__}"
        )
    rows, row_length = batch.input_ids.shape
    metadata = delivery_metadata(plan, batch.cu_seq_lens, batch.cu_seq_lens_real, rows, row_length, batch=batch)
    prepared = copy.copy(batch)
    object.__setattr__(prepared, "delivery", metadata)
    return prepared
