"""Preview the batches a pipeline config produces: decoded text with the trained-on tokens marked.

Usage::

    hp-data preview pipeline.yaml --tokenizer path/to/tokenizer_dir --batches 2
    hp-data preview pipeline.yaml   # the tokenizer of the config's model_assets node
    python -m hyper_parallel.data.tools.preview_batches pipeline.yaml --tokenizer DIR --json

For each batch it prints the shapes, the number of sequences and tokens, the tokens that carry loss, and each
sequence's text with those tokens between ``[[`` and ``]]`` (or highlighted on a terminal). It reads the batch
contract (``batching.batch.Batch``) alone, so Online and Indexed batches are shown the same way: sequences as
``cu_seq_lens`` cuts them (the Online padding is the last one; Indexed rows are cut after each EOD), trained
tokens as the loss mask counts them. Nothing is trained; the loaders are built exactly as a trainer builds them
(``batching.dataloader.build_dataloaders``). Over a mixture it ends with one line of what each source gave (samples,
their share, tokens: the loader state's ``mixture`` part).
Not responsible for: building the pipeline (that is the config) or checking masks (the transforms do).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Mapping

import numpy as np

from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.dataloader import SPLITS, build_dataloaders
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.instantiate import load_config
from hyper_parallel.data.mixture.mixture_tally import describe_mixture_state
from hyper_parallel.data.text.build_tokenizer import build_tokenizer

__all__ = ["describe_batch", "main", "marked_text"]

_PLAIN_MARKS = ("[[", "]]")
_TERMINAL_MARKS = ("\033[1;32m", "\033[0m")


def marked_text(input_ids: np.ndarray, labels: np.ndarray, decode, marks: tuple[str, str] = _PLAIN_MARKS) -> str:
    """The sequence as text, with the tokens that are loss targets between ``marks``.

    Labels are shifted (``labels[i]`` is the target after ``input_ids[i]``), so the text shown is the first input
    token followed by each position's target: the label where there is one, else the next input token.
    """
    tokens, trained = [int(input_ids[0])], [False]
    for position, label in enumerate(labels):
        if label != IGNORE_INDEX:
            tokens.append(int(label))
            trained.append(True)
        elif position + 1 < len(input_ids):
            tokens.append(int(input_ids[position + 1]))
            trained.append(False)
    pieces, start = [], 0
    for end in range(1, len(tokens) + 1):
        if end == len(tokens) or trained[end] != trained[start]:
            text = decode(tokens[start:end])
            pieces.append(f"{marks[0]}{text}{marks[1]}" if trained[start] else text)
            start = end
    return "".join(pieces)


def describe_batch(batch: Batch, decode, *, max_sequences: int = 4, marks: tuple[str, str] = _PLAIN_MARKS) -> dict:
    """Shapes, token counts and the marked text of the first ``max_sequences`` sequences of ``batch``."""
    if not isinstance(batch, Batch):
        raise DataConfigError(
            f"the collate_fn returned a {type(batch).__name__}, not a Batch; preview reads the batch contract, so use "
            "build_online_text_collate_fn or build_indexed_collate_fn (or a collate_fn that returns a Batch)"
        )
    texts = []
    for ids, labels in batch.sequences():
        if len(texts) == max_sequences:
            break
        texts.append(marked_text(ids.numpy(), labels.numpy(), decode, marks))
    return {
        "shapes": {key: list(value.shape) for key, value in batch.items()},
        "sequences": batch.num_sequences,
        "tokens": batch.num_tokens,
        "trained_tokens": batch.trained_tokens,
        "texts": texts,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="hp-data preview", description="Show the batches a pipeline config produces, with trained tokens marked."
    )
    parser.add_argument("config", help="the pipeline YAML (dataset, dataloader and collate_fn nodes)")
    parser.add_argument(
        "--tokenizer",
        help="local Hugging Face tokenizer directory or tokenizer.json (default: the config's model_assets.tokenizer)",
    )
    parser.add_argument("--split", choices=SPLITS, default="train", help="which loader to preview (default: train)")
    parser.add_argument("--batches", type=int, default=2, help="batches to show (default: 2)")
    parser.add_argument("--sequences", type=int, default=4, help="sequences shown per batch (default: 4)")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="micro batch size (default: 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per batch instead of text")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 2 error)."""
    args = parse_args(argv)
    try:
        _preview(args)
    except (DataConfigError, DataFileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _preview(args: argparse.Namespace) -> None:
    config = load_config(args.config)
    assets = config.get("model_assets")
    if args.tokenizer is None and not (isinstance(assets, Mapping) and assets.get("tokenizer") is not None):
        raise DataConfigError(
            "no tokenizer to decode with: pass --tokenizer, or set model_assets.tokenizer in the config"
        )
    tokenizer = None if args.tokenizer is None else build_tokenizer(args.tokenizer)
    # Only the split shown gets a loader, so a small other split (a 1% test split) cannot refuse the micro-batch size.
    shown = [None if split == args.split else 0 for split in SPLITS]
    loaders = build_dataloaders(
        config, tokenizer=tokenizer, micro_batch_size=args.micro_batch_size, train_valid_test_num_samples=shown
    )
    tokenizer = loaders.tokenizer
    loader = getattr(loaders, args.split)
    if loader is None:
        raise DataConfigError(f"the config builds no {args.split} split; choose another with --split")
    marks = _TERMINAL_MARKS if sys.stdout.isatty() and not args.json else _PLAIN_MARKS
    for number, batch in enumerate(itertools.islice(loader, args.batches)):  # no batch past the last shown
        summary = describe_batch(batch, tokenizer.decode, max_sequences=args.sequences, marks=marks)
        if args.json:
            print(json.dumps({"batch": number, **summary}, ensure_ascii=False))
            continue
        print(
            f"batch {number}: {summary['sequences']} sequences, {summary['tokens']} tokens, "
            f"{summary['trained_tokens']} trained; shapes {summary['shapes']}"
        )
        for index, text in enumerate(summary["texts"]):
            print(f"  sequence {index}: {text!r}")
    mixture = loader.state_dict().get("mixture")  # a mixture's loader tallies what each source gave
    if mixture is not None:
        if args.json:
            print(json.dumps({"mixture": mixture}, ensure_ascii=False))
        else:
            print(f"mixture after {mixture['batches']} batches: {describe_mixture_state(mixture)}")


if __name__ == "__main__":
    sys.exit(main())
