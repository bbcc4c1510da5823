"""Specification of the mid-level datasets: ``GPTFromMRDataset`` over offline-packed records, the pairing of data
kind and setting, ``MockGPTDataset`` against megatron-core's, special-token resolution, batched reads
(``__getitems__``) and reading through torch's ``DataLoader``.

Also home of the packed-record helpers the blend, lazy and entry-point tests share: ``packed_records``,
``write_records``, ``expected_packed_sample``, ``build_splits`` and ``assert_samples_equal``.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.gpt_dataset import MockGPTDataset as MegatronMockGPTDataset

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.indexed_pretrain_dataset import (
    GPTDataset,
    GPTFromMRDataset,
    MockGPTDataset,
    MockGPTLowLevelDataset,
    resolve_special_tokens,
)
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset

from .megatron_reference import ParityTokenizer, assert_array_equal, assert_sample_equal, megatron_sample, split_ranges
from .test_index_cache import write_corpus

__all__ = [
    "SEQ_LENGTH",
    "assert_samples_equal",
    "build_splits",
    "expected_packed_sample",
    "packed_records",
    "write_records",
]

SEQ_LENGTH = 16
PAD = 1  # the bundled tokenizer's pad id (its EOD is 0)
SAMPLE_KEYS = {"tokens", "labels", "loss_mask"}
GPT_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


# -- shared helpers -----------------------------------------------------------------------------------------------


def packed_records(num_records: int, seed: int, seq_length: int = SEQ_LENGTH) -> np.ndarray:
    """``[num_records, seq_length + 1]`` uint16 token ids from [2, 8192): never the bundled tokenizer's EOD or pad."""
    return np.random.default_rng(seed).integers(2, 8192, size=(num_records, seq_length + 1), dtype=np.uint16)


def write_records(prefix: str | os.PathLike, records: Sequence[np.ndarray]) -> str:
    """Write each record as one sequence (and one document) of a uint16 pair, as offline packing does; returns the
    prefix."""
    lengths = [len(record) for record in records]
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16) as builder:
        builder.add_documents(np.concatenate([np.asarray(r, np.uint16) for r in records]), lengths)
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def build_splits(data_path, tokenizer, sizes=None, **settings) -> tuple:
    """``build_indexed_text_dataset`` with ``seq_length`` ``SEQ_LENGTH`` unless given, and ``settings``."""
    return build_indexed_text_dataset(data_path, {"seq_length": SEQ_LENGTH, **settings}, sizes, tokenizer)


def assert_samples_equal(actual: Sequence[dict], expected: Sequence[dict], where: str = "") -> None:
    """Equal keys, and for every key equal values (tensors: also dtypes and shapes)."""
    assert len(actual) == len(expected), f"{where}: {len(actual)} samples != {len(expected)}"
    for position, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert got.keys() == want.keys(), f"{where}[{position}]: keys {sorted(got)} != {sorted(want)}"
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert got[key].dtype == value.dtype, f"{where}[{position}][{key}]: {got[key].dtype} != {value.dtype}"
                assert torch.equal(got[key], value), f"{where}[{position}][{key}]: {got[key]} != {value}"
            else:
                assert got[key] == value, f"{where}[{position}][{key}]: {got[key]!r} != {value!r}"


def expected_packed_sample(record: np.ndarray) -> dict[str, torch.Tensor]:
    """The sample of a packed record without pad tokens: tokens ``record[:-1]``, labels ``record[1:]``, full mask."""
    record = torch.as_tensor(np.asarray(record, np.int64))
    return {"tokens": record[:-1], "labels": record[1:], "loss_mask": torch.ones(len(record) - 1)}


# -- GPTFromMRDataset ---------------------------------------------------------------------------------------------


@pytest.fixture
def packed(tmp_path) -> tuple[str, np.ndarray]:
    """A prefix of 101 packed records of ``SEQ_LENGTH + 1`` tokens, and the records."""
    records = packed_records(101, seed=11)
    return write_records(tmp_path / "packed_text_document", records), records


def test_packed_samples_are_the_records_in_split_order(packed, tokenizer):
    """Each split holds its contiguous range of records (ranges as megatron-core computes them), one sample per
    record in order: tokens ``record[:-1]``, labels ``record[1:]``, loss mask of ones; no index cache is built."""
    prefix, records = packed
    splits = build_splits(prefix, tokenizer, is_dataset_from_mr=True, split="90, 8, 3")

    for name, dataset, bounds in zip(("train", "valid", "test"), splits, split_ranges("90, 8, 3", 101), strict=True):
        begin, end = bounds
        assert type(dataset) is GPTFromMRDataset
        assert len(dataset) == end - begin
        expected = [expected_packed_sample(record) for record in records[begin:end]]
        assert_samples_equal([dataset[i] for i in range(len(dataset))], expected, name)
    assert not os.path.exists(f"{prefix}/cache")


def test_packed_samples_without_the_extra_token(tmp_path, tokenizer):
    """With ``add_extra_token_to_sequence: false`` records hold ``seq_length`` tokens; the last label is padding
    (0, masked), as for ``GPTDataset``."""
    records = packed_records(12, seed=3, seq_length=SEQ_LENGTH - 1)
    prefix = write_records(tmp_path / "packed_text_document", records)

    settings = {"is_dataset_from_mr": True, "split": "1,0,0", "add_extra_token_to_sequence": False}
    train = build_splits(prefix, tokenizer, **settings)[0]

    assert len(train) == 12
    for record, sample in zip(records, [train[i] for i in range(12)], strict=True):
        record = torch.as_tensor(record.astype(np.int64))
        assert torch.equal(sample["tokens"], record)
        assert torch.equal(sample["labels"], torch.cat([record[1:], torch.zeros(1, dtype=torch.int64)]))
        assert torch.equal(sample["loss_mask"], torch.cat([torch.ones(SEQ_LENGTH - 1), torch.zeros(1)]))


def test_num_samples_takes_the_first_records_and_never_more_than_the_split_holds(packed, tokenizer):
    """``num_samples`` keeps the first records of the split; more than the split holds is a ``DataConfigError``
    naming both counts (packed records are never repeated)."""
    prefix, records = packed
    train = build_splits(prefix, tokenizer, [40, None, None], is_dataset_from_mr=True, split="90, 8, 3")[0]
    assert len(train) == 40
    assert_samples_equal(train.__getitems__(range(40)), [expected_packed_sample(r) for r in records[:40]])

    with pytest.raises(DataConfigError, match=r"holds 90 packed records but 91 samples were requested") as error:
        build_splits(prefix, tokenizer, [91, None, None], is_dataset_from_mr=True, split="90, 8, 3")
    assert prefix in str(error.value) and "train split" in str(error.value)


@pytest.mark.parametrize("length", [SEQ_LENGTH, SEQ_LENGTH + 5], ids=["short", "long"])
def test_record_of_the_wrong_length_is_refused(tmp_path, tokenizer, length):
    """A record of any other length than ``seq_length + 1`` is a ``DataFileError`` naming the prefix, the record and
    its length, and suggesting ``--pack-to-seq-len`` or ``is_dataset_from_mr: false``."""
    records = list(packed_records(20, seed=4))
    records[5] = records[5][:length] if length <= SEQ_LENGTH else np.resize(records[5], length)
    prefix = write_records(tmp_path / "packed_text_document", records)

    with pytest.raises(DataFileError) as error:
        build_splits(prefix, tokenizer, is_dataset_from_mr=True, split="1,0,0")

    message = str(error.value)
    assert prefix in message and f"record 5 has {length} tokens" in message
    assert f"--pack-to-seq-len {SEQ_LENGTH}" in message and "is_dataset_from_mr: false" in message


def test_documents_given_as_packed_records_are_refused(tmp_path, tokenizer):
    """Variable-length documents with ``is_dataset_from_mr: true`` are refused, suggesting
    ``is_dataset_from_mr: false``."""
    prefix = write_corpus(tmp_path / "documents_text_document", num_documents=40, seed=2)

    with pytest.raises(DataFileError, match="is_dataset_from_mr: false") as error:
        build_splits(prefix, tokenizer, is_dataset_from_mr=True, split="1,0,0")
    assert prefix in str(error.value)


def test_record_with_the_pad_token_is_refused_when_read(tmp_path, tokenizer):
    """A record holding the pad id is a ``DataFileError`` naming the prefix and the record, alone or in a batch;
    the other records read normally."""
    records = packed_records(10, seed=5)
    records[3, 7] = PAD
    prefix = write_records(tmp_path / "packed_text_document", records)
    train = build_splits(prefix, tokenizer, is_dataset_from_mr=True, split="1,0,0")[0]

    for read in (lambda: train[3], lambda: train.__getitems__([0, 3]), lambda: train[-7]):
        with pytest.raises(DataFileError, match="record 3 contains the pad token 1") as error:
            read()
        assert prefix in str(error.value) and "skip_data_check" in str(error.value)
    assert_samples_equal([train[2], train[4]], [expected_packed_sample(records[2]), expected_packed_sample(records[4])])


def test_skip_data_check_accepts_short_records_and_pad_tokens(tmp_path, tokenizer):
    """With ``skip_data_check`` a short record is padded (tokens and labels 0, loss masked) and a pad token in a
    record is masked as padding (token 0; the label 0 and masked where it is the target)."""
    records = list(packed_records(10, seed=6))
    records[2] = records[2][:10]
    records[6] = records[6].copy()
    records[6][7] = PAD
    prefix = write_records(tmp_path / "packed_text_document", records)

    train = build_splits(prefix, tokenizer, is_dataset_from_mr=True, split="1,0,0", skip_data_check=True)[0]

    short = train[2]
    text = torch.as_tensor(records[2].astype(np.int64))
    assert torch.equal(short["tokens"], torch.cat([text, torch.zeros(SEQ_LENGTH - 10, dtype=torch.int64)]))
    assert torch.equal(short["labels"], torch.cat([text[1:], torch.zeros(SEQ_LENGTH - 9, dtype=torch.int64)]))
    assert torch.equal(short["loss_mask"], torch.cat([torch.ones(9), torch.zeros(SEQ_LENGTH - 9)]))
    with_pad = train[6]
    expected = expected_packed_sample(records[6])
    expected["tokens"][7] = 0
    expected["labels"][6] = 0
    expected["loss_mask"][6] = 0.0
    assert_samples_equal([with_pad], [expected])
    assert_samples_equal(train.__getitems__([2, 6]), [short, with_pad])


def test_skip_data_check_reads_a_long_record_as_its_first_tokens(tmp_path, tokenizer):
    """With ``skip_data_check`` a record longer than ``seq_length + 1`` is accepted too: its sample is cut from its
    first ``seq_length + 1`` tokens."""
    records = list(packed_records(10, seed=7))
    records[4] = packed_records(1, seed=8, seq_length=SEQ_LENGTH + 4)[0]
    prefix = write_records(tmp_path / "packed_text_document", records)

    train = build_splits(prefix, tokenizer, is_dataset_from_mr=True, split="1,0,0", skip_data_check=True)[0]

    assert_samples_equal([train[4]], [expected_packed_sample(records[4][: SEQ_LENGTH + 1])])


def test_packed_records_given_to_gpt_dataset_are_refused(packed, tokenizer):
    """Packed records with ``is_dataset_from_mr: false`` would be packed a second time: a ``DataConfigError``
    naming the prefix and suggesting ``is_dataset_from_mr: true``; ``skip_data_check`` lets them through."""
    prefix, _ = packed
    with pytest.raises(DataConfigError, match="set is_dataset_from_mr: true") as error:
        build_splits(prefix, tokenizer, split="90, 8, 3")
    assert prefix in str(error.value) and "--pack-to-seq-len" in str(error.value)

    train = build_splits(prefix, tokenizer, split="90, 8, 3", skip_data_check=True)[0]
    assert type(train) is GPTDataset
    assert len(train) == (90 * (SEQ_LENGTH + 1) - 1) // SEQ_LENGTH  # one epoch: (T - 1) // S samples of T tokens


# -- MockGPTDataset -----------------------------------------------------------------------------------------------


def megatron_mock_splits(tokenizer: ParityTokenizer, seq_length: int, sizes: list, seed: int) -> list:
    """megatron-core's mock splits: neither ``blend`` nor ``blend_per_split``, so it sets ``mock`` itself."""
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    assert config.mock and config.split == "1,1,1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BlendedMegatronDatasetBuilder(MegatronMockGPTDataset, sizes, lambda: True, config).build()


@pytest.mark.parametrize(
    ("seq_length", "sizes", "seed", "vocab_size"),
    [(64, [100, 10, 5], 1234, 300), (37, [1000, 50, 1], 7, 8192), (128, [3000, 0, 20], 99, 2)],
)
def test_mock_data_equals_megatron_mock(seq_length, sizes, seed, vocab_size):
    """``mock_data: true`` builds train/valid/test from 100,000 synthetic documents split "1,1,1" whatever ``split``
    says, with the same documents, index arrays and first 50 samples as megatron-core's ``MockGPTDataset``."""
    tokenizer = ParityTokenizer(eod=0, pad=1, vocab_size=vocab_size)
    config = {"seq_length": seq_length, "mock_data": True, "random_seed": seed, "split": "98, 1, 1"}
    ours = build_indexed_text_dataset(None, config, sizes, tokenizer)
    theirs = megatron_mock_splits(tokenizer, seq_length, sizes, seed)

    for name, mine, reference in zip(("train", "valid", "test"), ours, theirs, strict=True):
        assert type(mine) is MockGPTDataset and type(reference).__name__ == "MockGPTDataset"
        assert type(mine.dataset) is MockGPTLowLevelDataset and len(mine.dataset) == 100_000
        assert_array_equal(mine.dataset.sequence_lengths, reference.dataset.sequence_lengths, f"{name}.lengths")
        for document in (0, 1, 99_999):
            assert_array_equal(mine.dataset.get(document), reference.dataset.get(document), f"{name} doc {document}")
        assert_array_equal(mine.indices, reference.indices, f"{name}.indices")
        assert len(mine) == len(reference)
        for index_name in GPT_INDEX_NAMES:
            assert_array_equal(getattr(mine, index_name), getattr(reference, index_name), f"{name}.{index_name}")
        for i in range(50):
            assert_sample_equal(mine[i], megatron_sample(reference, i), f"{name}[{i}]", ltor=False)


# -- special tokens -----------------------------------------------------------------------------------------------


AMBIGUOUS = "padding uses -1"
SPECIAL_TOKEN_CASES = [
    pytest.param({"eod": 0, "pad": None}, False, (0, -1), None, id="pad_none"),
    pytest.param({"eod": 0}, False, (0, -1), None, id="no_pad_attribute"),
    pytest.param({"eod": 0, "pad": 5}, False, (0, 5), None, id="distinct_pad"),
    pytest.param({"eos_token_id": 3, "pad_token_id": 4}, False, (3, 4), None, id="hf_attribute_names"),
    pytest.param({"eod": 0, "pad": 0}, False, (0, -1), AMBIGUOUS, id="pad_is_eod"),
    pytest.param({"eod": 0, "pad": 0}, True, (0, 0), "keeping it", id="pad_is_eod_allowed"),
    pytest.param({"eod": 0, "eos": 2, "pad": 2}, False, (0, -1), AMBIGUOUS, id="pad_is_eos"),
    pytest.param(
        {"eod": 0, "pad": 7, "special_tokens_dict": {"bos_token": 7, "eos_token": 0, "pad_token": 7}},
        False,
        (0, -1),
        AMBIGUOUS,
        id="pad_is_another_special_token",
    ),
    pytest.param(
        {"eod": 0, "pad": 3, "special_tokens_dict": {"eos_token": 0, "pad_token": 3}},
        False,
        (0, 3),
        None,
        id="pad_distinct_from_special_tokens",
    ),
    pytest.param(
        {"eod": 3, "pad": 3, "special_tokens_dict": {"pad_token": 3}},
        False,
        (3, -1),
        AMBIGUOUS,
        id="only_pad_in_special_tokens_falls_back_to_eod",
    ),
]


@pytest.mark.parametrize(("attributes", "allow_ambiguous", "expected", "warning"), SPECIAL_TOKEN_CASES)
def test_resolve_special_tokens(attributes, allow_ambiguous, expected, warning):
    """``(eod, pad)`` as megatron-core resolves them: no pad gives -1; a pad equal to another special token
    (``special_tokens_dict`` entries other than the pad, else EOS and EOD) gives -1 with a warning, or is kept (with a
    warning) under ``allow_ambiguous_pad_tokens``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_special_tokens(SimpleNamespace(**attributes), allow_ambiguous) == expected
    messages = [str(w.message) for w in caught]
    if warning is None:
        assert messages == []
    else:
        assert len(messages) == 1 and warning in messages[0]


def test_tokenizer_without_eod_is_refused():
    """A tokenizer with neither ``eod`` nor ``eos_token_id`` is a ``DataConfigError``."""
    with pytest.raises(DataConfigError, match="no EOD/EOS token id"):
        resolve_special_tokens(SimpleNamespace(pad=1), False)


# -- batched reads ------------------------------------------------------------------------------------------------


@pytest.fixture(params=["GPTDataset", "GPTFromMRDataset", "MockGPTDataset"])
def mid_level(request, tmp_path, tokenizer):
    """A train split of each mid-level kind; the packed one is cut to 60 of its 90 records by ``num_samples``."""
    if request.param == "GPTDataset":
        prefix = write_corpus(tmp_path / "documents_text_document", num_documents=200, seed=9)
        dataset = build_splits(prefix, tokenizer, [150, None, None], split="90, 8, 2", data_cache_path=str(tmp_path))
    elif request.param == "GPTFromMRDataset":
        prefix = write_records(tmp_path / "packed_text_document", packed_records(100, seed=10))
        dataset = build_splits(prefix, tokenizer, [60, None, None], split="90, 8, 2", is_dataset_from_mr=True)
    else:
        mock_tokenizer = ParityTokenizer(eod=0, pad=1, vocab_size=40)  # mock documents then hold the pad id
        dataset = build_splits(None, mock_tokenizer, [50, 5, 5], mock_data=True)
    assert type(dataset[0]).__name__ == request.param
    return dataset[0]


def test_getitems_equals_single_reads(mid_level):
    """``__getitems__`` returns what reading each index alone returns, for any order, repeats, negative indices
    (counted from ``len``) and ``None`` (sample 0 with a zero loss mask)."""
    rng = np.random.default_rng(12)
    n = len(mid_level)
    indices: list[int | None] = [int(i) for i in rng.integers(-n, n, size=40)] + [n - 1, -1, -n, 0, 0]
    indices[5] = None
    indices[17] = None

    assert_samples_equal(mid_level.__getitems__(indices), [mid_level[i] for i in indices], "__getitems__")
    assert_samples_equal([mid_level[-1], mid_level[-n]], [mid_level[n - 1], mid_level[0]], "negative")
    padding, first = mid_level[None], mid_level[0]
    assert_samples_equal([padding], [{**first, "loss_mask": torch.zeros_like(first["loss_mask"])}], "padding")


def test_getitems_of_no_indices_is_no_samples(mid_level):
    """An empty batch of indices reads nothing and returns an empty list."""
    assert mid_level.__getitems__([]) == []
    assert mid_level.__getitems__(np.empty(0, np.int64)) == []


def test_getitems_of_packed_records_counts_negative_indices_from_num_samples(tmp_path, tokenizer):
    """With ``num_samples`` below the split's record count, index -1 is the last of the ``num_samples`` records, not
    the split's last record."""
    records = packed_records(100, seed=13)
    prefix = write_records(tmp_path / "packed_text_document", records)
    train = build_splits(prefix, tokenizer, [60, None, None], split="90, 8, 2", is_dataset_from_mr=True)[0]

    expected = [expected_packed_sample(records[59]), expected_packed_sample(records[0])]
    assert_samples_equal([train[-1], train[-60]], expected)
    assert_samples_equal(train.__getitems__([-1, -60]), expected)


def test_out_of_range_index_raises_index_error(mid_level):
    """An index at or beyond ``len``, or below ``-len``, raises ``IndexError``, alone or in a batch."""
    n = len(mid_level)
    for read in (
        lambda: mid_level[n],
        lambda: mid_level[-n - 1],
        lambda: mid_level.__getitems__([0, n]),
        lambda: mid_level.__getitems__([-n - 1, 0]),
    ):
        with pytest.raises(IndexError):
            read()


# -- DataLoader ---------------------------------------------------------------------------------------------------


@pytest.fixture
def documents_train(tmp_path, tokenizer) -> GPTDataset:
    prefix = write_corpus(tmp_path / "documents_text_document", num_documents=120, seed=14)
    return build_splits(prefix, tokenizer, [61, None, None], split="90, 8, 2", data_cache_path=str(tmp_path))[0]


@pytest.mark.parametrize(("num_workers", "context"), [(0, None), (2, "fork"), (2, "spawn")])
def test_dataloader_batches_equal_stacked_samples(documents_train, num_workers, context):
    """A ``DataLoader`` (batch size 4, in order) yields ``default_collate`` of ``ds[i]`` for each batch, in the main
    process and in workers; spawned workers receive the dataset, reader included, by pickling."""
    dataset = documents_train
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=4, num_workers=num_workers, multiprocessing_context=context
    )

    batches = list(loader)

    assert len(batches) == -(-len(dataset) // 4)
    for b, batch in enumerate(batches):
        expected = torch.utils.data.default_collate([dataset[i] for i in range(4 * b, min(4 * b + 4, len(dataset)))])
        assert batch.keys() == expected.keys() == SAMPLE_KEYS
        for key in SAMPLE_KEYS:
            assert torch.equal(batch[key], expected[key]), (b, key)


def test_pickled_dataset_reads_the_same_samples(documents_train):
    """A pickled and restored ``GPTDataset`` (as sent to a worker) reads the same samples."""
    restored = pickle.loads(pickle.dumps(documents_train))
    positions = list(range(len(documents_train)))
    assert_samples_equal(restored.__getitems__(positions), documents_train.__getitems__(positions))
