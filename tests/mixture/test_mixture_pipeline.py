"""A mixture as a dataset node: Online and Indexed sources in one mix, the order's independence of workers and DP
sizes, each source's epochs, exact resume with the tally of every source, and the errors of bad configs."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from batching.resume_check import check_exact_resume, plain, roundtrip, take

from hyper_parallel.data.batching import DynamicBatchDataLoader, FixedBatchDataLoader, build_indexed_collate_fn
from hyper_parallel.data.batching.build_collate_fn import TextPackingCollator
from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError, ResumeStateError
from hyper_parallel.data.mixture import MixtureSource, build_mixture_dataset
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset, build_online_text_dataset
from hyper_parallel.data.tokenizer_protocol import read_tokenizer

from .conftest import SEQ_LENGTH, indexed_train_split


@pytest.fixture(scope="module")
def sources(online_paths, indexed_prefix, tokenizer, tmp_path_factory) -> dict:
    """The built sources: two Online mapping datasets and the Indexed GPTDataset (train split)."""
    cache = tmp_path_factory.mktemp("hf_cache")

    def online(path):
        transform = {"data_type": "plaintext", "text_keys": "text", "max_seq_len": 256}
        return build_online_text_dataset(path, transform, {"cache_dir": str(cache)}, tokenizer=tokenizer)

    indexed = indexed_train_split(indexed_prefix, tokenizer, tmp_path_factory.mktemp("cache"))
    return {"first": online(online_paths[0]), "second": online(online_paths[1]), "indexed": indexed}


def mixture(sources, weights: dict, **settings):
    entries = [{"name": name, "weight": weight, "dataset": sources[name]} for name, weight in weights.items()]
    for entry in entries:
        entry.update(settings.pop(entry["name"], {}))
    return build_mixture_dataset(entries, seed=11, **settings)


def source_names(dataset, count: int) -> list[str]:
    return [dataset.names[source] for source in dataset.sources_of(np.arange(count))]


# -- the realised mix and its order -------------------------------------------------------------------------------


def test_a_mix_of_online_and_indexed_sources_over_ten_thousand_samples_is_within_one_percent(sources):
    weights = {"first": 0.5, "second": 0.3, "indexed": 0.2}
    dataset = mixture(sources, weights, on_exhausted="restart", num_samples=10_000)
    names = source_names(dataset, 10_000)
    for name, weight in weights.items():
        assert abs(names.count(name) / 10_000 - weight) < 0.01


def test_each_source_gives_every_record_once_per_epoch(sources):
    dataset = mixture(sources, {"first": 1, "second": 1}, on_exhausted="reweight", first={"epochs": 2})
    located_sources, records = dataset.locate(np.arange(len(dataset)))
    assert len(dataset) == 2 * 40 + 60
    first = records[located_sources == 0]
    assert sorted(first[:40].tolist()) == list(range(40)) and sorted(first[40:].tolist()) == list(range(40))
    assert first[:40].tolist() != first[40:].tolist()  # the second epoch has its own order
    assert sorted(records[located_sources == 1].tolist()) == list(range(60))


def test_restart_begins_a_new_epoch_with_a_new_order_each_time_a_source_runs_out(sources):
    dataset = mixture(
        sources, {"first": 1, "second": 1}, on_exhausted="restart", num_samples=400, first={"max_samples": 10}
    )
    located_sources, records = dataset.locate(np.arange(len(dataset)))
    cycles = records[located_sources == 0][:50].reshape(5, 10)
    orders = {tuple(cycle) for cycle in cycles.tolist()}
    assert len(orders) == 5  # every restart reads the source in a new order
    assert all(len(set(cycle)) == 10 for cycle in cycles.tolist())


def test_max_samples_is_a_source_s_budget(sources):
    dataset = mixture(sources, {"first": 1, "second": 1}, on_exhausted="reweight", second={"max_samples": 25})
    assert len(dataset) == 40 + 25
    assert source_names(dataset, len(dataset)).count("second") == 25


def test_stop_is_the_default_and_ends_at_the_first_source_s_last_sample(sources):
    dataset = mixture(sources, {"first": 1, "second": 1})
    names = source_names(dataset, len(dataset))
    assert names.count("first") == 40 and names.count("second") < 60 and names[-1] == "first"


def batches(loader) -> list[dict]:
    return [plain(batch) for batch in loader]


@pytest.mark.parametrize("loader_class", [FixedBatchDataLoader, DynamicBatchDataLoader])
def test_the_batches_do_not_depend_on_the_worker_count(sources, loader_class):
    dataset = mixture(sources, {"first": 0.4, "second": 0.3, "indexed": 0.3}, on_exhausted="reweight")
    made = [batches(loader_class(dataset, micro_batch_size=4, num_workers=workers)) for workers in (0, 2)]
    assert made[0] == made[1] and made[0]


def step_sequences(dataset, dp_world_size: int) -> list[list[tuple]]:
    """Each optimizer step's sequences (sorted), as ``cu_seq_lens`` cut them, over all DP ranks of a fixed loader."""
    loaders = [
        FixedBatchDataLoader(
            dataset, micro_batch_size=2, global_batch_size=8, dp_rank=rank, dp_world_size=dp_world_size
        )
        for rank in range(dp_world_size)
    ]
    per_rank = [[batch for batch in loader] for loader in loaders]
    micro_per_step = 8 // (2 * dp_world_size)
    steps = []
    for step in range(len(per_rank[0]) // micro_per_step):
        sequences = [
            tuple(ids.tolist())
            for rank in per_rank
            for batch in rank[step * micro_per_step : (step + 1) * micro_per_step]
            for ids, _ in batch.sequences()
        ]
        steps.append(sorted(sequences))
    return steps


def test_every_step_holds_the_same_samples_whatever_the_dp_size(sources):
    indexed_only = build_mixture_dataset(  # one source twice under two names: rows stacked by the Indexed collator
        [
            {"name": "a", "weight": 0.7, "dataset": sources["indexed"]},
            {"name": "b", "weight": 0.3, "dataset": sources["indexed"], "max_samples": 50},
        ],
        on_exhausted="restart",
        num_samples=96,
        seed=5,
    )
    online_and_indexed = mixture(sources, {"first": 1, "indexed": 1}, on_exhausted="restart", num_samples=96)
    for dataset in (indexed_only, online_and_indexed):
        reference = step_sequences(dataset, 1)
        assert len(reference) == 12
        assert step_sequences(dataset, 2) == reference == step_sequences(dataset, 4)


# -- the common sample form -------------------------------------------------------------------------------------


def test_an_indexed_sample_in_a_mix_keeps_its_eod_boundaries_as_sequences(sources, tokenizer):
    dataset = mixture(sources, {"first": 1, "indexed": 1}, on_exhausted="reweight")
    located_sources, records = dataset.locate(np.arange(len(dataset)))
    eod = read_tokenizer(tokenizer).eod
    indexed_collate, packing = build_indexed_collate_fn(eod_token_id=eod), TextPackingCollator()
    checked = 0
    for number in np.flatnonzero(located_sources == 1)[:20].tolist():
        (model_sample,) = dataset[number]
        raw = sources["indexed"][int(records[number])]
        reference = indexed_collate([raw])  # the Indexed collator's boundaries: one row of seq_length tokens
        packed = packing([model_sample])
        assert packed.input_ids.tolist() == reference.input_ids.tolist()
        assert packed.labels.tolist() == reference.labels.tolist()
        assert packed.cu_seq_lens.tolist() == reference.cu_seq_lens.tolist()
        checked += len(reference.cu_seq_lens) > 2
    assert checked  # some of the rows hold more than one document


def test_a_mixed_batch_packs_online_records_and_indexed_rows_with_their_documents(sources, tokenizer):
    dataset = mixture(sources, {"first": 1, "indexed": 1}, on_exhausted="reweight")
    eod = read_tokenizer(tokenizer).eod
    for batch in take(FixedBatchDataLoader(dataset, micro_batch_size=4), 5):
        bounds, ids = batch["cu_seq_lens"], batch["input_ids"][0]
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            inside = ids[start : end - 1]
            assert eod not in inside  # an EOD input only ever ends a sequence


# -- the tally and resume ---------------------------------------------------------------------------------------


def test_the_state_tallies_samples_and_tokens_per_source(sources, caplog):
    dataset = build_mixture_dataset(
        [
            {"name": "first", "weight": 1, "dataset": sources["first"]},
            {"name": "indexed", "weight": 1, "dataset": sources["indexed"]},
        ],
        on_exhausted="reweight",
        log_every=2,
    )
    loader = FixedBatchDataLoader(dataset, micro_batch_size=4)
    with caplog.at_level(logging.INFO, logger="hyper_parallel.data"):
        taken = take(loader, 6)
    tally = loader.state_dict()["mixture"]
    assert tally["batches"] == 6
    assert sum(counts["samples"] for counts in tally["sources"].values()) == 24
    assert tally["sources"]["indexed"]["tokens"] == SEQ_LENGTH * tally["sources"]["indexed"]["samples"]
    real_tokens = sum(int(np.sum(np.asarray(batch["input_ids"][0]) >= 0)) - _tail_padding(batch) for batch in taken)
    assert sum(counts["tokens"] for counts in tally["sources"].values()) == real_tokens
    lines = [r.getMessage() for r in caplog.records if "batches: first" in r.getMessage()]
    assert len(lines) == 3 and "after 6 batches" in lines[-1]


def _tail_padding(batch) -> int:
    """The row's padding: its last sequence when that one carries no label at all (the collator's dummy)."""
    bounds, labels = batch["cu_seq_lens"], batch["labels"][0]
    last = labels[bounds[-2] : bounds[-1]]
    return len(last) if len(bounds) > 2 and all(label == IGNORE_INDEX for label in last) else 0


@pytest.mark.parametrize("loader_class", [FixedBatchDataLoader, DynamicBatchDataLoader])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_restored_loader_gives_exactly_the_remaining_batches_and_tally(sources, loader_class, workers):
    dataset = mixture(sources, {"first": 0.4, "second": 0.3, "indexed": 0.3}, on_exhausted="reweight")

    def make():
        return loader_class(dataset, micro_batch_size=4, num_workers=workers)

    reference = check_exact_resume(make, [3, -2])
    whole = make()
    take(whole, len(reference))
    stopped = make()
    take(stopped, 3)
    restored = make()
    restored.load_state_dict(roundtrip(stopped.state_dict()))
    take(restored, len(reference))
    assert restored.state_dict()["mixture"] == whole.state_dict()["mixture"]


def test_a_state_of_another_mixture_is_refused_naming_the_weights(sources):
    saved = FixedBatchDataLoader(mixture(sources, {"first": 0.5, "second": 0.5}), micro_batch_size=2)
    take(saved, 2)
    other = FixedBatchDataLoader(mixture(sources, {"first": 0.6, "second": 0.4}), micro_batch_size=2)
    with pytest.raises(ResumeStateError, match=r"weight.*0\.5.*0\.6|weight.*0\.6"):
        other.load_state_dict(saved.state_dict())


# -- configs ------------------------------------------------------------------------------------------------------


def node(name: str, weight, dataset) -> dict:
    return {"name": name, "weight": weight, "dataset": dataset}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"strategy": "random"}, "strategy.*'weighted' .*'interleave'"),
        ({"on_exhausted": "loop"}, "on_exhausted"),
        ({"sources": []}, "non-empty list"),
        ({"sources": [node("a", 0, "first")]}, r"sources\[0\] \('a'\) has weight 0; a weight is a positive"),
        ({"sources": [node("a", -1, "first")]}, "has weight -1"),
        ({"sources": [node("a", 1, "first"), node("a", 2, "second")]}, r"names \['a'\] more than once"),
        ({"sources": [{"name": "a", "dataset": "first"}]}, r"sources\[0\] has no weight"),
        ({"sources": [{**node("a", 1, "first"), "epochs": 1, "max_samples": 3}]}, "both epochs and max_samples"),
        ({"sources": [{**node("a", 1, "first"), "share": 1}]}, r"unknown keys \['share'\]"),
        ({"on_exhausted": "restart"}, "no end.*num_samples"),
        ({"mixture_change": "yes"}, "mixture_change is 'yes'; use one of refuse, allow"),
    ],
)
def test_bad_configs_are_refused_naming_the_key_and_the_fix(sources, change, message):
    settings = {"sources": [node("a", 1, "first"), node("b", 1, "second")], **change}
    settings["sources"] = [
        {**entry, "dataset": sources[entry["dataset"]]} if "dataset" in entry else entry
        for entry in settings["sources"]
    ]
    with pytest.raises(DataConfigError, match=message):
        build_mixture_dataset(**settings)


def test_the_pipeline_builds_a_mixture_node_with_nested_dataset_nodes(
    online_paths, indexed_prefix, tokenizer, tmp_path
):
    config = {
        "dataset": {
            "_target_": "hyper_parallel.data.mixture.build_mixture.build_mixture_dataset",
            "strategy": "interleave",
            "on_exhausted": "reweight",
            "sources": [
                {
                    "name": "online",
                    "weight": 3,
                    "dataset": {
                        "_target_": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
                        "data_path": str(online_paths[0]),
                        "data_transform": {"data_type": "plaintext", "text_keys": "text", "max_seq_len": 128},
                        "data_config": {"cache_dir": str(tmp_path / "hf")},
                    },
                },
                {
                    "name": "indexed",
                    "weight": 1,
                    "dataset": {
                        "_target_": "hyper_parallel.data.text.build_dataset.build_indexed_text_dataset",
                        "data_path": str(indexed_prefix),
                        "data_config": {"seq_length": 64, "split": "100, 0, 0", "data_cache_path": str(tmp_path)},
                    },
                },
            ],
        },
        "dataloader": {"_target_": "hyper_parallel.data.batching.DynamicBatchDataLoader"},
    }
    loaders = build_dataloaders(config, tokenizer=tokenizer, micro_batch_size=2, seed=3)
    dataset = loaders.datasets[0]
    assert source_names(dataset, 8) == ["online", "online", "indexed", "online"] * 2  # 3 : 1, smoothly
    batch = next(iter(loaders.train))
    assert isinstance(batch.cu_seq_lens, torch.Tensor)
    assert loaders.train.state_dict()["mixture"]["batches"] == 1


def test_a_source_may_be_a_mixture_source_node(sources):
    built = build_mixture_dataset(
        [
            MixtureSource("first", 1, sources["first"], max_samples=7),
            {"name": "second", "weight": 1, "dataset": sources["second"]},
        ],
        on_exhausted="reweight",
    )
    assert len(built) == 7 + 60


def test_indexed_sources_of_different_lengths_are_refused_in_a_mix_without_an_online_source(
    sources, indexed_prefix, tokenizer, tmp_path
):
    shorter = build_indexed_text_dataset(
        str(indexed_prefix),
        {"seq_length": 32, "split": "100, 0, 0", "data_cache_path": str(tmp_path)},
        tokenizer=tokenizer,
        synchronize=False,
    )[0]
    with pytest.raises(DataConfigError, match=r"different lengths \{'long': 64, 'short': 32\}.*same data_config"):
        build_mixture_dataset([node("long", 1, sources["indexed"]), node("short", 1, shorter)])
    # Beside an Online source both are ModelSamples of their own lengths, packed alike.
    mixed = build_mixture_dataset(
        [node("long", 1, sources["indexed"]), node("short", 1, shorter), node("text", 1, sources["first"])]
    )
    assert {len(mixed[index][0]["input_ids"]) for index in range(30)} > {32, 64}


def test_document_lengths_that_do_not_cover_the_sample_are_refused_by_the_collator():
    sample = {"input_ids": np.arange(6), "labels": np.arange(6), "document_lengths": np.array([2, 3])}
    with pytest.raises(DataFileError, match=r"document_lengths \[2, 3\].*sum to its 6 input_ids"):
        TextPackingCollator()([sample])
