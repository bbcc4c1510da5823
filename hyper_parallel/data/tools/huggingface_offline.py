"""Offline preparation of a Hugging Face dataset: ``save_to_disk`` folders and local dataset directories.

Usage::

    python -m hyper_parallel.data.tools.huggingface_offline \\
        --dataset-name-or-path /data/my_dataset --split train --output-prefix /data/train \\
        --json-keys text --tokenizer-name-or-path /models/tokenizer

The dataset is read with Hugging Face ``datasets`` (``load_from_disk`` for a ``save_to_disk`` folder,
``load_dataset`` for a local dataset directory) and fed through the same pipeline as ``offline_preparation``:
same flags, same outputs. Only the columns the run needs are read. No code from the dataset runs: a dataset
directory holding a Python file (a ``datasets`` loading script) is refused, and so is a symbolic link where the
Arrow cache of a dataset directory is written.

Owns: loading the dataset and turning it into record chunks. Not responsible for: tokenizing or writing
(``offline_preparation``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.text.online.online_utils import refuse_cache_symlinks, refuse_loading_scripts
from hyper_parallel.data.text.records import RecordChunk, is_saved_hf_dataset, select_hf_split
from hyper_parallel.data.tools.offline_config import (
    OfflinePreparationConfig,
    add_preparation_arguments,
    config_from_args,
)
from hyper_parallel.data.tools.offline_preparation import (
    PreparationSummary,
    RecordSource,
    preparation_parser,
    run_cli,
    run_offline_preparation,
)

__all__ = ["load_hf_dataset", "main", "run_huggingface_offline"]


def load_hf_dataset(name_or_path: str, split: str = "train", subset: str | None = None):
    """Load one split of a local Hugging Face dataset as a ``datasets.Dataset``.

    Args:
        name_or_path: a ``save_to_disk`` folder (a Dataset or a DatasetDict) or a local dataset directory.
        split: the split to read from a DatasetDict or a dataset directory.
        subset: the configuration name of a dataset directory with several.

    Raises:
        DataFileError: nothing at the path, it cannot be loaded, or a symbolic link sits in its Arrow cache.
        DataConfigError: a dataset directory that holds a Python file (a loading script, never run).
    """
    import datasets
    from datasets.naming import camelcase_to_snakecase

    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise DataFileError(
            f"no dataset at '{name_or_path}': pass a folder written by `Dataset.save_to_disk` or a local "
            "dataset directory (download Hub datasets with `datasets.load_dataset(...).save_to_disk(DIR)` first)"
        )
    saved = is_saved_hf_dataset(path)
    if not saved:
        refuse_loading_scripts(path, recursive=True)
        # datasets names the directory's cache folder after it, snake-cased
        refuse_cache_symlinks(None, camelcase_to_snakecase(path.name))
    try:
        if saved:
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = datasets.load_dataset(str(path), name=subset, split=split, trust_remote_code=False)
    except (FileNotFoundError, ValueError) as error:
        raise DataFileError(f"could not load a Hugging Face dataset from {path}: {error}") from None
    return select_hf_split(loaded, split, path, "pass --split with one of them")


def _chunks(dataset, source: str, columns: list[str], chunk_size: int) -> Iterator[RecordChunk]:
    total_bytes = max(1, dataset.data.nbytes)
    rows = len(dataset)
    for start in range(0, rows, chunk_size):
        batch = dataset[start : start + chunk_size]
        count = len(batch[columns[0]]) if columns else 0
        items = [{column: batch[column][i] for column in columns} for i in range(count)]
        end = start + count
        yield RecordChunk(source, "records", items, list(range(start, end)), "row", total_bytes * end // rows)


def run_huggingface_offline(
    config: OfflinePreparationConfig, split: str = "train", subset: str | None = None
) -> PreparationSummary:
    """Prepare one split of a local Hugging Face dataset; see ``run_offline_preparation``."""
    dataset = load_hf_dataset(config.dataset_name_or_path, split, subset)
    columns = config.record_fields
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise DataFileError(
            f"{config.dataset_name_or_path} (split {split}): missing key(s) {missing}; the dataset has columns "
            f"{dataset.column_names}. Pass the right --json-keys, fix --text-template, or name the fields of "
            "instruction records (--instruction-key, --input-key, --output-key)"
        )
    dataset = dataset.select_columns(columns)
    source = RecordSource(
        chunks=_chunks(dataset, f"{config.dataset_name_or_path}[{split}]", columns, config.chunk_size),
        total_bytes=max(1, dataset.data.nbytes),
        total_records=len(dataset),
    )
    return run_offline_preparation(config, source)


def build_parser() -> argparse.ArgumentParser:
    parser = preparation_parser(
        "prepare-hf", __doc__, "a save_to_disk folder or a local Hugging Face dataset directory"
    )
    parser.add_argument("--split", default="train", help="split to convert (default: train)")
    parser.add_argument("--subset", default=None, help="configuration name, for dataset directories with several")
    add_preparation_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from hyper_parallel.data.dataset_logging import enable_dataset_logging

    args = build_parser().parse_args(argv)
    enable_dataset_logging("info", ranks=None)
    return run_cli(
        lambda: run_huggingface_offline(config_from_args(args), args.split, args.subset),
        "Hugging Face offline preparation finished:",
    )


if __name__ == "__main__":
    sys.exit(main())
