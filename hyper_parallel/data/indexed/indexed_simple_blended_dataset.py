"""``SimpleBlendedDataset``: packed-record sources taken in turn (``inter``) or one after another (``intra``).

Owns: the ``(dataset_id, sample_id)`` locations of the two simple blends. Only for offline-packed records
(``is_dataset_from_mr``), where no source is repeated. Not responsible for: weighted blending
(``indexed_blended_dataset``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hyper_parallel.data.dataset_logging import brief_list, get_logger
from hyper_parallel.data.errors import DataConfigError

__all__ = ["SimpleBlendedDataset", "simple_blend_locations"]

logger = get_logger(__name__)


def simple_blend_locations(sizes: Sequence[int], mode: str) -> np.ndarray:
    """``[n, 2]`` int64 ``(dataset_id, sample_id)`` rows.

    ``intra``: every sample of source 0, then of source 1, ... ``inter``: one sample from each source that still
    has samples, in source order, round after round. Example: sizes ``[3, 1]`` give ``inter`` rows
    ``(0,0) (1,0) (0,1) (0,2)`` and ``intra`` rows ``(0,0) (0,1) (0,2) (1,0)``.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    dataset_ids = np.repeat(np.arange(len(sizes)), sizes)
    sample_ids = np.arange(len(dataset_ids)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    if mode == "intra":
        order = np.arange(len(dataset_ids))
    elif mode == "inter":
        order = np.lexsort((dataset_ids, sample_ids))  # by round (sample id), then by source
    else:
        raise DataConfigError(f"simple blend mode must be 'inter' or 'intra', got {mode!r}")
    return np.stack((dataset_ids[order], sample_ids[order]), axis=1)


class SimpleBlendedDataset(torch.utils.data.Dataset):
    """Packed-record sources blended ``inter`` (round-robin) or ``intra`` (concatenated).

    Args:
        datasets: ``GPTFromMRDataset`` sources of one split.
        mode: ``"inter"`` or ``"intra"``.
        size: samples wanted; None for all; more than the sources hold is an error.
    """

    def __init__(self, datasets: Sequence, mode: str, size: int | None = None) -> None:
        sizes = [len(d) for d in datasets]
        locations = simple_blend_locations(sizes, mode)
        if size is not None and size > len(locations):
            raise DataConfigError(
                f"the {mode} blend of {len(sizes)} packed sources holds {len(locations)} records (sizes {sizes}) "
                f"but {size} samples were requested; packed records are not repeated"
            )
        self.datasets = list(datasets)
        self.mode = mode
        self._locations = locations if size is None else locations[:size]
        self.unique_identifiers = {
            "class": "SimpleBlendedDataset",
            "mode": mode,
            "datasets": [d.unique_identifiers for d in self.datasets],
            "size": len(self._locations),
        }
        logger.info(
            "%s %s blend: %s records of %d packed sources, records per source %s",
            getattr(self.datasets[0], "split", "?") if self.datasets else "?",
            mode,
            f"{len(self._locations):,}",
            len(self.datasets),
            brief_list(np.bincount(self._locations[:, 0], minlength=len(sizes)).tolist()),
        )

    @property
    def eod_token_id(self) -> int | None:
        """The EOD id of the sources (one tokenizer builds them all)."""
        return getattr(self.datasets[0], "eod_token_id", None) if self.datasets else None

    def __len__(self) -> int:
        return len(self._locations)

    def __getitem__(self, idx: int) -> dict:
        dataset_id, sample_id = (int(v) for v in self._locations[idx])
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][sample_id]}

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        return [self[i] for i in indices]
