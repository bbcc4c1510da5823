"""Specification of ``IndexedDatasetBuilder``: byte identity with megatron-core, refusals, and atomic finalize."""

from __future__ import annotations

import gc
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from file_limits import file_size_limit
from megatron.core.datasets.indexed_dataset import DType as MegatronDType
from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MegatronBuilder

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.file_writes import temporary_path
from hyper_parallel.data.indexed.idx_format import optimal_token_dtype
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder

ALL_DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16]
MIXES = ["items", "documents", "mixed", "merge"]
INPUT_KINDS = ["numpy", "list", "torch", "native"]


def idx_path(prefix: Path) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: Path) -> Path:
    return Path(f"{prefix}.bin")


@pytest.fixture(autouse=True)
def _skip_megatron_gc(monkeypatch):
    """megatron-core's ``add_index`` runs a full ``gc.collect()`` per merge (~0.2 s with torch loaded); the bytes
    it writes do not depend on it, so these tests make it a no-op to stay fast."""
    monkeypatch.setattr(gc, "collect", lambda *args: 0)


# -- call plans: the same sequence of builder calls, replayed on either builder ---------------------------------


@dataclass(frozen=True)
class Item:
    tokens: np.ndarray
    mode: int
    kind: str


@dataclass(frozen=True)
class EndDocument:
    pass


@dataclass(frozen=True)
class Document:
    tokens: np.ndarray
    lengths: list[int]
    modes: list[int] | None
    kind: str


@dataclass(frozen=True)
class Merge:
    prefix: Path
    plan: list  # the calls that built the merged pair


@dataclass
class Contents:
    """What a pair built from a plan holds."""

    sequences: list[np.ndarray]
    document_indices: list[int]
    modes: list[int]


def random_tokens(rng: np.random.Generator, dtype, count: int) -> np.ndarray:
    """int64 token ids spanning the whole range of an integer ``dtype`` (small integers for floats)."""
    dtype = np.dtype(dtype)
    low, high = (-1000, 1000) if dtype.kind == "f" else (np.iinfo(dtype).min, np.iinfo(dtype).max)
    return rng.integers(low, high, size=count, endpoint=True, dtype=np.int64)


def random_plan(rng: np.random.Generator, dtype, mix: str, merges: tuple[Merge, ...] = ()) -> list:
    """A seeded plan of calls: items closed by ``end_document``, multi-sequence documents, empty ones, merges."""

    def kind() -> str:
        return str(rng.choice(INPUT_KINDS))

    def item_document() -> list:
        items = [
            Item(random_tokens(rng, dtype, int(rng.integers(0, 9))), int(rng.integers(0, 4)), kind())
            for _ in range(int(rng.integers(0, 4)))
        ]
        return [*items, EndDocument()]

    def whole_document() -> list:
        lengths = rng.integers(0, 9, size=int(rng.integers(0, 4))).tolist()
        modes = rng.integers(0, 4, size=len(lengths)).tolist() if rng.random() < 0.7 else None
        return [Document(random_tokens(rng, dtype, sum(lengths)), lengths, modes, kind())]

    makers = {"items": [item_document], "documents": [whole_document]}.get(mix, [item_document, whole_document])
    plan = []
    for merge in merges:
        for _ in range(int(rng.integers(0, 2))):
            plan += makers[int(rng.integers(len(makers)))]()
        plan.append(merge)
    for _ in range(int(rng.integers(3, 8))):
        plan += makers[int(rng.integers(len(makers)))]()
    return plan


def random_scenario(tmp_path: Path, seed: int, dtype, mix: str, multimodal: bool) -> list:
    """A plan for ``mix``; for "merge" it first writes 2-3 pairs (with megatron-core) that the plan merges."""
    rng = np.random.default_rng(seed)
    merges = []
    if mix == "merge":
        for i in range(int(rng.integers(2, 4))):
            part_plan = random_plan(rng, dtype, "mixed")
            prefix = build(MegatronBuilder, tmp_path / f"part{i}", dtype, multimodal, part_plan)
            merges.append(Merge(prefix, part_plan))
    return random_plan(rng, dtype, mix, tuple(merges))


def as_input(tokens: np.ndarray, kind: str, dtype):
    """The tokens as one of the inputs the builder accepts."""
    if kind == "list":
        return tokens.tolist()
    if kind == "torch":
        return torch.from_numpy(tokens)
    if kind == "native":
        return tokens.astype(dtype)
    return tokens


def replay(builder, plan: list, dtype) -> None:
    """Make the plan's calls on ``builder``; megatron-core gets torch tensors and explicit modes."""
    megatron = isinstance(builder, MegatronBuilder)
    for call in plan:
        match call:
            case Item(tokens, mode, kind):
                builder.add_item(torch.from_numpy(tokens) if megatron else as_input(tokens, kind, dtype), mode=mode)
            case EndDocument():
                builder.end_document()
            case Document(tokens, lengths, modes, kind):
                if megatron:
                    # megatron-core cannot default the modes of a multimodal document ([0] * list fails).
                    modes = [0] * len(lengths) if modes is None else modes
                    builder.add_document(torch.from_numpy(tokens), lengths, modes)
                else:
                    builder.add_document(as_input(tokens, kind, dtype), lengths, modes)
            case Merge(prefix):
                builder.add_index(str(prefix))


def build(builder_class, prefix: Path, dtype, multimodal: bool, plan: list) -> Path:
    """Write the pair ``prefix`` by replaying ``plan`` on a new builder of ``builder_class``; return the prefix."""
    builder = builder_class(str(bin_path(prefix)), dtype=np.dtype(dtype).type, multimodal=multimodal)
    replay(builder, plan, dtype)
    builder.finalize(str(idx_path(prefix)))
    return prefix


def split_sequences(tokens: np.ndarray, lengths) -> list[np.ndarray]:
    """Cut concatenated tokens into sequences of ``lengths`` (none for no lengths)."""
    return np.split(tokens, np.cumsum(lengths)[:-1].astype(np.int64)) if len(lengths) else []


def expected_contents(plan: list, dtype) -> Contents:
    """The sequences, document indices and modes that ``plan`` describes."""
    contents = Contents([], [0], [])
    for call in plan:
        match call:
            case Item(tokens, mode):
                contents.sequences.append(tokens.astype(dtype))
                contents.modes.append(mode)
            case EndDocument():
                contents.document_indices.append(len(contents.sequences))
            case Document(tokens, lengths, modes):
                contents.sequences += split_sequences(tokens.astype(dtype), lengths)
                contents.modes += [0] * len(lengths) if modes is None else modes
                contents.document_indices.append(len(contents.sequences))
            case Merge(_, part_plan):
                part = expected_contents(part_plan, dtype)
                offset = len(contents.sequences)
                contents.sequences += part.sequences
                contents.modes += part.modes
                contents.document_indices += [offset + d for d in part.document_indices[1:]]
    return contents


def parse_idx(path: Path, multimodal: bool = False) -> SimpleNamespace:
    """Parse an .idx by the documented layout alone, checking that nothing is left over."""
    raw = Path(path).read_bytes()
    magic, version, code, sequence_count, document_count = struct.unpack_from("<9sQBQQ", raw)
    offset = 34
    arrays = {}
    for name, dtype, count in (
        ("lengths", np.int32, sequence_count),
        ("pointers", np.int64, sequence_count),
        ("document_indices", np.int64, document_count),
        ("modes", np.int8, sequence_count if multimodal else 0),
    ):
        arrays[name] = np.frombuffer(raw, dtype=dtype, count=count, offset=offset)
        offset += arrays[name].nbytes
    assert offset == len(raw), f"{path}: {len(raw) - offset} bytes after the arrays"
    return SimpleNamespace(
        magic=magic, version=version, code=code, sequence_count=sequence_count, document_count=document_count, **arrays
    )


def assert_same_bytes(ours: Path, theirs: Path) -> None:
    for path in (bin_path, idx_path):
        assert path(ours).read_bytes() == path(theirs).read_bytes(), f"{path(ours)} differs from {path(theirs)}"


# -- byte identity and cross-reading ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_files_are_byte_identical_to_megatron(tmp_path, dtype, mix, multimodal, seed):
    """The same calls on megatron-core's builder and ours give identical .bin and .idx bytes, for every dtype code."""
    plan = random_scenario(tmp_path, seed, dtype, mix, multimodal)
    ours = build(IndexedDatasetBuilder, tmp_path / "ours", dtype, multimodal, plan)
    theirs = build(MegatronBuilder, tmp_path / "theirs", dtype, multimodal, plan)
    assert_same_bytes(ours, theirs)
    expected = expected_contents(plan, dtype)
    index = parse_idx(idx_path(ours), multimodal)
    assert index.sequence_count == len(expected.sequences)
    np.testing.assert_array_equal(index.document_indices, expected.document_indices)


def assert_reads_as(dataset, pointers, modes, expected: Contents, dtype, multimodal: bool, slicing: bool) -> None:
    """``dataset`` (ours or megatron-core's) holds exactly ``expected``; both share this reading interface."""
    dtype = np.dtype(dtype)
    lengths = [len(s) for s in expected.sequences]
    n = len(lengths)
    assert len(dataset) == n
    np.testing.assert_array_equal(dataset.sequence_lengths, lengths)
    np.testing.assert_array_equal(dataset.document_indices, expected.document_indices)
    np.testing.assert_array_equal(pointers, np.cumsum([0, *lengths])[:-1] * dtype.itemsize)
    if multimodal:
        np.testing.assert_array_equal(modes, expected.modes)

    def tokens(item, i):
        if multimodal:
            item, mode = item
            assert mode == expected.modes[i]
        assert item.dtype == dtype
        return item

    for i, sequence in enumerate(expected.sequences):
        np.testing.assert_array_equal(tokens(dataset[i], i), sequence)
        half = len(sequence) // 2
        np.testing.assert_array_equal(tokens(dataset.get(i, half), i), sequence[half:])
        if half:
            np.testing.assert_array_equal(tokens(dataset.get(i, 1, half - 1), i), sequence[1:half])
    if slicing:
        # megatron-core mishandles empty slices, so only non-empty ones are compared
        for start, stop in ((0, n), (1, n - 1), (n // 2, min(n, n // 2 + 2))):
            if start >= stop:
                continue
            got = dataset[start:stop]
            if multimodal:
                got, got_modes = got
                np.testing.assert_array_equal(got_modes, expected.modes[start:stop])
            assert len(got) == len(expected.sequences[start:stop])
            for actual, sequence in zip(got, expected.sequences[start:stop], strict=True):
                np.testing.assert_array_equal(actual, sequence)


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("writer", [IndexedDatasetBuilder, MegatronBuilder], ids=["written-by-ours", "by-megatron"])
@pytest.mark.parametrize("dtype", [np.uint16, np.int32], ids=lambda d: np.dtype(d).name)
def test_pairs_read_identically_with_either_reader(tmp_path, dtype, writer, mix, multimodal, mmap):
    """A pair written by either builder reads as the calls describe through megatron-core's reader and ours."""
    plan = random_scenario(tmp_path, 7, dtype, mix, multimodal)
    prefix = build(writer, tmp_path / "pair", dtype, multimodal, plan)
    expected = expected_contents(plan, dtype)
    ours = IndexedDataReader(prefix, mmap=mmap, multimodal=multimodal)
    ours.verify()
    assert_reads_as(ours, ours.sequence_pointers, ours.sequence_modes, expected, dtype, multimodal, slicing=mmap)
    theirs = MegatronDataset(str(prefix), multimodal=multimodal, mmap=mmap)
    index = theirs.index
    assert_reads_as(theirs, index.sequence_pointers, index.sequence_modes, expected, dtype, multimodal, slicing=True)


def test_golden_documents_layout(tmp_path):
    """Documents [[1,2,3],[4,5]], [], [[7,8],[9]] as uint16 give the index megatron-core writes for them."""
    prefix = tmp_path / "golden"
    builder = IndexedDatasetBuilder(bin_path(prefix), dtype=np.uint16)
    builder.add_document([1, 2, 3, 4, 5], [3, 2])
    builder.add_document([], [])
    builder.add_document(np.array([7, 8, 9]), [2, 1])
    builder.finalize(idx_path(prefix))

    index = parse_idx(idx_path(prefix))
    assert (index.magic, index.version, index.code) == (b"MMIDIDX\x00\x00", 1, 8)
    assert (index.sequence_count, index.document_count) == (4, 4)
    np.testing.assert_array_equal(index.lengths, [3, 2, 2, 1])
    np.testing.assert_array_equal(index.pointers, [0, 6, 10, 14])
    np.testing.assert_array_equal(index.document_indices, [0, 2, 2, 4])
    assert bin_path(prefix).read_bytes() == np.array([1, 2, 3, 4, 5, 7, 8, 9], dtype="<u2").tobytes()


@pytest.mark.parametrize("vocab_size", [None, 0, 255, 65499, 65500, 65536, 10**6])
def test_optimal_token_dtype_matches_megatron(vocab_size):
    """The token dtype for a vocabulary size is megatron-core's: uint16 below 65500, else int32."""
    assert optimal_token_dtype(vocab_size) == np.dtype(MegatronDType.optimal_dtype(vocab_size))


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
@pytest.mark.parametrize("dtype", [np.uint16, np.int32], ids=lambda d: np.dtype(d).name)
def test_add_documents_equals_one_document_at_a_time(tmp_path, dtype, multimodal):
    """``add_documents(tokens, lengths)`` writes what ``add_document(doc, [len])`` per document writes."""
    rng = np.random.default_rng(13)
    lengths = rng.integers(0, 30, size=40)
    lengths[[0, 17]] = 0
    tokens = random_tokens(rng, dtype, int(lengths.sum()))
    prologue = random_tokens(rng, dtype, 5)
    documents = split_sequences(tokens, lengths)

    def write(prefix: Path, bulk: bool) -> Path:
        builder = IndexedDatasetBuilder(bin_path(prefix), dtype=dtype, multimodal=multimodal)
        builder.add_document(prologue, [2, 3])  # documents already there shift the bulk indices
        if bulk:
            builder.add_documents(tokens, lengths)
        else:
            for document in documents:
                builder.add_document(document, [len(document)])
        builder.add_item(prologue)
        builder.end_document()
        builder.finalize(idx_path(prefix))
        return prefix

    assert_same_bytes(write(tmp_path / "bulk", bulk=True), write(tmp_path / "single", bulk=False))
    index = parse_idx(idx_path(tmp_path / "bulk"), multimodal)
    np.testing.assert_array_equal(index.document_indices, [0, *range(2, len(lengths) + 4)])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.float64], ids=lambda d: np.dtype(d).name)
def test_writes_of_many_pieces_are_byte_identical_to_megatron(tmp_path, dtype):
    """Tokens of several 32 KiB write pieces and a partial one, written in bulk, as one document or merged from
    megatron-core's pair, give megatron-core's bytes."""
    rng = np.random.default_rng(21)
    lengths = [3 * (32 << 10) // np.dtype(dtype).itemsize + 123, 1, 20_000]
    tokens = random_tokens(rng, dtype, sum(lengths)).astype(dtype)
    documents = split_sequences(tokens, lengths)
    theirs = build(
        MegatronBuilder, tmp_path / "theirs", dtype, False, [Document(d, [len(d)], None, "torch") for d in documents]
    )

    bulk = IndexedDatasetBuilder(bin_path(tmp_path / "bulk"), dtype=dtype)
    bulk.add_documents(tokens, lengths)
    bulk.finalize(idx_path(tmp_path / "bulk"))
    assert_same_bytes(tmp_path / "bulk", theirs)

    merged = IndexedDatasetBuilder(bin_path(tmp_path / "merged"), dtype=dtype)
    merged.add_index(theirs)
    merged.finalize(idx_path(tmp_path / "merged"))
    assert_same_bytes(tmp_path / "merged", theirs)


# -- refusals --------------------------------------------------------------------------------------------------


def add_with(method: str, builder: IndexedDatasetBuilder, tokens) -> None:
    """Add ``tokens`` as one sequence (and one document) through ``method``."""
    if method == "add_item":
        builder.add_item(tokens)
        builder.end_document()  # a pair whose document indices stop short of its sequences is refused on reading
    elif method == "add_document":
        builder.add_document(tokens, [len(tokens)])
    else:
        builder.add_documents(tokens, [len(tokens)])


ADD_METHODS = ["add_item", "add_document", "add_documents"]


@pytest.mark.parametrize("method", ADD_METHODS)
@pytest.mark.parametrize(
    ("dtype", "tokens", "bad_id"),
    [
        (np.uint16, [1, 70000, 3], 70000),
        (np.uint16, [-1, 5], -1),
        (np.uint8, np.array([0, 256]), 256),
        (np.int8, torch.tensor([-129, 0]), -129),
        (np.int16, [40000], 40000),
        (np.int32, np.array([2**31, 1], dtype=np.int64), 2**31),
        (np.int64, np.array([2**63], dtype=np.uint64), 2**63),
    ],
)
def test_token_ids_outside_the_dtype_are_refused(tmp_path, method, dtype, tokens, bad_id):
    """A token id that the dtype cannot hold raises DataFileError naming the id and dtype, and adds nothing."""
    prefix = tmp_path / "range"
    builder = IndexedDatasetBuilder(bin_path(prefix), dtype=dtype)
    with pytest.raises(DataFileError, match=rf"token id {bad_id} does not fit the dataset dtype {np.dtype(dtype)}"):
        add_with(method, builder, tokens)
    assert builder.num_sequences == 0
    builder.finalize(idx_path(prefix))
    assert bin_path(prefix).stat().st_size == 0
    assert len(IndexedDataReader(prefix)) == 0


@pytest.mark.parametrize("method", ADD_METHODS)
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int32])
def test_token_ids_at_the_dtype_limits_are_accepted(tmp_path, method, dtype):
    """The smallest and largest ids of the dtype are stored exactly."""
    prefix = tmp_path / "limits"
    info = np.iinfo(dtype)
    with IndexedDatasetBuilder(bin_path(prefix), dtype=dtype) as builder:
        add_with(method, builder, [info.min, info.max])
        builder.finalize(idx_path(prefix))
    np.testing.assert_array_equal(IndexedDataReader(prefix)[0], [info.min, info.max])


@pytest.mark.parametrize("method", ADD_METHODS)
@pytest.mark.parametrize("tokens", [np.array([1.0, 2.0]), [0.5], torch.tensor([3.0])], ids=["numpy", "list", "torch"])
def test_float_tokens_are_refused_for_integer_dtypes(tmp_path, method, tokens):
    """Floating-point token ids raise DataFileError for an integer dtype instead of being truncated."""
    builder = IndexedDatasetBuilder(bin_path(tmp_path / "floats"), dtype=np.int32)
    with pytest.raises(DataFileError, match=r"must be integers to be stored as int32, got float"):
        add_with(method, builder, tokens)
    builder.abort()


def test_document_lengths_must_sum_to_the_token_count(tmp_path):
    """``add_document``/``add_documents`` with lengths not summing to the token count raise ValueError."""
    builder = IndexedDatasetBuilder(bin_path(tmp_path / "sums"), dtype=np.int32)
    with pytest.raises(ValueError, match="sum to 5 but 6 tokens were given"):
        builder.add_document(np.arange(6), [2, 3])
    with pytest.raises(ValueError, match="sum to 7 but 6 tokens"):
        builder.add_documents(np.arange(6), [3, 4])
    assert builder.num_sequences == 0
    builder.abort()


def test_merging_a_pair_of_another_dtype_is_refused(tmp_path):
    """``add_index`` of a pair with a different token dtype raises DataFileError naming both dtypes."""
    part = tmp_path / "part"
    with IndexedDatasetBuilder(bin_path(part), dtype=np.uint16) as builder:
        builder.add_document([1, 2, 3], [3])
        builder.finalize(idx_path(part))
    builder = IndexedDatasetBuilder(bin_path(tmp_path / "merged"), dtype=np.int32)
    with pytest.raises(DataFileError, match=r"dtype uint16\).*\(dtype int32\)") as info:
        builder.add_index(part)
    assert str(part) in str(info.value)
    assert builder.num_sequences == 0
    builder.abort()


def test_unsupported_dtype_is_refused_at_construction(tmp_path):
    """A token dtype without an .idx code raises DataFileError listing the supported dtypes, and creates no file."""
    with pytest.raises(DataFileError, match="uint32 cannot be stored.*uint16"):
        IndexedDatasetBuilder(bin_path(tmp_path / "u32"), dtype=np.uint32)
    assert os.listdir(tmp_path) == []


# -- nothing looks finished before finalize --------------------------------------------------------------------


def start_builder(prefix: Path, seed: int = 0, dtype=np.int32) -> tuple[IndexedDatasetBuilder, list[np.ndarray]]:
    """A builder for ``prefix`` that already holds a few seeded documents."""
    rng = np.random.default_rng(seed)
    documents = [random_tokens(rng, dtype, int(n)) for n in rng.integers(1, 20, size=5)]
    builder = IndexedDatasetBuilder(bin_path(prefix), dtype=dtype)
    for document in documents:
        builder.add_document(document, [len(document)])
    return builder, documents


def assert_pair_holds(prefix: Path, documents: list[np.ndarray]) -> None:
    reader = IndexedDataReader(prefix)
    reader.verify()
    assert len(reader) == len(documents)
    for i, document in enumerate(documents):
        np.testing.assert_array_equal(reader[i], document)


def test_only_temporary_files_exist_before_finalize(tmp_path):
    """Before ``finalize`` only ``<name>.bin.tmp-<host>-<pid>`` exists; afterwards exactly the .bin/.idx pair."""
    prefix = tmp_path / "data"
    builder, documents = start_builder(prefix)
    assert sorted(os.listdir(tmp_path)) == [temporary_path(bin_path(prefix)).name]
    assert temporary_path(bin_path(prefix)).name.startswith("data.bin.tmp-")
    assert temporary_path(bin_path(prefix)).name.endswith(f"-{os.getpid()}")
    builder.finalize(idx_path(prefix))
    assert sorted(os.listdir(tmp_path)) == ["data.bin", "data.idx"]
    assert_pair_holds(prefix, documents)


def test_exception_inside_with_block_leaves_no_files(tmp_path):
    """An exception inside ``with IndexedDatasetBuilder(...)`` removes the temporary file and creates no pair."""
    with pytest.raises(RuntimeError, match="tokenizer crashed"), start_builder(tmp_path / "data")[0]:
        raise RuntimeError("tokenizer crashed")
    assert os.listdir(tmp_path) == []


def test_with_block_without_finalize_leaves_no_files(tmp_path):
    """Leaving the ``with`` block without calling ``finalize`` discards the data."""
    with start_builder(tmp_path / "data")[0]:
        pass
    assert os.listdir(tmp_path) == []


def test_abort_removes_the_temporary_file(tmp_path):
    """``abort`` deletes what was written so far."""
    builder, _ = start_builder(tmp_path / "data")
    builder.abort()
    assert os.listdir(tmp_path) == []


def test_failed_rebuild_leaves_an_older_pair_untouched(tmp_path):
    """An exception while rebuilding over an existing pair leaves that pair byte-for-byte as it was."""
    prefix = tmp_path / "data"
    builder, documents = start_builder(prefix, seed=1)
    builder.finalize(idx_path(prefix))
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    with pytest.raises(RuntimeError), start_builder(prefix, seed=2)[0]:
        raise RuntimeError
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before
    assert_pair_holds(prefix, documents)


def test_finalize_replaces_an_older_pair(tmp_path):
    """The older pair stays readable until ``finalize``, which then replaces both of its files."""
    prefix = tmp_path / "data"
    old_builder, old_documents = start_builder(prefix, seed=3, dtype=np.int64)
    old_builder.finalize(idx_path(prefix))
    builder, documents = start_builder(prefix, seed=4, dtype=np.uint16)
    assert_pair_holds(prefix, old_documents)
    builder.finalize(idx_path(prefix))
    assert sorted(os.listdir(tmp_path)) == ["data.bin", "data.idx"]
    assert IndexedDataReader(prefix).dtype == np.uint16
    assert_pair_holds(prefix, documents)


def test_a_failed_write_is_a_data_file_error_naming_the_file(tmp_path):
    """A write that fails part-way (here past the process's file size limit, which fails it as a full disk does) is
    a DataFileError naming the final file and the fix; abort removes the temporary."""
    prefix = tmp_path / "data"
    builder = IndexedDatasetBuilder(bin_path(prefix), dtype=np.int32)
    with file_size_limit(4096), pytest.raises(DataFileError, match=r"cannot write .*data\.bin: File too large; "):
        builder.add_document(np.arange(1 << 16), [1 << 16])
        builder.finalize(idx_path(prefix))
    builder.abort()
    assert os.listdir(tmp_path) == []


def test_files_are_opened_only_while_written(tmp_path):
    """``release_file`` closes the .bin between writes (the next write reopens it), so many builders can be open
    within the open-file limit; the pair is the same as if it had stayed open."""
    reference, documents = start_builder(tmp_path / "reference")
    reference.finalize(idx_path(tmp_path / "reference"))
    builder = IndexedDatasetBuilder(bin_path(tmp_path / "released"), dtype=np.int32)
    for document in documents:
        builder.release_file()
        builder.add_document(document, [len(document)])
    builder.finalize(idx_path(tmp_path / "released"))
    for suffix in (".bin", ".idx"):
        assert (
            Path(f"{tmp_path / 'released'}{suffix}").read_bytes()
            == Path(f"{tmp_path / 'reference'}{suffix}").read_bytes()
        )


# -- int64 offsets ---------------------------------------------------------------------------------------------


def test_index_pointers_past_4_gib_do_not_overflow(tmp_path):
    """Sequence pointers are int64: three sequences of 2**30 int32 tokens start at bytes 0, 2**32 and 2**33.

    Writing 12 GiB of tokens is not needed to check the index: the lengths are appended to the builder's
    private lengths array directly, so the .bin does not match this index and only the .idx is checked.
    """
    prefix = tmp_path / "big"
    builder = IndexedDatasetBuilder(bin_path(prefix), dtype=np.int32)
    builder._lengths.extend(np.array([2**30, 2**30, 2**30], dtype=np.int32))
    builder.end_document()
    builder.finalize(idx_path(prefix))
    index = parse_idx(idx_path(prefix))
    np.testing.assert_array_equal(index.lengths, [2**30, 2**30, 2**30])
    np.testing.assert_array_equal(index.pointers, [0, 2**32, 2**33])
    np.testing.assert_array_equal(index.document_indices, [0, 3])


def test_malformed_document_shapes_are_refused(tmp_path):
    """Negative sequence lengths, and multimodal modes that do not match the sequences, raise ValueError."""
    builder = IndexedDatasetBuilder(bin_path(tmp_path / "shapes"), dtype=np.int32, multimodal=True)
    with pytest.raises(ValueError, match="must not be negative"):
        builder.add_document(np.arange(4), [5, -1])
    with pytest.raises(ValueError, match="3 modes were given for 2 sequences"):
        builder.add_document(np.arange(4), [2, 2], modes=[0, 1, 1])
    builder.abort()
