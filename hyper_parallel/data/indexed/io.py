"""Writer of Megatron-compatible ``.idx``/``.bin`` pairs.

Owns: appending token sequences and documents, merging existing pairs, and writing the index. Files are
byte-identical to megatron-core's ``IndexedDatasetBuilder`` for the same calls. Unlike it, the metadata lives
in growable numpy arrays (not Python lists), token ids that do not fit the dtype are refused, and outputs are
written under temporary names and renamed only by ``finalize``, so an interrupted run leaves no file that
looks finished. Not responsible for: tokenization or record parsing (``tools.offline_preparation``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.indexed.idx_format import IdxHeader, code_for_dtype
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader, data_file_paths

__all__ = ["IndexedDatasetBuilder", "temporary_path"]


def temporary_path(path: str | os.PathLike) -> Path:
    """The name a file is written under until it is complete."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


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
    """

    def __init__(self, bin_path: str | os.PathLike, dtype=np.int32, multimodal: bool = False) -> None:
        self.bin_path = Path(bin_path)
        self.dtype = np.dtype(dtype)
        code_for_dtype(self.dtype)  # fail now, not at finalize
        self.multimodal = multimodal
        self._bin_tmp = temporary_path(self.bin_path)
        self._bin_file = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed by finalize or abort
        self._lengths = _GrowableArray(np.int32)
        self._document_indices = _GrowableArray(np.int64, (0,))
        self._modes = _GrowableArray(np.int8) if multimodal else None
        self._integer_limits = np.iinfo(self.dtype) if np.issubdtype(self.dtype, np.integer) else None
        self._range_check_by_dtype: dict[np.dtype, bool] = {}  # input dtype -> whether values need checking

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

    def _write(self, array: np.ndarray) -> None:
        self._bin_file.write(np.ascontiguousarray(array).data)  # the array's memory, no bytes copy

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
        if other.dtype != self.dtype:
            raise DataFileError(
                f"cannot merge '{path_prefix}' (dtype {other.dtype}) into {self.bin_path} (dtype {self.dtype}); "
                "all merged datasets must share one token dtype"
            )
        offset = len(self._lengths)
        self._lengths.extend(other.sequence_lengths)
        self._document_indices.extend(other.document_indices[1:] + offset)
        if self._modes is not None:
            self._modes.extend(other.sequence_modes)
        with open(data_file_paths(path_prefix)[1], "rb") as source:
            shutil.copyfileobj(source, self._bin_file, length=16 << 20)

    # -- finishing --------------------------------------------------------------------------------------------

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    def finalize(self, idx_path: str | os.PathLike) -> None:
        """Write the index and move both files to their final names."""
        idx_path = Path(idx_path)
        self._bin_file.close()
        lengths = self._lengths.view()
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        document_indices = self._document_indices.view()
        header = IdxHeader(self.dtype, len(lengths), len(document_indices))
        idx_tmp = temporary_path(idx_path)
        with open(idx_tmp, "wb") as f:
            f.write(header.pack())
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(document_indices.tobytes())
            if self._modes is not None:
                f.write(self._modes.view().tobytes())
        # Remove a stale index first: at no moment can a new .bin pair with an old .idx.
        idx_path.unlink(missing_ok=True)
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(idx_tmp, idx_path)

    def abort(self) -> None:
        """Discard everything written so far."""
        self._bin_file.close()
        self._bin_tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._bin_file.closed:  # an exception, or a block that never called finalize
            self.abort()
