"""``LazyDatasetProxy``: build a mid-level dataset on first use (``data_lazy_load: true``).

Owns: deferring construction until the first ``len()``, item access or ``unique_identifiers``, then reusing
the built dataset. With thousands of prefixes, start-up then opens only what training touches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hyper_parallel.data.dataset_logging import get_logger

__all__ = ["LazyDatasetProxy"]

logger = get_logger(__name__)


class LazyDatasetProxy(torch.utils.data.Dataset):
    """Stands in for the dataset that ``factory`` builds; nothing is opened before it is needed.

    Args:
        factory: builds the real dataset (called at most once).
        description: shown by ``repr`` before the dataset is built.
    """

    def __init__(self, factory: Callable[[], Any], description: str) -> None:
        self._factory = factory
        self._dataset = None
        self.description = description

    @property
    def is_built(self) -> bool:
        return self._dataset is not None

    @property
    def dataset(self):
        """The real dataset, built now if needed."""
        if self._dataset is None:
            self._dataset = self._factory()
            self._factory = None
            logger.debug("built on first use: %s", self.description)
        return self._dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx):
        return self.dataset[idx]

    def __getitems__(self, indices: Sequence[int]) -> list:
        return self.dataset.__getitems__(indices)

    @property
    def unique_identifiers(self) -> dict:
        return self.dataset.unique_identifiers

    def __getattr__(self, name: str):
        # Other attributes (dataset_path, split, ...) come from the real dataset.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __repr__(self) -> str:
        state = repr(self._dataset) if self.is_built else "not built yet"
        return f"LazyDatasetProxy({self.description}: {state})"
