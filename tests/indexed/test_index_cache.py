"""Specification of the index caches: keys that follow every setting, atomic entries, read-only fallback, deferral.

Also home of the small helpers the cache-related tests share: ``write_corpus``, ``building_messages`` and
``assert_same_datasets``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from permissions import read_only

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.indexed import index_cache
from hyper_parallel.data.indexed.index_cache import CacheOptions, IndexCache
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset

__all__ = ["assert_same_datasets", "building_messages", "write_corpus"]

SETTINGS = {"seq_length": 32, "split": "90, 8, 2", "random_seed": 1234}
NUM_SAMPLES = [200, 30, 10]
_INDEX_ARRAYS = ("document_index", "sample_index", "shuffle_index", "dataset_index", "dataset_sample_index")
_NAMES = ("first", "second")


# -- shared helpers -----------------------------------------------------------------------------------------------


def write_corpus(
    prefix: str | os.PathLike, num_documents: int = 300, seed: int = 0, empty_tail: int = 0, max_length: int = 120
) -> str:
    """Write a uint16 pair of random one-sequence documents and return its prefix.

    Token ids are drawn from [2, 8192), so they are never the bundled tokenizer's EOD (0) or pad (1).

    Args:
        prefix: the path without ``.bin``/``.idx``.
        num_documents: documents with 1 to ``max_length - 1`` tokens.
        seed: seeds the lengths and ids.
        empty_tail: documents of 0 tokens appended at the end (a split over them holds no tokens).
        max_length: exclusive bound of the document lengths.
    """
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(1, max_length, size=num_documents), np.zeros(empty_tail, np.int64)])
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16) as builder:
        builder.add_documents(rng.integers(2, 8192, size=int(lengths.sum())), lengths)
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def building_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The "building the ... indices" messages captured so far."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("building the")]


def assert_same_datasets(actual, expected, max_samples: int = 64) -> None:
    """Same type, length, index arrays (recursively through blend sources) and first samples."""
    assert type(actual) is type(expected)
    if expected is None:
        return
    assert len(actual) == len(expected)
    for name in _INDEX_ARRAYS:
        if hasattr(expected, name):
            np.testing.assert_array_equal(getattr(actual, name), getattr(expected, name), err_msg=name)
    for source, expected_source in zip(getattr(actual, "datasets", []), getattr(expected, "datasets", []), strict=True):
        assert_same_datasets(source, expected_source, max_samples=8)
    for i in range(min(len(expected), max_samples)):
        got, want = actual[i], expected[i]
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(value)), (i, key)


# -- fixtures -----------------------------------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path) -> str:
    return write_corpus(tmp_path / "corpus_text_document", num_documents=300, seed=7)


@pytest.fixture
def info_logs(caplog) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="hyper_parallel.data")
    return caplog


def _build(data_path, tokenizer, cache: Path | None, num_samples=NUM_SAMPLES, **settings):
    config = {**SETTINGS, **settings, "data_cache_path": None if cache is None else str(cache)}
    return build_indexed_text_dataset(data_path, config, num_samples, tokenizer)


def _files(directory: Path, pattern: str = "*") -> list[str]:
    return sorted(p.name for p in directory.glob(pattern))


# -- keys ---------------------------------------------------------------------------------------------------------


def test_key_is_the_md5_of_the_description_and_the_readable_text_is_saved(tmp_path):
    """The key is the MD5 of the compact JSON of the description; its indented JSON is saved beside the arrays,
    with the manifest of each array."""
    description = {"class": "GPTDataset", "dataset_path": "/data/a", "num_samples": 10}
    cache = IndexCache(tmp_path, "GPTDataset", "train", description)
    compact = json.dumps(description, separators=(",", ":"))

    assert cache.key == hashlib.md5(compact.encode("utf-8")).hexdigest()
    arrays = cache.get_or_build(("values",), lambda: {"values": np.arange(5)})

    np.testing.assert_array_equal(arrays["values"], np.arange(5))
    assert _files(tmp_path, "*.npy") == [f"{cache.key}-GPTDataset-train-values.npy"]
    saved = (tmp_path / f"{cache.key}-GPTDataset-train-description.txt").read_text(encoding="utf-8")
    assert saved.startswith('{\n    "description": {\n        "class": "GPTDataset",')
    manifest = json.loads(saved)
    assert manifest["description"] == description
    values = manifest["arrays"]["values"]
    assert (values["dtype"], values["shape"]) == (np.arange(5).dtype.str, [5])
    assert values["file_bytes"] == cache.path("values").stat().st_size


@pytest.mark.parametrize(
    "change",
    [
        {"add_extra_token_to_sequence": False},
        {"random_seed": 4321},
        {"seq_length": 40},
        {"split": "80, 15, 5"},
        {"drop_last_partial_validation_sequence": False},
        {"num_samples": [150, 30, 10]},
    ],
    ids=lambda change: next(iter(change)),
)
def test_every_setting_that_changes_the_indices_changes_the_key(tmp_path, corpus, tokenizer, info_logs, change):
    """A cache built with other settings is never reused: the changed datasets are rebuilt and equal a fresh build."""
    cache = tmp_path / "cache"
    settings = dict(change)
    num_samples = settings.pop("num_samples", NUM_SAMPLES)
    _build(corpus, tokenizer, cache)
    descriptions_before = _files(cache, "*-description.txt")
    info_logs.clear()

    changed = _build(corpus, tokenizer, cache, num_samples, **settings)

    assert building_messages(info_logs), "the changed settings reused the indices of the first build"
    assert len(_files(cache, "*-description.txt")) > len(descriptions_before)
    fresh = _build(corpus, tokenizer, tmp_path / "fresh", num_samples, **settings)
    for got, want in zip(changed, fresh, strict=True):
        assert_same_datasets(got, want)


def test_same_settings_reuse_the_cache(tmp_path, corpus, tokenizer, info_logs):
    """A second build with the same settings loads every index and builds nothing."""
    first = _build(corpus, tokenizer, tmp_path / "cache")
    assert len(building_messages(info_logs)) == 3
    info_logs.clear()

    second = _build(corpus, tokenizer, tmp_path / "cache")

    assert building_messages(info_logs) == []
    for got, want in zip(second, first, strict=True):
        assert_same_datasets(got, want)


# -- atomic entries -----------------------------------------------------------------------------------------------


def test_entries_are_published_atomically(tmp_path, corpus, tokenizer, info_logs):
    """No temporary file is left; an entry without its description is incomplete and is rebuilt."""
    cache = tmp_path / "cache"
    built = _build(corpus, tokenizer, cache)
    assert _files(cache, "*.tmp-*") == []
    train_description = next(cache.glob("*-GPTDataset-train-description.txt"))
    text = train_description.read_text(encoding="utf-8")
    train_description.unlink()
    info_logs.clear()

    rebuilt = _build(corpus, tokenizer, cache)

    assert len(building_messages(info_logs)) == 1 and "GPTDataset-train" in building_messages(info_logs)[0]
    assert train_description.read_text(encoding="utf-8") == text
    assert _files(cache, "*.tmp-*") == []
    assert_same_datasets(rebuilt[0], built[0])


def _fail_second_save(monkeypatch) -> None:
    """Make the second ``numpy.save`` write a few bytes and then fail as a full disk does."""
    save = np.save
    calls = []

    def failing_save(file, array, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            file.write(b"\x93NUMPY partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(file, array, *args, **kwargs)

    monkeypatch.setattr(np, "save", failing_save)


def _arrays() -> dict[str, np.ndarray]:
    return {name: np.arange(10) * (i + 1) for i, name in enumerate(_NAMES)}


def test_failed_write_leaves_an_incomplete_entry_that_is_rebuilt(tmp_path, monkeypatch):
    """A write that fails half-way publishes no description, so the next caller rebuilds the entry."""
    cache = IndexCache(tmp_path, "GPTDataset", "train", {"case": "failed write"})
    _fail_second_save(monkeypatch)
    with pytest.raises(DataFileError, match="cannot write .*-second.npy: No space left on device; free space"):
        cache.get_or_build(_NAMES, _arrays)
    assert not cache.is_complete(_NAMES)
    monkeypatch.undo()

    arrays = cache.get_or_build(_NAMES, _arrays)

    assert cache.is_complete(_NAMES)
    for name, expected in _arrays().items():
        np.testing.assert_array_equal(arrays[name], expected)


def test_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A write that fails half-way removes its temporary file."""
    cache = IndexCache(tmp_path, "GPTDataset", "train", {"case": "failed write"})
    _fail_second_save(monkeypatch)
    with pytest.raises(DataFileError, match="cannot write .*-second.npy: No space left on device; free space"):
        cache.get_or_build(_NAMES, _arrays)

    assert _files(tmp_path, "*.tmp-*") == []


# -- unwritable directories ---------------------------------------------------------------------------------------


@contextmanager
def _unwritable_directory(tmp_path: Path, kind: str) -> Iterator[Path]:
    """A cache directory that cannot be written: read-only, or below a regular file (so it cannot be created)."""
    if kind == "below_a_file":
        (tmp_path / "file").write_text("not a directory")
        yield tmp_path / "file" / "cache"
        return
    directory = tmp_path / "read_only"
    directory.mkdir()
    with read_only(directory):
        yield directory


@pytest.mark.parametrize("kind", ["below_a_file", "read_only"])
def test_unwritable_cache_directory_builds_in_memory_with_a_warning(tmp_path, corpus, tokenizer, info_logs, kind):
    """Indices are built in memory, with a warning naming the directory; the datasets are unchanged."""
    with _unwritable_directory(tmp_path, kind) as directory:
        datasets = _build(corpus, tokenizer, directory)

    warnings = [r.getMessage() for r in info_logs.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3
    assert all(f"cache directory {directory} is not writable" in w and "in memory" in w for w in warnings)
    assert not directory.exists() or _files(directory) == []
    reference = _build(corpus, tokenizer, tmp_path / "writable")
    for got, want in zip(datasets, reference, strict=True):
        assert_same_datasets(got, want)


def test_read_only_directory_with_a_complete_cache_is_loaded(tmp_path, corpus, tokenizer, info_logs):
    """A complete cache in a read-only directory is loaded as it is: no warning, nothing built."""
    cache = tmp_path / "cache"
    built = _build(corpus, tokenizer, cache)
    info_logs.clear()
    with read_only(cache):
        loaded = _build(corpus, tokenizer, cache)

    assert [r for r in info_logs.records if r.levelno >= logging.WARNING] == []
    assert building_messages(info_logs) == []
    for got, want in zip(loaded, built, strict=True):
        assert_same_datasets(got, want)


# -- deferred mapping ---------------------------------------------------------------------------------------------


def _republish(directory: Path, description: dict, arrays: dict[str, np.ndarray], kind: str = "GPTDataset") -> None:
    """Publish the entry again with other arrays (new files, new manifest), as a concurrent rebuild would."""
    cache = IndexCache(directory, kind, "train", description)
    cache.path("description").unlink()
    cache.get_or_build(tuple(arrays), lambda: arrays)


def test_defer_maps_each_file_on_first_access(tmp_path):
    """With ``defer`` a file is mapped when first read; without it, every file is mapped when the entry loads."""
    description = {"case": "defer"}
    IndexCache(tmp_path, "GPTDataset", "train", description).get_or_build(_NAMES, _arrays)
    eager = IndexCache(tmp_path, "GPTDataset", "train", description).get_or_build(_NAMES, _arrays)
    deferred = IndexCache(tmp_path, "GPTDataset", "train", description).get_or_build(
        _NAMES, _arrays, CacheOptions(defer=True)
    )
    np.testing.assert_array_equal(deferred["first"], _arrays()["first"])  # mapped now

    _republish(tmp_path, description, {**_arrays(), "second": np.full(3, 7)})

    np.testing.assert_array_equal(eager["second"], _arrays()["second"])  # mapped before the swap
    np.testing.assert_array_equal(deferred["second"], np.full(3, 7))  # mapped at this first access
    np.testing.assert_array_equal(deferred["first"], _arrays()["first"])  # kept from its first access


def test_deferred_dataset_opens_its_indices_on_first_use(tmp_path, corpus, tokenizer, info_logs):
    """A dataset built with ``defer_npy_index_mmap`` knows its length without its index files and reads them later."""
    cache = tmp_path / "cache"
    reference = _build(corpus, tokenizer, cache)[0]
    info_logs.clear()
    deferred = _build(corpus, tokenizer, cache, fast_cache_load=True, defer_npy_index_mmap=True)[0]
    assert len(deferred) == len(reference)
    assert building_messages(info_logs) == []

    arrays = {name: np.asarray(getattr(reference, name)) for name in _INDEX_ARRAYS[:3]}
    _republish(cache, reference.unique_identifiers, {**arrays, "shuffle_index": arrays["shuffle_index"][::-1]})

    np.testing.assert_array_equal(deferred.shuffle_index, np.asarray(reference.shuffle_index)[::-1])
    assert torch.equal(deferred[0]["tokens"], reference[len(reference) - 1]["tokens"])


def test_deferred_load_computes_each_key_at_first_access(tmp_path, corpus, tokenizer, monkeypatch):
    """With ``defer_npy_index_mmap`` and ``fast_cache_load`` a dataset's description is hashed only when its index
    files are first read, so that start-up with thousands of sources hashes nothing; the key is the same. At that
    first read the stored description is encoded too, to be compared with it, and so are the arrays' manifests,
    for the manifest's checksum."""
    cache = tmp_path / "cache"
    reference = _build(corpus, tokenizer, cache)[0]
    encoder = index_cache._COMPACT_JSON
    hashed = []

    def encode(description: dict) -> str:
        hashed.append(description)
        return encoder.encode(description)

    monkeypatch.setattr(index_cache, "_COMPACT_JSON", SimpleNamespace(encode=encode))
    deferred = _build(corpus, tokenizer, cache, fast_cache_load=True, defer_npy_index_mmap=True)[0]
    assert len(deferred) == len(reference)
    assert hashed == []

    assert torch.equal(deferred[3]["tokens"], reference[3]["tokens"])
    key, stored, arrays = hashed
    assert key == stored == deferred.unique_identifiers
    assert set(arrays) == {"document_index", "sample_index", "shuffle_index"}
    np.testing.assert_array_equal(deferred.shuffle_index, reference.shuffle_index)
    assert len(hashed) == 3  # the key and the checked manifest are kept
