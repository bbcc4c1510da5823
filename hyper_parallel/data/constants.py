"""Constants shared across the data pipeline.

``IGNORE_INDEX`` marks a label that carries no loss (prompts, non-assistant turns, padding). Labels are shifted once,
before collation: the Online transforms return ``labels[i]`` as the token the model must predict after reading
``input_ids[: i + 1]``, and the batches of both paths (``batching.batch.Batch``) keep that convention. The loss is
``cross_entropy(logits[i], labels[i])`` with ``ignore_index=IGNORE_INDEX``; no further shift happens downstream.
"""

from __future__ import annotations

__all__ = ["IGNORE_INDEX"]

# PyTorch's default ``ignore_index`` for ``cross_entropy``.
IGNORE_INDEX = -100
