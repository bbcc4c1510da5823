"""Packing the scheduler's planned groups into batches.

Owns: ``pack_group``, which turns one planned group's sequences into the packed ``Batch`` its ranks share (each
sequence padded for CP inside its own boundaries, one padding sequence filling the row). Not responsible for:
planning which sequences share a group (``parallel.scheduling``), moving sequences between ranks or cutting the row
over CP ranks (``parallel.data_schedule``, ``parallel.batch_parallel``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.build_collate_fn import TextPackingCollator
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, require_int

__all__ = ["pack_group"]


def pack_group(
    sequences: Sequence[tuple[torch.Tensor, torch.Tensor]], *, cp_size: int, local_length: int, pad_token_id: int
) -> Batch:
    """One group's sequences packed into the ``[1, P]`` row its ranks share, ``P = cp_size * local_length``.

    Each sequence is padded at its end to a multiple of ``2 * cp_size`` (when ``cp_size > 1``), inside its own
    boundaries; one padding sequence fills the row up to ``P``. Padding holds ``pad_token_id`` and
    ``IGNORE_INDEX`` labels. A group without sequences is one padding sequence.

    Args:
        sequences: ``(input_ids, labels)`` of each sequence, 1-D int64 of equal length, in packing order.
        cp_size: the group's CP size.
        local_length: every rank's CP-local length (``local_packed_length``; even when ``cp_size > 1``).
        pad_token_id: the padding's input id.

    Returns:
        A ``Batch`` with ``input_ids``/``labels`` ``[1, P]``, ``cu_seq_lens`` int32 and the extra
        ``local_cp_size`` (int64 ``[1]``).

    Raises:
        DataConfigError: a size below 1, an odd ``local_length`` with ``cp_size > 1``, or sequences whose padded
            lengths exceed ``P``.
        DataFileError: a sequence that is empty or whose ids and labels differ in length.

    Example:
        lengths 3 and 2, ``cp_size=2, local_length=6``: P = 12, ``cu_seq_lens = [0, 4, 8, 12]``.
    """
    cp = require_int("cp_size", cp_size, 1)
    local = require_int("local_length", local_length, 1)
    multiple = 2 * cp if cp > 1 else 1
    if local * cp % multiple:
        raise DataConfigError(
            f"local_length {local} with cp_size {cp} gives a row of {local * cp} tokens, not a multiple of "
            f"2 * cp_size = {multiple} that the zigzag_thd layout needs; use an even local_length (local_packed_length)"
        )
    row = local * cp
    extras = {"local_cp_size": torch.tensor([cp], dtype=torch.int64)}
    if not sequences:
        return Batch(
            input_ids=torch.full((1, row), pad_token_id, dtype=torch.int64),
            labels=torch.full((1, row), IGNORE_INDEX, dtype=torch.int64),
            cu_seq_lens=torch.tensor([0, row], dtype=torch.int32),
            extras=extras,
        )
    samples = [
        {"input_ids": np.asarray(ids).reshape(-1), "labels": np.asarray(labels).reshape(-1)}
        for ids, labels in sequences
    ]
    lengths = np.fromiter((len(sample["input_ids"]) for sample in samples), dtype=np.int64, count=len(samples))
    total = int((lengths + -lengths % multiple).sum())
    if total > row:
        raise DataConfigError(
            f"the group's {len(samples)} sequences hold {total} tokens once padded for CP size {cp}, more than the "
            f"{row} of its row (local_length {local} x cp_size {cp}); the schedule and local_packed_length disagree"
        )
    packed = TextPackingCollator(alignment=row, pad_token_id=pad_token_id, pad_each_sequence_to=multiple)(samples)
    return Batch(input_ids=packed.input_ids, labels=packed.labels, cu_seq_lens=packed.cu_seq_lens, extras=extras)
