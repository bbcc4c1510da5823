"""Specification of lazy construction (``data_lazy_load: true``): ``build_indexed_text_dataset`` returns
``LazyDatasetProxy`` objects that open no reader, build no index and write no cache until the first ``len()``, item
access or ``unique_identifiers``; the dataset is then built once, reused, and equal to the eager build."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import hyper_parallel.data.indexed.object_storage as object_storage
from hyper_parallel.data.indexed.indexed_blended_dataset import BlendedDataset
from hyper_parallel.data.indexed.indexed_lazy_dataset import LazyDatasetProxy
from hyper_parallel.data.indexed.indexed_pretrain_dataset import GPTDataset
from hyper_parallel.data.tools.build_sequences_per_dataset import write_sequences_per_dataset

from .test_index_cache import write_corpus
from .test_indexed_pretrain_dataset import assert_samples_equal, build_splits, packed_records, write_records

SETTINGS = {"split": "90, 8, 2", "data_lazy_load": True}
SIZES = [120, 12, 4]
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index", "dataset_index", "dataset_sample_index")


class Opened:
    """Counts the readers and ``GPTDataset`` objects created while it is installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.readers: list[str] = []
        self.datasets = 0
        reader_class, dataset_init = object_storage.IndexedDataReader, GPTDataset.__init__

        def open_reader(prefix, *args, **kwargs):
            self.readers.append(str(prefix))
            return reader_class(prefix, *args, **kwargs)

        def build_dataset(dataset, *args, **kwargs):
            self.datasets += 1
            dataset_init(dataset, *args, **kwargs)

        monkeypatch.setattr(object_storage, "IndexedDataReader", open_reader)
        monkeypatch.setattr(GPTDataset, "__init__", build_dataset)


@pytest.fixture
def opened(monkeypatch) -> Opened:
    return Opened(monkeypatch)


@pytest.fixture
def corpus(tmp_path) -> str:
    return write_corpus(tmp_path / "corpus_text_document", num_documents=150, seed=21)


def sequences_file(tmp_path: Path, *prefixes: str) -> str:
    """The per-dataset sequences file of ``prefixes``, written by the library's tool."""
    path = tmp_path / "sequences.json"
    write_sequences_per_dataset(prefixes, path, progress=False)
    return str(path)


def cache_files(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("*")) if cache.exists() else []


def lazy_splits(corpus: str, tokenizer, tmp_path: Path, **settings) -> tuple:
    settings = {**SETTINGS, "data_cache_path": str(tmp_path / "cache"), **settings}
    return build_splits(corpus, tokenizer, SIZES, **settings)


# -- nothing before first use -------------------------------------------------------------------------------------


def test_lazy_build_opens_nothing(corpus, tokenizer, tmp_path, opened):
    """With the sequence counts given by ``per_dataset_sequences_path``, every split is an unbuilt proxy: no reader
    opened, no dataset built, no cache written."""
    splits = lazy_splits(corpus, tokenizer, tmp_path, per_dataset_sequences_path=sequences_file(tmp_path, corpus))

    assert all(type(split) is LazyDatasetProxy and not split.is_built for split in splits)
    assert opened.readers == [] and opened.datasets == 0
    assert cache_files(tmp_path / "cache") == []


def test_lazy_build_opens_no_reader_without_a_sequences_file(corpus, tokenizer, tmp_path, opened):
    """Without ``per_dataset_sequences_path`` the lazy build opens no reader either: the prefix is opened at first
    use (start-up opens only what training touches)."""
    splits = lazy_splits(corpus, tokenizer, tmp_path)

    assert all(not split.is_built for split in splits)
    assert opened.readers == [] and cache_files(tmp_path / "cache") == []


def test_lazy_build_without_a_sequences_file_builds_nothing(corpus, tokenizer, tmp_path, opened):
    """Without ``per_dataset_sequences_path`` the lazy build still builds no dataset and writes no cache, and the
    prefix is opened at most once for all its splits."""
    splits = lazy_splits(corpus, tokenizer, tmp_path)
    assert all(not split.is_built for split in splits)
    assert opened.datasets == 0 and cache_files(tmp_path / "cache") == []

    for split in splits:
        len(split)
    assert opened.readers == [corpus] and opened.datasets == 3


def test_lazy_unweighted_blend_builds_nothing(tmp_path, tokenizer, opened):
    """An unweighted blend under ``data_lazy_load`` builds no source dataset and writes no cache before first use."""
    a = write_corpus(tmp_path / "a_text_document", num_documents=80, seed=22)
    b = write_corpus(tmp_path / "b_text_document", num_documents=80, seed=23)

    splits = build_splits([a, b], tokenizer, None, **SETTINGS, data_cache_path=str(tmp_path / "cache"))

    assert all(type(split) is LazyDatasetProxy and not split.is_built for split in splits)
    assert opened.datasets == 0 and cache_files(tmp_path / "cache") == []


# -- first use ----------------------------------------------------------------------------------------------------


TRIGGERS = {
    "len": len,
    "getitem": lambda proxy: proxy[3],
    "negative_getitem": lambda proxy: proxy[-1],
    "getitems": lambda proxy: proxy.__getitems__([0, 5]),
    "unique_identifiers": lambda proxy: proxy.unique_identifiers,
    "attribute": lambda proxy: proxy.dataset_path,
}


@pytest.mark.parametrize("trigger", TRIGGERS)
def test_first_use_builds_the_dataset_once(corpus, tokenizer, tmp_path, opened, trigger):
    """The first ``len()``, item access, ``unique_identifiers`` or attribute builds that split's dataset (and only
    its cache entry); later uses, of any kind, reuse the same object."""
    sequences = sequences_file(tmp_path, corpus)
    train, valid, test = lazy_splits(corpus, tokenizer, tmp_path, per_dataset_sequences_path=sequences)

    TRIGGERS[trigger](train)

    assert train.is_built and not valid.is_built and not test.is_built
    assert opened.readers == [corpus] and opened.datasets == 1
    built = train.dataset
    assert type(built) is GPTDataset
    written = sorted(name.split("-", 1)[1] for name in cache_files(tmp_path / "cache") if name.endswith(".npy"))
    assert written == [f"GPTDataset-train-{name}.npy" for name in ("document_index", "sample_index", "shuffle_index")]
    for use in TRIGGERS.values():
        use(train)
    assert train.dataset is built and opened.datasets == 1 and opened.readers == [corpus]


def test_private_attributes_do_not_build(corpus, tokenizer, tmp_path, opened):
    """Looking up a missing private attribute (as ``copy`` and ``pickle`` do) raises ``AttributeError`` and builds
    nothing."""
    train = lazy_splits(corpus, tokenizer, tmp_path, per_dataset_sequences_path=sequences_file(tmp_path, corpus))[0]

    with pytest.raises(AttributeError):
        train._not_an_attribute  # noqa: B018
    assert not train.is_built and opened.datasets == 0


def test_repr_before_and_after_building(corpus, tokenizer, tmp_path):
    """Before building, ``repr`` names the class, prefix, split and sequence range and says it is not built; after,
    it shows the built dataset."""
    train = lazy_splits(corpus, tokenizer, tmp_path)[0]

    assert repr(train) == f"LazyDatasetProxy(GPTDataset {corpus} train [0, 135): not built yet)"
    len(train)
    assert repr(train) == f"LazyDatasetProxy(GPTDataset {corpus} train [0, 135): {train.dataset!r})"


# -- equal to the eager build -------------------------------------------------------------------------------------


def unwrap(dataset):
    return dataset.dataset if isinstance(dataset, LazyDatasetProxy) else dataset


def assert_same_build(lazy, eager, where: str) -> None:
    """Same kind, length, index arrays, sources (recursively) and every sample."""
    assert (lazy is None) == (eager is None), where
    if eager is None:
        return
    assert type(unwrap(lazy)) is type(eager), where
    assert len(lazy) == len(eager), where
    for name in INDEX_NAMES:
        if hasattr(eager, name):
            np.testing.assert_array_equal(getattr(lazy, name), getattr(eager, name), err_msg=f"{where}.{name}")
    for k, (source, eager_source) in enumerate(
        zip(getattr(unwrap(lazy), "datasets", []), getattr(eager, "datasets", []), strict=True)
    ):
        assert_same_build(source, eager_source, f"{where}.datasets[{k}]")
    positions = list(range(len(eager)))
    assert_samples_equal(lazy.__getitems__(positions), eager.__getitems__(positions), where)


@pytest.mark.parametrize("kind", ["single", "weighted", "packed"])
def test_lazy_build_equals_eager_build(tmp_path, tokenizer, kind):
    """Every split of a lazy build, once used, equals the eager build of the same config: a single prefix, a weighted
    blend (whose sources are lazy too), and packed records."""
    settings = {"split": "90, 8, 2"}
    if kind == "packed":
        data_path = write_records(tmp_path / "packed_text_document", packed_records(80, seed=24))
        settings["is_dataset_from_mr"] = True
        sizes = [60, None, None]
    else:
        a = write_corpus(tmp_path / "a_text_document", num_documents=90, seed=25)
        b = write_corpus(tmp_path / "b_text_document", num_documents=60, seed=26)
        data_path = a if kind == "single" else ["30", a, "70", b]
        sizes = SIZES

    eager = build_splits(data_path, tokenizer, sizes, **settings, data_cache_path=str(tmp_path / "eager"))
    lazy = build_splits(
        data_path, tokenizer, sizes, **settings, data_lazy_load=True, data_cache_path=str(tmp_path / "lazy")
    )

    assert all(type(split) is LazyDatasetProxy and not split.is_built for split in lazy)
    if kind == "weighted":
        assert type(lazy[0].dataset) is BlendedDataset
        assert all(type(source) is LazyDatasetProxy for source in lazy[0].datasets)
    for name, lazy_split, eager_split in zip(("train", "valid", "test"), lazy, eager, strict=True):
        assert_same_build(lazy_split, eager_split, name)
    assert torch.equal(lazy[0][0]["tokens"], eager[0][0]["tokens"])
