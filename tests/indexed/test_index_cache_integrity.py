"""Specification of index cache integrity: no sample is ever cut through a damaged or stale cache entry.

A damaged entry (an array cut short, a byte flipped, an array missing, a description that does not parse) is
found by its manifest, rebuilt with a warning naming the damaged file, or refused in a directory that cannot be
written. Rewriting the data files, even with the same counts, builds new indices instead of reusing the old ones.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from permissions import read_only

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed import index_cache
from hyper_parallel.data.indexed.index_cache import IndexCache
from hyper_parallel.data.indexed.indexed_data_config import IndexedDataConfig
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset
from hyper_parallel.data.tools.prepare_cache import prepare_cache
from indexed.test_index_cache import assert_same_datasets, building_messages

SETTINGS = {"seq_length": 32, "split": "90, 8, 2", "random_seed": 1234}
NUM_SAMPLES = [200, 30, 10]
FAST = {"fast_cache_load": True, "defer_npy_index_mmap": True}
DOCUMENTS = 300
SPLIT_BOUNDS = (0, 270, 294, 300)  # the sequence ranges of "90, 8, 2" over 300 documents


def _build(data_path, tokenizer, cache: Path, **settings):
    config = {**SETTINGS, **settings, "data_cache_path": str(cache)}
    return build_indexed_text_dataset(str(data_path), config, NUM_SAMPLES, tokenizer)


def _write_pair(prefix: Path, lengths: np.ndarray, token_seed: int) -> Path:
    """A uint16 pair of one-sequence documents of ``lengths``, token ids drawn from [2, 8192) by ``token_seed``."""
    tokens = np.random.default_rng(token_seed).integers(2, 8192, size=int(lengths.sum()))
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16) as builder:
        builder.add_documents(tokens, lengths)
        builder.finalize(f"{prefix}.idx")
    return prefix


@pytest.fixture
def lengths() -> np.ndarray:
    return np.random.default_rng(11).integers(1, 120, size=DOCUMENTS)


@pytest.fixture
def corpus(tmp_path, lengths) -> Path:
    return _write_pair(tmp_path / "corpus_text_document", lengths, token_seed=1)


@pytest.fixture
def logs(caplog) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="hyper_parallel.data")
    return caplog


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _damage(cache: Path, kind: str) -> Path:
    """Damage the train GPTDataset entry in place and return the damaged file."""

    def entry_file(name: str) -> Path:
        return next(cache.glob(f"*-GPTDataset-train-{name}"))

    if kind == "array_cut_short":
        path = entry_file("shuffle_index.npy")
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 8)
    elif kind == "byte_flipped":
        path = entry_file("sample_index.npy")
        _flip_byte(path, path.stat().st_size // 2)
    elif kind == "array_missing":
        path = entry_file("document_index.npy")
        path.unlink()
    else:
        path = entry_file("description.txt")
        path.write_text('{"description": {"class": "GPTD', encoding="utf-8")
    return path


DAMAGES = ["array_cut_short", "byte_flipped", "array_missing", "description_unparsable"]


# -- damaged entries ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ordinary", "fast"])
@pytest.mark.parametrize("kind", DAMAGES)
def test_a_damaged_entry_is_rebuilt_with_a_warning_naming_the_file(tmp_path, corpus, tokenizer, logs, kind, mode):
    """An ordinary load finds the damage at start-up; ``fast_cache_load`` + ``defer_npy_index_mmap`` when the
    array is first read. Either way the entry is rebuilt once, with one warning naming the damaged file, and the
    samples are those of an undamaged cache."""
    cache = tmp_path / "cache"
    _build(corpus, tokenizer, cache)
    damaged = _damage(cache, kind)
    logs.clear()

    loaded = _build(corpus, tokenizer, cache, **(FAST if mode == "fast" else {}))
    first_samples = [dataset[0] for dataset in loaded]  # where the fast mode reads (and checks) the arrays

    [warning] = _warnings(logs)
    assert warning.startswith(f"{damaged}: ") and "rebuilding the" in warning and "GPTDataset-train" in warning
    assert [message.split()[2] for message in building_messages(logs)] == [warning.split()[-2]]
    reference = _build(corpus, tokenizer, tmp_path / "reference")
    for got, want, sample in zip(loaded, reference, first_samples, strict=True):
        assert_same_datasets(got, want)
        assert all(np.array_equal(sample[key], want[0][key]) for key in sample)
    logs.clear()
    _build(corpus, tokenizer, cache)
    assert _warnings(logs) == [] and building_messages(logs) == []


@pytest.mark.parametrize("mode", ["ordinary", "fast"])
def test_a_damaged_entry_in_an_unwritable_directory_is_refused(tmp_path, corpus, tokenizer, mode):
    """Where the entry cannot be rebuilt, loading it is a DataFileError naming the file, the damage and the fix."""
    cache = tmp_path / "cache"
    _build(corpus, tokenizer, cache)
    damaged = _damage(cache, "byte_flipped")

    with read_only(cache), pytest.raises(DataFileError) as raised:
        datasets = _build(corpus, tokenizer, cache, **(FAST if mode == "fast" else {}))
        datasets[0][0]  # a deferred load reads its arrays here

    message = str(raised.value)
    assert message.startswith(f"{damaged}: bytes ") and "do not match their checksum" in message
    assert f"its directory {cache} is not writable" in message
    assert "Delete the entry's files" in message and "data_cache_path" in message


def test_a_directory_at_the_description_name_is_a_data_file_error(tmp_path):
    """The description cannot be read, and the rebuilt one cannot replace a directory: one error naming it."""
    cache = IndexCache(tmp_path, "GPTDataset", "train", {"case": "a directory in the way"})
    cache.path("description").mkdir()

    with pytest.raises(DataFileError, match=f"cannot write {cache.path('description')}: Is a directory"):
        cache.get_or_build(("values",), lambda: {"values": np.arange(3)})


def test_a_missing_entry_under_fast_cache_load_names_the_fix(tmp_path, corpus, tokenizer):
    """``fast_cache_load`` builds nothing: an entry that was never prepared is a DataFileError, not a traceback."""
    with pytest.raises(DataFileError) as raised:
        _build(corpus, tokenizer, tmp_path / "empty", fast_cache_load=True)

    message = str(raised.value)
    assert "-GPTDataset-train-description.txt: no such index cache entry" in message
    assert "prepare_cache" in message and "fast_cache_load: false" in message


# -- entries bound to what was asked ------------------------------------------------------------------------------


def _entry_files(cache: Path, kind_split: str) -> dict[str, Path]:
    """The files of the one ``<kind>-<split>`` entry in ``cache``, by name (``description``, the arrays)."""
    [description] = cache.glob(f"*-{kind_split}-description.txt")
    stem = description.name.removesuffix("-description.txt")
    return {path.name.removeprefix(f"{stem}-").rsplit(".", 1)[0]: path for path in cache.glob(f"{stem}-*")}


def _copy_entry(source: dict[str, Path], target: dict[str, Path]) -> None:
    """Copy every file of one entry, manifest included, over the names of another."""
    assert source.keys() == target.keys()
    for name, path in source.items():
        target[name].write_bytes(path.read_bytes())


FOREIGN = {
    "seed": ({"random_seed": 4321}, "train", "random_seed: this entry has 1234, the files have 4321"),
    "split": ({}, "valid", "index_split: this entry has 'train', the files have 'valid'"),
    "sequence length": ({"seq_length": 24}, "train", "sequence_length: this entry has 32, the files have 24"),
    "data set": ({"other_corpus": True}, "train", "dataset_path: this entry has "),
}


def _foreign_entry(tmp_path, tokenizer, lengths, case: str) -> tuple[dict[str, Path], str]:
    """The files of an entry built for other settings, a split other than train, or another data set."""
    settings, split, _ = FOREIGN[case]
    settings = dict(settings)
    data = tmp_path / "corpus_text_document"
    if settings.pop("other_corpus", False):
        data = _write_pair(tmp_path / "other_text_document", lengths[::-1].copy(), token_seed=5)
    _build(data, tokenizer, tmp_path / "foreign", **settings)
    return _entry_files(tmp_path / "foreign", f"GPTDataset-{split}"), FOREIGN[case][2]


@pytest.mark.parametrize("mode", ["ordinary", "fast"])
@pytest.mark.parametrize("case", list(FOREIGN))
def test_an_entry_copied_from_another_is_rebuilt_with_a_warning_naming_what_differs(
    tmp_path, corpus, lengths, tokenizer, logs, case, mode
):
    """Every file of another entry (another seed, split, sequence length or data set), manifest included, copied
    under this entry's names is never read: the entry is rebuilt once, with a warning naming the differing field,
    and the samples are those of a fresh cache."""
    cache = tmp_path / "cache"
    _build(corpus, tokenizer, cache)
    foreign, difference = _foreign_entry(tmp_path, tokenizer, lengths, case)
    train = _entry_files(cache, "GPTDataset-train")
    _copy_entry(foreign, train)
    logs.clear()

    loaded = _build(corpus, tokenizer, cache, **(FAST if mode == "fast" else {}))
    first_samples = [dataset[0] for dataset in loaded]

    [warning] = _warnings(logs)
    assert (
        warning.startswith(f"{train['description']}: its description is not this entry's (") and difference in warning
    )
    assert "copied or renamed from another entry" in warning and "rebuilding the" in warning
    assert len(building_messages(logs)) == 1
    reference = _build(corpus, tokenizer, tmp_path / "reference")
    for got, want, sample in zip(loaded, reference, first_samples, strict=True):
        assert_same_datasets(got, want)
        assert all(np.array_equal(sample[key], want[0][key]) for key in sample)


@pytest.mark.parametrize("mode", ["ordinary", "fast"])
@pytest.mark.parametrize("case", ["seed", "split"])
def test_an_entry_copied_from_another_in_an_unwritable_directory_is_refused(
    tmp_path, corpus, lengths, tokenizer, case, mode
):
    cache = tmp_path / "cache"
    _build(corpus, tokenizer, cache)
    foreign, difference = _foreign_entry(tmp_path, tokenizer, lengths, case)
    train = _entry_files(cache, "GPTDataset-train")
    _copy_entry(foreign, train)

    with read_only(cache), pytest.raises(DataFileError) as raised:
        datasets = _build(corpus, tokenizer, cache, **(FAST if mode == "fast" else {}))
        datasets[0][0]

    message = str(raised.value)
    assert (
        message.startswith(f"{train['description']}: its description is not this entry's (") and difference in message
    )
    assert f"its directory {cache} is not writable" in message and "data_cache_path" in message


def _edit_manifest(path: Path, edit, rechecksum: bool = False) -> None:
    """Change the manifest as a hand edit would; with ``rechecksum``, as a forger would, checksum recomputed."""
    manifest = json.loads(path.read_text(encoding="utf-8"))
    edit(manifest)
    if rechecksum:
        compact = index_cache._COMPACT_JSON.encode(manifest["description"])
        manifest["manifest_xxh3_64"] = index_cache._manifest_checksum(compact, manifest["arrays"])
    path.write_text(json.dumps(manifest, indent=4), encoding="utf-8")


HAND_EDITS = {
    "seed": lambda m: m["description"].update(random_seed=4321),
    "shape": lambda m: m["arrays"]["shuffle_index"].update(shape=[m["arrays"]["shuffle_index"]["shape"][0] - 1]),
    "file size": lambda m: m["arrays"]["sample_index"].update(file_bytes=m["arrays"]["sample_index"]["file_bytes"] + 8),
    "checksum removed": lambda m: m.pop("manifest_xxh3_64"),
}


@pytest.mark.parametrize("case", list(HAND_EDITS))
def test_a_manifest_edited_by_hand_is_found_by_its_checksum(tmp_path, corpus, tokenizer, logs, case):
    cache = tmp_path / "cache"
    _build(corpus, tokenizer, cache)
    description = _entry_files(cache, "GPTDataset-train")["description"]
    _edit_manifest(description, HAND_EDITS[case])
    logs.clear()

    _build(corpus, tokenizer, cache, cache_verification="sizes")

    [warning] = _warnings(logs)
    expected = "has no checksum" if case == "checksum removed" else "does not match its checksum: it was edited"
    assert warning.startswith(f"{description}: the manifest ") and expected in warning
    assert len(building_messages(logs)) == 1


@pytest.mark.parametrize("mode", ["ordinary", "fast"])
@pytest.mark.parametrize("name", ["shuffle_index", "sample_index"])
def test_arrays_of_another_length_than_the_split_needs_are_never_read(tmp_path, corpus, tokenizer, logs, name, mode):
    """A consistent manifest (checksum recomputed) whose array is shorter than the split needs, its file cut to
    match, is another entry's: rebuilt, even when only sizes are checked."""
    cache = tmp_path / "cache"
    _build(corpus, tokenizer, cache)
    files = _entry_files(cache, "GPTDataset-train")
    array = np.load(files[name])
    np.save(files[name], array[:-1])

    def shorten(manifest: dict) -> None:
        header = files[name].read_bytes()[: files[name].stat().st_size - array[:-1].nbytes]
        manifest["arrays"][name] = {
            **manifest["arrays"][name],
            "shape": list(array[:-1].shape),
            "npy_header": header.decode("latin-1"),
            "file_bytes": files[name].stat().st_size,
            "xxh3_64": index_cache._block_digests(header, array[:-1]),
        }

    _edit_manifest(files["description"], shorten, rechecksum=True)
    logs.clear()

    loaded = _build(corpus, tokenizer, cache, cache_verification="sizes", **(FAST if mode == "fast" else {}))
    loaded[0][0]

    [warning] = _warnings(logs)
    needed = (len(array), 2) if name == "sample_index" else (len(array),)
    assert warning.startswith(f"{files['description']}: the manifest describes {name} as ")
    assert f"but this entry needs dtype kind i/u of shape {needed}" in warning
    assert len(loaded[0]) == len(_build(corpus, tokenizer, tmp_path / "reference")[0])


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_an_array_file_of_the_same_size_but_another_dtype_or_shape_is_never_read(
    tmp_path, corpus, tokenizer, logs, change
):
    """The array file is replaced by one of exactly the same size holding another dtype (or shape); its ``.npy``
    header differs from the manifest's, which every mode checks."""
    cache = tmp_path / "cache"
    _build(corpus, tokenizer, cache)
    path = _entry_files(cache, "GPTDataset-train")["sample_index"]
    array, size = np.load(path), path.stat().st_size
    other = array.view(np.uint32 if array.dtype == np.int32 else np.uint64) if change == "dtype" else array.reshape(-1)
    np.save(path, other)
    assert path.stat().st_size == size
    logs.clear()

    _build(corpus, tokenizer, cache, cache_verification="sizes")

    [warning] = _warnings(logs)
    assert warning.startswith(f"{path}: its .npy header does not match the dtype {array.dtype} and shape ")
    assert len(building_messages(logs)) == 1


# -- verification modes -------------------------------------------------------------------------------------------


def _big_entry(directory: Path) -> tuple[IndexCache, Path]:
    """An entry whose one array spans 123 checksum blocks of 64 KiB."""
    cache = IndexCache(directory, "GPTDataset", "train", {"case": "modes"})
    cache.get_or_build(("big",), lambda: {"big": np.arange(1_000_000, dtype=np.int64)})
    return cache, cache.path("big")


def test_sizes_are_checked_in_every_mode(tmp_path):
    cache, path = _big_entry(tmp_path)
    with open(path, "ab") as f:
        f.write(b"\0")

    assert [cache.is_complete(("big",), mode) for mode in ("sizes", "sampled", "full")] == [False] * 3


def test_sampled_checks_read_the_first_and_last_blocks(tmp_path):
    cache, path = _big_entry(tmp_path)
    for offset in (path.stat().st_size - 1, 9000):  # in the last block, in the first block past the header
        _flip_byte(path, offset)
        assert not cache.is_complete(("big",), "sampled")
        assert cache.is_complete(("big",), "sizes")
        _flip_byte(path, offset)
        assert cache.is_complete(("big",), "sampled")


@pytest.mark.parametrize("offset", [9, 22, 61], ids=["header-length", "dtype", "shape"])
def test_the_npy_header_is_checked_in_every_mode(tmp_path, offset):
    """The ``.npy`` header (its length, dtype and shape) is compared with the manifest even by ``"sizes"``."""
    cache, path = _big_entry(tmp_path)
    _flip_byte(path, offset)

    assert [cache.is_complete(("big",), mode) for mode in ("sizes", "sampled", "full")] == [False] * 3
    assert "its .npy header does not match the dtype int64 and shape (1000000,)" in cache._problem.damage


def test_full_checks_read_every_block(tmp_path):
    cache, path = _big_entry(tmp_path)
    _flip_byte(path, 40 * 65536 + 123)

    assert not cache.is_complete(("big",), "full")
    assert cache.is_complete(("big",), "sizes")


def test_prepare_cache_checks_every_block_and_rebuilds_a_damaged_entry(tmp_path, corpus, tokenizer, logs):
    """A load samples the blocks of a large array; running ``prepare_cache`` again reads all of them."""
    config = {**SETTINGS, "data_cache_path": str(tmp_path / "cache")}
    sizes = [1_000_000, 30, 10]  # a train shuffle index of 8 MB: 123 blocks
    prepare_cache(config, tokenizer, sizes, str(corpus))
    path = next((tmp_path / "cache").glob("*-GPTDataset-train-shuffle_index.npy"))
    _flip_byte(path, 40 * 65536 + 123)
    logs.clear()

    prepare_cache(config, tokenizer, sizes, str(corpus))

    [warning] = _warnings(logs)
    assert warning.startswith(f"{path}: bytes {40 * 65536} to {41 * 65536} do not match their checksum")
    assert len(building_messages(logs)) == 1


# -- data files in the key ----------------------------------------------------------------------------------------


def _same_counts(lengths: np.ndarray, change: str) -> tuple[np.ndarray, int]:
    """New lengths and token seed with the same documents, and the same tokens in every split."""
    if change == "tokens":
        return lengths, 2
    rng = np.random.default_rng(3)
    parts = [rng.permutation(lengths[b:e]) for b, e in zip(SPLIT_BOUNDS[:-1], SPLIT_BOUNDS[1:], strict=True)]
    return np.concatenate(parts), 1


@pytest.mark.parametrize("change", ["lengths", "tokens"])
def test_rewritten_data_files_never_reuse_the_old_indices(tmp_path, corpus, lengths, tokenizer, logs, change):
    """A pair rewritten with the same document count (and the same tokens per split) builds new indices: with
    other lengths the old ones would cut samples at the wrong places."""
    cache = tmp_path / "cache"
    _build(corpus, tokenizer, cache)
    new_lengths, token_seed = _same_counts(lengths, change)
    _write_pair(corpus, new_lengths, token_seed)
    logs.clear()

    rebuilt = _build(corpus, tokenizer, cache)

    assert len(building_messages(logs)) == 3
    fresh = _build(corpus, tokenizer, tmp_path / "fresh")
    for got, want in zip(rebuilt, fresh, strict=True):
        assert_same_datasets(got, want)


def test_the_key_records_the_data_files(tmp_path, corpus, tokenizer):
    """The description names the size and modification time of both files of the pair."""
    train = _build(corpus, tokenizer, tmp_path / "cache")[0]
    idx, bin_ = Path(f"{corpus}.idx").stat(), Path(f"{corpus}.bin").stat()

    assert train.unique_identifiers["data_files"] == {
        "idx_bytes": idx.st_size,
        "idx_mtime_ns": idx.st_mtime_ns,
        "bin_bytes": bin_.st_size,
        "bin_mtime_ns": bin_.st_mtime_ns,
    }


# -- settings -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "value", "expected"),
    [
        ("cache_verification", "everything", "cache_verification must be one of ('sizes', 'sampled', 'full')"),
        ("cache_lock_timeout", 0, "cache_lock_timeout must be a number of seconds > 0"),
        ("cache_lock_timeout", "60", "cache_lock_timeout must be a number of seconds > 0"),
        ("cache_lock_timeout", float("nan"), "cache_lock_timeout must be a number of seconds > 0"),
    ],
)
def test_cache_settings_are_checked(setting, value, expected):
    with pytest.raises(DataConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        IndexedDataConfig(seq_length=8, **{setting: value})
