"""Batching: choose the samples of each micro-batch (loaders) and turn them into tensors (collators)."""

from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.build_collate_fn import (
    IndexedStackingCollator,
    TextPackingCollator,
    build_indexed_collate_fn,
    build_online_text_collate_fn,
)
from hyper_parallel.data.batching.build_dataloader import (
    DynamicBatchDataLoader,
    FixedBatchDataLoader,
    TextTokenBatcher,
    calculate_num_micro_batches,
)

__all__ = [
    "Batch",
    "DynamicBatchDataLoader",
    "FixedBatchDataLoader",
    "IndexedStackingCollator",
    "TextPackingCollator",
    "TextTokenBatcher",
    "build_indexed_collate_fn",
    "build_online_text_collate_fn",
    "calculate_num_micro_batches",
]
