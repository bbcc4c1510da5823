"""Left-to-right (causal LM) fields of fixed-length rows: sequence boundaries, loss mask, position ids, dense mask.

Owns: the vectorised computation, identical to megatron-core's ``_get_ltor_masks_and_position_ids``, and the one
function that turns "a sequence ends after this position" marks into sequence boundaries (``cu_seq_lens_from_ends``),
shared by ``ltor_fields`` and the Indexed collator. Not responsible for: pad handling (the datasets), which
positions end a sequence (the caller's rule: after each EOD input token here), or batching.

Worked example, tokens ``[5, 0, 7, 8]`` with EOD ``0``:

* boundaries ``[0, 2, 4]``: the EOD belongs to the document it ends, so a sequence starts *after* each EOD, and
  the row end closes the last one; ``segment = [0, 0, 1, 1]``;
* reset position ids: ``[0, 1, 0, 1]``;
* reset attention mask: token 2 sees tokens 2 only; token 3 sees 2 and 3 (True in the mask means "masked out");
* ``eod_mask_loss``: loss mask ``[1, 0, 1, 1]`` (no prediction is trained from the EOD input position).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LtorFields", "cu_seq_lens_from_ends", "ltor_fields", "positions_within_sequences"]


@dataclass(frozen=True)
class LtorFields:
    """``loss_mask`` float32 [S], ``position_ids`` int64 [S], ``attention_mask`` bool [1, S, S] or None."""

    loss_mask: np.ndarray
    position_ids: np.ndarray
    attention_mask: np.ndarray | None


def cu_seq_lens_from_ends(ends_after: np.ndarray) -> np.ndarray:
    """Boundaries of the sequences of fixed-length rows, over the rows flattened one after another.

    A sequence ends after every position marked in ``ends_after`` and at the end of every row, so no sequence
    crosses a row. The marks are the caller's rule: ``tokens == eod`` for megatron-core's documents (the EOD ends
    the document it belongs to), or any other "a sequence ends after this position" test.

    Args:
        ends_after: bool ``[T]`` (one row) or ``[R, T]``.

    Returns:
        int64 ``[K + 1]``: 0, then the flattened offset just after each sequence (``r * T + j + 1`` for a mark at
        row ``r``, column ``j``); strictly increasing, ending at ``R * T``. ``[0]`` for no positions.

    Example:
        marks ``[[0, 1, 0, 0], [1, 0, 0, 1]]`` give ``[0, 2, 4, 5, 8]``: row 0 holds sequences of 2 and 2 tokens,
        row 1 of 1 and 3 (its final mark coincides with the row end).
    """
    ends = np.array(ends_after, dtype=bool)  # a copy: the row ends are marked in it below
    if ends.size == 0:
        return np.zeros(1, dtype=np.int64)
    ends[..., -1] = True
    return np.concatenate((np.zeros(1, dtype=np.int64), np.flatnonzero(ends) + 1))


def positions_within_sequences(cu_seq_lens: np.ndarray) -> np.ndarray:
    """int64 ``[cu_seq_lens[-1]]``: each position's distance from the start of its sequence.

    Example: boundaries ``[0, 2, 5]`` give ``[0, 1, 0, 1, 2]``.
    """
    bounds = np.asarray(cu_seq_lens, dtype=np.int64)
    return np.arange(bounds[-1], dtype=np.int64) - np.repeat(bounds[:-1], np.diff(bounds))


def ltor_fields(
    tokens: np.ndarray,
    eod: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> LtorFields:
    """Compute the LTR fields of one sample of token ids."""
    length = len(tokens)
    is_eod = tokens == eod
    loss_mask = np.ones(length, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    positions = np.arange(length, dtype=np.int64)
    if reset_position_ids or reset_attention_mask:
        bounds = cu_seq_lens_from_ends(is_eod)
    if reset_position_ids:
        positions = positions_within_sequences(bounds)
    attention_mask = None
    if create_attention_mask:
        visible = np.tril(np.ones((length, length), dtype=bool))
        if reset_attention_mask:
            segment = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))  # the sequence holding each position
            visible &= segment[:, None] == segment[None, :]
        attention_mask = ~visible[None]
    return LtorFields(loss_mask, positions, attention_mask)
