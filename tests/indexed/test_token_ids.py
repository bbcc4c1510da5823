"""Specification of the token-id checks of the Indexed path: the token datasets deliver token ids only.

A pair's header dtype must be an integer one, a ``.meta.json`` beside it must name the same dtype, and every id a
dataset reads must lie in ``[0, vocab_size)`` (the tokenizer's, or the ``.meta.json``'s). One flipped byte in the
dtype code of an ``.idx`` header (any of megatron's codes to any other) never delivers wrong tokens.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.indexed import indexed_data_reader
from hyper_parallel.data.indexed.idx_format import DTYPE_BY_CODE
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.indexed.pair_metadata import PairMetadata, metadata_path
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset

from .megatron_reference import ParityTokenizer

SEQ_LENGTH = 8
DTYPE_CODE_OFFSET = 17  # the header byte that holds the dtype code (idx_format)
INTEGER_CODES = [code for code, dtype in DTYPE_BY_CODE.items() if dtype.kind in "iu"]
# A vocabulary per written dtype whose top ids change value when the dtype's signedness flips.
VOCAB_BY_DTYPE = {"uint8": 250, "int8": 120, "int16": 30_000, "uint16": 50_000, "int32": 100_000, "int64": 100_000}
# Every header byte flip from a dtype tokens are written in to another of megatron's codes.
FLIPS = [(written, flipped) for written in INTEGER_CODES for flipped in DTYPE_BY_CODE if flipped != written]


def write_pair(prefix: Path, documents: list[list[int]], dtype, vocab_size: int | None = None) -> str:
    """One sequence per document; with ``vocab_size``, also the ``.meta.json`` offline preparation writes."""
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype) as builder:
        for document in documents:
            builder.add_document(np.asarray(document, dtype=dtype), [len(document)])
        builder.finalize(f"{prefix}.idx")
    if vocab_size is not None:
        metadata = PairMetadata(
            tokenizer_fingerprint="test", vocab_size=vocab_size, eod_id=0, token_dtype=str(np.dtype(dtype))
        )
        metadata_path(prefix).write_bytes(metadata.to_json())
    return str(prefix)


def edge_documents(vocab_size: int, count: int = 12, seed: int = 0) -> list[list[int]]:
    """Documents of ids in [2, vocab_size) ending with the EOD 0; every document holds vocab_size - 1."""
    rng = np.random.default_rng(seed)
    return [
        rng.integers(2, vocab_size, size=int(rng.integers(3, 20))).tolist() + [vocab_size - 1, 0] for _ in range(count)
    ]


def set_dtype_code(prefix: str, code: int) -> None:
    with open(f"{prefix}.idx", "r+b") as index:
        index.seek(DTYPE_CODE_OFFSET)
        index.write(bytes([code]))


def build_train(prefix: str, tokenizer, tmp_path: Path, **settings):
    """The train split of one pair, with its index cache under ``tmp_path``."""
    config = {"seq_length": SEQ_LENGTH, "split": "100,0,0", "data_cache_path": str(tmp_path / "cache"), **settings}
    return build_indexed_text_dataset(prefix, config, None, tokenizer)[0]


def every_sample(dataset) -> list[dict[str, torch.Tensor]]:
    """Every sample, through both read paths: one at a time (``get``) and batched (``gather``)."""
    single = [dataset[i] for i in range(len(dataset))]
    batched = dataset.__getitems__(list(range(len(dataset))))
    return single + batched


def samples_or_error(prefix: str, tokenizer, tmp_path: Path, **settings) -> list | DataFileError:
    try:
        return every_sample(build_train(prefix, tokenizer, tmp_path, **settings))
    except DataFileError as error:
        return error


# -- the dtype code ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "flipped"), FLIPS, ids=[f"{DTYPE_BY_CODE[w]}-to-{DTYPE_BY_CODE[f]}" for w, f in FLIPS]
)
@pytest.mark.parametrize("with_metadata", [True, False], ids=["meta.json", "no-meta.json"])
def test_a_flipped_dtype_code_never_delivers_wrong_tokens(tmp_path, written, flipped, with_metadata):
    """With the ``.meta.json`` offline preparation writes, every flip is refused; without one, a flip is refused
    unless the ids read through it are exactly the ids written (a signed/unsigned flip of small ids)."""
    dtype = DTYPE_BY_CODE[written]
    vocab_size = VOCAB_BY_DTYPE[dtype.name]
    tokenizer = ParityTokenizer(eod=0, pad=1, vocab_size=vocab_size)
    prefix = write_pair(tmp_path / "pair", edge_documents(vocab_size), dtype, vocab_size if with_metadata else None)
    expected = samples_or_error(prefix, tokenizer, tmp_path)
    assert not isinstance(expected, DataFileError), expected

    set_dtype_code(prefix, flipped)
    result = samples_or_error(prefix, tokenizer, tmp_path)

    if with_metadata or DTYPE_BY_CODE[flipped].kind == "f":
        assert isinstance(result, DataFileError), f"tokens delivered through code {flipped}"
        assert f"{prefix}" in str(result)
    elif not isinstance(result, DataFileError):
        assert len(result) == len(expected)
        for got, want in zip(result, expected, strict=True):
            assert torch.equal(got["tokens"], want["tokens"]) and torch.equal(got["labels"], want["labels"])


@pytest.mark.parametrize("flipped", [6, 7], ids=["float64", "float32"])
@pytest.mark.parametrize("is_dataset_from_mr", [False, True], ids=["GPTDataset", "GPTFromMRDataset"])
def test_a_float_dtype_code_is_refused_when_the_dataset_is_built(tmp_path, flipped, is_dataset_from_mr):
    """Nothing is read: the dataset is refused naming the file, the header's code and its dtype."""
    record = SEQ_LENGTH + 1
    documents = [list(range(2, 2 + record)) for _ in range(6)] if is_dataset_from_mr else edge_documents(1000)
    prefix = write_pair(tmp_path / "pair", documents, np.int32 if flipped == 7 else np.int64)
    set_dtype_code(prefix, flipped)
    tokenizer = ParityTokenizer(eod=0, pad=1, vocab_size=1000)

    with pytest.raises(DataFileError) as error:
        build_train(prefix, tokenizer, tmp_path, is_dataset_from_mr=is_dataset_from_mr)
    message = str(error.value)
    assert f"{prefix}.idx" in message
    assert f"dtype code {flipped} (byte 17)" in message and str(DTYPE_BY_CODE[flipped]) in message
    assert "rebuild it with offline_preparation" in message


def test_a_blend_with_one_float_source_is_refused(tmp_path):
    tokenizer = ParityTokenizer(eod=0, pad=1, vocab_size=1000)
    good = write_pair(tmp_path / "good", edge_documents(1000), np.uint16)
    bad = write_pair(tmp_path / "bad", edge_documents(1000, seed=1), np.int32)
    set_dtype_code(bad, 7)
    config = {"seq_length": SEQ_LENGTH, "split": "100,0,0", "data_cache_path": str(tmp_path / "cache")}

    with pytest.raises(DataFileError, match=rf"{bad}\.idx: the header's dtype code 7"):
        build_indexed_text_dataset(["50", good, "50", bad], config, [40, None, None], tokenizer)


@pytest.mark.parametrize(("header", "meta"), [(np.int32, "uint16"), (np.uint16, "int16"), (np.int64, "int32")])
def test_a_meta_json_naming_another_dtype_is_refused_naming_both_files(tmp_path, header, meta):
    prefix = write_pair(tmp_path / "pair", edge_documents(1000), header, vocab_size=1000)
    metadata = PairMetadata(tokenizer_fingerprint="test", vocab_size=1000, eod_id=0, token_dtype=meta)
    metadata_path(prefix).write_bytes(metadata.to_json())
    dataset = build_train(prefix, ParityTokenizer(eod=0, pad=1, vocab_size=1000), tmp_path)

    with pytest.raises(DataFileError) as error:
        dataset[0]
    message = str(error.value)
    assert f"{prefix}.meta.json says the tokens are {meta}" in message
    assert f"the header of {prefix}.idx says {np.dtype(header)}" in message


# -- the vocabulary ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
@pytest.mark.parametrize(("dtype", "vocab_size"), [(np.uint16, 8192), (np.int32, 8192), (np.uint8, 200), (np.int64, 3)])
def test_ids_up_to_the_vocabulary_edge_are_read_and_past_it_refused(tmp_path, mmap, dtype, vocab_size):
    """``vocab_size - 1`` is a token; ``vocab_size`` is an error naming the file, the document and the id."""
    tokenizer = ParityTokenizer(eod=0, pad=1, vocab_size=vocab_size)
    documents = [[vocab_size - 1] * 5 + [0] for _ in range(10)]
    ok = build_train(write_pair(tmp_path / "ok", documents, dtype), tokenizer, tmp_path, mmap_bin_files=mmap)
    assert max(int(sample["tokens"].max()) for sample in every_sample(ok)) == vocab_size - 1

    documents[7][2] = vocab_size
    bad = build_train(write_pair(tmp_path / "bad", documents, dtype), tokenizer, tmp_path, mmap_bin_files=mmap)
    messages = []
    for read in (lambda: [bad[i] for i in range(len(bad))], lambda: bad.__getitems__(list(range(len(bad))))):
        with pytest.raises(DataFileError) as error:
            read()
        messages.append(str(error.value))
    for message in messages:
        assert message.startswith(
            f"{tmp_path / 'bad'}.bin: the token id {vocab_size} in document 7 (sequence 7, token 2)"
        )
        assert f"outside [0, {vocab_size}) (the tokenizer's vocabulary)" in message


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64])
@pytest.mark.parametrize("vocab_size", [None, 50], ids=["no-vocabulary", "vocabulary"])
def test_a_negative_id_is_refused_with_or_without_a_vocabulary(tmp_path, dtype, vocab_size):
    documents = [[5, 6, 7, 8, 0] for _ in range(8)]
    documents[3][1] = -1
    prefix = write_pair(tmp_path / "pair", documents, dtype)
    dataset = build_train(prefix, ParityTokenizer(eod=0, pad=1, vocab_size=vocab_size), tmp_path)

    with pytest.raises(
        DataFileError, match=r"the token id -1 in document 3 \(sequence 3, token 1\) is (negative|outside)"
    ):
        [dataset[i] for i in range(len(dataset))]


def test_the_meta_json_vocabulary_bounds_the_ids_when_it_is_smaller(tmp_path):
    """The ``.meta.json``'s vocab_size bounds the ids too, and the error names that file."""
    documents = [[5, 6, 7, 0] for _ in range(8)]
    documents[4][0] = 600
    prefix = write_pair(tmp_path / "pair", documents, np.uint16, vocab_size=600)
    dataset = build_train(prefix, ParityTokenizer(eod=0, pad=1, vocab_size=None), tmp_path)

    with pytest.raises(
        DataFileError, match=r"600 in document 4 .* outside \[0, 600\) \(the vocabulary of pair.meta.json\)"
    ):
        dataset.__getitems__(list(range(len(dataset))))


def test_a_pickled_dataset_checks_the_ids_in_its_copy(tmp_path):
    """A dataset sent to a DataLoader worker keeps checking what it reads."""
    documents = [[5, 6, 7, 0] for _ in range(8)]
    documents[2][1] = 9000
    dataset = build_train(write_pair(tmp_path / "pair", documents, np.uint16), ParityTokenizer(0, 1, 8192), tmp_path)
    copy = pickle.loads(pickle.dumps(dataset))

    with pytest.raises(DataFileError, match=r"the token id 9000 in document 2"):
        [copy[i] for i in range(len(copy))]


# -- the per-read check of a memory-mapped pair, chunk by chunk ---------------------------------------------------


@pytest.mark.parametrize("shift", [2, 4, 15], ids=["4-token-chunks", "16-token-chunks", "default-chunks"])
def test_a_read_fails_exactly_when_what_it_returns_holds_a_bad_id(tmp_path, monkeypatch, shift):
    """Reads of good documents beside a bad id, before and after it is met, return their tokens; every read that
    returns the bad id (``[i]``, ``get``, a slice, ``join``, ``gather``) fails naming it, as often as it is made."""
    monkeypatch.setattr(indexed_data_reader, "_ID_CHUNK_SHIFT", shift)
    documents = edge_documents(1000, count=20, seed=3)
    documents[9][1] = 1000
    reader = IndexedDataReader(write_pair(tmp_path / "pair", documents, np.uint16))
    reader.check_token_ids(1000)
    good = [i for i in range(20) if i != 9]
    bad_reads = [
        lambda: reader[9],
        lambda: reader.get(9, 1, 1),
        lambda: reader[5:12],
        lambda: reader.join([(8, 0, None), (9, 0, 2)]),
        lambda: reader.gather([0, 9]),
    ]
    for _ in range(2):
        for i in good[::-1]:
            np.testing.assert_array_equal(reader[i], documents[i])
        np.testing.assert_array_equal(reader.get(9, 2), documents[9][2:])
        for read in bad_reads:
            with pytest.raises(DataFileError, match=r"the token id 1000 in document 9 \(sequence 9, token 1\)"):
                read()
    np.testing.assert_array_equal(reader.gather(good), np.concatenate([documents[i] for i in good]))


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
def test_ids_are_checked_from_check_token_ids_on_after_reads_without_it(tmp_path, mmap):
    """A reader that has already read without the check (the plain ``reader[i]``) refuses a bad id once
    ``check_token_ids`` is called, and still returns the good documents."""
    documents = edge_documents(1000, count=20, seed=5)
    documents[6][0] = 1000
    reader = IndexedDataReader(write_pair(tmp_path / "pair", documents, np.uint16), mmap=mmap)
    np.testing.assert_array_equal(reader[6], documents[6])
    np.testing.assert_array_equal(reader[-1], documents[-1])
    reader.check_token_ids(1000)
    with pytest.raises(DataFileError, match=r"the token id 1000 in document 6 \(sequence 6, token 0\)"):
        reader[6]
    with pytest.raises(DataFileError, match=r"the token id 1000 in document 6 \(sequence 6, token 0\)"):
        reader[-14]
    for i in (0, 5, 7, 19):
        np.testing.assert_array_equal(reader[i], documents[i])
