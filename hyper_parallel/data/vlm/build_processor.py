"""Reserved: building a multimodal processor (tokenizer plus image/video/audio feature extractors).

Owns: the name ``build_processor``. Not responsible for: text tokenizers (``text.build_tokenizer``).
"""

from __future__ import annotations

from typing import Any, NoReturn

from hyper_parallel.data.vlm.constants import not_available

__all__ = ["build_processor"]


def build_processor(processor_name_or_path: str, **options: Any) -> NoReturn:
    """Load a multimodal processor. Not available yet: raises ``MultimodalNotAvailableError``."""
    not_available("build_processor.build_processor")
