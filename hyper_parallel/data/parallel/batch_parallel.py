"""Context-, tensor- and pipeline-parallel delivery of batches: which columns each CP rank holds, the TP broadcast,
and the one relay of a data rank's batch, its end of data and its failure to every rank.

Owns: the CP cuts (``cp_local_columns``: which global columns of every row a CP rank holds, as pure numpy arithmetic
on the layouts of ``parallel.delivery_layout``), ``CPBatchSharder`` (gathers a batch's ``[R, T, ...]`` fields at those
columns), ``TPBatchBroadcaster`` (sends a data rank's tensors to the other ranks of its TP group: a fixed-size
header, then the tensors; the end of data and a reader's failure reach every rank too) and ``BatchRelay`` (the TP
broadcast on PP stage 0, then one PP hop in which every later stage receives only the fields it owns; every
delivery path uses it). Not responsible for: where sequences end (``batching.sequence_boundaries`` gives
``cu_seq_lens``), the layout's alignment arithmetic and the boundary rule (``parallel.delivery_layout``), padding
rows or sequences (the collators), or position ids, loss masks and attention metadata (``batching``).

Vocabulary: a row holds ``T`` columns; ``cu_seq_lens`` (int32, leading 0, ending at ``R * T``) gives the sequence
boundaries over the ``R`` rows flattened one after another, every row end being a boundary. A CP rank holds
``T // cp`` columns of every row, in local order; ``local_columns`` are their global columns (0..T-1). A field's
*owner* says which PP stages take it: ``first`` (stage 0 and the MTP stages), ``last`` (the last stage) or ``all``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import numpy as np
import torch

from hyper_parallel.data.errors import DataConfigError, DataFileError, require_int
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext
from hyper_parallel.data.parallel.delivery_layout import CP_LAYOUTS, DeliveryLayout, check_cu_seq_lens

__all__ = [
    "BROADCAST_DTYPES",
    "BROADCAST_FIELDS",
    "CP_LAYOUTS",
    "FIELD_OWNERS",
    "PIPELINE_FIELD_OWNERS",
    "BatchRelay",
    "CPBatchSharder",
    "MAX_BROADCAST_DIMS",
    "TPBatchBroadcaster",
    "broadcast_bytes",
    "cp_local_columns",
    "gather_columns",
    "header_bytes",
    "pipeline_bytes",
    "stage_fields",
]

# -- CP layouts ---------------------------------------------------------------------------------------------------


def _cut(layout: str | DeliveryLayout) -> DeliveryLayout:
    """The layout of the cut alone (its CP layout name), validated by ``DeliveryLayout``."""
    name = layout.cp_layout if isinstance(layout, DeliveryLayout) else layout
    return DeliveryLayout(cp_layout=name)


def _row_divides(layout: str, row_length: int, cp_size: int, divisor: int) -> None:
    if row_length % divisor == 0:
        return
    parts = f"cp_size={cp_size} equal parts" if layout == "contiguous" else f"2*cp_size={divisor} equal chunks"
    other = "" if layout == "contiguous" else ", or use the contiguous layout (rows a multiple of cp_size)"
    raise DataConfigError(
        f"the {layout} CP layout cuts every row into {parts}, but the row length {row_length} is not a multiple "
        f"of {divisor}; align the rows to a multiple of {divisor} (the collator's alignment: "
        f"build_online_text_collate_fn(layout=...), or a seq_length that {divisor} divides){other}"
    )


def _sequence_bounds(cu_seq_lens, rows: int, row_length: int) -> np.ndarray:
    """``cu_seq_lens`` as int64 numpy, checked by the one boundary rule (``check_cu_seq_lens``)."""
    if cu_seq_lens is None:
        raise DataConfigError("the zigzag_thd CP layout cuts every sequence, so it needs cu_seq_lens; got None")
    where = "the zigzag_thd CP cut's cu_seq_lens"
    checked = check_cu_seq_lens(cu_seq_lens, rows * row_length, where, row_length=row_length)
    return checked.cpu().numpy().astype(np.int64)


def _zigzag_thd_columns(
    bounds: np.ndarray, rows: int, row_length: int, cp_size: int, cp_rank: int, chunks: int
) -> np.ndarray:
    """Every sequence in ``chunks = 2·cp`` chunks; this rank's chunks ``cp_rank`` and ``2·cp-1-cp_rank`` of each, in
    order.

    Vectorised over the local tokens: each gets its sequence (``np.repeat``) and its offset among the sequence's
    local tokens, then its global position.
    """
    lengths = np.diff(bounds)
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
    layout: str | DeliveryLayout,
    cu_seq_lens: np.ndarray | torch.Tensor | None,
    rows: int,
    row_length: int,
    cp_size: int,
    cp_rank: int,
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
        layout: one of ``CP_LAYOUTS``, or a ``DeliveryLayout`` (its ``cp_layout``; ``cp_size`` may differ from
            the layout's own, as under dynamic CP).
        cu_seq_lens: the batch's sequence boundaries over the flattened rows; read by ``zigzag_thd`` only.
        rows, row_length: the batch's ``R`` and ``T``.
        cp_size, cp_rank: the context-parallel size and this rank.

    Raises:
        DataConfigError: an unknown layout, a rank not below the size, or a length the layout cannot cut (naming
            the layout, the length and the fix).
        DataFileError: ``zigzag_thd`` got ``cu_seq_lens`` that break the boundary rule (``check_cu_seq_lens``).
    """
    cut = _cut(layout)
    layout = cut.cp_layout
    rows = require_int("rows", rows, 1)
    row_length = require_int("row_length", row_length, 1)
    cp_size = require_int("cp_size", cp_size, 1)
    cp_rank = require_int("cp_rank", cp_rank, 0)
    if cp_rank >= cp_size:
        raise DataConfigError(f"cp_rank {cp_rank} must be below cp_size {cp_size}")
    if cp_size == 1:
        return np.tile(np.arange(row_length, dtype=np.int64), (rows, 1))
    if layout == "zigzag_thd":
        bounds = _sequence_bounds(cu_seq_lens, rows, row_length)
        return _zigzag_thd_columns(bounds, rows, row_length, cp_size, cp_rank, cut.sequence_multiple(cp_size))
    divisor = cut.row_multiple(cp_size)
    _row_divides(layout, row_length, cp_size, divisor)
    if layout == "contiguous":
        size = row_length // cp_size
        columns = np.arange(cp_rank * size, (cp_rank + 1) * size, dtype=np.int64)
    else:
        size = row_length // divisor
        first, second = cp_rank * size, (divisor - 1 - cp_rank) * size
        columns = np.concatenate([np.arange(first, first + size), np.arange(second, second + size)]).astype(np.int64)
    return np.tile(columns, (rows, 1))


def gather_columns(tensor: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``tensor[r, columns[r], ...]`` for every row ``r``: one ``torch.gather`` along the columns (advanced indexing
    with a row index costs about 200x more on a 32k row)."""
    index = columns.reshape(*columns.shape, *([1] * (tensor.dim() - 2))).expand(*columns.shape, *tensor.shape[2:])
    return torch.gather(tensor, 1, index)


class CPBatchSharder:
    """Cuts a batch's ``[R, T, ...]`` fields down to one CP rank's columns, ``[R, T // cp, ...]``.

    Args:
        cp_size: the context-parallel size.
        cp_rank: this rank.
        layout: one of ``CP_LAYOUTS`` or a ``DeliveryLayout`` (see ``cp_local_columns``); ``layout`` keeps its name.
    """

    def __init__(self, cp_size: int, cp_rank: int, layout: str | DeliveryLayout = "contiguous") -> None:
        layout = _cut(layout).cp_layout
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
        local = {name: gather_columns(tensor, local_columns) for name, tensor in fields.items()}
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
    "cu_seq_lens_real",
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


_BATCH, _END, _FAILED = 0, 1, 2  # header[0]; a failure's header[1] is its message length, header[2] its type
_SLOT = 2 + MAX_BROADCAST_DIMS  # per field: dtype code + 1 (0 = absent), ndim, the dimensions
_ERROR_TYPES = (DataFileError, DataConfigError)  # what a receiver raises for a failure's type code

Move = Callable[[torch.Tensor], None]  # sends a tensor on the source; fills it in place on a receiver


def _header_length(field_names: Sequence[str]) -> int:
    return 2 + len(field_names) * _SLOT  # status, failure message length, the slots


def header_bytes(field_names: Sequence[str] = BROADCAST_FIELDS) -> int:
    """Bytes of the fixed-size header every broadcast (and every PP hop) sends first (int64 words)."""
    return 8 * _header_length(field_names)


def broadcast_bytes(fields: Mapping[str, torch.Tensor] | None, field_names: Sequence[str] = BROADCAST_FIELDS) -> int:
    """Bytes one ``TPBatchBroadcaster.broadcast`` of ``fields`` sends: the header plus every tensor's bytes."""
    payload = sum(tensor.numel() * tensor.element_size() for tensor in (fields or {}).values())
    return header_bytes(field_names) + payload


def _registry(field_names: Sequence[str], what: str) -> tuple[str, ...]:
    names = tuple(field_names)
    if len(set(names)) != len(names):
        raise DataConfigError(f"the {what} field registry {list(names)} names a field twice")
    return names


class _Wire:
    """The protocol of one hop: a fixed-size int64 header, then each present non-empty tensor as its bytes.

    The header's status says whether fields follow, the data ended, or the source failed (then the message's
    bytes follow, and its type code); ``move`` is the transport (a broadcast, or a send on the source and a receive
    elsewhere).
    """

    def __init__(self, field_names: tuple[str, ...], device: torch.device) -> None:
        self.field_names = field_names
        self.device = device

    def check(self, fields: Mapping[str, torch.Tensor]) -> None:
        """Refuse what the header cannot describe: an unregistered name, a non-tensor, a dtype or a rank."""
        unknown = [name for name in fields if name not in self.field_names]
        if unknown:
            raise DataConfigError(
                f"the field {unknown[0]!r} is not in the TP broadcast registry {list(self.field_names)}; send only "
                "registered fields, or give every rank's TPBatchBroadcaster the same field_names including it"
            )
        for name, tensor in fields.items():
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

    def send(self, fields: Mapping[str, torch.Tensor] | None, move: Move) -> dict[str, torch.Tensor] | None:
        """Send ``fields`` (already ``check``-ed) or the end of data; return the fields in registry order."""
        header = torch.zeros(_header_length(self.field_names), dtype=torch.int64)
        if fields is None:
            header[0] = _END
            move(header.to(self.device))
            return None
        ordered = {}
        for slot, name in enumerate(self.field_names):
            if name in fields:
                tensor = fields[name]
                base = 2 + slot * _SLOT
                header[base] = BROADCAST_DTYPES.index(tensor.dtype) + 1
                header[base + 1] = tensor.dim()
                header[base + 2 : base + 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
                ordered[name] = tensor.to(self.device).contiguous()
        move(header.to(self.device))
        for tensor in ordered.values():
            if tensor.numel():
                move(tensor.reshape(-1).view(torch.uint8))
        return ordered

    def fail(self, message: str, error_type: type[Exception], move: Move) -> None:
        """Make the receiver raise ``error_type(message)`` (``DataFileError`` or ``DataConfigError``)."""
        text = torch.frombuffer(bytearray(message.encode("utf-8")), dtype=torch.uint8).to(self.device)
        header = torch.zeros(_header_length(self.field_names), dtype=torch.int64)
        header[0], header[1], header[2] = _FAILED, text.numel(), _ERROR_TYPES.index(error_type)
        move(header.to(self.device))
        move(text)

    def receive(self, move: Move) -> dict[str, torch.Tensor] | None:
        """The source's fields in registry order, or None at the end of data; raises the source's failure."""
        header = torch.empty(_header_length(self.field_names), dtype=torch.int64, device=self.device)
        move(header)
        words = header.tolist()
        if words[0] == _END:
            return None
        if words[0] == _FAILED:
            text = torch.empty(words[1], dtype=torch.uint8, device=self.device)
            move(text)
            raise _ERROR_TYPES[words[2]](bytes(text.cpu().tolist()).decode("utf-8", "replace"))
        received = {}
        for slot, name in enumerate(self.field_names):
            base = 2 + slot * _SLOT
            if not words[base]:
                continue
            shape = words[base + 2 : base + 2 + words[base + 1]]
            tensor = torch.empty(shape, dtype=BROADCAST_DTYPES[words[base] - 1], device=self.device)
            if tensor.numel():
                move(tensor.view(-1).view(torch.uint8))  # fills the tensor in place
            received[name] = tensor
        return received


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
        self.field_names = _registry(field_names, "TP broadcast")
        self._wire = _Wire(self.field_names, self.device)
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
        self.last_broadcast_bytes = 0
        if self.group is None:
            return None if fields is None else dict(fields)
        if not self.is_src:
            return self._wire.receive(self._bcast)
        try:
            self._wire.check(fields or {})
        except DataConfigError as error:
            self.broadcast_failure("send a batch", error)
            raise
        return self._wire.send(fields, self._bcast)

    def broadcast_failure(self, what: str, error: BaseException) -> None:
        """On the source, after its reader failed: make every receiver raise this failure instead of waiting.

        The receivers' pending (or next) ``broadcast`` raises ``DataFileError("global rank <src> (TP rank 0)
        failed to <what> (<error type>: <error>); see rank <src>'s log")``. The source re-raises its own error.
        """
        message = f"global rank {self.src} (TP rank 0) failed to {what} ({type(error).__name__}: {error}); see rank "
        self._fail(message + f"{self.src}'s log", DataFileError)

    def _fail(self, message: str, error_type: type[Exception]) -> None:
        if self.group is None:
            return
        if not self.is_src:
            raise DataConfigError(
                f"broadcast_failure is for the TP source (global rank {self.src}), which reads; the other TP ranks "
                "learn of its failure from their broadcast"
            )
        self._wire.fail(message, error_type, self._bcast)

    def _bcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(tensor, src=self.src, group=self.group)
        self.last_broadcast_bytes += tensor.numel() * tensor.element_size()


# -- the relay: TP on PP stage 0, then one PP hop -----------------------------------------------------------------

FIELD_OWNERS = ("first", "last", "all")
# Megatron-Core's ownership: the first stage embeds the tokens at their positions, the last one takes the loss; every
# field not named here (the THD metadata: cu_seq_lens, local_cp_size, ...) goes to every stage.
PIPELINE_FIELD_OWNERS = MappingProxyType(
    {"input_ids": "first", "position_ids": "first", "labels": "last", "loss_mask": "last"}
)


def _owners(owners: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(owners, Mapping):
        raise DataConfigError(
            f"the relay's owners must map field names to one of {list(FIELD_OWNERS)}, got {type(owners).__name__}"
        )
    bad = {name: owner for name, owner in owners.items() if owner not in FIELD_OWNERS}
    if bad:
        name, owner = next(iter(bad.items()))
        raise DataConfigError(
            f"the relay's owner of field {name!r} is {owner!r}; use one of {list(FIELD_OWNERS)} (first: PP stage 0 "
            "and the MTP stages, last: the last stage, all: every stage)"
        )
    return dict(owners)


def _stages(mtp_stages: Sequence[int], pp_size: int) -> frozenset[int]:
    if isinstance(mtp_stages, str | bytes) or not isinstance(mtp_stages, Sequence):
        raise DataConfigError(f"mtp_stages must be a list of PP stages, got {mtp_stages!r}; e.g. [3]")
    stages = frozenset(require_int("mtp_stages entry", stage, 0) for stage in mtp_stages)
    beyond = sorted(stage for stage in stages if stage >= pp_size)
    if beyond:
        raise DataConfigError(
            f"mtp_stages holds stage {beyond[0]}, but the pipeline has {pp_size} stage(s) (0 to {pp_size - 1}); name "
            "the stages that hold multi-token-prediction layers"
        )
    return stages


def stage_fields(
    field_names: Sequence[str],
    stage: int,
    pp_size: int,
    owners: Mapping[str, str] = PIPELINE_FIELD_OWNERS,
    mtp_stages: Sequence[int] = (),
) -> tuple[str, ...]:
    """The fields of ``field_names`` that PP stage ``stage`` of ``pp_size`` owns, in registry order.

    A field owned by ``first`` goes to stage 0 and the MTP stages, one owned by ``last`` to the last stage, one owned
    by ``all`` (or not named in ``owners``) to every stage. Example: with ``PIPELINE_FIELD_OWNERS`` and 4 stages,
    stage 0 owns ``input_ids`` and ``cu_seq_lens``, stage 1 ``cu_seq_lens`` alone, stage 3 ``labels`` and
    ``cu_seq_lens``.
    """
    pp_size = require_int("pp_size", pp_size, 1)
    stage = require_int("stage", stage, 0)
    owners, first_stages = _owners(owners), _stages(mtp_stages, pp_size) | {0}
    takes = {"all": True, "first": stage in first_stages, "last": stage == pp_size - 1}
    return tuple(name for name in field_names if takes[owners.get(name, "all")])


def pipeline_bytes(
    fields: Mapping[str, torch.Tensor] | None,
    pp_size: int,
    owners: Mapping[str, str] = PIPELINE_FIELD_OWNERS,
    mtp_stages: Sequence[int] = (),
    field_names: Sequence[str] = BROADCAST_FIELDS,
) -> int:
    """Bytes one ``BatchRelay`` PP hop of ``fields`` sends from stage 0: to every later stage, the header plus the
    tensors it owns (its ``last_pp_bytes`` on stage 0)."""
    total = 0
    for stage in range(1, require_int("pp_size", pp_size, 1)):
        owned = stage_fields(field_names, stage, pp_size, owners, mtp_stages)
        total += broadcast_bytes({name: t for name, t in (fields or {}).items() if name in owned}, field_names)
    return total


class BatchRelay:
    """A data rank's batch, its end of data or its failure, to every rank that takes part in its micro-batch.

    Every rank calls ``relay`` once per micro-batch. On PP stage 0 the data rank (``context.is_data_rank``) runs
    ``produce`` and ``TPBatchBroadcaster`` sends the result to its TP peers; then one PP hop takes it from each rank
    of stage 0 to the later stages of its (DP, CP, TP) coordinate, point to point, each stage receiving only the
    fields it owns (``stage_fields``): middle stages get the THD metadata alone. The end of data (``produce`` returns
    None) returns None on every rank in the same call; a failure raises on every rank in the same call, the data
    rank its own error and the others the same type (``DataFileError`` or ``DataConfigError``; any other is
    relayed as ``DataFileError``) with a message naming the data rank's global rank.

    Args:
        context: this rank's place (``DataLoaderParallelContext``; ``ProcessGroupCollection.parallel_context()``
            under the scheduler).
        field_names: the registry of fields ``produce`` may return, the same on every rank.
        owners: field name -> ``first`` | ``last`` | ``all``; unnamed fields go to every stage.
        mtp_stages: stages that hold multi-token-prediction layers and take the first stage's fields too.
        device: where receivers allocate and every rank's tensors are returned (NCCL needs CUDA).

    Attributes:
        fields: the fields this rank's stage owns (``stage_fields``), in registry order.
        last_tp_bytes: bytes the last call passed to the TP broadcast (0 off stage 0 or without a TP group).
        last_pp_bytes: bytes the last call moved over PP: sent to every later stage on stage 0
            (``pipeline_bytes``), received on the others.

    Example (every rank of a PP2 x TP2 mesh)::

        relay = BatchRelay(DataLoaderParallelContext.from_mesh(mesh), ("input_ids", "labels", "cu_seq_lens"))
        fields = relay.relay(lambda: next_fields(loader))  # stage 0: input_ids, cu_seq_lens; stage 1: labels, ...
    """

    def __init__(
        self,
        context: DataLoaderParallelContext,
        field_names: Sequence[str] = BROADCAST_FIELDS,
        owners: Mapping[str, str] = PIPELINE_FIELD_OWNERS,
        *,
        mtp_stages: Sequence[int] = (),
        device="cpu",
    ) -> None:
        if not isinstance(context, DataLoaderParallelContext):
            raise DataConfigError(
                f"BatchRelay needs a DataLoaderParallelContext (from_mesh, from_groups, or "
                f"ProcessGroupCollection.parallel_context()), got {type(context).__name__}"
            )
        self.context = context
        self.device = torch.device(device)
        self.field_names = _registry(field_names, "relay")
        self._by_stage = [
            stage_fields(self.field_names, stage, context.pp_size, owners, mtp_stages)
            for stage in range(context.pp_size)
        ]
        self.fields = self._by_stage[context.pp_rank]
        self._wire = _Wire(self.field_names, self.device)
        self._tp = None
        if context.is_first_stage:
            self._tp = TPBatchBroadcaster(context.tp_group, context.tp_src, self.device, self.field_names)
        self._pp_ranks = self._pipeline_ranks()
        self.last_tp_bytes = self.last_pp_bytes = 0

    def _pipeline_ranks(self) -> list[int]:
        for name in ("tp", "pp"):
            size = getattr(self.context, f"{name}_size")
            if size > 1 and getattr(self.context, f"{name}_group") is None:
                raise DataConfigError(
                    f"the context has {name}_size {size} but no {name}_group, so the ranks that do not read cannot "
                    f"receive their batches; build it with DataLoaderParallelContext.from_mesh or "
                    f"from_groups({name}_group=...)"
                )
        group = self.context.pp_group
        if self.context.pp_size == 1:
            return []
        import torch.distributed as dist

        return dist.get_process_group_ranks(group)

    def relay(
        self, produce: Callable[[], Mapping[str, torch.Tensor] | None], what: str = "read the next batch"
    ) -> dict[str, torch.Tensor] | None:
        """Run ``produce`` on the data rank; return on every rank the fields its stage owns, or None at the end.

        Args:
            produce: called on the data rank only: the fields of the next micro-batch, or None at the end of data.
            what: what ``produce`` does, for the failure message (``"global rank 0 (the data rank) failed to
                <what> (...)"``).

        Raises:
            DataFileError, DataConfigError: the data rank's ``produce`` failed or returned fields the registry cannot
                carry, on every rank of its TP group and of every PP stage.
        """
        self.last_tp_bytes = self.last_pp_bytes = 0
        payload, failure = None, None
        if self._tp is not None:
            payload, failure = self._over_tp(produce, what)
        if self._pp_ranks:
            payload = self._over_pp(payload, failure)
        if failure is not None:
            raise failure[0]
        if payload is None:
            return None
        return {name: tensor for name, tensor in payload.items() if name in self.fields}

    # -- the hops ------------------------------------------------------------------------------------------------

    def _over_tp(self, produce, what: str) -> tuple[dict | None, tuple | None]:
        """Stage 0: ``(fields or None, None)``, or ``(None, (error, message, type))`` after a failure."""
        self._tp.last_broadcast_bytes = 0
        try:
            if self.context.is_data_rank:
                try:
                    fields = produce()
                    if fields is not None:
                        self._wire.check(fields)
                except Exception as own:  # noqa: BLE001 - relayed to every rank, then raised
                    message, error_type = self._described(own, what)
                    self._tp._fail(message, error_type)
                    return None, (own, message, error_type)
                return self._tp.broadcast(fields), None
            return self._tp.broadcast(None), None
        except Exception as relayed:  # noqa: BLE001 - a receiver passes the data rank's failure on over PP
            if type(relayed) in _ERROR_TYPES:
                return None, (relayed, str(relayed), type(relayed))
            return None, (relayed, *self._described(relayed, "receive its batch over TP"))
        finally:
            self.last_tp_bytes = self._tp.last_broadcast_bytes

    def _described(self, error: BaseException, what: str) -> tuple[str, type[Exception]]:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        kind = type(error) if type(error) in _ERROR_TYPES else DataFileError
        place = "the data rank" if self.context.is_data_rank else f"PP stage 0, TP rank {self.context.tp_rank}"
        return (
            f"global rank {rank} ({place}) failed to {what} ({type(error).__name__}: {error}); see rank {rank}'s log",
            kind,
        )

    def _over_pp(self, payload: dict | None, failure: tuple | None) -> dict | None:
        """Stage 0 sends each later stage its fields (or the end, or the failure); the others receive theirs."""
        import torch.distributed as dist

        group = self.context.pp_group
        if not self.context.is_first_stage:
            src = self.context.pp_src

            def receive(tensor: torch.Tensor) -> None:
                dist.recv(tensor, src=src, group=group)
                self.last_pp_bytes += tensor.numel() * tensor.element_size()

            return self._wire.receive(receive)
        for stage, dst in enumerate(self._pp_ranks[1:], start=1):

            def send(tensor: torch.Tensor, dst: int = dst) -> None:
                dist.send(tensor, dst=dst, group=group)
                self.last_pp_bytes += tensor.numel() * tensor.element_size()

            if failure is not None:
                self._wire.fail(failure[1], failure[2], send)
            elif payload is None:
                self._wire.send(None, send)
            else:
                self._wire.send({n: t for n, t in payload.items() if n in self._by_stage[stage]}, send)
        return payload
