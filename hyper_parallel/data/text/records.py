"""Finding data files and reading their raw records, shared by the offline tools and the Online sources.

Owns: resolving a file, glob or directory (or a list of them) into an ordered list of files of one format, and
streaming raw records out of them in chunks with their line or row numbers, so that errors can name where a record
came from; a file that cannot be read to its end (a truncated ``.gz``, a CSV quote left open) is an error naming
the line; recognising a ``save_to_disk`` directory and choosing its split. JSON and text lines stay undecoded
bytes here: decoding and parsing happen where the records are consumed (often a worker process).
A file may be an fsspec URL (``s3://bucket/dir/*.jsonl``, a directory URL): its files are then listed through
fsspec, sorted by path as local files are, and each is an ``ObjectFile`` (URL, size, identity) that the readers
stream by ranged requests of exactly the version listed, where a local file is a ``Path``.
Not responsible for: opening files with Hugging Face ``datasets`` (``text.online.online_utils``), tokenization,
transforms or sampling.
"""

from __future__ import annotations

import bisect
import csv
import glob
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.indexed_data_reader import is_object_url
from hyper_parallel.data.indexed.object_storage import ObjectFile, list_objects
from hyper_parallel.data.resume_checks import file_entries

__all__ = [
    "FILE_FORMATS",
    "FileRange",
    "RecordChunk",
    "count_records",
    "data_file_entries",
    "file_format",
    "iter_range_chunks",
    "iter_record_chunks",
    "is_saved_hf_dataset",
    "data_path_entries",
    "resolve_data_files",
    "select_hf_split",
    "split_record_ranges",
]

# Extension (after removing ".gz") -> format name. Parquet and Arrow carry their own compression.
FILE_FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
    ".txt": "text",
}
_GZIP_FORMATS = {"json", "csv", "text"}
# What reading a truncated or damaged .gz raises: EOFError (no end marker), zlib.error, BadGzipFile (header, CRC).
_GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)
_GLOB_CHARS = set("*?[")

RecordKind = Literal["json_lines", "text_lines", "records"]
# A data file: a local path, or an object in object storage.
DataFile = Path | ObjectFile


@dataclass
class RecordChunk:
    """Consecutive raw records of one file.

    Attributes:
        source: the file the records come from.
        kind: ``json_lines`` (``items`` are undecoded JSON lines), ``text_lines`` (undecoded text lines, one
            document each) or ``records`` (already-parsed dicts, from columnar formats and JSON arrays).
        items: the raw records.
        locations: where each record starts, as a 1-based line number (``location_unit == "line"``) or a
            0-based row number (``"row"``).
        location_unit: ``"line"`` or ``"row"``.
        bytes_read: bytes consumed up to the end of this chunk, counted from the start of the first file of the
            run (compressed bytes for ``.gz``).
    """

    source: str
    kind: RecordKind
    items: list
    locations: list[int]
    location_unit: str
    bytes_read: int

    def where(self, position: int) -> str:
        """``file:line N`` or ``file:row N`` of the record at ``position`` in this chunk."""
        return f"{self.source}:{self.location_unit} {self.locations[position]}"


def file_format(path: str | os.PathLike) -> str | None:
    """The format name of ``path`` from its extension, or None when unsupported."""
    name = os.fspath(path).lower()
    compressed = name.endswith(".gz")
    if compressed:
        name = name[:-3]
    fmt = FILE_FORMATS.get(os.path.splitext(name)[1])
    if compressed and fmt not in _GZIP_FORMATS:
        return None
    return fmt


def _supported() -> str:
    return ", ".join(sorted(FILE_FORMATS)) + " (json, jsonl, csv and txt also as .gz)"


def data_path_entries(data_path: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The paths, globs or directories a ``data_path`` names: itself, or each entry of a list of them.

    Raises:
        DataConfigError: an empty list, or an entry that is not a path.
    """
    if isinstance(data_path, str | os.PathLike):
        return [os.fspath(data_path)]
    entries = list(data_path) if isinstance(data_path, Iterable) else [data_path]
    if not entries:
        raise DataConfigError("data_path is an empty list; give a file, a glob, a directory or a list of them")
    for entry in entries:
        if not isinstance(entry, str | os.PathLike):
            raise DataConfigError(
                f"data_path entry {entry!r} is a {type(entry).__name__}; every entry of a data_path list must be a "
                "file, a glob or a directory"
            )
    return [os.fspath(entry) for entry in entries]


def resolve_data_files(
    path_or_pattern: str | os.PathLike | Sequence[str | os.PathLike],
) -> tuple[list[DataFile], str]:
    """Resolve a file, a glob or a directory (not recursive), or a list of them, into files of one format; an
    entry that is a URL gives ``ObjectFile`` objects, a local one ``Path`` objects.

    Returns:
        The files and their format name: each entry's files sorted by path for a deterministic order, the entries
        in the order given.

    Raises:
        DataFileError: an entry matches nothing, a file is named twice, or the files mix formats.
    """
    entries = data_path_entries(path_or_pattern)
    if len(entries) > 1:
        resolved = [(entry, *_resolve_one(entry)) for entry in entries]
        files = [file for _, entry_files, _ in resolved for file in entry_files]
        seen: dict[DataFile, str] = {}
        for entry, entry_files, _ in resolved:
            for file in entry_files:
                key = file.resolve() if isinstance(file, Path) else file.url
                if key in seen:
                    raise DataFileError(
                        f"data_path names {file} twice (through {seen[key]!r} and {entry!r}); list each file once"
                    )
                seen[key] = entry
        kinds = sorted({fmt for _, _, fmt in resolved})
        if len(kinds) > 1:
            raise DataFileError(f"the data_path list {entries} mixes formats {kinds}; give files of one format")
        return files, kinds[0]
    return _resolve_one(entries[0])


def _resolve_one(spec: str) -> tuple[list[DataFile], str]:
    """One file, glob or directory: its files sorted by path, of one format."""
    files = _objects_named(spec) if is_object_url(spec) else sorted(_local_files_named(spec))
    formats = {p: file_format(p.name) for p in files}
    unsupported = [str(p) for p, fmt in formats.items() if fmt is None]
    if unsupported:
        raise DataFileError(f"unsupported file type: {unsupported[0]}; supported: {_supported()}")
    kinds = sorted(set(formats.values()))
    if len(kinds) > 1:
        raise DataFileError(
            f"'{spec}' mixes formats {kinds}; process one format per run (e.g. narrow the glob to *.jsonl)"
        )
    return files, kinds[0]


def _saved_dataset_error(where: str | Path) -> DataFileError:
    return DataFileError(
        f"{where} is a Hugging Face dataset saved with save_to_disk; convert it with "
        "`python -m hyper_parallel.data.tools.huggingface_offline` instead"
    )


def _objects_named(spec: str) -> list[ObjectFile]:
    """The objects of one URL file, glob or directory, sorted by path."""
    is_glob = bool(_GLOB_CHARS & set(spec))
    objects, is_directory = list_objects(spec, is_glob)
    if is_directory:
        names = {file.name for file in objects}
        if "dataset_dict.json" in names or {"state.json", "dataset_info.json"} <= names:
            raise _saved_dataset_error(spec)
        objects = [file for file in objects if not file.name.startswith(".") and file_format(file.name)]
        if not objects:
            raise DataFileError(f"the directory {spec} holds no data files; supported: {_supported()}")
    elif not objects:
        if is_glob:
            raise DataFileError(f"the pattern '{spec}' matches no objects; check the bucket, the key and the glob")
        raise DataFileError(f"no such object or directory: {spec}; check the bucket and the key")
    return objects


def _local_files_named(spec: str) -> list[Path]:
    """The files of one local file, glob or directory, in any order."""
    path = Path(spec).expanduser()
    if _GLOB_CHARS & set(spec):
        candidates = [Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file()]
        if not candidates:
            raise DataFileError(f"the pattern '{spec}' matches no files; check the path and the quoting of the glob")
    elif path.is_dir():
        if is_saved_hf_dataset(path):
            raise _saved_dataset_error(path)
        candidates = [p for p in path.iterdir() if p.is_file() and not p.name.startswith(".") and file_format(p)]
        if not candidates:
            raise DataFileError(f"the directory {path} holds no data files; supported: {_supported()}")
    elif path.is_file():
        candidates = [path]
    else:
        raise DataFileError(f"no such file or directory: {spec}; pass a file, a directory or a glob of data files")
    return candidates


def data_file_entries(files: Iterable[DataFile]) -> dict[str, str]:
    """The identity of each file for loader states: a local file's size and modification time
    (``resume_checks.file_entries``), an object's size and identity as listed."""
    entries = {}
    for file in files:
        if isinstance(file, ObjectFile):
            entries[file.url] = f"{file.size} bytes, identity {file.identity}"
        else:
            entries.update(file_entries([file]))
    return entries


class _CountingReader(io.RawIOBase):
    """Counts the bytes read from a file, so a gzip stream can report compressed progress."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._raw.readinto(buffer)
        self.count += n or 0
        return n


def _open_lines(path: DataFile) -> tuple[BinaryIO, _CountingReader]:
    counter = _CountingReader(path.open("rb"))  # noqa: SIM115 - closed with the returned stream
    raw = io.BufferedReader(counter, buffer_size=1 << 20)
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if path.name.lower().endswith(".gz") else raw
    return stream, counter


def _gzip_error(path: Path, error: Exception, last_line: int | None, counter: _CountingReader) -> DataFileError:
    """The error for a ``.gz`` input that cannot be read to its end, saying how far reading got."""
    state = "ends before its end marker (truncated)" if isinstance(error, EOFError) else f"is corrupt ({error})"
    where = f"at byte {counter.count:,} of the compressed file"
    if last_line is not None:
        where = f"after line {last_line:,}, the last complete one ({where})"
    return DataFileError(
        f"{path}: the gzip data {state} {where}; the file is incomplete or damaged: download or compress it "
        f"again (`gzip -t {path}` checks it)"
    )


def _line_chunks(path: Path, kind: RecordKind, chunk_size: int, chunk_bytes: int) -> Iterator[RecordChunk]:
    """Chunks of non-blank lines, numbered from 1, closed at ``chunk_size`` lines or ``chunk_bytes`` bytes."""
    stream, counter = _open_lines(path)
    with stream, counter._raw:
        items: list[bytes] = []
        locations: list[int] = []
        size = 0
        number = 0
        try:
            for number, line in enumerate(stream, start=1):  # noqa: B007 - the last number names where a read failed
                if not line.strip():
                    continue
                items.append(line)
                locations.append(number)
                size += len(line)
                if len(items) == chunk_size or size >= chunk_bytes:
                    yield RecordChunk(str(path), kind, items, locations, "line", counter.count)
                    items, locations, size = [], [], 0
        except _GZIP_ERRORS as error:
            raise _gzip_error(path, error, number, counter) from None
        if items:
            yield RecordChunk(str(path), kind, items, locations, "line", counter.count)


def _starts_with_array(path: Path) -> bool:
    stream, counter = _open_lines(path)
    with stream, counter._raw:
        try:
            head = stream.read(4096).lstrip()
        except _GZIP_ERRORS as error:
            raise _gzip_error(path, error, None, counter) from None
    return head.startswith(b"[")


def _json_array_chunks(path: Path, chunk_size: int) -> Iterator[RecordChunk]:
    """A ``.json`` file holding one JSON array of records (read whole: such files are small by nature)."""
    stream, counter = _open_lines(path)
    with stream, counter._raw:
        try:
            raw = stream.read()
        except _GZIP_ERRORS as error:
            raise _gzip_error(path, error, None, counter) from None
    try:
        records = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise DataFileError(f"{path}: byte {error.start} is not valid UTF-8; re-encode the file as UTF-8") from None
    except json.JSONDecodeError as error:
        raise DataFileError(
            f"{path}:line {error.lineno}: invalid JSON ({error.msg}, column {error.colno}); fix the file"
        ) from None
    if not isinstance(records, list):
        raise DataFileError(f"{path}: expected a JSON array of records or one JSON object per line")
    size = path.stat().st_size
    for start in range(0, len(records), chunk_size):
        items = records[start : start + chunk_size]
        yield RecordChunk(str(path), "records", items, list(range(start, start + len(items))), "row", size)


# Quoting errors of a strict CSV reader: an unbalanced quote either runs to the end of the file or, more often,
# "closes" at the next quote, which is then followed by text instead of a delimiter.
_CSV_QUOTE_FIX = (
    'close the quote, or write a quote inside a quoted field twice (""); a field that contains quotes must '
    "itself be quoted"
)


def _csv_error(path: Path, start: int, error: Exception) -> DataFileError:
    """The error for a record starting on line ``start`` that the strict CSV reader refused."""
    message = str(error)
    if message == "unexpected end of data":
        return DataFileError(
            f"{path}:line {start}: a quoted field opened in the record starting on this line is never closed (the "
            f"file ends inside it); {_CSV_QUOTE_FIX}"
        )
    if message.endswith("expected after '\"'"):
        return DataFileError(
            f"{path}:line {start}: unbalanced quote in the record starting on this line: its quoted field runs on "
            f"to a later quote that is followed by text ({message}); {_CSV_QUOTE_FIX}"
        )
    if message.startswith("field larger than field limit"):
        return DataFileError(
            f"{path}:line {start}: a field of the record starting on this line is longer than "
            f"{csv.field_size_limit():,} characters, the limit of Python's CSV reader; write such long records as "
            "JSONL or Parquet"
        )
    return DataFileError(f"{path}:line {start}: malformed CSV ({message}); fix the file")


def _csv_chunks(path: Path, chunk_size: int) -> Iterator[RecordChunk]:
    stream, counter = _open_lines(path)
    with stream, counter._raw:
        text = io.TextIOWrapper(stream, encoding="utf-8", errors="strict", newline="")
        # strict: a quote left open is an error rather than a field that silently swallows the following lines
        reader = csv.DictReader(text, strict=True)
        items: list[dict] = []
        locations: list[int] = []
        start = 1
        try:
            reader.fieldnames  # reads the header line, so line_num counts from it  # noqa: B018
            while True:
                start = reader.line_num + 1  # a quoted field may span lines: report where the record starts
                record = next(reader, None)
                if record is None:
                    break
                items.append(record)
                locations.append(start)
                if len(items) == chunk_size:
                    yield RecordChunk(str(path), "records", items, locations, "line", counter.count)
                    items, locations = [], []
        except UnicodeDecodeError:
            raise DataFileError(
                f"{path}:line {reader.line_num + 1}: the file is not valid UTF-8; re-encode it as UTF-8 "
                "(e.g. `iconv -f latin1 -t utf-8`)"
            ) from None
        except csv.Error as error:
            raise _csv_error(path, start, error) from None
        except _GZIP_ERRORS as error:
            raise _gzip_error(path, error, reader.line_num, counter) from None
        if items:
            yield RecordChunk(str(path), "records", items, locations, "line", counter.count)


def _table_columns(path: Path, schema_names: Sequence[str], columns: Sequence[str] | None) -> list[str] | None:
    if columns is None:
        return None
    missing = [c for c in columns if c not in schema_names]
    if missing:
        raise DataFileError(
            f"{path}: missing key(s) {missing}; the file has columns {list(schema_names)}. "
            "Pass the right --json-keys, fix --text-template, or name the fields of instruction records "
            "(--instruction-key, --input-key, --output-key)"
        )
    return list(columns)


def _open_parquet(path: DataFile):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path if isinstance(path, Path) else path.open("rb"))
    except Exception as error:  # noqa: BLE001 - pyarrow raises several types for a corrupt file
        raise DataFileError(f"{path}: not a readable Parquet file ({error})") from None


def _parquet_chunks(
    path: Path, chunk_size: int, columns: Sequence[str] | None, row_groups: range | None = None
) -> Iterator[RecordChunk]:
    """The rows of a Parquet file, or of its ``row_groups`` only (numbered as in the whole file)."""
    parquet = _open_parquet(path)
    selected = _table_columns(path, parquet.schema_arrow.names, columns)
    size = path.stat().st_size
    total = parquet.metadata.num_rows
    row = 0
    if row_groups is not None:
        row = sum(parquet.metadata.row_group(g).num_rows for g in range(row_groups.start))
        size = size * sum(parquet.metadata.row_group(g).num_rows for g in row_groups) // max(total, 1)
        total = sum(parquet.metadata.row_group(g).num_rows for g in row_groups)
    first_row = row
    for batch in parquet.iter_batches(batch_size=chunk_size, columns=selected, row_groups=row_groups):
        items = batch.to_pylist()
        end = row + len(items)
        read = size * (end - first_row) // max(total, 1)
        yield RecordChunk(str(path), "records", items, list(range(row, end)), "row", read)
        row = end


def _arrow_batches(path: Path):
    import pyarrow as pa

    source = pa.memory_map(str(path)) if isinstance(path, Path) else path.open("rb")
    try:
        reader = pa.ipc.open_stream(source)  # Hugging Face writes the IPC stream format
    except pa.ArrowInvalid:
        try:
            file_reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid as error:
            raise DataFileError(f"{path}: not an Arrow IPC stream or file ({error})") from None
        return file_reader.schema, (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
    return reader.schema, iter(reader)


def _arrow_row_count(path: Path) -> int:
    """The rows of an Arrow file, from its batches' headers (mapped, not read)."""
    return sum(batch.num_rows for batch in _arrow_batches(path)[1])


def _arrow_chunks(
    path: Path, chunk_size: int, columns: Sequence[str] | None, rows: range | None = None
) -> Iterator[RecordChunk]:
    """The rows of an Arrow file, or its ``rows`` only (numbered as in the whole file)."""
    schema, batches = _arrow_batches(path)
    selected = _table_columns(path, schema.names, columns)
    size = path.stat().st_size
    total = None if rows is None else max(_arrow_row_count(path), 1)
    first_wanted, stop = (0, None) if rows is None else (rows.start, rows.stop)
    row = 0
    for batch in batches:
        first = row
        row += batch.num_rows
        if stop is not None and first >= stop:
            break
        begin, end = max(first, first_wanted), row if stop is None else min(row, stop)
        if selected is not None:
            batch = batch.select(selected)
        for start in range(begin, end, chunk_size):
            items = batch.slice(start - first, min(chunk_size, end - start)).to_pylist()
            read = size if total is None else size * (start + len(items) - first_wanted) // total
            yield RecordChunk(str(path), "records", items, list(range(start, start + len(items))), "row", read)


def _file_chunks(
    path: Path, fmt: str, chunk_size: int, columns: Sequence[str] | None, chunk_bytes: int
) -> Iterator[RecordChunk]:
    if fmt == "json":
        if path.name.lower().removesuffix(".gz").endswith(".json") and _starts_with_array(path):
            return _json_array_chunks(path, chunk_size)
        return _line_chunks(path, "json_lines", chunk_size, chunk_bytes)
    if fmt == "text":
        return _line_chunks(path, "text_lines", chunk_size, chunk_bytes)
    if fmt == "csv":
        return _csv_chunks(path, chunk_size)
    if fmt == "parquet":
        return _parquet_chunks(path, chunk_size, columns)
    return _arrow_chunks(path, chunk_size, columns)


def iter_record_chunks(
    files: Iterable[Path],
    fmt: str,
    chunk_size: int = 4096,
    columns: Sequence[str] | None = None,
    chunk_bytes: int = 1 << 20,
) -> Iterator[RecordChunk]:
    """Stream the raw records of ``files`` (all of format ``fmt``) in chunks of at most ``chunk_size`` records.

    Args:
        columns: for Parquet and Arrow, the only columns to read; a missing one is a clear error.
        chunk_bytes: line formats also close a chunk once it holds this many bytes, so that chunks of long
            documents stay small.
    """
    ranges = (FileRange(_data_file(path)) for path in files)
    return iter_range_chunks(ranges, fmt, chunk_size, columns, chunk_bytes)


@dataclass(frozen=True)
class FileRange:
    """A part of one input file that holds whole records: bytes ``[start, end)`` of a JSON-lines or text file (the
    lines that start there), row groups ``[start, end)`` of a Parquet file, rows ``[start, end)`` of an Arrow file,
    or the whole file (``end`` None)."""

    path: Path
    start: int = 0
    end: int | None = None


def _line_file_is_cuttable(path: Path, fmt: str) -> bool:
    """Whether a byte range of ``path`` can be read alone: uncompressed lines (not a ``.json`` array)."""
    if fmt not in ("json", "text") or path.name.lower().endswith(".gz"):
        return False
    return not (fmt == "json" and path.name.lower().endswith(".json") and _starts_with_array(path))


def _data_file(path: DataFile | str | os.PathLike) -> DataFile:
    return path if isinstance(path, ObjectFile) else Path(path)


def split_record_ranges(files: Sequence[DataFile], fmt: str, parts: int) -> list[list[FileRange]]:
    """Split ``files`` into ``parts`` consecutive lists of ranges of about equal size, records never cut.

    Reading part 0, then part 1, ... gives every record once, in the order of ``iter_record_chunks``. Line files
    are cut at any byte (a line belongs to the range it starts in), Arrow files between rows (a cut at a fraction
    of the file's bytes falls at that fraction of its rows), Parquet files between row groups, other files
    (compressed, CSV, JSON arrays) not at all: a file or row group goes to the part its first byte is in.
    """
    units: list[tuple[Path, int, int, bool]] = []  # (file, row group or -1, weight, cuttable)
    for path in map(_data_file, files):
        if fmt == "parquet":
            metadata = _open_parquet(path).metadata
            units += [(path, g, metadata.row_group(g).total_byte_size, False) for g in range(metadata.num_row_groups)]
        else:
            cuttable = fmt == "arrow" or _line_file_is_cuttable(path, fmt)
            units.append((path, -1, path.stat().st_size, cuttable))
    total = sum(weight for _, _, weight, _ in units)
    bounds = [total * part // parts for part in range(parts + 1)]
    ranges: list[list[FileRange]] = [[] for _ in range(parts)]
    offset = 0
    for path, group, weight, cuttable in units:
        if cuttable:
            rows = _arrow_row_count(path) if fmt == "arrow" else None
            for part in range(parts):
                start, end = max(offset, bounds[part]) - offset, min(offset + weight, bounds[part + 1]) - offset
                if rows is not None:  # the same fraction of the rows: neighbouring parts meet at one row
                    start, end = rows * start // weight, rows * end // weight
                if start < end:
                    ranges[part].append(FileRange(path, start, end))
        else:
            part = min(max(bisect.bisect_right(bounds, offset) - 1, 0), parts - 1)
            previous = ranges[part][-1] if ranges[part] else None
            if group < 0:
                ranges[part].append(FileRange(path))
            elif previous is not None and previous.path == path and previous.end == group:
                ranges[part][-1] = FileRange(path, previous.start, group + 1)
            else:
                ranges[part].append(FileRange(path, group, group + 1))
        offset += weight
    return ranges


def _newlines_before(path: DataFile, position: int) -> int:
    count = 0
    with path.open("rb") as file:
        while position > 0:
            block = file.read(min(position, 16 << 20))
            if not block:
                break
            count += block.count(b"\n")
            position -= len(block)
    return count


def _line_range_chunks(
    path: DataFile, kind: RecordKind, start: int, end: int, chunk_size: int, chunk_bytes: int
) -> Iterator[RecordChunk]:
    """The non-blank lines that start in bytes ``[start, end)``, numbered as in the whole file."""
    with path.open("rb", 1 << 20) as file:
        position = 0
        if start > 0:
            file.seek(start - 1)
            file.readline()  # to just after the first newline at or after start - 1: the first line starting in range
            position = file.tell()
        number = _newlines_before(path, position)
        items: list[bytes] = []
        locations: list[int] = []
        size = 0
        for line in file:
            if position >= end:
                break
            number += 1
            position += len(line)
            if not line.strip():
                continue
            items.append(line)
            locations.append(number)
            size += len(line)
            if len(items) == chunk_size or size >= chunk_bytes:
                yield RecordChunk(str(path), kind, items, locations, "line", position - start)
                items, locations, size = [], [], 0
        if items:
            yield RecordChunk(str(path), kind, items, locations, "line", position - start)


def iter_range_chunks(
    ranges: Iterable[FileRange],
    fmt: str,
    chunk_size: int = 4096,
    columns: Sequence[str] | None = None,
    chunk_bytes: int = 1 << 20,
) -> Iterator[RecordChunk]:
    """``iter_record_chunks`` over parts of files (from ``split_record_ranges``); ``bytes_read`` counts from the
    start of the first range, a whole file counting its full size."""
    finished_bytes = 0
    for part in ranges:
        if part.end is None:
            chunks = _file_chunks(part.path, fmt, chunk_size, columns, chunk_bytes)
        elif fmt == "parquet":
            chunks = _parquet_chunks(part.path, chunk_size, columns, range(part.start, part.end))
        elif fmt == "arrow":
            chunks = _arrow_chunks(part.path, chunk_size, columns, range(part.start, part.end))
        else:
            kind: RecordKind = "json_lines" if fmt == "json" else "text_lines"
            chunks = _line_range_chunks(part.path, kind, part.start, part.end, chunk_size, chunk_bytes)
        read = 0
        for chunk in chunks:
            read = chunk.bytes_read
            chunk.bytes_read += finished_bytes
            yield chunk
        finished_bytes += part.path.stat().st_size if part.end is None else read


def count_records(files: Iterable[Path], fmt: str, columns: Sequence[str] | None = None) -> int:
    """How many records ``iter_record_chunks`` yields for ``files``, without parsing JSON lines."""
    return sum(len(chunk.items) for chunk in iter_record_chunks(files, fmt, chunk_size=4096, columns=columns))


def is_saved_hf_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def select_hf_split(loaded, split: str, path: Path, fix: str):
    """``loaded`` itself, or its ``split`` when it is a ``DatasetDict``; ``fix`` says how to choose another."""
    from datasets import DatasetDict, IterableDatasetDict

    if not isinstance(loaded, DatasetDict | IterableDatasetDict):
        return loaded
    if split not in loaded:
        raise DataConfigError(f"{path} has splits {sorted(loaded)}, not '{split}'; {fix}")
    return loaded[split]
