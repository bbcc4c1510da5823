"""Context- and tensor-parallel delivery of batches: which columns each CP rank holds, and the TP broadcast.

Owns: the three CP layouts (``cp_local_columns``: which global columns of every row a CP rank holds, as pure numpy
arithmetic), ``CPBatchSharder`` (gathers a batch's ``[R, T, ...]`` fields at those columns) and
``TPBatchBroadcaster`` (sends a data rank's tensors to the other ranks of its TP group: a fixed-size header, then
the tensors; the end of data and a reader's failure reach every rank too). Not responsible for: where sequences
end (``batching.sequence_boundaries`` gives ``cu_seq_lens``), padding rows or sequences to the layout's multiple
(the collators), or position ids, loss masks and attention metadata (``batching``).

Vocabulary: a row holds ``T`` columns; ``cu_seq_lens`` (int32, leading 0, ending at ``R * T``) gives the sequence
boundaries over the ``R`` rows flattened one after another, every row end being a boundary. A CP rank holds
``T // cp`` columns of every row, in local order; ``local_columns`` are their global columns (0..T-1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from hyper_parallel.data.errors import DataConfigError, DataFileError, require_int

__all__ = [
    "BROADCAST_DTYPES",
    "BROADCAST_FIELDS",
    "CP_LAYOUTS",
    "CPBatchSharder",
    "MAX_BROADCAST_DIMS",
    "TPBatchBroadcaster",
    "broadcast_bytes",
    "cp_local_columns",
    "header_bytes",
]

CP_LAYOUTS = ("contiguous", "zigzag", "zigzag_thd")

# -- CP layouts ---------------------------------------------------------------------------------------------------


def _layout_divisor(layout: str, cp_size: int) -> int:
    if layout not in CP_LAYOUTS:
        raise DataConfigError(f"unknown cp_layout {layout!r}; choose one of {list(CP_LAYOUTS)}")
    return cp_size if layout == "contiguous" else 2 * cp_size


def _row_divides(layout: str, row_length: int, cp_size: int, divisor: int) -> None:
    if row_length % divisor == 0:
        return
    parts = f"cp_size={cp_size} equal parts" if layout == "contiguous" else f"2*cp_size={divisor} equal chunks"
    other = "" if layout == "contiguous" else ", or use the contiguous layout (rows a multiple of cp_size)"
    raise DataConfigError(
        f"the {layout} CP layout cuts every row into {parts}, but the row length {row_length} is not a multiple "
        f"of {divisor}; align the rows to a multiple of {divisor} (the collator's alignment: "
        f"build_online_text_collate_fn(cp_size=...), or a seq_length that {divisor} divides){other}"
    )


def _sequence_bounds(cu_seq_lens, rows: int, row_length: int) -> np.ndarray:
    """``cu_seq_lens`` as int64 numpy, checked for what the per-sequence layout relies on."""
    if cu_seq_lens is None:
        raise DataConfigError("the zigzag_thd CP layout cuts every sequence, so it needs cu_seq_lens; got None")
    if isinstance(cu_seq_lens, torch.Tensor):
        cu_seq_lens = cu_seq_lens.detach().cpu().numpy()
    bounds = np.asarray(cu_seq_lens, dtype=np.int64)
    total = rows * row_length
    problem = None
    if bounds.ndim != 1 or bounds.size < 2 or bounds[0] != 0 or bounds[-1] != total:
        problem = f"must be 1-D, start at 0 and end at rows * row_length = {total}"
    elif (np.diff(bounds) <= 0).any():
        problem = "must be strictly increasing"
    elif not np.isin(np.arange(1, rows) * row_length, bounds).all():
        problem = f"must hold every row end (multiples of {row_length}), so that no sequence crosses rows"
    if problem:
        values = bounds.ravel().tolist()
        shown = str(values) if len(values) <= 12 else f"[{str(values[:5])[1:-1]}, ..., {str(values[-5:])[1:-1]}]"
        raise DataFileError(f"cu_seq_lens {shown} {problem} (the batch contract of batching/batch.py)")
    return bounds


def _zigzag_thd_columns(bounds: np.ndarray, rows: int, row_length: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Every sequence in ``2·cp`` chunks; this rank's chunks ``cp_rank`` and ``2·cp-1-cp_rank`` of each, in order.

    Vectorised over the local tokens: each gets its sequence (``np.repeat``) and its offset among the sequence's
    local tokens, then its global position.
    """
    lengths = np.diff(bounds)
    chunks = 2 * cp_size
    bad = np.flatnonzero(lengths % chunks)
    if bad.size:
        k = int(bad[0])
        start, end = int(bounds[k]), int(bounds[k + 1])
        raise DataConfigError(
            f"the zigzag_thd CP layout cuts every sequence into 2*cp_size={chunks} equal chunks, but sequence {k} "
            f"(row {start // row_length}, columns [{start % row_length}, {start % row_length + end - start})) has "
            f"length {end - start}, not a multiple of {chunks} ({bad.size} of the {lengths.size} sequences do not "
            f"divide); pad each sequence to a multiple of {chunks} in the collator (pad_each_sequence_to={chunks}, "
            "which build_dataloaders sets for zigzag_thd), or use the zigzag or contiguous layout"
        )
    chunk = lengths // chunks
    local = 2 * chunk  # local tokens of each sequence
    owner = np.repeat(np.arange(lengths.size), local)
    offset = np.arange(owner.size) - np.repeat(np.cumsum(local) - local, local)
    size = chunk[owner]
    first = offset < size
    within = np.where(first, cp_rank * size + offset, (chunks - 1 - cp_rank) * size + offset - size)
    flat = bounds[:-1][owner] + within  # positions over the flattened rows; sequences never cross rows
    return (flat % row_length).reshape(rows, row_length // cp_size)


def cp_local_columns(
    layout: str, cu_seq_lens: np.ndarray | torch.Tensor | None, rows: int, row_length: int, cp_size: int, cp_rank: int
) -> np.ndarray:
    """The global columns CP rank ``cp_rank`` holds of every row, in local order: int64 ``[rows, T // cp]``.

    Layouts (``T = row_length``, ``s = T / cp``):

    * ``contiguous``: rank r holds columns ``[r·s, (r+1)·s)``. T = 8, cp = 2: rank 0 ``[0, 1, 2, 3]``, rank 1
      ``[4, 5, 6, 7]``. Needs ``T % cp == 0``.
    * ``zigzag``: the row in ``2·cp`` chunks of ``T / 2cp``; rank r holds chunk r then chunk ``2cp-1-r``, so every
      rank does the same causal-attention work. T = 8, cp = 2: rank 0 ``[0, 1, 6, 7]``, rank 1 ``[2, 3, 4, 5]``.
      Needs ``T % 2cp == 0``.
    * ``zigzag_thd``: every sequence (from ``cu_seq_lens``) in ``2·cp`` chunks; rank r holds, sequence after
      sequence, its chunk r then its chunk ``2cp-1-r`` (Megatron-Core's and Transformer Engine's THD layout). T =
      12, sequences ``[0, 8)`` and ``[8, 12)``, cp = 2: rank 0 ``[0, 1, 6, 7, 8, 11]``, rank 1 ``[2, 3, 4, 5, 9,
      10]``. Needs every sequence length to be a multiple of ``2·cp``.

    With ``cp_size`` 1 every layout holds the whole row, ``[0, T)``, and nothing needs to divide.

    Args:
        layout: one of ``CP_LAYOUTS``.
        cu_seq_lens: the batch's sequence boundaries over the flattened rows; read by ``zigzag_thd`` only.
        rows, row_length: the batch's ``R`` and ``T``.
        cp_size, cp_rank: the context-parallel size and this rank.

    Raises:
        DataConfigError: an unknown layout, a rank not below the size, or a length the layout cannot cut (naming
            the layout, the length and the fix).
        DataFileError: ``zigzag_thd`` got ``cu_seq_lens`` that break the batch contract.
    """
    divisor = _layout_divisor(layout, cp_size)
    rows = require_int("rows", rows, 1)
    row_length = require_int("row_length", row_length, 1)
    cp_size = require_int("cp_size", cp_size, 1)
    cp_rank = require_int("cp_rank", cp_rank, 0)
    if cp_rank >= cp_size:
        raise DataConfigError(f"cp_rank {cp_rank} must be below cp_size {cp_size}")
    if cp_size == 1:
        return np.tile(np.arange(row_length, dtype=np.int64), (rows, 1))
    if layout == "zigzag_thd":
        return _zigzag_thd_columns(_sequence_bounds(cu_seq_lens, rows, row_length), rows, row_length, cp_size, cp_rank)
    _row_divides(layout, row_length, cp_size, divisor)
    if layout == "contiguous":
        size = row_length // cp_size
        columns = np.arange(cp_rank * size, (cp_rank + 1) * size, dtype=np.int64)
    else:
        size = row_length // divisor
        first, second = cp_rank * size, (divisor - 1 - cp_rank) * size
        columns = np.concatenate([np.arange(first, first + size), np.arange(second, second + size)]).astype(np.int64)
    return np.tile(columns, (rows, 1))


class CPBatchSharder:
    """Cuts a batch's ``[R, T, ...]`` fields down to one CP rank's columns, ``[R, T // cp, ...]``.

    Args:
        cp_size: the context-parallel size.
        cp_rank: this rank.
        layout: one of ``CP_LAYOUTS`` (see ``cp_local_columns``).
    """

    def __init__(self, cp_size: int, cp_rank: int, layout: str = "contiguous") -> None:
        _layout_divisor(layout, 1)
        self.cp_size = require_int("cp_size", cp_size, 1)
        self.cp_rank = require_int("cp_rank", cp_rank, 0)
        if self.cp_rank >= self.cp_size:
            raise DataConfigError(f"cp_rank {cp_rank} must be below cp_size {cp_size}")
        self.layout = layout

    def shard(
        self, fields: Mapping[str, torch.Tensor], cu_seq_lens: np.ndarray | torch.Tensor | None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """This rank's part of every field, and the global columns it holds.

        Args:
            fields: tensors that all start with the same ``[R, T]`` (e.g. ``input_ids``, ``labels``, ``loss_mask``).
            cu_seq_lens: the global sequence boundaries over the flattened rows (read by ``zigzag_thd``).

        Returns:
            ``(local fields, local_columns)``: each field gathered at the columns, ``[R, T // cp, ...]``, and the
            columns as an int64 tensor ``[R, T // cp]`` on the first field's device. With ``cp_size`` 1 the fields
            are returned as they are.

        Raises:
            DataConfigError: no fields, or fields whose first two dimensions differ (naming them).
        """
        rows, row_length, device = self._grid(fields)
        columns = cp_local_columns(self.layout, cu_seq_lens, rows, row_length, self.cp_size, self.cp_rank)
        local_columns = torch.from_numpy(columns).to(device)
        if self.cp_size == 1:
            return dict(fields), local_columns
        row_index = torch.arange(rows, device=device)[:, None]
        local = {name: tensor[row_index, local_columns] for name, tensor in fields.items()}
        return local, local_columns

    @staticmethod
    def _grid(fields: Mapping[str, torch.Tensor]) -> tuple[int, int, torch.device]:
        if not fields:
            raise DataConfigError("CPBatchSharder.shard got no fields; pass at least input_ids")
        name, first = next(iter(fields.items()))
        for other, tensor in fields.items():
            if tensor.dim() < 2 or tensor.shape[:2] != first.shape[:2]:
                raise DataConfigError(
                    f"every field to shard must start with the same [rows, row_length]; {name} has shape "
                    f"{list(first.shape)} but {other} has {list(tensor.shape)}"
                )
            if tensor.device != first.device:
                raise DataConfigError(
                    f"every field to shard must be on one device; {name} is on {first.device} but {other} on "
                    f"{tensor.device}"
                )
        return int(first.shape[0]), int(first.shape[1]), first.device


# -- TP broadcast -------------------------------------------------------------------------------------------------

# The fields a broadcast may carry, in the order they are sent: every rank of a TP group must use the same list.
BROADCAST_FIELDS = (
    "input_ids",
    "labels",
    "loss_mask",
    "position_ids",
    "local_columns",
    "cu_seq_lens",
    "attention_mask",
    "dataset_id",
)
BROADCAST_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
MAX_BROADCAST_DIMS = 4

_BATCH, _END, _FAILED = 0, 1, 2  # header[0]
_SLOT = 2 + MAX_BROADCAST_DIMS  # per field: dtype code + 1 (0 = absent), ndim, the dimensions


def _header_length(field_names: Sequence[str]) -> int:
    return 2 + len(field_names) * _SLOT  # status, failure message length, the slots


def header_bytes(field_names: Sequence[str] = BROADCAST_FIELDS) -> int:
    """Bytes of the fixed-size header every broadcast sends first (int64 words)."""
    return 8 * _header_length(field_names)


def broadcast_bytes(fields: Mapping[str, torch.Tensor] | None, field_names: Sequence[str] = BROADCAST_FIELDS) -> int:
    """Bytes one ``TPBatchBroadcaster.broadcast`` of ``fields`` sends: the header plus every tensor's bytes."""
    payload = sum(tensor.numel() * tensor.element_size() for tensor in (fields or {}).values())
    return header_bytes(field_names) + payload


class TPBatchBroadcaster:
    """Sends TP rank 0's batch to the other ranks of its TP group, which allocate it from a header.

    Each call sends a fixed-size int64 header (a status, then per registered field: its dtype code, its number of
    dimensions, its shape), then each present non-empty tensor, in registry order, as its bytes. The header's
    status says whether a batch follows, the data ended (every rank returns None for the same call), or the reader
    failed (every rank raises its message).

    Args:
        tp_group: the TP process group; None, or a group of one rank, sends nothing.
        src: the global rank of TP rank 0 (``DataLoaderParallelContext.tp_src``), the one that reads.
        device: where receivers allocate, and where every rank's returned tensors live (NCCL needs CUDA).
        field_names: the registry of field names that may be sent, the same on every rank.

    Attributes:
        last_broadcast_bytes: bytes the last call passed to the collectives, the same on every rank (0 without a
            TP group); ``broadcast_bytes(fields)`` computes it ahead.
    """

    def __init__(self, tp_group, src: int, device="cpu", field_names: Sequence[str] = BROADCAST_FIELDS) -> None:
        import torch.distributed as dist

        self.src = require_int("src", src, 0)
        self.device = torch.device(device)
        self.field_names = tuple(field_names)
        if len(set(self.field_names)) != len(self.field_names):
            raise DataConfigError(f"the TP broadcast field registry {list(self.field_names)} names a field twice")
        self.group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        self.is_src = self.group is None or dist.get_rank() == self.src
        if self.group is not None and self.src not in dist.get_process_group_ranks(self.group):
            raise DataConfigError(
                f"the TP broadcast source, global rank {self.src}, is not in the TP group "
                f"{dist.get_process_group_ranks(self.group)}; pass DataLoaderParallelContext.tp_src"
            )
        self.last_broadcast_bytes = 0

    def broadcast(self, fields: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """On the source, send ``fields`` (None at the end of data); everywhere, return the same fields, or None.

        Returns:
            The fields in registry order, on ``device``, on every rank of the group; None on every rank when the
            source passed None. Without a TP group, ``fields`` as given.

        Raises:
            DataConfigError: on the source, a field name outside the registry, a dtype outside
                ``BROADCAST_DTYPES`` or more than ``MAX_BROADCAST_DIMS`` dimensions (the receivers raise a
                ``DataFileError`` carrying the same message).
            DataFileError: on a receiver, the source reported a failure (``broadcast_failure`` or a refused batch).
        """
        if self.group is None:
            self.last_broadcast_bytes = 0
            return None if fields is None else dict(fields)
        self.last_broadcast_bytes = 0
        if self.is_src:
            return self._send(fields)
        return self._receive()

    def broadcast_failure(self, what: str, error: BaseException) -> None:
        """On the source, after its reader failed: make every receiver raise this failure instead of waiting.

        The receivers' pending (or next) ``broadcast`` raises ``DataFileError("global rank <src> (TP rank 0)
        failed to <what> (<error type>: <error>); see rank <src>'s log")``. The source re-raises its own error.
        """
        if self.group is None:
            return
        if not self.is_src:
            raise DataConfigError(
                f"broadcast_failure is for the TP source (global rank {self.src}), which reads; the other TP ranks "
                "learn of its failure from their broadcast"
            )
        message = f"global rank {self.src} (TP rank 0) failed to {what} ({type(error).__name__}: {error}); see rank "
        message += f"{self.src}'s log"
        text = torch.frombuffer(bytearray(message.encode("utf-8")), dtype=torch.uint8).to(self.device)
        header = torch.zeros(_header_length(self.field_names), dtype=torch.int64)
        header[0], header[1] = _FAILED, text.numel()
        self._bcast(header.to(self.device))
        self._bcast(text)

    # -- the source ----------------------------------------------------------------------------------------------

    def _send(self, fields: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        header = torch.zeros(_header_length(self.field_names), dtype=torch.int64)
        if fields is None:
            header[0] = _END
            self._bcast(header.to(self.device))
            return None
        try:
            ordered = self._encode(fields, header)
        except DataConfigError as error:
            self.broadcast_failure("send a batch", error)
            raise
        self._bcast(header.to(self.device))
        for tensor in ordered.values():
            if tensor.numel():
                self._bcast(tensor.reshape(-1).view(torch.uint8))
        return ordered

    def _encode(self, fields: Mapping[str, torch.Tensor], header: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fill the header's slots; return the fields in registry order, contiguous on the device."""
        unknown = [name for name in fields if name not in self.field_names]
        if unknown:
            raise DataConfigError(
                f"the field {unknown[0]!r} is not in the TP broadcast registry {list(self.field_names)}; send only "
                "registered fields, or give every rank's TPBatchBroadcaster the same field_names including it"
            )
        ordered = {}
        for slot, name in enumerate(self.field_names):
            if name not in fields:
                continue
            tensor = fields[name]
            if not isinstance(tensor, torch.Tensor):
                raise DataConfigError(f"the TP broadcast field {name!r} must be a tensor, got {type(tensor).__name__}")
            if tensor.dtype not in BROADCAST_DTYPES:
                raise DataConfigError(
                    f"the TP broadcast field {name!r} has dtype {tensor.dtype}, which the broadcast does not carry; "
                    f"convert it to one of {[str(d).removeprefix('torch.') for d in BROADCAST_DTYPES]}"
                )
            if tensor.dim() > MAX_BROADCAST_DIMS:
                raise DataConfigError(
                    f"the TP broadcast field {name!r} has shape {list(tensor.shape)}: more than "
                    f"{MAX_BROADCAST_DIMS} dimensions; reshape it before sending"
                )
            base = 2 + slot * _SLOT
            header[base] = BROADCAST_DTYPES.index(tensor.dtype) + 1
            header[base + 1] = tensor.dim()
            header[base + 2 : base + 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            ordered[name] = tensor.to(self.device).contiguous()
        return ordered

    # -- the receivers -------------------------------------------------------------------------------------------

    def _receive(self) -> dict[str, torch.Tensor] | None:
        header = torch.empty(_header_length(self.field_names), dtype=torch.int64, device=self.device)
        self._bcast(header)
        words = header.tolist()
        if words[0] == _END:
            return None
        if words[0] == _FAILED:
            text = torch.empty(words[1], dtype=torch.uint8, device=self.device)
            self._bcast(text)
            raise DataFileError(bytes(text.cpu().tolist()).decode("utf-8", "replace"))
        received = {}
        for slot, name in enumerate(self.field_names):
            base = 2 + slot * _SLOT
            if not words[base]:
                continue
            shape = words[base + 2 : base + 2 + words[base + 1]]
            tensor = torch.empty(shape, dtype=BROADCAST_DTYPES[words[base] - 1], device=self.device)
            if tensor.numel():
                self._bcast(tensor.view(-1).view(torch.uint8))  # fills the tensor in place
            received[name] = tensor
        return received

    def _bcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(tensor, src=self.src, group=self.group)
        self.last_broadcast_bytes += tensor.numel() * tensor.element_size()
