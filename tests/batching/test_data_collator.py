"""The micro-batch group collator: a plain torch DataLoader fetching whole steps gives the micro-batches
FixedBatchDataLoader gives one at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from indexed.test_index_cache import write_corpus

from hyper_parallel.data.batching import (
    FixedBatchDataLoader,
    MicroBatchGroupCollator,
    build_indexed_collate_fn,
    build_online_text_collate_fn,
    calculate_num_micro_batches,
)
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset, build_online_text_dataset


def assert_same_batches(steps: list, micro_batches: list) -> None:
    flat = [batch for step in steps for batch in step]
    assert len(flat) == len(micro_batches) > 0
    for ours, expected in zip(flat, micro_batches, strict=True):
        assert torch.equal(ours.input_ids, expected.input_ids)
        assert torch.equal(ours.labels, expected.labels)
        assert torch.equal(ours.cu_seq_lens, expected.cu_seq_lens)


def test_indexed_steps_hold_the_fixed_loaders_micro_batches(tmp_path, tokenizer):
    prefix = write_corpus(tmp_path / "corpus_text_document", num_documents=60, seed=9)
    train, _, _ = build_indexed_text_dataset(
        prefix,
        {"seq_length": 16, "split": "100, 0, 0", "data_cache_path": str(tmp_path / "cache")},
        tokenizer=tokenizer,
    )
    micro_batch_size, global_batch_size = 2, 6
    count = calculate_num_micro_batches(global_batch_size, micro_batch_size, dp_world_size=1)
    collate = build_indexed_collate_fn(tokenizer)
    steps = list(
        torch.utils.data.DataLoader(
            train,
            batch_size=count * micro_batch_size,
            drop_last=True,
            collate_fn=MicroBatchGroupCollator(count, collate),
            num_workers=2,  # the collator runs in the workers: it pickles
        )
    )
    assert all(len(step) == 3 for step in steps)
    fixed = FixedBatchDataLoader(
        train, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, collate_fn=collate
    )
    assert_same_batches(steps, list(fixed)[: 3 * len(steps)])


def test_online_conversations_are_unwrapped_from_their_records(tmp_path, conversation_path, hf_cache_dir, tokenizer):
    dataset = build_online_text_dataset(
        conversation_path,
        {"data_type": "conversation", "max_seq_len": 512},
        {"dataset_type": "mapping", "cache_dir": str(hf_cache_dir)},
        tokenizer=tokenizer,
    )
    collate = build_online_text_collate_fn(tokenizer)
    steps = list(
        torch.utils.data.DataLoader(
            dataset, batch_size=4, drop_last=True, collate_fn=MicroBatchGroupCollator(2, collate)
        )
    )
    fixed = FixedBatchDataLoader(dataset, micro_batch_size=2, collate_fn=collate)
    assert_same_batches(steps, list(fixed)[: 2 * len(steps)])


def test_steps_that_cannot_be_cut_say_how_to_size_them():
    collator = MicroBatchGroupCollator(3)
    sample = {"input_ids": np.arange(4)}
    with pytest.raises(DataConfigError, match=r"a step of 4 samples cannot be cut into 3 .* batch_size"):
        collator([sample] * 4)
    with pytest.raises(DataConfigError, match="a step of 0 samples"):
        collator([])
    with pytest.raises(DataFileError, match="sample 1 of the step is a record of 2 ModelSamples"):
        collator([[sample], [sample, sample], [sample]])
    with pytest.raises(DataFileError, match="sample 0 of the step is a int"):
        collator([1, 2, 3])
    with pytest.raises(DataConfigError, match="num_micro_batches"):
        MicroBatchGroupCollator(0)
    with pytest.raises(DataConfigError, match="collate_fn must be callable"):
        MicroBatchGroupCollator(2, "default")
    groups = collator([[{"x": torch.tensor(i)}] for i in range(6)])  # default_collate, in order
    assert [group["x"].tolist() for group in groups] == [[0, 1], [2, 3], [4, 5]]
