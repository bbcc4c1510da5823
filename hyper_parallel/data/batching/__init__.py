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
    calculate_num_micro_batches,
)
from hyper_parallel.data.batching.data_collator import MicroBatchGroupCollator
from hyper_parallel.data.batching.data_schedule import (
    SCHEDULER_CLASSES,
    BasePackingScheduler,
    ComputeBalancedScheduler,
    DefaultDynamicCPScheduler,
    DpBalancedScheduler,
    get_batch_on_this_cp_rank,
    get_batch_on_this_rank_for_sequence_packing,
    wrap_data_iterator,
)
from hyper_parallel.data.batching.elastic import merge_rank_states
from hyper_parallel.data.batching.get_batch import ParallelBatch, ScheduledStep
from hyper_parallel.data.batching.loader_options import BatchLayout, LoaderOptions, SamplerOptions, WorkerOptions
from hyper_parallel.data.batching.packing_policy import PackingPolicy, SampleCodec
from hyper_parallel.data.batching.token_batcher import TextTokenBatcher

__all__ = [
    "SCHEDULER_CLASSES",
    "BasePackingScheduler",
    "ComputeBalancedScheduler",
    "DefaultDynamicCPScheduler",
    "DpBalancedScheduler",
    "ScheduledStep",
    "get_batch_on_this_cp_rank",
    "get_batch_on_this_rank_for_sequence_packing",
    "wrap_data_iterator",
    "Batch",
    "BatchLayout",
    "DynamicBatchDataLoader",
    "FixedBatchDataLoader",
    "IndexedStackingCollator",
    "LoaderOptions",
    "MicroBatchGroupCollator",
    "PackingPolicy",
    "ParallelBatch",
    "SampleCodec",
    "SamplerOptions",
    "TextPackingCollator",
    "TextTokenBatcher",
    "WorkerOptions",
    "build_indexed_collate_fn",
    "build_online_text_collate_fn",
    "calculate_num_micro_batches",
    "merge_rank_states",
]
