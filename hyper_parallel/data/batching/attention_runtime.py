"""Attention metadata of one context-parallel rank, from the global sequence boundaries and its local columns.

Owns: three pure functions of the global ``cu_seq_lens`` (``batching.sequence_boundaries``) and the global columns a
CP rank holds (``parallel.batch_parallel.cp_local_columns``): the dense boolean mask of the rank's queries against
all keys (``dense_attention_mask``, with its sliding-window variant), Megatron-Core's ``PackedSeqParams`` for THD
kernels (``packed_seq_params``, with the real and the padded boundaries apart; ``attention_params`` strips the
context-parallel groups a micro-batch carries before a backend attention call), and a FlexAttention ``BlockMask``
(``flex_block_mask``; its tables alone, picklable, are ``flex_block_tables``). Not responsible for: where
sequences end, which columns a rank holds, moving tensors between ranks, or running attention.

Conventions (``R`` rows of ``T`` tokens; a CP rank holds ``s = T // cp`` columns of each row, in local order):

* A query at global column ``q`` may attend a key at global column ``k`` of the same row when both are in the same
  sequence, and, when ``causal``, ``k <= q``. Sequences never cross rows, and the Online tail padding is a sequence
  of its own, so no real token attends it and it attends only itself.
* ``sliding_window = w`` additionally keeps ``q - w <= k``: the query sees itself and the ``w`` keys before it,
  Transformer Engine's and Megatron-Core's window ``(w, 0)``; without ``causal`` it also keeps ``k <= q + w``
  (window ``(w, w)``). A Hugging Face ``sliding_window`` counts the query itself: ours ``w`` is its ``w + 1``.
* Dense masks are True where the query **may attend** (``torch.nn.functional.scaled_dot_product_attention``'s
  convention; the batch's ``megatron_attention_mask`` has the opposite polarity, and another name for it).

Every query's visible keys are thus one interval of its row, ``lo <= k <= hi`` (``_key_intervals``); the dense and
flex masks are built from those two int arrays of ``[R, s]`` entries, so nothing of ``[T, T]`` is ever materialised.

Worked example: one row of 8, boundaries ``[0, 3, 5, 8]`` (sequences ``[0, 3)``, ``[3, 5)``, ``[5, 8)``), cp 2,
zigzag layout: rank 0 holds columns ``[0, 1, 6, 7]``, so its queries see the keys ``[0, 0]``, ``[0, 1]``,
``[5, 6]`` and ``[5, 7]``, and its dense mask (rows = local queries, columns = the 8 keys) is::

    1 . . . . . . .
    1 1 . . . . . .
    . . . . . 1 1 .
    . . . . . 1 1 1

With ``sliding_window=1`` the last row keeps keys 6 and 7 only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from hyper_parallel.data.batching.sequence_boundaries import real_boundaries, row_boundaries
from hyper_parallel.data.errors import DataConfigError, require_int
from hyper_parallel.data.parallel.delivery_layout import check_cu_seq_lens

__all__ = [
    "THD_FIELDS",
    "FlexBlockTables",
    "PackedSeqParams",
    "attention_params",
    "dense_attention_mask",
    "flex_block_mask",
    "flex_block_tables",
    "packed_seq_params",
]


def _local_columns(local_columns: Any, row_length: int, where: str) -> np.ndarray:
    """``local_columns`` as int64 ``[R, s]`` numpy, checked to be columns of rows of ``row_length``."""
    if isinstance(local_columns, torch.Tensor):
        local_columns = local_columns.detach().cpu().numpy()
    columns = np.asarray(local_columns)
    if columns.ndim != 2 or columns.shape[1] == 0 or not np.issubdtype(columns.dtype, np.integer):
        raise DataConfigError(
            f"{where}: local_columns must be a non-empty [rows, local_length] integer array (the global columns a CP "
            f"rank holds, as cp_local_columns gives them), got {columns.dtype} of shape {list(columns.shape)}"
        )
    if columns.min() < 0 or columns.max() >= row_length:
        bad = columns.min() if columns.min() < 0 else columns.max()
        raise DataConfigError(
            f"{where}: local column {bad} is not a column of rows of {row_length}; pass the row length of the "
            "reader's batch (local_length * cp_size) and the columns cp_local_columns gives"
        )
    return columns.astype(np.int64, copy=False)


def _window(sliding_window: Any) -> int | None:
    return None if sliding_window is None else require_int("sliding_window", sliding_window, 0)


def _key_intervals(
    cu_seq_lens: Any, local_columns: Any, row_length: int, causal: bool, where: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(columns, lo, hi)`` int64 ``[R, s]``: each local query's column and the interval of keys it may attend.

    Example: boundaries ``[0, 3, 5, 8]``, columns ``[[0, 1, 6, 7]]``, causal: ``lo = [[0, 0, 5, 5]]``,
    ``hi = [[0, 1, 6, 7]]``; not causal: ``hi = [[2, 2, 7, 7]]``.
    """
    row_length = require_int("row_length", row_length, 1)
    if not isinstance(causal, bool):
        raise DataConfigError(f"{where}: causal must be true or false, got {causal!r}")
    columns = _local_columns(local_columns, row_length, where)
    starts, ends = row_boundaries(cu_seq_lens, len(columns), row_length)
    lo = np.take_along_axis(starts, columns, axis=1)
    hi = columns.copy() if causal else np.take_along_axis(ends, columns, axis=1) - 1
    return columns, lo, hi


def _windowed(
    columns: np.ndarray, lo: np.ndarray, hi: np.ndarray, window: int | None, causal: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The intervals cut to the sliding window: ``q - w <= k``, and ``k <= q + w`` when not causal."""
    if window is None:
        return lo, hi
    return np.maximum(lo, columns - window), hi if causal else np.minimum(hi, columns + window)


# -- dense ---------------------------------------------------------------------------------------------------------


def _runs(columns: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(row, first, end)`` of each run of local queries at consecutive columns of one sequence.

    Every layout holds few runs: one per sequence piece of a rank's slice (contiguous), one more where the two
    chunks meet (zigzag), two per sequence (zigzag_thd). Example: columns ``[[0, 1, 6, 7]]`` of sequences starting
    at ``[[0, 0, 5, 5]]`` are two runs, local ``[0, 2)`` and ``[2, 4)``.
    """
    rows, local = columns.shape
    first = np.ones((rows, local), dtype=bool)
    first[:, 1:] = (np.diff(columns, axis=1) != 1) | (np.diff(starts, axis=1) != 0)
    flat = np.flatnonzero(first)
    ends = np.append(flat[1:], rows * local)  # every row's first query starts a run, so no run crosses a row
    return flat // local, flat % local, ends - flat + flat % local


def _interval_mask(
    columns: np.ndarray,
    runs: tuple[np.ndarray, np.ndarray, np.ndarray],
    lo: np.ndarray,
    hi: np.ndarray,
    bands: tuple[int | None, int | None],
    row_length: int,
    device: torch.device,
) -> torch.Tensor:
    """bool ``[R, 1, s, T]``, True where ``lo <= key <= hi``: zeros, then one band per run of queries.

    Along a run the query column grows by one per row, and ``lo``/``hi`` are the sequence's bounds clipped to the
    diagonal bands ``q - left <= key <= q + right`` (``bands = (left, right)``, None for no bound), so each run's
    block of ``[lo[first], hi[last]]`` keys is filled and cut by ``tril_``/``triu_``. The work is the zeroing plus
    the visible area, with one step per run, not per query.
    """
    left, right = bands
    mask = torch.zeros(*columns.shape[:1], 1, columns.shape[1], row_length, dtype=torch.bool, device=device)
    for row, first, end in zip(*(part.tolist() for part in runs), strict=True):
        key_first, key_end = int(lo[row, first]), int(hi[row, end - 1]) + 1
        block = mask[row, 0, first:end, key_first:key_end]
        block.fill_(True)
        offset = int(columns[row, first]) - key_first  # diagonal of the query's own column in the block
        if right is not None:
            block.tril_(offset + right)
        if left is not None:
            block.triu_(offset - left)
    return mask


def dense_attention_mask(
    cu_seq_lens: Any,
    local_columns: Any,
    row_length: int,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The dense masks of one CP rank's queries against all keys: ``(attention_mask, swa_mask)``.

    Args:
        cu_seq_lens: the batch's global boundaries (int32 ``[K + 1]`` over the rows flattened).
        local_columns: int ``[R, s]``, the global columns this rank holds (``cp_local_columns``).
        row_length: ``T``, the reader's row length.
        causal: keys at or before the query only.
        sliding_window: ``w``: also ``q - w <= k`` (and ``k <= q + w`` without ``causal``); None for none.
        device: where the masks are built (default CPU).

    Returns:
        ``attention_mask`` bool ``[R, 1, s, T]``, True = may attend, and ``swa_mask`` (the same with the window) or
        None without ``sliding_window``. Each is ``R * s * T`` bytes: ``1 / cp`` of a global mask.

    Raises:
        DataFileError: the boundaries are not those of ``R`` rows of ``T``.
        DataConfigError: bad columns, window or flags.
    """
    window = _window(sliding_window)
    columns, lo, hi = _key_intervals(cu_seq_lens, local_columns, row_length, causal, "dense_attention_mask")
    device = torch.device("cpu" if device is None else device)
    runs = _runs(columns, lo)
    attention_mask = _interval_mask(columns, runs, lo, hi, (None, 0 if causal else None), row_length, device)
    if window is None:
        return attention_mask, None
    bands = (window, 0 if causal else window)
    return attention_mask, _interval_mask(
        columns, runs, *_windowed(columns, lo, hi, window, causal), bands, row_length, device
    )


# -- packed (THD) --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, init=False)
class PackedSeqParams:
    """THD metadata with Megatron-Core's field names (``megatron.core.packed_seq_params.PackedSeqParams``).

    All boundaries are global (over the rows flattened), int32, as Transformer Engine's THD attention takes them
    with context parallelism in the ``zigzag_thd`` layout: every sequence is cut into ``2 * cp`` chunks and each
    rank passes the global boundaries. The real and the padded boundaries are kept apart, as Megatron-Core and
    Transformer Engine expect: ``cu_seqlens_q``/``cu_seqlens_kv`` are the cumulative real token counts of the
    sequences, ``cu_seqlens_q_padded``/``cu_seqlens_kv_padded`` the physical boundaries of the same sequences with
    their padding (each sequence padded at its end to ``2 * cp``, the tail padding added to the last sequence or
    one dummy sequence of its own), and ``max_seqlen_q``/``max_seqlen_kv`` the longest padded sequence. Without
    per-sequence padding the two are one tensor. A Megatron-Core trainer converts with
    ``megatron.core.packed_seq_params.PackedSeqParams(**vars(params))``.

    Worked example, cp 2 (sequences padded to 4), real lengths 3 and 6: ``cu_seqlens_q = [0, 3, 9]``,
    ``cu_seqlens_q_padded = [0, 4, 12]``, ``max_seqlen_q = 8``; sequence 1's real tokens are the positions
    ``[4, 10)`` of the row, and ``[3, 4)`` and ``[10, 12)`` are padding.

    The packing scheduler also records which context-parallel group a micro-batch was cut for: ``cp_group`` and
    ``local_cp_size`` (its size, which dynamic CP chooses per micro-batch) and, with sequence parallelism,
    ``tp_cp_group``. Attention kernels take only the seven THD fields: pass ``attention_params(params)``.
    Megatron-Core's class has ``cp_group`` and ``local_cp_size`` but no ``tp_cp_group`` (it takes that group from
    its process-group collection), so ``vars(params)`` holds ``tp_cp_group`` only when it is set, and the
    conversion above keeps working without sequence parallelism.

    Attributes:
        qkv_format: ``"thd"``.
        cu_seqlens_q, cu_seqlens_kv: int32 ``[K + 1]`` (one tensor), the cumulative real token counts.
        cu_seqlens_q_padded, cu_seqlens_kv_padded: int32 ``[K + 1]`` (one tensor), the physical boundaries.
        max_seqlen_q, max_seqlen_kv: the longest padded sequence.
        cp_group: the CP process group the sequences are cut across, or None (no context parallelism recorded).
        local_cp_size: that group's size (the micro-batch's CP size), or None.
        tp_cp_group: the TP x CP group of that CP group, with sequence parallelism; else None.
    """

    qkv_format: str
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor
    cu_seqlens_kv_padded: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int
    cp_group: Any = None
    local_cp_size: int | None = None
    tp_cp_group: Any = None

    def __init__(
        self,
        qkv_format: str,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_kv: torch.Tensor,
        cu_seqlens_q_padded: torch.Tensor,
        cu_seqlens_kv_padded: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_kv: int,
        cp_group: Any = None,
        local_cp_size: int | None = None,
        tp_cp_group: Any = None,
    ) -> None:
        values = dict(locals())
        del values["self"]
        if tp_cp_group is None:
            del values["tp_cp_group"]  # read from the class default; absent from vars() (see the class docstring)
        for name, value in values.items():
            object.__setattr__(self, name, value)


THD_FIELDS = (
    "qkv_format",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
)


def attention_params(params: PackedSeqParams) -> dict[str, Any]:
    """The seven THD fields of ``params``, without its process groups: the keywords of a backend attention call.

    Example: ``attention(q, k, v, **attention_params(inputs["packed_seq_params"]))``; the CP group itself is given
    to the attention module (Transformer Engine: ``set_context_parallel_group``), not to each call.

    Raises:
        DataConfigError: ``params`` is not a ``PackedSeqParams``.
    """
    if not isinstance(params, PackedSeqParams):
        raise DataConfigError(f"attention_params takes a PackedSeqParams, got {type(params).__name__}")
    return {name: getattr(params, name) for name in THD_FIELDS}


def packed_seq_params(
    cu_seq_lens: Any,
    *,
    cu_seq_lens_real: Any = None,
    cp_size: int = 1,
    capacity: int | None = None,
    device: torch.device | str | None = None,
) -> PackedSeqParams:
    """``PackedSeqParams`` of the global boundaries (see the class for the layout they describe).

    Args:
        cu_seq_lens: the batch's global physical boundaries, each sequence with its padding (``Batch.cu_seq_lens``).
        cu_seq_lens_real: the cumulative real token counts of the same sequences (``Batch.cu_seq_lens_real``);
            None when no sequence is padded (the real boundaries are then ``cu_seq_lens``).
        cp_size: the context-parallel size; above 1, every padded sequence must be a multiple of ``2 * cp_size``.
        capacity: a fixed number of sequences the boundary tensors hold (``thd_max_packed_sequences``, for static
            shapes): each has ``capacity + 1`` entries, the unused ones repeating the last boundary (sequences of no
            token that attention skips, as Transformer Engine reads padded ``cu_seqlens``); None: one entry per
            sequence. Only the kernel's tensors are padded so; the batch's own boundaries never hold an empty span.
        device: where the boundary tensors are (default CPU).

    Raises:
        DataFileError: the boundaries are not valid, or the real ones are not those of the same sequences with at
            least one and at most their padded number of tokens (which rule is named).
        DataConfigError: a padded sequence does not divide into ``2 * cp_size`` chunks, or more sequences than
            ``capacity``.

    Example: boundaries ``[0, 4, 12]`` with real ``[0, 3, 9]``, cp 2: ``cu_seqlens_q = [0, 3, 9]``,
    ``cu_seqlens_q_padded = [0, 4, 12]``, ``max_seqlen_q = 8``.
    """
    cp_size = require_int("cp_size", cp_size, 1)
    if isinstance(cu_seq_lens, torch.Tensor):
        cu_seq_lens = cu_seq_lens.detach().cpu()
    values = np.asarray(cu_seq_lens)
    total = int(values[-1]) if values.ndim == 1 and values.size else 1  # the boundaries' own end; checked below
    padded = check_cu_seq_lens(cu_seq_lens, max(total, 1), "packed_seq_params")
    real = padded if cu_seq_lens_real is None else real_boundaries(cu_seq_lens_real, padded, "packed_seq_params")
    lengths = np.diff(padded.numpy())
    if cp_size > 1 and (bad := np.flatnonzero(lengths % (2 * cp_size))).size:
        raise DataConfigError(
            f"packed_seq_params: with cp_size {cp_size}, THD attention cuts every sequence into {2 * cp_size} chunks, "
            f"but sequence {bad[0]} has {lengths[bad[0]]} positions ({bad.size} of {lengths.size} do not divide); pad "
            f"every sequence to a multiple of {2 * cp_size} (a layout with pad_sequences makes the collator do it)"
        )
    if capacity is not None:
        padded, real = (_to_capacity(bounds, capacity) for bounds in (padded, real))
    device = torch.device("cpu" if device is None else device)
    padded = padded.to(device)
    real = padded if cu_seq_lens_real is None and capacity is None else real.to(device)
    longest = int(lengths.max())
    return PackedSeqParams("thd", real, real, padded, padded, longest, longest)


def _to_capacity(bounds: torch.Tensor, capacity: int) -> torch.Tensor:
    """``bounds`` with ``capacity + 1`` entries, the unused ones repeating its last."""
    capacity = require_int("capacity", capacity, 1)
    sequences = bounds.numel() - 1
    if sequences > capacity:
        raise DataConfigError(
            f"packed_seq_params: the micro-batch holds {sequences} sequences, more than the fixed capacity of "
            f"{capacity} (thd_max_packed_sequences); the scheduler keeps each group within it, so raise "
            "thd_max_packed_sequences or feed this stage the scheduler's micro-batches"
        )
    return torch.cat([bounds, bounds[-1:].expand(capacity - sequences)])


# -- FlexAttention -------------------------------------------------------------------------------------------------


def _block_tables(
    lo: torch.Tensor, hi: torch.Tensor, row_length: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """bool ``(partial, full)`` ``[R, 1, QB, KB]``: the key blocks each query block touches and those it sees whole.

    A query sees the keys ``[lo, hi]``, so it touches the key blocks ``[lo // b, hi // b]`` and sees whole the
    blocks ``[ceil(lo / b), last block ending at or before hi]``. A query block touches the union of its queries'
    ranges (a difference array over the blocks, then a running sum) and sees whole the intersection (the largest
    start, the smallest end). ``lo``/``hi`` are padded to whole query blocks with empty intervals. As in
    FlexAttention's ``create_block_mask``, which pads the token mask with False to whole blocks, a block holding
    padding (the row's last key block, the last query block) is never whole, so the tables are its tables.
    """
    rows, padded = lo.shape
    q_blocks, kv_blocks = padded // block_size, -(-row_length // block_size)
    valid = (lo <= hi).view(rows, q_blocks, block_size)
    first, last = lo.div(block_size, rounding_mode="floor"), hi.div(block_size, rounding_mode="floor")
    slot = torch.arange(rows * q_blocks, device=lo.device).view(rows, q_blocks, 1) * (kv_blocks + 1)
    flat = valid.reshape(-1)
    starts = (slot + first.view(rows, q_blocks, block_size)).reshape(-1)[flat]
    stops = (slot + last.view(rows, q_blocks, block_size) + 1).reshape(-1)[flat]
    steps = torch.zeros(rows * q_blocks * (kv_blocks + 1), dtype=torch.int32, device=lo.device)
    steps.index_add_(0, starts, torch.ones_like(starts, dtype=torch.int32))
    steps.index_add_(0, stops, torch.full_like(stops, -1, dtype=torch.int32))
    touched = steps.view(rows, q_blocks, kv_blocks + 1).cumsum(-1)[..., :kv_blocks] > 0

    whole_first = (lo + block_size - 1).div(block_size, rounding_mode="floor").view(rows, q_blocks, block_size)
    whole_last = (hi + 1).div(block_size, rounding_mode="floor").view(rows, q_blocks, block_size) - 1
    blocks = torch.arange(kv_blocks, device=lo.device)
    full = (blocks >= whole_first.amax(-1)[..., None]) & (blocks <= whole_last.amin(-1)[..., None])
    full &= valid.all(-1, keepdim=True)
    return (touched & ~full)[:, None], full[:, None]


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's tables of a bool ``[..., N, M]``: how many blocks each row lists, and which (int32).

    Each row's listed columns come first, ascending, then the others, ascending: the order of FlexAttention's own
    ``argsort(descending=True, stable=True)``, placed here by a running count instead of a sort. Example: row
    ``[0, 1, 0, 1]`` lists 2, with indices ``[1, 3, 0, 2]``.
    """
    listed_so_far = blocks.cumsum(-1, dtype=torch.int32)
    counts = listed_so_far[..., -1:]
    columns = torch.arange(blocks.shape[-1], dtype=torch.int32, device=blocks.device).expand_as(listed_so_far)
    places = torch.where(blocks, listed_so_far - 1, counts + columns - listed_so_far)
    indices = torch.empty_like(listed_so_far).scatter_(-1, places.long(), columns)
    return counts.squeeze(-1).contiguous(), indices


@dataclass(frozen=True)
class FlexBlockTables:
    """Everything a FlexAttention ``BlockMask`` of ``flex_block_mask`` holds, as plain tensors: picklable, so a
    DataLoader worker can build it and the training process only wraps it (``block_mask``).

    Attributes:
        first, last: int32 ``[R, P]`` (``P`` the local queries padded to whole blocks): each query's first and last
            visible key, read by the ``mask_mod`` (a padding query has ``first > last`` and sees nothing).
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices: the key-major tables (int32).
        q_num_blocks, q_indices, full_q_num_blocks, full_q_indices: the query-major tables (int32).
        seq_lengths: ``(s, T)``.
        block_size: the block size of queries and keys.
    """

    first: torch.Tensor
    last: torch.Tensor
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: torch.Tensor
    full_q_indices: torch.Tensor
    seq_lengths: tuple[int, int]
    block_size: int

    def map(self, function) -> FlexBlockTables:
        """The tables with ``function`` applied to every tensor (a device move, ``pin_memory``)."""
        return FlexBlockTables(*(function(getattr(self, name)) for name in _FLEX_TENSORS), self.seq_lengths,
                               self.block_size)  # fmt: skip

    def block_mask(self) -> BlockMask:
        """The ``BlockMask`` of these tables, with the document mask over ``first``/``last`` as its ``mask_mod``."""
        first, last = self.first, self.last

        def document_mask(batch, head, q_index, kv_index):
            return (kv_index >= first[batch, q_index]) & (kv_index <= last[batch, q_index])

        tables = {name: getattr(self, name) for name in _FLEX_TENSORS[2:]}
        return BlockMask(seq_lengths=self.seq_lengths, **tables, BLOCK_SIZE=(self.block_size, self.block_size),
                         mask_mod=document_mask)  # fmt: skip


_FLEX_TENSORS = tuple(
    name for name in FlexBlockTables.__dataclass_fields__ if name not in ("seq_lengths", "block_size")
)


def flex_block_tables(
    cu_seq_lens: Any,
    local_columns: Any,
    row_length: int,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    block_size: int = 128,
    device: torch.device | str = "cpu",
) -> FlexBlockTables:
    """The tables of ``flex_block_mask`` (same arguments), before they are wrapped in a ``BlockMask``."""
    block_size = require_int("block_size", block_size, 1)
    window = _window(sliding_window)
    columns, lo, hi = _key_intervals(cu_seq_lens, local_columns, row_length, causal, "flex_block_mask")
    lo, hi = _windowed(columns, lo, hi, window, causal)
    rows, local = lo.shape
    padded = -(-local // block_size) * block_size
    # Queries past ``s`` (the last block's padding) get empty intervals, so they touch nothing and mask everything.
    first = torch.ones(rows, padded, dtype=torch.int32)
    last = torch.zeros(rows, padded, dtype=torch.int32)
    first[:, :local], last[:, :local] = torch.from_numpy(lo), torch.from_numpy(hi)
    first, last = first.to(device), last.to(device)
    partial, full = _block_tables(first.long(), last.long(), row_length, block_size)
    # The query-major tables the backward pass reads are the transposed block tables, ordered the same way.
    return FlexBlockTables(
        first, last, *_ordered(partial), *_ordered(full), *_ordered(partial.transpose(-2, -1)),
        *_ordered(full.transpose(-2, -1)), (local, row_length), block_size,
    )  # fmt: skip


def flex_block_mask(
    cu_seq_lens: Any,
    local_columns: Any,
    row_length: int,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    block_size: int = 128,
    device: torch.device | str = "cpu",
) -> BlockMask:
    """A FlexAttention ``BlockMask`` of one CP rank's queries (local order) against all ``T`` keys of their row.

    Built at block level from the boundaries: for each block of ``block_size`` local queries, the key blocks it
    sees whole (``full_kv_*``, no ``mask_mod`` call) and those it sees in part (``kv_*``, where ``mask_mod``
    decides), both computed from each query's key interval (module docstring) in ``O(R * s + R * QB * KB)``; the
    ``mask_mod`` reads two int32 ``[R, s]`` tensors (each query's first and last visible key). Nothing of
    ``[s, T]`` is materialised. Its batch dimension is the ``R`` rows and its head dimension 1 (broadcast).

    Args:
        cu_seq_lens, local_columns, row_length, causal, sliding_window: as ``dense_attention_mask``.
        block_size: the sparse block size, for queries and keys (FlexAttention's default 128).
        device: where the tables and the ``mask_mod``'s tensors are.

    Returns:
        ``BlockMask`` of ``seq_lengths (s, T)``; ``create_mask`` or the tables plus ``mask_mod`` expand it to the
        dense ``attention_mask`` (True = may attend).

    Raises:
        DataFileError, DataConfigError: as ``dense_attention_mask``; a ``block_size`` below 1.
    """
    return flex_block_tables(
        cu_seq_lens, local_columns, row_length, causal=causal, sliding_window=sliding_window, block_size=block_size,
        device=device,
    ).block_mask()  # fmt: skip
