"""Specification of the inspection tools on Indexed prefixes in object storage (moto's S3 server on loopback):
``inspect``, ``prepare-cache`` and ``sequences-per-dataset`` give for a URL prefix what they give for the same
pair on a local disk, and write their outputs locally."""

from __future__ import annotations

import json

import pytest
from command_runs import run_command
from object_storage_server import BUCKET, s3_server  # noqa: F401 - the fixture

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.indexed.indexed_data_config import IndexedDataConfig
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.tools import build_sequences_per_dataset, prepare_cache, read_indexed_dataset

from .test_index_cache import building_messages, write_corpus
from .test_indexed_pretrain_dataset import assert_samples_equal
from .test_object_storage import upload

SETTINGS = {"seq_length": 32, "split": "90, 8, 2", "random_seed": 77}
SCHEDULE = ["--global-batch-size", "4", "--train-iters", "20", "--eval-interval", "10", "--eval-iters", "2"]


@pytest.fixture(scope="module")
def pairs(s3_server, tmp_path_factory):  # noqa: F811
    """Two local pairs and their copies in the bucket: ``([local prefixes], [URL prefixes])``."""
    directory = tmp_path_factory.mktemp("tool_pairs")
    local = [write_corpus(directory / f"{name}_text_document", 150, seed) for name, seed in (("a", 3), ("b", 4))]
    return local, [upload(s3_server, prefix, f"tools/{prefix.rsplit('/', 1)[1]}") for prefix in local]


@pytest.mark.parametrize("extension", ["", ".idx"])
def test_inspect_summarises_verifies_and_decodes_a_url_prefix_as_the_local_pair(pairs, capsys, extension):
    options = ["--verify", "--tokenizer", BUNDLED_TOKENIZER_PATH, "--decode", "0,-1", "--show-ids", "--json"]
    reports = []
    for prefix in (pairs[0][0], pairs[1][0] + extension):
        code, out, _ = run_command(read_indexed_dataset.main, capsys, prefix, *options)
        assert code == 0
        reports.append(json.loads(out))
    local, remote = reports
    assert remote.pop("prefix") == pairs[1][0] and local.pop("prefix") == pairs[0][0]
    assert remote == local and remote["verify"]["ok"] and len(remote["decoded"]) == 2


def test_inspect_names_a_missing_url_prefix(pairs, capsys):
    code, _, err = run_command(read_indexed_dataset.main, capsys, pairs[1][0] + "_absent")
    assert code == 2 and f"{pairs[1][0]}_absent.bin does not exist" in err


def test_sequences_per_dataset_reads_the_url_headers(pairs, capsys, tmp_path):
    local, remote = pairs
    counts = []
    for name, prefixes in (("local", local), ("remote", remote)):
        out = tmp_path / f"{name}.json"
        argv = ["--data-path", "30", prefixes[0], "70", prefixes[1], "--per-dataset-sequences-path", out]
        assert run_command(build_sequences_per_dataset.main, capsys, *argv)[0] == 0
        counts.append(json.loads(out.read_text()))
    assert list(counts[1]) == remote and list(counts[1].values()) == list(counts[0].values())


def test_a_sequences_file_at_a_url_is_written_and_read_as_a_local_one(pairs, capsys, tmp_path, s3_server):  # noqa: F811
    """The counts file goes to the bucket in one request and a data_config reads it there; a missing one is named."""
    remote = pairs[1]
    url = f"s3://{BUCKET}/tools/sequences.json"
    local = tmp_path / "sequences.json"
    for out in (url, local):
        argv = ["--data-path", "30", remote[0], "70", remote[1], "--per-dataset-sequences-path", out]
        assert run_command(build_sequences_per_dataset.main, capsys, *argv)[0] == 0
    assert s3_server.cat_file(url) == local.read_bytes()
    loaded = IndexedDataConfig(seq_length=32, per_dataset_sequences_path=url).load_sequences_per_dataset()
    assert (
        loaded == IndexedDataConfig(seq_length=32, per_dataset_sequences_path=str(local)).load_sequences_per_dataset()
    )
    assert list(loaded) == remote
    absent = IndexedDataConfig(seq_length=32, per_dataset_sequences_path=url + ".absent")
    with pytest.raises(DataFileError, match=rf"per_dataset_sequences_path {url}\.absent does not exist"):
        absent.load_sequences_per_dataset()


def test_prepare_cache_of_url_prefixes_is_what_training_loads(pairs, capsys, logs, tokenizer, tmp_path):
    local, remote = pairs
    cache = tmp_path / "cache"
    blend = ["30", remote[0], "70", remote[1]]
    argv = ["--split", SETTINGS["split"], "--seq-length", SETTINGS["seq_length"], "--seed", SETTINGS["random_seed"]]
    argv += ["--tokenizer-name-or-path", BUNDLED_TOKENIZER_PATH, "--data-cache-path", cache, *SCHEDULE]
    code, out, _ = run_command(prepare_cache.main, capsys, "--data-path", *blend, *argv)
    assert code == 0 and any(path.suffix == ".npy" for path in cache.iterdir())

    sizes = [80, 24, 8]
    config = IndexedDataConfig(**SETTINGS, data_cache_path=str(cache))
    logs.clear()  # what training logs, not the command
    trained = build_indexed_text_dataset(blend, config, sizes, tokenizer)
    assert building_messages(logs) == []  # every index came from the prepared cache
    expected = build_indexed_text_dataset(
        ["30", local[0], "70", local[1]], IndexedDataConfig(**SETTINGS), sizes, tokenizer
    )
    for split, reference in zip(trained, expected, strict=True):
        assert_samples_equal(split, reference)


def test_prepare_cache_names_a_missing_url_prefix(pairs, capsys, tmp_path):
    missing = pairs[1][0] + "_absent"
    argv = ["--data-path", missing, "--split", "1,0,0", "--seq-length", "32", "--data-cache-path", tmp_path]
    code, _, err = run_command(
        prepare_cache.main, capsys, *argv, "--tokenizer-name-or-path", BUNDLED_TOKENIZER_PATH, *SCHEDULE
    )
    assert code == 2 and f"{missing}.bin does not exist" in err
