"""Specification of Indexed prefixes in object storage, against a real S3 endpoint (moto's server on loopback):
the same sequences and samples as the local pair, ranged reads through the bounded block cache, index caches kept
locally and keyed by the objects' identity, and clear errors for missing and replaced objects."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import s3fs
import torch
from object_storage_server import BUCKET, FaultyProxy, s3_server  # noqa: F401 - the fixture

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.indexed_data_config import IndexedDataConfig
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader, read_sequence_counts
from hyper_parallel.data.indexed.object_storage import ObjectIndexedDataReader, open_reader
from hyper_parallel.data.indexed.pair_metadata import loss_mask_prefix

from .test_index_cache import building_messages, write_corpus
from .test_indexed_pretrain_dataset import assert_samples_equal, build_splits
from .test_loss_mask_pairs import prepare, train_split

SAMPLES = (40, 4, 2)


def splits(data_path, tokenizer, **settings) -> tuple:
    """The ``SAMPLES`` of the three splits of ``data_path``, 80/15/5."""
    return build_splits(data_path, tokenizer, SAMPLES, split="80,15,5", **settings)


def upload(fs, local_prefix: str, key: str) -> str:
    """Put the pair ``local_prefix`` at ``s3://BUCKET/key``; returns that URL prefix."""
    for extension in (".idx", ".bin"):
        fs.put(local_prefix + extension, f"{BUCKET}/{key}{extension}")
    return f"s3://{BUCKET}/{key}"


@pytest.fixture(scope="module")
def pairs(s3_server, tmp_path_factory):  # noqa: F811
    """Two local pairs and their copies in the bucket: ``[(local prefix, URL prefix), ...]``."""
    directory = tmp_path_factory.mktemp("pairs")
    made = []
    for name, seed in (("books", 1), ("web", 2)):
        local = write_corpus(directory / name, num_documents=120, seed=seed)
        made.append((local, upload(s3_server, local, f"corpus/{name}")))
    return made


def test_reader_returns_the_sequences_of_the_local_pair(pairs):
    local_prefix, url = pairs[0]
    local = IndexedDataReader(local_prefix)
    remote = ObjectIndexedDataReader(url, block_bytes=256, cache_bytes=4096)  # reads cross block edges
    remote.check_token_ids(8192)
    assert len(remote) == len(local) and remote.dtype == local.dtype
    np.testing.assert_array_equal(remote.document_indices, local.document_indices)
    for i in range(len(local)):
        np.testing.assert_array_equal(remote[i], local[i])
    np.testing.assert_array_equal(remote.get(5, 3, 7), local.get(5, 3, 7))
    ids = [7, 0, 99, 7]
    np.testing.assert_array_equal(remote.gather(ids), local.gather(ids))
    assert read_sequence_counts(url) == read_sequence_counts(local_prefix)


def test_a_read_fetches_only_the_blocks_it_touches_and_the_cache_stays_bounded(pairs):
    local_prefix, url = pairs[1]
    local = IndexedDataReader(local_prefix)
    block = 128
    remote = ObjectIndexedDataReader(url, block_bytes=block, cache_bytes=8 * block)
    i = len(local) // 2
    start = int(local.sequence_pointers[i])
    end = start + int(local.sequence_lengths[i]) * local.dtype.itemsize
    np.testing.assert_array_equal(remote[i], local[i])
    touched = range(start // block, (end - 1) // block + 1)
    assert remote._cache.held_bytes == len(touched) * block
    for j in range(len(local)):
        remote[j]
    assert remote._cache.held_bytes <= 8 * block
    assert remote._cache.held_bytes < local.sequence_pointers[-1]  # far less than the whole .bin


def test_the_cache_counts_hits_and_misses_and_a_cleared_cache_fetches_again(pairs):
    local_prefix, url = pairs[1]
    local = IndexedDataReader(local_prefix)
    block = 64
    remote = ObjectIndexedDataReader(url, block_bytes=block, cache_bytes=1 << 20)  # holds the whole .bin
    cache = remote._cache
    hits, misses = cache.hits, cache.misses
    i = 7
    start = int(local.sequence_pointers[i])
    end = start + int(local.sequence_lengths[i]) * local.dtype.itemsize
    blocks = (end - 1) // block - start // block + 1
    remote[i]
    assert (cache.hits - hits, cache.misses - misses) == (0, blocks)
    remote[i]
    assert (cache.hits - hits, cache.misses - misses) == (blocks, blocks)
    cache.clear()
    assert cache.held_bytes == 0
    remote[i]
    assert (cache.hits - hits, cache.misses - misses) == (blocks, 2 * blocks)


def test_a_reader_sent_to_another_process_reopens_the_objects(pairs):
    local_prefix, url = pairs[0]
    remote = pickle.loads(pickle.dumps(ObjectIndexedDataReader(url, block_bytes=512, cache_bytes=4096)))
    assert (remote.block_bytes, remote.cache_bytes) == (512, 4096)
    np.testing.assert_array_equal(remote[3], IndexedDataReader(local_prefix)[3])


def test_open_reader_picks_the_backend_by_the_scheme(pairs):
    local_prefix, url = pairs[0]
    assert type(open_reader(url)) is ObjectIndexedDataReader
    assert type(open_reader(local_prefix)) is IndexedDataReader


@pytest.mark.parametrize("lazy", [False, True])
def test_gpt_samples_equal_those_of_the_local_pair(pairs, tokenizer, tmp_path, lazy):
    local_prefix, url = pairs[0]
    settings = {"data_lazy_load": lazy, "object_block_bytes": 1024}
    expected = splits(local_prefix, tokenizer, data_cache_path=str(tmp_path / "local"), **settings)
    actual = splits(url, tokenizer, data_cache_path=str(tmp_path / "remote"), **settings)
    for got, want in zip(actual, expected, strict=True):
        assert_samples_equal([got[i] for i in range(len(got))], [want[i] for i in range(len(want))])
    assert any((tmp_path / "remote").rglob("*.npy"))  # the index caches of the URL prefix are local files


def test_a_blend_of_two_prefixes_equals_the_local_blend(pairs, tokenizer):
    (books, books_url), (web, web_url) = pairs
    expected = splits(["30", books, "70", web], tokenizer)
    actual = splits(["30", books_url, "70", web_url], tokenizer)
    for got, want in zip(actual, expected, strict=True):
        assert_samples_equal([got[i] for i in range(len(got))], [want[i] for i in range(len(want))])


def test_samples_through_dataloader_workers_equal_the_local_ones(pairs, tokenizer):
    local_prefix, url = pairs[1]
    expected = splits(local_prefix, tokenizer)[0]
    actual = splits(url, tokenizer)[0]
    loader = torch.utils.data.DataLoader(actual, batch_size=None, num_workers=2)
    assert_samples_equal(list(loader), [expected[i] for i in range(len(expected))])


def test_index_caches_are_keyed_by_the_object_identity(s3_server, tokenizer, tmp_path, logs):  # noqa: F811
    first = write_corpus(tmp_path / "first", num_documents=120, seed=5)
    url = upload(s3_server, first, "replaced/pair")
    cache = str(tmp_path / "cache")
    splits(url, tokenizer, data_cache_path=cache)
    built = len(building_messages(logs))
    splits(url, tokenizer, data_cache_path=cache)
    assert len(building_messages(logs)) == built  # the same objects reuse their caches
    second = write_corpus(tmp_path / "second", num_documents=120, seed=6)
    upload(s3_server, second, "replaced/pair")
    actual = splits(url, tokenizer, data_cache_path=cache)[0]
    assert len(building_messages(logs)) > built
    expected = splits(second, tokenizer)[0]
    assert_samples_equal([actual[i] for i in range(len(actual))], [expected[i] for i in range(len(expected))])


def test_a_missing_object_names_the_url_and_the_fix(s3_server, pairs):  # noqa: F811
    with pytest.raises(DataFileError, match=rf"s3://{BUCKET}/absent\.bin does not exist.*upload the pair"):
        ObjectIndexedDataReader(f"s3://{BUCKET}/absent")
    local_prefix, _ = pairs[0]
    s3_server.put(local_prefix + ".bin", f"{BUCKET}/half/pair.bin")
    with pytest.raises(DataFileError, match=rf"s3://{BUCKET}/half/pair\.idx does not exist"):
        ObjectIndexedDataReader(f"s3://{BUCKET}/half/pair")


@pytest.mark.parametrize("read_before", [False, True])
def test_an_object_replaced_after_the_index_read_is_refused(s3_server, pairs, read_before):  # noqa: F811
    local_prefix, _ = pairs[0]
    url = upload(s3_server, local_prefix, f"changing/{read_before}")
    reader = ObjectIndexedDataReader(url, block_bytes=256, cache_bytes=1024)
    if read_before:
        reader[0]  # the conditional file handle is open already
    size = reader.file_identity["bin_bytes"]
    s3_server.pipe(f"{BUCKET}/changing/{read_before}.bin", bytes(size))  # same size, other tokens
    with pytest.raises(DataFileError, match=rf"{url}\.bin changed after its index was read"):
        reader[len(reader) - 1]  # a block not cached yet


def test_cache_settings_are_checked(pairs):
    with pytest.raises(DataConfigError, match="object_cache_bytes must be an integer >= 4096"):
        IndexedDataConfig(seq_length=8, object_block_bytes=4096, object_cache_bytes=1024)
    with pytest.raises(DataConfigError, match="cache_bytes .* must hold at least one block"):
        ObjectIndexedDataReader(pairs[0][1], block_bytes=4096, cache_bytes=1024)


@pytest.fixture
def through_proxy(s3_server, monkeypatch):  # noqa: F811
    """Open readers through a ``FaultyProxy`` in front of the server, with the SDK's own retries off."""

    def start(**faults) -> FaultyProxy:
        proxy = FaultyProxy(os.environ["AWS_ENDPOINT_URL"], **faults)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        s3fs.S3FileSystem.clear_instance_cache()
        return proxy

    yield start
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.parametrize("drop", [False, True], ids=["503", "dropped"])
def test_transient_errors_are_retried(pairs, through_proxy, drop):
    local_prefix, url = pairs[0]
    with through_proxy(failing={1, 2}, drop=drop) as proxy:
        # Blocks of a size no other test uses, so none is in the process-wide cache: the .idx is GET 3, block 0 GET 4.
        reader = ObjectIndexedDataReader(url, block_bytes=320 + 32 * drop, cache_bytes=4096)
        np.testing.assert_array_equal(reader[0], IndexedDataReader(local_prefix)[0])
    assert proxy.ranged_gets == 4


def test_persistent_errors_name_the_object_and_the_range(pairs, through_proxy):
    _, url = pairs[0]
    with through_proxy(always_from=2):  # the .idx is read by GET 1, the .bin never
        reader = ObjectIndexedDataReader(url, block_bytes=416, cache_bytes=4096)
        with pytest.raises(DataFileError, match=rf"reading bytes \[0, 416\) of {url}\.bin failed 4 times"):
            reader[0]


def test_the_loss_mask_pair_beside_a_url_prefix_is_read(s3_server, tmp_path, tokenizer_path):  # noqa: F811
    _, local_prefix = prepare(tmp_path, tokenizer_path)
    url = upload(s3_server, local_prefix, "sft/pair")
    upload(s3_server, loss_mask_prefix(local_prefix), loss_mask_prefix("sft/pair"))
    expected = train_split(local_prefix, tokenizer_path, 24)
    actual = train_split(url, tokenizer_path, 24)
    assert actual.loss_mask_pair is not None
    assert_samples_equal([actual[i] for i in range(len(actual))], [expected[i] for i in range(len(expected))])


def test_the_metadata_beside_a_url_prefix_bounds_the_token_ids(s3_server, pairs):  # noqa: F811
    local_prefix, _ = pairs[0]
    url = upload(s3_server, local_prefix, "described/pair")
    reader = IndexedDataReader(local_prefix)
    largest = int(max(reader[i].max() for i in range(len(reader))))
    metadata = {"tokenizer_fingerprint": "f", "vocab_size": largest, "eod_id": 0, "token_dtype": "uint16"}
    s3_server.pipe(f"{BUCKET}/described/pair.meta.json", json.dumps(metadata).encode())
    remote = ObjectIndexedDataReader(url)
    assert remote.pair_metadata().vocab_size == largest
    remote.check_token_ids(None)
    with pytest.raises(DataFileError, match=rf"the token id {largest} .* outside \[0, {largest}\)"):
        for i in range(len(remote)):
            remote[i]
