"""Choose and open the Online source: mapping (``streaming=False``) or iterable (``streaming=True``).

Owns: ``OnlineDataConfig`` (the ``data_config`` of ``build_online_text_dataset``) and opening the source it
describes, with rank 0 writing the Hugging Face Arrow cache first when ranks share storage, and the list of files
the source reads (their identity goes into loader states). Not responsible for: transforms, sampling or batching.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.parallel.build_barrier import rank_zero_first
from hyper_parallel.data.text.online.online_iterable_dataset import OnlineIterableDataset
from hyper_parallel.data.text.online.online_mapping_dataset import OnlineMappingDataset
from hyper_parallel.data.text.online.online_utils import open_hf_dataset
from hyper_parallel.data.text.records import data_path_entries, is_saved_hf_dataset, resolve_data_files

__all__ = ["OnlineDataConfig", "open_online_source"]

logger = get_logger(__name__)

DATASET_TYPES = ("mapping", "iterable")


@dataclass(frozen=True, kw_only=True)
class OnlineDataConfig:
    """How to read an Online source.

    Attributes:
        dataset_type: ``mapping`` (random access; order and DP assignment by the batch sampler) or ``iterable``
            (a stream; shuffled by a bounded buffer and split between DP ranks by the source).
        shuffle_buffer_size: records buffered to shuffle a stream (iterable only); 0 keeps the file order.
        cache_dir: where Hugging Face ``datasets`` writes the Arrow cache of a mapping source, beside the local
            copies of its files at URLs (default: its own).
        split: the split to read from a saved ``DatasetDict``.
        valid_data_path, test_data_path: optional separate sources; with either, the builder returns
            ``(train, valid, test)``.
    """

    dataset_type: Literal["mapping", "iterable"] = "mapping"
    shuffle_buffer_size: int = 10_000
    cache_dir: str | None = None
    split: str = "train"
    valid_data_path: str | list[str] | None = None
    test_data_path: str | list[str] | None = None

    def __post_init__(self) -> None:
        if self.dataset_type not in DATASET_TYPES:
            raise DataConfigError(
                f"dataset_type is {self.dataset_type!r}; use 'mapping' (random access, streaming=False) or "
                "'iterable' (streaming=True)"
            )
        size = self.shuffle_buffer_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:  # a bool is an int to Python
            raise DataConfigError(f"shuffle_buffer_size is {size!r}; use a record count >= 0 (0 keeps the file order)")

    @classmethod
    def from_mapping(cls, values: Mapping | None) -> OnlineDataConfig:
        """Build from a YAML mapping; an unknown key is an error that lists the known ones."""
        values = dict(values or {})
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise DataConfigError(f"unknown data_config keys {unknown} for an Online dataset; known: {sorted(known)}")
        return cls(**values)


def _source_files(data_path: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The files a source reads: the data files the path names, or every file of a ``save_to_disk`` directory."""
    entries = data_path_entries(data_path)
    path = Path(entries[0]).expanduser()
    if len(entries) == 1 and path.is_dir() and is_saved_hf_dataset(path):
        return sorted(item for item in path.rglob("*") if item.is_file())
    return resolve_data_files(data_path)[0]


def open_online_source(
    data_path: str | os.PathLike | Sequence[str | os.PathLike],
    config: OnlineDataConfig,
    *,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    seed: int = 1234,
) -> OnlineMappingDataset | OnlineIterableDataset:
    """Open ``data_path`` as the source ``config.dataset_type`` asks for."""
    streaming = config.dataset_type == "iterable"

    def load():
        started = time.time_ns()  # after rank 0's turn: what this rank's load writes is newer
        return *open_hf_dataset(data_path, streaming=streaming, cache_dir=config.cache_dir, split=config.split), started

    # A mapping source writes an Arrow cache: let rank 0 write it while the other ranks wait, then reuse it.
    hf_dataset, description, started = load() if streaming else rank_zero_first(load)
    files = _source_files(data_path)
    if not streaming:
        source = OnlineMappingDataset(hf_dataset, description, files=files)
        logger.info(
            "Online dataset type: mapping (random access), %s, %s records; %s",
            description,
            f"{len(source):,}",
            _arrow_cache(hf_dataset, started),
        )
        return source
    logger.info(
        "Online dataset type: iterable (streamed, no cache), %s; DP rank %d of %d reads its share, shuffle buffer %d "
        "records, seed %d",
        description,
        dp_rank,
        dp_world_size,
        config.shuffle_buffer_size,
        seed,
    )
    return OnlineIterableDataset(
        hf_dataset,
        description,
        files=files,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        shuffle_buffer_size=config.shuffle_buffer_size,
        seed=seed,
    )


def _arrow_cache(hf_dataset, started: int) -> str:
    """Where a mapping source's Arrow files are, and whether this load wrote them (newer than ``started``, in
    nanoseconds) or found them, for its log line."""
    files = [entry["filename"] for entry in hf_dataset.cache_files]
    if not files:
        return "held in memory (no Arrow cache)"
    written = any(os.stat(file).st_mtime_ns >= started for file in files)
    return f"Arrow cache {'written to' if written else 'reused from'} {os.path.dirname(files[0])}"
