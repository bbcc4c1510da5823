"""Specification of the reserved multimodal package: every interface says it is not available, and how to go on."""

from __future__ import annotations

import importlib

import pytest

import hyper_parallel.data
from hyper_parallel.data.vlm.build_data_transform import build_vlm_data_transform
from hyper_parallel.data.vlm.build_processor import build_processor
from hyper_parallel.data.vlm.collator import build_vlm_collate_fn
from hyper_parallel.data.vlm.constants import (
    AUDIO_TOKEN_INDEX,
    IMAGE_TOKEN_INDEX,
    VIDEO_TOKEN_INDEX,
    MultimodalNotAvailableError,
)
from hyper_parallel.data.vlm.dataset import VLMDataset
from hyper_parallel.data.vlm.get_batch import VLMParallelBatch

CALLS = {
    "build_processor.build_processor": lambda: build_processor("some/processor"),
    "build_data_transform.build_vlm_data_transform": lambda: build_vlm_data_transform(max_seq_len=64),
    "dataset.VLMDataset": lambda: VLMDataset("data/*.jsonl"),
    "collator.build_vlm_collate_fn": lambda: build_vlm_collate_fn(),
    "get_batch.VLMParallelBatch": lambda: VLMParallelBatch(attention_mode="packed"),
}


@pytest.mark.parametrize("interface", sorted(CALLS))
def test_every_reserved_interface_names_itself_and_the_text_path(interface):
    with pytest.raises(MultimodalNotAvailableError) as raised:
        CALLS[interface]()
    message = str(raised.value)
    assert f"hyper_parallel.data.vlm.{interface} is not available yet" in message
    assert "hyper_parallel.data.text.build_dataset" in message
    assert isinstance(raised.value, NotImplementedError)  # what callers probing for support catch


def test_the_package_lists_the_files_of_the_design_and_is_not_exported_flat():
    for module in ("build_data_transform", "build_processor", "collator", "dataset", "get_batch", "constants"):
        importlib.import_module(f"hyper_parallel.data.vlm.{module}")
    assert not hasattr(hyper_parallel.data, "VLMDataset")
    assert not hasattr(hyper_parallel.data, "vlm") or "vlm" not in getattr(hyper_parallel.data, "__all__", ())


def test_placeholder_ids_are_distinct_negatives_apart_from_ignore_index():
    from hyper_parallel.data.constants import IGNORE_INDEX

    ids = [IMAGE_TOKEN_INDEX, VIDEO_TOKEN_INDEX, AUDIO_TOKEN_INDEX]
    assert len(set(ids)) == 3 and all(i < 0 for i in ids) and IGNORE_INDEX not in ids
