"""Reserved: the multimodal chat transform (messages with images, video or audio to model samples).

Owns: the name ``build_vlm_data_transform``. Not responsible for: text conversations
(``text.build_data_transform``).
"""

from __future__ import annotations

from typing import Any, NoReturn

from hyper_parallel.data.vlm.constants import not_available

__all__ = ["build_vlm_data_transform"]


def build_vlm_data_transform(processor: Any = None, **options: Any) -> NoReturn:
    """Build the multimodal chat transform. Not available yet: raises ``MultimodalNotAvailableError``."""
    not_available("build_data_transform.build_vlm_data_transform")
