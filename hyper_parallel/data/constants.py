"""Constants shared across the data pipeline.

Label convention (Online path): transforms return labels already shifted, so ``labels[i]`` is the token the model
must predict after reading ``input_ids[: i + 1]``, and ``IGNORE_INDEX`` marks positions that carry no loss
(prompts, non-assistant turns, padding). The loss is ``cross_entropy(logits[i], labels[i])`` with
``ignore_index=IGNORE_INDEX``; no further shift happens downstream.
"""

from __future__ import annotations

__all__ = ["IGNORE_INDEX"]

# PyTorch's default ``ignore_index`` for ``cross_entropy``.
IGNORE_INDEX = -100
