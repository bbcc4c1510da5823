"""Reserved: multimodal batches to model inputs on every DP x CP x TP rank.

Owns: the name ``VLMParallelBatch``. Not responsible for: text batches (``batching.get_batch.ParallelBatch``).
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.data.vlm.constants import not_available

__all__ = ["VLMParallelBatch"]


class VLMParallelBatch:
    """Multimodal delivery to parallel ranks. Not available yet: constructing one raises
    ``MultimodalNotAvailableError``."""

    def __init__(self, **options: Any) -> None:
        not_available("get_batch.VLMParallelBatch")
