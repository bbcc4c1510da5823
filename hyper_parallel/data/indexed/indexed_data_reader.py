"""Low-level reader of Megatron ``.idx``/``.bin`` pairs.

Owns: parsing and checking the index, reading token ranges of one prefix without copying the ``.bin`` into
memory, and, for the datasets that deliver token ids, checking those ids (the dtype, the ``.meta.json`` and the
vocabulary). Not responsible for: documents-to-samples assembly, splits or blends (mid-level datasets), or
writing files (``io.IndexedDatasetBuilder``). The byte layout is documented in ``idx_format``.

Checks come in two steps. Opening checks what costs nothing per prefix: both paths are regular files, the header,
the ``.idx`` size against the header's counts, and the last sequence against the ``.bin`` size. The first read
of tokens (``[i]``, ``get``, a slice or ``gather``) checks the whole index against the ``.bin`` once
(``_index_problems``, the check ``verify`` runs), so that no sample is ever cut from a corrupt index while
start-up over thousands of prefixes stays a header read each.

Token ids are checked the same way once ``check_token_ids`` is called (the mid-level datasets call it): at once,
that the header's dtype is an integer one; on the first read, that a ``.meta.json`` beside the pair names the same
dtype; and on every read, that each id it returns lies in ``[0, vocab_size)`` (the tokenizer's, or the
``.meta.json``'s, whichever is smaller; without either, that no id is negative). With a memory map the check is one
vectorised pass over each 32K-token chunk of the ``.bin`` the first time a read touches it, after which reads of
checked chunks cost a flag lookup; a chunk holding a bad id stays unmarked and every read of it is checked exactly,
so a read fails if and only if what it returns holds a bad id. ``gather`` checks its whole output in one pass, and
``pread`` reads check what they return. ``check_all_token_ids`` scans the whole ``.bin`` (``hp-data inspect
--verify``).

Reads return views of one token array over the map (slicing it costs a fifth of ``np.frombuffer``); ``gather``
copies all its ranges into one preallocated array, or the caller's ``out``, in the package's C helper, with no
Python object per range. ``reader[i]`` with a plain int on a mapped pair without the id check or modes is answered
by the reader's C base (``_indexed_helpers.MappedItems``), which makes the view through the numpy C API with no
Python frame (about a fifth of the Python path's cost), and a slice's views are cut there too (``split_views``).
"""

from __future__ import annotations

import copyreg
import mmap
import os
import stat
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.indexed import _indexed_helpers
from hyper_parallel.data.indexed.idx_format import HEADER_SIZE, IdxHeader, check_token_dtype
from hyper_parallel.data.indexed.pair_metadata import PairMetadata, metadata_path, read_pair_metadata

__all__ = ["IndexedDataReader", "data_file_paths", "is_object_url", "pair_prefix", "read_sequence_counts"]

# An index that fits in one page is read into memory (a map would take a whole page anyway); a larger one is
# memory-mapped, so that processes share its pages.
_READ_INDEX_AT_MOST = mmap.PAGESIZE

# Entries per vectorised pass of the full index check: its temporaries stay near 10 MB whatever the index size.
_CHECK_CHUNK = 1 << 20

# Tokens per pass of the full token-id scan (check_all_token_ids): its temporaries stay near 10 MB as well.
_SCAN_CHUNK = 1 << 21

# Tokens per chunk of the per-read id check of a memory-mapped .bin, as a power of two: a chunk is checked whole,
# once, on the first read that touches it (64 KiB of uint16, a few microseconds), then costs a flag lookup per read.
_ID_CHUNK_SHIFT = 15

_REBUILD = "Rebuild the pair with `python -m hyper_parallel.data.tools.offline_preparation`."


def is_object_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a URL of an fsspec file system other than the local one (``s3://bucket/prefix``)."""
    scheme, separator, _ = os.fspath(path).partition("://")
    return bool(separator) and scheme.isidentifier() and scheme != "file"


def data_file_paths(path_prefix: str | os.PathLike) -> tuple[Path, Path]:
    """Return the ``(.idx, .bin)`` paths of a dataset prefix."""
    prefix = os.fspath(path_prefix)
    return Path(prefix + ".idx"), Path(prefix + ".bin")


def _pread_full(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes from ``offset``, fewer only where the file ends: one ``pread`` may return less than asked
    (Linux caps one call near 2 GiB)."""
    raw = os.pread(fd, size, offset)
    if len(raw) == size:
        return raw
    parts = [raw]
    done = len(raw)
    while done < size:
        part = os.pread(fd, size - done, offset + done)
        if not part:
            break
        parts.append(part)
        done += len(part)
    return b"".join(parts)


def pair_prefix(path: str) -> str:
    """The prefix of the pair ``path`` names: ``path`` without a trailing ``.idx``/``.bin``, unless ``path`` is
    itself a prefix (``<path>.idx`` exists). Only paths with such an ending cost a ``stat``."""
    stem, extension = os.path.splitext(path)
    if extension in (".idx", ".bin") and not os.path.exists(path + ".idx"):
        return stem
    return path


def missing_pair_error(prefix: str) -> DataFileError:
    """The error for a prefix whose ``.idx`` or ``.bin`` is missing, naming which."""
    missing = [str(p) for p in data_file_paths(prefix) if not p.is_file()]
    return DataFileError(
        f"indexed dataset '{prefix}': missing {' and '.join(missing)}. Pass the path prefix without the .idx/.bin "
        "extension, or create the pair with `python -m hyper_parallel.data.tools.offline_preparation`."
    )


def _regular(status: os.stat_result, path: str, prefix: str) -> os.stat_result:
    """``status``, the ``stat`` of ``path``, when it is a regular file; anything else is a DataFileError naming it."""
    if not stat.S_ISREG(status.st_mode):
        kind = "a directory" if stat.S_ISDIR(status.st_mode) else "not a regular file"
        raise DataFileError(
            f"indexed dataset '{prefix}': {path} is {kind}, where a data file of the pair belongs. Pass the path "
            f"prefix of an .idx/.bin pair, or move what is at {path} away. {_REBUILD}"
        )
    return status


def _open_regular(path: str, prefix: str) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file ``path`` and its ``stat``; anything else is a DataFileError."""
    try:
        # O_NONBLOCK: opening a FIFO placed at the path must fail below rather than wait for a writer; it changes
        # nothing for regular files.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        raise missing_pair_error(prefix) from None
    except OSError as error:
        raise DataFileError(f"indexed dataset '{prefix}': cannot open {path}: {error.strerror}") from None
    try:
        return fd, _regular(os.fstat(fd), path, prefix)
    except BaseException:
        os.close(fd)
        raise


def read_sequence_counts(prefix: str) -> tuple[int, int]:
    """``(sequence_count, document_count)`` of ``<prefix>.idx``, from its header and the file size.

    Reads the 34 header bytes only; counts that the file is too short to hold are refused before anything is
    sized from them.

    Raises:
        DataFileError: the index is missing, not a regular file, unreadable, has a malformed header, or is
            shorter than its counts need.
    """
    if is_object_url(prefix):
        from hyper_parallel.data.indexed.object_storage import object_sequence_counts  # imports this module

        return object_sequence_counts(os.fspath(prefix))
    idx_path = os.fspath(prefix) + ".idx"
    fd, idx_status = _open_regular(idx_path, prefix)
    try:
        raw = _pread_full(fd, HEADER_SIZE, 0)
    except OSError as error:
        raise DataFileError(f"indexed dataset '{prefix}': cannot read {idx_path}: {error.strerror}") from None
    finally:
        os.close(fd)
    header = IdxHeader.parse(raw, idx_path)
    header.check_file_size(idx_status.st_size, idx_path)
    return header.sequence_count, header.document_count


def _tally(found: dict[str, tuple[int, int]], name: str, mask: np.ndarray, begin: int) -> None:
    """Add the failures of check ``name`` in a chunk starting at ``begin`` to ``found[name]``: (count, first)."""
    bad = np.flatnonzero(mask)
    if bad.size:
        count, first = found.get(name, (0, begin + int(bad[0])))
        found[name] = (count + int(bad.size), first)


def _scan_sequences(
    lengths: np.ndarray, pointers: np.ndarray, itemsize: int, bin_size: int
) -> tuple[dict[str, tuple[int, int]], int]:
    """``(count, first)`` of the sequences failing each check, and the bytes all sequences hold, chunk by chunk.

    Checks: ``negative`` length, ``outside`` the ``.bin`` (written ``pointer > bin_size - size`` so that a corrupt
    pointer near 2**63 cannot overflow), ``moved`` (the pointer is not the sum of the sizes before it).
    """
    found: dict[str, tuple[int, int]] = {}
    total = 0  # bytes of the sequences before the chunk
    for begin in range(0, len(lengths), _CHECK_CHUNK):
        sizes = lengths[begin : begin + _CHECK_CHUNK].astype(np.int64)
        sizes *= itemsize
        ends = np.cumsum(sizes)
        ends += total
        total = int(ends[-1])
        chunk = pointers[begin : begin + _CHECK_CHUNK]
        _tally(found, "negative", sizes < 0, begin)
        _tally(found, "outside", (chunk < 0) | (chunk > bin_size - sizes), begin)
        _tally(found, "moved", chunk != ends - sizes, begin)
    return found, total


def _id_bound(dtype: np.dtype, vocab_size: int | None) -> int | None:
    """The bound that the ids of ``dtype``, viewed as unsigned integers of the same size, must stay below: seen so,
    a negative id is at least ``2**(bits - 1)``, so one comparison refuses ids below 0 and ids from ``vocab_size`` on.
    None when no id of ``dtype`` can be out of range (unsigned ids and no smaller vocabulary)."""
    if dtype.kind == "i":
        half = 1 << (8 * dtype.itemsize - 1)
        return half if vocab_size is None else min(vocab_size, half)
    if vocab_size is None or vocab_size > np.iinfo(dtype).max:
        return None
    return vocab_size


def _scan_documents(documents: np.ndarray, count: int) -> dict[str, tuple[int, int]]:
    """``(count, first)`` of the document indices failing each check, chunk by chunk.

    Checks: ``decrease`` (smaller than the entry before), ``outside`` ``[0, count]`` (inner entries only: the first
    and last are checked against 0 and ``count`` exactly).
    """
    found: dict[str, tuple[int, int]] = {}
    last = len(documents) - 1
    for begin in range(1, len(documents), _CHECK_CHUNK):
        stop = min(begin + _CHECK_CHUNK, len(documents))
        current = documents[begin:stop]
        _tally(found, "decrease", current < documents[begin - 1 : stop - 1], begin)
        outside = (current < 0) | (current > count)
        if stop == last + 1:
            outside[-1] = False
        _tally(found, "outside", outside, begin)
    return found


class IndexedDataReader(_indexed_helpers.MappedItems):
    """Random access to the sequences of one ``<prefix>.idx``/``<prefix>.bin`` pair.

    ``reader[i]`` returns one sequence; ``reader[a:b]`` a list of consecutive sequences (mmap only). Multimodal
    readers return ``(tokens, mode)`` and ``(list_of_tokens, modes)`` respectively.

    The index arrays are read-only views of the ``.idx``: of one read of it when it fits in one page, else of a
    memory map. With ``mmap=True`` the ``.bin`` is memory-mapped and reads return read-only views; with
    ``mmap=False`` each read is one ``pread``.

    Args:
        path_prefix: the path without ``.idx``/``.bin``; a path ending in ``.idx`` or ``.bin`` names its pair too
            (``data/books.idx`` is the prefix ``data/books``), unless a pair ``<path>.idx``/``<path>.bin`` exists.
        mmap: memory-map the ``.bin`` (required for slicing).
        multimodal: the index carries one int8 mode per sequence after the document indices. The header does
            not record this, so the caller must say so.
    """

    def __init__(self, path_prefix: str | os.PathLike, mmap: bool = True, multimodal: bool = False) -> None:
        self.path_prefix = pair_prefix(os.fspath(path_prefix))
        self.mmap = mmap
        self.multimodal = multimodal
        self._checks_token_ids = False  # set by check_token_ids
        self._vocab_size: int | None = None  # the tokenizer's, given to check_token_ids
        self._open()

    # -- opening and checking -------------------------------------------------------------------------------

    def _open(self) -> None:
        # Plain strings and os-level calls: opening thousands of prefixes must stay cheap (file objects, np.memmap
        # and pathlib cost tens of microseconds each).
        idx_path, bin_path = self.path_prefix + ".idx", self.path_prefix + ".bin"
        try:
            bin_status = os.stat(bin_path)  # the .bin itself is opened on the first read
        except (FileNotFoundError, NotADirectoryError):
            raise missing_pair_error(self.path_prefix) from None
        bin_size = _regular(bin_status, bin_path, self.path_prefix).st_size
        fd, idx_status = _open_regular(idx_path, self.path_prefix)
        idx_size = idx_status.st_size
        try:
            # A small index is copied by one read, cheaper than a map (a syscall, page faults, an unmap); a large
            # one is mapped so that processes share its pages. Either way the arrays are read-only views.
            if idx_size <= _READ_INDEX_AT_MOST:
                index = _pread_full(fd, idx_size, 0)
                idx_size = len(index)  # shorter if the file shrank since fstat
            else:
                index = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # outlives the descriptor
        except OSError as error:
            raise DataFileError(f"indexed dataset '{self.path_prefix}': cannot read {idx_path}: {error}") from None
        finally:
            os.close(fd)
        self._parse_index(index, idx_size, bin_size)
        self._identity = (idx_size, idx_status.st_mtime_ns, bin_size, bin_status.st_mtime_ns)

    def _parse_index(self, index, idx_size: int, bin_size: int) -> None:
        """Check the header of ``index`` (the ``.idx`` bytes, ``idx_size`` of them) and its last sequence against
        ``bin_size``, and view its arrays: the opening steps shared by every backend."""
        idx_path, bin_path = self.path_prefix + ".idx", self.path_prefix + ".bin"
        header = IdxHeader.parse(index[:HEADER_SIZE], idx_path)
        header.check_file_size(idx_size, idx_path, self.multimodal)
        self._header = header
        count = header.sequence_count
        offset = HEADER_SIZE
        self._lengths = np.frombuffer(index, dtype=np.int32, count=count, offset=offset)
        offset += self._lengths.nbytes
        self._pointers = np.frombuffer(index, dtype=np.int64, count=count, offset=offset)
        offset += self._pointers.nbytes
        self._document_indices = np.frombuffer(index, dtype=np.int64, count=header.document_count, offset=offset)
        offset += self._document_indices.nbytes
        self._modes = np.frombuffer(index, dtype=np.int8, count=count, offset=offset) if self.multimodal else None

        if count:
            end = self._pointers.item(-1) + self._lengths.item(-1) * header.dtype.itemsize
            if end > bin_size:
                raise DataFileError(
                    f"{bin_path}: the data file is {bin_size} bytes but the index points to byte {end} "
                    f"(last of {count} sequences). The .bin is truncated or belongs to another .idx; rebuild the pair."
                )
        self._bin_size = bin_size
        self._fd: int | None = None
        self._bin_view: memoryview | None = None
        self._tokens: np.ndarray | None = None  # the whole mapped .bin as one token array, made on the first read
        self._bin_opened = False  # the .bin is opened, and the whole index checked, on the first read
        self._arm_items(None, None, None)  # reader[i]'s fast path (the C base), armed by _arm_plain_items
        # Plain attributes for the per-read hot path (numpy scalar indexing and properties cost microseconds).
        self._count = header.sequence_count
        self._dtype = header.dtype
        self._itemsize = header.dtype.itemsize
        self._ids_checked: bytearray | None = None  # one flag per id-check chunk, with a map and an id bound
        self._unsigned = np.dtype(f"u{self._itemsize}")  # the view the id check compares (see _id_bound)
        self._id_bound: int | None = None  # set on the first read once check_token_ids is called
        self._id_rule = ""  # the bound in words, for the error

    def _index_problems(self) -> list[str]:
        """Every way the index disagrees with itself or with the ``.bin`` size, each with its first offending entry.

        Sequence ``i`` must have a non-negative length, start where the sequences before it end and lie within the
        ``.bin``, which they must fill exactly; the document indices must rise from 0 to the sequence count. For
        uint16 lengths ``[3, 0, 2]``: pointers ``[0, 6, 6]``, a 10-byte ``.bin``, document indices like ``[0, 2, 3]``.
        """
        lengths, pointers, documents = self._lengths, self._pointers, self._document_indices
        itemsize, bin_size, bin_path = self._itemsize, self._bin_size, self.path_prefix + ".bin"
        sequences, total = _scan_sequences(lengths, pointers, itemsize, bin_size)
        problems = []
        if "negative" in sequences:
            n, i = sequences["negative"]
            problems.append(f"{n} sequences have a negative length; first: sequence {i} has length {lengths[i]}")
        if "outside" in sequences:
            n, i = sequences["outside"]
            problems.append(
                f"{n} sequences lie outside {bin_path} ({bin_size} bytes); first: sequence {i} of {lengths[i]} "
                f"tokens at byte {pointers[i]} ends at byte {int(pointers[i]) + int(lengths[i]) * itemsize}"
            )
        if "moved" in sequences:
            n, i = sequences["moved"]
            expected = int(lengths[:i].sum(dtype=np.int64)) * itemsize
            problems.append(
                f"{n} sequence pointers disagree with the cumulative lengths; first: sequence {i} points to "
                f"byte {pointers[i]}, expected {expected}"
            )
        if total != bin_size:
            problems.append(f"the sequences hold {total} bytes but {bin_path} has {bin_size} bytes")
        count = len(lengths)
        if documents[0] != 0:
            problems.append(f"document_indices must start with 0, found {documents[0]}")
        if documents[-1] != count:
            problems.append(f"document_indices must end with the sequence count {count}, found {documents[-1]}")
        scan = _scan_documents(documents, count)
        if "outside" in scan:
            n, j = scan["outside"]
            problems.append(
                f"{n} document indices lie outside [0, {count}]; first: document_indices[{j}] = {documents[j]}"
            )
        if "decrease" in scan:
            n, j = scan["decrease"]
            problems.append(
                f"document_indices decrease at position {j} ({documents[j - 1]} then {documents[j]}), "
                f"{n} time{'s' if n > 1 else ''} in all"
            )
        return problems

    def _check_index(self) -> None:
        """Raise one DataFileError listing every problem ``_index_problems`` finds, naming the file and the fix."""
        problems = self._index_problems()
        if problems:
            raise DataFileError(
                f"{self.path_prefix}.idx: the index is inconsistent, so samples read through it would be wrong:\n  - "
                + "\n  - ".join(problems)
                + f"\n{_REBUILD}"
            )

    def verify(self) -> None:
        """Check that lengths, pointers, document indices and the ``.bin`` size agree; raise listing every problem.

        The same check runs by itself before the first read returns any token; ``verify`` runs it now.
        """
        self._check_index()

    def pair_metadata(self) -> PairMetadata | None:
        """The pair's ``.meta.json``, or None when it has none; one naming another token dtype than the header's
        is a DataFileError naming both files and both dtypes."""
        metadata = read_pair_metadata(self.path_prefix)
        if metadata is not None and metadata.token_dtype != str(self._dtype):
            raise DataFileError(
                f"{metadata_path(self.path_prefix)} says the tokens are {metadata.token_dtype}, but the header of "
                f"{self.path_prefix}.idx says {self._dtype} (its dtype code, byte 17): one of the two files is "
                f"corrupt or belongs to another pair, and ids read as {self._dtype} would be wrong. {_REBUILD}"
            )
        return metadata

    def token_vocabulary(self, vocab_size: int | None) -> tuple[int | None, str]:
        """The vocabulary size the ids must fit, the smaller of ``vocab_size`` (a tokenizer's) and the
        ``.meta.json``'s, and where it comes from; ``(None, "")`` when neither is known."""
        metadata = self.pair_metadata()
        known = [] if vocab_size is None else [(int(vocab_size), "the tokenizer's vocabulary")]
        if metadata is not None:
            known.append((metadata.vocab_size, f"the vocabulary of {metadata_path(self.path_prefix).name}"))
        return min(known, default=(None, ""))

    def check_token_ids(self, vocab_size: int | None) -> None:
        """Deliver only token ids from now on: refuse a header dtype that cannot hold them now, a ``.meta.json``
        that names another dtype on the first read, and any read holding an id outside ``[0, vocab_size)``
        (bounded by the ``.meta.json``'s ``vocab_size`` too; without either, a negative id), naming the document.

        Raises:
            DataFileError: the header's dtype is not an integer dtype.
        """
        check_token_dtype(self._dtype, self.path_prefix + ".idx")
        self._checks_token_ids, self._vocab_size = True, vocab_size
        if self._bin_opened:
            self._set_id_bound()

    def _set_id_bound(self) -> None:
        """Bound the ids from now on, with no chunk of the map checked yet."""
        self._id_bound = self._bound_ids(self._vocab_size)
        chunks = (self._bin_size // self._itemsize + (1 << _ID_CHUNK_SHIFT) - 1) >> _ID_CHUNK_SHIFT
        self._ids_checked = bytearray(chunks) if self._id_bound is not None and self.mmap else None
        self._arm_plain_items()

    def _bound_ids(self, vocab_size: int | None) -> int | None:
        """The ``_id_bound`` of ``token_vocabulary(vocab_size)``, keeping its rule in words for the error."""
        vocab_size, source = self.token_vocabulary(vocab_size)
        self._id_rule = "negative" if vocab_size is None else f"outside [0, {vocab_size}) ({source})"
        return _id_bound(self._dtype, vocab_size)

    def _id_error(self, token: int, value: int, count: int = 1) -> DataFileError:
        """The error for ``count`` ids out of range, the first being ``value`` at index ``token`` of the ``.bin``."""
        byte = token * self._itemsize
        sequence = int(np.searchsorted(self._pointers, byte, side="right")) - 1
        document = int(np.searchsorted(self._document_indices, sequence, side="right")) - 1
        position = (byte - int(self._pointers[sequence])) // self._itemsize
        where = f"{value} in document {document} (sequence {sequence}, token {position})"
        found = (
            f"{count:,} token ids are {self._id_rule}; the first is {where}"
            if count > 1
            else f"the token id {where} is {self._id_rule}"
        )
        return DataFileError(
            f"{self.path_prefix}.bin: {found}. The pair is corrupt (a wrong dtype code in its .idx header reads "
            f"wrong ids) or was prepared with another tokenizer: `hp-data inspect {self.path_prefix} --verify` "
            "counts every such id; prepare the pair again with the tokenizer of the config."
        )

    def _first_bad_id(self, ids: np.ndarray) -> int | None:
        """The position of the first id of ``ids`` (one read) out of range, or None: one pass when all are fine."""
        unsigned = ids.view(self._unsigned)
        if not ids.size or unsigned.max() < self._id_bound:
            return None
        return int(np.argmax(unsigned >= self._id_bound))

    def check_all_token_ids(self, vocab_size: int | None) -> int:
        """Scan every id of the ``.bin``, chunk by chunk, against ``token_vocabulary(vocab_size)`` (without one,
        for negative ids); return how many ids were checked.

        Raises:
            DataFileError: the header's dtype cannot hold ids, the ``.meta.json`` names another dtype, or ids are
                out of range (how many, and the first with its document).
        """
        check_token_dtype(self._dtype, self.path_prefix + ".idx")
        if not self._bin_opened:
            self._open_bin()
        bound = self._bound_ids(vocab_size)
        total = self._bin_size // self._itemsize
        if bound is None:
            return total
        count, first = 0, None
        for begin in range(0, total, _SCAN_CHUNK):
            ids = self._raw(begin * self._itemsize, min(_SCAN_CHUNK, total - begin))
            bad = np.flatnonzero(ids.view(self._unsigned) >= bound)
            if bad.size:
                count += int(bad.size)
                if first is None:
                    first = (begin + int(bad[0]), int(ids[bad[0]]))
        if first is not None:
            raise self._id_error(*first, count)
        return total

    # -- metadata ---------------------------------------------------------------------------------------------

    @property
    def dtype(self) -> np.dtype:
        """The token dtype recorded in the header."""
        return self._header.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 token count of every sequence (a view of the index)."""
        return self._lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 byte offset of every sequence in the ``.bin`` (a view of the index)."""
        return self._pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64 array of length documents + 1; document d covers sequences ``[d_i[d], d_i[d + 1])``."""
        return self._document_indices

    @property
    def file_identity(self) -> dict[str, int]:
        """Size and modification time (ns) of the ``.idx`` and ``.bin`` as opened: what index cache keys record,
        so that a pair rewritten in place, even with the same counts, never reuses indices built from the old one."""
        idx_bytes, idx_mtime_ns, bin_bytes, bin_mtime_ns = self._identity
        return {
            "idx_bytes": idx_bytes,
            "idx_mtime_ns": idx_mtime_ns,
            "bin_bytes": bin_bytes,
            "bin_mtime_ns": bin_mtime_ns,
        }

    @property
    def sequence_modes(self) -> np.ndarray | None:
        """int8 mode of every sequence for multimodal files, else None."""
        return self._modes

    @property
    def num_documents(self) -> int:
        return len(self._document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self._lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        return self._header.sequence_count

    def __repr__(self) -> str:
        return (
            f"IndexedDataReader({self.path_prefix!r}, sequences={len(self)}, documents={self.num_documents}, "
            f"dtype={self.dtype}, mmap={self.mmap}, multimodal={self.multimodal})"
        )

    # -- reading ----------------------------------------------------------------------------------------------

    def _open_bin(self) -> None:
        """On the first read: check the whole index against the ``.bin`` as it is now, then map (or open) it.

        Start-up with thousands of prefixes opens only the indices; the full check runs here once per reader and
        process (a reader sent to a DataLoader worker re-opens, and checks again there, before its first read).
        """
        fd, status = _open_regular(self.path_prefix + ".bin", self.path_prefix)
        self._bin_size = status.st_size
        try:
            self._check_before_reads()
            if self.mmap:
                # An empty file cannot be mapped; an empty dataset has nothing to read anyway.
                self._bin_view = memoryview(mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if self._bin_size else b"")
                self._tokens = np.frombuffer(self._bin_view, dtype=self._dtype)
            else:
                self._fd, fd = fd, None
        finally:
            if fd is not None:
                os.close(fd)
        self._bin_opened = True
        self._arm_plain_items()

    def _check_before_reads(self) -> None:
        """What the first read checks, whatever the backend: the whole index, then the id bound if asked for."""
        self._check_index()
        if self._checks_token_ids:
            self._set_id_bound()

    def _arm_plain_items(self) -> None:
        """Give ``reader[i]`` its fast path where a read is a view of the map and nothing more (no id check, no
        mode): the C base answers a plain int itself, from the token array and the index arrays."""
        if self._tokens is None or self._id_bound is not None or self._modes is not None:
            self._arm_items(None, None, None)
        else:
            self._arm_items(self._tokens, self._pointers, self._lengths)

    def _read(self, byte_offset: int, count: int) -> np.ndarray:
        """``count`` tokens from ``byte_offset``, their ids checked once ``check_token_ids`` was called."""
        tokens = self._tokens
        if tokens is None:  # not opened yet, or read with pread
            array = self._raw(byte_offset, count)
            if self._id_bound is not None and (bad := self._first_bad_id(array)) is not None:
                raise self._id_error(byte_offset // self._itemsize + bad, int(array[bad]))
            return array
        # The memory-mapped case inline: this is every reader[i] and get(i).
        start = byte_offset // self._itemsize
        checked = self._ids_checked
        if checked is not None and count:
            first, last = start >> _ID_CHUNK_SHIFT, (start + count - 1) >> _ID_CHUNK_SHIFT
            if not checked[first] or (first != last and checked.find(0, first, last + 1) >= 0):
                self._check_chunks(start, count, first, last)
        return tokens[start : start + count]

    def _check_chunks(self, start: int, count: int, first: int, last: int) -> None:
        """Check id-check chunks ``first..last`` whole and mark them; if one holds a bad id, check exactly the
        read ``[start, start + count)`` instead, leaving them unmarked."""
        tokens = self._tokens
        chunk = tokens[first << _ID_CHUNK_SHIFT : (last + 1) << _ID_CHUNK_SHIFT]
        if self._first_bad_id(chunk) is None:
            self._ids_checked[first : last + 1] = b"\x01" * (last + 1 - first)
            return
        array = tokens[start : start + count]
        if (bad := self._first_bad_id(array)) is not None:
            raise self._id_error(start + bad, int(array[bad]))

    def _raw(self, byte_offset: int, count: int) -> np.ndarray:
        """``count`` tokens from ``byte_offset``, unchecked: a view of the map, or one ``pread``."""
        if self._tokens is not None:
            start = byte_offset // self._itemsize
            return self._tokens[start : start + count]
        if not self._bin_opened:
            self._open_bin()
            return self._raw(byte_offset, count)
        wanted = count * self._itemsize
        raw = self._read_bytes(byte_offset, wanted)
        if len(raw) < wanted:
            raise DataFileError(
                f"{self.path_prefix}.bin ended at byte {byte_offset + len(raw)} while reading {count} tokens "
                f"at byte {byte_offset}; the file was truncated after it was opened"
            )
        return np.frombuffer(raw, dtype=self._dtype)

    def _read_bytes(self, byte_offset: int, size: int) -> bytes:
        """``size`` bytes of the opened ``.bin`` from ``byte_offset``, fewer only where it ends."""
        return _pread_full(self._fd, size, byte_offset)

    def _sequence_id(self, i) -> int:
        n = self._count
        if not -n <= i < n:
            raise IndexError(f"sequence {i} is out of range for '{self.path_prefix}' with {n} sequences")
        return int(i) + n if i < 0 else int(i)

    def _span(self, i, offset: int, length: int | None) -> tuple[int, int, int]:
        """``(byte offset, token count, sequence)`` of tokens ``[offset, offset + length)`` of sequence ``i``
        (``length`` None: to its end); a range outside the sequence is an IndexError."""
        if not self._bin_opened:
            self._open_bin()  # the index is checked before its lengths bound the range
        i = self._sequence_id(i)
        sequence_length = self._lengths.item(i)
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) are outside sequence {i} of '{self.path_prefix}', "
                f"which has {sequence_length} tokens"
            )
        return self._pointers.item(i) + offset * self._itemsize, length, i

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Return ``length`` tokens of sequence ``i`` starting ``offset`` tokens in (default: to its end)."""
        byte_offset, length, i = self._span(i, offset, length)
        array = self._read(byte_offset, length)
        return (array, self._modes.item(i)) if self._modes is not None else array

    def join(self, pieces: Sequence[tuple[int, int, int | None]]) -> np.ndarray:
        """The token ranges ``(sequence, offset, length)`` (``length`` None: to the sequence's end) concatenated,
        their ids checked: the cheap path for the few pieces of one sample (``gather`` is the batched one)."""
        spans = [self._span(i, offset, length) for i, offset, length in pieces]
        return np.concatenate([self._read(byte_offset, length) for byte_offset, length, _ in spans])

    def _item_or_slice(self, key):
        """``reader[key]`` where the C base's fast path does not answer: before the first read, with the id check
        or modes, numpy integers, slices, and keys out of range."""
        if type(key) is int or isinstance(key, (int, np.integer)):  # the first test is the fast one
            i = key if 0 <= key < self._count else self._sequence_id(key)  # the common case without a call
            array = self._read(self._pointers.item(i), self._lengths.item(i))
            return (array, self._modes.item(i)) if self._modes is not None else array
        if isinstance(key, slice):
            return self._get_slice(key)
        raise TypeError(f"indices must be integers or slices, not {type(key).__name__}")

    def gather(self, sequence_ids, offsets=None, lengths=None, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of each listed sequence, concatenated into one array.

        ``offsets`` None reads from each sequence's start, ``lengths`` None to its end, so ``gather(ids)`` is the
        listed sequences whole. With a memory map this is one copy of every range into one array (the C helper, no
        Python object per range) and one vectorised id check of the result; without one, one ``pread`` per range.

        Args:
            out: where to write the tokens instead of a new array: a writable C-contiguous 1-D array of the
                reader's dtype holding exactly the tokens gathered (a slice ``buffer[:n]`` of a larger one will do);
                it is returned. A loader reusing one buffer writes into memory already mapped and cached, where a
                fresh multi-MB array per call may have to be faulted in (and zeroed) by the kernel and starts cold.
                Its contents are unspecified after an error.

        Raises:
            IndexError: a sequence id or a token range lies outside the pair.
            ValueError: ``out`` is not such an array, naming what it is.
            DataFileError: an id is out of range (once ``check_token_ids`` was called), naming its document.
        """
        if not self._bin_opened:
            self._open_bin()  # the index is checked before its lengths bound the ranges
        sequence_ids, offsets, lengths = self._ranges(sequence_ids, offsets, lengths)
        flat = self._gather_output(out, int(lengths.sum()))
        if self._tokens is None:
            pieces = [self.get(int(i), int(o), int(n)) for i, o, n in zip(sequence_ids, offsets, lengths, strict=True)]
            if pieces:
                np.concatenate(pieces, out=flat)
            return flat
        byte_starts = self._pointers[sequence_ids] + offsets * self._itemsize
        _indexed_helpers.copy_ranges(self._bin_view, byte_starts, lengths * self._itemsize, flat)
        if self._id_bound is not None and (bad := self._first_bad_id(flat)) is not None:
            ends = np.cumsum(lengths)
            piece = int(np.searchsorted(ends, bad, side="right"))
            token = int(byte_starts[piece]) // self._itemsize + bad - int(ends[piece] - lengths[piece])
            raise self._id_error(token, int(flat[bad]))
        return flat

    def _gather_output(self, out: np.ndarray | None, count: int) -> np.ndarray:
        """The array ``gather`` writes ``count`` tokens into: a new one, or ``out`` once checked to fit exactly."""
        if out is None:
            return np.empty(count, self._dtype)
        wanted = f"a writable C-contiguous 1-D {self._dtype} array of exactly the {count} tokens gathered"
        if not isinstance(out, np.ndarray):
            raise ValueError(f"gather's out must be {wanted}, got {type(out).__name__}")
        flags = out.flags
        if out.dtype != self._dtype or out.shape != (count,) or not flags.c_contiguous or not flags.writeable:
            kind = ("writable" if flags.writeable else "read-only") + ("" if flags.c_contiguous else " non-contiguous")
            raise ValueError(
                f"gather's out must be {wanted}, got a {kind} {out.dtype} array of shape {out.shape}: pass "
                f"np.empty({count}, {self._dtype}) or a slice buffer[:{count}] of a larger buffer, or no out for a "
                "new array"
            )
        return out

    def _ranges(self, sequence_ids, offsets, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``gather``'s arguments as int64 arrays, ``None`` filled in; a range outside its sequence is an IndexError.

        Seen as unsigned, a negative value is at least ``2**63``, so one maximum refuses ids below 0 and from the
        sequence count on; offsets and lengths are negative exactly when their bitwise or is.
        """
        sequence_ids = np.asarray(sequence_ids, dtype=np.int64).reshape(-1)
        if len(sequence_ids) and sequence_ids.view(np.uint64).max() >= self._count:
            raise IndexError(f"a requested sequence is outside '{self.path_prefix}' with {self._count} sequences")
        available = self._lengths[sequence_ids].astype(np.int64)
        if offsets is None and lengths is None:
            return sequence_ids, np.zeros_like(sequence_ids), available
        offsets = np.zeros_like(sequence_ids) if offsets is None else np.asarray(offsets, dtype=np.int64).reshape(-1)
        lengths = available - offsets if lengths is None else np.asarray(lengths, dtype=np.int64).reshape(-1)
        if len(sequence_ids) and ((offsets | lengths).min() < 0 or np.any(offsets + lengths > available)):
            raise IndexError(f"a requested token range is outside its sequence in '{self.path_prefix}'")
        return sequence_ids, offsets, lengths

    def _get_slice(self, key: slice):
        if not self.mmap:
            raise ValueError(
                f"slicing '{self.path_prefix}' needs a memory-mapped .bin; open it with mmap=True or read "
                "sequences one at a time with reader[i]"
            )
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError(f"only contiguous slices are supported (step 1), got step {step}")
        stop = max(start, stop)
        lengths = self._lengths[start:stop]
        if start == stop:
            tokens = []
        else:
            flat = self._read(self._pointers.item(start), int(lengths.sum(dtype=np.int64)))
            tokens = _indexed_helpers.split_views(flat, lengths)
        return (tokens, self._modes[start:stop]) if self._modes is not None else tokens

    # -- lifetime ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            self.close()

    def __getstate__(self) -> dict:
        # Workers re-open the files rather than receiving pickled maps, and check the token ids as here.
        return {
            "path_prefix": self.path_prefix,
            "mmap": self.mmap,
            "multimodal": self.multimodal,
            "_checks_token_ids": self._checks_token_ids,
            "_vocab_size": self._vocab_size,
        }

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __reduce__(self):
        # Protocol 2's form for every protocol: protocols 0 and 1 would otherwise try to pickle the C base, which
        # holds nothing that the first read does not arm again.
        return copyreg.__newobj__, (type(self),), self.__getstate__()
