"""Whole pipelines built from YAML configs: the Online config with both sources and both loaders, and Indexed."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from hyper_parallel.data.batching import DynamicBatchDataLoader, FixedBatchDataLoader, ParallelBatch
from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.batching.get_batch import MODEL_INPUT_KEYS
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.instantiate import load_config
from hyper_parallel.data.parallel.data_schedule_utils import PackingSchedulerConfig
from hyper_parallel.data.text.transform_dataset import IterableTransformDataset, TransformDataset

from .conftest import write_indexed_corpus
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


def test_a_typo_in_the_dataloader_node_fails_before_the_dataset_is_read(
    tmp_path, plaintext_path, hf_cache_dir, tokenizer_path
):
    config = load_config(
        online_config(tmp_path, plaintext_path, hf_cache_dir, dataset_type="mapping", loader="FixedBatchDataLoader")
    )
    config["dataset"]["data_path"] = str(tmp_path / "not_written_yet.jsonl")  # reading it would fail
    config["dataloader"]["num_worker"] = 2
    with pytest.raises(DataConfigError, match=r"dataloader\.num_worker: .*did you mean 'num_workers'"):
        build_dataloaders(config, tokenizer=tokenizer_path)


@pytest.mark.parametrize(("node", "named"), [("dataloaders", "dataloader"), ("collate", "collate_fn"), ("model", None)])
def test_an_unknown_top_level_node_is_refused_before_anything_is_built(
    node, named, tmp_path, plaintext_path, hf_cache_dir, tokenizer_path
):
    config = load_config(
        online_config(tmp_path, plaintext_path, hf_cache_dir, dataset_type="mapping", loader="FixedBatchDataLoader")
    )
    config["dataset"]["data_path"] = str(tmp_path / "not_written_yet.jsonl")  # reading it would fail
    config[node] = {"_target_": "hyper_parallel.data.batching.FixedBatchDataLoader"}
    with pytest.raises(DataConfigError) as refused:
        build_dataloaders(config, tokenizer=tokenizer_path)
    message = str(refused.value)
    assert message.startswith(f"{node}: the pipeline config has no node '{node}'")
    assert (
        "its top-level nodes are model_assets, dataset, collate_fn, dataloader, get_batch, packing_scheduler, debug, "
        "variables"
    ) in message
    assert (f"did you mean '{named}'?" in message) == (named is not None)


def test_the_get_batch_node_is_built_and_checked_before_anything_else(
    tmp_path, plaintext_path, hf_cache_dir, tokenizer_path, caplog
):
    """The get_batch node is built (a ParallelBatch beside the loaders, no warning); one whose target or keys do
    not resolve is refused before anything is built, like any other node."""
    path = online_config(tmp_path, plaintext_path, hf_cache_dir, dataset_type="mapping", loader="FixedBatchDataLoader")
    config = load_config(path)
    config["get_batch"] = {"_target_": "hyper_parallel.data.batching.ParallelBatch", "source_type": "online"}
    with caplog.at_level("WARNING", logger="hyper_parallel.data"):
        loaders = build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=2)
    assert not [r for r in caplog.records if r.getMessage().startswith("get_batch:")]
    assert type(loaders.get_batch) is ParallelBatch
    model_inputs, loss_inputs = loaders.get_batch(iter(loaders.train))
    assert model_inputs["attention_mask"].shape[-1] == loss_inputs["loss_mask"].shape[-1]

    config["dataset"]["data_path"] = str(tmp_path / "not_written_yet.jsonl")  # reading it would fail
    config["get_batch"] = {"_target_": "hyper_parallel.data.batching.ParalelBatch", "source_type": "online"}
    with pytest.raises(DataConfigError, match=r"^get_batch\._target_: .*ParalelBatch"):
        build_dataloaders(config, tokenizer=tokenizer_path)
    config["get_batch"] = {"_target_": "hyper_parallel.data.batching.ParallelBatch", "source_typ": "online"}
    with pytest.raises(DataConfigError, match=r"^get_batch\.source_typ: .*did you mean 'source_type'"):
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
    prefix = write_indexed_corpus(tmp_path / "corpus_text_document", documents=200, seed=0)
    config = {**INDEXED_CONFIG, "dataset": {**INDEXED_CONFIG["dataset"], "data_path": str(prefix)}}
    config["dataset"]["data_config"] = {**config["dataset"]["data_config"], "data_cache_path": str(tmp_path / "cache")}

    def make():
        return build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=4).train

    loaders = build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=4)
    assert all(loader is not None for loader in loaders)
    batches = check_exact_resume(make, stop_points=[3])
    assert all(len(batch["input_ids"]) == 4 and len(batch["input_ids"][0]) == 32 for batch in batches)


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


# -- errors name their YAML path ------------------------------------------------------------------------------------


def with_changes(tmp_path, plaintext_path, hf_cache_dir, *, transform=None, data_config=None) -> dict:
    """The Online mapping config, loaded, with keys of ``data_transform`` and ``data_config`` replaced or added."""
    path = online_config(tmp_path, plaintext_path, hf_cache_dir, dataset_type="mapping", loader="FixedBatchDataLoader")
    config = load_config(path)
    config["dataset"]["data_transform"].update(transform or {})
    config["dataset"]["data_config"].update(data_config or {})
    return config


@pytest.mark.parametrize(
    ("transform", "data_config", "start", "named"),
    [
        ({"max_seq_length": 64}, None, "dataset.data_transform: ", ["['max_seq_length']", "'max_seq_len'"]),
        ({"data_type": "plain"}, None, "dataset.data_transform: ", ["unknown data_type 'plain'", "plaintext"]),
        ({"text_keys": 5}, None, "dataset.data_transform: ", ["text_keys must be", "got 5"]),
        ({"max_seq_len": 0}, None, "dataset.data_transform: ", ["max_seq_len must be a positive integer", "got 0"]),
        (None, {"dataset_type": "map"}, "dataset.data_config: ", ["dataset_type is 'map'", "'iterable'"]),
        (None, {"shuffle": True}, "dataset.data_config: ", ["unknown data_config keys ['shuffle']", "cache_dir"]),
    ],
    ids=["unknown_option", "data_type", "text_keys", "max_seq_len", "dataset_type", "unknown_key"],
)
def test_online_config_errors_name_their_yaml_path(
    tmp_path, plaintext_path, hf_cache_dir, tokenizer_path, transform, data_config, start, named
):
    """Errors about ``data_transform`` options and ``data_config`` keys, raised while the ``dataset`` node is built,
    start with their YAML path, as errors about misspelt node keys do."""
    config = with_changes(tmp_path, plaintext_path, hf_cache_dir, transform=transform, data_config=data_config)
    with pytest.raises(DataConfigError) as error:
        build_dataloaders(config, tokenizer=tokenizer_path)
    message = str(error.value)
    assert message.startswith(start), message
    for text in named:
        assert text in message


def test_a_data_transform_mapping_without_target_names_its_yaml_path(
    tmp_path, plaintext_path, hf_cache_dir, tokenizer_path
):
    """A ``data_transform`` given as options only (no ``_target_``) names the same path."""
    config = with_changes(tmp_path, plaintext_path, hf_cache_dir, transform={"max_seq_length": 64})
    del config["dataset"]["data_transform"]["_target_"]
    with pytest.raises(DataConfigError, match=r"^dataset\.data_transform: unknown option\(s\) \['max_seq_length'\]"):
        build_dataloaders(config, tokenizer=tokenizer_path)


@pytest.mark.parametrize(
    ("data_config", "named"),
    [
        ({"seq_length": True}, "seq_length must be an integer >= 1, got the bool True"),
        ({"split": "98,1,abc"}, "split '98,1,abc': part 3 ('abc') is not a non-negative decimal number"),
        ({"random_seed": 2**32}, "random_seed must be an integer in [0, 2**32 - 1]"),
        ({"mock_data": "false"}, "mock_data must be true or false, got 'false'"),
        ({"sequence_length": 32}, "unknown data_config key(s) ['sequence_length']"),
    ],
    ids=["seq_length_bool", "split", "seed", "quoted_flag", "unknown_key"],
)
def test_indexed_data_config_errors_name_their_yaml_path(tmp_path, tokenizer_path, data_config, named):
    """The same for the Indexed ``data_config``, given as a mapping or (for values; a misspelt key of a node is
    refused before anything is built, by the key's own path) as an ``IndexedDataConfig`` node."""
    settings = {**INDEXED_CONFIG["dataset"]["data_config"], **data_config}
    forms = [settings]
    if "sequence_length" not in data_config:
        forms.append({"_target_": "hyper_parallel.data.indexed.indexed_data_config.IndexedDataConfig", **settings})
    for form in forms:
        config = {**INDEXED_CONFIG, "dataset": {**INDEXED_CONFIG["dataset"], "data_config": form}}
        with pytest.raises(DataConfigError, match=rf"^dataset\.data_config: {re.escape(named)}"):
            build_dataloaders(config, tokenizer=tokenizer_path)


@pytest.mark.parametrize("seed", [-1, 2**64, True, 1.5])
def test_runtime_seed_out_of_range_is_refused(tmp_path, tokenizer_path, seed):
    """The runtime seed seeds torch and numpy generators: an integer in [0, 2**64 - 1], or a ``DataConfigError``."""
    with pytest.raises(DataConfigError, match=r"^seed must be an integer"):
        build_dataloaders(INDEXED_CONFIG, tokenizer=tokenizer_path, seed=seed)


# -- CP/TP alignment ------------------------------------------------------------------------------------------------


def test_a_token_budget_off_the_packing_alignment_names_the_fix(
    tmp_path, plaintext_path, hf_cache_dir, tokenizer_path, caplog
):
    """A token budget that is not a multiple of the layout's row multiple lets padded micro-batches exceed it: the
    dynamic loader, given the pipeline's layout, warns naming the budget, the multiple and the max_seq_len values
    that fix it (micro_batch_size 2 x max_seq_len 62 with cp 8: multiples of 4, so 60 or 64)."""
    config = online_config(
        tmp_path, plaintext_path, hf_cache_dir, dataset_type="mapping", loader="DynamicBatchDataLoader"
    )
    config.write_text(config.read_text().replace("max_seq_len: 64", "max_seq_len: 62"))

    with caplog.at_level("WARNING", logger="hyper_parallel.data"):
        loaders = build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=2, cp_size=8)
    warnings = [r.getMessage() for r in caplog.records if "row multiple" in r.getMessage()]
    assert len(warnings) == 1
    assert (
        "token budget 124 (micro_batch_size 2 x max_seq_len 62) is not a multiple of the layout's row multiple 8"
        in (warnings[0])
    )
    assert "up to 128 tokens" in warnings[0] and "multiple of 4, such as 60 or 64" in warnings[0]
    assert max(len(batch["input_ids"][0]) for batch in loaders.train) <= 128

    caplog.clear()
    with caplog.at_level("WARNING", logger="hyper_parallel.data"):
        build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=2, cp_size=2)
    assert not [r for r in caplog.records if "row multiple" in r.getMessage()]


def test_variables_interpolate_and_debug_sets_the_dataset_log_level(
    tmp_path, plaintext_path, hf_cache_dir, tokenizer_path
):
    """``variables`` holds values for interpolations and is not built; ``debug.check_dataset`` sets this package's
    log level (rank 0), as ``enable_dataset_logging`` does."""
    import logging

    text = online_config(tmp_path, plaintext_path, hf_cache_dir, dataset_type="mapping", loader="FixedBatchDataLoader")
    config = load_config(text)
    root = logging.getLogger("hyper_parallel.data")
    saved = root.level, root.propagate, list(root.handlers)
    try:
        yaml = (
            f"variables:\n  path: {plaintext_path}\n"
            "debug:\n  check_dataset: debug\n"
            "dataset:\n  data_path: ${variables.path}\n"
        )
        from omegaconf import OmegaConf

        merged = OmegaConf.to_container(OmegaConf.merge(config, OmegaConf.create(yaml)), resolve=True)
        loaders = build_dataloaders(merged, tokenizer=tokenizer_path, micro_batch_size=2)
        assert merged["dataset"]["data_path"] == str(plaintext_path)
        assert next(iter(loaders.train)) is not None
        assert root.level == logging.DEBUG
    finally:
        root.setLevel(saved[0])
        root.propagate = saved[1]
        root.handlers[:] = saved[2]


@pytest.mark.parametrize(
    ("debug", "fragment"),
    [
        ({"check_dataset": "loud"}, "debug.check_dataset: 'loud' is not a log level"),
        ({"check_datasets": "info"}, "debug.check_datasets: unknown key"),
        ("info", "debug: must be a mapping"),
    ],
)
def test_a_bad_debug_node_is_refused_before_anything_is_built(
    debug, fragment, tmp_path, plaintext_path, hf_cache_dir, tokenizer_path
):
    config = load_config(
        online_config(tmp_path, plaintext_path, hf_cache_dir, dataset_type="mapping", loader="FixedBatchDataLoader")
    )
    config["dataset"]["data_path"] = str(tmp_path / "not_written_yet.jsonl")  # reading it would fail
    config["debug"] = debug
    with pytest.raises(DataConfigError, match=fragment):
        build_dataloaders(config, tokenizer=tokenizer_path)


# -- the packing_scheduler node -------------------------------------------------------------------------------------

SCHEDULER_NODE = {
    "_target_": "hyper_parallel.data.parallel.data_schedule_utils.PackingSchedulerConfig",
    "max_seqlen_per_dp_cp_rank": 64,
    "scheduler": "dynamic_cp",
}


def scheduled_config(tmp_path, plaintext_path, hf_cache_dir, *, loader="DynamicBatchDataLoader", **scheduler) -> dict:
    path = online_config(tmp_path, plaintext_path, hf_cache_dir, dataset_type="mapping", loader=loader)
    config = load_config(path)
    config["packing_scheduler"] = {**SCHEDULER_NODE, **scheduler}
    return config


def uneven_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "different numbers of micro-batches" in r.getMessage()]


def test_the_packing_scheduler_node_is_built_and_the_collator_leaves_the_padding_to_it(
    tmp_path, plaintext_path, hf_cache_dir, tokenizer_path, caplog
):
    """The node builds the scheduler's settings on every rank (runtime facts such as sequence_parallel reach it);
    the collator, given a layout without CP or TP padding, packs without any padding: every sequence of every
    micro-batch is a sample carrying loss (the plaintext samples all do), where cp 2 x tp 2 would otherwise pad rows
    to 4."""
    config = scheduled_config(tmp_path, plaintext_path, hf_cache_dir)
    with caplog.at_level("WARNING", logger="hyper_parallel.data"):
        loaders = build_dataloaders(
            config,
            tokenizer=tokenizer_path,
            micro_batch_size=2,
            dp_world_size=2,
            cp_size=2,
            tp_size=2,
            sequence_parallel=True,
        )
    assert loaders.packing_scheduler == PackingSchedulerConfig(
        max_seqlen_per_dp_cp_rank=64, scheduler="dynamic_cp", sequence_parallel=True
    )
    stage = loaders.get_batch  # no get_batch node: a packed stage is built with the scheduler
    assert isinstance(stage, ParallelBatch) and stage.attention_mode == "packed"
    assert stage.scheduler is loaders.packing_scheduler
    assert (loaders.train.collate_fn.alignment, loaders.train.collate_fn.pad_each_sequence_to) == (1, 1)
    assert not uneven_warnings(caplog)  # the scheduler evens the counts out
    lengths = []
    for batch in loaders.train:
        bounds = batch.cu_seq_lens.tolist()
        labels = batch.labels[0]
        assert bounds[-1] == labels.numel()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            assert (labels[start:end] != IGNORE_INDEX).any(), "a padding sequence"
        lengths.append(labels.numel())
    assert any(length % 4 for length in lengths)  # not aligned: the collator did not pad

    unscheduled = {key: value for key, value in config.items() if key != "packing_scheduler"}
    padded = build_dataloaders(
        unscheduled, tokenizer=tokenizer_path, micro_batch_size=2, cp_size=2, tp_size=2, sequence_parallel=True
    )
    assert padded.packing_scheduler is None and padded.train.collate_fn.alignment == 4


def test_a_dynamic_loader_over_several_dp_ranks_without_a_scheduler_says_how_to_even_the_counts(
    tmp_path, plaintext_path, hf_cache_dir, tokenizer_path, caplog
):
    """Each DP rank of the dynamic loader packs its own share, so the counts per step may differ: one warning at
    build time names the packing_scheduler node and wrap_data_iterator; one DP rank, or the fixed loader, gets none."""
    config = scheduled_config(tmp_path, plaintext_path, hf_cache_dir)
    del config["packing_scheduler"]
    with caplog.at_level("WARNING", logger="hyper_parallel.data"):
        build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=2, dp_rank=1, dp_world_size=2)
    [warning] = uneven_warnings(caplog)
    assert warning.startswith("DynamicBatchDataLoader with dp_world_size 2: each DP rank packs its own share")
    assert "packing_scheduler node (_target_: hyper_parallel.data.parallel.data_schedule_utils." in warning
    assert "wrap_data_iterator" in warning

    caplog.clear()
    fixed = scheduled_config(tmp_path, plaintext_path, hf_cache_dir, loader="FixedBatchDataLoader")
    del fixed["packing_scheduler"]
    with caplog.at_level("WARNING", logger="hyper_parallel.data"):
        build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=2)
        build_dataloaders(fixed, tokenizer=tokenizer_path, micro_batch_size=2, dp_world_size=2)
    assert not uneven_warnings(caplog)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            {"get_batch": {"_target_": "hyper_parallel.data.batching.ParallelBatch", "cp_layout": "zigzag"}},
            r"^get_batch: .*zigzag",
        ),
        (
            {"packing_scheduler": {**SCHEDULER_NODE, "max_seqlen_per_dp_cp_rnk": 64}},
            r"^packing_scheduler\.max_seqlen_per_dp_cp_rnk: .*max_seqlen_per_dp_cp_rank",
        ),
        (
            {"packing_scheduler": {**SCHEDULER_NODE, "deterministic_mode": True}},
            r"deterministic_mode",
        ),
        (
            {"packing_scheduler": {"_target_": "hyper_parallel.data.batching.build_online_text_collate_fn"}},
            r"^packing_scheduler: the node built a TextPackingCollator, .*_target_ to "
            r"hyper_parallel\.data\.parallel\.data_schedule_utils\.PackingSchedulerConfig",
        ),
    ],
    ids=["get_batch_layout_against_the_scheduler", "misspelt_key", "dynamic_cp_deterministic", "other_target"],
)
def test_a_bad_packing_scheduler_node_is_refused_before_the_data_is_read(
    change, fragment, tmp_path, plaintext_path, hf_cache_dir, tokenizer_path
):
    config = scheduled_config(tmp_path, plaintext_path, hf_cache_dir)
    config["dataset"]["data_path"] = str(tmp_path / "not_written_yet.jsonl")  # reading it would fail
    config.update(change)
    with pytest.raises(DataConfigError, match=fragment):
        build_dataloaders(config, tokenizer=tokenizer_path)


def test_a_get_batch_node_beside_the_scheduler_delivers_its_steps(
    tmp_path, plaintext_path, hf_cache_dir, tokenizer_path
):
    """The one delivery stage: the get_batch node is given the scheduler, plans each step and delivers its
    micro-batches under the keys of every other mode, every real token of the step once."""
    config = scheduled_config(tmp_path, plaintext_path, hf_cache_dir)
    config["get_batch"] = {"_target_": "hyper_parallel.data.batching.ParallelBatch", "attention_mode": "packed"}
    loaders = build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=2)
    assert loaders.get_batch.scheduler is loaders.packing_scheduler
    step = loaders.get_batch.schedule(iter(loaders.train), num_microbatches=3)
    delivered = [inputs for inputs, _ in step]
    assert len(delivered) == len(step) == step.num_micro_batches >= 1
    assert all(set(inputs) == set(MODEL_INPUT_KEYS) for inputs in delivered)
    real = sum(int(torch.diff(inputs["packed_seq_params"].cu_seqlens_q).sum()) for inputs in delivered)
    assert real == step.stats.valid_tokens > 0


@pytest.mark.parametrize(("pad_token_id", "refused"), [(8191, False), (8192, True), (10**6, True)])
def test_the_packing_schedulers_pad_token_id_must_lie_in_the_vocabulary(
    tmp_path, plaintext_path, hf_cache_dir, tokenizer_path, pad_token_id, refused
):
    """The scheduler writes its padding id into the rows it sends: past the bundled tokenizer's 8,192 ids the
    embedding has no row for it, so the pipeline is refused when built, naming the node."""
    config = scheduled_config(tmp_path, plaintext_path, hf_cache_dir, pad_token_id=pad_token_id)
    if not refused:
        assert build_dataloaders(config, tokenizer=tokenizer_path).packing_scheduler.pad_token_id == pad_token_id
        return
    with pytest.raises(DataConfigError, match=rf"pad_token_id {pad_token_id} is outside the vocabulary \[0, 8192\)"):
        build_dataloaders(config, tokenizer=tokenizer_path)
    with pytest.raises(DataConfigError, match="Set pad_token_id on the packing_scheduler node"):
        build_dataloaders(config, tokenizer=tokenizer_path)


def seeded_indexed_config(tmp_path, prefix, **data_config):
    node = {**INDEXED_CONFIG["dataset"]["data_config"], "data_cache_path": str(tmp_path / "cache"), **data_config}
    return {**INDEXED_CONFIG, "dataset": {**INDEXED_CONFIG["dataset"], "data_path": str(prefix), "data_config": node}}


def first_train_tokens(config, tokenizer_path, **keywords):
    train = build_dataloaders(config, tokenizer=tokenizer_path, micro_batch_size=4, **keywords).datasets[0]
    return np.stack([np.asarray(train[index]["tokens"]) for index in range(8)])


def test_the_pipelines_seed_is_the_indexed_order(tmp_path, tokenizer_path):
    """build_dataloaders(seed=...) reaches the Indexed order: seed 7 orders the samples as random_seed 7 written in
    the config does, and unlike the default 1234; without a seed, the config's random_seed keeps its order."""
    prefix = write_indexed_corpus(tmp_path / "corpus_text_document", documents=200, seed=0)
    by_seed = first_train_tokens(seeded_indexed_config(tmp_path, prefix), tokenizer_path, seed=7)
    by_random_seed = first_train_tokens(seeded_indexed_config(tmp_path, prefix, random_seed=7), tokenizer_path)
    default = first_train_tokens(seeded_indexed_config(tmp_path, prefix), tokenizer_path)
    assert np.array_equal(by_seed, by_random_seed)
    assert not np.array_equal(by_seed, default)
    same = first_train_tokens(seeded_indexed_config(tmp_path, prefix, random_seed=7), tokenizer_path, seed=7)
    assert np.array_equal(same, by_seed)  # written and given alike: no conflict
    loaders = build_dataloaders(
        seeded_indexed_config(tmp_path, prefix), tokenizer=tokenizer_path, micro_batch_size=4, seed=7
    )
    assert loaders.train.options.sampler.seed == 7  # the same seed seeds the sampler


def test_a_written_random_seed_other_than_the_given_seed_is_refused_naming_both(tmp_path, tokenizer_path):
    prefix = write_indexed_corpus(tmp_path / "corpus_text_document", documents=200, seed=0)
    config = seeded_indexed_config(tmp_path, prefix, random_seed=99)
    with pytest.raises(DataConfigError, match=r"^dataset: data_config\.random_seed is 99, but the pipeline's seed "):
        build_dataloaders(config, tokenizer=tokenizer_path, seed=7)
    with pytest.raises(DataConfigError, match=r"remove random_seed from data_config, set it to 7, or leave seed out"):
        build_dataloaders(config, tokenizer=tokenizer_path, seed=7)
