"""Specification of the reader's integrity checks: no sample is ever cut from a corrupt or misplaced pair.

A corrupt index (pointers, lengths or document indices) opens, since start-up must stay a header read per prefix,
but the first read of tokens through any path (``reader[i]``, ``get``, a slice, ``gather`` and the datasets built
on top) raises a ``DataFileError`` naming the file, the first bad entry and the fix; the check runs once per reader
and again in each process a reader is sent to. Directories and other non-files in place of the ``.idx`` or
``.bin``, and header counts the file cannot hold, are ``DataFileError`` s naming the path, never an ``OSError`` or an
allocation.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.indexed.idx_format import HEADER_SIZE
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader, read_sequence_counts
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset

from .test_index_cache import write_corpus
from .test_indexed_data_reader import (
    Corpus,
    bin_path,
    document_index_offset,
    idx_path,
    patch,
    pointer_offset,
    random_corpus,
)
from .test_indexed_pretrain_dataset import SEQ_LENGTH, packed_records, write_records

COUNT = 24  # sequences in random_corpus
FIX = "Rebuild the pair with `python -m hyper_parallel.data.tools.offline_preparation`"


# -- damaging an index -----------------------------------------------------------------------------------------


def pointer(corpus: Corpus, i: int) -> int:
    """Byte offset of sequence ``i`` in the corpus's ``.bin``."""
    return int(corpus.lengths[:i].sum()) * corpus.dtype.itemsize


def set_pointer(corpus: Corpus, i: int, value: int) -> None:
    patch(idx_path(corpus.prefix), pointer_offset(COUNT, i), struct.pack("<q", value))


def set_length(corpus: Corpus, i: int, value: int) -> None:
    patch(idx_path(corpus.prefix), HEADER_SIZE + 4 * i, struct.pack("<i", value))


def set_document_index(corpus: Corpus, j: int, value: int) -> None:
    patch(idx_path(corpus.prefix), document_index_offset(COUNT, j), struct.pack("<q", value))


def bin_size(corpus: Corpus) -> int:
    return bin_path(corpus.prefix).stat().st_size


def _moved_pointer(c: Corpus) -> str:
    set_pointer(c, 10, pointer(c, 10) + 4)
    moved = pointer(c, 10) + 4
    return f"1 sequence pointers disagree with the cumulative lengths; first: sequence 10 points to byte {moved}"


def _pointer_backwards(c: Corpus) -> str:
    set_pointer(c, 12, pointer(c, 2))
    return f"first: sequence 12 points to byte {pointer(c, 2)}, expected {pointer(c, 12)}"


def _pointer_past_the_bin(c: Corpus) -> str:
    size = bin_size(c)
    set_pointer(c, 7, size + 64)
    where = f"{bin_path(c.prefix)} ({size} bytes)"
    return f"lie outside {where}; first: sequence 7 of {c.lengths[7]} tokens at byte {size + 64}"


def _negative_pointer(c: Corpus) -> str:
    set_pointer(c, 6, -8)
    return f"first: sequence 6 of {c.lengths[6]} tokens at byte -8"


def _negative_length(c: Corpus) -> str:
    set_length(c, 5, -50)
    return "1 sequences have a negative length; first: sequence 5 has length -50"


def _oversized_length(c: Corpus) -> str:
    set_length(c, 5, 2**31 - 1)
    return f"first: sequence 5 of {2**31 - 1} tokens at byte {pointer(c, 5)}"


def _documents_not_from_0(c: Corpus) -> str:
    set_document_index(c, 0, 1)
    return "document_indices must start with 0, found 1"


def _documents_not_to_the_count(c: Corpus) -> str:
    set_document_index(c, len(c.document_indices) - 1, COUNT - 1)
    return f"document_indices must end with the sequence count {COUNT}, found {COUNT - 1}"


def _documents_decrease(c: Corpus) -> str:
    set_document_index(c, 1, COUNT)
    return f"document_indices decrease at position 2 ({COUNT} then {c.document_indices[2]})"


def _documents_beyond_the_count(c: Corpus) -> str:
    set_document_index(c, 1, COUNT + 5)
    return f"document indices lie outside [0, {COUNT}]; first: document_indices[1] = {COUNT + 5}"


def _bin_longer_than_the_sequences(c: Corpus) -> str:
    size = bin_size(c)
    with open(bin_path(c.prefix), "ab") as f:
        f.write(bytes(8))
    return f"the sequences hold {size} bytes but {bin_path(c.prefix)} has {size + 8} bytes"


# name: damage the pair in a way opening cannot see, and return the phrase the error must hold
CORRUPT_INDICES: dict[str, Callable[[Corpus], str]] = {
    "moved-pointer": _moved_pointer,
    "pointer-backwards": _pointer_backwards,
    "pointer-past-the-bin": _pointer_past_the_bin,
    "negative-pointer": _negative_pointer,
    "negative-length": _negative_length,
    "oversized-length": _oversized_length,
    "documents-not-from-0": _documents_not_from_0,
    "documents-not-to-the-count": _documents_not_to_the_count,
    "documents-decrease": _documents_decrease,
    "documents-beyond-the-count": _documents_beyond_the_count,
    "bin-longer-than-the-sequences": _bin_longer_than_the_sequences,
}

# every way of reading tokens from a reader; slices need a memory-mapped .bin
READS: dict[str, Callable[[IndexedDataReader], object]] = {
    "reader[i]": lambda r: r[1],
    "reader.get": lambda r: r.get(1, offset=1, length=2),
    "reader[a:b]": lambda r: r[0:3],
    "gather": lambda r: r.gather([1, 2], [0, 1], [2, 1]),
}


@pytest.fixture
def corpus(tmp_path) -> Corpus:
    corpus = random_corpus(tmp_path / "corrupt", seed=8, dtype=np.int32)
    assert len(corpus.sequences) == COUNT and corpus.document_indices[2] < COUNT
    assert np.all(corpus.lengths[[1, 2, 5, 6, 7]] > 2)
    return corpus


def assert_names_the_problem(error: pytest.ExceptionInfo, corpus: Corpus, phrase: str) -> None:
    message = str(error.value)
    assert f"{idx_path(corpus.prefix)}: the index is inconsistent" in message
    assert phrase in message, message
    assert FIX in message


# -- every read path -------------------------------------------------------------------------------------------


# Slices need a memory-mapped .bin, so they are read with mmap only.
READ_MODES = [(read, mmap) for read in READS for mmap in (True, False) if mmap or read != "reader[a:b]"]


@pytest.mark.parametrize(("read", "mmap"), READ_MODES)
@pytest.mark.parametrize("name", list(CORRUPT_INDICES))
def test_a_corrupt_index_raises_before_the_first_tokens(corpus, name, read, mmap):
    """The pair opens (opening reads the header only), but the first read through any path raises DataFileError
    naming the index, the first bad entry with its values, and the fix; it keeps raising on later reads."""
    phrase = CORRUPT_INDICES[name](corpus)
    reader = IndexedDataReader(corpus.prefix, mmap=mmap)
    for _ in range(2):
        with pytest.raises(DataFileError) as error:
            READS[read](reader)
        assert_names_the_problem(error, corpus, phrase)


@pytest.mark.parametrize("name", list(CORRUPT_INDICES))
def test_verify_reports_the_same_problem(corpus, name):
    """``verify`` runs the same check on demand."""
    phrase = CORRUPT_INDICES[name](corpus)
    with pytest.raises(DataFileError) as error:
        IndexedDataReader(corpus.prefix).verify()
    assert_names_the_problem(error, corpus, phrase)


def test_the_index_is_checked_once_per_reader(corpus, monkeypatch):
    """Opening does not walk the index; the first read does, once, and later reads of any kind do not again."""
    checks = []
    walk = IndexedDataReader._index_problems
    monkeypatch.setattr(IndexedDataReader, "_index_problems", lambda reader: checks.append(1) or walk(reader))
    reader = IndexedDataReader(corpus.prefix)
    assert checks == []
    for _ in range(3):
        for read in READS.values():
            read(reader)
    assert checks == [1]


def test_a_reader_sent_to_a_worker_checks_the_files_it_reopens(corpus):
    """A pickled reader (as DataLoader workers receive it) re-opens the pair and checks it again before its first
    read, so an index damaged after the parent's check is still caught in the worker."""
    reader = IndexedDataReader(corpus.prefix)
    np.testing.assert_array_equal(reader[1], corpus.sequences[1])
    phrase = _moved_pointer(corpus)
    clone = pickle.loads(pickle.dumps(reader))
    with pytest.raises(DataFileError) as error:
        clone[1]
    assert_names_the_problem(error, corpus, phrase)


def test_a_bin_changed_after_opening_is_checked_at_the_first_read(corpus):
    """The full check compares the index with the ``.bin`` as it is when first read, not when the pair opened."""
    reader = IndexedDataReader(corpus.prefix)
    phrase = _bin_longer_than_the_sequences(corpus)
    with pytest.raises(DataFileError) as error:
        reader.gather([0], [0], [1])
    assert_names_the_problem(error, corpus, phrase)


# -- through the datasets --------------------------------------------------------------------------------------


def dataset_reads(dataset) -> list[Callable[[], object]]:
    """``ds[0]``, ``ds.__getitems__`` and the first batch of a DataLoader (which calls ``__getitems__``)."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    return [lambda: dataset[0], lambda: dataset.__getitems__([0, 1]), lambda: next(iter(loader))]


def _damage_documents(prefix: str, damage: str) -> None:
    """Move the pointer of sequence 9 by one token, or make the length of sequence 5 negative (300 sequences)."""
    if damage == "moved-pointer":
        offset = pointer_offset(300, 9)
        (value,) = struct.unpack_from("<q", Path(f"{prefix}.idx").read_bytes(), offset)
        patch(Path(f"{prefix}.idx"), offset, struct.pack("<q", value + 2))
    else:
        patch(Path(f"{prefix}.idx"), HEADER_SIZE + 4 * 5, struct.pack("<i", -40))


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("damage", ["moved-pointer", "negative-length"])
def test_gpt_datasets_over_a_corrupt_index_return_no_sample(tmp_path, tokenizer, damage, lazy):
    """``build_indexed_text_dataset`` over a damaged pair: ``ds[i]``, ``__getitems__`` and a DataLoader raise the
    reader's DataFileError, for every split, instead of returning samples cut at the wrong bytes."""
    prefix = write_corpus(tmp_path / "corpus_text_document", num_documents=300, seed=3)
    _damage_documents(prefix, damage)
    settings = {"seq_length": 32, "split": "90, 8, 2", "data_cache_path": str(tmp_path / "cache")}
    splits = build_indexed_text_dataset(prefix, {**settings, "data_lazy_load": lazy}, [200, 30, 10], tokenizer)

    for dataset in splits:
        for read in dataset_reads(dataset):
            with pytest.raises(DataFileError, match="the index is inconsistent") as error:
                read()
            assert f"{prefix}.idx" in str(error.value) and FIX in str(error.value)


def test_packed_records_over_a_corrupt_index_return_no_sample(tmp_path, tokenizer):
    """The same for ``GPTFromMRDataset`` (``is_dataset_from_mr: true``), whose batched read is one ``gather``."""
    prefix = write_records(tmp_path / "packed_text_document", packed_records(40, seed=2))
    record_bytes = (SEQ_LENGTH + 1) * 2
    patch(Path(f"{prefix}.idx"), pointer_offset(40, 3), struct.pack("<q", 3 * record_bytes + 2))
    settings = {"seq_length": SEQ_LENGTH, "split": "1, 0, 0", "is_dataset_from_mr": True}
    train = build_indexed_text_dataset(prefix, settings, None, tokenizer)[0]

    for read in dataset_reads(train):
        with pytest.raises(DataFileError, match="first: sequence 3 points to byte"):
            read()


# -- directories and other non-files ---------------------------------------------------------------------------


def _replace_with_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "inside").write_bytes(bytes(64))


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("suffix", ["idx", "bin"])
def test_a_directory_in_place_of_a_data_file_is_named(corpus, suffix, mmap):
    """A directory at ``<prefix>.idx`` or ``<prefix>.bin`` is a DataFileError naming it, not an OSError."""
    path = Path(f"{corpus.prefix}.{suffix}")
    _replace_with_directory(path)
    with pytest.raises(DataFileError, match=f"{path} is a directory") as error:
        IndexedDataReader(corpus.prefix, mmap=mmap)
    assert "rebuild the pair" in str(error.value).lower()


def test_a_directory_in_place_of_the_index_is_named_by_the_header_read(corpus):
    """``read_sequence_counts`` (lazy builds, the sequences-file tool) names it too."""
    _replace_with_directory(idx_path(corpus.prefix))
    with pytest.raises(DataFileError, match=f"{idx_path(corpus.prefix)} is a directory"):
        read_sequence_counts(str(corpus.prefix))


@pytest.mark.parametrize("mmap", [True, False])
def test_a_bin_replaced_by_a_directory_after_opening_is_named_at_the_first_read(corpus, mmap):
    """The ``.bin`` is opened on the first read; a directory found there then is named the same way."""
    reader = IndexedDataReader(corpus.prefix, mmap=mmap)
    _replace_with_directory(bin_path(corpus.prefix))
    with pytest.raises(DataFileError, match=f"{bin_path(corpus.prefix)} is a directory"):
        reader[0]


_OPEN_FIFO_PAIR = """
import sys
from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader, read_sequence_counts
for open_pair in (IndexedDataReader, read_sequence_counts):
    try:
        open_pair(sys.argv[1])
    except DataFileError as error:
        print(error)
"""


@pytest.mark.parametrize("suffix", ["idx", "bin"])
def test_a_fifo_in_place_of_a_data_file_is_refused_without_waiting(corpus, suffix):
    """A named pipe is refused at once as not a regular file (opening it must not wait for a writer)."""
    path = Path(f"{corpus.prefix}.{suffix}")
    path.unlink()
    os.mkfifo(path)
    result = subprocess.run(
        [sys.executable, "-c", _OPEN_FIFO_PAIR, str(corpus.prefix)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert f"{path} is not a regular file" in result.stdout


# -- header counts against the file size -----------------------------------------------------------------------


HEADER_COUNTS = {
    "sequences-10**18": (18, 10**18, "promises 1000000000000000000 sequences"),
    "one-sequence-too-many": (18, COUNT + 1, f"promises {COUNT + 1} sequences"),
    "documents-10**18": (26, 10**18, f"promises {COUNT} sequences and {10**18 - 1} documents"),
}


@pytest.mark.parametrize("name", list(HEADER_COUNTS))
def test_header_counts_the_file_cannot_hold_are_refused_before_any_allocation(corpus, name):
    """Opening and the header-only read compare the header's counts with the ``.idx`` size first."""
    offset, value, phrase = HEADER_COUNTS[name]
    patch(idx_path(corpus.prefix), offset, struct.pack("<Q", value))
    for open_pair in (IndexedDataReader, read_sequence_counts):
        with pytest.raises(DataFileError) as error:
            open_pair(str(corpus.prefix))
        message = str(error.value)
        assert f"{idx_path(corpus.prefix)}: the index is truncated or its header is corrupt" in message
        assert phrase in message and "Rebuild the pair" in message


def test_a_lazy_build_refuses_a_header_count_of_10_to_the_18(tmp_path, tokenizer):
    """``data_lazy_load: true`` sizes the splits from the header alone; a corrupt count is an error naming the
    index, not an attempt to allocate 10**18 sequence ids."""
    prefix = write_corpus(tmp_path / "corpus_text_document", num_documents=100, seed=4)
    patch(Path(f"{prefix}.idx"), 18, struct.pack("<Q", 10**18))
    settings = {"seq_length": 32, "split": "90, 8, 2", "data_lazy_load": True, "data_cache_path": str(tmp_path)}
    with pytest.raises(DataFileError, match=f"{prefix}.idx: the index is truncated or its header is corrupt"):
        build_indexed_text_dataset(prefix, settings, [100, 10, 5], tokenizer)
