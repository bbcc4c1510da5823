"""Vision-language and omni-modal data: reserved interfaces, not available yet.

Owns: the names a multimodal pipeline will use (``build_processor``, ``build_vlm_data_transform``,
``VLMDataset``, ``build_vlm_collate_fn``, ``VLMParallelBatch``) and the cross-modal token index constants. Each
callable raises ``MultimodalNotAvailableError`` saying what to use today; none pretends to work. Not exported from
``hyper_parallel.data``. Not responsible for: text data, which the ``text``, ``indexed`` and ``batching`` packages
serve in full.
"""

from __future__ import annotations

from hyper_parallel.data.vlm.constants import MultimodalNotAvailableError, not_available

__all__ = ["MultimodalNotAvailableError", "not_available"]
