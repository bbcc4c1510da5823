"""Specification of ``IndexedDataReader``: reading Megatron ``.idx``/``.bin`` pairs and refusing bad ones.

The pairs are written by hand here (header + arrays), independently of the builder, so that these tests pin
the reader against the documented byte layout alone.
"""

from __future__ import annotations

import mmap
import os
import pickle
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.indexed import _indexed_helpers, indexed_data_reader
from hyper_parallel.data.indexed.idx_format import HEADER_SIZE, IdxHeader
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader

TOKEN_DTYPES = [np.uint8, np.uint16, np.int32, np.int64, np.float64]
INDEX_READ_LIMITS = {"read": 2**62, "mapped": 0}  # how the reader holds an index: read into memory, or mapped


# -- writing pairs by hand -------------------------------------------------------------------------------------


def idx_path(prefix: Path) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: Path) -> Path:
    return Path(f"{prefix}.bin")


def write_idx(
    path: Path, dtype: np.dtype, lengths: np.ndarray, document_indices: np.ndarray, modes: np.ndarray | None = None
) -> None:
    """Write an index whose pointers are the cumulative byte lengths of ``lengths``."""
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.cumsum(np.concatenate([[0], lengths.astype(np.int64) * np.dtype(dtype).itemsize]))[:-1]
    with open(path, "wb") as f:
        f.write(IdxHeader(np.dtype(dtype), len(lengths), len(document_indices)).pack())
        f.write(lengths.tobytes())
        f.write(pointers.astype(np.int64).tobytes())
        f.write(np.asarray(document_indices, dtype=np.int64).tobytes())
        if modes is not None:
            f.write(np.asarray(modes, dtype=np.int8).tobytes())


def write_pair(
    prefix: Path, sequences: list[np.ndarray], document_indices, dtype, modes: np.ndarray | None = None
) -> Path:
    """Write ``<prefix>.bin`` (the concatenated sequences) and ``<prefix>.idx``; return the prefix."""
    dtype = np.dtype(dtype)
    bin_path(prefix).write_bytes(b"".join(np.asarray(s, dtype=dtype).tobytes() for s in sequences))
    write_idx(idx_path(prefix), dtype, np.array([len(s) for s in sequences]), np.asarray(document_indices), modes)
    return prefix


def patch(path: Path, offset: int, data: bytes) -> None:
    """Overwrite ``len(data)`` bytes of ``path`` at ``offset``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def pointer_offset(sequence_count: int, i: int) -> int:
    """Byte offset of sequence pointer ``i`` in an index of ``sequence_count`` sequences."""
    return HEADER_SIZE + 4 * sequence_count + 8 * i


def document_index_offset(sequence_count: int, j: int) -> int:
    """Byte offset of document index ``j`` in an index of ``sequence_count`` sequences."""
    return HEADER_SIZE + 12 * sequence_count + 8 * j


@dataclass
class Corpus:
    """A pair on disk and what it holds."""

    prefix: Path
    dtype: np.dtype
    sequences: list[np.ndarray]
    document_indices: np.ndarray
    modes: np.ndarray | None

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(s) for s in self.sequences])


def random_tokens(rng: np.random.Generator, dtype: np.dtype, count: int) -> np.ndarray:
    """``count`` tokens spanning the whole range of an integer ``dtype`` (any values for floats)."""
    if dtype.kind == "f":
        return rng.standard_normal(count).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=count, endpoint=True, dtype=np.int64).astype(dtype)


def random_corpus(prefix: Path, seed: int, dtype, multimodal: bool = False, count: int = 24) -> Corpus:
    """Write a seeded random pair with empty sequences (one of them last) and empty documents."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    lengths = rng.integers(1, 40, size=count)
    lengths[[3, 4, count - 1]] = 0
    sequences = [random_tokens(rng, dtype, int(n)) for n in lengths]
    boundaries = rng.integers(0, count + 1, size=5)
    document_indices = np.sort(np.concatenate([[0, 7, 7, count], boundaries])).astype(np.int64)
    modes = rng.integers(-3, 4, size=count).astype(np.int8) if multimodal else None
    write_pair(prefix, sequences, document_indices, dtype, modes)
    return Corpus(prefix, dtype, sequences, document_indices, modes)


@pytest.fixture(params=TOKEN_DTYPES, ids=lambda d: np.dtype(d).name)
def corpus(request, tmp_path) -> Corpus:
    return random_corpus(tmp_path / "corpus", seed=TOKEN_DTYPES.index(request.param), dtype=request.param)


@pytest.fixture(params=list(INDEX_READ_LIMITS))
def index_access(request, monkeypatch) -> str:
    """Every index read into memory, or every non-empty one memory-mapped: what must hold for both ways."""
    monkeypatch.setattr(indexed_data_reader, "_READ_INDEX_AT_MOST", INDEX_READ_LIMITS[request.param])
    return request.param


@pytest.fixture
def multimodal_corpus(tmp_path) -> Corpus:
    return random_corpus(tmp_path / "mm", seed=11, dtype=np.uint16, multimodal=True)


def assert_tokens(actual: np.ndarray, expected: np.ndarray, dtype: np.dtype) -> None:
    assert actual.dtype == dtype
    np.testing.assert_array_equal(actual, expected)


def assert_token_lists(actual: list[np.ndarray], expected: list[np.ndarray], dtype: np.dtype) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert_tokens(got, want, dtype)


# -- reading ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mmap", [True, False])
def test_getitem_returns_every_sequence(corpus, mmap, index_access):
    """``reader[i]`` returns sequence i with the header's dtype, for Python and numpy integer indices."""
    reader = IndexedDataReader(corpus.prefix, mmap=mmap)
    for i, expected in enumerate(corpus.sequences):
        assert_tokens(reader[i], expected, corpus.dtype)
    assert_tokens(reader[np.int64(5)], corpus.sequences[5], corpus.dtype)


@pytest.mark.parametrize("mmap", [True, False])
def test_negative_indices_count_from_the_end(corpus, mmap):
    """``reader[-k]`` is sequence ``len - k``, down to ``-len``."""
    reader = IndexedDataReader(corpus.prefix, mmap=mmap)
    n = len(corpus.sequences)
    for k in (1, 2, n):
        assert_tokens(reader[-k], corpus.sequences[n - k], corpus.dtype)
        assert_tokens(reader.get(-k), corpus.sequences[n - k], corpus.dtype)


@pytest.mark.parametrize("mmap", [True, False])
def test_index_out_of_range_raises_index_error(corpus, mmap):
    """Indices outside ``[-len, len)`` raise IndexError naming the index, the dataset and its size."""
    reader = IndexedDataReader(corpus.prefix, mmap=mmap)
    n = len(corpus.sequences)
    for bad in (n, n + 7, -n - 1):
        with pytest.raises(IndexError, match=rf"sequence {bad} is out of range") as info:
            reader[bad]
        assert str(corpus.prefix) in str(info.value)
        assert f"{n} sequences" in str(info.value)
        with pytest.raises(IndexError, match="out of range"):
            reader.get(bad)


def test_contiguous_slices_return_lists_of_sequences(corpus):
    """``reader[a:b]`` returns the sequences a..b-1, with Python slice semantics for bounds."""
    reader = IndexedDataReader(corpus.prefix)
    n = len(corpus.sequences)
    for key in (slice(0, n), slice(2, 9), slice(3, 5), slice(-4, None), slice(None, 6), slice(1, n + 10)):
        assert_token_lists(reader[key], corpus.sequences[key], corpus.dtype)


def test_empty_slices_return_empty_lists(corpus):
    """A slice selecting nothing (equal or reversed bounds, or past the end) is an empty list."""
    reader = IndexedDataReader(corpus.prefix)
    n = len(corpus.sequences)
    for key in (slice(5, 5), slice(9, 3), slice(n, n + 2), slice(0, 0)):
        assert reader[key] == []


def test_slices_with_a_step_raise_value_error(corpus):
    """Only contiguous slices are supported: any step other than 1 raises ValueError."""
    reader = IndexedDataReader(corpus.prefix)
    for key in (slice(None, None, 2), slice(0, 10, 3), slice(None, None, -1)):
        with pytest.raises(ValueError, match="step"):
            reader[key]


def test_non_integer_index_raises_type_error(corpus):
    """Indices that are neither integers nor slices raise TypeError naming the type."""
    reader = IndexedDataReader(corpus.prefix)
    for key in ("1", 1.0, [1, 2]):
        with pytest.raises(TypeError, match=type(key).__name__):
            reader[key]


@pytest.mark.parametrize("mmap", [True, False])
def test_get_reads_a_token_range(corpus, mmap):
    """``get(i, offset, length)`` returns tokens ``[offset, offset + length)``; length defaults to the rest."""
    rng = np.random.default_rng(3)
    reader = IndexedDataReader(corpus.prefix, mmap=mmap)
    for i, sequence in enumerate(corpus.sequences):
        n = len(sequence)
        offset = int(rng.integers(0, n + 1))
        length = int(rng.integers(0, n - offset + 1))
        assert_tokens(reader.get(i), sequence, corpus.dtype)
        assert_tokens(reader.get(i, offset=offset), sequence[offset:], corpus.dtype)
        assert_tokens(reader.get(i, offset, length), sequence[offset : offset + length], corpus.dtype)
        assert_tokens(reader.get(i, n, 0), sequence[:0], corpus.dtype)


@pytest.mark.parametrize("mmap", [True, False])
def test_gather_concatenates_the_listed_token_ranges(corpus, mmap):
    """``gather(ids, offsets, lengths)`` equals the ranges cut from the written sequences and joined in a loop;
    ``gather(ids)`` is the listed sequences whole, repeats and empty sequences included."""
    reader = IndexedDataReader(corpus.prefix, mmap=mmap)
    rng = np.random.default_rng(7)
    ids = rng.integers(0, len(corpus.sequences), size=40)
    lengths = corpus.lengths[ids]
    offsets = rng.integers(0, lengths + 1)
    counts = rng.integers(0, lengths - offsets + 1)
    expected = [corpus.sequences[i][o : o + n] for i, o, n in zip(ids, offsets, counts, strict=True)]
    assert_tokens(reader.gather(ids, offsets, counts), np.concatenate(expected), corpus.dtype)
    whole = np.concatenate([corpus.sequences[i] for i in ids])
    assert_tokens(reader.gather(ids), whole, corpus.dtype)
    assert_tokens(reader.gather(ids.tolist(), lengths=lengths), whole, corpus.dtype)
    assert_tokens(reader.gather([]), np.empty(0), corpus.dtype)


@pytest.mark.parametrize("mmap", [True, False])
def test_gather_writes_into_out_and_returns_it(corpus, mmap):
    """``gather(..., out=buffer[:n])`` writes exactly what ``gather`` returns without ``out`` into the buffer and
    returns that slice, leaving the rest of the buffer as it was."""
    reader = IndexedDataReader(corpus.prefix, mmap=mmap)
    rng = np.random.default_rng(8)
    for ids in (rng.integers(0, len(corpus.sequences), size=40), np.array([3, 4]), np.array([], dtype=np.int64)):
        lengths = corpus.lengths[ids]
        offsets = rng.integers(0, lengths + 1)
        counts = rng.integers(0, lengths - offsets + 1)
        for args in ((ids,), (ids, offsets, counts)):
            expected = reader.gather(*args)
            buffer = np.full(len(expected) + 5, 7, dtype=corpus.dtype)
            out = buffer[: len(expected)]
            assert reader.gather(*args, out=out) is out
            assert_tokens(out, expected, corpus.dtype)
            assert_tokens(buffer[len(expected) :], np.full(5, 7), corpus.dtype)
    whole = np.concatenate(corpus.sequences)
    out = np.empty(len(whole), corpus.dtype)
    assert_tokens(reader.gather(np.arange(len(corpus.sequences)), out=out), whole, corpus.dtype)


@pytest.mark.parametrize("mmap", [True, False])
def test_gather_refuses_an_out_that_does_not_fit(corpus, mmap):
    """An ``out`` of another dtype, size or shape, read-only, non-contiguous or not an array is refused with a
    ValueError naming what it is and what is wanted."""
    reader = IndexedDataReader(corpus.prefix, mmap=mmap)
    ids = [0, 1, 2]
    count = int(corpus.lengths[ids].sum())
    other = np.dtype(np.int16) if corpus.dtype != np.int16 else np.dtype(np.uint16)
    read_only = np.empty(count, corpus.dtype)
    read_only.flags.writeable = False
    bad_outs = {
        "another dtype": np.empty(count, other),
        "one token short": np.empty(count - 1, corpus.dtype),
        "one token long": np.empty(count + 1, corpus.dtype),
        "two dimensions": np.empty((1, count), corpus.dtype),
        "read-only": read_only,
        "non-contiguous": np.empty(2 * count, corpus.dtype)[::2],
        "a list": [0] * count,
    }
    for name, out in bad_outs.items():
        with pytest.raises(ValueError, match=rf"out must be a writable C-contiguous 1-D {corpus.dtype} array") as info:
            reader.gather(ids, out=out)
        assert f"exactly the {count} tokens" in str(info.value), name
    assert "got list" in str(info.value)


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize(
    ("ids", "offsets", "lengths"),
    [([-1], None, None), ([24], None, None), ([0], [0], [-1]), ([0], [-1], [1]), ([0, 1], [0, 0], [1, 10**6])],
    ids=["negative-id", "id-past-the-end", "negative-length", "negative-offset", "range-past-the-end"],
)
def test_gather_outside_the_pair_raises_index_error(corpus, mmap, ids, offsets, lengths):
    reader = IndexedDataReader(corpus.prefix, mmap=mmap)
    with pytest.raises(IndexError, match=re.escape(str(corpus.prefix))):
        reader.gather(ids, offsets, lengths)


@pytest.mark.parametrize("mmap", [True, False])
def test_get_outside_the_sequence_raises_index_error(corpus, mmap):
    """Token ranges that leave the sequence raise IndexError naming the range and the sequence length."""
    reader = IndexedDataReader(corpus.prefix, mmap=mmap)
    i = int(np.argmax(corpus.lengths))
    n = len(corpus.sequences[i])
    for offset, length in ((n + 1, None), (-1, 2), (1, n), (0, n + 1), (2, -1)):
        with pytest.raises(IndexError, match=rf"outside sequence {i} .* which has {n} tokens"):
            reader.get(i, offset, length)


def test_len_and_counts(corpus):
    """``len`` is the sequence count; documents and tokens are counted from the index."""
    reader = IndexedDataReader(corpus.prefix)
    assert len(reader) == len(corpus.sequences)
    assert reader.num_documents == len(corpus.document_indices) - 1
    assert reader.num_tokens == int(corpus.lengths.sum())
    assert reader.dtype == corpus.dtype


def test_index_arrays_have_megatron_dtypes_and_are_views(corpus, index_access):
    """Lengths/pointers/document indices are int32/int64/int64 read-only zero-copy views of the index."""
    reader = IndexedDataReader(corpus.prefix)
    expected_pointers = np.cumsum(np.concatenate([[0], corpus.lengths[:-1]])) * corpus.dtype.itemsize
    arrays = {
        "sequence_lengths": (np.int32, corpus.lengths),
        "sequence_pointers": (np.int64, expected_pointers),
        "document_indices": (np.int64, corpus.document_indices),
    }
    for name, (dtype, expected) in arrays.items():
        array = getattr(reader, name)
        assert array.dtype == dtype, name
        assert not array.flags.owndata and array.base is not None, name
        assert not array.flags.writeable, name
        np.testing.assert_array_equal(array, expected, err_msg=name)
    assert reader.sequence_modes is None


def test_small_indices_are_read_and_large_ones_mapped(tmp_path):
    """An index that fits in one page is read into memory at once (cheaper to open than a map); a larger one is
    memory-mapped, so that processes share its pages."""
    small = random_corpus(tmp_path / "small", seed=1, dtype=np.uint16)
    large = random_corpus(tmp_path / "large", seed=2, dtype=np.uint16, count=2000)
    assert idx_path(small.prefix).stat().st_size <= mmap.PAGESIZE < idx_path(large.prefix).stat().st_size

    assert isinstance(IndexedDataReader(small.prefix).sequence_lengths.base, bytes)
    mapped = IndexedDataReader(large.prefix)
    assert isinstance(mapped.sequence_lengths.base.obj, mmap.mmap)
    np.testing.assert_array_equal(mapped.sequence_lengths, large.lengths)
    assert_token_lists([mapped[i] for i in range(len(mapped))], large.sequences, large.dtype)


def test_plain_int_reads_equal_the_general_path(corpus, index_access):
    """With a map and no id check, ``reader[i]`` for a Python int (answered by the C base) returns what a numpy
    integer (the Python path) returns: a read-only view of the same bytes, with the same dtype and base."""
    reader = IndexedDataReader(corpus.prefix)
    n = len(corpus.sequences)
    reader[0]  # the first read opens the .bin and arms the fast path
    for i in [*range(n), *range(-n, 0)]:
        fast, general = reader[i], reader[np.int64(i)]
        assert_tokens(fast, general, corpus.dtype)
        assert fast.shape == general.shape
        assert fast.base is general.base
        assert not fast.flags.writeable and not fast.flags.owndata
        if len(general):
            assert fast.__array_interface__["data"] == general.__array_interface__["data"]
    for bad in (n, -n - 1, 2**64, -(2**70)):
        with pytest.raises(IndexError, match=rf"sequence {bad} is out of range"):
            reader[bad]


def test_memory_mapped_reads_are_read_only_views(corpus):
    """With mmap the returned tokens are read-only views of the mapped .bin, not copies."""
    reader = IndexedDataReader(corpus.prefix)
    for tokens in (reader[0], reader.get(1, 1), *reader[0:3]):
        assert not tokens.flags.writeable
        assert not tokens.flags.owndata


def test_unmapped_reads_equal_mapped_reads(corpus):
    """``mmap=False`` reads the same tokens as ``mmap=True`` through ``[i]`` and ``get``."""
    mapped = IndexedDataReader(corpus.prefix, mmap=True)
    unmapped = IndexedDataReader(corpus.prefix, mmap=False)
    for i in range(len(mapped)):
        assert_tokens(unmapped[i], mapped[i], corpus.dtype)
        half = len(mapped[i]) // 2
        assert_tokens(unmapped.get(i, half), mapped.get(i, half), corpus.dtype)
        assert_tokens(unmapped.get(i, 0, half), mapped.get(i, 0, half), corpus.dtype)


def test_slicing_without_mmap_raises_value_error(corpus):
    """Slices need the memory-mapped .bin: with ``mmap=False`` they raise ValueError saying so."""
    reader = IndexedDataReader(corpus.prefix, mmap=False)
    with pytest.raises(ValueError, match="mmap=True"):
        reader[0:3]


# -- the C helper's views --------------------------------------------------------------------------------------


class _Armed(_indexed_helpers.MappedItems):
    """The reader's C base alone, with a general path that says it was asked."""

    def _item_or_slice(self, key):
        return ("general path", key)


def test_the_fast_path_answers_only_sequences_that_lie_whole_and_aligned_in_the_tokens():
    """Armed, the C base returns views for in-range plain ints whose sequence lies whole and aligned in the token
    array; anything else, and everything once disarmed, goes to ``_item_or_slice``, so a corrupt index can never
    make it read outside the map."""
    tokens = np.arange(10, dtype=np.uint16)
    tokens.flags.writeable = False
    items = _Armed()
    assert items[0] == ("general path", 0)  # not armed yet
    pointers = np.array([0, 4, 16, 3, -2, 0], dtype=np.int64)  # bytes
    lengths = np.array([2, 3, 3, 1, 1, -1], dtype=np.int32)
    items._arm_items(tokens, pointers, lengths)
    for i, expected in ((0, [0, 1]), (1, [2, 3, 4]), (-6, [0, 1])):
        view = items[i]
        assert_tokens(view, np.array(expected), np.dtype(np.uint16))
        assert view.base is tokens and not view.flags.writeable
    for key in (2, 3, 4, 5, -1, 6, -7, 2**64, np.int64(0), True, 1.0):  # past the end, odd, negative, out of range
        assert items[key] == ("general path", key)
    items._arm_items(None, None, None)
    assert items[0] == ("general path", 0)


def test_the_fast_path_refuses_index_arrays_of_other_dtypes():
    items = _Armed()
    tokens = np.arange(4, dtype=np.uint16)
    with pytest.raises(TypeError, match="pointers must be a contiguous 1-D array of native int64"):
        items._arm_items(tokens, np.zeros(2, np.int32), np.zeros(2, np.int32))
    for lengths in (np.zeros(2, np.int64), np.zeros(2, np.dtype(np.int32).newbyteorder()), np.zeros((2, 1), np.int32)):
        with pytest.raises(TypeError, match="lengths must be a contiguous 1-D array of native int32"):
            items._arm_items(tokens, np.zeros(2, np.int64), lengths)
    with pytest.raises(ValueError, match="the same length"):
        items._arm_items(tokens, np.zeros(2, np.int64), np.zeros(3, np.int32))


def test_split_views_cuts_consecutive_views():
    """``split_views(array, lengths)`` equals ``np.split`` at the cumulative lengths, as views of ``array``; lengths
    that are negative or run past its end are refused."""
    array = np.arange(20, dtype=np.int32)
    lengths = np.array([3, 0, 5, 1, 0, 7], dtype=np.int32)
    views = _indexed_helpers.split_views(array, lengths)
    expected = np.split(array[: lengths.sum()], np.cumsum(lengths)[:-1])
    assert_token_lists(views, expected, np.dtype(np.int32))
    assert all(view.base is array for view in views)
    assert _indexed_helpers.split_views(array, np.zeros(0, np.int32)) == []
    for bad in ([21], [5, -1], [10, 11]):
        with pytest.raises(ValueError, match="sum to at most the 20 items"):
            _indexed_helpers.split_views(array, np.array(bad, dtype=np.int32))


# -- multimodal ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mmap", [True, False])
def test_multimodal_items_carry_their_mode(multimodal_corpus, mmap, index_access):
    """Multimodal ``[i]`` and ``get`` return ``(tokens, mode)`` with the int8 mode of the sequence."""
    corpus = multimodal_corpus
    reader = IndexedDataReader(corpus.prefix, mmap=mmap, multimodal=True)
    assert reader.sequence_modes.dtype == np.int8
    assert not reader.sequence_modes.flags.owndata
    np.testing.assert_array_equal(reader.sequence_modes, corpus.modes)
    for i, (sequence, mode) in enumerate(zip(corpus.sequences, corpus.modes, strict=True)):
        tokens, got_mode = reader[i]
        assert_tokens(tokens, sequence, corpus.dtype)
        assert got_mode == mode
        tokens, got_mode = reader.get(i, offset=len(sequence) // 2)
        assert_tokens(tokens, sequence[len(sequence) // 2 :], corpus.dtype)
        assert got_mode == mode


def test_multimodal_slices_return_tokens_and_modes(multimodal_corpus):
    """Multimodal ``[a:b]`` returns ``(list of tokens, int8 modes a..b-1)``; an empty slice gives empty both."""
    corpus = multimodal_corpus
    reader = IndexedDataReader(corpus.prefix, multimodal=True)
    for key in (slice(2, 11), slice(None), slice(6, 6)):
        tokens, modes = reader[key]
        assert_token_lists(tokens, corpus.sequences[key], corpus.dtype)
        assert modes.dtype == np.int8
        np.testing.assert_array_equal(modes, corpus.modes[key])


def test_text_reader_of_a_multimodal_file_ignores_the_modes(multimodal_corpus):
    """Opened without ``multimodal``, a multimodal pair reads as plain token sequences."""
    corpus = multimodal_corpus
    reader = IndexedDataReader(corpus.prefix)
    assert reader.sequence_modes is None
    assert_token_lists([reader[i] for i in range(len(reader))], corpus.sequences, corpus.dtype)


def test_multimodal_reader_of_a_text_file_is_refused(corpus, index_access):
    """Opening a pair without modes as multimodal fails: the index is too short to hold the modes."""
    with pytest.raises(DataFileError, match="truncated") as info:
        IndexedDataReader(corpus.prefix, multimodal=True)
    assert str(idx_path(corpus.prefix)) in str(info.value)
    assert "with modes" in str(info.value)


# -- pickling and empty datasets -------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("multimodal", [False, True])
def test_pickle_round_trip_reopens_an_equal_reader(tmp_path, mmap, multimodal, protocol):
    """A reader pickled with any protocol re-opens the same files with the same options and reads the same data."""
    corpus = random_corpus(tmp_path / "p", seed=5, dtype=np.int32, multimodal=multimodal)
    reader = IndexedDataReader(corpus.prefix, mmap=mmap, multimodal=multimodal)
    reader[0]  # the original is armed (or reading) before it is pickled
    clone = pickle.loads(pickle.dumps(reader, protocol=protocol))
    assert isinstance(clone, IndexedDataReader)
    assert (clone.path_prefix, clone.mmap, clone.multimodal) == (reader.path_prefix, mmap, multimodal)
    assert len(clone) == len(reader)
    assert clone.dtype == reader.dtype
    for name in ("sequence_lengths", "sequence_pointers", "document_indices", "sequence_modes"):
        np.testing.assert_array_equal(getattr(clone, name), getattr(reader, name), err_msg=name)
    for reopened in (clone, reader):  # the original keeps working after being pickled
        for i, sequence in enumerate(corpus.sequences):
            item = reopened[i]
            if multimodal:
                item, mode = item
                assert mode == corpus.modes[i]
            assert_tokens(item, sequence, corpus.dtype)


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("document_indices", [[0], [0, 0, 0]], ids=["no-documents", "empty-documents"])
def test_empty_dataset_opens_and_verifies(tmp_path, mmap, document_indices):
    """A pair with no sequences (zero-byte .bin) opens with length 0 and passes ``verify``."""
    prefix = write_pair(tmp_path / "empty", [], document_indices, np.uint16)
    assert bin_path(prefix).stat().st_size == 0
    reader = IndexedDataReader(prefix, mmap=mmap)
    assert len(reader) == 0
    assert reader.num_documents == len(document_indices) - 1
    assert reader.num_tokens == 0
    assert reader.sequence_lengths.shape == reader.sequence_pointers.shape == (0,)
    reader.verify()
    with pytest.raises(IndexError, match="out of range"):
        reader[0]
    if mmap:
        assert reader[0:0] == []
        assert reader[:] == []


# -- refusing bad files at construction ------------------------------------------------------------------------


def _truncate(path: Path, size: int) -> None:
    os.truncate(path, size)


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], Callable[[Path], Path], str]] = {
    # name: (how to damage the pair at prefix, which file the message names, phrase in the message)
    "missing-idx": (lambda p: idx_path(p).unlink(), idx_path, "missing"),
    "missing-bin": (lambda p: bin_path(p).unlink(), bin_path, "missing"),
    "bad-magic": (lambda p: patch(idx_path(p), 0, b"TNTIDX\x00\x00\x00"), idx_path, "bad magic"),
    "version-2": (lambda p: patch(idx_path(p), 9, struct.pack("<Q", 2)), idx_path, "version 2 is not supported"),
    "dtype-code-9": (lambda p: patch(idx_path(p), 17, bytes([9])), idx_path, "unknown dtype code 9"),
    "dtype-code-0": (lambda p: patch(idx_path(p), 17, bytes([0])), idx_path, "unknown dtype code 0"),
    "document-count-0": (lambda p: patch(idx_path(p), 26, struct.pack("<Q", 0)), idx_path, "document_count is 0"),
    "truncated-idx": (lambda p: _truncate(idx_path(p), idx_path(p).stat().st_size - 3), idx_path, "truncated"),
    "idx-shorter-than-header": (lambda p: _truncate(idx_path(p), 10), idx_path, "10 bytes, shorter than"),
    "zero-byte-idx": (lambda p: _truncate(idx_path(p), 0), idx_path, "0 bytes, shorter than"),
    "truncated-bin": (lambda p: _truncate(bin_path(p), bin_path(p).stat().st_size - 3), bin_path, "truncated"),
}


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_bad_files_are_refused_at_construction(tmp_path, name, mmap, index_access):
    """Each kind of damaged pair raises DataFileError naming the damaged file, the problem and a fix."""
    damage, named_file, phrase = CORRUPTIONS[name]
    corpus = random_corpus(tmp_path / "bad", seed=7, dtype=np.uint16)
    damage(corpus.prefix)
    with pytest.raises(DataFileError) as info:
        IndexedDataReader(corpus.prefix, mmap=mmap)
    message = str(info.value)
    assert str(named_file(corpus.prefix)) in message
    assert phrase in message
    assert re.search("rebuild|offline_preparation", message, re.IGNORECASE), message


# -- verify ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mmap", [True, False])
def test_verify_accepts_a_consistent_pair(corpus, mmap):
    """``verify`` passes on a pair whose index and data agree."""
    IndexedDataReader(corpus.prefix, mmap=mmap).verify()


def _shift_pointer(prefix: Path, count: int, i: int, by: int) -> None:
    raw = idx_path(prefix).read_bytes()
    (pointer,) = struct.unpack_from("<q", raw, pointer_offset(count, i))
    patch(idx_path(prefix), pointer_offset(count, i), struct.pack("<q", pointer + by))


def _append_to_bin(prefix: Path) -> None:
    with open(bin_path(prefix), "ab") as f:
        f.write(b"\x01\x02\x03\x04")


def _set_document_index(prefix: Path, count: int, j: int, value: int) -> None:
    patch(idx_path(prefix), document_index_offset(count, j), struct.pack("<q", value))


COUNT = 24  # sequences in random_corpus
DOCUMENTS = 9  # document indices in random_corpus
TRAILING = "the sequences hold {total} bytes but {bin} has {grown} bytes"
INCONSISTENCIES: dict[str, tuple[Callable[[Path], object], list[str]]] = {
    # name: (how to damage the pair at prefix without failing construction, one phrase per expected problem)
    "moved-pointer": (
        lambda p: _shift_pointer(p, COUNT, 10, 2),
        ["1 sequence pointers disagree with the cumulative lengths; first: sequence 10 points"],
    ),
    "trailing-bin-bytes": (_append_to_bin, [TRAILING]),
    "documents-start-negative": (lambda p: _set_document_index(p, COUNT, 0, -1), ["must start with 0, found -1"]),
    "documents-end-early": (
        lambda p: _set_document_index(p, COUNT, DOCUMENTS - 1, COUNT - 1),
        [f"must end with the sequence count {COUNT}, found {COUNT - 1}"],
    ),
    "documents-decrease": (lambda p: _set_document_index(p, COUNT, 1, COUNT), ["decrease at position 2"]),
    "two-problems": (
        lambda p: (_shift_pointer(p, COUNT, 5, -2), _append_to_bin(p)),
        ["sequence 5 points to byte", TRAILING],
    ),
}


@pytest.mark.parametrize("name", list(INCONSISTENCIES))
def test_verify_lists_every_inconsistency(tmp_path, name):
    """``verify`` raises DataFileError naming the index and listing each problem that opening does not catch."""
    damage, phrases = INCONSISTENCIES[name]
    corpus = random_corpus(tmp_path / "v", seed=8, dtype=np.int32)
    assert (len(corpus.sequences), len(corpus.document_indices)) == (COUNT, DOCUMENTS)
    damage(corpus.prefix)
    reader = IndexedDataReader(corpus.prefix)
    with pytest.raises(DataFileError) as info:
        reader.verify()
    message = str(info.value)
    assert str(idx_path(corpus.prefix)) in message
    total = int(corpus.lengths.sum()) * corpus.dtype.itemsize
    for phrase in phrases:
        assert phrase.format(total=total, bin=bin_path(corpus.prefix), grown=total + 4) in message
    assert message.count("\n  - ") == len(phrases), message


# -- large files -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mmap", [True, False])
def test_pointers_past_4_gib_are_read_as_int64(tmp_path, mmap):
    """Sequences starting beyond 2**31 and 2**32 bytes are found at their int64 pointers.

    Three sequences of 2**30 uint16 tokens need a 6 GiB .bin; it is made sparse with ``truncate`` and
    only its last tokens are written, so the test costs no disk space.
    """
    prefix = tmp_path / "big"
    n = 2**30
    write_idx(idx_path(prefix), np.dtype(np.uint16), np.array([n, n, n]), np.array([0, 1, 3]))
    tail = np.array([7, 65535, 0, 42], dtype=np.uint16)
    with open(bin_path(prefix), "wb") as f:
        f.truncate(3 * 2 * n)
        f.seek(3 * 2 * n - tail.nbytes)
        f.write(tail.tobytes())
    reader = IndexedDataReader(prefix, mmap=mmap)
    np.testing.assert_array_equal(reader.sequence_pointers, [0, 2**31, 2**32])
    assert reader.sequence_pointers[2] == 2**32
    assert reader.num_tokens == 3 * n
    assert_tokens(reader.get(2, offset=n - 4), tail, np.dtype(np.uint16))
    assert_tokens(reader.get(1, offset=n - 2), np.zeros(2), np.dtype(np.uint16))
    reader.verify()


def test_unmapped_reads_survive_short_preads(tmp_path, monkeypatch):
    """``pread`` may return fewer bytes than asked (Linux caps one call at 0x7ffff000 bytes); reading the index at
    opening and the tokens afterwards still complete."""
    corpus = random_corpus(tmp_path / "short", seed=9, dtype=np.int32)
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: real_pread(fd, min(n, 16), offset))
    reader = IndexedDataReader(corpus.prefix, mmap=False)
    for i, sequence in enumerate(corpus.sequences):
        assert_tokens(reader[i], sequence, corpus.dtype)


# -- naming the pair ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extension", [".idx", ".bin"])
def test_a_path_ending_in_idx_or_bin_opens_its_pair(tmp_path, extension):
    corpus = random_corpus(tmp_path / "books", seed=3, dtype=np.uint16)
    reader = IndexedDataReader(str(corpus.prefix) + extension)
    assert reader.path_prefix == str(corpus.prefix)
    assert_token_lists(reader[0 : len(corpus.sequences)], corpus.sequences, corpus.dtype)


def test_a_prefix_that_itself_ends_in_bin_stays_a_prefix(tmp_path):
    """``data.bin`` names the pair ``data.bin.idx``/``data.bin.bin`` when that pair exists, not ``data.idx``."""
    random_corpus(tmp_path / "data", seed=4, dtype=np.uint16)
    corpus = random_corpus(tmp_path / "data.bin", seed=5, dtype=np.int32)
    reader = IndexedDataReader(tmp_path / "data.bin")
    assert reader.path_prefix == str(tmp_path / "data.bin")
    assert_token_lists(reader[0 : len(corpus.sequences)], corpus.sequences, corpus.dtype)
