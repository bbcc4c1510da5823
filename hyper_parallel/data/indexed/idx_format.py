"""The Megatron ``.idx`` file format: dtype codes, header layout and the token-dtype rules.

Owns the byte layout shared by the reader (``indexed_data_reader``) and the writer (``io``), Megatron's choice of
token dtype, and which header dtypes can hold token ids; it reads and writes no files itself. Layout, all
little-endian, no padding::

    offset 0   9 bytes   magic b"MMIDIDX\\x00\\x00"
    offset 9   <Q        version, always 1
    offset 17  <B        dtype code of the tokens in .bin (see DTYPE_BY_CODE)
    offset 18  <Q        sequence_count S
    offset 26  <Q        document_count = D + 1 (length of the document_indices array)
    offset 34  int32[S]  sequence_lengths
               int64[S]  sequence_pointers (byte offsets into .bin)
               int64[D+1] document_indices (0, ..., S)
               int8[S]   sequence_modes (multimodal files only; the header does not say so)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hyper_parallel.data.errors import DataFileError

__all__ = [
    "DTYPE_BY_CODE",
    "HEADER_SIZE",
    "IDX_MAGIC",
    "IDX_VERSION",
    "IdxHeader",
    "check_token_dtype",
    "code_for_dtype",
    "optimal_token_dtype",
]

IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")
HEADER_SIZE = _HEADER.size  # 34

DTYPE_BY_CODE: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_BY_DTYPE = {dtype: code for code, dtype in DTYPE_BY_CODE.items()}

# Megatron stores tokens as uint16 below this vocabulary size; 65500 rather than 65536 is historical.
_UINT16_VOCAB_LIMIT = 65500


def code_for_dtype(dtype: np.dtype | type) -> int:
    """Return the ``.idx`` dtype code for ``dtype``, or raise naming the supported dtypes."""
    dtype = np.dtype(dtype)
    try:
        return _CODE_BY_DTYPE[dtype]
    except KeyError:
        supported = ", ".join(str(d) for d in DTYPE_BY_CODE.values())
        raise DataFileError(f"token dtype {dtype} cannot be stored in an .idx file; use one of: {supported}") from None


def optimal_token_dtype(vocab_size: int | None) -> np.dtype:
    """Megatron's choice of token dtype: uint16 when ``vocab_size < 65500``, else int32 (also for None)."""
    if vocab_size is not None and vocab_size < _UINT16_VOCAB_LIMIT:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def check_token_dtype(dtype: np.dtype | type, idx_path: Path | str) -> None:
    """Refuse a header dtype that cannot hold token ids (megatron's float codes 6 and 7), naming the file.

    A float code in a token pair is a corrupt header (one flipped byte turns int32 into float32): reading the
    tokens through it would give ids that are no tokens at all.
    """
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        integers = ", ".join(f"{code} ({d})" for code, d in DTYPE_BY_CODE.items() if d.kind in "iu")
        raise DataFileError(
            f"{idx_path}: the header's dtype code {_CODE_BY_DTYPE.get(dtype, '?')} (byte 17) says the tokens are "
            f"{dtype}, which cannot hold token ids; token pairs use an integer code: {integers}. The header is "
            "corrupt or the pair holds no token ids; rebuild it with offline_preparation."
        )


@dataclass(frozen=True)
class IdxHeader:
    """The fixed 34-byte header at the start of every ``.idx`` file."""

    dtype: np.dtype
    sequence_count: int
    document_count: int

    def pack(self) -> bytes:
        return _HEADER.pack(
            IDX_MAGIC, IDX_VERSION, code_for_dtype(self.dtype), self.sequence_count, self.document_count
        )

    def arrays_nbytes(self, multimodal: bool) -> int:
        """Bytes that the arrays after the header occupy."""
        per_sequence = 4 + 8 + (1 if multimodal else 0)
        return self.sequence_count * per_sequence + self.document_count * 8

    def check_file_size(self, idx_size: int, path: Path | str, multimodal: bool = False) -> None:
        """Refuse an index of ``idx_size`` bytes too short for the arrays this header promises.

        Called before any array is viewed or sized from the counts, so that a corrupt count (say 10**18
        sequences) is an error naming the file, never an allocation or a ``MemoryError``.
        """
        needed = HEADER_SIZE + self.arrays_nbytes(multimodal)
        if idx_size < needed:
            raise DataFileError(
                f"{path}: the index is truncated or its header is corrupt: the header promises "
                f"{self.sequence_count} sequences and {self.document_count - 1} documents ({needed} bytes"
                f"{' with modes' if multimodal else ''}), but the file has {idx_size} bytes. Rebuild the pair with "
                "offline_preparation; an interrupted writer leaves such files."
            )

    @classmethod
    def parse(cls, raw: bytes, path: Path | str) -> IdxHeader:
        """Parse the header bytes of ``path``; every failure names the file and the fix."""
        if len(raw) < HEADER_SIZE:
            raise DataFileError(
                f"{path}: the .idx file is {len(raw)} bytes, shorter than its {HEADER_SIZE}-byte header; "
                "the file is truncated or not an index file. Rebuild it with offline_preparation."
            )
        magic, version, code, sequence_count, document_count = _HEADER.unpack_from(raw)
        if magic != IDX_MAGIC:
            raise DataFileError(
                f"{path}: bad magic {magic!r}, expected {IDX_MAGIC!r}; this is not a Megatron MMIDIDX index "
                "(older 'TNTIDX' lazy/cached formats are not supported). Rebuild it with offline_preparation."
            )
        if version != IDX_VERSION:
            raise DataFileError(
                f"{path}: index version {version} is not supported, only version {IDX_VERSION}; "
                "rebuild the dataset with a Megatron-compatible writer."
            )
        if code not in DTYPE_BY_CODE:
            raise DataFileError(
                f"{path}: unknown dtype code {code} at byte 17; valid codes are "
                f"{sorted(DTYPE_BY_CODE)}. The file is corrupt; rebuild it with offline_preparation."
            )
        if document_count < 1:
            raise DataFileError(
                f"{path}: document_count is 0, but the document index always holds at least its leading 0; "
                "the file is corrupt. Rebuild it with offline_preparation."
            )
        return cls(DTYPE_BY_CODE[code], sequence_count, document_count)
