"""On-disk caches of index arrays (document, sample, shuffle and blending indices).

Owns: the cache key, the file names, each entry's manifest, atomic publication, checked loading and the repair
of a damaged entry. The key is the MD5 of a JSON description that lists every setting that changes the arrays
and the identity of the data files behind them, unlike megatron-core's, whose key omits
``add_extra_token_to_sequence`` and others, so that it silently reuses stale indices. Arrays are written under
temporary names and renamed; the description file, written last, marks the entry complete and holds the manifest:
the full description, each array's dtype, shape, ``.npy`` header, file size and the xxh3 checksums of its 64 KiB
blocks, and the manifest's own checksum. Loading checks that checksum, compares the stored description field by
field with the one asked for (an entry copied or renamed from another split, seed or data set is never read), each
array's dtype and shape with what the caller expects (the length the split must have), every file's size and
header with the manifest and the checksums of some or all blocks (``cache_verification``); an entry that fails is
rebuilt with a warning naming the file and what differs, or refused with a ``DataFileError`` where the directory
is read-only. No file of an entry is read or written through a symbolic link: a link at one of its names (or at
its lock) is refused with a ``DataFileError`` naming it.
One process builds while the others wait (``parallel.build_barrier``); everyone then memory-maps the files.
Not responsible for: computing the arrays (``indexed_helpers``) or deciding what they mean (the datasets).
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import json
import math
import mmap
import os
import random
import stat
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

import numpy as np
from xxhash import xxh3_64_intdigest

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.file_writes import NO_FOLLOW, atomic_file, link_refusal
from hyper_parallel.data.indexed.indexed_data_reader import is_object_url
from hyper_parallel.data.parallel.build_barrier import DEFAULT_LOCK_TIMEOUT_S, build_once, description_differences

__all__ = ["CacheOptions", "ExpectedArray", "IndexCache", "LazyArrays", "array_property", "writable_directory"]

logger = get_logger("hyper_parallel.data.indexed.index_cache")

# The hashed form of a description: compact, by json's C encoder; one instance, since making one per key costs
# microseconds at start-up with thousands of prefixes. Same output as ``json.dumps(d, separators=(",", ":"))``.
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))

_BLOCK_BYTES = 1 << 16  # one checksum per block of the .npy file, header included
_RANDOM_BLOCKS = 2  # blocks a "sampled" check reads besides the first and the last
_RANDOM = random.Random()  # seeded per process, so that ranks and jobs check different blocks
_READ = os.O_RDONLY | NO_FOLLOW
_CHECKSUM_KEY = "manifest_xxh3_64"


@dataclass(frozen=True, kw_only=True)
class CacheOptions:
    """How index cache entries are placed, read and built: decided once for a whole build (from the config and
    whether a process group builds together: ``IndexedDataConfig.cache_options``) and passed down unchanged.

    Attributes:
        directory: where entries go (``data_cache_path``); None: beside each prefix for its datasets
            (``directory_for``), in memory for blends and mock data.
        synchronize: the ranks of a process group build together: rank 0 builds each entry while the others wait,
            so every rank must build the same datasets in the same order. False: every process on its own, an
            entry built once under its file lock.
        assume_complete: every entry exists, written by a build that checked its sources (``fast_cache_load``): no
            existence checks and no waiting; each array is still checked when it is mapped.
        defer: map (and check) each array on its first access (``defer_npy_index_mmap``).
        verification: what a load checks: ``"sizes"``, ``"sampled"`` or ``"full"`` (``cache_verification``).
        lock_timeout: seconds to wait for another process building an entry (``cache_lock_timeout``).
    """

    directory: str | None = None
    synchronize: bool = False
    assume_complete: bool = False
    defer: bool = False
    verification: str = "sampled"
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S

    def directory_for(self, prefix: str | None) -> str | None:
        """Where the entries of a dataset over ``prefix`` go: ``directory``, else beside the prefix, as
        megatron-core puts them; None (in memory) for mock data, which has no prefix, and for a prefix in object
        storage, whose caches stay local."""
        if self.directory is not None or prefix is None or is_object_url(prefix):
            return self.directory
        return f"{prefix}/cache/GPTDataset_indices"


class _Unusable(Exception):
    """Why an entry cannot be read as it is: not built yet (``damage`` None), or damaged."""

    def __init__(self, path: str, damage: str | None = None) -> None:
        super().__init__(path, damage)
        self.path = path
        self.damage = damage


class ExpectedArray(NamedTuple):
    """What an array of an entry must be, known before the entry is read: an array of another shape or dtype kind
    comes from another entry (or a forged one) and is never read.

    Attributes:
        shape: the array's shape; the split fixes its length.
        kinds: the numpy dtype kinds it may have: index arrays hold integers.
    """

    shape: tuple[int, ...]
    kinds: str = "iu"


_NOTHING_EXPECTED: Mapping[str, ExpectedArray] = MappingProxyType({})


class _Request(NamedTuple):  # a NamedTuple: made once per source at start-up, and cheaper than a dataclass
    """What a caller asked of one entry: its arrays, how to build them and how to read them."""

    names: tuple[str, ...]
    build: Callable[[], dict[str, np.ndarray]] | None  # None: only checked, never built
    verification: str
    lock_timeout: float
    assume_complete: bool
    expected: Mapping[str, ExpectedArray]


class _ArrayRecord(NamedTuple):
    """One array's manifest, parsed and checked for consistency."""

    dtype: np.dtype
    shape: tuple[int, ...]
    file_bytes: int
    block_bytes: int
    digests: np.ndarray
    header: bytes  # the .npy header: everything before the data


def _manifest_checksum(compact_description: str, arrays: dict) -> str:
    """The manifest's own checksum: xxh3-64 (hex) of the compact JSON of the description, then of the arrays."""
    return f"{xxh3_64_intdigest((compact_description + _COMPACT_JSON.encode(arrays)).encode()):016x}"


def _block_digests(header: bytes, array: np.ndarray) -> str:
    """Base64 of the little-endian xxh3_64 of each ``_BLOCK_BYTES`` of the file ``header + array``, from memory."""
    data = array.reshape(-1).view(np.uint8)
    head = _BLOCK_BYTES - len(header)  # the first block holds the header and the first data bytes
    digests = [xxh3_64_intdigest(header + data[:head].tobytes())]
    digests += [xxh3_64_intdigest(data[start : start + _BLOCK_BYTES]) for start in range(head, data.size, _BLOCK_BYTES)]
    return base64.b64encode(np.array(digests, dtype="<u8").tobytes()).decode("ascii")


def _check_blocks(path: str, buffer: mmap.mmap, digests: np.ndarray, block_bytes: int, full: bool) -> None:
    """Compare the checksums of every block (``full``), or of the first, the last and two random ones."""
    blocks = len(digests)
    if full or blocks <= 2 + _RANDOM_BLOCKS:
        chosen = range(blocks)
    else:
        chosen = (0, blocks - 1, *_RANDOM.sample(range(1, blocks - 1), _RANDOM_BLOCKS))
    view = memoryview(buffer)
    for block in chosen:
        start = block * block_bytes
        if xxh3_64_intdigest(view[start : start + block_bytes]) != digests[block]:
            end = min(start + block_bytes, len(buffer))
            raise _Unusable(
                path,
                f"bytes {start} to {end} do not match their checksum in the manifest: the file was altered or "
                "damaged after it was written",
            )


class LazyArrays(Mapping):
    """The arrays of one entry, each memory-mapped and checked against the manifest on its first access.

    A problem found then (a file missing, cut short or altered) is repaired by rebuilding the entry under its
    file lock, with a warning, or refused with a ``DataFileError`` (read-only directory; an entry missing under
    ``fast_cache_load``). Pickled, it keeps no mapping: a DataLoader worker maps and checks the files itself.
    """

    def __init__(self, cache: IndexCache, request: _Request) -> None:
        self._cache = cache
        self._request = request
        self._records: dict[str, _ArrayRecord] | None = None
        self._arrays: dict[str, np.ndarray] = {}

    def _map(self, name: str) -> np.ndarray:
        if self._records is None:
            self._records = self._cache._read_manifest(self._request)
        return self._cache._map(name, self._records[name], self._request.verification)

    def map_all(self) -> LazyArrays:
        """Map and check every array now; a problem raises ``_Unusable``."""
        for name in self._request.names:
            if name not in self._arrays:
                self._arrays[name] = self._map(name)
        return self

    def check_sizes(self) -> LazyArrays:
        """Check the manifest and every file's size now, and leave the mapping for first access."""
        self._records = self._cache._read_manifest(self._request)
        for name in self._request.names:
            self._cache._check_size(name, self._records[name])
        return self

    def __getitem__(self, name: str) -> np.ndarray:
        array = self._arrays.get(name)
        if array is None:
            if name not in self._request.names:
                raise KeyError(name)
            try:
                array = self._map(name)
            except _Unusable as problem:
                self._cache._repair(problem, self._request)
                self._records = None
                self._arrays.clear()  # arrays mapped before the repair may come from the damaged entry
                try:
                    array = self._map(name)
                except _Unusable as again:
                    raise DataFileError(
                        f"{again.path}: {again.damage or 'missing'}, even after the index cache entry was rebuilt; "
                        "check the file system of the cache directory, or set data_cache_path to another one"
                    ) from None
            self._arrays[name] = array
        return array

    def __iter__(self):
        return iter(self._request.names)

    def __len__(self) -> int:
        return len(self._request.names)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_records": None, "_arrays": {}}


def array_property(name: str) -> property:
    """A read-only attribute for the cached array ``name`` of a dataset's ``_arrays`` (megatron-core's names)."""
    return property(lambda dataset: dataset._arrays[name], doc=f"The cached ``{name}`` array.")


def writable_directory(directory: Path) -> bool:
    """Whether ``directory`` exists (or can be created) and accepts new files."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            return True
    except OSError:
        return False


class IndexCache:
    """One cache entry: ``<dir>/<md5>-<kind>-<split>-{description.txt,<name>.npy}``.

    The description file holds ``{"description": ..., "arrays": {name: manifest}, "manifest_xxh3_64": ...}``,
    indented; each manifest records the array's ``dtype``, ``shape``, ``npy_header`` (latin-1), ``file_bytes``,
    ``block_bytes`` and ``xxh3_64`` (base64 of the blocks' little-endian checksums); ``manifest_xxh3_64`` is the
    checksum of the description and the arrays' manifests (``_manifest_checksum``).

    Args:
        directory: the cache directory, or None to keep arrays in memory only.
        kind: the dataset class name, e.g. ``"GPTDataset"``.
        split: ``"train"``, ``"valid"`` or ``"test"``.
        description: every setting that determines the arrays.
    """

    def __init__(self, directory: str | os.PathLike | None, kind: str, split: str, description: dict) -> None:
        self.description = description
        self._directory_text = None if directory is None else os.fspath(directory)
        self._kind_split = f"{kind}-{split}"
        self._problem: _Unusable | None = None  # what the last soundness check found
        self._mapped: LazyArrays | None = None  # the arrays the last soundness check mapped

    @cached_property
    def _compact_description(self) -> str:
        """The hashed form of the description; the indented, readable form is written at build time."""
        return _COMPACT_JSON.encode(self.description)

    @cached_property
    def key(self) -> str:
        """The MD5 of the compact description, computed when first needed: a deferred load needs it only when an
        array is first read, which keeps start-up with thousands of sources cheap."""
        return hashlib.md5(self._compact_description.encode("utf-8"), usedforsecurity=False).hexdigest()

    @cached_property
    def _stem(self) -> str:
        return f"{self.key}-{self._kind_split}"

    @property
    def directory(self) -> Path | None:
        return None if self._directory_text is None else Path(self._directory_text)

    def path(self, name: str) -> Path:
        """The file of array ``name``, or of the description for ``"description"``."""
        assert self.directory is not None
        return Path(self._file(name))

    def _file(self, name: str) -> str:
        suffix = "txt" if name == "description" else "npy"
        return f"{self._directory_text}/{self._stem}-{name}.{suffix}"

    # -- reading --------------------------------------------------------------------------------------------

    def _read_manifest(self, request: _Request) -> dict[str, _ArrayRecord]:
        """The parsed manifests of the requested arrays, once the description file is found to be this entry's:
        its checksum holds, its description equals the one asked for and every array is what ``request`` expects.
        ``_Unusable`` if the entry is not built (no description) or fails a check."""
        path = self._file("description")
        try:
            with open(os.open(path, _READ), "rb") as f:
                text = f.read()
        except (FileNotFoundError, NotADirectoryError):  # not built, or no cache directory at all
            raise _Unusable(path) from None
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise link_refusal(path) from None
            raise _Unusable(path, f"the description cannot be read ({error.strerror})") from None
        try:
            manifest = json.loads(text)
            stored_description, arrays = _COMPACT_JSON.encode(manifest["description"]), manifest["arrays"]
            checksum = manifest.get(_CHECKSUM_KEY)
            if checksum is None:
                raise _Unusable(
                    path, "the manifest has no checksum (it was written by an older version of the library)"
                )
            if checksum != _manifest_checksum(stored_description, arrays):
                raise _Unusable(
                    path, "the manifest does not match its checksum: it was edited or damaged after it was written"
                )
            if stored_description != self._compact_description:
                raise _Unusable(path, self._foreign_entry(manifest["description"]))
            records = {name: self._record(name, arrays[name]) for name in request.names}
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise _Unusable(
                path, f"the description does not parse as an index cache manifest ({type(error).__name__}: {error})"
            ) from None
        for name, wanted in request.expected.items():
            record = records[name]
            if record.shape != tuple(wanted.shape) or record.dtype.kind not in wanted.kinds:
                raise _Unusable(
                    path,
                    f"the manifest describes {name} as {record.dtype} of shape {record.shape}, but this entry needs "
                    f"dtype kind {'/'.join(wanted.kinds)} of shape {tuple(wanted.shape)}: its files come from "
                    "another entry",
                )
        return records

    def _foreign_entry(self, stored: object) -> str:
        """What differs between the description stored in an entry's files and the one this entry is for."""
        fields = "; ".join(
            f"{where}: this entry has {ours}, the files have {theirs}"
            for where, ours, theirs in description_differences(self.description, stored)
        )
        return (
            f"its description is not this entry's ({fields or 'they differ'}): its files were copied or renamed "
            "from another entry (another split, seed or data set), so they are not read"
        )

    def _record(self, name: str, record: dict) -> _ArrayRecord:
        """One array's manifest, parsed, or ``_Unusable`` naming it when it is malformed or inconsistent."""
        try:
            dtype = np.dtype(record["dtype"])
            shape = tuple(int(n) for n in record["shape"])
            file_bytes, block_bytes = int(record["file_bytes"]), int(record["block_bytes"])
            digests = np.frombuffer(base64.b64decode(record["xxh3_64"], validate=True), dtype="<u8")
            header = record["npy_header"].encode("latin-1")
            usable = dtype.kind in "biuf" and block_bytes > 0 and min(shape, default=0) >= 0
            sized = len(header) + math.prod(shape) * dtype.itemsize == file_bytes
            if usable and sized and len(digests) == -(-file_bytes // block_bytes):
                return _ArrayRecord(dtype, shape, file_bytes, block_bytes, digests, header)
        except (KeyError, TypeError, ValueError, AttributeError, binascii.Error):
            pass
        raise _Unusable(self._file("description"), f"the manifest of {name} is malformed: {record!r:.200}")

    def _check_size(self, name: str, record: _ArrayRecord) -> None:
        path = self._file(name)
        try:
            status = os.lstat(path)
        except FileNotFoundError:
            raise _Unusable(path, "the array file is missing") from None
        if stat.S_ISLNK(status.st_mode):
            raise link_refusal(path)
        if status.st_size != record.file_bytes:
            raise _Unusable(path, _size_damage(status.st_size, record.file_bytes))

    def _map(self, name: str, record: _ArrayRecord, verification: str) -> np.ndarray:
        """Map array ``name`` after checking its size and header and, unless ``verification`` is ``"sizes"``, its
        checksums."""
        path = self._file(name)
        try:
            fd = os.open(path, _READ)
        except FileNotFoundError:
            raise _Unusable(path, "the array file is missing") from None
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise link_refusal(path) from None
            raise _Unusable(path, f"the array file cannot be opened ({error.strerror})") from None
        try:
            size = os.fstat(fd).st_size
            if size != record.file_bytes:
                raise _Unusable(path, _size_damage(size, record.file_bytes))
            buffer = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as error:  # a directory, or an empty file
            raise _Unusable(path, f"the array file cannot be mapped ({error})") from None
        finally:
            os.close(fd)
        header_bytes = len(record.header)
        if buffer[:header_bytes] != record.header:
            raise _Unusable(
                path,
                f"its .npy header does not match the dtype {record.dtype} and shape {record.shape} of its manifest: "
                "the file was replaced after it was written",
            )
        if verification != "sizes":
            _check_blocks(path, buffer, record.digests, record.block_bytes, full=verification == "full")
        # A plain ndarray view: indexing a np.memmap subclass costs microseconds per call.
        count = math.prod(record.shape)
        return np.frombuffer(buffer, dtype=record.dtype, count=count, offset=header_bytes).reshape(record.shape)

    def _present(self, request: _Request, defer: bool) -> LazyArrays:
        """The entry's arrays, checked now (or, deferred, the manifest and sizes now and the rest on first access)."""
        arrays = LazyArrays(self, request)
        return arrays.check_sizes() if defer else arrays.map_all()

    def _sound(self, request: _Request, full: bool = False) -> bool:
        """Whether the entry is complete and passes its checks (all of them with ``full``); keeps what it found."""
        if full:
            request = request._replace(verification="full")
        try:
            self._mapped = LazyArrays(self, request).map_all()
        except _Unusable as problem:
            self._problem, self._mapped = problem, None
            return False
        self._problem = None
        return True

    def is_complete(
        self,
        names: tuple[str, ...],
        verification: str = "sampled",
        expected: Mapping[str, ExpectedArray] = _NOTHING_EXPECTED,
    ) -> bool:
        """Whether the entry is published, is this entry's and every file matches its manifest."""
        return self._sound(_Request(tuple(names), None, verification, DEFAULT_LOCK_TIMEOUT_S, False, expected))

    # -- writing --------------------------------------------------------------------------------------------

    def _write_array(self, name: str, array: np.ndarray) -> dict:
        """Write one array under a temporary name, rename it, and return its manifest."""
        array = np.ascontiguousarray(array)
        with atomic_file(self.path(name), "w+b") as f:
            np.save(f, array, allow_pickle=False)
            file_bytes = f.seek(0, os.SEEK_END)
            f.seek(0)
            header = f.read(file_bytes - array.nbytes)
        return {
            "dtype": array.dtype.str,
            "shape": list(array.shape),
            "npy_header": header.decode("latin-1"),
            "file_bytes": file_bytes,
            "block_bytes": _BLOCK_BYTES,
            "xxh3_64": _block_digests(header, array),
        }

    def _publish(self, arrays: dict[str, np.ndarray]) -> None:
        records = {name: self._write_array(name, array) for name, array in arrays.items()}
        checksum = _manifest_checksum(self._compact_description, records)
        manifest = {"description": self.description, "arrays": records, _CHECKSUM_KEY: checksum}
        with atomic_file(self.path("description")) as f:  # last: marks the entry complete
            f.write(json.dumps(manifest, indent=4).encode("utf-8"))

    def _build_and_publish(self, request: _Request) -> None:
        problem = self._problem
        if problem is not None and problem.damage is not None:
            logger.warning("%s: %s; rebuilding the %s indices", problem.path, problem.damage, self._stem)
        logger.info("building the %s indices in %s", self._stem, self.directory)
        arrays = request.build()
        self._publish(arrays)
        megabytes = sum(array.nbytes for array in arrays.values()) / 2**20
        logger.info(
            "index cache written: %s, %d arrays, %.1f MiB, in %s", self._stem, len(arrays), megabytes, self.directory
        )

    # -- building and repairing -----------------------------------------------------------------------------

    def _refusal(self, problem: _Unusable) -> DataFileError:
        return DataFileError(
            f"{problem.path}: {problem.damage}. The index cache entry {self._stem} is damaged and its directory "
            f"{self.directory} is not writable, so it cannot be rebuilt here. Delete the entry's files "
            f"({self._stem}-*) and rebuild them where the directory is writable (any build with the same settings, "
            "or `python -m hyper_parallel.data.tools.prepare_cache`), or set data_cache_path to a writable directory"
        )

    def _build_under_lock(self, request: _Request, synchronize: bool, damaged: bool) -> None:
        build_once(
            lambda: self._sound(request, full=damaged),  # after damage, sampled blocks could miss it
            lambda: self._build_and_publish(request),
            self.directory / f"{self._stem}.lock",
            synchronize=synchronize,
            description=self.description,
            lock_timeout=request.lock_timeout,
        )

    def _repair(self, problem: _Unusable, request: _Request) -> None:
        """Rebuild an entry found missing or damaged when its arrays were first read, or refuse to."""
        if problem.damage is None and request.assume_complete:
            raise DataFileError(
                f"{problem.path}: no such index cache entry, but fast_cache_load assumes that every entry exists. "
                "Prepare the cache with `python -m hyper_parallel.data.tools.prepare_cache` and the same settings "
                "and data files (their sizes and modification times are part of the key: data files copied or "
                "rewritten since need a new cache), or set fast_cache_load: false to build missing entries"
            )
        if not writable_directory(self.directory):
            if problem.damage is None:
                raise DataFileError(
                    f"{problem.path}: the index cache entry {self._stem} disappeared and {self.directory} is not "
                    "writable, so it cannot be rebuilt; set data_cache_path to a writable directory"
                )
            raise self._refusal(problem)
        self._build_under_lock(request, synchronize=False, damaged=problem.damage is not None)

    def get_or_build(
        self,
        names: tuple[str, ...],
        build: Callable[[], dict[str, np.ndarray]],
        options: CacheOptions = CacheOptions(),  # noqa: B008 - frozen, so one shared default is safe
        expected: Mapping[str, ExpectedArray] = _NOTHING_EXPECTED,
    ) -> Mapping[str, np.ndarray]:
        """Load the entry, building it first if needed (once, whoever else asks at the same time).

        Args:
            names: the arrays of the entry.
            build: computes them.
            options: how to read and build it (the ``directory`` is this entry's, given when it was made).
            expected: what some arrays must be (their shape and dtype kinds), known before they are read; an
                entry whose arrays differ is rebuilt, or refused where it cannot be.
        """
        if self._directory_text is None:
            logger.debug("%s indices built in memory (no cache directory)", self._kind_split)
            return build()
        defer, together = options.defer, options.synchronize
        request = _Request(names, build, options.verification, options.lock_timeout, options.assume_complete, expected)
        if options.assume_complete:
            # Not the key: fast_cache_load with deferred mapping computes it only when an array is first read.
            logger.debug(
                "index cache assumed complete (fast_cache_load): %s in %s", self._kind_split, self._directory_text
            )
            arrays = LazyArrays(self, request)
            if not defer:
                for name in request.names:
                    arrays[name]  # noqa: B018 - map (and check, or repair) now
            return arrays
        damage = None
        if not together:
            # A sound entry never changes (it is published by renames), so reading it needs no lock.
            try:
                arrays = self._present(request, defer)
            except _Unusable as problem:
                damage = problem if problem.damage else None
            else:
                logger.debug("index cache hit: %s in %s", self._stem, self._directory_text)
                return arrays
        if not writable_directory(self.directory):
            return self._read_only(request, defer, damage)
        self._build_under_lock(request, together, damaged=damage is not None)
        if self._mapped is not None:  # found sound under the lock: built by another process
            logger.debug("index cache hit: %s in %s", self._stem, self._directory_text)
        if self._mapped is not None and not defer:
            return self._mapped
        try:
            return self._present(request, defer)
        except _Unusable as problem:
            raise DataFileError(
                f"{problem.path}: {problem.damage or 'missing'} right after the index cache entry was published; "
                "check the file system of the cache directory, or set data_cache_path to another one"
            ) from None

    def _read_only(self, request: _Request, defer: bool, damage: _Unusable | None) -> Mapping[str, np.ndarray]:
        """A directory that cannot be written: read a sound entry, refuse a damaged one, else build in memory."""
        if damage is None:
            try:
                arrays = self._present(request, defer)
            except _Unusable as problem:
                damage = problem if problem.damage else None
            else:
                logger.debug("index cache hit: %s in read-only %s", self._stem, self._directory_text)
                return arrays
        if damage is not None:
            raise self._refusal(damage)
        logger.warning(
            "cache directory %s is not writable; building the %s indices in memory (set data_cache_path to a "
            "writable directory to build them once and share them)",
            self.directory,
            self._stem,
        )
        return request.build()


def _size_damage(size: int, file_bytes: int) -> str:
    change = "cut short" if size < file_bytes else "extended"
    return f"the file has {size} bytes but the manifest records {file_bytes}: it was {change} after it was written"
