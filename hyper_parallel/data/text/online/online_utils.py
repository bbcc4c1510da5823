"""Opening local data files with Hugging Face ``datasets`` for the Online sources.

Owns: ``open_hf_dataset``: a file, glob, directory or ``save_to_disk`` folder as a random-access
``datasets.Dataset`` (Arrow cache under ``cache_dir``) or a streaming ``datasets.IterableDataset``, and a short
description of it for messages. Not responsible for: finding the files or reading raw records (``text.records``,
shared with the offline tools), sampling, or DP sharding (the sources).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.text.records import data_path_entries, is_saved_hf_dataset, resolve_data_files, select_hf_split

__all__ = ["open_hf_dataset"]

# Our format name -> the Hugging Face ``datasets`` builder that reads it (the names happen to agree).
_HF_BUILDERS = {"json": "json", "parquet": "parquet", "csv": "csv", "arrow": "arrow", "text": "text"}


def open_hf_dataset(
    data_path: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    streaming: bool,
    cache_dir: str | os.PathLike | None = None,
    split: str = "train",
):
    """Open local data files with Hugging Face ``datasets``.

    Args:
        data_path: a JSON/JSONL/Parquet/CSV/Arrow/text file, a glob, a directory of such files, a list of those
            (read in the order given), or a directory written by ``save_to_disk``.
        streaming: False gives a random-access ``datasets.Dataset`` (its Arrow cache is written under
            ``cache_dir``); True gives a ``datasets.IterableDataset`` read as it is iterated.
        split: the split of a saved ``DatasetDict``.

    Returns:
        The dataset and a short description of where it comes from, for messages.
    """
    entries = data_path_entries(data_path)
    path = Path(entries[0]).expanduser()
    if len(entries) == 1 and path.is_dir() and is_saved_hf_dataset(path):
        from datasets import load_from_disk

        dataset = select_hf_split(load_from_disk(str(path)), split, path, "set split to one of them")
        if streaming:
            dataset = dataset.to_iterable_dataset(num_shards=max(1, len(dataset.cache_files)))
        return dataset, str(path)
    files, fmt = resolve_data_files(data_path)
    from datasets import load_dataset

    description = str(files[0]) if len(files) == 1 else f"{len(files)} {fmt} files matching {', '.join(entries)}"
    try:
        dataset = load_dataset(
            _HF_BUILDERS[fmt],
            data_files=[str(f) for f in files],
            split="train",
            streaming=streaming,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
        )
    except Exception as error:  # noqa: BLE001 - the builders raise many types; all get the file named
        raise DataFileError(f"{description}: Hugging Face datasets could not read it as {fmt} ({error})") from error
    return dataset, description
