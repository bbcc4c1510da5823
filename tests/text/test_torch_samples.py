"""Samples as torch tensors: Indexed samples are; Online samples with ``return_tensors="pt"`` hold the values of the
numpy samples, a plain torch DataLoader reads them, and the library's loaders give the same batches over the view."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from indexed.test_index_cache import write_corpus

from hyper_parallel.data.batching import DynamicBatchDataLoader
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset, build_online_text_dataset
from hyper_parallel.data.torch_samples import IterableTorchSamples, TorchSamples, to_torch


def assert_same(numpy_sample, torch_sample) -> None:
    if isinstance(numpy_sample, dict):
        assert set(numpy_sample) == set(torch_sample)
        for key in numpy_sample:
            assert_same(numpy_sample[key], torch_sample[key])
    elif isinstance(numpy_sample, list):
        assert len(numpy_sample) == len(torch_sample)
        for a, b in zip(numpy_sample, torch_sample, strict=True):
            assert_same(a, b)
    else:
        assert isinstance(torch_sample, torch.Tensor), type(torch_sample)
        expected = np.asarray(numpy_sample)
        assert torch_sample.dtype == torch.from_numpy(expected.copy()).dtype
        assert np.array_equal(torch_sample.numpy(), expected)


def test_to_torch_shares_writable_arrays_and_copies_read_only_ones():
    writable = np.arange(4, dtype=np.int64)
    shared = to_torch({"ids": writable, "n": np.int32(3), "name": "x"})
    writable[0] = 9
    assert shared["ids"][0].item() == 9 and shared["n"].item() == 3 and shared["name"] == "x"
    read_only = np.arange(3)
    read_only.flags.writeable = False
    assert to_torch([read_only])[0].tolist() == [0, 1, 2]


def test_indexed_samples_are_torch_tensors_already(tmp_path, tokenizer):
    prefix = write_corpus(tmp_path / "corpus_text_document", num_documents=40, seed=5)
    train, _, _ = build_indexed_text_dataset(
        prefix, {"seq_length": 16, "split": "90, 8, 2", "data_cache_path": str(tmp_path / "cache")}, tokenizer=tokenizer
    )
    assert all(isinstance(value, torch.Tensor) for value in train[0].values())


@pytest.fixture
def online_path(tmp_path):
    path = tmp_path / "train.jsonl"
    lines = [
        json.dumps({"text": f"Chapter {i}. " + "It is a truth universally acknowledged. " * (i % 7 + 1)})
        for i in range(30)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("dataset_type", ["mapping", "iterable"])
def test_online_samples_as_torch_tensors(online_path, tmp_path, tokenizer, dataset_type):
    def build(return_tensors):
        return build_online_text_dataset(
            online_path,
            {"data_type": "plaintext", "max_seq_len": 16},
            {"dataset_type": dataset_type, "cache_dir": str(tmp_path / "cache")},
            tokenizer=tokenizer,
            return_tensors=return_tensors,
        )

    plain, view = build("np"), build("pt")
    if dataset_type == "mapping":
        assert isinstance(view, TorchSamples) and view.transform is view.dataset.transform  # the rest is the dataset's
        assert_same([plain[i] for i in range(len(plain))], [view[i] for i in range(len(view))])
        # a plain torch DataLoader with two workers (the view pickles), one record per batch
        records = torch.utils.data.DataLoader(view, batch_size=None, num_workers=2)
        assert_same([plain[i] for i in range(len(plain))], list(records))
    else:
        assert isinstance(view, IterableTorchSamples)
        assert_same(list(plain), list(view))
    loaders = [
        DynamicBatchDataLoader(dataset, micro_batch_size=2, min_buffered_samples=4)
        for dataset in (build("np"), build("pt"))
    ]
    for a, b in zip(*(list(loader) for loader in loaders), strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.cu_seq_lens, b.cu_seq_lens)


def test_an_unknown_return_tensors_is_refused_before_reading(tmp_path, tokenizer):
    with pytest.raises(DataConfigError, match=r"return_tensors is 'torch'; use 'np' .* or 'pt'"):
        build_online_text_dataset(
            tmp_path / "missing.jsonl",
            {"data_type": "plaintext", "max_seq_len": 8},
            tokenizer=tokenizer,
            return_tensors="torch",
        )
