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
* ``cu_seq_lens``: int32 ``[K + 1]``, the boundaries of the K sequences over the rows flattened one after
  another: a leading 0, strictly increasing, ending at ``R * T``; every row end is a boundary, so no sequence
  crosses rows. Padding is part of a sequence too (the Online tail padding is a sequence of its own).
* ``position_ids`` (int64 ``[R, T]``) and ``attention_mask`` (bool ``[R, 1, T, T]``, megatron-core's polarity:
  True = masked out, the query may not see that key): present only when asked for, None otherwise.
* ``extras``: any other per-sample field of the dataset, stacked with the rows as its first dimension
  (``dataset_id`` of blends, int64 ``[R]``).

A ``Batch`` is also a read-only mapping over the fields that are present (then the extras), so
``batch["input_ids"]``, ``"position_ids" in batch`` and ``dict(batch)`` work, and ``batch["tokens"]`` is an alias of
``input_ids`` for readers written for megatron-core's samples. New code reads the attributes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError

__all__ = ["Batch"]

_TENSOR_FIELDS = ("input_ids", "labels", "loss_mask", "cu_seq_lens", "position_ids", "attention_mask")
_ALIASES = {"tokens": "input_ids"}
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
        cu_seq_lens: int32 ``[K + 1]`` sequence boundaries over the flattened rows.
        position_ids: int64 ``[R, T]`` or None.
        attention_mask: bool ``[R, 1, T, T]`` (True = masked out) or None.
        extras: other per-sample fields, each a tensor whose first dimension is R.
        loss_mask: float32 ``[R, T]``, ``labels != IGNORE_INDEX``; computed, not passed.

    Raises:
        DataConfigError: a field is not a tensor, or an extra's name is a field name.
        DataFileError: a shape, dtype or ``cu_seq_lens`` value breaks the contract (the message names the field,
            what it holds and what it must hold).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seq_lens: torch.Tensor
    position_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    loss_mask: torch.Tensor = field(init=False)

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
        return moved

    # -- the read-only mapping view -----------------------------------------------------------------------------

    def __getitem__(self, key: str) -> torch.Tensor:
        name = _ALIASES.get(key, key)
        value = getattr(self, name, None) if name in _TENSOR_FIELDS else self.extras.get(name)
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
    if batch.attention_mask is not None:
        mask = _tensor("attention_mask", batch.attention_mask, torch.bool, 4)
        if tuple(mask.shape) != (rows, 1, width, width):
            raise DataFileError(
                f"Batch.attention_mask has shape {list(mask.shape)}; for input_ids of shape {list(ids.shape)} it must "
                f"be {[rows, 1, width, width]} (one [T, T] mask per row, True = masked out); {_FIX}"
            )
    for name, value in batch.extras.items():
        if not isinstance(name, str) or name in _TENSOR_FIELDS or name in _ALIASES or name == "extras":
            raise DataConfigError(
                f"Batch extra {name!r} is not a valid name: extras must be strings other than the contract's fields "
                f"{[*_TENSOR_FIELDS, *_ALIASES]}; rename the dataset's field"
            )
        if not isinstance(value, torch.Tensor) or value.ndim == 0 or value.shape[0] != rows:
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise DataFileError(
                f"Batch extra {name!r} is {shape}; an extra must be a tensor with one entry per row ({rows}); give it "
                "one numeric value or array per sample"
            )
    _check_boundaries(_tensor("cu_seq_lens", batch.cu_seq_lens, torch.int32, 1), rows, width)


def _check_boundaries(bounds: torch.Tensor, rows: int, width: int) -> None:
    """``bounds`` starts at 0, strictly increases, ends at ``rows * width`` and holds every row end."""
    values = bounds.detach().cpu().numpy()  # no copy on CPU, where collators build batches
    total = rows * width
    problem = ""
    if len(values) < 2 or values[0] != 0 or values[-1] != total:
        problem = f"it must start at 0 and end at the batch's {total} positions"
    elif (steps := np.diff(values) <= 0).any():
        at = int(np.argmax(steps)) + 1
        problem = f"it must strictly increase, but entry {at} is {values[at]} after {values[at - 1]}"
    elif rows > 1 and len(missing := _absent(np.arange(width, total, width), values)):
        problem = f"every row end must be a boundary (no sequence crosses rows), but {missing[0]} is not"
    if problem:
        shown = values.tolist() if len(values) <= 12 else [*values[:6].tolist(), "...", *values[-5:].tolist()]
        raise DataFileError(
            f"Batch.cu_seq_lens {shown} is not a list of sequence boundaries for {rows} rows of {width}: {problem}; "
            f"{_FIX}"
        )


def _absent(wanted: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The entries of ``wanted`` missing from the sorted ``values`` (a binary search each)."""
    found = values[np.minimum(np.searchsorted(values, wanted), len(values) - 1)]
    return wanted[found != wanted]
