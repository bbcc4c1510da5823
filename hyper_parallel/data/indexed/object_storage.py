"""Indexed pairs in object storage: an fsspec URL (``s3://bucket/prefix``, ``gs://...``) as an Indexed prefix.

Owns: the reader backend for such prefixes (``ObjectIndexedDataReader``), its ranged reads through a bounded
block cache, retries of transient errors, and the object identity that index cache keys record. Not responsible
for: parsing or checking the index (``IndexedDataReader`` does, the same for both backends) or credentials (the
file system's own: for S3 the usual ``AWS_*`` variables and files).

The ``.idx`` is fetched whole once per process (a DataLoader worker fetches its own on unpickling) and checked as a
local one. The ``.bin`` is never downloaded whole: a read fetches the blocks of ``block_bytes`` that it touches
with ranged requests and keeps them in a process-wide LRU cache of at most ``cache_bytes``, keyed by URL, object
identity and block. Every ranged request is conditional on the identity seen when the index was read (S3's
``If-Match`` on the ETag, through s3fs), so an object replaced meanwhile is a DataFileError, never tokens of
another version. Needs the ``[s3]`` extra (s3fs) for ``s3://``.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.idx_format import HEADER_SIZE, IdxHeader
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader, is_object_url

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_CACHE_BYTES",
    "BlockCache",
    "ObjectFile",
    "ObjectIndexedDataReader",
    "RemoteObject",
    "list_objects",
    "object_sequence_counts",
    "open_reader",
    "pair_exists",
    "read_small_object",
]

DEFAULT_BLOCK_BYTES = 4 << 20
DEFAULT_CACHE_BYTES = 256 << 20

# Attempts of one ranged request before its error is final, and the wait before the second (doubling after).
_ATTEMPTS = 4
_FIRST_BACKOFF_S = 0.1

# Keys of fsspec's info() that identify one version of an object, most specific first.
_IDENTITY_KEYS = ("VersionId", "ETag", "etag", "generation", "md5Hash", "LastModified", "mtime", "created")

_REUPLOAD = "Upload the pair again (both files), or pass the prefix of an existing pair without .idx/.bin."


def _identity_of(info: dict) -> str:
    """The version of an object as its file system names it (empty when it names none)."""
    return next((str(info[key]) for key in _IDENTITY_KEYS if info.get(key) not in (None, "")), "")


def _url_to_fs(url: str):
    from fsspec.core import url_to_fs  # a dependency of datasets; imported only for object storage

    try:
        return url_to_fs(url)
    except ImportError as error:
        raise DataConfigError(
            f"{url}: no file system for this URL is installed ({error}); pip install 'hyper-parallel-data[s3]' for "
            "s3:// URLs, or the fsspec implementation of its scheme"
        ) from None


def _replaced_object_errors() -> tuple[type[BaseException], ...]:
    """The exceptions by which a file system says that a conditional read found another version of the object."""
    try:
        from s3fs.utils import FileExpired
    except ImportError:
        return ()
    return (FileExpired,)


# Errors that a retry cannot cure: the object is forbidden or is not a file.
_FINAL_ERRORS = (PermissionError, IsADirectoryError, NotADirectoryError)


class RemoteObject:
    """One object of a file system: its size and identity as first seen, and ranged reads of exactly that version.

    Args:
        url: the object's URL.
        prefix: the Indexed prefix it belongs to, for errors; None for a data file of its own.
        size, identity: the object's size and identity as a listing gave them, which saves asking for them.
    """

    def __init__(self, url: str, prefix: str | None = None, size: int | None = None, identity: str = "") -> None:
        self.url, self.prefix = url, prefix
        # Errors name the Indexed prefix the object belongs to, or else the data file alone.
        self._about = f"indexed dataset '{prefix}': " if prefix is not None else ""
        self._since = "its index was read" if prefix is not None else "it was listed"
        self._fix = _REUPLOAD if prefix is not None else "Upload the file again, or leave it out of the data path."
        self._fs, self._path = _url_to_fs(url)
        self._file = None
        self._pid = os.getpid()
        if size is not None:  # as a listing gave it: no request
            self.size, self.identity = size, identity
            return
        try:
            info = self._fs.info(self._path)
        except FileNotFoundError:
            raise DataFileError(
                f"indexed dataset '{prefix}': {url} does not exist. Pass the URL prefix without the .idx/.bin "
                f"extension, check the bucket and key, or upload the pair. {_REUPLOAD}"
            ) from None
        except PermissionError as error:
            raise DataFileError(
                f"{self._about}{url} cannot be read ({error}); check the credentials and the object's permissions"
            ) from None
        if info.get("type") == "directory":
            raise DataFileError(f"{self._about}{url} is a directory, where a data file belongs")
        self.size = int(info["size"])
        self.identity = _identity_of(info)

    def _open_file(self):
        """A file object of the version first seen: s3fs makes each of its ranged requests conditional on it."""
        if self._file is None or self._pid != os.getpid():
            # A forked DataLoader worker must not share the parent's connections or event loop.
            self._fs, _ = _url_to_fs(self.url)
            self._pid = os.getpid()
            self._file = self._fs.open(self._path, "rb", cache_type="none")
            seen = _identity_of(getattr(self._file, "details", {}) or {})
            if self.identity and seen and seen != self.identity:
                self._file = None
                raise self._changed_error()
        return self._file

    def _changed_error(self) -> DataFileError:
        if self.prefix is not None:
            consequence, kind = "its tokens would no longer match the index", "pair"
        else:
            consequence, kind = "records of two versions would be mixed", "file"
        return DataFileError(
            f"{self._about}{self.url} changed after {self._since} (identity {self.identity} then another), so "
            f"{consequence}. Restart the job once the upload is complete; never overwrite a {kind} that a job reads. "
            f"{self._fix}"
        )

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes from ``offset``, fewer only where the object ends; transient errors are retried with
        backoff ``_ATTEMPTS`` times in all."""
        replaced = _replaced_object_errors()
        expected = max(0, min(size, self.size - offset))
        for attempt in range(_ATTEMPTS):
            try:
                handle = self._open_file()
                handle.seek(offset)
                data = handle.read(size)
                if len(data) == expected:
                    return data
                # Some file systems turn a failed request into fewer bytes: never hand those on as tokens.
                raise ConnectionError(f"{len(data)} bytes came back where {expected} were asked for")
            except replaced:
                raise self._changed_error() from None
            except FileNotFoundError:
                raise DataFileError(f"{self._about}{self.url} was deleted after {self._since}. {self._fix}") from None
            except DataFileError:
                raise
            except Exception as error:
                if isinstance(error, _FINAL_ERRORS):
                    raise DataFileError(
                        f"{self._about}cannot read bytes [{offset}, {offset + size}) of {self.url}: {error}"
                    ) from None
                last = error
                self._file = None  # a dropped connection leaves the file object unusable
                if attempt + 1 < _ATTEMPTS:
                    time.sleep(_FIRST_BACKOFF_S * 2**attempt)
        raise DataFileError(
            f"{self._about}reading bytes [{offset}, {offset + size}) of {self.url} failed "
            f"{_ATTEMPTS} times; the last error: {type(last).__name__}: {last}. Check the network and the storage "
            "service, then resume from the last checkpoint."
        )


class ObjectStat(NamedTuple):
    """What the record readers ask of a file's status: its size."""

    st_size: int


@dataclass(frozen=True)
class ObjectFile:
    """A data file in object storage (a JSONL, Parquet... object) as a listing found it: where local files are
    ``Path`` objects, the record readers take these, through ``name``, ``stat()`` and ``open()``.

    Attributes:
        url: the object's URL.
        size: its size in bytes.
        identity: its version (ETag or version id) when listed; a stream of it refuses any other version.
    """

    url: str
    size: int
    identity: str

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    def stat(self) -> ObjectStat:
        return ObjectStat(self.size)

    def open(self, mode: str = "rb", buffer_size: int = DEFAULT_BLOCK_BYTES) -> io.BufferedReader:
        """A seekable binary stream of the version listed, read by ranged requests of ``buffer_size`` bytes with the
        retries of ``RemoteObject``; an object replaced or deleted since the listing is a DataFileError."""
        if mode != "rb":
            raise ValueError(f"{self.url}: objects open for reading in binary ('rb'), not {mode!r}")
        return io.BufferedReader(_ObjectStream(RemoteObject(self.url, None, self.size, self.identity)), buffer_size)

    def __str__(self) -> str:
        return self.url


class _ObjectStream(io.RawIOBase):
    """A remote object as a raw binary file: each read is one ranged request of ``RemoteObject.read``."""

    def __init__(self, remote: RemoteObject) -> None:
        self._remote = remote
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._remote.size}[whence]
        self._position = max(0, start + offset)
        return self._position

    def readall(self) -> bytes:  # in one request, where io's default reads 8 KiB at a time
        data = self._remote.read(self._position, max(0, self._remote.size - self._position))
        self._position += len(data)
        return data

    def readinto(self, buffer) -> int:
        if self._position >= self._remote.size:
            return 0
        data = self._remote.read(self._position, len(buffer))
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)


def list_objects(url: str, is_glob: bool) -> tuple[list[ObjectFile], bool]:
    """The objects that ``url`` names, sorted by path: a glob's matches, the objects directly in a directory, or the
    object itself (none when nothing is there); and whether ``url`` is a directory. Read afresh each time, never
    from the file system's cache of an earlier listing, so that identities are current."""
    fs, path = _url_to_fs(url)
    fs.invalidate_cache()
    directory = False
    try:
        if is_glob:
            infos = list(fs.glob(path, detail=True).values())
        else:
            try:
                infos = [fs.info(path)]
            except FileNotFoundError:
                return [], False
            directory = infos[0].get("type") == "directory"
            if directory:
                infos = fs.ls(path, detail=True)
    except PermissionError as error:
        raise DataFileError(
            f"{url} cannot be listed ({error}); check the credentials and the bucket's permissions"
        ) from None
    files = [
        ObjectFile(fs.unstrip_protocol(info["name"]), int(info["size"]), _identity_of(info))
        for info in infos
        if info.get("type") == "file"
    ]
    # By path components, as local paths sort: "d/a" before "d-x/b", where the plain strings sort the other way.
    return sorted(files, key=lambda file: file.url.split("/")), directory


class BlockCache:
    """At most ``capacity_bytes`` of fixed-size blocks, the least recently used dropped first; ``hits`` and
    ``misses`` count the lookups that found or did not find their block."""

    def __init__(self, block_bytes: int, capacity_bytes: int) -> None:
        self.block_bytes, self.capacity_bytes = block_bytes, capacity_bytes
        self._blocks: OrderedDict[tuple, bytes] = OrderedDict()
        self._held = 0
        self.hits = self.misses = 0
        self._lock = threading.Lock()  # a DataLoader with pin_memory or a prefetch thread may share a reader

    def get(self, key: tuple) -> bytes | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                self.misses += 1
            else:
                self.hits += 1
                self._blocks.move_to_end(key)
            return block

    def put(self, key: tuple, block: bytes) -> None:
        with self._lock:
            if key in self._blocks:
                return
            self._blocks[key] = block
            self._held += len(block)
            while self._held > self.capacity_bytes and len(self._blocks) > 1:
                _, dropped = self._blocks.popitem(last=False)
                self._held -= len(dropped)

    def clear(self) -> None:
        """Drop every block (the counters keep counting)."""
        with self._lock:
            self._blocks.clear()
            self._held = 0

    @property
    def held_bytes(self) -> int:
        return self._held

    @property
    def hit_rate(self) -> float:
        """The fraction of lookups so far that found their block (0 before any)."""
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


_CACHES: dict[tuple[int, int], BlockCache] = {}


def _renew_cache_locks() -> None:
    """In a forked child: a lock the parent held at the fork would stay held forever."""
    for cache in _CACHES.values():
        cache._lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_cache_locks)


def block_cache(block_bytes: int, cache_bytes: int) -> BlockCache:
    """The process-wide cache of these settings: all prefixes of a blend share one bound."""
    return _CACHES.setdefault((block_bytes, cache_bytes), BlockCache(block_bytes, cache_bytes))


def _check_cache_settings(block_bytes: int, cache_bytes: int) -> None:
    for name, value in (("block_bytes", block_bytes), ("cache_bytes", cache_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataConfigError(f"object storage {name} must be a positive integer of bytes, got {value!r}")
    if cache_bytes < block_bytes:
        raise DataConfigError(
            f"object storage cache_bytes ({cache_bytes}) must hold at least one block of block_bytes ({block_bytes})"
        )


class ObjectIndexedDataReader(IndexedDataReader):
    """``IndexedDataReader`` over a pair in object storage: the same index checks, reads and id checks; the
    ``.bin`` read through ranged requests and the block cache instead of a map (so no slicing).

    Args:
        path_prefix: the URL prefix, without ``.idx``/``.bin``.
        multimodal: as for ``IndexedDataReader``.
        block_bytes: bytes per ranged request and cache block.
        cache_bytes: the bound of the process-wide block cache.
    """

    def __init__(
        self,
        path_prefix: str,
        multimodal: bool = False,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        _check_cache_settings(block_bytes, cache_bytes)
        self.block_bytes, self.cache_bytes = block_bytes, cache_bytes
        super().__init__(_strip_extension(path_prefix), mmap=False, multimodal=multimodal)

    def _open(self) -> None:
        self._bin_object = RemoteObject(self.path_prefix + ".bin", self.path_prefix)
        index_object = RemoteObject(self.path_prefix + ".idx", self.path_prefix)
        index = index_object.read(0, index_object.size)
        self._parse_index(index, len(index), self._bin_object.size)
        self._identity = (len(index), index_object.identity, self._bin_object.size, self._bin_object.identity)
        self._cache = block_cache(self.block_bytes, self.cache_bytes)

    def _open_bin(self) -> None:
        self._check_before_reads()
        self._bin_opened = True
        self._arm_plain_items()

    def _read_bytes(self, byte_offset: int, size: int) -> bytes:
        if size <= 0:
            return b""
        block_bytes, end = self.block_bytes, min(byte_offset + size, self._bin_size)
        first, last = byte_offset // block_bytes, (end - 1) // block_bytes
        blocks = [self._block(b) for b in range(first, last + 1)]
        joined = blocks[0] if len(blocks) == 1 else b"".join(blocks)
        start = byte_offset - first * block_bytes
        return joined[start : start + size]

    def _block(self, number: int) -> bytes:
        key = (self._bin_object.url, self._bin_object.identity, self.block_bytes, number)
        block = self._cache.get(key)
        if block is None:
            offset = number * self.block_bytes
            block = self._bin_object.read(offset, min(self.block_bytes, self._bin_size - offset))
            self._cache.put(key, block)
        return block

    @property
    def file_identity(self) -> dict[str, int | str]:
        """Size and identity (ETag or version) of the ``.idx`` and ``.bin`` objects as opened: what index cache keys
        record, so that a pair uploaded again never reuses indices built from the old one."""
        idx_bytes, idx_identity, bin_bytes, bin_identity = self._identity
        return {
            "idx_bytes": idx_bytes,
            "idx_identity": idx_identity,
            "bin_bytes": bin_bytes,
            "bin_identity": bin_identity,
        }

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "block_bytes": self.block_bytes, "cache_bytes": self.cache_bytes}


def _strip_extension(url: str) -> str:
    stem, extension = os.path.splitext(url)
    return stem if extension in (".idx", ".bin") else url


def open_reader(
    prefix: str,
    mmap: bool = True,
    multimodal: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
) -> IndexedDataReader:
    """The reader of ``prefix`` for its scheme: an ``ObjectIndexedDataReader`` for a URL, else a local one."""
    if is_object_url(prefix):
        return ObjectIndexedDataReader(prefix, multimodal, block_bytes, cache_bytes)
    return IndexedDataReader(prefix, mmap=mmap, multimodal=multimodal)


def pair_exists(prefix: str) -> bool:
    """Whether ``<prefix>.idx`` or ``<prefix>.bin`` exists, locally or in object storage."""
    if not is_object_url(prefix):
        return os.path.exists(f"{prefix}.idx") or os.path.exists(f"{prefix}.bin")
    fs, path = _url_to_fs(prefix)
    return fs.exists(path + ".idx") or fs.exists(path + ".bin")


def read_small_object(url: str) -> bytes | None:
    """The whole object at ``url`` (a ``.meta.json`` beside a prefix), or None when there is none."""
    fs, path = _url_to_fs(url)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None


def object_sequence_counts(prefix: str) -> tuple[int, int]:
    """``(sequence_count, document_count)`` of the ``.idx`` object of ``prefix``, from its first bytes and size."""
    index_object = RemoteObject(prefix + ".idx", prefix)
    header = IdxHeader.parse(index_object.read(0, HEADER_SIZE), index_object.url)
    header.check_file_size(index_object.size, index_object.url)
    return header.sequence_count, header.document_count
