"""Tests of the ``read_indexed_dataset`` inspection command on real ``.idx``/``.bin`` pairs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.data.indexed import indexed_data_reader
from hyper_parallel.data.indexed.idx_format import HEADER_SIZE
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.indexed.pair_metadata import PairMetadata, metadata_path
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.tools.read_indexed_dataset import build_parser, main, summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife."
)


def _stats(values: np.ndarray) -> dict:
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"min": values.min(), "mean": values.mean(), "p50": p50, "p90": p90, "p99": p99, "max": values.max()}


def _assert_stats(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key] == pytest.approx(float(value)), key


@pytest.fixture
def dataset(tmp_path):
    """A uint16 pair of random documents of 0-4 sequences (some empty), with their known lengths."""
    rng = np.random.default_rng(1234)
    prefix = tmp_path / "corpus_text_document"
    sequence_lengths, document_tokens = [], []
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16) as builder:
        for _ in range(200):
            lengths = rng.integers(0, 400, size=rng.integers(0, 5))
            builder.add_document(rng.integers(0, 8192, size=lengths.sum()), lengths)
            sequence_lengths.extend(lengths.tolist())
            document_tokens.append(int(lengths.sum()))
        builder.finalize(f"{prefix}.idx")
    return prefix, np.array(sequence_lengths), np.array(document_tokens)


@pytest.fixture
def text_dataset(tmp_path, tokenizer):
    """Two single-sequence documents: random ids, then ``TEXT`` encoded with the bundled tokenizer."""
    prefix = tmp_path / "text_document"
    ids = tokenizer.encode(TEXT)
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16) as builder:
        builder.add_documents(np.arange(10, 30), [20])
        builder.add_document(ids, [len(ids)])
        builder.finalize(f"{prefix}.idx")
    return prefix, ids


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- summary -----------------------------------------------------------------------------------------------------


def test_summarize_matches_numpy(dataset):
    prefix, sequence_lengths, document_tokens = dataset
    summary = summarize(IndexedDataReader(prefix))

    assert summary["prefix"] == str(prefix)
    assert summary["dtype"] == "uint16"
    assert summary["sequences"] == sequence_lengths.size
    assert summary["documents"] == document_tokens.size
    assert summary["tokens"] == sequence_lengths.sum()
    assert summary["bin_bytes"] == 2 * sequence_lengths.sum()
    assert summary["empty_documents"] == np.count_nonzero(document_tokens == 0) > 0
    _assert_stats(summary["sequence_lengths"], _stats(sequence_lengths))
    _assert_stats(summary["document_lengths"], _stats(document_tokens))
    assert "mode_counts" not in summary


def test_summarize_single_sequence_documents_omits_document_lengths(tmp_path):
    prefix = tmp_path / "single"
    lengths = np.random.default_rng(7).integers(1, 100, size=50)
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32) as builder:
        builder.add_documents(np.ones(lengths.sum(), np.int32), lengths)
        builder.finalize(f"{prefix}.idx")
    summary = summarize(IndexedDataReader(prefix))
    assert summary["document_lengths"] is None
    assert summary["empty_documents"] == 0
    assert summary["sequences_per_document"]["min"] == summary["sequences_per_document"]["max"] == 1
    _assert_stats(summary["sequence_lengths"], _stats(lengths))


def test_summarize_empty_dataset(tmp_path):
    prefix = tmp_path / "empty"
    with IndexedDatasetBuilder(f"{prefix}.bin") as builder:
        builder.finalize(f"{prefix}.idx")
    summary = summarize(IndexedDataReader(prefix))
    assert (summary["sequences"], summary["documents"], summary["tokens"]) == (0, 0, 0)
    assert summary["sequence_lengths"] is None


def test_text_summary(dataset, capsys):
    prefix, sequence_lengths, document_tokens = dataset
    code, out, err = _run(capsys, prefix)
    assert code == 0 and err == ""
    assert f"sequences           {sequence_lengths.size:,}" in out
    assert f"{document_tokens.size:,} ({np.count_nonzero(document_tokens == 0):,} empty)" in out
    assert f"{sequence_lengths.sum():,}" in out
    assert "p90" in out and "document lengths" in out


def test_json_matches_summary(dataset, capsys):
    prefix, sequence_lengths, _ = dataset
    code, out, _ = _run(capsys, prefix, "--json")
    assert code == 0
    parsed = json.loads(out)
    assert parsed == summarize(IndexedDataReader(prefix))
    assert parsed["tokens"] == sequence_lengths.sum()
    _assert_stats(parsed["sequence_lengths"], _stats(sequence_lengths))


def test_multimodal_mode_counts(tmp_path, capsys):
    prefix = tmp_path / "multimodal"
    modes = np.random.default_rng(3).integers(0, 3, size=30)
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16, multimodal=True) as builder:
        builder.add_document(np.zeros(60, np.uint16), np.full(30, 2), modes=modes)
        builder.finalize(f"{prefix}.idx")
    expected = {str(m): int(np.count_nonzero(modes == m)) for m in np.unique(modes)}
    assert summarize(IndexedDataReader(prefix, multimodal=True))["mode_counts"] == expected

    code, out, _ = _run(capsys, prefix, "--multimodal", "--decode", "4")
    assert code == 0
    assert f"mode 0: {expected['0']}" in out
    assert f"sequence 4 (document 0, mode {modes[4]}): 2 tokens" in out


# -- decoding ----------------------------------------------------------------------------------------------------


def test_decode_prints_original_text(text_dataset, capsys):
    prefix, ids = text_dataset
    code, out, err = _run(capsys, prefix, "--decode", "1")
    assert code == 0 and err == ""
    assert f"sequence 1 (document 1): {len(ids)} tokens" in out
    assert f"--- text ---\n{TEXT}\n--- end ---" in out


def test_decode_list_repeat_negative_and_ids(text_dataset, capsys):
    prefix, ids = text_dataset
    code, out, _ = _run(capsys, prefix, "--decode", "0,1", "--decode=-1", "--show-ids", "--json")
    assert code == 0
    decoded = json.loads(out)["decoded"]
    assert [d["index"] for d in decoded] == [0, 1, 1]
    assert decoded[0]["ids"] == list(range(10, 30))
    assert decoded[1]["ids"] == ids and decoded[1]["text"] == TEXT
    assert not decoded[1]["truncated"]


def test_decode_truncates_with_note(text_dataset, capsys):
    prefix, _ = text_dataset
    code, out, _ = _run(capsys, prefix, "--decode", "1", "--max-chars", "10")
    assert code == 0
    assert f"--- text ---\n{TEXT[:10]}\n--- truncated: first 10 of {len(TEXT)} characters shown" in out


def test_decode_warns_about_ids_beyond_the_vocabulary(tmp_path, capsys):
    prefix = tmp_path / "wide"
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32) as builder:
        builder.add_documents(np.array([5, 100_000]), [2])
        builder.finalize(f"{prefix}.idx")
    code, out, _ = _run(capsys, prefix, "--decode", "0")
    assert code == 0
    assert "warning: ids up to 100000 exceed the vocabulary of 8192 tokens" in out


@pytest.mark.parametrize("index", ["2", "-3"])
def test_decode_out_of_range_exits_2(text_dataset, capsys, index):
    prefix, _ = text_dataset
    code, out, err = _run(capsys, prefix, f"--decode={index}")
    assert code == 2 and out == ""
    assert f"error: sequence {index} is out of range for '{prefix}', which has 2 sequences (valid: 0..1" in err
    assert "Traceback" not in err


def test_bad_decode_value_is_a_usage_error(text_dataset, capsys):
    prefix, _ = text_dataset
    with pytest.raises(SystemExit) as exit_info:
        main([str(prefix), "--decode", "one"])
    assert exit_info.value.code == 2
    assert "comma list" in capsys.readouterr().err


# -- verification ------------------------------------------------------------------------------------------------


def test_verify_ok(dataset, capsys):
    prefix, sequence_lengths, _ = dataset
    code, out, _ = _run(capsys, prefix, "--verify")
    assert code == 0
    assert f"OK: {sequence_lengths.size:,} sequences" in out


def test_verify_reports_trailing_bytes(dataset, capsys):
    prefix, sequence_lengths, _ = dataset
    with open(f"{prefix}.bin", "ab") as f:
        f.write(b"\x00" * 6)
    code, out, _ = _run(capsys, prefix, "--verify")
    assert code == 1
    assert out.startswith("FAILED:")
    assert f"the sequences hold {2 * sequence_lengths.sum()} bytes but {prefix}.bin has" in out

    code, out, _ = _run(capsys, prefix, "--verify", "--json")
    assert code == 1
    assert json.loads(out)["verify"]["ok"] is False


def test_corrupt_document_indices_exit_2(dataset, capsys):
    prefix, sequence_lengths, _ = dataset
    # Overwrite the second document index (after lengths and pointers) with one past the sequence count.
    offset = HEADER_SIZE + 12 * sequence_lengths.size + 8
    with open(f"{prefix}.idx", "r+b") as f:
        f.seek(offset)
        f.write(np.int64(sequence_lengths.size + 1).tobytes())
    code, out, err = _run(capsys, prefix)
    assert code == 2 and out == ""
    assert "document_indices" in err

    code, out, _ = _run(capsys, prefix, "--verify")
    assert code == 1 and "document_indices" in out


def _write_metadata(prefix: Path, vocab_size: int, token_dtype: str) -> None:
    metadata = PairMetadata(tokenizer_fingerprint="test", vocab_size=vocab_size, eod_id=0, token_dtype=token_dtype)
    metadata_path(prefix).write_bytes(metadata.to_json())


def _verify_checks(capsys, *argv) -> tuple[int, dict]:
    code, out, _ = _run(capsys, *argv, "--verify", "--json")
    return code, json.loads(out)["verify"]["checks"]


def test_verify_prints_one_line_per_token_check(dataset, capsys):
    """Without a .meta.json or --tokenizer, the dtype is checked and the rest is a note saying what is missing;
    --tokenizer checks every id against its vocabulary."""
    prefix, sequence_lengths, _ = dataset
    code, out, _ = _run(capsys, prefix, "--verify")
    assert code == 0
    assert "OK: the header's token dtype uint16 holds token ids" in out
    assert "note: no corpus_text_document.meta.json beside the pair: its token dtype is not cross-checked" in out
    assert "no vocabulary size is known (no corpus_text_document.meta.json, no --tokenizer)" in out

    code, out, _ = _run(capsys, prefix, "--verify", "--tokenizer", BUNDLED_TOKENIZER_PATH)
    assert code == 0
    assert f"OK: all {sequence_lengths.sum():,} token ids lie in [0, 8192) (the tokenizer's vocabulary)" in out

    _write_metadata(prefix, 8192, "uint16")
    code, checks = _verify_checks(capsys, prefix)
    assert code == 0
    assert [check["ok"] for check in checks.values()] == [True, True, True, True]
    assert "corpus_text_document.meta.json names the header's token dtype, uint16" in checks["metadata"]["message"]


@pytest.mark.parametrize(("written", "code_byte"), [(np.int32, 7), (np.int64, 6)])
def test_verify_fails_on_a_float_dtype_code(tmp_path, capsys, written, code_byte):
    prefix = tmp_path / "pair"
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=written) as builder:
        builder.add_documents(np.arange(2, 40), [10, 28])
        builder.finalize(f"{prefix}.idx")
    with open(f"{prefix}.idx", "r+b") as index:
        index.seek(17)
        index.write(bytes([code_byte]))

    code, out, _ = _run(capsys, prefix, "--verify")
    assert code == 1
    assert f"FAILED: {prefix}.idx: the header's dtype code {code_byte} (byte 17)" in out
    code, checks = _verify_checks(capsys, prefix)
    assert code == 1 and checks["index"]["ok"] is True and checks["token_dtype"]["ok"] is False


def test_verify_fails_on_a_meta_json_naming_another_dtype(dataset, capsys):
    prefix, _, _ = dataset
    _write_metadata(prefix, 8192, "int16")
    code, out, _ = _run(capsys, prefix, "--verify")
    assert code == 1
    assert f"FAILED: {prefix}.meta.json says the tokens are int16, but the header of {prefix}.idx says uint16" in out


@pytest.mark.parametrize("chunk", [7, 1 << 21], ids=["small-chunks", "one-chunk"])
def test_verify_counts_every_id_outside_the_meta_json_vocabulary(dataset, capsys, monkeypatch, chunk):
    """The scan goes chunk by chunk; the count and the first id are those of the whole .bin."""
    monkeypatch.setattr(indexed_data_reader, "_SCAN_CHUNK", chunk)
    prefix, sequence_lengths, _ = dataset
    _write_metadata(prefix, 4000, "uint16")
    tokens = np.fromfile(f"{prefix}.bin", dtype=np.uint16)
    bad = np.flatnonzero(tokens >= 4000)

    code, out, _ = _run(capsys, prefix, "--verify")
    assert code == 1
    assert (
        f"FAILED: {prefix}.bin: {bad.size:,} token ids are outside [0, 4000) (the vocabulary of "
        f"corpus_text_document.meta.json); the first is {tokens[bad[0]]} in document"
    ) in out


@pytest.mark.parametrize(
    ("ids", "tokenizer", "found"),
    [
        ([5, 8191, 8192, 7], True, "the token id 8192 in document 1 (sequence 1, token 2) is outside [0, 8192)"),
        ([5, 8191, -1, 7], False, "the token id -1 in document 1 (sequence 1, token 2) is negative"),
    ],
)
def test_verify_names_the_first_id_outside_the_tokenizer_vocabulary(tmp_path, capsys, ids, tokenizer, found):
    prefix = tmp_path / "wide"
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32) as builder:
        builder.add_documents(np.array([3, 4, *ids]), [2, 4])
        builder.finalize(f"{prefix}.idx")
    argv = ["--tokenizer", BUNDLED_TOKENIZER_PATH] if tokenizer else []
    code, out, _ = _run(capsys, prefix, "--verify", *argv)
    assert code == 1
    assert f"FAILED: {prefix}.bin: {found}" in out


def _truncate_idx(prefix: Path) -> None:
    with open(f"{prefix}.idx", "r+b") as f:
        f.truncate(HEADER_SIZE + 30)


def _bad_magic(prefix: Path) -> None:
    with open(f"{prefix}.idx", "r+b") as f:
        f.write(b"NOTANIDX")


def _pointer_beyond_bin(prefix: Path) -> None:
    """Sequence 5 points far past the end of the .bin (pointers follow the int32 lengths)."""
    sequences = IndexedDataReader(prefix).sequence_lengths.size
    with open(f"{prefix}.idx", "r+b") as f:
        f.seek(HEADER_SIZE + 4 * sequences + 8 * 5)
        f.write(np.int64(10**9).tobytes())


def _bin_replaced_by_directory(prefix: Path) -> None:
    Path(f"{prefix}.bin").unlink()
    Path(f"{prefix}.bin").mkdir()


CORRUPTIONS = {
    "truncated idx": (_truncate_idx, "truncated"),
    "bad header": (_bad_magic, "bad magic"),
    "pointer beyond bin": (_pointer_beyond_bin, "lie outside"),
    "bin is a directory": (_bin_replaced_by_directory, "is a directory"),
}
MODES = {
    "summary": [],
    "json": ["--json"],
    "verify": ["--verify"],
    "decode": ["--decode", "0,5"],
    "histogram": ["--histogram", "{tmp}/lengths.png"],
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_pairs_exit_2_in_every_mode(dataset, tmp_path, capsys, corruption, mode):
    """A corrupt pair is refused in every mode with an ``error: ...`` naming the file and the fault, never a
    traceback, a summary of wrong numbers or a plot; ``--verify`` reports an index it can open as FAILED (exit 1)
    and one it cannot open as an error."""
    prefix, _, _ = dataset
    corrupt, fault = CORRUPTIONS[corruption]
    corrupt(prefix)
    argv = [arg.format(tmp=tmp_path) for arg in MODES[mode]]
    code, out, err = _run(capsys, prefix, *argv)
    assert "Traceback" not in err
    assert not (tmp_path / "lengths.png").exists()
    if mode == "verify" and corruption == "pointer beyond bin":
        assert code == 1 and out.startswith(f"FAILED: {prefix}.idx") and fault in out
        return
    assert code == 2 and out == ""
    assert err.startswith("error: ") and str(prefix) in err and fault in err


# -- histogram ---------------------------------------------------------------------------------------------------


def test_histogram_writes_png(dataset, tmp_path, capsys):
    prefix, _, _ = dataset
    out_path = tmp_path / "plots" / "lengths.png"
    out_path.parent.mkdir()
    code, out, _ = _run(capsys, prefix, "--histogram", out_path)
    assert code == 0
    data = out_path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > len(PNG_MAGIC)
    assert list(out_path.parent.iterdir()) == [out_path]  # no temporary file left behind
    assert f"wrote the sequence length histogram to {out_path}" in out


def test_histogram_without_matplotlib_names_the_extra(dataset, tmp_path, capsys, monkeypatch):
    """matplotlib is the optional [plot] extra: without it the tool says how to install it and writes nothing."""
    prefix, _, _ = dataset
    for name in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # what Python does for a module that is not installed
    code, out, err = _run(capsys, prefix, "--histogram", tmp_path / "lengths.png")
    assert code == 2 and "hyper-parallel-data[plot]" in err
    assert not (tmp_path / "lengths.png").exists()


def test_histogram_missing_directory_exits_2(dataset, tmp_path, capsys):
    prefix, _, _ = dataset
    code, _, err = _run(capsys, prefix, "--histogram", tmp_path / "absent" / "lengths.png")
    assert code == 2 and err.startswith("error: cannot write the histogram")


# -- prefixes and errors -----------------------------------------------------------------------------------------


def test_missing_prefix_exits_2(tmp_path, capsys):
    prefix = tmp_path / "absent"
    code, out, err = _run(capsys, prefix)
    assert code == 2 and out == ""
    assert err.startswith(f"error: indexed dataset '{prefix}': missing")
    assert "Traceback" not in err


def _pair(prefix: Path) -> None:
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16) as builder:
        builder.add_documents(np.arange(10), [10])
        builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize(
    ("given", "suggested"),
    [
        ("corpus", ["corpus_code_document", "corpus_text_document"]),  # the output prefix, not the pair's
        # a typo: the closest names, best first
        ("corpus_txt_document", ["corpus_text_document", "corpus_code_document", "other_text_document"]),
        ("", ["corpus_code_document", "corpus_text_document", "other_text_document"]),  # the directory
    ],
)
def test_wrong_prefix_lists_the_pairs_nearby(tmp_path, capsys, given, suggested):
    """A prefix with no pair names the pairs it may have meant: those starting with it (the ``_text_document``
    suffix left out), else the closest names, or the pairs of a directory."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for name in ("corpus_text_document", "corpus_code_document", "other_text_document"):
        _pair(out_dir / name)
    (out_dir / "corpus_lonely.idx").write_bytes(b"")  # half a pair is not offered
    code, out, err = _run(capsys, f"{out_dir}/{given}")
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith("error: ") and "missing" in err
    assert err.rstrip().endswith(f"Did you mean {' or '.join(str(out_dir / name) for name in suggested)}?")


def test_wrong_prefix_suggestions_are_bounded(tmp_path, capsys):
    """However many pairs match, only a few are listed; a prefix like nothing nearby gets no suggestion."""
    for i in range(8):
        _pair(tmp_path / f"corpus_{i}_text_document")
    code, _, err = _run(capsys, tmp_path / "corpus")
    assert code == 2 and err.count("corpus_") == 5

    code, _, err = _run(capsys, tmp_path / "zzz")
    assert code == 2 and "Did you mean" not in err


@pytest.mark.parametrize("suffix", [".idx", ".bin"])
def test_prefix_with_suffix(dataset, capsys, suffix):
    prefix, _, _ = dataset
    code, out, _ = _run(capsys, f"{prefix}{suffix}", "--json")
    assert code == 0
    assert json.loads(out)["prefix"] == str(prefix)


def test_help_documents_every_option():
    text = build_parser().format_help()
    for option in ("--multimodal", "--decode", "--tokenizer", "--max-chars", "--show-ids", "--verify", "--histogram"):
        assert option in text
    assert "examples:" in text


def test_module_runs_as_a_command():
    result = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.data.tools.read_indexed_dataset", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "PREFIX" in result.stdout and "--histogram" in result.stdout
