"""The small JSON files written beside ``.bin``/``.idx`` pairs by offline preparation.

``<prefix>.meta.json`` says which tokenizer and token dtype a pair was prepared with, so that a blend of pairs
prepared with different tokenizers is refused instead of training on ids that mean different tokens.
megatron-core reads only ``<prefix>.bin`` and ``<prefix>.idx`` and ignores it; pairs without it (written by
megatron-core or by ``IndexedDatasetBuilder`` directly) still load, with a warning when they are blended.

``<prefix>_loss_mask.{bin,idx}`` (a loss-mask pair), written beside the pair of a conversation key, holds one uint8
0/1 per token of ``<prefix>`` (1: the token is a supervised target) in the same documents of the same lengths;
its ``.meta.json`` says ``token_dtype: uint8`` and ``vocab_size: 2``.

``<prefix>.partitions.json`` (the manifest) lists the partition pairs kept beside a merged pair. It is written
after every partition pair is in place, so a reader that lists partitions through it never sees a half set.

Owns: the contents of both files, reading them (a ``vocab_size`` and ``token_dtype`` the reader can use), and the
blend check.
Not responsible for: writing them atomically (``file_writes``), deciding when they are written
(``tools.offline_outputs``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from hyper_parallel.data import __version__
from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError

__all__ = [
    "COMPARED_FIELDS",
    "LOSS_MASK_SUFFIX",
    "PairMetadata",
    "check_same_tokenizer",
    "loss_mask_prefix",
    "manifest_json",
    "manifest_path",
    "metadata_path",
    "partition_prefixes",
    "read_file_bytes",
    "read_pair_metadata",
]

logger = get_logger("hyper_parallel.data.indexed.pair_metadata")

METADATA_FORMAT = 1
# Fields that must agree between the sources of one dataset; the others are for people reading the file.
COMPARED_FIELDS = ("tokenizer_fingerprint", "vocab_size", "eod_id", "token_dtype")
_MISSING_LISTED = 3
# The loss-mask pair of the token pair <prefix> is <prefix>_loss_mask.
LOSS_MASK_SUFFIX = "_loss_mask"
_REWRITE = "delete it, or prepare the pair again to rewrite it"


def metadata_path(prefix: str | os.PathLike) -> Path:
    """``<prefix>.meta.json``."""
    return Path(f"{os.fspath(prefix)}.meta.json")


def loss_mask_prefix(prefix: str | os.PathLike) -> str:
    """``<prefix>_loss_mask``: the loss-mask pair of the token pair ``prefix``."""
    return f"{os.fspath(prefix)}{LOSS_MASK_SUFFIX}"


def manifest_path(prefix: str | os.PathLike) -> Path:
    """``<prefix>.partitions.json``, beside the merged pair ``prefix``."""
    return Path(f"{os.fspath(prefix)}.partitions.json")


@dataclass(frozen=True, kw_only=True)
class PairMetadata:
    """What a pair was prepared with.

    Attributes:
        tokenizer_fingerprint: the tokenizer's ``fingerprint`` (a hash of its vocabulary).
        vocab_size: the tokenizer's vocabulary size, added tokens included.
        eod_id: the id appended after each document (None when no EOD was appended).
        token_dtype: the ``.bin`` token dtype, e.g. ``"uint16"``.
        tokenizer: where the tokenizer was loaded from (for people; not compared).
        library_version: the ``hyper_parallel.data`` version that wrote the pair (not compared).
    """

    tokenizer_fingerprint: str
    vocab_size: int
    eod_id: int | None
    token_dtype: str
    tokenizer: str = ""
    library_version: str = __version__

    def to_json(self) -> bytes:
        return (json.dumps({"format": METADATA_FORMAT, **asdict(self)}, indent=2) + "\n").encode("utf-8")

    def first_difference(self, other: PairMetadata) -> str | None:
        """The first compared field whose value differs, or None."""
        return next((name for name in COMPARED_FIELDS if getattr(self, name) != getattr(other, name)), None)


def read_file_bytes(path: str | Path) -> bytes | None:
    """The bytes of a local file or of an object at an fsspec URL, None if it does not exist. Plain ``os`` calls
    for a file: blends of many sources read one each."""
    if "://" in os.fspath(path):  # beside a prefix in object storage; that module imports this one
        from hyper_parallel.data.indexed.object_storage import read_small_object

        return read_small_object(os.fspath(path))
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        chunks = []
        while chunk := os.read(descriptor, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(descriptor)


def _load_json(path: str | Path) -> object | None:
    try:
        data = read_file_bytes(path)
    except OSError as error:
        raise DataFileError(f"{path}: cannot be read ({error.strerror or error}); {_REWRITE}") from None
    if data is None:
        return None
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        reason = f"{error.msg} at line {error.lineno}" if isinstance(error, json.JSONDecodeError) else "not UTF-8"
        raise DataFileError(f"{path}: invalid JSON ({reason}); {_REWRITE}") from None


_FIELD_NAMES = frozenset(f.name for f in fields(PairMetadata))
_COMPARED = frozenset(COMPARED_FIELDS)


def read_pair_metadata(prefix: str | os.PathLike) -> PairMetadata | None:
    """The metadata of the pair ``prefix``, or None when it has none (for example a megatron-core pair)."""
    path = f"{os.fspath(prefix)}.meta.json"  # a plain string: blends of thousands of sources read one each
    data = _load_json(path)
    if data is None:
        return None
    if not isinstance(data, dict) or not data.keys() >= _COMPARED:
        raise DataFileError(f"{path}: expected a JSON object with the fields {list(COMPARED_FIELDS)}; {_REWRITE}")
    # The reader bounds token ids by vocab_size and compares token_dtype with the .idx header: both must be usable.
    vocab_size, token_dtype = data["vocab_size"], data["token_dtype"]
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise DataFileError(f"{path}: vocab_size must be a positive integer, got {vocab_size!r}; {_REWRITE}")
    if not isinstance(token_dtype, str):
        raise DataFileError(
            f"{path}: token_dtype must be a dtype name such as 'uint16', got {token_dtype!r}; {_REWRITE}"
        )
    return PairMetadata(**{key: value for key, value in data.items() if key in _FIELD_NAMES})


def check_same_tokenizer(prefixes: Sequence[str]) -> None:
    """Refuse sources whose metadata disagree on the tokenizer or the token dtype; warn about sources without.

    Nothing is read for a single source. Sources without metadata cannot be checked: one warning lists how many
    and the first few.

    Raises:
        DataConfigError: naming the two prefixes and the field that differs.
    """
    unique = list(dict.fromkeys(prefixes))
    if len(unique) < 2:
        return
    reference: tuple[str, PairMetadata] | None = None
    missing = []
    for prefix in unique:
        metadata = read_pair_metadata(prefix)
        if metadata is None:
            missing.append(prefix)
        elif reference is None:
            reference = (prefix, metadata)
        elif (field := reference[1].first_difference(metadata)) is not None:
            first, expected = reference
            raise DataConfigError(
                f"the sources '{first}' and '{prefix}' were prepared differently: {field} is "
                f"{getattr(expected, field)!r} in {metadata_path(first).name} but {getattr(metadata, field)!r} in "
                f"{metadata_path(prefix).name} (tokenizers {expected.tokenizer!r} and {metadata.tokenizer!r}); "
                "their token ids would not mean the same tokens. Prepare every source with the same tokenizer and "
                "dtype, or leave one of them out"
            )
    if missing:
        listed = ", ".join(missing[:_MISSING_LISTED]) + (", ..." if len(missing) > _MISSING_LISTED else "")
        logger.warning(
            "%d of %d sources have no .meta.json (not written by offline preparation), so their tokenizer cannot "
            "be checked against the others: %s",
            len(missing),
            len(unique),
            listed,
        )


def manifest_json(merged_prefix: str | os.PathLike, partitions: Sequence[tuple[str, int, int]]) -> bytes:
    """The manifest of the partition pairs kept beside ``merged_prefix``.

    Args:
        merged_prefix: the merged pair.
        partitions: ``(prefix, sequences, documents)`` of each partition pair, in merge order.
    """
    entries = [
        {"prefix": Path(prefix).name, "sequences": sequences, "documents": documents}
        for prefix, sequences, documents in partitions
    ]
    body = {"format": METADATA_FORMAT, "merged": Path(merged_prefix).name, "partitions": entries}
    return (json.dumps(body, indent=2) + "\n").encode("utf-8")


def partition_prefixes(merged_prefix: str | os.PathLike) -> list[str]:
    """The partition pairs kept beside ``merged_prefix``, in merge order, read from its manifest.

    Raises:
        DataFileError: when there is no manifest: the partitions were not kept, or their publication did not
            finish (partition pairs without a manifest may be a half set and must not be read as a whole).
    """
    path = manifest_path(merged_prefix)
    data = _load_json(path)
    if data is None:
        raise DataFileError(
            f"no partition manifest {path}: the partitions of {merged_prefix} were not kept or their publication "
            "did not finish; prepare again with --keep-partition-files"
        )
    if not isinstance(data, dict) or not isinstance(data.get("partitions"), list):
        raise DataFileError(f"{path}: expected a JSON object with a 'partitions' list; {_REWRITE}")
    directory = path.parent
    return [str(directory / entry["prefix"]) for entry in data["partitions"]]
