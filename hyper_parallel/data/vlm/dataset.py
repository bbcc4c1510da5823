"""Reserved: the multimodal source dataset (records with media files or bytes).

Owns: the name ``VLMDataset``. Not responsible for: text sources (``text.online``, ``indexed``).
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.data.vlm.constants import not_available

__all__ = ["VLMDataset"]


class VLMDataset:
    """A multimodal source dataset. Not available yet: constructing one raises ``MultimodalNotAvailableError``."""

    def __init__(self, data_path: Any = None, **options: Any) -> None:
        not_available("dataset.VLMDataset")
