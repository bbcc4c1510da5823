"""Specification of ``hp-data prepare`` on bad input: every case exits 2 with one ``error: ...`` line naming the
file, the line, the field and the fix, never a traceback, and publishes nothing."""

from __future__ import annotations

import csv
import gzip
import json
import zlib
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.tools.cli import main as hp_data

GOOD = [f"It is a truth universally acknowledged, number {i}." for i in range(40)]


pytestmark = pytest.mark.usefixtures("restore_package_logger")


def prepare(capsys, data: Path | str, output_prefix: Path, *extra: str, tokenizer: Path | str = BUNDLED_TOKENIZER_PATH):
    """Run ``hp-data prepare`` with one worker; returns (exit status, stdout, stderr)."""
    argv = ["prepare", "--dataset-name-or-path", str(data), "--output-prefix", str(output_prefix)]
    argv += ["--tokenizer-name-or-path", str(tokenizer), "--workers", "1", *extra]
    code = hp_data(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def error_line(err: str, *fragments: str) -> str:
    """The command's normal error: exactly one ``error: ...`` line holding every fragment, no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def outputs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("out*"))


def documents(prefix: Path) -> list[list[int]]:
    reader = IndexedDataReader(prefix)
    return [reader[i].tolist() for i in range(len(reader))]


def jsonl(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


# -- a lone surrogate --------------------------------------------------------------------------------------------

# name -> (the bad record as written in the file, extra flags, the field the message names)
SURROGATES = {
    "string": (
        r'{"text": "caf\u00e9 \ud800 au lait"}',
        [],
        "key 'text' holds a lone surrogate '\\ud800' at character 5",
    ),
    "low half": (r'{"text": "x\udc00"}', [], "key 'text' holds a lone surrogate '\\udc00' at character 1"),
    "list item": (r'{"text": ["fine", "bad \udbff"]}', [], "key 'text' item 1 holds a lone surrogate"),
    "template": (
        r'{"text": "body", "title": "\ud83d"}',
        ["--text-template", "{title}: {text}"],
        "the text rendered by --text-template holds a lone surrogate",
    ),
}


@pytest.mark.parametrize("case", list(SURROGATES))
def test_lone_surrogate_stops_with_the_record_named(tmp_path, capsys, case):
    """Half a UTF-16 pair (valid JSON, invalid Unicode) stops the run at its record, naming the file, the line,
    the field and the fix, instead of crashing inside the tokenizer."""
    bad, extra, field = SURROGATES[case]
    good = [json.dumps({"text": text, "title": "t"}) for text in GOOD[:5]]
    data = tmp_path / "in.jsonl"
    data.write_bytes(jsonl([*good, "", bad, good[0]]))
    code, out, err = prepare(capsys, data, tmp_path / "out", *extra)
    assert code == 2
    error_line(err, f"error: {data}:line 7: {field}", "not valid Unicode", "pass --skip-bad-records")
    assert "finished" not in out
    assert outputs(tmp_path) == []


def test_lone_surrogate_is_skipped_and_counted_with_skip_bad_records(tmp_path, capsys, tokenizer):
    """With ``--skip-bad-records`` the record is skipped, logged and counted like any bad record; a valid
    surrogate pair (an emoji) is kept."""
    lines = [json.dumps({"text": GOOD[0]}), r'{"text": "bad \ud800"}', r'{"text": "emoji \ud83d\ude00"}']
    data = tmp_path / "in.jsonl"
    data.write_bytes(jsonl(lines))
    code, out, err = prepare(capsys, data, tmp_path / "out", "--skip-bad-records")
    assert code == 0, err
    assert "Traceback" not in err
    assert f"skipped: {data}:line 2: key 'text' holds a lone surrogate" in err
    assert any(line.split() == ["bad", "records", "skipped", "1"] for line in out.splitlines()), out
    expected = [tokenizer.encode(text) + [tokenizer.eod] for text in (GOOD[0], "emoji \U0001f600")]
    assert documents(tmp_path / "out_text_document") == expected


# -- a truncated or damaged .gz ----------------------------------------------------------------------------------


def _jsonl_gz(records: int) -> bytes:
    return gzip.compress(jsonl([json.dumps({"text": f"{GOOD[i % 40]} {i}"}) for i in range(records)]))


def _complete_lines(compressed: bytes) -> int:
    """Lines that can be decompressed from the start of a truncated gzip stream."""
    return zlib.decompressobj(wbits=31).decompress(compressed).count(b"\n")


@pytest.mark.parametrize("extra", [[], ["--partitions", "2", "--keep-sequential-samples"]], ids=["read", "count"])
def test_truncated_gzip_names_the_last_complete_line(tmp_path, capsys, extra):
    """A ``.jsonl.gz`` cut short is an error naming the file, the last complete line and the fix, both in the
    pass that counts records (contiguous partitions) and in the reading pass; nothing is published."""
    whole = _jsonl_gz(3000)
    data = tmp_path / "in.jsonl.gz"
    data.write_bytes(whole[: len(whole) // 2])
    code, _, err = prepare(capsys, data, tmp_path / "out", "--chunk-size", "100", *extra)
    assert code == 2
    line = error_line(err, f"error: {data}: the gzip data ends before its end marker (truncated)")
    assert f"after line {_complete_lines(data.read_bytes()):,}, the last complete one" in line
    assert "download or compress it again" in line and f"gzip -t {data}" in line
    assert outputs(tmp_path) == []


def test_damaged_gzip_is_an_error_naming_the_file(tmp_path, capsys):
    """Bytes changed inside the compressed stream (a bad copy) give the same error, naming the damage."""
    damaged = bytearray(_jsonl_gz(3000))
    damaged[len(damaged) // 2 : len(damaged) // 2 + 64] = bytes(64)
    data = tmp_path / "in.jsonl.gz"
    data.write_bytes(bytes(damaged))
    code, _, err = prepare(capsys, data, tmp_path / "out")
    assert code == 2
    error_line(err, f"error: {data}: the gzip data is corrupt", "download or compress it again")


@pytest.mark.parametrize("name", ["in.txt.gz", "in.csv.gz", "in.json.gz"])
def test_truncated_gzip_of_every_line_format(tmp_path, capsys, name):
    """Text, CSV and JSON-array files cut short are the same clear error."""
    if name == "in.json.gz":
        raw = json.dumps([{"text": f"{GOOD[i % 40]} {i}"} for i in range(3000)]).encode()
    elif name == "in.csv.gz":
        raw = ("text\n" + "".join(f'"{GOOD[i % 40]} {i}"\n' for i in range(3000))).encode()
    else:
        raw = jsonl([f"{GOOD[i % 40]} {i}" for i in range(3000)])
    compressed = gzip.compress(raw)
    data = tmp_path / name
    data.write_bytes(compressed[: len(compressed) // 2])
    code, _, err = prepare(capsys, data, tmp_path / "out")
    assert code == 2
    error_line(err, f"error: {data}: the gzip data ends before its end marker (truncated)", "compress it again")


# -- CSV quoting -------------------------------------------------------------------------------------------------

UNBALANCED = {
    # the quote opened on line 3 runs to the end of the file
    "to the end": 'text,title\nfine,a\n"unbalanced,b\nnext line,c\nmore,d\n',
    # the quote opened on line 3 "closes" at the opening quote of line 5, which text follows
    "to a later quote": 'text,title\nfine,a\n"unbalanced,b\nnext line,c\n"quoted",d\nlast,e\n',
}


@pytest.mark.parametrize("case", list(UNBALANCED))
def test_csv_unbalanced_quote_names_the_line_it_opened_on(tmp_path, capsys, case):
    """An unbalanced quote is an error naming the line where it opened, not a field that silently swallows the
    lines after it."""
    data = tmp_path / "in.csv"
    data.write_text(UNBALANCED[case], encoding="utf-8")
    code, _, err = prepare(capsys, data, tmp_path / "out")
    assert code == 2
    error_line(err, f"error: {data}:line 3: ", "quote", 'write a quote inside a quoted field twice ("")')
    assert outputs(tmp_path) == []


def test_csv_field_beyond_the_csv_reader_limit_says_what_to_use(tmp_path, capsys):
    """A field longer than Python's CSV reader accepts names its line and the formats that take long records."""
    data = tmp_path / "in.csv"
    data.write_text('text\nshort\n"' + "word " * 30_000 + '"\n', encoding="utf-8")
    code, _, err = prepare(capsys, data, tmp_path / "out")
    assert code == 2
    error_line(err, f"error: {data}:line 3: ", "longer than 131,072 characters", "as JSONL or Parquet")


def test_csv_multi_line_quoted_fields_still_work(tmp_path, capsys, tokenizer):
    """Valid quoting (fields spanning lines, doubled quotes, delimiters inside quotes) is read as before."""
    texts = ["one line", "two\nlines", 'a "quoted" word', "comma, inside", "three\n\nlines"]
    data = tmp_path / "in.csv"
    with data.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "title"])
        writer.writerows([text, f"title {i}"] for i, text in enumerate(texts))
    assert '"two\nlines"' in data.read_text(encoding="utf-8")
    code, _, err = prepare(capsys, data, tmp_path / "out")
    assert code == 0, err
    assert documents(tmp_path / "out_text_document") == [tokenizer.encode(t) + [tokenizer.eod] for t in texts]


# -- tokenizer paths and special tokens --------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["./no/such/dir", "no/such/dir", "models/tok/", "tok.json", "{tmp}/absent"])
def test_missing_local_tokenizer_is_no_such_file(tmp_path, capsys, monkeypatch, spec):
    """A path-like tokenizer that does not exist is reported as missing, naming it, with no Hub download hint."""
    monkeypatch.chdir(tmp_path)
    spec = spec.format(tmp=tmp_path)
    data = tmp_path / "in.jsonl"
    data.write_bytes(jsonl([json.dumps({"text": GOOD[0]})]))
    code, _, err = prepare(capsys, data, tmp_path / "out", tokenizer=spec)
    assert code == 2
    line = error_line(err, f"error: no such file or directory: {spec}", "pass an existing tokenizer directory")
    assert "Hub" not in line


def test_hub_name_keeps_the_offline_hint(tmp_path, capsys):
    """A Hub-style name that is not a local path keeps the hint on downloading it while offline."""
    data = tmp_path / "in.jsonl"
    data.write_bytes(jsonl([json.dumps({"text": GOOD[0]})]))
    code, _, err = prepare(capsys, data, tmp_path / "out", tokenizer="gpt2")
    assert code == 2
    error_line(err, "tokenizer 'gpt2' is not a local directory", "Hub is disabled (offline)", "save_pretrained(DIR)")


END_OF_SENTENCE = "<｜end▁of▁sentence｜>"
BEGIN_OF_SENTENCE = "<｜begin▁of▁sentence｜>"


def _deepseek_like(directory: Path) -> Path:
    """The bundled tokenizer with its special tokens renamed as DeepSeek names them, saved as a bare
    ``tokenizer.json`` (no tokenizer_config.json beside it)."""
    spec = json.loads(Tokenizer.from_file(str(BUNDLED_TOKENIZER_PATH / "tokenizer.json")).to_str())
    renamed = {"<|endoftext|>": END_OF_SENTENCE, "<|im_start|>": BEGIN_OF_SENTENCE}
    for token in spec["added_tokens"]:
        token["content"] = renamed.get(token["content"], token["content"])
    spec["model"]["vocab"] = {renamed.get(word, word): i for word, i in spec["model"]["vocab"].items()}
    directory.mkdir()
    Tokenizer.from_str(json.dumps(spec)).save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def test_bare_tokenizer_with_an_unusual_eos_says_how_to_name_it(tmp_path, capsys, tokenizer):
    """A bare tokenizer.json whose EOS has an unusual name lists the special tokens it has and shows the
    tokenizer_config.json to write; once written, the directory runs with that token as EOD."""
    tokenizer_file = _deepseek_like(tmp_path / "deepseek")
    data = tmp_path / "in.jsonl"
    data.write_bytes(jsonl([json.dumps({"text": GOOD[0]})]))
    code, _, err = prepare(capsys, data, tmp_path / "out", tokenizer=tokenizer_file)
    assert code == 2
    config = tmp_path / "deepseek" / "tokenizer_config.json"
    error_line(
        err,
        f"error: tokenizer {tokenizer_file} has no EOS token to append",
        f"'{END_OF_SENTENCE}' (id 0)",
        f"'{BEGIN_OF_SENTENCE}' (id 2)",
        f'name the EOS in {config}, e.g. {{"eos_token": "{END_OF_SENTENCE}"}}',
        "--append-eod false",
    )

    config.write_text(json.dumps({"eos_token": END_OF_SENTENCE}, ensure_ascii=False), encoding="utf-8")
    code, _, err = prepare(capsys, data, tmp_path / "out", tokenizer=config.parent)
    assert code == 0, err
    assert documents(tmp_path / "out_text_document") == [tokenizer.encode(GOOD[0]) + [0]]


# -- a text template that would build a huge string --------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "record", "fragment"),
    [
        ("{text:>3000000000}", {"text": "a"}, "error: text_template asks for a field 3,000,000,000 characters wide"),
        ("{text:>{width}}", {"text": "a", "width": 3_000_000_000}, ":line 1: --text-template asks for a field"),
        ("{text.__class__}", {"text": "a"}, "error: text_template '{text.__class__}' reads the private attribute"),
    ],
)
def test_a_text_template_past_the_width_limit_stops_with_one_error_line(tmp_path, capsys, template, record, fragment):
    """A width from the template is refused before any file is read; one from the record stops at that record."""
    data = tmp_path / "in.jsonl"
    data.write_bytes(jsonl([json.dumps(record)]))
    code, _, err = prepare(capsys, data, tmp_path / "out", "--text-template", template)
    assert code == 2
    error_line(err, fragment)
    assert outputs(tmp_path) == []
