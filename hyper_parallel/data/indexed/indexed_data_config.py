"""Configuration of the Indexed path: the typed config, split strings, blend lists and data-path discovery.

Owns: ``IndexedDataConfig`` (validated at construction), turning ``split`` into contiguous per-split ranges
exactly as megatron-core does, parsing ``data_path`` (a prefix, a directory, or a Megatron blend list such as
``["30", prefix_a, "70", prefix_b]``) into a ``Blend``, reading the ``per_dataset_sequences_path`` counts file (each
entry checked: two integers in range). Not responsible for: opening ``.bin``/``.idx`` files or building datasets
(``indexed_split_builder``).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from hyper_parallel.data.errors import DataConfigError, DataFileError, require_int
from hyper_parallel.data.indexed.index_cache import CacheOptions
from hyper_parallel.data.indexed.pair_metadata import LOSS_MASK_SUFFIX, read_file_bytes
from hyper_parallel.data.parallel.build_barrier import DEFAULT_LOCK_TIMEOUT_S

__all__ = [
    "SPLIT_NAMES",
    "Blend",
    "IndexedDataConfig",
    "parse_blend",
    "parse_split",
    "sample_counts",
    "split_matrix",
    "split_range",
]

SPLIT_NAMES = ("train", "valid", "test")
SIMPLE_BLEND_MODES = ("no", "inter", "intra")
LOSS_MASK_READS = ("auto", "required", "off")
CACHE_VERIFICATIONS = ("sizes", "sampled", "full")
DataPath = str | os.PathLike | Sequence[str | os.PathLike]
# numpy's legacy RandomState, which orders samples as megatron-core does, takes seeds in [0, 2**32 - 1].
MAX_RANDOM_SEED = 2**32 - 1


@dataclass(frozen=True)
class Blend:
    """Dataset prefixes and, optionally, their raw (unnormalised) weights."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.prefixes:
            raise DataConfigError("a blend needs at least one dataset prefix")
        if self.weights is not None:
            if len(self.weights) != len(self.prefixes):
                raise DataConfigError(f"{len(self.weights)} weights for {len(self.prefixes)} prefixes")
            for prefix, weight in zip(self.prefixes, self.weights, strict=True):
                if not math.isfinite(weight) or weight <= 0:
                    raise DataConfigError(
                        f"blend weight {weight} of '{prefix}' must be a positive number; drop the source instead "
                        "of giving it weight 0"
                    )


@dataclass(frozen=True, kw_only=True)
class IndexedDataConfig:
    """Every setting of the Indexed path: the ``data_config`` mapping of ``build_indexed_text_dataset`` in YAML.

    Attributes:
        seq_length: tokens per sample (S).
        split: train/valid/test proportions such as ``"98, 1, 1"``; ignored when per-split paths are given.
        random_seed: seeds every index shuffle (legacy ``numpy.random.RandomState``, as megatron-core).
        mock_data: use synthetic documents instead of files (``MockGPTDataset``).
        is_dataset_from_mr: the data are offline-packed records of ``seq_length + add_extra_token_to_sequence``
            tokens (``GPTFromMRDataset``) instead of variable-length documents (``GPTDataset``).
        simple_blend: ``"no"`` (weighted ``BlendedDataset``), ``"inter"`` (round-robin) or ``"intra"``
            (one source after another); the last two need ``is_dataset_from_mr``.
        data_lazy_load: build each mid-level dataset on first use (``LazyDatasetProxy``).
        skip_data_check: do not check packed records for length and pad tokens, nor the data-kind pairing.
        create_ltor_fields_in_dataloader: samples also carry ``loss_mask``, ``position_ids`` (and
            ``attention_mask`` when ``create_attention_mask``).
        create_attention_mask: with ``create_ltor_fields_in_dataloader``, samples also carry the dense
            ``attention_mask`` (bool ``[1, S, S]``, True = masked out); false leaves it out.
        add_extra_token_to_sequence: read S + 1 tokens per sample so labels are the shifted tokens.
        drop_last_partial_validation_sequence: drop (True) or pad (False) the last partial validation sample.
        reset_position_ids, reset_attention_mask, eod_mask_loss: the LTR field options.
        allow_ambiguous_pad_tokens: keep a pad id that equals another special token (otherwise -1 is used).
        data_cache_path: where index caches go; default ``<prefix dir>/cache/GPTDataset_indices``.
        train_data_path, valid_data_path, test_data_path: separate sources per split (then ``split`` is unused).
        mid_level_dataset_surplus: extra fraction of samples built per blended source.
        mmap_bin_files: memory-map ``.bin`` files (else one ``pread`` per read).
        fast_cache_load: assume the caches exist: no existence checks, no barriers.
        defer_npy_index_mmap: map cached index files on first access.
        per_dataset_sequences_path: a JSON file of ``{prefix: [sequence_count, document_count]}`` read instead
            of every ``.idx`` header (``tools.build_sequences_per_dataset``).
        cache_verification: what loading an index cache entry checks: ``"sizes"`` (every file's size against
            the entry's manifest), ``"sampled"`` (also the checksums of each file's first and last 64 KiB blocks
            and two random ones) or ``"full"`` (every block).
        cache_lock_timeout: seconds to wait for another process building the same cache entry before giving up.
        read_loss_mask: whether ``GPTDataset`` and ``GPTFromMRDataset`` read each prefix's loss-mask pair
            ``<prefix>_loss_mask`` (written by ``hp-data prepare --chat-template``, packed with its tokens under
            ``--pack-to-seq-len``: 1 where a token is a supervised target) and train only where it is 1
            (``loss_mask`` 0 and ``labels`` ``IGNORE_INDEX`` elsewhere): ``"auto"`` where that pair exists,
            ``"required"`` refusing a prefix without one, ``"off"`` never.
        object_block_bytes: for prefixes in object storage (``s3://bucket/prefix``): bytes per ranged request
            and block of the process-wide ``.bin`` cache.
        object_cache_bytes: the bound of that cache, least recently used blocks dropped first.
    """

    seq_length: int
    split: str | None = "969, 30, 1"
    random_seed: int = 1234
    mock_data: bool = False
    is_dataset_from_mr: bool = False
    simple_blend: str = "no"
    data_lazy_load: bool = False
    skip_data_check: bool = False
    create_ltor_fields_in_dataloader: bool = False
    create_attention_mask: bool = True
    add_extra_token_to_sequence: bool = True
    drop_last_partial_validation_sequence: bool = True
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    allow_ambiguous_pad_tokens: bool = False
    data_cache_path: str | None = None
    train_data_path: DataPath | None = None
    valid_data_path: DataPath | None = None
    test_data_path: DataPath | None = None
    mid_level_dataset_surplus: float = 0.005
    mmap_bin_files: bool = True
    fast_cache_load: bool = False
    defer_npy_index_mmap: bool = False
    per_dataset_sequences_path: str | None = None
    cache_verification: str = "sampled"
    cache_lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S
    read_loss_mask: str = "auto"
    object_block_bytes: int = 4 << 20
    object_cache_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        self._check_types()
        self._check_cache_settings()
        if self.read_loss_mask not in LOSS_MASK_READS:
            raise DataConfigError(f"read_loss_mask must be one of {LOSS_MASK_READS}, got {self.read_loss_mask!r}")
        if self.read_loss_mask == "required" and self.mock_data:
            raise DataConfigError(
                "read_loss_mask: 'required' reads the loss masks of prepared data; mock_data have none. Set "
                "read_loss_mask: auto"
            )
        if self.simple_blend not in SIMPLE_BLEND_MODES:
            raise DataConfigError(f"simple_blend must be one of {SIMPLE_BLEND_MODES}, got {self.simple_blend!r}")
        if self.simple_blend != "no" and not self.is_dataset_from_mr:
            raise DataConfigError(
                f"simple_blend: {self.simple_blend!r} works on offline-packed records only; set "
                "is_dataset_from_mr: true, or use simple_blend: 'no' for variable-length documents"
            )
        if self.split is not None and not self.has_per_split_paths:
            split_matrix(self.split)  # validates
        if (self.fast_cache_load or self.defer_npy_index_mmap) and self.data_cache_path is None:
            raise DataConfigError(
                "fast_cache_load and defer_npy_index_mmap read an existing cache; set data_cache_path to it "
                "(build it first with `python -m hyper_parallel.data.tools.prepare_cache`)"
            )
        if self.mock_data and self.is_dataset_from_mr:
            raise DataConfigError(
                "mock_data makes variable-length documents; it cannot be used with is_dataset_from_mr"
            )

    def _check_types(self) -> None:
        """Numbers, flags and paths of the right type and range; integers stored as Python ints (cache keys)."""
        object.__setattr__(self, "seq_length", require_int("seq_length", self.seq_length, 1))
        seed = require_int("random_seed", self.random_seed, 0)
        if seed > MAX_RANDOM_SEED:
            raise DataConfigError(
                f"random_seed must be an integer in [0, 2**32 - 1] (numpy's legacy RandomState orders the samples, "
                f"as megatron-core), got {seed}; choose a smaller seed"
            )
        object.__setattr__(self, "random_seed", seed)
        block_bytes = require_int("object_block_bytes", self.object_block_bytes, 1)
        object.__setattr__(self, "object_block_bytes", block_bytes)
        cache_bytes = require_int("object_cache_bytes", self.object_cache_bytes, block_bytes)
        object.__setattr__(self, "object_cache_bytes", cache_bytes)
        surplus = self.mid_level_dataset_surplus
        is_number = isinstance(surplus, int | float) and not isinstance(surplus, bool)
        if not is_number or not math.isfinite(surplus) or surplus < 0:
            raise DataConfigError(
                f"mid_level_dataset_surplus must be a number >= 0 (a fraction such as 0.005), got {surplus!r}"
            )
        for field in fields(self):
            value = getattr(self, field.name)
            if field.type == "bool" and not isinstance(value, bool):
                # YAML's quoted "false" is a non-empty string, which Python would take as true
                raise DataConfigError(
                    f"{field.name} must be true or false, got {value!r} ({type(value).__name__}); write it unquoted"
                )
            path_types = str | os.PathLike | list | tuple if field.type == "DataPath | None" else str | os.PathLike
            if field.name.endswith("_path") and value is not None and not isinstance(value, path_types):
                raise DataConfigError(f"{field.name} must be a path (a string), got {value!r} ({type(value).__name__})")

    @property
    def has_per_split_paths(self) -> bool:
        return any(p is not None for p in (self.train_data_path, self.valid_data_path, self.test_data_path))

    def _check_cache_settings(self) -> None:
        if self.cache_verification not in CACHE_VERIFICATIONS:
            raise DataConfigError(
                f"cache_verification must be one of {CACHE_VERIFICATIONS}, got {self.cache_verification!r}"
            )
        timeout = self.cache_lock_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
            raise DataConfigError(
                f"cache_lock_timeout must be a number of seconds > 0 (default {DEFAULT_LOCK_TIMEOUT_S:g}), got "
                f"{timeout!r}"
            )

    def cache_options(self, together: bool) -> CacheOptions:
        """How this build places, reads and builds its index caches: the one place the cache settings are turned
        into a decision, which the datasets receive and never derive again.

        Args:
            together: the ranks of a process group (more than one) all build these datasets, so rank 0 may build
                each cache entry while the others wait.
        """
        return CacheOptions(
            directory=self.data_cache_path,
            # Lazy datasets are built at first use, at different moments on different ranks, and fast_cache_load
            # builds nothing: file locks alone then.
            synchronize=together and not self.data_lazy_load and not self.fast_cache_load,
            assume_complete=self.fast_cache_load,
            defer=self.defer_npy_index_mmap,
            verification=self.cache_verification,
            lock_timeout=float(self.cache_lock_timeout),
        )

    @property
    def extra_token(self) -> int:
        """1 when samples read one extra token for the shifted labels, else 0."""
        return int(self.add_extra_token_to_sequence)

    def check_sample_fits(self, prefix: str, split_tokens: dict[str, int]) -> None:
        """Refuse a ``seq_length`` larger than every split of ``prefix``, given the tokens of each present split.

        No split could then hold one sample: one-epoch splits would be empty, and requested samples would each
        repeat the split several times (megatron-core's arithmetic), so it is a configuration mistake.
        """
        needed = self.seq_length + self.extra_token
        most = max(split_tokens.values(), default=needed)
        if most >= needed:
            return
        counts = ", ".join(f"{name} {tokens}" for name, tokens in split_tokens.items())
        fix = f"lower seq_length to at most {most - self.extra_token}, or " if most > self.extra_token else ""
        raise DataConfigError(
            f"seq_length {self.seq_length} is larger than every split of {prefix}: one sample needs {needed} tokens "
            f"(seq_length + add_extra_token_to_sequence) but the splits hold {counts} tokens; {fix}add documents "
            "to the prefix"
        )

    @classmethod
    def from_mapping(cls, values: dict) -> IndexedDataConfig:
        """Build from a plain mapping (e.g. a YAML ``data_config``); unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise DataConfigError(f"unknown data_config key(s) {unknown}; valid keys are {sorted(known)}")
        return cls(**values)

    @property
    def sequences_file_fix(self) -> str:
        """How to write the ``per_dataset_sequences_path`` file again, for the messages that refuse it."""
        return (
            "write it again with `python -m hyper_parallel.data.tools.build_sequences_per_dataset --data-path "
            f"<this run's data paths> --per-dataset-sequences-path {self.per_dataset_sequences_path}`"
        )

    def load_sequences_per_dataset(self) -> dict[str, tuple[int, int]] | None:
        """The ``{prefix: (sequence_count, document_count)}`` file named by ``per_dataset_sequences_path``.

        Raises:
            DataFileError: the file is missing, unreadable or not JSON, is not an object, or maps a prefix to
                anything but two integers in range (``document_count`` >= 1: the documents + 1, as in the header).
        """
        if self.per_dataset_sequences_path is None:
            return None
        path, fix = os.fspath(self.per_dataset_sequences_path), self.sequences_file_fix
        try:
            data = read_file_bytes(path)  # a local file or an object at a URL
        except OSError as error:
            raise DataFileError(
                f"per_dataset_sequences_path {path} cannot be read ({error.strerror or error}); {fix}"
            ) from None
        if data is None:
            raise DataFileError(f"per_dataset_sequences_path {path} does not exist; {fix}")
        try:
            raw = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise DataFileError(
                f"per_dataset_sequences_path {path} is not UTF-8 JSON (byte {error.start}: {error.reason}); {fix}"
            ) from None
        except (ValueError, RecursionError) as error:  # JSONDecodeError, a number of too many digits, deep nesting
            raise DataFileError(f"per_dataset_sequences_path {path} holds invalid JSON ({error}); {fix}") from None
        if not isinstance(raw, dict):
            raise DataFileError(
                f"per_dataset_sequences_path {path} holds {_json_described(raw)}, but it must be a JSON object "
                f"{{prefix: [sequence_count, document_count], ...}}; {fix}"
            )
        return {prefix: _listed_counts(prefix, counts, path, fix) for prefix, counts in raw.items()}


# The counts of an .idx header, used to size numpy arrays: each must fit an int64.
_MAX_LISTED_COUNT = 2**63 - 1
_JSON_KINDS = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}


def _json_described(value, limit: int = 60) -> str:
    """What a JSON value is, for a message: ``null``, or its kind and a short form of it."""
    if value is None:
        return "null"
    text = json.dumps(value)
    shown = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"the JSON {_JSON_KINDS.get(type(value), type(value).__name__)} {shown}"


def _listed_counts(prefix: str, counts, path: str, fix: str) -> tuple[int, int]:
    """``[sequence_count, document_count]`` of ``prefix`` in the counts file, checked: two integers in range."""
    where = f"per_dataset_sequences_path {path}: '{prefix}'"
    if not isinstance(counts, list) or len(counts) != 2:
        raise DataFileError(
            f"{where} maps to {_json_described(counts)}, but each prefix must map to "
            f"[sequence_count, document_count] (two integers, as the .idx header holds them); {fix}"
        )
    for name, count, minimum in zip(("sequence_count", "document_count"), counts, (0, 1), strict=True):
        if isinstance(count, bool) or not isinstance(count, int) or not minimum <= count <= _MAX_LISTED_COUNT:
            raise DataFileError(
                f"{where}: {name} is {_json_described(count)}, but it must be an integer in "
                f"[{minimum}, 2**63 - 1] ({'the documents + 1, ' if minimum else ''}as the .idx header holds it); "
                f"{fix}"
            )
    return counts[0], counts[1]


# -- split ---------------------------------------------------------------------------------------------------------


_SPLIT_FORM = "one to three non-negative numbers separated by commas, such as '98, 1, 1' or '969, 30, 1'"
_SPLIT_SEPARATOR = re.compile(r"\s*[,;/:]\s*|\s+")
_SPLIT_NUMBER = re.compile(r"[0-9]+\.?[0-9]*|\.[0-9]+")  # ASCII digits only, as megatron-core reads


def parse_split(split: str) -> list[float]:
    """``"98, 1, 1"`` to normalised proportions ``[0.98, 0.01, 0.01]``; missing trailing values are 0.

    The numbers are those megatron-core reads from its accepted strings, normalised the same way, but every part
    must be a plain decimal number: megatron-core silently drops what is not (``"98,1,abc"`` becomes ``98, 1, 0``
    and ``"nan,1,1"`` becomes ``1, 1, 0``), here it is an error naming the part. Commas, semicolons, slashes,
    colons or spaces separate the parts.
    """
    if not isinstance(split, str):
        raise DataConfigError(
            f"split must be a string of {_SPLIT_FORM}, got {split!r} ({type(split).__name__}); quote it in YAML"
        )
    parts = _SPLIT_SEPARATOR.split(split.strip())
    for position, part in enumerate(parts, 1):
        if not _SPLIT_NUMBER.fullmatch(part):
            what = "is empty" if not part else f"({part!r}) is not a non-negative decimal number"
            raise DataConfigError(f"split {split!r}: part {position} {what}; write {_SPLIT_FORM}")
    if len(parts) > 3:
        raise DataConfigError(f"split {split!r} has {len(parts)} parts; write {_SPLIT_FORM}")
    values = [float(part) for part in parts] + [0.0] * (3 - len(parts))
    total = sum(values)
    if total <= 0:
        raise DataConfigError(f"split {split!r} gives every split a share of 0; give the train split a share")
    if not math.isfinite(total):
        raise DataConfigError(f"split {split!r} holds a number too large for a float; write {_SPLIT_FORM}")
    # float64 division as numpy does it, so boundaries match megatron-core bit for bit
    return [v / total for v in values]


def sample_counts(sizes: Iterable[int | None] | None) -> list[int | None]:
    """``train_valid_test_num_samples`` checked: three entries, each a sample count >= 0 or None (one epoch of that
    split); None alone means one epoch of every split."""
    if sizes is None:
        return [None, None, None]
    if isinstance(sizes, str | bytes | Mapping) or not isinstance(sizes, Iterable):
        raise DataConfigError(
            f"train_valid_test_num_samples must be a list of three sample counts (train, valid, test; null for one "
            f"epoch), got {sizes!r}"
        )
    sizes = list(sizes)
    if len(sizes) != 3:
        raise DataConfigError(f"train_valid_test_num_samples must have three entries, got {sizes}")
    return [
        None if count is None else require_int(f"train_valid_test_num_samples[{index}] ({name} samples)", count, 0)
        for index, (name, count) in enumerate(zip(SPLIT_NAMES, sizes, strict=True))
    ]


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """Per-split ``(begin, end)`` fractions; a zero-width split is None. The first bound is the int 0, as upstream."""
    bounds: list[float] = [0]
    for value in parse_split(split):
        bounds.append(bounds[-1] + value)
    return [(b, e) if e > b else None for b, e in zip(bounds[:-1], bounds[1:], strict=True)]


def split_range(bookend: tuple[float, float] | None, num_elements: int) -> tuple[int, int] | None:
    """Element range ``[begin, end)`` of a split; Python's round-half-even, as megatron-core."""
    if bookend is None:
        return None
    return int(round(bookend[0] * float(num_elements))), int(round(bookend[1] * float(num_elements)))


# -- blends --------------------------------------------------------------------------------------------------------


def _as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _discover_prefixes(directory: Path) -> list[str]:
    """Every ``<prefix>.bin``/``.idx`` pair below ``directory``, sorted by path (deterministic), but for the
    loss-mask pairs ``<prefix>_loss_mask`` of pairs found (read with their tokens, not as data of their own)."""
    found = sorted(str(p.with_suffix("")) for p in directory.rglob("*.idx") if p.with_suffix(".bin").is_file())
    pairs = set(found)
    prefixes = [p for p in found if not (p.endswith(LOSS_MASK_SUFFIX) and p.removesuffix(LOSS_MASK_SUFFIX) in pairs)]
    if not prefixes:
        raise DataFileError(f"no .bin/.idx pairs found under the directory {directory}")
    return prefixes


def _is_directory_of_pairs(path: str | os.PathLike) -> bool:
    """A directory to search, unless ``<path>.idx`` exists: a prefix wins over the same-named directory that
    holds its default cache (``<prefix>/cache/GPTDataset_indices``)."""
    return os.path.isdir(path) and not os.path.isfile(os.fspath(path) + ".idx")


def parse_blend(data_path: DataPath) -> Blend:
    """Turn ``data_path`` into a ``Blend``.

    Accepted forms: one prefix; a directory (every ``.bin``/``.idx`` pair below it, sorted, unweighted); a list of
    prefixes (unweighted); a Megatron blend list ``[weight, prefix, weight, prefix, ...]``. A list that mixes
    numbers and prefixes in any other way is an error naming the entry, never silently reread as prefixes.
    """
    if isinstance(data_path, (str, os.PathLike)):
        if not os.fspath(data_path).strip():
            raise DataConfigError("data_path is empty; give a prefix, a directory or a blend list")
        if _is_directory_of_pairs(data_path):
            return Blend(tuple(_discover_prefixes(Path(data_path))))
        entries = str(data_path).split()
    else:
        entries = [str(entry) for entry in data_path]
    entries = [e.strip() for e in entries if e.strip()]
    if not entries:
        raise DataConfigError("data_path is empty; give a prefix, a directory or a blend list")
    numbers = [_as_number(e) for e in entries]
    if all(n is None for n in numbers):
        expanded: list[str] = []
        for entry in entries:
            expanded += _discover_prefixes(Path(entry)) if _is_directory_of_pairs(entry) else [entry]
        return Blend(tuple(expanded))
    weights, prefixes = numbers[0::2], entries[1::2]
    if len(entries) % 2 or any(w is None for w in weights) or any(n is not None for n in numbers[1::2]):
        position = next((i for i, n in enumerate(numbers) if (i % 2 == 0) == (n is None)), len(entries) - 1)
        raise DataConfigError(
            f"malformed blend list {entries}: entry {position} ({entries[position]!r}) breaks the "
            "[weight, prefix, weight, prefix, ...] pattern; give a weight before every prefix, or no weights at all"
        )
    return Blend(tuple(prefixes), tuple(float(w) for w in weights))
