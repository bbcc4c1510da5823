"""Write the ``{prefix: [sequence_count, document_count]}`` file read through ``per_dataset_sequences_path``.

With hundreds or thousands of prefixes, opening every ``.idx`` at start-up to learn its size stresses the file
system. This command reads each header once, ahead of training, into one JSON file; training then reads that
file instead (``IndexedDataConfig.per_dataset_sequences_path``)::

    python -m hyper_parallel.data.tools.build_sequences_per_dataset \\
        --data-path 30 /data/a_text_document 70 /data/b_text_document \\
        --per-dataset-sequences-path /data/sequences_per_dataset.json

The keys are the prefixes exactly as the data paths give them (blend weights skipped, directories expanded as
training expands them), since training looks them up by that string. ``document_count`` is the raw header
value, i.e. the number of documents + 1, as in megatron-core's file. Each header's counts are checked against
its ``.idx`` size. Training compares the counts with each header when it opens the prefix and refuses stale ones,
so rerun this command whenever the data changes.

Owns: collecting the unique prefixes of the data paths, reading the 34-byte headers and writing the file
atomically. Not responsible for: parsing blends (``indexed.indexed_data_config``), the header layout
(``indexed.idx_format``) or using the counts (``indexed.indexed_split_builder``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from tqdm import tqdm

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.file_writes import write_atomically
from hyper_parallel.data.indexed.indexed_data_config import DataPath, parse_blend
from hyper_parallel.data.indexed.indexed_data_reader import read_sequence_counts
from hyper_parallel.data.tools.cli import command_parser

__all__ = ["build_parser", "collect_prefixes", "main", "write_sequences_per_dataset"]

_PROG = "hp-data sequences-per-dataset"

_EXAMPLES = f"""\
examples:
  {_PROG} --data-path /data/a_text_document --per-dataset-sequences-path seqs.json
  {_PROG} --data-path 30 /data/a_text_document 70 /data/b_text_document --per-dataset-sequences-path seqs.json
  {_PROG} --data-path /data/shards/ --per-dataset-sequences-path seqs.json
  {_PROG} --train-data-path /data/train --valid-data-path /data/valid --per-dataset-sequences-path seqs.json

then train with per_dataset_sequences_path: seqs.json and the same data paths, written the same way.

exit status: 0 on success, 2 on a usage error or a file that cannot be read.
"""


def collect_prefixes(data_paths: Iterable[DataPath | None]) -> list[str]:
    """Every unique prefix of ``data_paths`` (blend weights skipped), in order of first appearance.

    Args:
        data_paths: data paths in the forms training accepts (a prefix, a directory, a blend list); None and
            empty lists are skipped.

    Raises:
        DataConfigError: no prefix at all, or a malformed blend list.
    """
    prefixes: dict[str, None] = {}
    for data_path in data_paths:
        if data_path is None or (not isinstance(data_path, (str, os.PathLike)) and not data_path):
            continue
        prefixes.update(dict.fromkeys(parse_blend(data_path).prefixes))
    if not prefixes:
        raise DataConfigError(
            "no dataset prefixes were given; pass the data paths of the training run (data_path and/or "
            "train/valid/test_data_path)"
        )
    return list(prefixes)


def write_sequences_per_dataset(
    prefixes: Iterable[str], output_path: str | os.PathLike, progress: bool = True
) -> dict[str, list[int]]:
    """Read every prefix's header and write ``{prefix: [sequence_count, document_count]}`` to ``output_path``.

    The file is written under a temporary name and renamed, so a reader never sees a partial file.

    Args:
        prefixes: dataset prefixes, used as the keys exactly as given.
        output_path: the JSON file; its directory must exist.
        progress: show a progress bar when writing to a terminal.

    Returns:
        The mapping written.
    """
    output_path = Path(output_path)
    if not output_path.parent.is_dir():
        raise DataConfigError(
            f"cannot write {output_path}: directory {output_path.parent} does not exist; create it first"
        )
    prefixes = list(prefixes)
    counts = {
        prefix: list(read_sequence_counts(prefix))
        for prefix in tqdm(prefixes, desc="reading .idx headers", unit="prefix", disable=None if progress else True)
    }
    write_atomically(output_path, (json.dumps(counts, indent=1) + "\n").encode("utf-8"))
    return counts


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; every option's help carries an example."""
    parser = command_parser(
        "sequences-per-dataset",
        (
            "Read the header of every dataset prefix of a training run and write their sequence and document "
            "counts to one JSON file, for per_dataset_sequences_path: training then reads one file instead of "
            "opening every .idx at start-up."
        ),
        _EXAMPLES,
    )
    for name, example in (
        ("data", "30 /data/a_text_document 70 /data/b_text_document"),
        ("train-data", "/data/train_text_document"),
        ("valid-data", "/data/valid_text_document"),
        ("test-data", "/data/test_text_document"),
    ):
        parser.add_argument(
            f"--{name}-path",
            nargs="*",
            default=[],
            metavar="PATH",
            help=f"prefixes (local or fsspec URLs), directories or a blend list (weights are skipped), as in training, "
            f"e.g. --{name}-path {example}",
        )
    parser.add_argument(
        "--per-dataset-sequences-path",
        required=True,
        metavar="OUT.json",
        help="the JSON file to write, e.g. --per-dataset-sequences-path /data/sequences_per_dataset.json",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 2 error)."""
    args = build_parser().parse_args(argv)
    try:
        prefixes = collect_prefixes((args.data_path, args.train_data_path, args.valid_data_path, args.test_data_path))
        counts = write_sequences_per_dataset(prefixes, args.per_dataset_sequences_path)
    except (DataConfigError, DataFileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    sequences = sum(c[0] for c in counts.values())
    documents = sum(c[1] - 1 for c in counts.values())
    print(
        f"wrote {args.per_dataset_sequences_path}: {len(counts):,} prefixes, {sequences:,} sequences, "
        f"{documents:,} documents"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
