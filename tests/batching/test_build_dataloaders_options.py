"""build_dataloaders refuses a node of the wrong shape before anything is built, and takes the worker options by
keyword, overriding the dataloader node's."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import yaml

from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.errors import DataConfigError

from .conftest import INDEXED

ONLINE_DYNAMIC = {
    "dataset": {
        "_target_": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
        "data_transform": {
            "_target_": "hyper_parallel.data.text.build_data_transform.build_llm_data_transform",
            "data_type": "plaintext",
            "text_keys": "text",
            "max_seq_len": 64,
        },
        "data_config": {"dataset_type": "mapping"},
    },
    "dataloader": {"_target_": "hyper_parallel.data.batching.DynamicBatchDataLoader", "min_buffered_samples": 8},
    "collate_fn": {"_target_": "hyper_parallel.data.batching.build_online_text_collate_fn"},
}


@pytest.fixture
def online_config(plaintext_path, hf_cache_dir) -> dict:
    config = copy.deepcopy(ONLINE_DYNAMIC)
    config["dataset"]["data_path"] = str(plaintext_path)
    config["dataset"]["data_config"]["cache_dir"] = str(hf_cache_dir)
    return config


def batches(loader, count: int) -> list:
    taken = iter(loader)
    return [np.asarray(next(taken)["input_ids"]).tolist() for _ in range(count)]


# -- nodes of the wrong shape --------------------------------------------------------------------------------------

WRONG_SHAPES = {
    # name: (node, value, what the message says it holds, the example target it offers)
    "dataloader-int": ("dataloader", 5, "the int 5", "hyper_parallel.data.batching.FixedBatchDataLoader"),
    "dataloader-null": ("dataloader", None, "null", "FixedBatchDataLoader"),
    "dataloader-no-target": ("dataloader", {"num_workers": 1}, "a mapping without _target_ (keys num_workers)", ""),
    "dataset-list": ("dataset", [1, 2], "the list [1, 2]", "build_online_text_dataset"),
    "dataset-string": ("dataset", "/data/train.jsonl", "the str '/data/train.jsonl'", "build_dataset"),
    "dataset-null": ("dataset", None, "null", "build_dataset"),
    "dataset-no-target": ("dataset", {"data_path": "x"}, "a mapping without _target_ (keys data_path)", ""),
    "get_batch-string": ("get_batch", "x", "the str 'x'", "hyper_parallel.data.batching.ParallelBatch"),
    "get_batch-no-target": ("get_batch", {"source_type": "indexed"}, "a mapping without _target_", "ParallelBatch"),
    "collate_fn-int": ("collate_fn", 5, "the int 5", "build_online_text_collate_fn"),
    "collate_fn-list": ("collate_fn", [{"_target_": "x"}], "the list [{'_target_': 'x'}]", "collate_fn"),
    "collate_fn-bool": ("collate_fn", True, "the bool True", "collate_fn"),
    "packing_scheduler-list": ("packing_scheduler", [1], "the list [1]", "PackingSchedulerConfig"),
    "variables-int": ("variables", 5, "the int 5", "variables: {seq_len: 4096}"),
    "variables-list": ("variables", ["a"], "the list ['a']", "${variables.seq_len}"),
}


@pytest.mark.parametrize("name", list(WRONG_SHAPES))
def test_a_node_of_the_wrong_shape_is_one_error_naming_it_before_anything_is_built(
    indexed_config, tmp_path, tokenizer_path, name
):
    """Each built node must be a mapping with _target_ (an optional one may be null): anything else is refused
    naming the node, what it holds and what it must be, before the dataset is read."""
    node, value, held, example = WRONG_SHAPES[name]
    config = copy.deepcopy(indexed_config)
    if node != "dataset":
        config["dataset"]["data_path"] = str(tmp_path / "not_written_yet")  # reading it would fail
    config[node] = value

    with pytest.raises(DataConfigError) as refused:
        build_dataloaders(config, tokenizer=tokenizer_path)

    message = str(refused.value)
    assert message.startswith(f"{node}: the node holds {held}"), message
    assert "but it must be a mapping" in message and example in message
    if node in ("dataset", "dataloader"):
        assert "or null" not in message  # required nodes
    elif node != "variables":
        assert message.endswith("or null to leave the node out")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("- dataset: {}\n- dataloader: {}\n", "(keys such as dataset: and dataloader:), got a list"),
        ("pipeline\n", "must hold a mapping at the top level (keys such as dataset: and dataloader:), got the scalar"),
        ("", "is empty; a pipeline config is a mapping of nodes, such as dataset: and dataloader:"),
        ("\n# dataset: later\n", "is empty"),
        (
            "dataloader:\n  _target_: x\n  num_workers: !!binary Mg==\n",
            "dataloader.num_workers (line 3) is tagged !!binary",
        ),
        ("variables: !!set {a}\n", "variables (line 1) is tagged !!set, a value a config cannot hold; write a list"),
        ("variables:\n  when: !!timestamp 2024-01-01\n", "variables.when (line 2) is tagged !!timestamp"),
    ],
)
def test_a_config_file_that_is_not_a_pipeline_mapping_names_the_file(tmp_path, tokenizer_path, text, fragment):
    path = tmp_path / "pipeline.yaml"
    path.write_text(text, encoding="utf-8")

    with pytest.raises(DataConfigError) as refused:
        build_dataloaders(path, tokenizer=tokenizer_path)

    assert str(refused.value).startswith(f"config file {path}")
    assert fragment in str(refused.value)


@pytest.mark.parametrize("config", [[{"dataset": {}}], 5, None, b"dataset: {}"])
def test_a_config_that_is_neither_a_mapping_nor_a_path_is_refused(config):
    with pytest.raises(DataConfigError, match=r"^config must be a pipeline mapping .* or the path of a YAML file"):
        build_dataloaders(config)


# -- worker options by keyword -------------------------------------------------------------------------------------

OVERRIDES = {
    # name: (the dataloader node's worker keys, the keywords, the options the loaders get, the logged changes)
    "num_workers": ({}, {"num_workers": 2}, {"num_workers": 2}, "num_workers 0 -> 2"),
    "num_workers-over-yaml": ({"num_workers": 1}, {"num_workers": 2}, {"num_workers": 2}, "num_workers 1 -> 2"),
    "to-main-process": (
        {"num_workers": 2, "prefetch_factor": 4},
        {"num_workers": 0},
        {"num_workers": 0, "prefetch_factor": 4},
        "num_workers 2 -> 0",
    ),
    "all-four": (
        {"num_workers": 1, "persistent_workers": False},
        {"num_workers": 2, "prefetch_factor": 3, "pin_memory": True, "persistent_workers": True},
        {"num_workers": 2, "prefetch_factor": 3, "pin_memory": True, "persistent_workers": True},
        "num_workers 1 -> 2, prefetch_factor None -> 3, pin_memory False -> True, persistent_workers False -> True",
    ),
    # prefetch_factor without workers is kept and unused, as the same YAML value is
    "prefetch-without-workers": ({}, {"prefetch_factor": 4}, {"num_workers": 0, "prefetch_factor": 4}, "None -> 4"),
    "start-method-and-timeout": (
        {},
        {"num_workers": 1, "multiprocessing_context": "fork", "timeout": 60},
        {"num_workers": 1, "multiprocessing_context": "fork", "timeout": 60},
        "multiprocessing_context None -> 'fork', timeout 0 -> 60",
    ),
}


@pytest.mark.parametrize("name", list(OVERRIDES))
def test_worker_options_by_keyword_override_the_dataloader_node_and_are_logged(
    indexed_config, tokenizer_path, caplog, name
):
    """Every split's loader gets the keyword's value over the YAML's; the override is logged once, old -> new, and
    the batches are those of the YAML-only run (workers never change them)."""
    node_options, keywords, expected, logged = OVERRIDES[name]
    config = copy.deepcopy(indexed_config)
    config["dataloader"].update(node_options)
    yaml_only = build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=2)

    with caplog.at_level(logging.INFO, logger="hyper_parallel.data"):
        overridden = build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=2, **keywords)

    for split in ("train", "valid", "test"):
        workers = getattr(overridden, split).options.workers
        assert {option: getattr(workers, option) for option in expected} == expected
        assert getattr(yaml_only, split).options.workers.num_workers == node_options.get("num_workers", 0)
    # the torch DataLoader the loader fetches with (built on first iteration) takes them
    assert batches(overridden.train, 3) == batches(yaml_only.train, 3)
    assert overridden.train._tracked.loader.num_workers == expected["num_workers"]
    assert config["dataloader"] == {**INDEXED["dataloader"], **node_options}  # the caller's config is untouched
    lines = [r.getMessage() for r in caplog.records if "override the dataloader node" in r.getMessage()]
    assert len(lines) == 1 and logged in lines[0], lines
    assert lines[0].startswith("loader options given to build_dataloaders override the dataloader node: ")


def test_worker_options_by_keyword_reach_a_dynamic_online_loader(online_config, tokenizer_path, caplog):
    with caplog.at_level(logging.INFO, logger="hyper_parallel.data"):
        loaders = build_dataloaders(online_config, tokenizer=tokenizer_path, num_workers=2, persistent_workers=True)

    workers = loaders.train.options.workers
    assert (workers.num_workers, workers.persistent_workers) == (2, True)
    assert len(batches(loaders.train, 2)) == 2
    assert loaders.train._tracked.loader.num_workers == 2
    assert any("num_workers 0 -> 2, persistent_workers False -> True" in r.getMessage() for r in caplog.records)


def test_a_yaml_file_takes_the_keywords_too(indexed_config, tmp_path, tokenizer_path):
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({**indexed_config, "dataloader": {**INDEXED["dataloader"], "num_workers": 1}}))

    loaders = build_dataloaders(path, tokenizer=tokenizer_path, num_workers=0, pin_memory=True)

    assert (loaders.train.options.workers.num_workers, loaders.train.options.workers.pin_memory) == (0, True)


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"num_workers": -1}, "num_workers must be an integer >= 0, got -1"),
        ({"num_workers": 1.5}, "num_workers must be an integer >= 0, got 1.5"),
        ({"num_workers": True}, "num_workers must be an integer >= 0, got the bool True"),
        ({"prefetch_factor": 0}, "prefetch_factor must be an integer >= 1, got 0"),
        ({"pin_memory": "yes"}, "pin_memory must be a bool, got 'yes'; write true or false"),
        ({"persistent_workers": 1}, "persistent_workers must be a bool, got 1"),
        ({"multiprocessing_context": "threads"}, "multiprocessing_context 'threads' is not a start method"),
        ({"timeout": -1}, "timeout must be a number of seconds >= 0"),
    ],
)
def test_a_bad_worker_option_by_keyword_is_refused_before_anything_is_built(
    indexed_config, tmp_path, tokenizer_path, keywords, message
):
    config = copy.deepcopy(indexed_config)
    config["dataset"]["data_path"] = str(tmp_path / "not_written_yet")  # reading it would fail

    with pytest.raises(DataConfigError) as refused:
        build_dataloaders(config, tokenizer=tokenizer_path, **keywords)

    assert str(refused.value).startswith(message), str(refused.value)
