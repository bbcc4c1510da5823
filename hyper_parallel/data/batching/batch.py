"""The batch contract: what every collator returns, on the Online (packed) and Indexed (stacked) paths alike.

Owns: the fields of a collated batch, their dtypes, shapes and conventions, the checks of those invariants, and the
helpers consumers read batches through (counts, per-sequence views, device moves). Not responsible for: building
batches (the collators in ``build_collate_fn``), deciding where sequences end (``indexed.ltor_fields``), or
splitting a batch across context/tensor-parallel ranks.

Conventions (the package README's "batch contract" section has the worked example):

* ``input_ids`` and ``labels``: int64 ``[R, T]``: one packed row (``R = 1``) on the Online path, ``R =
  micro_batch_size`` rows of ``seq_length`` on the Indexed path. Labels are already shifted: ``labels[r, t]`` is
  the target of ``input_ids[r, t]``, and ``IGNORE_INDEX`` (-100) wherever no loss is taken (prompts, padding,
  EOD inputs under ``eod_mask_loss``).
* ``loss_mask``: float32 ``[R, T]``, 1.0 where a loss is taken, 0.0 elsewhere; always ``labels != IGNORE_INDEX``,
  because it is computed from the labels here.
* ``cu_seq_lens``: int32 ``[K + 1]``, the physical boundaries of the K sequences over the rows flattened one after
  another: a leading 0, strictly increasing, ending at ``R * T``; every row end is a boundary, so no sequence
  crosses rows. Padding is part of a sequence too (a sequence's own padding at its end; the Online tail padding
  is a dummy sequence of its own, or the end of the last sequence).
* ``cu_seq_lens_real``: int32 ``[K + 1]``, the cumulative real token counts of the same K sequences (Transformer
  Engine's ``cu_seqlens`` beside ``cu_seq_lens`` as its ``cu_seqlens_padded``): sequence ``k`` holds
  ``cu_seq_lens_real[k + 1] - cu_seq_lens_real[k]`` real tokens, at least one and at most its padded length, at
  the start of its span. None when the collator pads no sequence (the real boundaries are then ``cu_seq_lens``).
  A dummy tail sequence counts its padding as its real tokens (it carries no loss and attends only itself).
* ``position_ids`` (int64 ``[R, T]``) and ``megatron_attention_mask`` (bool ``[R, 1, T, T]``, megatron-core's
  polarity: True = masked out, the query may not see that key): present only when asked for, None otherwise. The
  name ``attention_mask`` is kept for the opposite polarity, the ``model_inputs`` mask ``ParallelBatch``
  delivers (True = may attend).
* ``extras``: any other per-sample field of the dataset, stacked with the rows as its first dimension
  (``dataset_id`` of blends, int64 ``[R]``).
* ``delivery``: the ``batching.delivery_plan.DeliveryMetadata`` of one CP rank, when a collator given a
  ``delivery_plan`` computed it in the worker (``prepare_delivery``); None otherwise. Not a field of the mapping.

A ``Batch`` is also a read-only mapping over the fields that are present (then the extras), so
``batch["input_ids"]``, ``"position_ids" in batch`` and ``dict(batch)`` work. It has no megatron-core key names
(``tokens``, ``attention_mask``): a megatron-style dict is converted once, by ``build_collate_fn.indexed_batch``.
New code reads the attributes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hyper_parallel.data.batching.sequence_boundaries import real_boundaries
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.parallel.delivery_layout import check_cu_seq_lens

__all__ = ["Batch"]

_TENSOR_FIELDS = (
    "input_ids",
    "labels",
    "loss_mask",
    "cu_seq_lens",
    "cu_seq_lens_real",
    "position_ids",
    "megatron_attention_mask",
)
_MEGATRON_KEYS = ("tokens", "attention_mask")  # converted by indexed_batch; never a field or an extra here
_FIX = "build batches with TextPackingCollator or build_indexed_collate_fn, which follow the contract"


@dataclass(frozen=True, eq=False, repr=False)
class Batch(Mapping):
    """One collated micro-batch; see the module docstring for each field's convention.

    Picklable (DataLoader workers send it to the main process) and understood by ``DataLoader(pin_memory=True)``,
    which calls ``pin_memory()``. Construction checks shapes, dtypes and ``cu_seq_lens`` in O(R + K), never the
    token values.

    Attributes:
        input_ids: int64 ``[R, T]`` token ids.
        labels: int64 ``[R, T]`` targets, ``IGNORE_INDEX`` where no loss is taken.
        cu_seq_lens: int32 ``[K + 1]`` sequence boundaries over the flattened rows, padding included.
        position_ids: int64 ``[R, T]`` or None.
        megatron_attention_mask: bool ``[R, 1, T, T]`` (True = masked out) or None.
        cu_seq_lens_real: int32 ``[K + 1]`` cumulative real token counts of the same sequences, or None.
        extras: other per-sample fields, each a tensor whose first dimension is R.
        loss_mask: float32 ``[R, T]``, ``labels != IGNORE_INDEX``; computed, not passed.
        delivery: one CP rank's precomputed ``DeliveryMetadata`` (set by ``prepare_delivery``), or None.

    Raises:
        DataConfigError: a field is not a tensor, or an extra's name is a field name.
        DataFileError: a shape, dtype or ``cu_seq_lens`` value breaks the contract (the message names the field,
            what it holds and what it must hold).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seq_lens: torch.Tensor
    position_ids: torch.Tensor | None = None
    megatron_attention_mask: torch.Tensor | None = None
    cu_seq_lens_real: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    loss_mask: torch.Tensor = field(init=False)
    delivery: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "extras", dict(self.extras))
        _check(self)
        object.__setattr__(self, "loss_mask", (self.labels != IGNORE_INDEX).to(torch.float32))

    # -- what consumers read ------------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Positions in the batch, padding included (``R * T``)."""
        return self.input_ids.numel()

    @property
    def num_sequences(self) -> int:
        """Sequences in ``cu_seq_lens``, the Online padding sequence included."""
        return self.cu_seq_lens.numel() - 1

    @property
    def trained_tokens(self) -> int:
        """Positions that carry a loss (``loss_mask`` 1)."""
        return int(torch.count_nonzero(self.loss_mask))

    def sequences(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(input_ids, labels)`` of each sequence, as 1-D views of the flattened rows, in ``cu_seq_lens`` order."""
        ids, labels = self.input_ids.reshape(-1), self.labels.reshape(-1)
        bounds = self.cu_seq_lens.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            yield ids[start:end], labels[start:end]

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """The batch with every tensor on ``device`` (not checked again: moving changes no value)."""
        return self._map(lambda tensor: tensor.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """The batch with every tensor in pinned memory (what ``DataLoader(pin_memory=True)`` calls)."""
        return self._map(torch.Tensor.pin_memory)

    def _map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        moved = copy.copy(self)
        for name in _TENSOR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(moved, name, function(value))
        object.__setattr__(moved, "extras", {name: function(value) for name, value in self.extras.items()})
        if self.delivery is not None:
            object.__setattr__(moved, "delivery", self.delivery.map(function))
        return moved

    # -- the read-only mapping view -----------------------------------------------------------------------------

    def __getitem__(self, key: str) -> torch.Tensor:
        value = getattr(self, key, None) if key in _TENSOR_FIELDS else self.extras.get(key)
        if value is None:
            raise KeyError(f"{key!r}: the batch has no such field; it holds {list(self)}")
        return value

    def __iter__(self) -> Iterator[str]:
        yield from (name for name in _TENSOR_FIELDS if getattr(self, name) is not None)
        yield from self.extras

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __eq__(self, other: object) -> bool:
        """Same fields holding equal tensors (same shapes and values)."""
        if not isinstance(other, Batch):
            return NotImplemented
        return list(self) == list(other) and all(torch.equal(self[key], other[key]) for key in self)

    __hash__ = None  # tensors are mutable

    def __repr__(self) -> str:
        fields = ", ".join(f"{key}={_describe(self[key])}" for key in self)
        return f"{type(self).__name__}({fields})"


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def _tensor(name: str, value: object, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """``value`` when it is a tensor of ``dtype`` and ``ndim`` dimensions; else the error naming the field."""
    if not isinstance(value, torch.Tensor):
        raise DataConfigError(f"Batch.{name} must be a torch.Tensor, got {type(value).__name__}; {_FIX}")
    if value.dtype != dtype or value.ndim != ndim:
        raise DataFileError(
            f"Batch.{name} must be a {ndim}-D {str(dtype).removeprefix('torch.')} tensor, got {_describe(value)}; "
            f"{_FIX}"
        )
    return value


def _check(batch: Batch) -> None:
    ids = _tensor("input_ids", batch.input_ids, torch.int64, 2)
    rows, width = ids.shape
    for name, value in (("labels", batch.labels), ("position_ids", batch.position_ids)):
        if value is not None and _tensor(name, value, torch.int64, 2).shape != ids.shape:
            raise DataFileError(
                f"Batch.{name} has shape {list(value.shape)} but input_ids has {list(ids.shape)}; they must match "
                f"(one entry per position); {_FIX}"
            )
    if batch.megatron_attention_mask is not None:
        mask = _tensor("megatron_attention_mask", batch.megatron_attention_mask, torch.bool, 4)
        if tuple(mask.shape) != (rows, 1, width, width):
            raise DataFileError(
                f"Batch.megatron_attention_mask has shape {list(mask.shape)}; for input_ids of shape "
                f"{list(ids.shape)} it must be {[rows, 1, width, width]} (one [T, T] mask per row, True = masked "
                f"out); {_FIX}"
            )
    for name, value in batch.extras.items():
        if not isinstance(name, str) or name in _TENSOR_FIELDS or name in _MEGATRON_KEYS or name == "extras":
            raise DataConfigError(
                f"Batch extra {name!r} is not a valid name: extras must be strings other than the contract's fields "
                f"{list(_TENSOR_FIELDS)} and megatron-core's names {list(_MEGATRON_KEYS)} (indexed_batch converts "
                "those); rename the dataset's field"
            )
        if not isinstance(value, torch.Tensor) or value.ndim == 0 or value.shape[0] != rows:
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise DataFileError(
                f"Batch extra {name!r} is {shape}; an extra must be a tensor with one entry per row ({rows}); give it "
                "one numeric value or array per sample"
            )
    bounds = check_cu_seq_lens(
        _tensor("cu_seq_lens", batch.cu_seq_lens, torch.int32, 1), rows * width, "Batch.cu_seq_lens", row_length=width
    )
    if batch.cu_seq_lens_real is not None:
        real_boundaries(_tensor("cu_seq_lens_real", batch.cu_seq_lens_real, torch.int32, 1), bounds, "Batch")
