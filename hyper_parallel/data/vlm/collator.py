"""Reserved: collating multimodal samples (token ids with media features and their placements).

Owns: the name ``build_vlm_collate_fn``. Not responsible for: text batches (``batching.build_collate_fn``).
"""

from __future__ import annotations

from typing import Any, NoReturn

from hyper_parallel.data.vlm.constants import not_available

__all__ = ["build_vlm_collate_fn"]


def build_vlm_collate_fn(processor: Any = None, **options: Any) -> NoReturn:
    """Build the multimodal collator. Not available yet: raises ``MultimodalNotAvailableError``."""
    not_available("collator.build_vlm_collate_fn")
