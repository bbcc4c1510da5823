"""Left-to-right (causal LM) fields of one fixed-length sample: loss mask, position ids, dense attention mask.

Owns: the vectorised computation, identical to megatron-core's ``_get_ltor_masks_and_position_ids``. Not
responsible for: pad handling (the datasets) or packed-sequence metadata (``batching``).

Worked example, tokens ``[5, 0, 7, 8]`` with EOD ``0``:

* ``segment = [0, 0, 1, 1]``: the EOD belongs to the document it ends, so segments start *after* each EOD;
* reset position ids: ``[0, 1, 0, 1]``;
* reset attention mask: token 2 sees tokens 2 only; token 3 sees 2 and 3 (True in the mask means "masked out");
* ``eod_mask_loss``: loss mask ``[1, 0, 1, 1]`` (no prediction is trained from the EOD input position).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LtorFields", "ltor_fields"]


@dataclass(frozen=True)
class LtorFields:
    """``loss_mask`` float32 [S], ``position_ids`` int64 [S], ``attention_mask`` bool [1, S, S] or None."""

    loss_mask: np.ndarray
    position_ids: np.ndarray
    attention_mask: np.ndarray | None


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
    segment = None
    if reset_position_ids or reset_attention_mask:
        # segment[j] = number of EODs strictly before j
        segment = np.concatenate(([0], np.cumsum(is_eod[:-1], dtype=np.int64))) if length else positions
    if reset_position_ids and length:
        # position = distance from the first token after the latest earlier EOD
        starts = np.concatenate(([0], np.flatnonzero(is_eod) + 1))
        positions = positions - starts[segment]
    attention_mask = None
    if create_attention_mask:
        visible = np.tril(np.ones((length, length), dtype=bool))
        if reset_attention_mask:
            visible &= segment[:, None] == segment[None, :]
        attention_mask = ~visible[None]
    return LtorFields(loss_mask, positions, attention_mask)
