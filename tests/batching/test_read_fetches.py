"""Without workers, the dynamic loader fetches several reads in one call (so the transform tokenizes them together)
and consumes them one read at a time: batches, states and resumes are those of one read per fetch."""

from __future__ import annotations

import copy

import pytest

from hyper_parallel.data.batching import DynamicBatchDataLoader, build_dataloader
from hyper_parallel.data.batching.read_tracking import TrackedDataLoader
from hyper_parallel.data.text.build_data_transform import PlaintextTransform

from .conftest import paragraphs, write_jsonl
from .test_build_dataloader import plaintext_dataset

MICRO_BATCH = 2
RECORDS = 700  # more than five fetches of four reads of 32 records


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("read_fetches")
    records = [{"id": index, "text": text} for index, text in enumerate(paragraphs(RECORDS))]
    return write_jsonl(folder / "train.jsonl", records), folder / "cache"


def loader_of(corpus, tokenizer, dataset_type: str) -> DynamicBatchDataLoader:
    path, cache = corpus
    dataset = plaintext_dataset(path, tokenizer, cache, dataset_type=dataset_type, max_seq_len=64)
    return DynamicBatchDataLoader(dataset, micro_batch_size=MICRO_BATCH, min_buffered_samples=6, drop_last=False)


@pytest.fixture
def transform_calls(monkeypatch) -> list[int]:
    """The number of records of every batched call the plaintext transform gets (the real method is called)."""
    calls: list[int] = []
    batch = PlaintextTransform.batch

    def counted(self, records, wheres):
        calls.append(len(records))
        return batch(self, records, wheres)

    monkeypatch.setattr(PlaintextTransform, "batch", counted)
    return calls


def states_and_batches(loader) -> tuple[list[dict], list]:
    """The state before every batch (and after the last), and the batches, over one epoch."""
    states, batches = [copy.deepcopy(loader.state_dict())], []
    for batch in loader:
        batches.append(batch)
        states.append(copy.deepcopy(loader.state_dict()))
    return states, batches


@pytest.mark.parametrize("dataset_type", ["mapping", "iterable"])
def test_fetching_four_reads_at_once_gives_the_batches_and_resumes_of_one_read_at_a_time(
    corpus, tokenizer, dataset_type, transform_calls, monkeypatch
):
    states, batches = states_and_batches(loader_of(corpus, tokenizer, dataset_type))
    read = build_dataloader._RECORDS_PER_READ
    grouped = read * build_dataloader._READS_PER_FETCH_IN_PROCESS
    assert grouped > read
    assert max(transform_calls) == grouped  # the reads of a fetch were tokenized in one call
    assert sum(transform_calls) == RECORDS

    monkeypatch.setattr(build_dataloader, "_READS_PER_FETCH_IN_PROCESS", 1)
    transform_calls.clear()
    single_states, single_batches = states_and_batches(loader_of(corpus, tokenizer, dataset_type))
    assert max(transform_calls) == read
    assert batches == single_batches
    if dataset_type == "mapping":  # the sampler rewinds before the reads of a fetch not yet consumed
        assert states == single_states

    # A state saved anywhere resumes exactly, in a loader of either kind.
    for number in (1, 7, len(batches) // 2, len(batches) - 1):
        for grouping in (1, 4):
            monkeypatch.setattr(build_dataloader, "_READS_PER_FETCH_IN_PROCESS", grouping)
            resumed = loader_of(corpus, tokenizer, dataset_type)
            resumed.load_state_dict(copy.deepcopy(states[number]))
            assert list(resumed) == batches[number:], f"resumed before batch {number}, {grouping} reads per fetch"


def test_a_loader_with_workers_fetches_one_read_at_a_time(corpus, tokenizer):
    path, cache = corpus
    dataset = plaintext_dataset(path, tokenizer, cache, dataset_type="mapping", max_seq_len=64)
    loader = DynamicBatchDataLoader(
        dataset, micro_batch_size=MICRO_BATCH, min_buffered_samples=6, num_workers=1, drop_last=False
    )
    reference = list(loader_of(corpus, tokenizer, "mapping"))
    assert list(loader) == reference
    assert loader._tracked.reads_per_fetch == 1


@pytest.mark.parametrize("reads_per_fetch", [0, -1, 1.5, True])
def test_a_fetch_of_no_whole_positive_number_of_reads_is_refused(reads_per_fetch):
    with pytest.raises(ValueError, match=r"reads_per_fetch must be a positive int, got"):
        TrackedDataLoader(None, None, None, {}, 1, reads_per_fetch)
