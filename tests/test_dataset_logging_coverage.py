"""Specification of what the dataset logs say, at which level, and what they never say (docs/tools.md, Logging).

Real small datasets and loaders are built and iterated with the package logger at DEBUG. Each category of the
section is asserted at its level (docs/tools.md, "Logging", lists them): the dataset type chosen, the splits and
blends, the caches, the DataLoader and its sampler at construction, and the shapes ``get_batch`` delivers. The
expected numbers are worked out here from the data written (megatron-core's sample arithmetic, the deficit blend's
exact counts). Every record is checked for sample content: the corpora carry a marker string (Online) and a
marker token id (Indexed) that no log line may show. The rank filter is tested under gloo in
``tests/parallel/test_dataset_logging.py``.
"""

from __future__ import annotations

import itertools
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from batching.conftest import paragraphs, write_jsonl

from hyper_parallel.data.batching import DynamicBatchDataLoader, FixedBatchDataLoader, ParallelBatch
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext, build_on_data_ranks
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset, build_online_text_dataset

MARKER_TEXT = "QUILLFEATHER-7c1e"  # in every Online record
MARKER_ID = 7919  # every Indexed token but the EOD, inside the bundled vocabulary; no count or size has these digits
EOD = 0  # the bundled tokenizer's
SEQ_LENGTH = 16
NUM_DOCUMENTS = 200
_HASH = re.compile(r"[0-9a-f]{16,}")
PLAINTEXT = {"data_type": "plaintext", "text_keys": "text", "max_seq_len": 64}


def messages(caplog, level: int, start: str = "") -> list[str]:
    """The messages logged at exactly ``level`` that start with ``start``."""
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.getMessage().startswith(start)]


def assert_no_sample_content(caplog) -> None:
    """No record shows the text or the token ids of a sample."""
    assert caplog.records, "nothing was logged, so nothing was checked"
    for record in caplog.records:
        text = _HASH.sub("#", record.getMessage())  # a cache key's hex digits could hold the marker id by chance
        assert MARKER_TEXT not in text and str(MARKER_ID) not in text, text


# -- data ---------------------------------------------------------------------------------------------------------


def document_lengths(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(2, 60, size=NUM_DOCUMENTS)


def write_documents(prefix: Path, seed: int) -> str:
    """Documents of ``MARKER_ID`` tokens, each ended by the EOD, one sequence each."""
    lengths = document_lengths(seed)
    tokens = np.full(int(lengths.sum()), MARKER_ID, dtype=np.uint16)
    tokens[np.cumsum(lengths) - 1] = EOD
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16) as builder:
        builder.add_documents(tokens, lengths)
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def write_packed_records(prefix: Path, count: int) -> str:
    """``count`` records of ``SEQ_LENGTH + 1`` marker tokens, as offline packing writes them."""
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16) as builder:
        builder.add_documents(np.full(count * (SEQ_LENGTH + 1), MARKER_ID, np.uint16), [SEQ_LENGTH + 1] * count)
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def one_epoch_samples(seed: int, begin: int, end: int) -> int:
    """Samples of one epoch of documents ``[begin, end)``: megatron-core's ``(tokens - 1) // seq_length`` (the
    extra token of the last sample is the first of the next)."""
    return (int(document_lengths(seed)[begin:end].sum()) - 1) // SEQ_LENGTH


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("indexed_logging")
    return write_documents(root / "a_text_document", seed=0), write_documents(root / "b_text_document", seed=1)


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    records = [{"text": f"{text} {MARKER_TEXT}"} for text in paragraphs(60)]
    return write_jsonl(tmp_path_factory.mktemp("online_logging") / "train.jsonl", records)


def indexed(data_path, tokenizer, sizes=None, **settings) -> tuple:
    return build_indexed_text_dataset(
        data_path, {"seq_length": SEQ_LENGTH, "split": "90,5,5", **settings}, sizes, tokenizer
    )


# -- dataset type, split and blend ---------------------------------------------------------------------------------


def test_a_single_prefix_logs_its_type_split_range_size_and_cache(tmp_path, prefixes, tokenizer, logs):
    cache = tmp_path / "cache"
    indexed(prefixes[0], tokenizer, data_cache_path=str(cache))
    assert messages(logs, logging.INFO, "Indexed dataset type:") == [
        "Indexed dataset type: GPTDataset (documents cut into samples across document boundaries), samples of 16 tokens"
    ]
    # "90,5,5" over 200 documents: [0, 180), [180, 190), [190, 200)
    expected = [
        f"{split} split: {share} of {prefixes[0]}, GPTDataset, {one_epoch_samples(0, begin, end):,} samples of 16 "
        f"tokens; index cache in {cache}"
        for split, share, begin, end in [
            ("train", "0.0% to 90.0%", 0, 180),
            ("valid", "90.0% to 95.0%", 180, 190),
            ("test", "95.0% to 100.0%", 190, 200),
        ]
    ]
    assert [m for m in messages(logs, logging.INFO) if " split: " in m] == expected
    ranges = [m.split("(")[1].split(")")[0] for m in messages(logs, logging.DEBUG, "GPTDataset ")]
    assert ranges == ["train split, sequences [0, 180]", "valid split, sequences [180, 190]",
                      "test split, sequences [190, 200]"]  # fmt: skip
    assert_no_sample_content(logs)


def test_index_caches_log_where_they_are_built_written_and_hit(tmp_path, prefixes, tokenizer, logs):
    cache = tmp_path / "cache"
    indexed(prefixes[0], tokenizer, data_cache_path=str(cache))
    building = messages(logs, logging.INFO, "building the ")
    written = messages(logs, logging.INFO, "index cache written: ")
    stems = [message.split()[2] for message in building]
    assert [stem.split("-", 1)[1] for stem in stems] == ["GPTDataset-train", "GPTDataset-valid", "GPTDataset-test"]
    assert written == [f"index cache written: {stem}, 3 arrays, 0.0 MiB, in {cache}" for stem in stems]
    assert sorted(path.name for path in cache.glob("*-description.txt")) == sorted(
        f"{s}-description.txt" for s in stems
    )
    logs.clear()
    indexed(prefixes[0], tokenizer, data_cache_path=str(cache))
    assert messages(logs, logging.INFO, "building the ") == messages(logs, logging.INFO, "index cache written") == []
    assert messages(logs, logging.DEBUG, "index cache hit: ") == [
        f"index cache hit: {stem} in {cache}" for stem in stems
    ]
    assert_no_sample_content(logs)


def test_a_weighted_blend_logs_its_weights_and_samples_per_source(tmp_path, prefixes, tokenizer, logs):
    blend = ["30", prefixes[0], "70", prefixes[1]]
    indexed(blend, tokenizer, [100, 10, 10], data_cache_path=str(tmp_path / "cache"))
    # The deficit blend keeps every source within one sample of weight x size: exactly 30/70 and 3/7 here.
    assert messages(logs, logging.INFO, "train blend:") == [
        "train blend: 100 samples of 2 sources, weights [0.3, 0.7], samples per source [30, 70]"
    ]
    assert messages(logs, logging.INFO, "valid blend:") == [
        "valid blend: 10 samples of 2 sources, weights [0.3, 0.7], samples per source [3, 7]"
    ]
    assert messages(logs, logging.INFO, "train split:") == [
        f"train split: 0.0% to 90.0% of 2 prefixes, BlendedDataset of GPTDataset sources, 100 samples of 16 tokens; "
        f"index cache in {tmp_path / 'cache'}"
    ]
    # each source is built with ceil(ceil(N * w) * 1.005) samples: ceil(30.15) and ceil(70.35)
    assert messages(logs, logging.DEBUG, "train blend plan:") == [
        "train blend plan: samples per prefix [30, 70], each source built with [31, 71] (surplus 0.005)"
    ]
    assert_no_sample_content(logs)


def test_a_blend_by_size_logs_every_source_once(prefixes, tokenizer, logs):
    indexed(list(prefixes), tokenizer)
    sizes = [one_epoch_samples(0, 0, 180), one_epoch_samples(1, 0, 180)]
    assert messages(logs, logging.INFO, "train blend:") == [
        f"train blend: {sum(sizes):,} samples, every sample of 2 sources once, samples per source {sizes}"
    ]
    assert messages(logs, logging.INFO, "train split:") == [
        f"train split: 0.0% to 90.0% of 2 prefixes, BlendedDataset of GPTDataset sources, {sum(sizes):,} samples of "
        "16 tokens; index caches in <prefix>/cache/GPTDataset_indices, blend indices in memory"
    ]
    assert messages(logs, logging.DEBUG, "BlendedDataset-train indices built in memory")
    assert_no_sample_content(logs)


def test_packed_records_log_their_type_and_simple_blend(tmp_path, tokenizer, logs):
    blend = [write_packed_records(tmp_path / "a", 20), write_packed_records(tmp_path / "b", 10)]
    indexed(blend, tokenizer, split="100,0,0", is_dataset_from_mr=True, simple_blend="inter")
    assert messages(logs, logging.INFO, "Indexed dataset type:") == [
        "Indexed dataset type: GPTFromMRDataset (records packed offline, read as they are), samples of 16 tokens"
    ]
    assert messages(logs, logging.INFO, "train ") == [
        "train inter blend: 30 records of 2 packed sources, records per source [20, 10]",
        "train split: 0.0% to 100.0% of 2 prefixes, SimpleBlendedDataset of GPTFromMRDataset sources, 30 samples of "
        "16 tokens; no index cache (packed records are read in order)",
    ]
    assert messages(logs, logging.DEBUG, "GPTFromMRDataset ") == [
        f"GPTFromMRDataset {blend[0]} (train split, records [0, 20)): 20 samples of 16 tokens",
        f"GPTFromMRDataset {blend[1]} (train split, records [0, 10)): 10 samples of 16 tokens",
    ]
    assert_no_sample_content(logs)


def test_mock_data_logs_its_type_and_in_memory_indices(tokenizer, logs):
    train, _, _ = indexed(None, tokenizer, [8, 8, 8], mock_data=True)
    assert messages(logs, logging.INFO, "Indexed dataset type:") == [
        "Indexed dataset type: MockGPTDataset (synthetic documents, mock_data), samples of 16 tokens"
    ]
    assert messages(logs, logging.INFO, "train split:") == [
        f"train split: 0.0% to 33.3% of mock data, MockGPTDataset, {len(train):,} samples of 16 tokens; indices in "
        "memory (no data_cache_path)"
    ]


def test_lazy_datasets_log_the_choice_then_their_build_at_first_use(prefixes, tokenizer, logs):
    train, _, _ = indexed(list(prefixes), tokenizer, data_lazy_load=True)
    assert messages(logs, logging.INFO, "Indexed dataset type:")[0].endswith(
        ", each dataset built on first use (data_lazy_load)"
    )
    assert messages(logs, logging.INFO, "train split:") == [
        "train split: 0.0% to 90.0% of 2 prefixes, BlendedDataset of 2 sources, train, built on first use; index "
        "caches in <prefix>/cache/GPTDataset_indices, blend indices in memory"
    ]
    assert messages(logs, logging.DEBUG, "built on first use") == []
    assert len(train) == one_epoch_samples(0, 0, 180) + one_epoch_samples(1, 0, 180)
    assert messages(logs, logging.DEBUG, "built on first use") == [
        f"built on first use: GPTDataset {prefixes[0]} train [0, 180)",
        f"built on first use: GPTDataset {prefixes[1]} train [0, 180)",
        "built on first use: BlendedDataset of 2 sources, train",
    ]
    assert_no_sample_content(logs)


# -- Online sources ------------------------------------------------------------------------------------------------


def test_a_mapping_source_logs_its_type_and_whether_it_wrote_its_arrow_cache(tmp_path, jsonl, tokenizer, logs):
    config = {"dataset_type": "mapping", "cache_dir": str(tmp_path / "hf")}
    for outcome in ("written to", "reused from"):
        logs.clear()
        build_online_text_dataset(jsonl, PLAINTEXT, config, tokenizer)
        [message] = messages(logs, logging.INFO, "Online dataset type:")
        head = f"Online dataset type: mapping (random access), {jsonl}, 60 records; Arrow cache {outcome} "
        assert message.startswith(head), message
        assert (
            Path(message.removeprefix(head)).is_relative_to(tmp_path / "hf")
            and Path(message.removeprefix(head)).is_dir()
        )
        assert_no_sample_content(logs)


def test_an_iterable_source_logs_its_type_share_and_shuffle(jsonl, tokenizer, logs):
    dataset = build_online_text_dataset(
        jsonl,
        {**PLAINTEXT, "max_seq_len": 4096},
        {"dataset_type": "iterable", "shuffle_buffer_size": 8},
        tokenizer,
        1,
        2,
        7,
    )
    assert messages(logs, logging.INFO, "Online dataset type:") == [
        f"Online dataset type: iterable (streamed, no cache), {jsonl}; DP rank 1 of 2 reads its share, shuffle buffer "
        "8 records, seed 7"
    ]
    loader = FixedBatchDataLoader(dataset, micro_batch_size=3, dp_rank=1, dp_world_size=2)
    assert sum(1 for _ in loader) == 10  # 30 records of DP rank 1
    assert messages(logs, logging.DEBUG, "DP rank 1's stream") == [
        f"DP rank 1's stream of {jsonl}: epoch 0 ended after 30 records"
    ]
    assert_no_sample_content(logs)


# -- loaders and samplers -----------------------------------------------------------------------------------------


def test_a_fixed_loader_logs_its_batches_workers_and_sampler_once_at_construction(prefixes, tokenizer, logs):
    train, _, _ = indexed(prefixes[0], tokenizer)
    logs.clear()
    loader = FixedBatchDataLoader(
        train, micro_batch_size=2, global_batch_size=8, dp_rank=1, dp_world_size=2, sampler_type="cyclic", seed=5,
        num_workers=2, prefetch_factor=3,
    )  # fmt: skip
    samples = one_epoch_samples(0, 0, 180)
    epoch = samples - samples % 8  # drop_last keeps whole global batches
    assert messages(logs, logging.INFO) == [
        "FixedBatchDataLoader over GPTDataset: micro_batch_size 2, global_batch_size 8, DP rank 1 of 2, 2 workers, "
        "prefetch_factor 3",
        f"sampler: DatasetBatchSampler cyclic, seed 5, DP rank 1 of 2, {samples:,} samples, epochs of {epoch:,} "
        f"(drop_last True), {epoch // 4} micro-batches of 2 on this rank per epoch",
    ]
    assert len(loader) == epoch // 4


def test_a_dynamic_loader_logs_its_token_budget_and_a_stream_its_missing_sampler(jsonl, tokenizer, logs):
    dataset = build_online_text_dataset(jsonl, PLAINTEXT, {"dataset_type": "iterable"}, tokenizer)
    logs.clear()
    DynamicBatchDataLoader(dataset, micro_batch_size=2, min_buffered_samples=4)
    assert messages(logs, logging.INFO) == [
        f"DynamicBatchDataLoader over IterableTransformDataset of {jsonl}: token budget 128 per micro-batch, packed by "
        "TextTokenBatcher(token_budget=128, min_buffered_samples=4, sequence_multiple=1), global_batch_size 2, DP rank "
        "0 of 1, no workers (main process)",
        f"sampler: none, the stream is split between DP ranks and shuffled as read (OnlineIterableDataset({jsonl}, "
        "dp 0/1, shuffle buffer 10000, epoch 0))",
    ]
    assert_no_sample_content(logs)


def test_the_rank_layout_is_logged_where_datasets_are_built(logs):
    assert build_on_data_ranks(DataLoaderParallelContext.standalone(), lambda: "built") == "built"
    assert build_on_data_ranks(DataLoaderParallelContext(tp_rank=1, tp_size=2, tp_src=6), lambda: "built") is None
    assert messages(logs, logging.INFO) == [
        "DP rank 0 of 1, CP rank 0 of 1, TP rank 0 of 1: a data rank, builds the datasets and reads its DataLoader "
        "(global rank 0 first)",
        "DP rank 0 of 1, CP rank 0 of 1, TP rank 1 of 2: reads no data, receives global rank 6's batches",
    ]


# -- iterating: get_batch shapes, nothing per batch at INFO ---------------------------------------------------------


def shape_signature(model_inputs: dict) -> tuple:
    """What the shape log describes, read from the delivered fields (PackedSeqParams by its sequence count)."""
    signature = []
    for name, value in model_inputs.items():
        if isinstance(value, torch.Tensor):
            signature.append((name, value.dtype, tuple(value.shape)))
        elif value is None:
            signature.append((name, None))
        else:
            signature.append((name, len(value.cu_seqlens_q)))
    return tuple(signature)


def deliver_all(get_batch: ParallelBatch, loader, epochs: int) -> list[tuple]:
    signatures = []
    for _ in range(epochs):
        iterator = iter(loader)
        while True:
            try:
                model_inputs, _ = get_batch(iterator)
            except StopIteration:
                break
            signatures.append(shape_signature(model_inputs))
    return signatures


@pytest.mark.parametrize("attention_mode", ["dense", "packed"])
def test_online_batches_log_their_shapes_when_they_change_and_nothing_at_info(jsonl, tokenizer, logs, attention_mode):
    dataset = build_online_text_dataset(jsonl, PLAINTEXT, {"dataset_type": "mapping"}, tokenizer)
    loader = DynamicBatchDataLoader(dataset, micro_batch_size=2, min_buffered_samples=4)
    get_batch = ParallelBatch("online", attention_mode=attention_mode)
    assert messages(logs, logging.INFO, "ParallelBatch:") == [
        f"ParallelBatch: {attention_mode} attention, CP rank 0 of 1 (contiguous layout), TP rank 0 of 1, PP stage 0 of "
        "1, plain delivery, reads the loader, on cpu"
    ]
    logs.clear()
    signatures = deliver_all(get_batch, loader, epochs=2)
    assert len(signatures) > 60
    assert [r for r in logs.records if r.levelno >= logging.INFO] == []
    changes = 1 + sum(a != b for a, b in itertools.pairwise(signatures))
    shape_logs = messages(logs, logging.DEBUG, "get_batch ")
    assert 1 < len(shape_logs) == changes < len(signatures)
    rows, columns = signatures[0][0][2]
    assert shape_logs[0].startswith(f"get_batch first batch: input_ids int64[{rows}, {columns}], labels int64[")
    assert shape_logs[0].endswith(
        f"; rows of {columns} tokens, {columns} columns on CP rank 0 of 1 (contiguous), TP rank 0 of 1"
    )
    assert all(message.startswith("get_batch shapes changed: ") for message in shape_logs[1:])
    assert_no_sample_content(logs)


def test_fixed_indexed_batches_log_their_shapes_once(prefixes, tokenizer, logs):
    train, _, _ = indexed(prefixes[0], tokenizer)
    loader = FixedBatchDataLoader(train, micro_batch_size=2)
    get_batch = ParallelBatch("indexed", eod_token_id=EOD, parallel_context=DataLoaderParallelContext(cp_size=2))
    logs.clear()
    signatures = deliver_all(get_batch, loader, epochs=1)
    assert len(signatures) == one_epoch_samples(0, 0, 180) // 2
    assert [r for r in logs.records if r.levelno >= logging.INFO] == []
    assert messages(logs, logging.DEBUG, "get_batch ") == [
        "get_batch first batch: input_ids int64[2, 8], labels int64[2, 8], position_ids int64[2, 8], attention_mask "
        "bool[2, 1, 8, 16], swa_mask None, packed_seq_params None; rows of 16 tokens, 8 columns on CP rank 0 of 2 "
        "(contiguous), TP rank 0 of 1"
    ]
    assert_no_sample_content(logs)
