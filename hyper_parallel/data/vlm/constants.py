"""Cross-modal token index constants, and the error every reserved multimodal interface raises.

Owns: the negative ids that stand for a modality's features inside ``input_ids`` until a model's embedding layer
replaces them (LLaVA's convention: ids no vocabulary uses), and ``not_available``. Not responsible for: processing
images, video or audio.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = [
    "AUDIO_TOKEN_INDEX",
    "IMAGE_TOKEN_INDEX",
    "MultimodalNotAvailableError",
    "VIDEO_TOKEN_INDEX",
    "not_available",
]

IMAGE_TOKEN_INDEX = -200  # LLaVA's image placeholder id
VIDEO_TOKEN_INDEX = -201
AUDIO_TOKEN_INDEX = -202


class MultimodalNotAvailableError(NotImplementedError):
    """A multimodal (VLM / omni) interface was called; only its name is reserved so far."""


def not_available(interface: str) -> NoReturn:
    """Raise the error of the reserved multimodal ``interface``, naming what works today."""
    raise MultimodalNotAvailableError(
        f"hyper_parallel.data.vlm.{interface} is not available yet: the multimodal (VLM / omni) path keeps its "
        "interfaces only, with no dataset, transform or collator implementation. Text pipelines are complete: use "
        "hyper_parallel.data.text.build_dataset (Online or Indexed) with hyper_parallel.data.batching"
    )
