"""The loader options: one validated set of groups, taken by both loaders and by build_dataloaders, flat in YAML."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from hyper_parallel.data.batching import (
    BatchLayout,
    DynamicBatchDataLoader,
    FixedBatchDataLoader,
    LoaderOptions,
    SamplerOptions,
    TextTokenBatcher,
    WorkerOptions,
)
from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.text.build_dataset import build_online_text_dataset

from .resume_check import check_exact_resume

GROUPS = (BatchLayout, SamplerOptions, WorkerOptions)


def keyword_defaults(target) -> dict:
    return {
        name: parameter.default
        for name, parameter in inspect.signature(target).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }


def test_both_loaders_list_every_option_by_name_with_its_default():
    defaults = {name: value for group in GROUPS for name, value in keyword_defaults(group).items()}
    assert len(defaults) == 15  # the 14 options the loaders always took, and the worker timeout
    for loader in (FixedBatchDataLoader, DynamicBatchDataLoader):
        assert defaults.items() <= keyword_defaults(loader).items()
    own = keyword_defaults(DynamicBatchDataLoader).keys() - defaults.keys()
    assert own == {"max_seq_len", "min_buffered_samples", "packing_policy", "layout"}


def test_flat_options_are_gathered_into_their_groups():
    options = LoaderOptions.from_keywords(micro_batch_size=2, dp_world_size=2, sampler_type="cyclic", num_workers=3)
    assert options.layout == BatchLayout(micro_batch_size=2, global_batch_size=4, dp_world_size=2)
    assert options.sampler == SamplerOptions(sampler_type="cyclic")
    assert options.workers == WorkerOptions(num_workers=3)
    assert LoaderOptions.from_keywords() == LoaderOptions()
    with pytest.raises(
        DataConfigError, match=r"unknown loader option\(s\) \['num_worker'\] \(did you mean 'num_workers'"
    ):
        LoaderOptions.from_keywords(num_worker=2)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"num_workers": -1}, "num_workers must be an integer >= 0, got -1"),
        ({"prefetch_factor": 0}, "prefetch_factor must be an integer >= 1, got 0"),
        ({"pin_memory": "false"}, "pin_memory must be a bool, got 'false'; write true or false, unquoted"),
        ({"persistent_workers": 1}, "persistent_workers must be a bool, got 1"),
        ({"multiprocessing_context": "thread"}, "multiprocessing_context 'thread' is not a start method"),
        ({"timeout": -5}, "timeout must be a number of seconds >= 0"),
        ({"timeout": True}, "timeout must be a number of seconds >= 0 (0 waits as long as a worker takes), got True"),
        ({"dp_rank": 2, "dp_world_size": 2}, "dp_rank 2 is out of range for dp_world_size 2; ranks are 0..1"),
        ({"micro_batch_size": 2, "global_batch_size": 5}, "global_batch_size 5 is not a multiple of micro_batch_size"),
        ({"sampler_type": "random"}, "unknown sampler_type 'random'; choose one of ['single', 'cyclic']"),
        ({"data_sharding": True}, "data_sharding needs sampler_type 'cyclic'"),
        ({"seed": -1}, "seed must be an integer in [0, 2**64 - 1]"),
    ],
)
def test_a_bad_option_names_itself_and_the_fix(options, named):
    with pytest.raises(DataConfigError) as refused:
        LoaderOptions.from_keywords(**options)
    assert named in str(refused.value)


def test_the_loaders_and_the_pipeline_check_options_the_same_way(plaintext_path, tokenizer, hf_cache_dir):
    dataset = build_online_text_dataset(
        plaintext_path,
        {"data_type": "plaintext", "max_seq_len": 64},
        {"dataset_type": "mapping", "cache_dir": str(hf_cache_dir)},
        tokenizer=tokenizer,
    )
    for loader in (FixedBatchDataLoader, DynamicBatchDataLoader):
        with pytest.raises(DataConfigError, match="dp_rank 3 is out of range for dp_world_size 2"):
            loader(dataset, dp_rank=3, dp_world_size=2)
        with pytest.raises(DataConfigError, match="did you mean 'drop_last'"):
            loader(dataset, drop_lst=False)
    config = {"dataset": {}, "dataloader": {}}
    with pytest.raises(DataConfigError, match="dp_rank 3 is out of range for dp_world_size 2"):
        build_dataloaders(config, dp_rank=3, dp_world_size=2)
    with pytest.raises(DataConfigError, match=r"^seed must be an integer in \[0, 2\*\*64 - 1\]"):
        build_dataloaders(config, seed=np.int64(-3))


def test_a_yaml_packing_policy_and_worker_options(tmp_path, plaintext_path, hf_cache_dir, tokenizer_path, caplog):
    config = {
        "dataset": {
            "_target_": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
            "data_path": str(plaintext_path),
            "data_transform": {"data_type": "plaintext", "max_seq_len": 48},
            "data_config": {"dataset_type": "mapping", "cache_dir": str(hf_cache_dir)},
        },
        "dataloader": {
            "_target_": "hyper_parallel.data.batching.DynamicBatchDataLoader",
            "num_workers": 2,
            "timeout": 120,
            "packing_policy": {
                "_target_": "hyper_parallel.data.batching.TextTokenBatcher",
                "token_budget": 96,
                "min_buffered_samples": 4,
            },
        },
    }

    def make():
        return build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=2).train

    loader = make()
    assert isinstance(loader.policy, TextTokenBatcher) and loader.token_budget == 96
    assert loader.options.workers == WorkerOptions(num_workers=2, timeout=120)
    check_exact_resume(make, stop_points=[3])

    config["collate_fn"] = {"_target_": "hyper_parallel.data.batching.build_online_text_collate_fn"}
    config["dataloader"]["packing_policy"]["token_budget"] = 90
    with caplog.at_level("WARNING", logger="hyper_parallel.data"):
        build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=2, cp_size=4)
    assert (
        "the packing policy's token budget 90 is not a multiple of the layout's row multiple 4 (" in caplog.text
        and "so a padded micro-batch can hold up to 92 tokens; set the policy's token_budget to a multiple of 4"
        in caplog.text
    )
