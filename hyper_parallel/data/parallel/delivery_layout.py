"""How a batch is laid out over the CP and TP ranks, decided once: the frozen ``DeliveryLayout`` and the one check
of sequence boundaries.

Owns: ``DeliveryLayout`` (the CP size and layout, the TP size, sequence parallelism, MXFP8, the CP-local alignment
``N`` or ``"max"``, and whether every sequence is padded for CP), the arithmetic every stage derives from it (how
long a row, a sequence and a rank's CP-local part must be), and ``check_cu_seq_lens``, the one rule sequence
boundaries follow everywhere. The collators, the packing policy, the scheduler and ``ParallelBatch`` take the same
value; none recomputes an alignment. Not responsible for: which columns a CP rank holds (``parallel.batch_parallel``),
where sequences end (``batching.sequence_boundaries``), or padding itself (the collators).

Vocabulary (``c`` a CP size, ``tp_sp = tp`` with sequence parallelism, else 1):

* ``local_multiple(c)``: a rank's CP-local length is a multiple of ``lcm(N, tp_sp, 32 * tp_sp with MXFP8, 2 for the
  zigzag layouts when c > 1)``; ``N`` counts before sequence parallelism, as Megatron-Core's
  ``--pad-packed-seq-alignment`` does.
* ``row_multiple(c)``: a packed row is ``c * local_multiple(c)`` long (a multiple of it).
* ``sequence_multiple(c)``: with per-sequence padding, every sequence is padded at its end to ``2 * c`` (the
  ``zigzag_thd`` chunks, Transformer Engine's THD layout with CP); else 1.

Example::

    layout = DeliveryLayout(cp_size=2, cp_layout="zigzag_thd", tp_size=4, sequence_parallel=True, mxfp8=True)
    layout.local_multiple()     # lcm(1, 4, 128, 2) = 128
    layout.row_multiple()       # 256
    layout.sequence_multiple()  # 4
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hyper_parallel.data.errors import DataConfigError, DataFileError, require_choice, require_flag, require_int

__all__ = ["CP_LAYOUTS", "MXFP8_BLOCK", "DeliveryLayout", "check_cu_seq_lens", "shown_boundaries"]

CP_LAYOUTS = ("contiguous", "zigzag", "zigzag_thd")
MXFP8_BLOCK = 32  # tokens of one MXFP8 scaling block: a rank's shard after sequence parallelism is a multiple

_INT32_MAX = int(np.iinfo(np.int32).max)
_FIX = (
    "build batches with the library's collators (TextPackingCollator, build_indexed_collate_fn), whose boundaries "
    "follow the batch contract"
)


@dataclass(frozen=True)
class DeliveryLayout:
    """The layout of every delivered batch over the CP and TP ranks, validated when built.

    Attributes:
        cp_size: the (static) context-parallel size.
        cp_layout: one of ``CP_LAYOUTS``: which columns each CP rank holds (``parallel.batch_parallel``).
        tp_size: the tensor-parallel size.
        sequence_parallel: the CP-local part is split again over the TP ranks.
        mxfp8: a rank's part after sequence parallelism is a multiple of 32 tokens (MXFP8 blocks).
        alignment: ``N``, the multiple of a rank's CP-local length (before sequence parallelism), or ``"max"``:
            every rank holds ``max_seqlen_per_rank`` tokens (fixed shapes).
        pad_sequences: every sequence is padded at its end to ``2 * cp`` when CP is above 1; needed by
            ``zigzag_thd``, optional with ``contiguous``; None (the default) means "on for ``zigzag_thd``".
        max_seqlen_per_rank: the most tokens one rank holds (needed by ``alignment="max"``); None: no limit.

    Raises:
        DataConfigError: a size or alignment that is not a positive integer, an unknown layout (with the closest
            name), a flag that is not a bool, ``zigzag_thd`` without per-sequence padding, per-sequence padding with
            the row-wise ``zigzag`` layout, ``"max"`` without ``max_seqlen_per_rank``, or an alignment above it.
    """

    cp_size: int = 1
    cp_layout: str = "contiguous"
    tp_size: int = 1
    sequence_parallel: bool = False
    mxfp8: bool = False
    alignment: int | str = 1
    pad_sequences: bool | None = None
    max_seqlen_per_rank: int | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "cp_size", require_int("cp_size", self.cp_size, 1))
        set_(self, "tp_size", require_int("tp_size", self.tp_size, 1))
        set_(
            self,
            "cp_layout",
            require_choice("cp_layout", self.cp_layout, CP_LAYOUTS, "how a row is cut across CP ranks"),
        )
        set_(self, "sequence_parallel", require_flag("sequence_parallel", self.sequence_parallel))
        set_(self, "mxfp8", require_flag("mxfp8", self.mxfp8))
        if self.max_seqlen_per_rank is not None:
            set_(self, "max_seqlen_per_rank", require_int("max_seqlen_per_rank", self.max_seqlen_per_rank, 1))
        if self.alignment != "max":
            if isinstance(self.alignment, str):
                raise DataConfigError(
                    f"alignment is {self.alignment!r}; use an integer N (a rank's CP-local length is a multiple of "
                    "N) or 'max' (every rank holds max_seqlen_per_rank tokens)"
                )
            set_(self, "alignment", require_int("alignment", self.alignment, 1))
            if self.max_seqlen_per_rank is not None and self.alignment > self.max_seqlen_per_rank:
                raise DataConfigError(
                    f"alignment {self.alignment} is above max_seqlen_per_rank {self.max_seqlen_per_rank}, so no "
                    f"aligned length fits on a rank; use an alignment <= {self.max_seqlen_per_rank}, or 'max'"
                )
        elif self.max_seqlen_per_rank is None:
            raise DataConfigError(
                "alignment 'max' pads every rank to max_seqlen_per_rank, which is not set; set max_seqlen_per_rank "
                "(the scheduler's max_seqlen_per_dp_cp_rank), or use an integer alignment"
            )
        pad = (
            self.cp_layout == "zigzag_thd"
            if self.pad_sequences is None
            else require_flag("pad_sequences", self.pad_sequences)
        )
        if self.cp_layout == "zigzag_thd" and not pad:
            raise DataConfigError(
                "cp_layout 'zigzag_thd' cuts every sequence into 2 * cp chunks, so it needs pad_sequences true; "
                "turn per-sequence padding off only with the contiguous layout (cp_partition_mode 'contiguous')"
            )
        if self.cp_layout == "zigzag" and pad:
            raise DataConfigError(
                "pad_sequences pads every sequence to 2 * cp for a per-sequence CP cut, but cp_layout 'zigzag' cuts "
                "whole rows; use cp_layout 'zigzag_thd' (per sequence) or set pad_sequences false"
            )
        set_(self, "pad_sequences", pad)
        if self.alignment == "max" and self.max_seqlen_per_rank % self.local_multiple():
            raise DataConfigError(
                f"alignment 'max' pads every rank to max_seqlen_per_rank {self.max_seqlen_per_rank}, which is not a "
                f"multiple of the CP-local multiple {self.local_multiple()} ({self._reasons()}); set "
                f"max_seqlen_per_rank to a multiple of {self.local_multiple()}"
            )

    # -- arithmetic ----------------------------------------------------------------------------------------------

    def _cp(self, cp_size: int | None) -> int:
        return self.cp_size if cp_size is None else require_int("cp_size", cp_size, 1)

    @property
    def tp_sp(self) -> int:
        """The ranks a CP-local part is split over again: ``tp_size`` with sequence parallelism, else 1."""
        return self.tp_size if self.sequence_parallel else 1

    def sequence_multiple(self, cp_size: int | None = None) -> int:
        """The multiple every sequence is padded to: ``2 * c`` with per-sequence padding and ``c > 1``, else 1."""
        cp = self._cp(cp_size)
        return 2 * cp if self.pad_sequences and cp > 1 else 1

    def local_multiple(self, cp_size: int | None = None) -> int:
        """The multiple of a rank's CP-local length for CP size ``c`` (the layout's own by default)."""
        cp = self._cp(cp_size)
        n = 1 if self.alignment == "max" else self.alignment
        chunks = 2 if cp > 1 and self.cp_layout != "contiguous" else 1
        return math.lcm(n, self.tp_sp, MXFP8_BLOCK * self.tp_sp if self.mxfp8 else 1, chunks)

    def row_multiple(self, cp_size: int | None = None, extra: int = 1) -> int:
        """The multiple of a packed row's length: ``c * local_multiple(c)``, combined with ``extra`` (a further
        multiple the kernels need) and with ``sequence_multiple(c)`` so that tail padding is a sequence too."""
        cp = self._cp(cp_size)
        extra = require_int("extra", extra, 1)
        return math.lcm(cp * self.local_multiple(cp), extra, self.sequence_multiple(cp))

    def padded_lengths(self, lengths: np.ndarray, cp_size: int | None = None) -> np.ndarray:
        """Each length padded up to ``sequence_multiple(c)``, int64.

        Example: lengths ``[5, 8, 1]``, ``cp_size=2`` with per-sequence padding: ``[8, 8, 4]``.
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        multiple = self.sequence_multiple(cp_size)
        return lengths if multiple == 1 else lengths + -lengths % multiple

    def local_length(self, padded_total: int, cp_size: int | None = None) -> int:
        """The tokens every rank of a group of CP size ``c`` holds for sequences of ``padded_total`` tokens.

        ``max_seqlen_per_rank`` with alignment ``"max"``; else ``padded_total / c`` rounded up to the local
        multiple, at least one multiple (so a group of padding only still holds one padding sequence).
        """
        cp = self._cp(cp_size)
        if self.alignment == "max":
            return self.max_seqlen_per_rank
        multiple = self.local_multiple(cp)
        local = -(-int(padded_total) // cp)
        return max(multiple, -(-local // multiple) * multiple)

    def local_capacity(self, cp_size: int | None = None) -> int:
        """The most tokens a rank may hold: ``max_seqlen_per_rank`` rounded down to the local multiple.

        Raises:
            DataConfigError: no ``max_seqlen_per_rank``, or it is below the local multiple (naming both).
        """
        cp = self._cp(cp_size)
        if self.max_seqlen_per_rank is None:
            raise DataConfigError("the layout has no max_seqlen_per_rank, so it sets no capacity per rank")
        multiple = self.local_multiple(cp)
        if self.max_seqlen_per_rank < multiple:
            raise DataConfigError(
                f"max_seqlen_per_rank {self.max_seqlen_per_rank} is below the CP-local multiple {multiple} "
                f"({self._reasons(cp)}), so no aligned length fits on a rank; raise it to at least {multiple}"
            )
        return self.max_seqlen_per_rank // multiple * multiple

    def check_row_length(self, seq_length: int) -> None:
        """Refuse fixed rows of ``seq_length`` tokens (Indexed rows, never padded) that this layout cannot cut.

        Raises:
            DataConfigError: a layout that pads every sequence (fixed rows are not padded per sequence), or a
                ``seq_length`` that is not a multiple of the row multiple (naming the nearest valid lengths).
        """
        if self.pad_sequences and self.cp_size > 1:
            raise DataConfigError(
                f"the {self.cp_layout} layout cuts every sequence into {2 * self.cp_size} chunks, so each must be "
                "padded to that multiple, but fixed rows (Indexed rows, documents cut at EOD tokens) are never "
                "padded per sequence; use cp_layout contiguous or zigzag for Indexed sources"
            )
        multiple = self.row_multiple()
        if seq_length % multiple == 0:
            return
        lower = seq_length - seq_length % multiple
        such_as = " or ".join(str(value) for value in (lower, lower + multiple) if value > 0)
        raise DataConfigError(
            f"the Indexed rows hold {seq_length} tokens (seq_length), but the delivery layout ({self.describe()}) cuts "
            f"rows into multiples of {multiple}; set data_config.seq_length to a multiple of {multiple}, such as "
            f"{such_as}"
        )

    def _reasons(self, cp_size: int | None = None) -> str:
        cp = self._cp(cp_size)
        return (
            f"alignment {self.alignment!r}, sequence_parallel {self.sequence_parallel} with tp {self.tp_size}, "
            f"mxfp8 {self.mxfp8}, cp {cp} in the {self.cp_layout} layout"
        )

    def describe(self) -> str:
        """One line for logs and messages."""
        return (
            f"cp {self.cp_size} ({self.cp_layout}, per-sequence padding {'on' if self.pad_sequences else 'off'}), "
            f"tp {self.tp_size}{' with sequence parallelism' if self.sequence_parallel else ''}"
            f"{', mxfp8' if self.mxfp8 else ''}, alignment {self.alignment!r}, rows a multiple of "
            f"{self.row_multiple()}"
        )


# -- boundaries ---------------------------------------------------------------------------------------------------


def shown_boundaries(values: np.ndarray) -> list:
    """Boundaries for a message: all of them up to 12, else the first six and the last five."""
    return values.tolist() if len(values) <= 12 else [*values[:6].tolist(), "...", *values[-5:].tolist()]


def _boundary_problem(values: np.ndarray, total: int, row_length: int | None) -> str:
    """Which rule ``values`` breaks, with the entry that breaks it; empty when none."""
    if len(values) < 2:
        return f"it must hold at least [0, {total}] (one sequence), but has {len(values)} entries"
    if values[0] != 0:
        return f"the leading entry must be 0, but it is {values[0]}"
    if (steps := np.diff(values) <= 0).any():
        at = int(np.argmax(steps)) + 1
        return f"it must strictly increase (no empty sequence), but entry {at} is {values[at]} after {values[at - 1]}"
    if values[-1] != total:
        return f"the last entry must be the token count {total}, but it is {values[-1]}"
    if row_length is not None and total > row_length:
        wanted = np.arange(row_length, total, row_length)
        found = values[np.minimum(np.searchsorted(values, wanted), len(values) - 1)]
        if (missing := wanted[found != wanted]).size:
            return (
                f"every row end must be a boundary (no sequence crosses rows of {row_length}), but {missing[0]} is not"
            )
    return ""


def _integer_1d(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return (
            value.ndim == 1 and not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool
        )
    array = np.asarray(value)
    return array.ndim == 1 and (np.issubdtype(array.dtype, np.integer) or array.size == 0)


def check_cu_seq_lens(
    cu_seq_lens: Any, total_tokens: int, where: str, *, row_length: int | None = None
) -> torch.Tensor:
    """``cu_seq_lens`` as an int32 tensor, once checked to be the boundaries of ``total_tokens`` tokens.

    The one rule, everywhere: 1-D integers, a leading 0, strictly increasing (a zero-length span is refused),
    ending at the token count, every row end a boundary when ``row_length`` is given, and fitting int32.

    Args:
        cu_seq_lens: 1-D integers (tensor, array or list).
        total_tokens: the token count they must end at (``R * T`` for ``R`` rows of ``T``).
        where: what they are, for the message (e.g. ``"the Online collator's cu_seq_lens"``).
        row_length: when given, every multiple of it below ``total_tokens`` must be a boundary (row ends).

    Returns:
        The same values, int32; the input tensor itself when it already is a 1-D int32 tensor.

    Raises:
        DataFileError: naming the rule broken and the entry that breaks it.

    Example: ``check_cu_seq_lens([0, 3, 3, 8], 8, "x")`` raises "it must strictly increase (no empty sequence), but
    entry 2 is 3 after 3".
    """
    total = require_int("total_tokens", total_tokens, 1)
    if not _integer_1d(cu_seq_lens):
        shape = list(getattr(cu_seq_lens, "shape", np.shape(cu_seq_lens)))
        raise DataFileError(
            f"{where}: cu_seq_lens must be a 1-D sequence of integers, got {type(cu_seq_lens).__name__} of shape "
            f"{shape}; {_FIX}"
        )
    tensor = cu_seq_lens if isinstance(cu_seq_lens, torch.Tensor) else None
    values = tensor.detach().cpu().numpy() if tensor is not None else np.asarray(cu_seq_lens)
    values = values.astype(np.int64, copy=False)
    if total > _INT32_MAX:
        raise DataFileError(
            f"{where}: the batch holds {total} tokens, more than int32 cu_seq_lens can address; use smaller batches"
        )
    if problem := _boundary_problem(values, total, row_length):
        raise DataFileError(
            f"{where} {shown_boundaries(values)} are not sequence boundaries of {total} tokens: {problem}; {_FIX}"
        )
    if tensor is not None and tensor.dtype == torch.int32:
        return tensor
    return tensor.to(torch.int32) if tensor is not None else torch.from_numpy(values.astype(np.int32))
