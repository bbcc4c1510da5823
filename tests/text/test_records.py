"""Specification of finding data files and streaming their raw records with their locations."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.text.records import (
    count_records,
    file_format,
    iter_range_chunks,
    iter_record_chunks,
    resolve_data_files,
    split_record_ranges,
)


def random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghij klmnopqrstuvwxyz éü"
    return [f"record {i}: " + "".join(rng.choices(letters, k=rng.randint(0, 40))) for i in range(count)]


def jsonl_line(text: str) -> bytes:
    return json.dumps({"text": text}).encode() + b"\n"


def chunks_of(path: Path, **options) -> list:
    return list(iter_record_chunks(*resolve_data_files(path), **options))


def test_json_lines_keep_their_line_numbers_across_blank_lines(tmp_path):
    """Blank and whitespace-only lines are not records but still count in the 1-based line numbers."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n" + jsonl_line("a") + b"   \n\r\n" + jsonl_line("b") + b"\n\n" + jsonl_line("c")[:-1])
    (chunk,) = chunks_of(path)
    assert chunk.kind == "json_lines" and chunk.location_unit == "line"
    assert [json.loads(item)["text"] for item in chunk.items] == ["a", "b", "c"]
    assert chunk.locations == [2, 5, 8]
    assert chunk.where(1) == f"{path}:line 5"
    assert chunk.bytes_read == path.stat().st_size


def test_chunk_size_bounds_records_per_chunk(tmp_path):
    """Chunks hold at most ``chunk_size`` consecutive records of one file, never spanning two files."""
    texts = random_texts(10, seed=1)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_bytes(b"".join(map(jsonl_line, texts[:7])))
    second.write_bytes(b"".join(map(jsonl_line, texts[7:])))
    chunks = list(iter_record_chunks([first, second], "json", chunk_size=3))
    assert [(Path(c.source).name, len(c.items)) for c in chunks] == [
        ("a.jsonl", 3),
        ("a.jsonl", 3),
        ("a.jsonl", 1),
        ("b.jsonl", 3),
    ]
    assert [json.loads(item)["text"] for c in chunks for item in c.items] == texts
    assert [c.locations for c in chunks] == [[1, 2, 3], [4, 5, 6], [7], [1, 2, 3]]
    assert [c.bytes_read for c in chunks][-1] == first.stat().st_size + second.stat().st_size  # counted across files


def test_chunk_bytes_closes_chunks_of_long_lines(tmp_path):
    """Line formats also close a chunk once its lines reach ``chunk_bytes`` bytes."""
    path = tmp_path / "in.txt"
    lines = [f"{i:02d}".encode() + b"x" * 97 + b"\n" for i in range(10)]  # 100 bytes each
    path.write_bytes(b"".join(lines))
    chunks = chunks_of(path, chunk_size=100, chunk_bytes=250)
    assert [len(c.items) for c in chunks] == [3, 3, 3, 1]
    assert [item for c in chunks for item in c.items] == lines
    assert all(c.kind == "text_lines" for c in chunks)


def test_gzip_progress_counts_compressed_bytes(tmp_path):
    """For ``.gz`` files ``bytes_read`` counts compressed bytes, ending at the file size."""
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(map(jsonl_line, random_texts(50, seed=2)))))
    chunks = chunks_of(path, chunk_size=8)
    assert sum(len(c.items) for c in chunks) == 50
    assert chunks[-1].bytes_read == path.stat().st_size


def test_parquet_rows_are_numbered_from_zero_and_columns_selected(tmp_path):
    """Parquet records are dicts located by 0-based row; only the requested columns are read."""
    path = tmp_path / "in.parquet"
    texts = random_texts(7, seed=3)
    pq.write_table(pa.table({"text": texts, "other": list(range(7))}), path, row_group_size=3)
    chunks = chunks_of(path, chunk_size=4, columns=["text"])
    assert [c.items for c in chunks] == [[{"text": t} for t in texts[:4]], [{"text": t} for t in texts[4:]]]
    assert [c.locations for c in chunks] == [[0, 1, 2, 3], [4, 5, 6]]
    assert chunks[1].where(0) == f"{path}:row 4"
    with pytest.raises(DataFileError, match=r"missing key\(s\) \['body'\]; the file has columns \['text', 'other'\]"):
        chunks_of(path, columns=["body"])


def _write_jsonl_gz(path: Path, texts: list[str]) -> None:
    path.write_bytes(gzip.compress(b"\n".join(map(jsonl_line, texts))))  # blank lines between records


def _write_csv(path: Path, texts: list[str]) -> None:
    path.write_text("text\n" + "".join(f'"{t}"\n' for t in texts), encoding="utf-8")


def _write_parquet(path: Path, texts: list[str]) -> None:
    pq.write_table(pa.table({"text": texts}), path, row_group_size=5)


@pytest.mark.parametrize(
    ("file_name", "write"),
    [("in.jsonl.gz", _write_jsonl_gz), ("in.csv", _write_csv), ("in.parquet", _write_parquet)],
)
def test_count_records_equals_the_records_yielded(tmp_path, file_name, write):
    """``count_records`` counts exactly the records that ``iter_record_chunks`` yields."""
    path = tmp_path / file_name
    write(path, random_texts(23, seed=4))
    files, fmt = resolve_data_files(path)
    assert count_records(files, fmt) == sum(len(c.items) for c in iter_record_chunks(files, fmt, chunk_size=5)) == 23


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a.jsonl", "json"),
        ("a.jsonl.gz", "json"),
        ("A.JSONL.GZ", "json"),
        ("a.json", "json"),
        ("a.csv.gz", "csv"),
        ("a.txt.gz", "text"),
        ("a.parquet", "parquet"),
        ("a.arrow", "arrow"),
        ("a.parquet.gz", None),
        ("a.arrow.gz", None),
        ("a.xml", None),
        ("jsonl", None),
    ],
)
def test_file_format_from_extension(name, expected):
    """Formats come from the extension; Parquet and Arrow are not accepted gzip-compressed."""
    assert file_format(name) == expected


def test_directory_resolves_to_sorted_supported_files(tmp_path):
    """A directory gives its visible supported files sorted by path; subdirectories are not searched."""
    for name in ("b.jsonl", "a.jsonl.gz", ".hidden.jsonl", "notes.md"):
        (tmp_path / name).write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.jsonl").write_text("")
    files, fmt = resolve_data_files(tmp_path)
    assert ([p.name for p in files], fmt) == (["a.jsonl.gz", "b.jsonl"], "json")


def test_recursive_glob(tmp_path):
    """A ``**`` glob matches files in subdirectories, sorted by path."""
    (tmp_path / "x" / "y").mkdir(parents=True)
    for path in (tmp_path / "x" / "y" / "b.jsonl", tmp_path / "x" / "a.jsonl", tmp_path / "c.jsonl"):
        path.write_text("")
    files, _ = resolve_data_files(f"{tmp_path}/**/*.jsonl")
    assert [p.relative_to(tmp_path).as_posix() for p in files] == ["c.jsonl", "x/a.jsonl", "x/y/b.jsonl"]


def test_json_array_file_is_read_as_rows(tmp_path):
    """A ``.json`` file holding one JSON array yields its objects as records located by 0-based row."""
    path = tmp_path / "in.json"
    records = [{"text": t} for t in random_texts(5, seed=5)]
    path.write_text(json.dumps(records, indent=2), encoding="utf-8")
    chunks = chunks_of(path, chunk_size=2)
    assert [c.kind for c in chunks] == ["records"] * 3
    assert [r for c in chunks for r in c.items] == records
    assert [c.locations for c in chunks] == [[0, 1], [2, 3], [4]]


def test_gzipped_json_array_file_is_read_as_rows(tmp_path):
    """``.json`` is accepted gzip-compressed, so a ``.json.gz`` JSON array yields its objects as records."""
    path = tmp_path / "in.json.gz"
    records = [{"text": t} for t in random_texts(5, seed=6)]
    path.write_bytes(gzip.compress(json.dumps(records, indent=2).encode()))
    chunks = chunks_of(path)
    assert [r for c in chunks for r in c.items] == records


def test_csv_locations_are_the_lines_records_start_on(tmp_path):
    """CSV records are located by the 1-based line they start on, also when a quoted field spans lines."""
    path = tmp_path / "in.csv"
    path.write_text('text,title\n"first\nspans two lines",a\nsecond,b\n', encoding="utf-8")
    (chunk,) = chunks_of(path)
    assert [r["text"] for r in chunk.items] == ["first\nspans two lines", "second"]
    assert chunk.locations == [2, 4]


def _records_with_locations(chunks) -> list[tuple[str, int, object]]:
    return [
        (chunk.source, where, item)
        for chunk in chunks
        for where, item in zip(chunk.locations, chunk.items, strict=True)
    ]


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 8])
def test_split_ranges_read_in_order_give_every_record_once(tmp_path, parts):
    """Byte ranges of JSON-lines files (blank lines, a file without a final newline, an empty file), row groups
    of Parquet files and rows of Arrow files (an IPC stream of several batches, an IPC file of one batch), read
    part after part, give exactly the records and line or row numbers of one pass."""
    lines = tmp_path / "lines"
    lines.mkdir()
    texts = random_texts(90, seed=3)
    (lines / "a.jsonl").write_bytes(
        b"".join(jsonl_line(t) + (b"\n" if i % 7 == 0 else b"") for i, t in enumerate(texts[:50]))
    )
    (lines / "b.jsonl").write_bytes(b"")
    (lines / "c.jsonl").write_bytes(b"".join(map(jsonl_line, texts[50:]))[:-1])
    tables = tmp_path / "tables"
    tables.mkdir()
    for name, part in (("a", texts[:37]), ("b", texts[37:])):
        pq.write_table(pa.table({"text": part}), tables / f"{name}.parquet", row_group_size=6)
    arrows = tmp_path / "arrows"
    arrows.mkdir()
    batches = pa.table({"text": texts[:41], "other": list(range(41))})
    with pa.ipc.new_stream(arrows / "a.arrow", batches.schema) as writer:
        for batch in batches.to_batches(max_chunksize=9):
            writer.write_batch(batch)
    with pa.ipc.new_file(arrows / "b.arrow", pa.schema([("text", pa.string())])) as writer:
        writer.write_table(pa.table({"text": texts[41:]}))
    for directory in (lines, tables, arrows):
        files, fmt = resolve_data_files(directory)
        expected = _records_with_locations(iter_record_chunks(files, fmt, chunk_size=4))
        ranges = split_record_ranges(files, fmt, parts)
        assert len(ranges) == parts
        read = [record for part in ranges for record in _records_with_locations(iter_range_chunks(part, fmt, 4))]
        assert read == expected
    one_batch = split_record_ranges([arrows / "b.arrow"], "arrow", parts)
    assert all(len(part) == 1 for part in one_batch)  # a file of one batch is cut between rows, one range per part
