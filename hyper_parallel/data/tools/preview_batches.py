"""Preview the batches a pipeline config produces: decoded text with the trained-on tokens marked.

Usage::

    hp-data preview pipeline.yaml --tokenizer path/to/tokenizer_dir --batches 2
    hp-data preview pipeline.yaml   # the tokenizer of the config's model_assets node
    hp-data preview pipeline.yaml --html preview.html --cp-size 2   # tokens, CP slices and schedule in a browser
    python -m hyper_parallel.data.tools.preview_batches pipeline.yaml --tokenizer DIR --json

For each batch it prints the shapes, the number of sequences and tokens, the tokens that carry loss, and each
sequence's text with those tokens between ``[[`` and ``]]`` (or highlighted on a terminal). It reads the batch
contract (``batching.batch.Batch``) alone, so Online and Indexed batches are shown the same way: sequences as
``cu_seq_lens`` cuts them (the Online padding is the last one; Indexed rows are cut after each EOD), trained
tokens as the loss mask counts them. Nothing is trained; the loaders are built exactly as a trainer builds them
(``batching.dataloader.build_dataloaders``). ``--html`` writes the same batches as one self-contained page
(``tools.preview_html``).
Over a mixture it ends with one line of what each source gave (samples, their share, tokens: the loader
state's ``mixture`` part).
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
from hyper_parallel.data.batching.dataloader import SPLITS, DataLoaders, build_dataloaders
from hyper_parallel.data.batching.delivery_plan import DeliveryPlan
from hyper_parallel.data.batching.get_batch import ParallelBatch
from hyper_parallel.data.batching.scheduled_packing import fetch_sequences
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.file_writes import write_atomically
from hyper_parallel.data.instantiate import load_config
from hyper_parallel.data.mixture.mixture_tally import describe_mixture_state
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext
from hyper_parallel.data.text.build_tokenizer import build_tokenizer
from hyper_parallel.data.tools.preview_html import batch_view, render_page, schedule_view, visible_piece

__all__ = ["describe_batch", "main", "marked_text", "open_loaders", "parse_args", "write_html"]

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


def _require_batch(batch: object) -> Batch:
    if not isinstance(batch, Batch):
        raise DataConfigError(
            f"the collate_fn returned a {type(batch).__name__}, not a Batch; preview reads the batch contract, so use "
            "build_online_text_collate_fn or build_indexed_collate_fn (or a collate_fn that returns a Batch)"
        )
    return batch


def describe_batch(batch: Batch, decode, *, max_sequences: int = 4, marks: tuple[str, str] = _PLAIN_MARKS) -> dict:
    """Shapes, token counts and the marked text of the first ``max_sequences`` sequences of ``batch``."""
    _require_batch(batch)
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


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of ranks >= 1")
    return int(text)


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
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print one JSON object per batch instead of text")
    output.add_argument(
        "--html",
        metavar="OUT.html",
        help="write one self-contained HTML page instead: every token coloured by whether a loss is taken there, the "
        "sequence boundaries, each CP rank's columns in every layout, and with a packing_scheduler node one "
        "step's schedule per rank",
    )
    parser.add_argument(
        "--cp-size",
        type=_positive,
        default=1,
        help="the context-parallel size whose slices --html outlines; the batches are built for it (default: 1)",
    )
    parser.add_argument(
        "--dp-size",
        type=_positive,
        default=1,
        help="with a packing_scheduler node: the DP ranks whose micro-batches one scheduled step plans (default: 1)",
    )
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


def open_loaders(args: argparse.Namespace, *, dp_rank: int = 0) -> tuple[DataLoaders, object]:
    """The pipeline of ``args.config`` built as a trainer builds it, and the loader of ``args.split``.

    Without a packing scheduler the loaders are those of one rank of ``args.cp_size`` CP ranks (the batches then
    carry that layout's padding); with one, those of DP rank ``dp_rank`` of ``args.dp_size`` (the scheduler pads).
    """
    config = load_config(args.config)
    assets = config.get("model_assets")
    if args.tokenizer is None and not (isinstance(assets, Mapping) and assets.get("tokenizer") is not None):
        raise DataConfigError(
            "no tokenizer to decode with: pass --tokenizer, or set model_assets.tokenizer in the config"
        )
    tokenizer = None if args.tokenizer is None else build_tokenizer(args.tokenizer)
    # Only the split shown gets a loader, so a small other split (a 1% test split) cannot refuse the micro-batch size.
    shown = [None if split == args.split else 0 for split in SPLITS]
    if config.get("packing_scheduler") is not None:  # its ParallelBatch needs real groups over several ranks
        ranks = {"dp_rank": dp_rank, "dp_world_size": args.dp_size}
    else:
        ranks = {"parallel_context": DataLoaderParallelContext(cp_size=args.cp_size)}
    loaders = build_dataloaders(
        config,
        tokenizer=tokenizer,
        micro_batch_size=args.micro_batch_size,
        train_valid_test_num_samples=shown,
        **ranks,
    )
    loader = getattr(loaders, args.split)
    if loader is None:
        raise DataConfigError(f"the config builds no {args.split} split; choose another with --split")
    return loaders, loader


def write_html(args: argparse.Namespace) -> None:
    """Write ``args.html``: the first ``args.batches`` micro-batches of DP rank 0, and with a packing scheduler the
    step it plans from ``args.batches`` micro-batches of each of ``args.dp_size`` DP ranks."""
    loaders, loader = open_loaders(args)
    batches = [_require_batch(batch) for batch in itertools.islice(loader, args.batches)]
    if not batches:
        raise DataConfigError(f"the {args.split} loader yields no batch; nothing to preview")
    get_batch, scheduler = loaders.get_batch, loaders.packing_scheduler
    cp_plan = None  # under a scheduler the loader's batches are unpacked and packed again per CP group
    if scheduler is None:
        cp_plan = get_batch.delivery_plan if isinstance(get_batch, ParallelBatch) else DeliveryPlan(args.cp_size)
    pad_token_id = getattr(loaders.collate_fn, "pad_token_id", None)
    views = [batch_view(batch, pad_token_id=pad_token_id, cp_plan=cp_plan) for batch in batches]
    schedule = None
    if scheduler is not None:
        lengths, names = [], []
        for dp_rank in range(args.dp_size):
            read = batches if dp_rank == 0 else itertools.islice(open_loaders(args, dp_rank=dp_rank)[1], args.batches)
            step = fetch_sequences(iter(read), args.batches)
            lengths.append(step.lengths)
            names += [f"DP {dp_rank} sequence {index}" for index in range(len(step.lengths))]
        layout = scheduler.layout(cp_size=args.cp_size, tp_size=1)
        schedule = schedule_view(
            scheduler, np.concatenate(lengths), layout=layout, dp_size=args.dp_size, sequence_names=names
        )
    pieces: dict[int, str] = {}

    def piece(token: int) -> str:
        if token not in pieces:
            pieces[token] = visible_piece(loaders.tokenizer.decode([token]))
        return pieces[token]

    layout = get_batch.cp_layout if isinstance(get_batch, ParallelBatch) else "contiguous"
    page = render_page(views, piece=piece, title=str(args.config), cp_layout=layout, schedule=schedule)
    write_atomically(args.html, page.encode("utf-8"))  # names the path and the fix on failure; never via a link
    print(f"wrote {args.html}: {len(views)} micro-batch(es){', one scheduled step' if schedule else ''}")


def _preview(args: argparse.Namespace) -> None:
    if args.html is not None:
        write_html(args)
        return
    loaders, loader = open_loaders(args)
    tokenizer = loaders.tokenizer
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
