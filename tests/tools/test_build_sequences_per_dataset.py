"""Specification of ``build_sequences_per_dataset``: the header counts file, and training with it."""

from __future__ import annotations

import json
import mmap
import struct
import subprocess
import sys

import numpy as np
import pytest
from indexed.test_index_cache import assert_same_datasets, write_corpus

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset
from hyper_parallel.data.tools.build_sequences_per_dataset import collect_prefixes, main

SETTINGS = {"seq_length": 32, "split": "90, 8, 2"}
NUM_SAMPLES = [200, 30, 10]


@pytest.fixture
def multi_sequence_corpus(tmp_path) -> tuple[str, int, int]:
    """A pair whose documents hold 0 to 3 sequences (so sequences != documents); returns (prefix, S, D + 1)."""
    rng = np.random.default_rng(5)
    prefix = tmp_path / "sentences_text_sentence"
    sequences = 0
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32) as builder:
        for _ in range(40):
            lengths = rng.integers(1, 50, size=rng.integers(0, 4))
            builder.add_document(rng.integers(2, 8192, size=int(lengths.sum())), lengths)
            sequences += len(lengths)
        builder.finalize(f"{prefix}.idx")
    return str(prefix), sequences, 41


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_file_holds_each_prefix_header_counts_in_order(tmp_path, multi_sequence_corpus, capsys):
    """Keys are the unique prefixes in order of appearance, weights skipped; values the raw header counts."""
    sentences, sentence_count, document_count = multi_sequence_corpus
    a = write_corpus(tmp_path / "a_text_document", num_documents=30, seed=1)
    b = write_corpus(tmp_path / "b_text_document", num_documents=50, seed=2, empty_tail=3)
    out = tmp_path / "sequences.json"

    code, stdout, err = _run(
        capsys,
        *["--data-path", "30", b, "70", a, "--train-data-path", a, "--valid-data-path", sentences],
        *["--per-dataset-sequences-path", out],
    )

    assert code == 0, err
    written = json.loads(out.read_text(encoding="utf-8"))
    assert list(written) == [b, a, sentences]
    assert written == {b: [53, 54], a: [30, 31], sentences: [sentence_count, document_count]}
    assert stdout == f"wrote {out}: 3 prefixes, {53 + 30 + sentence_count} sequences, {53 + 30 + 40} documents\n"
    assert sorted(p.name for p in tmp_path.glob("sequences.json*")) == ["sequences.json"]


def test_directories_expand_as_training_expands_them(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    prefixes = [write_corpus(shards / f"shard_{i}", num_documents=5, seed=i) for i in (1, 0)]

    assert collect_prefixes([str(shards)]) == sorted(prefixes)
    assert collect_prefixes([None, [], [str(shards)], ["2", prefixes[0]]]) == sorted(prefixes)
    with pytest.raises(DataConfigError, match="no dataset prefixes were given"):
        collect_prefixes([None, []])


def test_reads_only_the_header(tmp_path, monkeypatch):
    """Only the 34 header bytes are read and compared with the file size: nothing is memory-mapped."""
    prefix = write_corpus(tmp_path / "corpus", num_documents=10)
    monkeypatch.setattr(np, "memmap", None)  # any attempt to map the index fails
    monkeypatch.setattr(mmap, "mmap", None)
    out = tmp_path / "sequences.json"

    assert main(["--data-path", prefix, "--per-dataset-sequences-path", str(out)]) == 0
    assert json.loads(out.read_text(encoding="utf-8")) == {prefix: [10, 11]}


@pytest.mark.parametrize("damage", ["truncated", "count-10**18"])
def test_counts_the_index_cannot_hold_exit_2_naming_it(tmp_path, capsys, damage):
    """A truncated index, or a header claiming 10**18 sequences, is refused naming the file; no file is written."""
    prefix = write_corpus(tmp_path / "corpus", num_documents=10)
    with open(f"{prefix}.idx", "r+b") as f:
        if damage == "truncated":
            f.truncate(40)
        else:
            f.seek(18)
            f.write(struct.pack("<Q", 10**18))
    out = tmp_path / "sequences.json"

    code, stdout, err = _run(capsys, "--data-path", prefix, "--per-dataset-sequences-path", out)

    assert code == 2 and stdout == ""
    assert err.startswith(f"error: {prefix}.idx: the index is truncated or its header is corrupt"), err
    assert list(tmp_path.glob("sequences.json*")) == []


def test_training_with_the_file_builds_the_same_datasets(tmp_path, tokenizer):
    """A blend built with per_dataset_sequences_path equals the same blend built from the headers."""
    a = write_corpus(tmp_path / "a_text_document", num_documents=250, seed=1)
    b = write_corpus(tmp_path / "b_text_document", num_documents=400, seed=2)
    data_path = ["30", a, "70", b]
    out = tmp_path / "sequences.json"
    assert main(["--data-path", *data_path, "--per-dataset-sequences-path", str(out)]) == 0

    with_file = build_indexed_text_dataset(
        data_path,
        {**SETTINGS, "data_cache_path": str(tmp_path / "c1"), "per_dataset_sequences_path": str(out)},
        NUM_SAMPLES,
        tokenizer,
    )
    without = build_indexed_text_dataset(
        data_path, {**SETTINGS, "data_cache_path": str(tmp_path / "c2")}, NUM_SAMPLES, tokenizer
    )
    for got, want in zip(with_file, without, strict=True):
        assert_same_datasets(got, want)


def test_prefix_missing_from_the_file_is_a_config_error(tmp_path, tokenizer):
    a = write_corpus(tmp_path / "a_text_document", num_documents=50, seed=1)
    b = write_corpus(tmp_path / "b_text_document", num_documents=50, seed=2)
    out = tmp_path / "sequences.json"
    assert main(["--data-path", a, "--per-dataset-sequences-path", str(out)]) == 0

    config = {**SETTINGS, "data_cache_path": str(tmp_path / "cache"), "per_dataset_sequences_path": str(out)}
    with pytest.raises(DataConfigError, match=f"prefix '{b}' is missing from per_dataset_sequences_path {out}"):
        build_indexed_text_dataset([a, b], config, NUM_SAMPLES, tokenizer)


def _rewrite_sequences_file(path, prefix: str, counts: list[int]) -> None:
    written = json.loads(path.read_text(encoding="utf-8"))
    written[prefix] = counts
    path.write_text(json.dumps(written), encoding="utf-8")


def _read_train(splits) -> None:
    """With ``data_lazy_load`` nothing is opened before use: read every train sample."""
    splits[0].__getitems__(list(range(len(splits[0]))))


STALE = {
    # name: (how the file or the data changes after the file was written, listed and actual [sequences, documents])
    "more-documents": (lambda out, a: write_corpus(a, num_documents=70, seed=1), [50, 51], [70, 71]),
    "fewer-documents": (lambda out, a: write_corpus(a, num_documents=40, seed=1), [50, 51], [40, 41]),
    "document-count-edited": (lambda out, a: _rewrite_sequences_file(out, a, [50, 52]), [50, 52], [50, 51]),
    "count-10**18-edited": (lambda out, a: _rewrite_sequences_file(out, a, [10**18, 51]), [10**18, 51], [50, 51]),
}


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("name", list(STALE))
def test_counts_that_disagree_with_the_data_are_an_error(tmp_path, tokenizer, name, lazy):
    """Splits are cut from the file's counts; when they are not the header's, opening the prefix raises naming it,
    both counts and the fix, before any split is sized from them (never a silent loss or a huge allocation)."""
    change, listed, actual = STALE[name]
    a = write_corpus(tmp_path / "a_text_document", num_documents=50, seed=1)
    b = write_corpus(tmp_path / "b_text_document", num_documents=50, seed=2)
    out = tmp_path / "sequences.json"
    assert main(["--data-path", a, b, "--per-dataset-sequences-path", str(out)]) == 0
    change(out, a)

    config = {**SETTINGS, "data_cache_path": str(tmp_path / "cache"), "per_dataset_sequences_path": str(out)}
    with pytest.raises(DataFileError) as error:
        splits = build_indexed_text_dataset(
            ["30", a, "70", b], {**config, "data_lazy_load": lazy}, NUM_SAMPLES, tokenizer
        )
        _read_train(splits)
    message = str(error.value)
    assert (
        f"per_dataset_sequences_path {out} lists '{a}' with {listed[0]} sequences and {listed[1] - 1} documents"
        in message
    )
    assert f"but {a}.idx holds {actual[0]} sequences and {actual[1] - 1} documents" in message
    assert "Rerun `python -m hyper_parallel.data.tools.build_sequences_per_dataset`" in message


def test_missing_idx_exits_2_naming_the_prefix(tmp_path, capsys):
    a = write_corpus(tmp_path / "a_text_document", num_documents=5)
    missing = str(tmp_path / "missing_text_document")
    out = tmp_path / "sequences.json"

    code, stdout, err = _run(capsys, "--data-path", a, missing, "--per-dataset-sequences-path", out)

    assert code == 2 and stdout == ""
    assert err.startswith(f"error: indexed dataset '{missing}': missing {missing}.idx")
    assert list(tmp_path.glob("sequences.json*")) == []


def test_missing_output_directory_and_no_prefix_exit_2(tmp_path, capsys):
    a = write_corpus(tmp_path / "a_text_document", num_documents=5)

    code, _, err = _run(capsys, "--data-path", a, "--per-dataset-sequences-path", tmp_path / "no" / "out.json")
    assert code == 2 and f"directory {tmp_path / 'no'} does not exist" in err

    code, _, err = _run(capsys, "--per-dataset-sequences-path", tmp_path / "out.json")
    assert code == 2 and "no dataset prefixes were given" in err


def test_help_and_module_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.data.tools.build_sequences_per_dataset", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "--per-dataset-sequences-path" in result.stdout and "examples:" in result.stdout
