"""Writer of Megatron-compatible ``.idx``/``.bin`` pairs.

Owns: appending token sequences and documents, merging existing pairs, and writing the index. Files are
byte-identical to megatron-core's ``IndexedDatasetBuilder`` for the same calls. Unlike it, the metadata lives
in growable numpy arrays (not Python lists), token ids that do not fit the dtype are refused, and outputs are
written under temporary names (``<name>.tmp-<host>-<pid>``) and renamed only when complete, the ``.idx`` last,
so an interrupted run leaves no file that looks finished. The ``.bin`` is opened only while data is written
to it, so that many builders can be open at once within the open-file limit. Write errors (a full disk, a
read-only directory) are ``DataFileError``s naming the file. Temporaries of a process that died are
recognised by their name and removed by ``remove_stale_temporaries``.
Every file is created and reopened through ``file_writes``, never through a symbolic link: a link found at a
temporary or at a final name is refused with a ``DataFileError`` naming it.
Not responsible for: tokenization or record parsing (``tools.offline_preparation``), what the companion files
written beside a pair contain (``indexed.pair_metadata``), temporary names and safe creation (``file_writes``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.file_writes import (
    create_temporary,
    output_error,
    refuse_links,
    reopen_for_append,
    temporary_path,
)
from hyper_parallel.data.indexed.idx_format import IdxHeader, code_for_dtype
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader, data_file_paths

__all__ = ["IndexedDatasetBuilder"]

# A large buffer reaches the page cache in pieces of this many bytes, so that the kernel backs it with folios of at
# most 32 KiB (order 3, which it finds cheaply even in fragmented memory). One write of hundreds of MB asks for the
# largest folios first and can stall in compaction: after a file of small writes was freed, a bulk int32 write of
# 793 MB ran at 0.15-0.25 GB/s in one write and at 1.0-1.7 GB/s in these pieces.
_WRITE_PIECE = 32 << 10
_COPY_CHUNK = 16 << 20  # bytes read at a time when a merge copies another .bin


class _GrowableArray:
    """An append-only numpy array with amortised O(1) appends."""

    def __init__(self, dtype, initial: tuple[int, ...] = ()) -> None:
        self._data = np.empty(max(1024, len(initial)), dtype=dtype)
        self._size = 0
        self.extend(np.asarray(initial, dtype=dtype))

    def _reserve(self, extra: int) -> None:
        needed = self._size + extra
        if needed > len(self._data):
            grown = np.empty(max(needed, 2 * len(self._data)), dtype=self._data.dtype)
            grown[: self._size] = self._data[: self._size]
            self._data = grown

    def append(self, value: int) -> None:
        self._reserve(1)
        self._data[self._size] = value
        self._size += 1

    def extend(self, values: np.ndarray) -> None:
        self._reserve(len(values))
        self._data[self._size : self._size + len(values)] = values
        self._size += len(values)

    def view(self) -> np.ndarray:
        return self._data[: self._size]

    def __len__(self) -> int:
        return self._size


def _write_pieces(file, data: memoryview) -> None:
    """Write ``data`` to ``file`` in pieces of at most ``_WRITE_PIECE`` bytes (one write when it is smaller)."""
    if data.nbytes <= _WRITE_PIECE:
        file.write(data)
        return
    data = data.cast("B")
    for start in range(0, len(data), _WRITE_PIECE):
        file.write(data[start : start + _WRITE_PIECE])


def _as_numpy(tokens) -> np.ndarray:
    if not isinstance(tokens, np.ndarray):
        # torch tensors (detached and moved to CPU if needed), lists and scalars
        tokens = tokens.numpy(force=True) if hasattr(tokens, "numpy") else np.asarray(tokens)
    return tokens if tokens.ndim == 1 else tokens.reshape(-1)


class IndexedDatasetBuilder:
    """Build one ``.bin``/``.idx`` pair.

    Args:
        bin_path: where the ``.bin`` goes once ``finalize`` is called.
        dtype: token dtype; ``idx_format.optimal_token_dtype(vocab_size)`` gives Megatron's choice.
        multimodal: also record one int8 mode per sequence.

    Example::

        builder = IndexedDatasetBuilder("corpus_text_document.bin", dtype=numpy.uint16)
        builder.add_document(numpy.array([5, 6, 7, 0]), lengths=[4])
        builder.finalize("corpus_text_document.idx")

    ``finalize`` is ``seal`` (write the index and companion files under temporary names) then ``publish``
    (rename them into place, the ``.idx`` last); callers publishing several pairs together seal them all first.
    """

    def __init__(self, bin_path: str | os.PathLike, dtype=np.int32, multimodal: bool = False) -> None:
        self.bin_path = Path(bin_path)
        self.dtype = np.dtype(dtype)
        code_for_dtype(self.dtype)  # fail now, not at finalize
        self.multimodal = multimodal
        self._bin_tmp = temporary_path(self.bin_path)
        self._bin_file = None  # open only while writing: see release_file
        self._created: list[Path] = []  # the temporaries this builder created, the only files abort removes
        refuse_links(self.bin_path)
        self._open_bin(create=True)
        self._lengths = _GrowableArray(np.int32)
        self._document_indices = _GrowableArray(np.int64, (0,))
        self._modes = _GrowableArray(np.int8) if multimodal else None
        self._integer_limits = np.iinfo(self.dtype) if np.issubdtype(self.dtype, np.integer) else None
        self._range_check_by_dtype: dict[np.dtype, bool] = {}  # input dtype -> whether values need checking
        self._sealed: dict[Path, Path] = {}  # temporary -> final name, in publication order (the .idx last)
        self._done = False

    # -- adding data ------------------------------------------------------------------------------------------

    def _cast(self, tokens) -> np.ndarray:
        array = _as_numpy(tokens)
        if array.dtype == self.dtype:
            return array
        if not array.size:  # e.g. an empty list, which numpy types as float64
            return array.astype(self.dtype)
        limits = self._integer_limits
        check = self._range_check_by_dtype.get(array.dtype)
        if check is None:
            check = limits is not None and not np.can_cast(array.dtype, self.dtype, "safe")
            if check and array.dtype.kind not in "iu":
                raise DataFileError(f"token ids must be integers to be stored as {self.dtype}, got {array.dtype}")
            self._range_check_by_dtype[array.dtype] = check
        if check:
            if limits.min == 0:
                # One pass: every id fits an unsigned dtype iff no bit above its width is set (negatives set them all).
                out_of_range = int(np.bitwise_or.reduce(array)) & ~int(limits.max)
            else:
                out_of_range = int(array.min()) < limits.min or int(array.max()) > limits.max
            if out_of_range:
                low, high = int(array.min()), int(array.max())
                raise DataFileError(
                    f"token id {high if high > limits.max else low} does not fit the dataset dtype {self.dtype} "
                    f"(range {limits.min}..{limits.max}) of {self.bin_path}; build with a wider dtype "
                    "(int32 for vocabularies of 65500 tokens or more)"
                )
        return array.astype(self.dtype)

    def _open_bin(self, create: bool = False):
        if self._bin_file is None:
            try:
                if create:
                    descriptor = create_temporary(self._bin_tmp)
                    self._created.append(self._bin_tmp)
                else:  # reopened after release_file: still never through a link
                    descriptor = reopen_for_append(self._bin_tmp)
                self._bin_file = os.fdopen(descriptor, "ab")  # closed by release_file, seal or abort
            except OSError as error:
                raise output_error(self.bin_path, error) from None
        return self._bin_file

    def release_file(self) -> None:
        """Close the ``.bin`` until the next write (which reopens it), to bound the number of open files."""
        if self._bin_file is not None:
            file, self._bin_file = self._bin_file, None
            try:
                file.close()
            except OSError as error:
                raise output_error(self.bin_path, error) from None

    def _write(self, array: np.ndarray) -> None:
        file = self._bin_file or self._open_bin()
        try:
            _write_pieces(file, np.ascontiguousarray(array).data)  # the array's memory, no bytes copy
        except OSError as error:
            raise output_error(self.bin_path, error) from None

    @staticmethod
    def _check_lengths(total: int, smallest: int, tokens: int) -> None:
        if smallest < 0:
            raise ValueError(f"sequence lengths must not be negative, got {smallest}")
        if total != tokens:
            raise ValueError(f"the sequence lengths sum to {total} but {tokens} tokens were given")

    def add_item(self, tokens, mode: int = 0) -> None:
        """Append one sequence without closing the current document."""
        array = self._cast(tokens)
        self._write(array)
        self._lengths.append(array.size)
        if self._modes is not None:
            self._modes.append(mode)

    def end_document(self) -> None:
        """Close the current document at the current sequence count."""
        self._document_indices.append(len(self._lengths))

    def add_document(self, tokens, lengths, modes=None) -> None:
        """Append one document made of ``len(lengths)`` sequences whose tokens are concatenated in ``tokens``."""
        array = self._cast(tokens)
        lengths = [int(n) for n in lengths]  # a handful per document: plain ints are cheapest
        self._check_lengths(sum(lengths), min(lengths, default=0), array.size)
        if self._modes is not None:
            modes = [0] * len(lengths) if modes is None else [int(m) for m in modes]
            if len(modes) != len(lengths):
                raise ValueError(f"{len(modes)} modes were given for {len(lengths)} sequences")
        self._write(array)
        for n in lengths:
            self._lengths.append(n)
        if self._modes is not None:
            for mode in modes:
                self._modes.append(mode)
        self._document_indices.append(len(self._lengths))

    def add_documents(self, tokens, sequence_lengths, sequences_per_document=None, modes=None) -> None:
        """Append many documents at once; ``tokens`` is the concatenation of all their sequences.

        Args:
            tokens: every token of every sequence, in order.
            sequence_lengths: tokens per sequence.
            sequences_per_document: sequences per document; default one sequence per document.
            modes: one int8 mode per sequence (multimodal builders only); default 0.
        """
        array = self._cast(tokens)
        sequence_lengths = np.asarray(sequence_lengths, dtype=np.int64).reshape(-1)
        smallest = int(sequence_lengths.min()) if sequence_lengths.size else 0
        self._check_lengths(int(sequence_lengths.sum()), smallest, array.size)
        if sequences_per_document is None:
            sequences_per_document = np.ones(len(sequence_lengths), np.int64)
        sequences_per_document = np.asarray(sequences_per_document, dtype=np.int64).reshape(-1)
        if int(sequences_per_document.sum()) != len(sequence_lengths):
            raise ValueError(
                f"sequences_per_document sums to {int(sequences_per_document.sum())} but "
                f"{len(sequence_lengths)} sequence lengths were given"
            )
        if self._modes is not None:
            modes = np.zeros(len(sequence_lengths), np.int8) if modes is None else np.asarray(modes, np.int8)
            if modes.shape != sequence_lengths.shape:
                raise ValueError(f"{modes.size} modes were given for {sequence_lengths.size} sequences")
        self._write(array)
        first = len(self._lengths)
        self._lengths.extend(sequence_lengths)
        if self._modes is not None:
            self._modes.extend(modes)
        self._document_indices.extend(first + np.cumsum(sequences_per_document))

    def add_index(self, path_prefix: str | os.PathLike) -> None:
        """Append every sequence and document of another pair (same dtype), copying its ``.bin``."""
        other = IndexedDataReader(path_prefix, multimodal=self.multimodal)
        self._check_mergeable(path_prefix, other.dtype)
        self._append_index(other.sequence_lengths, other.document_indices, other.sequence_modes)
        self._copy_bin(data_file_paths(path_prefix)[1])

    def add_builder(self, other: IndexedDatasetBuilder) -> None:
        """Append everything another builder (same dtype) holds, copying its temporary ``.bin``.

        Used to merge partitions that were never published; ``other`` stays usable (sealed or aborted later).
        """
        self._check_mergeable(other.bin_path, other.dtype)
        if other.multimodal != self.multimodal:
            raise ValueError(f"cannot merge {other.bin_path} into {self.bin_path}: only one of them is multimodal")
        other.release_file()
        self._append_index(
            other._lengths.view(), other._document_indices.view(), None if other._modes is None else other._modes.view()
        )
        self._copy_bin(other._bin_tmp)

    def _check_mergeable(self, source, dtype: np.dtype) -> None:
        if dtype != self.dtype:
            raise DataFileError(
                f"cannot merge '{source}' (dtype {dtype}) into {self.bin_path} (dtype {self.dtype}); "
                "all merged datasets must share one token dtype"
            )

    def _append_index(self, lengths: np.ndarray, document_indices: np.ndarray, modes: np.ndarray | None) -> None:
        offset = len(self._lengths)
        self._lengths.extend(lengths)
        self._document_indices.extend(document_indices[1:] + offset)
        if self._modes is not None:
            self._modes.extend(modes)

    def _copy_bin(self, source_path: Path) -> None:
        target = self._bin_file or self._open_bin()
        try:
            buffer = memoryview(bytearray(_COPY_CHUNK))
            with open(source_path, "rb") as source:
                while count := source.readinto(buffer):
                    _write_pieces(target, buffer[:count])
        except OSError as error:
            raise output_error(self.bin_path, error) from None

    # -- finishing --------------------------------------------------------------------------------------------

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    def finalize(self, idx_path: str | os.PathLike, companions: Mapping[Path, bytes] | None = None) -> None:
        """Write the index and move the files to their final names (see ``seal`` and ``publish``)."""
        self.seal(idx_path, companions)
        self.publish()

    def seal(self, idx_path: str | os.PathLike, companions: Mapping[Path, bytes] | None = None) -> None:
        """Complete every file under its temporary name; nothing is published yet.

        Args:
            idx_path: where the ``.idx`` goes.
            companions: other files published with the pair (final path -> contents), such as its metadata.
        """
        idx_path = Path(idx_path)
        companions = {Path(path): data for path, data in (companions or {}).items()}
        refuse_links(idx_path, *companions)  # before anything more is written
        self.release_file()
        # Publication order: companions, the .bin, the .idx last.
        self._sealed = {temporary_path(path): path for path in companions}
        self._sealed[self._bin_tmp] = self.bin_path
        self._sealed[temporary_path(idx_path)] = idx_path
        for path, data in companions.items():
            self._write_temporary(path, [data])
        self._write_temporary(idx_path, self._index_parts())

    def _index_parts(self) -> Iterator:
        lengths = self._lengths.view()
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        document_indices = self._document_indices.view()
        yield IdxHeader(self.dtype, len(lengths), len(document_indices)).pack()
        yield from (lengths, pointers, document_indices)
        if self._modes is not None:
            yield self._modes.view()

    def _write_temporary(self, path: Path, parts: Iterable) -> None:
        temporary = temporary_path(path)
        try:
            with os.fdopen(create_temporary(temporary), "wb") as f:
                self._created.append(temporary)
                for part in parts:
                    f.write(part)
        except OSError as error:
            raise output_error(path, error) from None

    def publish(self) -> None:
        """Rename the sealed files into place: companions, then the ``.bin``, then the ``.idx``."""
        assert self._sealed, "publish() needs seal() first"
        idx_path = next(reversed(self._sealed.values()))
        refuse_links(*self._sealed.values())  # a link planted at a final name since seal: nothing is published
        try:
            # Remove a stale index first: at no moment can a new .bin or companion pair with an old .idx.
            idx_path.unlink(missing_ok=True)
            for temporary, path in self._sealed.items():
                os.replace(temporary, path)
        except OSError as error:
            raise output_error(idx_path, error) from None
        self._done = True

    def abort(self) -> None:
        """Discard everything written so far."""
        with contextlib.suppress(DataFileError):  # a full disk fails the last flush too; the file is closed anyway
            self.release_file()
        for temporary in self._created:
            temporary.unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:  # an exception, or a block that never called finalize
            self.abort()
