"""Whole pipelines built from YAML configs: the Online config with both sources and both loaders, and Indexed."""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.data.batching import DynamicBatchDataLoader, FixedBatchDataLoader
from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.text.transform_dataset import IterableTransformDataset, TransformDataset

from .resume_check import check_exact_resume

ONLINE_CONFIG = """
dataset:
  _target_: hyper_parallel.data.text.build_dataset.build_online_text_dataset
  data_path: {data_path}
  data_transform:
    _target_: hyper_parallel.data.text.build_data_transform.build_llm_data_transform
    data_type: plaintext
    text_keys: text
    max_seq_len: {max_seq_len}
  data_config:
    dataset_type: {dataset_type}
    cache_dir: {cache_dir}
dataloader:
  _target_: hyper_parallel.data.batching.{loader}
{loader_options}
collate_fn:
  _target_: hyper_parallel.data.batching.build_online_text_collate_fn
get_batch:
  _target_: hyper_parallel.data.batching.ParallelBatch
  source_type: online
"""


def online_config(tmp_path, plaintext_path, hf_cache_dir, *, dataset_type, loader):
    text = ONLINE_CONFIG.format(
        data_path=plaintext_path,
        cache_dir=hf_cache_dir,
        dataset_type=dataset_type,
        loader=loader,
        max_seq_len=4096 if loader == "FixedBatchDataLoader" else 64,
        loader_options="  min_buffered_samples: 8" if loader == "DynamicBatchDataLoader" else "",
    )
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("loader", ["DynamicBatchDataLoader", "FixedBatchDataLoader"])
@pytest.mark.parametrize("dataset_type", ["mapping", "iterable"])
def test_the_online_config_builds_and_iterates_with_either_switch(
    dataset_type, loader, tmp_path, plaintext_path, hf_cache_dir, tokenizer_path
):
    config = online_config(tmp_path, plaintext_path, hf_cache_dir, dataset_type=dataset_type, loader=loader)

    def make():
        return build_dataloaders(
            config, tokenizer=tokenizer_path, micro_batch_size=2, cp_size=2, tp_size=2, sequence_parallel=True
        ).train

    loaders = build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=2)
    assert loaders.valid is None and loaders.test is None
    train = make()
    assert (
        type(train)
        is {"DynamicBatchDataLoader": DynamicBatchDataLoader, "FixedBatchDataLoader": FixedBatchDataLoader}[loader]
    )
    expected_source = TransformDataset if dataset_type == "mapping" else IterableTransformDataset
    assert isinstance(train.dataset, expected_source)
    batches = check_exact_resume(make, stop_points=[2])
    for batch in batches:
        # cp 2 x tp 2 with sequence parallel: every packed length is a multiple of 4
        assert len(batch["input_ids"][0]) % 4 == 0
        assert batch["cu_seq_lens"][-1] == len(batch["input_ids"][0])


def test_runtime_facts_reach_the_nodes_that_name_them(tmp_path, plaintext_path, hf_cache_dir, tokenizer_path):
    config = online_config(
        tmp_path, plaintext_path, hf_cache_dir, dataset_type="iterable", loader="FixedBatchDataLoader"
    )
    loaders = build_dataloaders(
        config, tokenizer=tokenizer_path, micro_batch_size=3, dp_rank=1, dp_world_size=2, seed=5
    )
    train = loaders.train
    assert (train.micro_batch_size, train.dp_rank, train.dp_world_size) == (3, 1, 2)
    assert (train.dataset.stream.dp_rank, train.dataset.stream.dp_world_size, train.dataset.stream.seed) == (1, 2, 5)


def test_a_typo_in_the_config_names_its_path(tmp_path, plaintext_path, hf_cache_dir, tokenizer_path):
    config = online_config(
        tmp_path, plaintext_path, hf_cache_dir, dataset_type="mapping", loader="DynamicBatchDataLoader"
    )
    config.write_text(config.read_text().replace("min_buffered_samples", "min_bufered_samples"))
    with pytest.raises(DataConfigError, match=r"dataloader\.min_bufered_samples.*min_buffered_samples"):
        build_dataloaders(config, tokenizer=tokenizer_path)


INDEXED_CONFIG = {
    "dataset": {
        "_target_": "hyper_parallel.data.text.build_dataset.build_indexed_text_dataset",
        "data_config": {"seq_length": 32, "split": "90, 5, 5", "mock_data": False, "data_lazy_load": True},
    },
    "dataloader": {"_target_": "hyper_parallel.data.batching.FixedBatchDataLoader"},
    "collate_fn": {"_target_": "hyper_parallel.data.batching.build_indexed_collate_fn"},
}


def test_the_indexed_config_builds_a_loader_per_split(tmp_path, tokenizer_path):
    prefix = tmp_path / "corpus_text_document"
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(200):
        length = int(rng.integers(5, 90))
        builder.add_document(rng.integers(2, 8000, size=length), [length])
    builder.finalize(f"{prefix}.idx")
    config = {**INDEXED_CONFIG, "dataset": {**INDEXED_CONFIG["dataset"], "data_path": str(prefix)}}
    config["dataset"]["data_config"] = {**config["dataset"]["data_config"], "data_cache_path": str(tmp_path / "cache")}

    def make():
        return build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=4).train

    loaders = build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=4)
    assert all(loader is not None for loader in loaders)
    batches = check_exact_resume(make, stop_points=[3])
    assert all(len(batch["tokens"]) == 4 and len(batch["tokens"][0]) == 32 for batch in batches)


def test_pipeline_configs_missing_a_node_or_returning_odd_splits_are_refused(tmp_path, tokenizer_path):
    with pytest.raises(DataConfigError, match="no 'dataloader' node"):
        build_dataloaders({"dataset": {}}, tokenizer=tokenizer_path)
    two = {
        "dataset": {"_target_": "builtins.tuple", "_args_": [[1, 2]]},
        "dataloader": {"_target_": "hyper_parallel.data.batching.FixedBatchDataLoader"},
    }
    with pytest.raises(DataConfigError, match="outside|allowed"):
        build_dataloaders(two, tokenizer=tokenizer_path)
    with pytest.raises(DataConfigError, match="returned 2 datasets"):
        build_dataloaders(two, tokenizer=tokenizer_path, allowed_prefixes=("hyper_parallel.", "builtins."))
