"""build_dataloaders over a mesh of real gloo ranks: ranks whose batch-shaping settings differ all raise the same
DataConfigError before any data is read, naming the node, the field and every rank's value; equal ones build."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch.distributed as dist

from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH

from .launch import launch

WORLD = 2
DEADLINE_S = 90.0


def indexed_config(prefix: str, cache: str) -> dict:
    return {
        "dataset": {
            "_target_": "hyper_parallel.data.text.build_dataset.build_indexed_text_dataset",
            "data_path": prefix,
            "data_config": {"seq_length": 32, "split": "90, 5, 5", "data_cache_path": cache},
        },
        "dataloader": {"_target_": "hyper_parallel.data.batching.FixedBatchDataLoader"},
        "collate_fn": {"_target_": "hyper_parallel.data.batching.build_indexed_collate_fn"},
    }


def online_config(data_path: str) -> dict:
    return {
        "dataset": {
            "_target_": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
            "data_path": data_path,
            "data_transform": {
                "_target_": "hyper_parallel.data.text.build_data_transform.build_llm_data_transform",
                "data_type": "plaintext",
                "text_keys": "text",
                "max_seq_len": 256,
            },
            "data_config": {"dataset_type": "mapping"},
        },
        "dataloader": {"_target_": "hyper_parallel.data.batching.DynamicBatchDataLoader"},
        "collate_fn": {"_target_": "hyper_parallel.data.batching.build_online_text_collate_fn"},
        "packing_scheduler": {
            "_target_": "hyper_parallel.data.parallel.data_schedule_utils.PackingSchedulerConfig",
            "max_seqlen_per_dp_cp_rank": 256,
        },
    }


def build_on_rank(rank: int, world_size: int, *, configs: list[dict], seeds: list) -> dict:
    """Build this rank's pipeline as two DP ranks of one world; report the first train batch's shape or the error."""
    context = DataLoaderParallelContext.from_groups(dp_group=dist.group.WORLD)
    keywords = {} if seeds[rank] is None else {"seed": seeds[rank]}
    loaders = build_dataloaders(
        configs[rank],
        tokenizer=str(BUNDLED_TOKENIZER_PATH),
        micro_batch_size=2,
        global_batch_size=4,
        parallel_context=context,
        **keywords,
    )
    batch = next(iter(loaders.train))
    return {"shape": list(batch.input_ids.shape), "dp_rank": loaders.train.dp_rank}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A small Indexed corpus (seeded): 200 documents of 5 to 89 tokens."""
    prefix = tmp_path_factory.mktemp("indexed") / "corpus_text_document"
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(200):
        length = int(rng.integers(5, 90))
        builder.add_document(rng.integers(2, 8000, size=length), [length])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def run(tmp_path, configs: list[dict], seeds=(None, None)) -> list[dict]:
    worker = functools.partial(build_on_rank, configs=configs, seeds=list(seeds))
    return launch(worker, tmp_path, world_size=WORLD, deadline_s=DEADLINE_S)


def test_equal_configs_build_on_every_rank(tmp_path, corpus):
    config = indexed_config(corpus, str(tmp_path / "cache"))
    reports = run(tmp_path, [config, config], seeds=(7, 7))
    assert [report.get("error") for report in reports] == [None, None]
    assert [report["value"] for report in reports] == [
        {"shape": [2, 32], "dp_rank": 0},
        {"shape": [2, 32], "dp_rank": 1},
    ]


def _differing(base: dict, path: tuple, value) -> list[dict]:
    other = copy.deepcopy(base)
    node = other
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return [base, other]


@pytest.mark.parametrize(
    ("path", "values", "field"),
    [
        (("dataset", "data_config", "seq_length"), (32, 64), "dataset.data_config.seq_length"),
        (("dataset", "data_config", "split"), ("90, 5, 5", "80, 10, 10"), "dataset.data_config.split"),
        (("dataset", "data_config", "random_seed"), (1234, 99), "dataset.data_config.random_seed"),
    ],
    ids=["seq_length", "split", "random_seed"],
)
def test_indexed_settings_that_differ_raise_the_same_error_on_every_rank(tmp_path, path, values, field):
    """The data path is never written: the ranks must refuse before any file is read."""
    base = indexed_config(str(tmp_path / "not_written_text_document"), str(tmp_path / "cache"))
    node = base
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = values[0]
    reports = run(tmp_path, _differing(base, path, values[1]))
    errors = [report.get("error") for report in reports]
    assert all(error is not None and error["type"] == "DataConfigError" for error in errors), errors
    assert errors[0]["message"] == errors[1]["message"]
    assert f"{field}: rank 0 has {values[0]!r}, rank 1 has {values[1]!r}" in errors[0]["message"].replace('"', "'")


@pytest.mark.parametrize(
    ("path", "value", "field", "shown"),
    [
        (
            ("dataset", "data_transform", "max_seq_len"),
            512,
            "dataset.data_transform.max_seq_len",
            "256, rank 1 has 512",
        ),
        (
            ("packing_scheduler", "max_seqlen_per_dp_cp_rank"),
            128,
            "packing_scheduler.max_seqlen_per_dp_cp_rank",
            "256, rank 1 has 128",
        ),
    ],
    ids=["online_max_seq_len", "scheduler_max_seqlen_per_dp_cp_rank"],
)
def test_online_and_scheduler_settings_that_differ_raise_the_same_error_on_every_rank(
    tmp_path, path, value, field, shown
):
    base = online_config(str(tmp_path / "not_written.jsonl"))
    reports = run(tmp_path, _differing(base, path, value))
    errors = [report.get("error") for report in reports]
    assert all(error is not None and error["type"] == "DataConfigError" for error in errors), errors
    assert errors[0]["message"] == errors[1]["message"]
    assert f"{field}: rank 0 has {shown}" in errors[0]["message"]


def test_a_seed_given_differently_is_refused_on_every_rank(tmp_path):
    base = indexed_config(str(tmp_path / "not_written_text_document"), str(tmp_path / "cache"))
    reports = run(tmp_path, [base, base], seeds=(1, 2))
    errors = [report.get("error") for report in reports]
    assert all(error is not None and error["type"] == "DataConfigError" for error in errors), errors
    assert errors[0]["message"] == errors[1]["message"]
    assert "build_dataloaders.seed: rank 0 has 1, rank 1 has 2" in errors[0]["message"]
