"""The pipeline object build_dataloaders returns: model assets built first, every built part, one state over all
loaders (all or nothing)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.errors import DataConfigError, ResumeStateError
from hyper_parallel.data.text.build_data_transform import TextConversationTransform
from hyper_parallel.data.text.build_tokenizer import TextTokenizer
from hyper_parallel.data.text.chat_template import ChatMLTemplate


def tokens(batch) -> list:
    return np.asarray(batch["input_ids"]).tolist()


def take(loader, count: int) -> list:
    batches = iter(loader)
    return [tokens(next(batches)) for _ in range(count)]


def test_the_model_assets_node_builds_the_tokenizer_and_chat_template_every_node_gets(
    tmp_path, conversation_path, hf_cache_dir, tokenizer_path
):
    config = {
        "model_assets": {"tokenizer": str(tokenizer_path), "chat_template": "chatml"},
        "dataset": {
            "_target_": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
            "data_path": str(conversation_path),
            "data_transform": {
                "_target_": "hyper_parallel.data.text.build_data_transform.TextConversationTransform",
                "max_seq_len": 512,
            },
            "data_config": {"dataset_type": "mapping", "cache_dir": str(hf_cache_dir)},
        },
        "dataloader": {"_target_": "hyper_parallel.data.batching.FixedBatchDataLoader"},
        "collate_fn": {"_target_": "hyper_parallel.data.batching.build_online_text_collate_fn"},
    }
    built = build_dataloaders(config, micro_batch_size=2)
    assert isinstance(built.tokenizer, TextTokenizer)
    assert isinstance(built.chat_template, ChatMLTemplate)
    transform = built.datasets[0].transform
    assert isinstance(transform, TextConversationTransform)
    assert transform.chat_template is built.chat_template  # built once, handed to the node that names it
    assert built.train.dataset is built.datasets[0] and built.train.collate_fn is built.collate_fn

    # the same pipeline with the tokenizer given by argument and the template named in the node: the same batches
    by_argument = copy.deepcopy(config)
    del by_argument["model_assets"]
    by_argument["dataset"]["data_transform"]["chat_template"] = "chatml"
    other = build_dataloaders(by_argument, tokenizer=tokenizer_path, micro_batch_size=2)
    assert other.chat_template is None and other.tokenizer.fingerprint == built.tokenizer.fingerprint
    assert take(other.train, 3) == take(built.train, 3)


def test_a_tokenizer_node_with_a_target_is_built(indexed_config, tokenizer_path):
    config = {
        **indexed_config,
        "model_assets": {
            "tokenizer": {
                "_target_": "hyper_parallel.data.text.build_tokenizer.build_tokenizer",
                "name_or_path": str(tokenizer_path),
            }
        },
    }
    built = build_dataloaders(config, micro_batch_size=2)
    assert isinstance(built.tokenizer, TextTokenizer) and built.chat_template is None
    plain = build_dataloaders(indexed_config, tokenizer=tokenizer_path, micro_batch_size=2)
    assert take(built.train, 2) == take(plain.train, 2)


@pytest.mark.parametrize(
    ("assets", "by_argument", "message"),
    [
        ({"tokenizer": "TOKENIZER"}, True, r"^model_assets\.tokenizer: the tokenizer is given twice"),
        ({"tokenizr": "TOKENIZER"}, False, r"^model_assets\.tokenizr: unknown key \(did you mean 'tokenizer'\?\)"),
        ({"chat_template": "chatml"}, False, r"^model_assets\.chat_template: a chat template needs a tokenizer"),
        ("TOKENIZER", False, r"^model_assets: must be a mapping"),
        ({"tokenizer": {"_target_": "os.system"}}, False, r"^model_assets\.tokenizer\._target_: .*os\.system"),
    ],
)
def test_bad_model_assets_are_refused_before_anything_is_built(
    indexed_config, tokenizer_path, assets, by_argument, message
):
    if isinstance(assets, dict):
        assets = {k: str(tokenizer_path) if v == "TOKENIZER" else v for k, v in assets.items()}
    config = {**indexed_config, "model_assets": assets}
    with pytest.raises(DataConfigError, match=message):
        build_dataloaders(config, tokenizer=tokenizer_path if by_argument else None)


def test_one_state_restores_every_split(indexed_config, tokenizer_path):
    def build():
        return build_dataloaders(indexed_config, tokenizer=tokenizer_path, micro_batch_size=2)

    uninterrupted = build()
    assert all(loader is not None for loader in uninterrupted)
    iterators = {split: iter(loader) for split, loader in zip(("train", "valid", "test"), uninterrupted, strict=True)}
    for split, count in (("train", 3), ("valid", 2), ("test", 1)):
        for _ in range(count):
            next(iterators[split])
    state = uninterrupted.state_dict()
    expected = {split: [tokens(next(iterators[split])) for _ in range(2)] for split in iterators}

    restored = build()
    restored.load_state_dict(state)
    for split, loader in zip(("train", "valid", "test"), restored, strict=True):
        assert take(loader, 2) == expected[split], split


def test_a_refused_state_moves_no_loader(indexed_config, tokenizer_path):
    def build(config=indexed_config):
        return build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=2)

    fresh_train = take(build().train, 2)
    moved = build()
    take(moved.train, 3)
    state = moved.state_dict()
    other_length = copy.deepcopy(indexed_config)
    other_length["dataset"]["data_config"]["seq_length"] = 16
    state["splits"]["test"] = build(other_length).state_dict()["splits"]["test"]  # another dataset's position

    target = build()
    with pytest.raises(ResumeStateError, match="sequence_length was 16, is now 32"):
        target.load_state_dict(state)
    assert take(target.train, 2) == fresh_train  # train was restored before test refused: put back


def test_states_that_do_not_fit_this_ranks_loaders_name_the_split(indexed_config, tokenizer_path):
    built = build_dataloaders(indexed_config, tokenizer=tokenizer_path, micro_batch_size=2)
    state = built.state_dict()
    with pytest.raises(DataConfigError, match="not one DataLoaders.state_dict"):
        built.load_state_dict(state["splits"]["train"])
    without_valid = {**state, "splits": {**state["splits"], "valid": None}}
    with pytest.raises(DataConfigError, match=r"^valid: this rank has a loader for the valid split"):
        built.load_state_dict(without_valid)


# -- the trainer's sample counts ----------------------------------------------------------------------------------


def test_the_trainers_sample_counts_reach_the_indexed_dataset_node(indexed_config, tokenizer_path):
    one_epoch = build_dataloaders(indexed_config, tokenizer=tokenizer_path)
    valid_epoch = len(one_epoch.datasets[1])
    batch = valid_epoch + 1  # one epoch of the valid split holds less than a global batch
    with pytest.raises(DataConfigError, match=f"smaller than global_batch_size {batch}"):
        build_dataloaders(indexed_config, tokenizer=tokenizer_path, micro_batch_size=batch)

    counts = [None, 2 * batch, batch]
    loaders = build_dataloaders(
        indexed_config, tokenizer=tokenizer_path, micro_batch_size=batch, train_valid_test_num_samples=counts
    )
    train, valid, test = loaders.datasets
    assert len(train) == len(one_epoch.datasets[0])  # None: one epoch
    assert len(valid) >= counts[1] and len(test) >= counts[2]  # epochs repeated until they hold that many
    # The same datasets as the Indexed builder given the counts itself (megatron-core's trainer passes them so).
    direct = copy.deepcopy(indexed_config)
    direct["dataset"]["train_valid_test_num_samples"] = counts
    by_config = build_dataloaders(direct, tokenizer=tokenizer_path, micro_batch_size=batch)
    assert [len(d) for d in by_config.datasets] == [len(d) for d in loaders.datasets]
    assert take(by_config.valid, 2) == take(loaders.valid, 2)


def test_sample_counts_set_by_the_config_win_over_the_trainers(indexed_config, tokenizer_path):
    config = copy.deepcopy(indexed_config)
    config["dataset"]["train_valid_test_num_samples"] = [None, 30, 30]
    loaders = build_dataloaders(config, tokenizer=tokenizer_path, train_valid_test_num_samples=[None, 60, 60])
    expected = build_dataloaders(config, tokenizer=tokenizer_path)
    assert [len(d) for d in loaders.datasets] == [len(d) for d in expected.datasets]


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ([100, 10], "train_valid_test_num_samples must have three entries"),
        ([100, -1, 10], r"train_valid_test_num_samples\[1\] \(valid samples\) must be an integer >= 0"),
        ("100,10,10", "train_valid_test_num_samples must be a list of three sample counts"),
    ],
)
def test_bad_sample_counts_are_refused_naming_the_entry(indexed_config, tokenizer_path, counts, message):
    with pytest.raises(DataConfigError, match=message):
        build_dataloaders(indexed_config, tokenizer=tokenizer_path, train_valid_test_num_samples=counts)


def test_a_split_the_trainer_takes_no_samples_from_gets_no_loader(
    indexed_config, conversation_path, hf_cache_dir, tokenizer_path
):
    loaders = build_dataloaders(indexed_config, tokenizer=tokenizer_path, train_valid_test_num_samples=[None, 0, 5])
    assert loaders.train is not None and loaders.valid is None and loaders.test is not None
    assert all(dataset is not None for dataset in loaders.datasets)  # built as megatron-core builds them
    assert loaders.state_dict()["splits"]["valid"] is None

    online = {
        "dataset": {
            "_target_": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
            "data_path": str(conversation_path),
            "data_transform": {"data_type": "conversation", "text_keys": "messages", "chat_template": "chatml"},
            "data_config": {"cache_dir": str(hf_cache_dir)},
        },
        "dataloader": {"_target_": "hyper_parallel.data.batching.DynamicBatchDataLoader"},
        "collate_fn": {"_target_": "hyper_parallel.data.batching.build_online_text_collate_fn"},
    }
    assert (
        build_dataloaders(online, tokenizer=tokenizer_path, train_valid_test_num_samples=[0, None, None]).train is None
    )
