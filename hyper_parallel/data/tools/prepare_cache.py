"""Build the index caches of a training run ahead of time, on CPU, without ``torch.distributed``.

At start-up, rank 0 builds the document, sample, shuffle and blending indices of every dataset while every
accelerator waits; with large blends that takes minutes. This command runs the same construction
(``build_indexed_text_dataset``) beforehand, so that training finds every index in ``data_cache_path``::

    python -m hyper_parallel.data.tools.prepare_cache \\
        --data-path 30 /data/a_text_document 70 /data/b_text_document --split "969, 30, 1" \\
        --seq-length 4096 --tokenizer-name-or-path /models/tokenizer --data-cache-path /cache/indices \\
        --global-batch-size 512 --train-iters 10000 --eval-interval 1000 --eval-iters 10

Training must then use the same data paths (written the same way), split, sequence length, seed, tokenizer,
extra-token and validation settings, and the same sample counts: they are all part of the cache keys. With the
cache prepared, training can set ``fast_cache_load`` and ``defer_npy_index_mmap``. Running the command again
checks every existing entry whole and rebuilds a damaged one.

Sample counts follow megatron-core's training loop: train = train_iters * global batch; valid =
(train_iters // eval_interval + 1) * eval_iters * global batch; test = eval_iters * global batch. Without a
global batch size, the default one is micro batch * data-parallel size, with the data-parallel size derived
from ``--prepare-cache-world-size`` as the real job would.

Owns: the command line, the sample-count arithmetic and the report. Not responsible for: building the datasets
or their caches (``text.build_dataset``, ``indexed.index_cache``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.index_cache import writable_directory
from hyper_parallel.data.indexed.indexed_data_config import SPLIT_NAMES, DataPath, IndexedDataConfig
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset
from hyper_parallel.data.text.build_tokenizer import build_tokenizer
from hyper_parallel.data.tools.cli import command_parser

__all__ = [
    "CacheRequest",
    "build_parser",
    "default_global_batch_size",
    "format_report",
    "format_settings",
    "main",
    "num_samples_from_schedule",
    "prepare_cache",
    "request_from_args",
]

_PROG = "hp-data prepare-cache"

# Settings that only make sense once the cache exists, or that would skip building: off while preparing.
_TURNED_OFF = ("fast_cache_load", "defer_npy_index_mmap", "data_lazy_load")

_EXAMPLES = f"""\
examples:
  # one prefix, counts from the batch schedule (as megatron-core computes them)
  {_PROG} --data-path /data/a_text_document --seq-length 4096 \\
      --tokenizer-name-or-path /models/tokenizer --data-cache-path /cache/indices \\
      --global-batch-size 512 --train-iters 10000 --eval-interval 1000 --eval-iters 10

  # a weighted blend, explicit sample counts
  {_PROG} --data-path 30 /data/a_text_document 70 /data/b_text_document --split "98, 1, 1" \\
      --seq-length 4096 --tokenizer-name-or-path /models/tokenizer --data-cache-path /cache/indices \\
      --train-samples 5120000 --valid-samples 56320 --test-samples 5120

  # the job sets no global batch size: give the micro batch and the job's world size
  {_PROG} --data-path /data/shards/ --seq-length 4096 --tokenizer-name-or-path /models/tokenizer \\
      --data-cache-path /cache/indices --micro-batch-size 4 --prepare-cache-world-size 64 \\
      --tensor-model-parallel-size 2 --train-iters 10000 --eval-interval 1000 --eval-iters 10

  # separate files per split
  {_PROG} --train-data-path /data/train --valid-data-path /data/valid --seq-length 4096 \\
      --tokenizer-name-or-path /models/tokenizer --data-cache-path /cache/indices \\
      --train-samples 100000 --valid-samples 1000

then train with data_cache_path: /cache/indices (and fast_cache_load: true, defer_npy_index_mmap: true).

exit status: 0 on success, 2 on a usage error or a file that cannot be read.
"""


# -- sample counts ------------------------------------------------------------------------------------------------


def _check_positive(name: str, value: int | None, allow_zero: bool = False) -> None:
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise DataConfigError(f"{name} must be {'>= 0' if allow_zero else 'positive'}, got {value}")


def default_global_batch_size(
    micro_batch_size: int,
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> int:
    """megatron-core's default global batch: micro batch * data-parallel size.

    The data-parallel size is ``world_size // (tensor * pipeline * context parallel sizes)``.

    Example:
        micro batch 4, world size 64, tensor parallel 2: 4 * 64 // 2 = 128.
    """
    for name, value in (
        ("micro_batch_size", micro_batch_size),
        ("world_size", world_size),
        ("tensor_model_parallel_size", tensor_model_parallel_size),
        ("pipeline_model_parallel_size", pipeline_model_parallel_size),
        ("context_parallel_size", context_parallel_size),
    ):
        _check_positive(name, value)
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_parallel:
        raise DataConfigError(
            f"world size {world_size} is not divisible by tensor * pipeline * context parallel sizes = "
            f"{model_parallel}; give the sizes of the real job"
        )
    return micro_batch_size * (world_size // model_parallel)


def num_samples_from_schedule(
    *,
    global_batch_size: int | None = None,
    train_iters: int | None = None,
    eval_interval: int | None = None,
    eval_iters: int | None = None,
    train_samples: int | None = None,
    valid_samples: int | None = None,
    test_samples: int | None = None,
) -> tuple[int, int | None, int | None]:
    """The samples per split that training requests, as megatron-core's ``get_train_valid_test_num_samples``.

    An explicit count wins. Otherwise train = ``train_iters * gbs``; valid = ``(train_iters // eval_interval + 1)
    * eval_iters * gbs``; test = ``eval_iters * gbs``. With ``train_samples`` instead of ``train_iters``, the
    iteration count is ``train_samples // gbs``. A valid or test count that cannot be computed is None (one
    epoch of the split, as ``build_indexed_text_dataset`` reads None).

    Example:
        gbs 8, 100 iterations, eval every 30 for 2 iterations: train 800, valid (100 // 30 + 1) * 2 * 8 = 64,
        test 2 * 8 = 16.

    Raises:
        DataConfigError: no way to know the train count, both ``train_samples`` and ``train_iters``, or a
            count that is not positive.
    """
    _check_positive("global_batch_size", global_batch_size)
    _check_positive("train_iters", train_iters)
    _check_positive("eval_interval", eval_interval)
    _check_positive("eval_iters", eval_iters, allow_zero=True)
    _check_positive("train_samples", train_samples)
    _check_positive("valid_samples", valid_samples, allow_zero=True)
    _check_positive("test_samples", test_samples, allow_zero=True)
    if train_samples is not None and train_iters is not None:
        raise DataConfigError(
            f"give train_samples ({train_samples}) or train_iters ({train_iters}), not both: each fixes the other"
        )
    if train_samples is None:
        if train_iters is None or global_batch_size is None:
            raise DataConfigError(
                "the number of train samples is unknown: give train_samples, or train_iters with a global batch "
                "size (or a micro batch size and the world size)"
            )
        train_samples = train_iters * global_batch_size
    elif train_iters is None and global_batch_size is not None:
        train_iters = train_samples // global_batch_size
    if valid_samples is None and None not in (eval_interval, eval_iters, train_iters, global_batch_size):
        valid_samples = (train_iters // eval_interval + 1) * eval_iters * global_batch_size
    if test_samples is None and None not in (eval_iters, global_batch_size):
        test_samples = eval_iters * global_batch_size
    return train_samples, valid_samples, test_samples


# -- preparation --------------------------------------------------------------------------------------------------


def _require_writable(directory: Path) -> None:
    """Refuse a cache directory that cannot be written: building would then keep the indices in memory only."""
    if not writable_directory(directory):
        raise DataConfigError(
            f"data_cache_path {directory} is not a writable directory; preparing a cache needs one, on a file "
            "system that the training job's ranks share"
        )


def _preparation_config(data_config: IndexedDataConfig | Mapping) -> tuple[IndexedDataConfig, list[str]]:
    """The config to prepare with, and the names of the settings turned off for it.

    Raises:
        DataConfigError: mock data, packed records (neither builds an index cache) or no ``data_cache_path``.
    """
    config = (
        data_config if isinstance(data_config, IndexedDataConfig) else IndexedDataConfig.from_mapping(dict(data_config))
    )
    if config.mock_data:
        raise DataConfigError(
            "mock_data is set, but mock documents are synthetic and have no files whose indices could be cached; "
            "prepare a cache for real data paths, or train with mock data directly (it needs no cache)"
        )
    if config.is_dataset_from_mr:
        raise DataConfigError(
            "is_dataset_from_mr is set, but offline-packed records are read in order and build no index cache; "
            "there is nothing to prepare"
        )
    if config.data_cache_path is None:
        raise DataConfigError(
            "data_cache_path (--data-cache-path) is required: the caches are written there, and training must "
            "read them from the same directory"
        )
    turned_off = [name for name in _TURNED_OFF if getattr(config, name)]
    # Entries that exist are checked whole, so that preparing again also finds (and rebuilds) damaged ones.
    checked = dataclasses.replace(config, cache_verification="full", **dict.fromkeys(turned_off, False))
    return checked, turned_off


def _cache_files(directory: Path) -> set[str]:
    if not directory.is_dir():
        return set()
    return {entry.name for entry in os.scandir(directory) if entry.is_file() and not entry.name.endswith(".lock")}


def _describe(dataset) -> dict | None:
    """Type and length of a built split, and of each source of a blend."""
    if dataset is None:
        return None
    described = {"type": type(dataset).__name__, "length": len(dataset)}
    if hasattr(dataset, "datasets"):
        described["sources"] = [
            {"type": type(d).__name__, "path": getattr(d, "dataset_path", None), "length": len(d)}
            for d in dataset.datasets
        ]
    return described


def prepare_cache(
    data_config: IndexedDataConfig | Mapping,
    tokenizer,
    train_valid_test_num_samples: Sequence[int | None] | None = None,
    data_path: DataPath | None = None,
) -> dict:
    """Build every index cache that ``build_indexed_text_dataset`` will load with these arguments.

    ``fast_cache_load``, ``defer_npy_index_mmap`` and ``data_lazy_load`` are turned off while preparing (the
    first two need the cache this builds; the last would build nothing). Entries that already exist are checked
    whole (``cache_verification: "full"``) and rebuilt, with a warning, if damaged. Nothing waits on other ranks:
    processes preparing the same cache at once are serialised by file locks.

    Args:
        data_config: the training run's ``IndexedDataConfig`` (or mapping); ``data_cache_path`` is required.
        tokenizer: the training run's tokenizer, or the path of a local Hugging Face tokenizer.
        train_valid_test_num_samples: the training run's samples per split (None entries: one epoch).
        data_path: the training run's data path; not needed with per-split paths.

    Returns:
        ``{"data_cache_path", "num_samples", "turned_off", "splits", "files_written"}``: ``splits`` maps each split
        name to None or ``{"type", "length"}`` (plus ``"sources"`` for a blend); ``files_written`` lists the new
        files in the cache directory (empty when everything was cached already).

    Raises:
        DataConfigError: mock data, packed records, no ``data_cache_path``, an unwritable cache directory, no data
            path, or any error building the datasets.
        DataFileError: a data file is missing or malformed.
    """
    config, turned_off = _preparation_config(data_config)
    if data_path is None and not config.has_per_split_paths:
        raise DataConfigError(
            "nothing to prepare: give data_path (a prefix, a directory or a blend list) or per-split paths"
        )
    directory = Path(config.data_cache_path)
    _require_writable(directory)
    before = _cache_files(directory)
    sizes = None if train_valid_test_num_samples is None else list(train_valid_test_num_samples)
    splits = build_indexed_text_dataset(data_path, config, sizes, tokenizer, synchronize=False)
    return {
        "data_cache_path": str(directory),
        "num_samples": sizes if sizes is not None else [None, None, None],
        "turned_off": turned_off,
        "splits": {name: _describe(dataset) for name, dataset in zip(SPLIT_NAMES, splits, strict=True)},
        "files_written": sorted(_cache_files(directory) - before),
    }


# -- command line -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheRequest:
    """What the command line asks to prepare: the arguments of ``prepare_cache`` plus how the batch was found."""

    data_path: tuple[str, ...] | None
    config: IndexedDataConfig
    num_samples: tuple[int, int | None, int | None]
    tokenizer_path: str
    global_batch_size: int | None
    global_batch_source: str


def _add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data (as in the training run)")
    group.add_argument(
        "--data-path",
        nargs="+",
        metavar="PATH",
        help="a prefix (local or an fsspec URL), a directory of .bin/.idx pairs, or a blend list, e.g. --data-path 30 "
        "/data/a_text_document 70 s3://bucket/b_text_document",
    )
    for split in SPLIT_NAMES:
        group.add_argument(
            f"--{split}-data-path",
            nargs="+",
            metavar="PATH",
            help=f"separate {split} data (then --split is unused), e.g. --{split}-data-path "
            f"/data/{split}_text_document",
        )
    group.add_argument(
        "--split",
        default="969, 30, 1",
        help='train/valid/test proportions, e.g. --split "98, 1, 1" (default: 969, 30, 1)',
    )
    group.add_argument("--seq-length", type=int, required=True, help="tokens per sample, e.g. --seq-length 4096")
    group.add_argument("--seed", type=int, default=1234, help="seed of the index shuffles (default: 1234)")
    group.add_argument(
        "--tokenizer-name-or-path",
        required=True,
        metavar="PATH",
        help="local Hugging Face tokenizer directory or tokenizer.json of the training run (its identity is part "
        "of the cache keys), e.g. --tokenizer-name-or-path /models/tokenizer",
    )
    group.add_argument(
        "--no-add-extra-token",
        dest="add_extra_token_to_sequence",
        action="store_false",
        help="samples read seq_length tokens instead of seq_length + 1, e.g. --no-add-extra-token",
    )
    group.add_argument(
        "--keep-last-partial-validation-sequence",
        dest="drop_last_partial_validation_sequence",
        action="store_false",
        help="pad the last partial validation sample instead of dropping it",
    )
    group.add_argument(
        "--mid-level-dataset-surplus",
        type=float,
        default=0.005,
        help="extra fraction of samples built per weighted blend source, e.g. --mid-level-dataset-surplus 0.01 "
        "(default: 0.005)",
    )
    group.add_argument(
        "--data-cache-path",
        metavar="DIR",
        help="(required) where the caches go; training must use the same directory, e.g. --data-cache-path "
        "/cache/indices",
    )
    group.add_argument("--mock-data", action="store_true", help="refused: mock data has no files to cache")
    group.add_argument("--is-dataset-from-mr", action="store_true", help="refused: packed records build no cache")


def _add_sample_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sample counts", "explicit counts, or a batch schedule to compute them from as megatron-core does"
    )
    for split in SPLIT_NAMES:
        group.add_argument(
            f"--{split}-samples", type=int, metavar="N", help=f"{split} samples, e.g. --{split}-samples 1000"
        )
    group.add_argument(
        "--global-batch-size", type=int, metavar="N", help="samples per step, e.g. --global-batch-size 512"
    )
    group.add_argument("--train-iters", type=int, metavar="N", help="training steps, e.g. --train-iters 10000")
    group.add_argument(
        "--eval-interval", type=int, metavar="N", help="steps between evaluations, e.g. --eval-interval 1000"
    )
    group.add_argument("--eval-iters", type=int, metavar="N", help="steps per evaluation, e.g. --eval-iters 10")
    group.add_argument(
        "--micro-batch-size",
        type=int,
        metavar="N",
        help="without --global-batch-size: the default global batch is micro batch * data-parallel size",
    )
    group.add_argument(
        "--prepare-cache-world-size",
        type=int,
        metavar="N",
        help="the training job's world size, for the default global batch, e.g. --prepare-cache-world-size 64",
    )
    for name in ("tensor-model", "pipeline-model", "context"):
        group.add_argument(
            f"--{name}-parallel-size",
            type=int,
            default=1,
            metavar="N",
            help="the training job's size, which divides the world size into the data-parallel size (default: 1)",
        )


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; every option's help carries an example."""
    parser = command_parser(
        "prepare-cache",
        (
            "Build the document, sample, shuffle and blending indices of a training run into --data-cache-path "
            "ahead of training, through the same construction as training, so that start-up only loads them."
        ),
        _EXAMPLES,
    )
    _add_dataset_arguments(parser)
    _add_sample_arguments(parser)
    return parser


def _global_batch(args: argparse.Namespace) -> tuple[int | None, str]:
    if args.global_batch_size is not None:
        return args.global_batch_size, "--global-batch-size"
    if args.micro_batch_size is None or args.prepare_cache_world_size is None:
        if args.micro_batch_size is not None or args.prepare_cache_world_size is not None:
            raise DataConfigError(
                "the default global batch needs both --micro-batch-size and --prepare-cache-world-size "
                "(or give --global-batch-size)"
            )
        return None, "none given"
    size = default_global_batch_size(
        args.micro_batch_size,
        args.prepare_cache_world_size,
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    data_parallel = size // args.micro_batch_size
    return size, f"micro batch {args.micro_batch_size} x data-parallel size {data_parallel}"


def request_from_args(args: argparse.Namespace) -> CacheRequest:
    """Turn parsed arguments into a ``CacheRequest``.

    Raises:
        DataConfigError: invalid settings (mock data, packed records and a missing cache directory first) or
            sample counts.
    """

    def as_tuple(values: list[str] | None) -> tuple[str, ...] | None:
        return None if values is None else tuple(values)

    config = IndexedDataConfig(
        seq_length=args.seq_length,
        split=args.split,
        random_seed=args.seed,
        mock_data=args.mock_data,
        is_dataset_from_mr=args.is_dataset_from_mr,
        add_extra_token_to_sequence=args.add_extra_token_to_sequence,
        drop_last_partial_validation_sequence=args.drop_last_partial_validation_sequence,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        data_cache_path=args.data_cache_path,
        train_data_path=as_tuple(args.train_data_path),
        valid_data_path=as_tuple(args.valid_data_path),
        test_data_path=as_tuple(args.test_data_path),
    )
    _preparation_config(config)  # refuse what cannot be prepared before asking about sample counts
    global_batch_size, source = _global_batch(args)
    num_samples = num_samples_from_schedule(
        global_batch_size=global_batch_size,
        train_iters=args.train_iters,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        train_samples=args.train_samples,
        valid_samples=args.valid_samples,
        test_samples=args.test_samples,
    )
    return CacheRequest(
        as_tuple(args.data_path), config, num_samples, args.tokenizer_name_or_path, global_batch_size, source
    )


def _format_count(count: int | None) -> str:
    return "one epoch" if count is None else f"{count:,}"


def format_settings(request: CacheRequest, tokenizer) -> str:
    """The effective values, one per line."""
    config = request.config
    if config.has_per_split_paths:
        paths = [
            (f"{split}_data_path", " ".join(path) if path is not None else "-")
            for split, path in zip(
                SPLIT_NAMES, (config.train_data_path, config.valid_data_path, config.test_data_path), strict=True
            )
        ]
    else:
        paths = [("data_path", " ".join(request.data_path or ())), ("split", config.split)]
    batch = (
        "-" if request.global_batch_size is None else f"{request.global_batch_size:,} ({request.global_batch_source})"
    )
    rows = [
        *paths,
        ("seq_length", f"{config.seq_length:,}"),
        ("seed", str(config.random_seed)),
        ("tokenizer", f"{request.tokenizer_path} (eod {tokenizer.eod}, pad {tokenizer.pad_token_id})"),
        ("add_extra_token_to_sequence", str(config.add_extra_token_to_sequence).lower()),
        ("drop_last_partial_validation_sequence", str(config.drop_last_partial_validation_sequence).lower()),
        ("mid_level_dataset_surplus", str(config.mid_level_dataset_surplus)),
        ("global batch size", batch),
        (
            "samples",
            ", ".join(f"{s} {_format_count(n)}" for s, n in zip(SPLIT_NAMES, request.num_samples, strict=True)),
        ),
        ("data_cache_path", str(config.data_cache_path)),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def format_report(report: dict) -> str:
    """Each split's dataset type and length, then the files written."""
    lines = []
    if report["turned_off"]:
        lines.append(f"turned off while preparing: {', '.join(report['turned_off'])} (set them again in training)")
    lines.append("datasets:")
    for split, described in report["splits"].items():
        if described is None:
            lines.append(f"  {split}: none (empty split)")
            continue
        lines.append(f"  {split}: {described['type']}, {described['length']:,} samples")
        for i, source in enumerate(described.get("sources", [])):
            lines.append(f"    [{i}] {source['type']} {source['path']}: {source['length']:,} samples")
    written = report["files_written"]
    if written:
        lines.append(f"cache directory {report['data_cache_path']}: {len(written)} files written")
        lines += [f"  {name}" for name in written]
    else:
        lines.append(f"cache directory {report['data_cache_path']}: nothing written, every index was cached already")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 2 error)."""
    from hyper_parallel.data.dataset_logging import enable_dataset_logging

    args = build_parser().parse_args(argv)
    enable_dataset_logging("info", ranks=None)
    try:
        request = request_from_args(args)
        tokenizer = build_tokenizer(request.tokenizer_path)
        print("preparing the index caches with:")
        print(format_settings(request, tokenizer))
        report = prepare_cache(request.config, tokenizer, request.num_samples, request.data_path)
    except (DataConfigError, DataFileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
