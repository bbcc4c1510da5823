"""Specification of the metadata beside prepared pairs as datasets use it: sources of one dataset must have been
prepared with one tokenizer and dtype; pairs without metadata (megatron-core's) still load, with one warning."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MegatronBuilder
from tokenizers import Tokenizer, models, pre_tokenizers
from tools.test_offline_preparation import make_records, prepare, write_jsonl

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.pair_metadata import metadata_path
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset


def settings(tmp_path: Path, **extra) -> dict:
    return {"seq_length": 8, "split": "1, 0, 0", "data_cache_path": str(tmp_path / "cache"), **extra}


def prepared(tmp_path: Path, name: str, seed: int, **options) -> str:
    """A pair prepared from 12 seeded records, with the bundled tokenizer unless told otherwise."""
    data = write_jsonl(tmp_path / f"{name}.jsonl", make_records(12, seed=seed))
    return prepare(data, tmp_path / name, **options).outputs["text"]


def megatron_pair(tmp_path: Path, name: str, seed: int) -> str:
    """A pair written by megatron-core's builder: no metadata."""
    prefix = str(tmp_path / name)
    rng = np.random.default_rng(seed)
    builder = MegatronBuilder(f"{prefix}.bin", dtype=np.uint16)
    for length in rng.integers(5, 40, size=12):
        builder.add_document(torch.tensor(rng.integers(1, 8192, size=int(length))), [int(length)])
    builder.finalize(f"{prefix}.idx")
    return prefix


def word_level_tokenizer(directory: Path) -> Path:
    """Another tokenizer: four words, no EOS."""
    vocab = {word: i for i, word in enumerate(["[UNK]", "The", "family", "of"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    path = directory / "tokenizer.json"
    backend.save(str(path))
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, str]:
    """``a`` and ``b``: the bundled tokenizer; ``other``: another tokenizer; ``wide``: the bundled one, int32."""
    directory = tmp_path_factory.mktemp("pairs")
    other_tokenizer = str(word_level_tokenizer(directory))
    return {
        "a": prepared(directory, "a", 1),
        "b": prepared(directory, "b", 2),
        "other": prepared(directory, "other", 3, tokenizer_name_or_path=other_tokenizer, append_eod=False),
        "wide": prepared(directory, "wide", 4, token_dtype="int32"),
    }


def copy_pair(prefix: str, directory: Path) -> str:
    """A copy of the pair ``prefix`` and its metadata in ``directory``."""
    copy = directory / Path(prefix).name
    for suffix in (".bin", ".idx", ".meta.json"):
        shutil.copy(f"{prefix}{suffix}", f"{copy}{suffix}")
    return str(copy)


def test_sources_prepared_alike_blend_without_warning(tmp_path, tokenizer, pairs, caplog):
    """Two sources prepared with the same tokenizer and dtype blend as before, and nothing is logged about them."""
    caplog.set_level(logging.WARNING, logger="hyper_parallel.data")
    train, _, _ = build_indexed_text_dataset([pairs["a"], pairs["b"]], settings(tmp_path), tokenizer=tokenizer)
    assert len(train) > 0
    assert not [r for r in caplog.records if "meta.json" in r.getMessage()]


@pytest.mark.parametrize("form", ["list", "weighted", "per-split"])
def test_sources_prepared_with_different_tokenizers_are_refused(tmp_path, tokenizer, pairs, form):
    """A blend (or per-split paths) mixing pairs of two tokenizers is a DataConfigError naming both prefixes and the
    field that differs, whichever way the sources are given."""
    a, other = pairs["a"], pairs["other"]
    if form == "list":
        args = ([a, other], settings(tmp_path))
    elif form == "weighted":
        args = (["0.5", a, "0.5", other], settings(tmp_path))
    else:
        args = (None, settings(tmp_path, split=None, train_data_path=[a], valid_data_path=[other]))
    with pytest.raises(DataConfigError) as error:
        build_indexed_text_dataset(*args, train_valid_test_num_samples=[20, 5, None], tokenizer=tokenizer)
    message = str(error.value)
    assert f"'{a}'" in message and f"'{other}'" in message
    assert "tokenizer_fingerprint is" in message and "same tokenizer" in message


def test_sources_with_different_token_dtypes_are_refused(tmp_path, tokenizer, pairs):
    """The same tokenizer with another token dtype is refused too, naming ``token_dtype``."""
    with pytest.raises(DataConfigError, match=r"token_dtype is 'uint16' in a_text_document\.meta\.json but 'int32'"):
        build_indexed_text_dataset([pairs["a"], pairs["wide"]], settings(tmp_path), tokenizer=tokenizer)


def test_sources_without_metadata_still_load_with_one_warning(tmp_path, tokenizer, pairs, caplog):
    """Pairs written by megatron-core have no metadata: the blend loads, and one warning says how many sources
    could not be checked and names them."""
    caplog.set_level(logging.WARNING, logger="hyper_parallel.data")
    m1, m2 = megatron_pair(tmp_path, "m1", 5), megatron_pair(tmp_path, "m2", 6)
    train, _, _ = build_indexed_text_dataset([pairs["a"], m1, m2], settings(tmp_path), tokenizer=tokenizer)
    assert len(train) > 0
    warnings = [r.getMessage() for r in caplog.records if "meta.json" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith("2 of 3 sources have no .meta.json") and f"{m1}, {m2}" in warnings[0]


def test_malformed_metadata_is_a_data_file_error_naming_it(tmp_path, tokenizer, pairs):
    """A metadata file that is not the expected JSON is a DataFileError naming it and the fix."""
    b = copy_pair(pairs["b"], tmp_path)
    metadata_path(b).write_text("{not json")
    with pytest.raises(DataFileError, match=r"b_text_document\.meta\.json: invalid JSON .*; delete it, or prepare"):
        build_indexed_text_dataset([pairs["a"], b], settings(tmp_path), tokenizer=tokenizer)


def test_a_single_source_reads_no_metadata(tmp_path, tokenizer, pairs):
    """With one source there is nothing to compare, so its metadata is not even read (start-up stays cheap)."""
    a = copy_pair(pairs["a"], tmp_path)
    metadata_path(a).write_text("{not json")
    train, _, _ = build_indexed_text_dataset(a, settings(tmp_path), tokenizer=tokenizer)
    assert len(train) > 0


def test_fast_cache_load_trusts_the_build_that_checked(tmp_path, tokenizer, pairs):
    """``fast_cache_load`` needs caches written by an ordinary build, which checked the sources; it reads no
    metadata, so that start-up with many prefixes stays cheap."""
    b = copy_pair(pairs["b"], tmp_path)
    first, _, _ = build_indexed_text_dataset([pairs["a"], b], settings(tmp_path), tokenizer=tokenizer)
    metadata_path(b).write_text("{not json")
    fast = settings(tmp_path, fast_cache_load=True)
    train, _, _ = build_indexed_text_dataset([pairs["a"], b], fast, tokenizer=tokenizer)
    assert len(train) == len(first)
    with pytest.raises(DataFileError, match="invalid JSON"):
        build_indexed_text_dataset([pairs["a"], b], settings(tmp_path), tokenizer=tokenizer)
