"""Specification of offline preparation: raw text files in, Megatron-compatible ``.bin``/``.idx`` pairs out."""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MegatronBuilder
from tokenizers import Tokenizer, models, pre_tokenizers
from tokenizers.processors import TemplateProcessing

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader, data_file_paths
from hyper_parallel.data.indexed.pair_metadata import partition_prefixes
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.tools.offline_config import MAX_PARTITIONS, TOKEN_DTYPES, OfflinePreparationConfig
from hyper_parallel.data.tools.offline_preparation import (
    PreparationSummary,
    main,
    run_offline_preparation,
)

EOS = 0  # <|endoftext|> of the bundled tokenizer
IM_START = 2  # <|im_start|> of the bundled tokenizer, used as a BOS token below
_SOURCE_TEXT = (
    "The family of Dashwood had long been settled in Sussex. Their estate was large, and their residence "
    'was at Norland Park, in the centre of their property; "Marianne" said: it\'s naïve — café, 1811, 日本語!'
)
_WORDS = _SOURCE_TEXT.split()
PAIR_FILES = ("bin", "idx", "meta.json")  # what preparation publishes per pair


# -- shared helpers ----------------------------------------------------------------------------------------------


def make_records(count: int, seed: int) -> list[dict]:
    """Records with a ``text`` of 1-30 random words and a ``title``, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [
        {"text": " ".join(rng.choices(_WORDS, k=rng.randint(1, 30))), "title": f"Chapter {i + 1}"} for i in range(count)
    ]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(lines))
    return path


def prepare(data: Path | str, output_prefix: Path, **options) -> PreparationSummary:
    """Run offline preparation with the bundled tokenizer and one worker unless told otherwise."""
    options.setdefault("workers", 1)
    options.setdefault("tokenizer_name_or_path", str(BUNDLED_TOKENIZER_PATH))
    config = OfflinePreparationConfig(dataset_name_or_path=str(data), output_prefix=str(output_prefix), **options)
    return run_offline_preparation(config)


def read_documents(prefix: str | Path) -> list[list[int]]:
    """Every document of a verified pair, as the concatenation of its sequences."""
    reader = IndexedDataReader(prefix)
    reader.verify()
    bounds = reader.document_indices
    return [[int(t) for i in range(bounds[d], bounds[d + 1]) for t in reader[i]] for d in range(reader.num_documents)]


def read_sequences(prefix: str | Path) -> list[list[int]]:
    reader = IndexedDataReader(prefix)
    reader.verify()
    return [reader[i].tolist() for i in range(len(reader))]


def pair_bytes(prefix: str | Path) -> tuple[bytes, bytes]:
    idx_path, bin_path = data_file_paths(prefix)
    return idx_path.read_bytes(), bin_path.read_bytes()


def encode_documents(tokenizer, texts: list[str], append_eod: bool = True) -> list[list[int]]:
    return [tokenizer.encode(text, add_special_tokens=True) + ([EOS] if append_eod else []) for text in texts]


def leftover_files(directory: Path) -> list[str]:
    """Temporary files a writer left behind."""
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def partition_indices(count: int, partitions: int, sequential: bool) -> list[list[int]]:
    """Record indices of each partition: round-robin, or contiguous blocks of ceil(count / partitions)."""
    if sequential:
        block = -(-count // partitions)
        return [list(range(p * block, min(count, (p + 1) * block))) for p in range(partitions)]
    return [list(range(p, count, partitions)) for p in range(partitions)]


def pack(tokens: list[int], seq_len: int) -> tuple[list[list[int]], int]:
    """Records of ``seq_len + 1`` tokens cut from ``tokens``, and the number of tail tokens dropped."""
    size = seq_len + 1
    full = len(tokens) // size
    return [tokens[i * size : (i + 1) * size] for i in range(full)], len(tokens) - full * size


@pytest.fixture(scope="module")
def bos_tokenizer_dir(tmp_path_factory) -> Path:
    """The bundled tokenizer with a post-processor that prepends ``<|im_start|>`` as a BOS token."""
    directory = tmp_path_factory.mktemp("bos_tokenizer")
    shutil.copytree(BUNDLED_TOKENIZER_PATH, directory, dirs_exist_ok=True)
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", IM_START)])
    backend.save(str(directory / "tokenizer.json"))
    return directory


# -- correctness -------------------------------------------------------------------------------------------------


def test_documents_equal_tokenizer_output_in_record_order(tmp_path, tokenizer):
    """Each record becomes one single-sequence document, encode(text) + EOS, in record order, one aligned pair
    per json key; the bundled 8192-token vocabulary is stored as uint16."""
    records = make_records(13, seed=1)
    summary = prepare(
        write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out", json_keys=("text", "title"), chunk_size=3
    )

    assert summary.outputs == {key: str(tmp_path / f"out_{key}_document") for key in ("text", "title")}
    for key in ("text", "title"):
        expected = encode_documents(tokenizer, [r[key] for r in records])
        assert read_documents(summary.outputs[key]) == expected
        reader = IndexedDataReader(summary.outputs[key])
        assert reader.dtype == np.uint16
        assert reader.document_indices.tolist() == list(range(len(records) + 1))
        assert reader.sequence_lengths.tolist() == [len(doc) for doc in expected]
    assert (summary.records, summary.documents, summary.sequences) == (13, 26, 26)
    assert summary.tokens == sum(len(doc) for key in ("text", "title") for doc in read_documents(summary.outputs[key]))
    assert summary.token_dtype == "uint16" and summary.empty_documents == summary.bad_records == 0


def test_parallel_workers_keep_record_order(tmp_path, tokenizer):
    """With two workers and many small chunks, documents still come out in record order."""
    records = make_records(40, seed=2)
    summary = prepare(write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out", workers=2, chunk_size=2)
    assert read_documents(summary.outputs["text"]) == encode_documents(tokenizer, [r["text"] for r in records])


def test_text_template_tokenizes_the_rendered_text(tmp_path, tokenizer):
    """``text_template`` renders each record with ``str.format`` and tokenizes the result; the key names the output."""
    records = make_records(5, seed=3)
    summary = prepare(write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out", text_template="{title}\n\n{text}")
    rendered = [f"{r['title']}\n\n{r['text']}" for r in records]
    assert read_documents(tmp_path / "out_text_document") == encode_documents(tokenizer, rendered)
    assert list(summary.outputs) == ["text"]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_add_special_tokens_controls_the_tokenizer_bos(tmp_path, bos_tokenizer_dir, add_special_tokens):
    """``add_special_tokens`` lets the tokenizer's post-processor add its BOS, exactly as ``encode`` does."""
    records = make_records(4, seed=4)
    summary = prepare(
        write_jsonl(tmp_path / "in.jsonl", records),
        tmp_path / "out",
        tokenizer_name_or_path=str(bos_tokenizer_dir),
        add_special_tokens=add_special_tokens,
    )
    backend = Tokenizer.from_file(str(bos_tokenizer_dir / "tokenizer.json"))
    expected = [backend.encode(r["text"], add_special_tokens=add_special_tokens).ids + [EOS] for r in records]
    documents = read_documents(summary.outputs["text"])
    assert documents == expected
    assert all((doc[0] == IM_START) == add_special_tokens for doc in documents)


def test_append_eod_false_writes_bare_tokens(tmp_path, tokenizer):
    """Without ``append_eod`` documents are exactly the tokenizer output, with no EOS."""
    records = make_records(6, seed=5)
    summary = prepare(write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out", append_eod=False)
    expected = encode_documents(tokenizer, [r["text"] for r in records], append_eod=False)
    assert read_documents(summary.outputs["text"]) == expected
    assert summary.tokens == sum(map(len, expected))


def test_list_values_become_multi_sequence_documents(tmp_path, tokenizer):
    """A list of strings is one document with one sequence per non-empty string, EOS only after the last one."""
    records = [
        {"text": ["First sentence.", "Second one,", "and a third."]},
        {"text": "A plain string."},
        {"text": ["", "Only this one counts.", ""]},
        {"text": ["Two", "parts."]},
    ]
    summary = prepare(write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out")

    expected_sequences = []
    expected_bounds = [0]
    for record in records:
        strings = [s for s in ([record["text"]] if isinstance(record["text"], str) else record["text"]) if s]
        sequences = [tokenizer.encode(s, add_special_tokens=True) for s in strings]
        sequences[-1] = sequences[-1] + [EOS]
        expected_sequences += sequences
        expected_bounds.append(len(expected_sequences))
    reader = IndexedDataReader(summary.outputs["text"])
    assert read_sequences(summary.outputs["text"]) == expected_sequences
    assert reader.document_indices.tolist() == expected_bounds == [0, 3, 4, 5, 7]
    assert reader.sequence_lengths.tolist() == [len(s) for s in expected_sequences]
    assert (summary.documents, summary.sequences, summary.empty_documents) == (4, 7, 0)


def test_empty_documents_are_skipped_and_counted(tmp_path, tokenizer):
    """Records whose text is empty ("" , null, [] or only empty strings) write no document and are counted."""
    records = [
        {"text": "Kept one."},
        {"text": ""},
        {"text": None},
        {"text": "Kept two."},
        {"text": []},
        {"text": ["", ""]},
        {"text": "Kept three."},
    ]
    summary = prepare(write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out")
    assert read_documents(summary.outputs["text"]) == encode_documents(
        tokenizer, ["Kept one.", "Kept two.", "Kept three."]
    )
    assert (summary.records, summary.documents, summary.empty_documents) == (7, 3, 4)


def test_token_dtype_override(tmp_path, tokenizer):
    """``token_dtype="int32"`` stores the same ids as int32; missing output directories are created."""
    records = make_records(3, seed=6)
    output_prefix = tmp_path / "new" / "dir" / "out"
    summary = prepare(write_jsonl(tmp_path / "in.jsonl", records), output_prefix, token_dtype="int32")
    assert summary.outputs["text"] == f"{output_prefix}_text_document"
    assert IndexedDataReader(summary.outputs["text"]).dtype == np.int32
    assert summary.token_dtype == "int32"
    assert read_documents(summary.outputs["text"]) == encode_documents(tokenizer, [r["text"] for r in records])


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_token_dtype_that_cannot_hold_the_vocabulary_is_a_config_error(tmp_path, dtype):
    """A dtype that cannot hold every id of the 8192-token vocabulary is refused before anything is written."""
    data = write_jsonl(tmp_path / "in.jsonl", make_records(2, seed=7))
    with pytest.raises(DataConfigError, match=rf"token dtype {dtype} cannot hold the 8192 token ids.*--dtype"):
        prepare(data, tmp_path / "out", token_dtype=dtype)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize("dtype", ["bogus", "float32"])
def test_token_dtype_that_is_not_an_integer_type_is_the_normal_error(tmp_path, capsys, restore_package_logger, dtype):
    """``--dtype bogus`` and ``--dtype float32`` exit with 2 and one line saying that the dtype must be an integer
    type, listing the valid ones; no traceback, no file."""
    data = write_jsonl(tmp_path / "in.jsonl", make_records(2, seed=7))
    argv = ["--dataset-name-or-path", str(data), "--output-prefix", str(tmp_path / "out"), "--dtype", dtype]
    assert main([*argv, "--tokenizer-name-or-path", str(BUNDLED_TOKENIZER_PATH), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"error: token_dtype must be an integer type that .idx files store, one of {', '.join(TOKEN_DTYPES)}" in err
    assert f"got '{dtype}'" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


# -- input formats -----------------------------------------------------------------------------------------------

FORMAT_RECORDS = make_records(9, seed=8) + [
    {"text": "Commas, \"double quotes\", 'single' and a trailing space ", "title": "Quoting"},
    {"text": "  leading spaces and unicode: naïve café 日本語 — ok", "title": "Unicode"},
]


def _write_csv(path: Path, records: list[dict], opener=open) -> None:
    with opener(path, "wt", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


def _write_hf_arrow(path: Path, records: list[dict]) -> None:
    import datasets

    saved = path.parent / "saved_dataset"
    datasets.Dataset.from_list(records).save_to_disk(str(saved))
    shutil.copy(next(saved.glob("*.arrow")), path)


def _write_arrow_file(path: Path, records: list[dict]) -> None:
    table = pa.Table.from_pylist(records)
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)


def _write_text(path: Path, records: list[dict], opener=open) -> None:
    with opener(path, "wt", encoding="utf-8", newline="") as f:
        f.writelines(r["text"] + "\n" for r in records)


FORMAT_WRITERS = {
    "in.jsonl.gz": lambda p, r: p.write_bytes(gzip.compress("".join(json.dumps(x) + "\n" for x in r).encode())),
    "in.json": lambda p, r: p.write_text(json.dumps(r, indent=2, ensure_ascii=False), encoding="utf-8"),
    "lines.json": lambda p, r: write_jsonl(p, r),
    "in.parquet": lambda p, r: pq.write_table(pa.Table.from_pylist(r), p, row_group_size=4),
    "in.csv": _write_csv,
    "in.csv.gz": lambda p, r: _write_csv(p, r, gzip.open),
    "in.arrow": _write_hf_arrow,
    "ipc_file.arrow": _write_arrow_file,
    "in.txt": _write_text,
    "in.txt.gz": lambda p, r: _write_text(p, r, gzip.open),
}


@pytest.fixture(scope="module")
def jsonl_reference(tmp_path_factory) -> tuple[bytes, bytes]:
    """The output pair of ``FORMAT_RECORDS`` written as JSONL."""
    directory = tmp_path_factory.mktemp("jsonl_reference")
    summary = prepare(write_jsonl(directory / "in.jsonl", FORMAT_RECORDS), directory / "out", chunk_size=4)
    return pair_bytes(summary.outputs["text"])


@pytest.mark.parametrize("file_name", list(FORMAT_WRITERS))
def test_every_input_format_gives_the_jsonl_output(tmp_path, tokenizer, jsonl_reference, file_name):
    """The same records as .jsonl.gz, .json (array or lines), .parquet, .csv(.gz), .arrow (stream or file) and
    .txt(.gz) give byte-identical outputs to .jsonl."""
    data = tmp_path / file_name
    FORMAT_WRITERS[file_name](data, FORMAT_RECORDS)
    summary = prepare(data, tmp_path / "out", chunk_size=4)
    assert read_documents(summary.outputs["text"]) == encode_documents(tokenizer, [r["text"] for r in FORMAT_RECORDS])
    assert pair_bytes(summary.outputs["text"]) == jsonl_reference
    assert summary.records == len(FORMAT_RECORDS)


@pytest.mark.parametrize("spec", ["directory", "glob"])
def test_directory_and_glob_read_files_in_sorted_order(tmp_path, tokenizer, spec):
    """A directory (non-recursive, hidden and unsupported files ignored) or a glob reads its files sorted by path."""
    data = tmp_path / "data"
    data.mkdir()
    parts = {name: make_records(3, seed=10 + i) for i, name in enumerate(["part-b.jsonl", "part-a.jsonl", "part-c"])}
    write_jsonl(data / "part-b.jsonl", parts["part-b.jsonl"])
    write_jsonl(data / "part-a.jsonl", parts["part-a.jsonl"])
    (data / "part-c.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(r) + "\n" for r in parts["part-c"]).encode())
    )
    write_jsonl(data / ".hidden.jsonl", make_records(2, seed=20))
    (data / "README.md").write_text("not data")
    (data / "nested").mkdir()
    write_jsonl(data / "nested" / "deeper.jsonl", make_records(2, seed=21))

    summary = prepare(data if spec == "directory" else f"{data}/part-*.jsonl*", tmp_path / "out")
    expected = [r["text"] for name in ("part-a.jsonl", "part-b.jsonl", "part-c") for r in parts[name]]
    assert read_documents(summary.outputs["text"]) == encode_documents(tokenizer, expected)


def _mixed_directory(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "data" / "a.jsonl", make_records(1, seed=0))
    pq.write_table(pa.Table.from_pylist(make_records(1, seed=0)), tmp_path / "data" / "b.parquet")
    return tmp_path / "data"


def _saved_dataset(tmp_path: Path) -> Path:
    import datasets

    datasets.Dataset.from_list(make_records(2, seed=0)).save_to_disk(str(tmp_path / "data"))
    return tmp_path / "data"


def _unsupported_file(tmp_path: Path) -> Path:
    path = tmp_path / "data" / "in.xml"
    path.write_text("<text>hello</text>")
    return path


def _compressed_parquet(tmp_path: Path) -> Path:
    path = tmp_path / "data" / "in.parquet.gz"
    path.write_bytes(gzip.compress(b"not really parquet"))
    return path


def _empty_directory(tmp_path: Path) -> Path:
    (tmp_path / "data" / "notes.md").write_text("no data here")
    return tmp_path / "data"


@pytest.mark.parametrize(
    ("make_input", "message"),
    [
        (_mixed_directory, r"mixes formats \['json', 'parquet'\]; process one format per run"),
        (lambda tmp: f"{tmp}/data/*.jsonl", r"the pattern '.*\*\.jsonl' matches no files"),
        (lambda tmp: tmp / "data" / "missing.jsonl", r"no such file or directory: .*missing\.jsonl"),
        (_unsupported_file, r"unsupported file type: .*in\.xml; supported: .*\.jsonl"),
        (_compressed_parquet, r"unsupported file type: .*in\.parquet\.gz"),
        (_empty_directory, r"holds no data files; supported"),
        (_saved_dataset, r"saved with save_to_disk; convert it with .*huggingface_offline"),
    ],
    ids=["mixed-formats", "glob-no-match", "missing-path", "unsupported-extension", "gz-parquet", "empty-dir", "hf"],
)
def test_unusable_inputs_are_data_file_errors(tmp_path, make_input, message):
    """Inputs that cannot be read raise a DataFileError that says why and what to do; no output is created."""
    (tmp_path / "data").mkdir()
    data = make_input(tmp_path)
    with pytest.raises(DataFileError, match=message):
        prepare(data, tmp_path / "out")
    assert not list(tmp_path.glob("out*"))


# -- packing -----------------------------------------------------------------------------------------------------


def test_packing_cuts_fixed_records_and_drops_the_tail(tmp_path, tokenizer):
    """With ``pack_to_seq_len=N`` every record is N + 1 tokens cut from the concatenated documents (EOD included),
    carried over across chunks, and the tail shorter than N + 1 is dropped and reported."""
    seq_len = 15
    records = make_records(15, seed=30)
    summary = prepare(
        write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out", pack_to_seq_len=seq_len, chunk_size=2, workers=2
    )
    stream = [t for doc in encode_documents(tokenizer, [r["text"] for r in records]) for t in doc]
    expected, tail = pack(stream, seq_len)
    assert len(expected) > 5 and tail > 0

    reader = IndexedDataReader(summary.outputs["text"])
    assert set(reader.sequence_lengths.tolist()) == {seq_len + 1}
    assert reader.document_indices.tolist() == list(range(len(expected) + 1))
    assert read_sequences(summary.outputs["text"]) == expected
    assert summary.dropped_tail_tokens == tail == len(stream) % (seq_len + 1)
    assert (summary.documents, summary.sequences, summary.tokens) == (
        len(expected),
        len(expected),
        len(expected) * (seq_len + 1),
    )
    assert summary.packed_to == seq_len


@pytest.mark.parametrize("sequential", [False, True], ids=["round-robin", "sequential"])
def test_partitions_pack_on_their_own(tmp_path, tokenizer, sequential):
    """Each partition packs its own records (round-robin, or contiguous blocks with ``keep_sequential_samples``)
    and drops its own tail; the output holds partition 0's records, then partition 1's, and so on."""
    seq_len, partitions = 12, 3
    records = make_records(17, seed=31)
    summary = prepare(
        write_jsonl(tmp_path / "in.jsonl", records),
        tmp_path / "out",
        pack_to_seq_len=seq_len,
        partitions=partitions,
        keep_sequential_samples=sequential,
        chunk_size=4,
        workers=2,
    )
    documents = encode_documents(tokenizer, [r["text"] for r in records])
    expected, dropped = [], 0
    for indices in partition_indices(len(records), partitions, sequential):
        packed, tail = pack([t for i in indices for t in documents[i]], seq_len)
        expected += packed
        dropped += tail
    assert read_sequences(summary.outputs["text"]) == expected
    assert summary.dropped_tail_tokens == dropped
    assert summary.documents == len(expected)


def test_packing_without_eod_warns(tmp_path, tokenizer, caplog):
    """Packing with ``append_eod=False`` works but warns that document boundaries are lost."""
    caplog.set_level(logging.WARNING, logger="hyper_parallel.data")
    records = make_records(8, seed=32)
    summary = prepare(
        write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out", pack_to_seq_len=9, append_eod=False
    )
    stream = [t for doc in encode_documents(tokenizer, [r["text"] for r in records], append_eod=False) for t in doc]
    assert read_sequences(summary.outputs["text"]) == pack(stream, 9)[0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("without --append-eod" in r.getMessage() for r in warnings)
    assert all(r.name.startswith("hyper_parallel.data") for r in warnings)


# -- partitions without packing ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sequential", "keep_partition_files"), [(False, True), (True, False)], ids=["round-robin-kept", "sequential"]
)
def test_partitions_are_merged_in_partition_order(tmp_path, tokenizer, sequential, keep_partition_files):
    """Partition outputs are merged in partition order; the partition pairs are deleted unless kept."""
    partitions = 2
    records = make_records(11, seed=33)
    summary = prepare(
        write_jsonl(tmp_path / "in.jsonl", records),
        tmp_path / "out",
        partitions=partitions,
        keep_sequential_samples=sequential,
        keep_partition_files=keep_partition_files,
        chunk_size=3,
        workers=2,
    )
    documents = encode_documents(tokenizer, [r["text"] for r in records])
    groups = partition_indices(len(records), partitions, sequential)
    assert read_documents(summary.outputs["text"]) == [documents[i] for group in groups for i in group]
    assert summary.documents == len(records)

    for p, group in enumerate(groups):
        prefix = tmp_path / f"out_{p}_text_document"
        if keep_partition_files:
            assert read_documents(prefix) == [documents[i] for i in group]
        else:
            assert not any(path.exists() for path in data_file_paths(prefix))
    kept = [f"out_{p}_text_document.{ext}" for p in range(partitions) for ext in PAIR_FILES if keep_partition_files]
    manifest = ["out_text_document.partitions.json"] if keep_partition_files else []
    assert sorted(p.name for p in tmp_path.glob("out*")) == sorted(
        [f"out_text_document.{ext}" for ext in PAIR_FILES] + kept + manifest
    )
    if keep_partition_files:
        assert partition_prefixes(summary.outputs["text"]) == [str(tmp_path / f"out_{p}_text_document") for p in (0, 1)]
    assert leftover_files(tmp_path) == []


# -- bad input ---------------------------------------------------------------------------------------------------

GOOD_LINE = b'{"text": "It is a truth universally acknowledged.", "title": "One"}\n'
# Failing runs below put the bad record in the last chunk: a run stopped while later chunks are still being encoded
# can hang in multiprocessing's Pool.terminate() (a worker killed while writing its result keeps the queue lock).
# name -> (bad line, extra options, fragments the message must contain besides the file, the line and the fix)
BAD_RECORDS = {
    "malformed-json": (b'{"text": "unterminated\n', {}, ["invalid JSON"]),
    "non-utf8": (b'{"text": "caf\xe9"}\n', {}, ["byte 13 is not valid UTF-8", "\\xe9", "re-encode the file as UTF-8"]),
    "missing-key": (b'{"body": "x", "title": "t"}\n', {}, ["missing key 'text'", "['body', 'title']", "--json-keys"]),
    "number": (b'{"text": 42}\n', {}, ["key 'text' holds int, expected a string or a list of strings"]),
    "list-of-numbers": (b'{"text": ["a", 3]}\n', {}, ["key 'text' holds list"]),
    "array-line": (b'["not", "an", "object"]\n', {}, ["expected a JSON object, got list"]),
    "template-field": (
        b'{"text": "no title here"}\n',
        {"text_template": "{title}\n\n{text}"},
        ["missing key 'title' used by --text-template", "['text']"],
    ),
    "template-item": (
        b'{"text": [], "title": "t"}\n',
        {"text_template": "{title}: {text[0]}"},
        ["--text-template cannot render the record (IndexError: list index out of range)", "['text', 'title']"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_bad_record_stops_the_run_naming_file_line_field_and_fix(tmp_path, case):
    """A malformed record raises a DataFileError naming the file, its line (blank lines counted), what is wrong
    and how to fix it; no output and no temporary file is left, although earlier chunks were already written."""
    bad_line, options, fragments = BAD_RECORDS[case]
    data = write_lines(tmp_path / "in.jsonl", [GOOD_LINE] * 5 + [b"\n", b"   \n", bad_line])
    with pytest.raises(DataFileError) as error:
        prepare(data, tmp_path / "out", chunk_size=2, **options)
    message = str(error.value)
    assert message.startswith(f"{data}:line 8: ")
    assert "fix the record, or pass --skip-bad-records" in message
    for fragment in fragments:
        assert fragment in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_skip_bad_records_writes_every_good_record(tmp_path, tokenizer, caplog):
    """With ``skip_bad_records`` malformed records are logged, counted and skipped, empty ones counted, and every
    good record is written in order."""
    caplog.set_level(logging.WARNING, logger="hyper_parallel.data")
    good = make_records(4, seed=40)
    lines = [
        json.dumps(good[0]).encode() + b"\n",
        b"{broken\n",
        json.dumps(good[1]).encode() + b"\n",
        b'{"text": ""}\n',
        b'{"text": 5}\n',
        json.dumps(good[2]).encode() + b"\n",
        b'{"text": null}\n',
        b"[1]\n",
        json.dumps(good[3]).encode() + b"\n",
    ]
    data = write_lines(tmp_path / "in.jsonl", lines)
    summary = prepare(data, tmp_path / "out", skip_bad_records=True, chunk_size=2, workers=2)
    assert read_documents(summary.outputs["text"]) == encode_documents(tokenizer, [r["text"] for r in good])
    assert (summary.records, summary.documents, summary.bad_records, summary.empty_documents) == (9, 4, 3, 2)
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped:")]
    assert [m.split(": ")[1] for m in skipped] == [f"{data}:line {n}" for n in (2, 5, 8)]


def test_cli_reports_bad_input_with_exit_code_2(tmp_path, capsys, restore_package_logger):
    """The command line turns a data error into ``error: ...`` on stderr and exit code 2, with no traceback."""
    data = write_lines(tmp_path / "in.jsonl", [GOOD_LINE, b"\n", b'{"text": 3.5}\n'])
    argv = ["--dataset-name-or-path", str(data), "--output-prefix", str(tmp_path / "out")]
    argv += ["--tokenizer-name-or-path", str(BUNDLED_TOKENIZER_PATH), "--workers", "1"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert f"error: {data}:line 3: key 'text' holds float" in captured.err
    assert "Traceback" not in captured.err
    assert "finished" not in captured.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_cli_flags_reach_the_run(tmp_path, tokenizer, capsys, restore_package_logger):
    """Command-line flags (keys, --append-eod false, --dtype, --chunk-size) configure the run; the summary is
    printed."""
    records = make_records(5, seed=41)
    data = write_jsonl(tmp_path / "in.jsonl", records)
    argv = ["--dataset-name-or-path", str(data), "--output-prefix", str(tmp_path / "out")]
    argv += ["--tokenizer-name-or-path", str(BUNDLED_TOKENIZER_PATH), "--workers", "1", "--chunk-size", "2"]
    argv += ["--json-keys", "text", "title", "--append-eod", "false", "--dtype", "int32"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "offline preparation finished:" in out and f"output [title]: {tmp_path / 'out_title_document'}" in out
    for key in ("text", "title"):
        prefix = tmp_path / f"out_{key}_document"
        assert IndexedDataReader(prefix).dtype == np.int32
        assert read_documents(prefix) == encode_documents(tokenizer, [r[key] for r in records], append_eod=False)


ALL_FLAGS = [
    "--dataset-name-or-path",
    "--output-prefix",
    "--tokenizer-name-or-path",
    "--json-keys",
    "--append-eod",
    "--add-special-tokens",
    "--pack-to-seq-len",
    "--text-template",
    "--workers",
    "--partitions",
    "--keep-sequential-samples",
    "--keep-partition-files",
    "--skip-bad-records",
    "--dtype",
    "--overwrite",
    "--log-interval",
    "--chunk-size",
]


def test_help_lists_every_flag(capsys):
    """``--help`` lists every option of the command, with the valid token dtypes."""
    with pytest.raises(SystemExit) as exit_code:
        main(["--help"])
    assert exit_code.value.code == 0
    out = capsys.readouterr().out
    assert [flag for flag in ALL_FLAGS if flag not in out] == []
    assert ", ".join(TOKEN_DTYPES) in " ".join(out.split())


def test_missing_tokenizer_path_is_a_config_error(tmp_path):
    """A tokenizer path that does not exist is not fetched from the Hub but reported as missing."""
    data = write_jsonl(tmp_path / "in.jsonl", make_records(1, seed=0))
    with pytest.raises(DataConfigError, match=r"no such file or directory: .*no_such_tokenizer"):
        prepare(data, tmp_path / "out", tokenizer_name_or_path=str(tmp_path / "no_such_tokenizer"))


def _write_word_level_tokenizer(path: Path) -> Path:
    vocab = {word: i for i, word in enumerate(["[UNK]", "hello", "world", "again"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(path))
    return path


def test_append_eod_needs_an_eos_token(tmp_path):
    """``append_eod`` with a tokenizer that has no EOS-like token is a config error; without EOD it runs."""
    tokenizer_file = _write_word_level_tokenizer(tmp_path / "tokenizer.json")
    data = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello world"}, {"text": "world again hello"}])
    with pytest.raises(DataConfigError, match=r"has no EOS token to append.*--append-eod false"):
        prepare(data, tmp_path / "out", tokenizer_name_or_path=str(tokenizer_file))
    assert not list(tmp_path.glob("out*"))

    summary = prepare(data, tmp_path / "out", tokenizer_name_or_path=str(tokenizer_file), append_eod=False)
    assert read_documents(summary.outputs["text"]) == [[1, 2], [2, 3, 1]]


# -- nothing lost or half-written --------------------------------------------------------------------------------


def test_failed_rerun_leaves_the_previous_output_intact(tmp_path, tokenizer):
    """A failing re-run over an existing output (partitioned, so partition files were being written) leaves the
    earlier pair byte-identical and readable, and no partition or temporary file behind."""
    records = make_records(6, seed=50)
    summary = prepare(write_jsonl(tmp_path / "good.jsonl", records), tmp_path / "out")
    before = pair_bytes(summary.outputs["text"])

    bad = write_lines(tmp_path / "bad.jsonl", [GOOD_LINE] * 6 + [b"{oops\n"])
    with pytest.raises(DataFileError, match=r"bad\.jsonl:line 7"):
        prepare(bad, tmp_path / "out", partitions=2, chunk_size=2, workers=2, overwrite=True)

    assert pair_bytes(summary.outputs["text"]) == before
    assert read_documents(summary.outputs["text"]) == encode_documents(tokenizer, [r["text"] for r in records])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.jsonl"] + [
        f"out_text_document.{ext}" for ext in PAIR_FILES
    ]


# -- configuration -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"json_keys": ()}, r"json_keys must name at least one record field"),
        ({"json_keys": ("text", "")}, r"json_keys must name at least one record field"),
        ({"json_keys": ("text", "title", "text")}, r"json_keys has duplicates"),
        (
            {"json_keys": ("title", "text"), "text_template": "{title}: {text}"},
            r"text_template .* exactly one json key",
        ),
        ({"text_template": "{title"}, r"text_template '\{title' is not a valid str.format template"),
        ({"text_template": "{0}: {1}"}, r"text_template '\{0\}: \{1\}' must read record fields by name"),
        ({"text_template": "no fields"}, r"text_template 'no fields' must read record fields by name"),
        ({"workers": 0}, r"workers must be at least 1, got 0"),
        ({"partitions": 0}, r"partitions must be at least 1, got 0"),
        ({"chunk_size": 0}, r"chunk_size must be at least 1, got 0"),
        ({"log_interval": -1}, r"log_interval must be at least 1, got -1"),
        ({"pack_to_seq_len": 0}, r"pack_to_seq_len must be a positive token count, got 0"),
        ({"partitions": MAX_PARTITIONS + 1}, rf"partitions must be at most {MAX_PARTITIONS}, got {MAX_PARTITIONS + 1}"),
        ({"token_dtype": "float64"}, r"token_dtype must be an integer type .* one of uint8, .*int64; got 'float64'"),
        ({"output_prefix": ""}, r"output_prefix must not be empty"),
    ],
)
def test_invalid_config_is_a_config_error_naming_the_field(overrides, message):
    """Each invalid option raises a DataConfigError that names it."""
    options = {"dataset_name_or_path": "in.jsonl", "output_prefix": "out", "tokenizer_name_or_path": "tok"}
    with pytest.raises(DataConfigError, match=message):
        OfflinePreparationConfig(**{**options, **overrides})


def test_config_normalises_keys_and_is_frozen():
    """A single key string becomes a one-key tuple; the config cannot be changed after validation."""
    config = OfflinePreparationConfig(
        dataset_name_or_path="in.jsonl", output_prefix="out", tokenizer_name_or_path="tok", json_keys="body"
    )
    assert config.json_keys == ("body",)
    assert config.output_prefix_for("body") == "out_body_document"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.workers = 0


# -- Megatron parity ---------------------------------------------------------------------------------------------


def test_output_is_byte_identical_to_megatron_builder(tmp_path, tokenizer, corpus_path):
    """For non-empty single-string documents with EOD, the pair equals what megatron-core's IndexedDatasetBuilder
    writes for the same documents, i.e. what Megatron's preprocess_data writes."""
    with gzip.open(corpus_path, "rt", encoding="utf-8") as f:
        chapters = [json.loads(next(f)) for _ in range(3)]
    records = [{"text": c["text"][:4000]} for c in chapters] + make_records(7, seed=60)
    summary = prepare(write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "ours", chunk_size=3, workers=2)

    megatron_prefix = tmp_path / "megatron_text_document"
    builder = MegatronBuilder(f"{megatron_prefix}.bin", dtype=np.uint16)
    for tokens in encode_documents(tokenizer, [r["text"] for r in records]):
        builder.add_document(torch.tensor(tokens), [len(tokens)])
    builder.finalize(f"{megatron_prefix}.idx")

    assert pair_bytes(summary.outputs["text"]) == pair_bytes(megatron_prefix)
