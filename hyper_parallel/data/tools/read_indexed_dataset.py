"""Inspect one Megatron ``.idx``/``.bin`` pair from the command line.

Owns: the ``python -m hyper_parallel.data.tools.read_indexed_dataset PREFIX`` command, which prints a summary
of a pair (counts, sizes, length statistics), decodes chosen sequences through a tokenizer, checks the pair's
consistency and its token ids (``--verify``: one line per check) and draws its sequence length histogram, and names
the pairs nearby when a local prefix has none. A prefix may be an fsspec URL (``s3://bucket/prefix``): it is read
through the object storage reader (``indexed.object_storage``); what is written (a histogram) stays local.
Not responsible for: parsing or checking the files (``indexed.IndexedDataReader``), writing them
(``indexed.io``) or loading tokenizers (``text.build_tokenizer``).

Example::

    python -m hyper_parallel.data.tools.read_indexed_dataset data/corpus_text_document --verify --decode 0,1
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

import numpy as np

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.file_writes import atomic_output
from hyper_parallel.data.indexed.idx_format import check_token_dtype
from hyper_parallel.data.indexed.indexed_data_reader import (
    IndexedDataReader,
    data_file_paths,
    is_object_url,
    pair_prefix,
)
from hyper_parallel.data.indexed.object_storage import open_reader
from hyper_parallel.data.indexed.pair_metadata import metadata_path
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, TextTokenizer, build_tokenizer
from hyper_parallel.data.tools.cli import command_parser

__all__ = ["build_parser", "format_summary", "main", "summarize"]

_PROG = "hp-data inspect"
_PERCENTILES = (50, 90, 99)
_SHOWN_IDS = 64
_HISTOGRAM_BINS = 100
_SUGGESTED_PAIRS = 5

_EXAMPLES = f"""\
examples:
  {_PROG} data/corpus_text_document
  {_PROG} data/corpus_text_document.idx --json
  {_PROG} data/corpus_text_document --verify
  {_PROG} data/corpus_text_document --verify --tokenizer path/to/tokenizer_dir
  {_PROG} data/corpus_text_document --decode 0,5 --decode -1 --show-ids --max-chars 500
  {_PROG} data/corpus_text_document --decode 3 --tokenizer path/to/tokenizer_dir
  {_PROG} data/corpus_text_document --histogram lengths.png
  {_PROG} data/vision_document --multimodal
  {_PROG} s3://bucket/corpus_text_document --verify

every mode checks the pair first: nothing is summarised, decoded or plotted from a corrupt one.
--verify checks the index, that the header's token dtype is an integer one, that a .meta.json beside the pair names
the same dtype, and every token id against the vocabulary (of the .meta.json, and of --tokenizer when given).
exit status: 0 on success, 1 when --verify finds problems, 2 on a usage error, a pair that cannot be read, or
(without --verify) an inconsistent one.
"""


class _UsageError(Exception):
    """A request that cannot be served; main prints it as ``error: ...`` and exits 2."""


# -- arguments ----------------------------------------------------------------------------------------------------


def _index_list(text: str) -> list[int]:
    """Parse ``"3"`` or ``"0,5,-1"`` into sequence indices."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a sequence index or a comma list of them such as 0,5,-1, got {text!r}"
        ) from None


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; every option's help carries an example."""
    parser = command_parser(
        "inspect",
        (
            "Summarise a Megatron .idx/.bin indexed dataset: dtype, sequence, document and token counts, file size, "
            "and length statistics (min, mean, p50/p90/p99, max) of sequences and documents. Optionally decode "
            "sequences, verify the pair, or plot the length distribution."
        ),
        _EXAMPLES,
    )
    parser.add_argument(
        "prefix",
        metavar="PREFIX",
        help="path of the pair without .idx/.bin, e.g. data/corpus_text_document (a path ending in .idx or .bin "
        "is accepted too), or an fsspec URL prefix, e.g. s3://bucket/corpus_text_document",
    )
    parser.add_argument(
        "--multimodal",
        action="store_true",
        help="the index holds one int8 mode per sequence (the header does not record it); also prints the number "
        "of sequences per mode, e.g. --multimodal",
    )
    parser.add_argument(
        "--decode",
        metavar="I",
        type=_index_list,
        action="append",
        default=[],
        help="print sequence I (0-based; negative counts from the end): its length and its decoded text. Repeat "
        "it or give a comma list, e.g. --decode 0,5 --decode -1 (a list starting with a negative index needs the "
        "= form: --decode=-1,-2)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="Hugging Face tokenizer directory or tokenizer.json used by --decode, and by --verify to check every "
        "token id against its vocabulary; use the one the dataset was built with, e.g. --tokenizer models/llama3 "
        "(default: the bundled tokenizer for --decode; --verify then checks against the .meta.json's vocabulary only)",
    )
    parser.add_argument(
        "--max-chars",
        metavar="N",
        type=_non_negative,
        default=2000,
        help="print at most N characters of each decoded text, 0 for all, e.g. --max-chars 500 (default: 2000)",
    )
    parser.add_argument(
        "--show-ids",
        action="store_true",
        help=f"with --decode, also print the first {_SHOWN_IDS} token ids of each sequence, e.g. --decode 0 --show-ids",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check that lengths, pointers, document indices and the .bin size agree, that the token dtype is an "
        "integer one and the one the .meta.json names, and that every token id fits the vocabulary; prints one "
        "line per check and exits 1 when one fails, e.g. --verify",
    )
    parser.add_argument(
        "--histogram",
        metavar="OUT.png",
        help="draw the sequence length distribution (log-scale counts) as a PNG, e.g. --histogram lengths.png",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with the same numbers (and the results of --verify, --decode, --histogram) "
        "instead of text, for scripts, e.g. --json",
    )
    return parser


def _pairs_in(directory: Path) -> list[str]:
    """Names (without ``.idx``/``.bin``) of the pairs in ``directory``, sorted."""
    try:
        names = {entry.name for entry in os.scandir(directory)}
    except OSError:
        return []
    return sorted(name[:-4] for name in names if name.endswith(".idx") and f"{name[:-4]}.bin" in names)


def _nearby_pairs(prefix: str) -> list[str]:
    """Prefixes of the pairs that ``prefix`` may have meant, at most a few: for a directory, the pairs in it;
    else the pairs beside it whose name starts with its name (``out/corpus`` -> ``out/corpus_text_document``),
    or failing that the closest names."""
    path = Path(prefix)
    if path.is_dir():
        return [str(path / name) for name in _pairs_in(path)[:_SUGGESTED_PAIRS]]
    pairs = _pairs_in(path.parent)
    chosen = [name for name in pairs if name.startswith(path.name)]
    if not chosen:
        chosen = difflib.get_close_matches(path.name, pairs, n=_SUGGESTED_PAIRS, cutoff=0.6)
    return [str(path.parent / name) for name in chosen[:_SUGGESTED_PAIRS]]


def _open_reader(prefix: str, multimodal: bool) -> IndexedDataReader:
    """Open the pair; when it does not exist, the error names the pairs nearby that may have been meant."""
    try:
        return open_reader(prefix, multimodal=multimodal)
    except DataFileError as error:
        if is_object_url(prefix) or data_file_paths(prefix)[0].exists():
            raise
        nearby = _nearby_pairs(prefix)
        if not nearby:
            raise
        raise DataFileError(f"{error} Did you mean {' or '.join(nearby)}?") from None


# -- summary -----------------------------------------------------------------------------------------------------


def _stats(values: np.ndarray) -> dict | None:
    """min, mean, percentiles and max of ``values``, or None when there are none."""
    if values.size == 0:
        return None
    percentiles = np.percentile(values, _PERCENTILES)
    return {
        "min": int(values.min()),
        "mean": float(values.mean(dtype=np.float64)),
        **{f"p{p}": float(v) for p, v in zip(_PERCENTILES, percentiles, strict=True)},
        "max": int(values.max()),
    }


def summarize(reader: IndexedDataReader) -> dict:
    """The numbers describing one pair, as plain JSON-ready values.

    Document lengths are the token counts of documents (the sum of their sequence lengths); they are reported
    only when some document does not hold exactly one sequence, since otherwise they equal the sequence lengths.
    A document is empty when it holds no tokens.

    Raises:
        DataFileError: the pair is inconsistent (``reader.verify()``), so its numbers would be wrong.
    """
    reader.verify()
    lengths = reader.sequence_lengths
    documents = reader.document_indices
    sequences_per_document = np.diff(documents)
    # Token count of each document from the cumulative lengths: one vectorised pass, empty documents included.
    cumulative = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, dtype=np.int64, out=cumulative[1:])
    document_tokens = cumulative[documents[1:]] - cumulative[documents[:-1]]
    sizes = reader.file_identity
    summary = {
        "prefix": reader.path_prefix,
        "dtype": str(reader.dtype),
        "multimodal": reader.multimodal,
        "sequences": len(reader),
        "documents": reader.num_documents,
        "tokens": reader.num_tokens,
        "bin_bytes": sizes["bin_bytes"],
        "idx_bytes": sizes["idx_bytes"],
        "empty_documents": int(np.count_nonzero(document_tokens == 0)),
        "sequence_lengths": _stats(lengths),
        "sequences_per_document": _stats(sequences_per_document),
        "document_lengths": _stats(document_tokens) if np.any(sequences_per_document != 1) else None,
    }
    if reader.multimodal:
        modes, counts = np.unique(reader.sequence_modes, return_counts=True)
        summary["mode_counts"] = {str(int(m)): int(c) for m, c in zip(modes, counts, strict=True)}
    return summary


def _format_stats(stats: dict | None) -> str:
    if stats is None:
        return "-"
    return "  ".join(
        f"{key} {value:,.1f}" if isinstance(value, float) else f"{key} {value:,}" for key, value in stats.items()
    )


def format_summary(summary: dict) -> str:
    itemsize = np.dtype(summary["dtype"]).itemsize
    rows = [
        ("prefix", summary["prefix"]),
        ("dtype", f"{summary['dtype']} ({itemsize} byte{'s' if itemsize > 1 else ''} per token)"),
        ("sequences", f"{summary['sequences']:,}"),
        ("documents", f"{summary['documents']:,} ({summary['empty_documents']:,} empty)"),
        ("tokens", f"{summary['tokens']:,}"),
        (".bin size", f"{summary['bin_bytes']:,} bytes"),
        ("sequence lengths", _format_stats(summary["sequence_lengths"])),
    ]
    if summary["document_lengths"] is None:
        rows.append(("document lengths", "same as sequence lengths (one sequence per document)"))
    else:
        rows.append(("document lengths", _format_stats(summary["document_lengths"])))
        rows.append(("sequences/document", _format_stats(summary["sequences_per_document"])))
    if "mode_counts" in summary:
        counts = ", ".join(f"mode {m}: {c:,}" for m, c in summary["mode_counts"].items()) or "-"
        rows.append(("modes", counts))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# -- decoding ----------------------------------------------------------------------------------------------------


def _check_indices(reader: IndexedDataReader, indices: list[int]) -> list[int]:
    """Normalise negative indices; refuse any outside the dataset before anything is printed."""
    n = len(reader)
    for i in indices:
        if not -n <= i < n:
            valid = f"valid: 0..{n - 1}, or -{n}..-1 from the end" if n else "it has no sequences to decode"
            raise _UsageError(
                f"sequence {i} is out of range for '{reader.path_prefix}', which has {n:,} sequences ({valid})"
            )
    return [i + n if i < 0 else i for i in indices]


def _load_tokenizer(path: str) -> TextTokenizer:
    try:
        return build_tokenizer(path)
    except DataConfigError as error:
        raise _UsageError(str(error)) from None


def _decode_sequences(reader: IndexedDataReader, indices: list[int], args: argparse.Namespace) -> list[dict]:
    tokenizer = _load_tokenizer(args.tokenizer or str(BUNDLED_TOKENIZER_PATH))
    documents = reader.document_indices
    results = []
    for i in indices:
        item = reader[i]
        tokens, mode = item if reader.multimodal else (item, None)
        text = tokenizer.decode(tokens)
        shown = text if args.max_chars == 0 else text[: args.max_chars]
        entry = {
            "index": i,
            "document": int(np.searchsorted(documents, i, side="right")) - 1,
            "length": int(tokens.size),
            "chars": len(text),
            "truncated": len(shown) < len(text),
            "text": shown,
        }
        if mode is not None:
            entry["mode"] = mode
        if args.show_ids:
            entry["ids"] = tokens[:_SHOWN_IDS].tolist()
        # Ids the tokenizer does not know decode to nothing; say so rather than print silently wrong text.
        if tokens.size and int(tokens.max()) >= tokenizer.vocab_size:
            entry["warning"] = (
                f"ids up to {int(tokens.max())} exceed the vocabulary of {tokenizer.vocab_size} tokens of "
                f"{tokenizer.name_or_path}; pass the tokenizer the dataset was built with via --tokenizer"
            )
        results.append(entry)
    return results


def _format_decoded(entry: dict, max_chars: int) -> str:
    mode = f", mode {entry['mode']}" if "mode" in entry else ""
    lines = [f"sequence {entry['index']} (document {entry['document']}{mode}): {entry['length']:,} tokens"]
    if "ids" in entry:
        more = entry["length"] - len(entry["ids"])
        lines.append(f"ids: {entry['ids']}" + (f" ... ({more:,} more)" if more > 0 else ""))
    if "warning" in entry:
        lines.append(f"warning: {entry['warning']}")
    lines += ["--- text ---", entry["text"]]
    if entry["truncated"]:
        lines.append(
            f"--- truncated: first {max_chars:,} of {entry['chars']:,} characters shown; --max-chars 0 shows all ---"
        )
    else:
        lines.append("--- end ---")
    return "\n".join(lines)


# -- histogram ---------------------------------------------------------------------------------------------------


def _write_histogram(reader: IndexedDataReader, summary: dict, out: str) -> Path:
    """Plot the sequence length distribution to ``out`` (PNG), written under a temporary name then renamed."""
    # Figure + the Agg canvas directly: no pyplot global state and no display needed.
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise _UsageError(
            "--histogram needs matplotlib, an optional dependency: pip install 'hyper-parallel-data[plot]' (or "
            "pip install matplotlib)"
        ) from None

    out_path = Path(out)
    if not out_path.parent.is_dir():
        raise _UsageError(f"cannot write the histogram to {out_path}: directory {out_path.parent} does not exist")
    lengths = reader.sequence_lengths
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    if lengths.size:
        low, high = int(lengths.min()), int(lengths.max())
        # Integer-aligned bins; never more bins than distinct lengths.
        counts, edges = np.histogram(lengths, bins=min(_HISTOGRAM_BINS, high - low + 1), range=(low, high + 1))
        axes.stairs(counts, edges, fill=True)
        axes.set_yscale("log")
        stats = summary["sequence_lengths"]
        for key, style in (("p50", "--"), ("p99", ":")):
            axes.axvline(stats[key], color="black", linestyle=style, linewidth=1, label=f"{key} = {stats[key]:,.0f}")
        axes.legend()
    else:
        axes.text(0.5, 0.5, "no sequences", ha="center", va="center", transform=axes.transAxes)
    axes.set_xlabel("sequence length (tokens)")
    axes.set_ylabel("sequences (log scale)")
    axes.set_title(
        f"{summary['prefix']}\n{summary['sequences']:,} sequences, {summary['documents']:,} documents, "
        f"{summary['tokens']:,} tokens",
        fontsize=9,
    )
    with atomic_output(out_path) as temporary:
        figure.savefig(temporary, format="png", dpi=120)
    return out_path


# -- entry point -------------------------------------------------------------------------------------------------


def _verify(reader: IndexedDataReader, vocab_size: int | None) -> list[tuple[str, bool | None, str]]:
    """The checks of ``--verify`` in order, each ``(name, passed, message)``; ``passed`` is None where a check
    could not be made (the message says why). A failed check ends the list: the later ones build on it."""
    try:
        reader.verify()
    except DataFileError as error:
        return [("index", False, str(error))]
    bin_bytes = reader.file_identity["bin_bytes"]
    checks: list[tuple[str, bool | None, str]] = [
        (
            "index",
            True,
            f"{len(reader):,} sequences, {reader.num_documents:,} documents and {bin_bytes:,} bytes of .bin are "
            "consistent",
        )
    ]
    meta_name = metadata_path(reader.path_prefix).name
    name = "token_dtype"  # the check being made, named if it fails
    try:
        check_token_dtype(reader.dtype, f"{reader.path_prefix}.idx")
        checks.append((name, True, f"the header's token dtype {reader.dtype} holds token ids"))
        name = "metadata"
        metadata = reader.pair_metadata()
        if metadata is None:
            checks.append((name, None, f"no {meta_name} beside the pair: its token dtype is not cross-checked"))
        else:
            checks.append((name, True, f"{meta_name} names the header's token dtype, {reader.dtype}"))
        name = "token_ids"
        vocabulary, source = reader.token_vocabulary(vocab_size)
        count = reader.check_all_token_ids(vocab_size)
    except DataFileError as error:
        return [*checks, (name, False, str(error))]
    if vocabulary is not None:
        checks.append(("token_ids", True, f"all {count:,} token ids lie in [0, {vocabulary}) ({source})"))
    else:
        negative = "none is negative, but " if reader.dtype.kind == "i" else ""
        checks.append(
            (
                "token_ids",
                None,
                f"{count:,} token ids: {negative}no vocabulary size is known (no {meta_name}, no --tokenizer), so "
                "they are not checked against one; pass --tokenizer",
            )
        )
    return checks


_VERIFY_MARKS = {True: "OK", False: "FAILED", None: "note"}


def _print_checks(checks: list[tuple[str, bool | None, str]]) -> None:
    for _, passed, message in checks:
        print(f"{_VERIFY_MARKS[passed]}: {message}")


def _run(reader: IndexedDataReader, args: argparse.Namespace) -> int:
    report: dict = {}
    if args.verify:
        vocab_size = _load_tokenizer(args.tokenizer).vocab_size if args.tokenizer else None
        checks = _verify(reader, vocab_size)
        failed = [message for _, passed, message in checks if passed is False]
        report["verify"] = {
            "ok": not failed,
            "checks": {name: {"ok": passed, "message": message} for name, passed, message in checks},
        }
        if failed:
            report["verify"]["problems"] = "\n".join(failed)
            if checks[0][1] is False:  # nothing is summarised from an inconsistent index
                if args.json:
                    print(json.dumps({"prefix": reader.path_prefix, **report}))
                else:
                    _print_checks(checks)
                return 1
    summary = summarize(reader)
    if args.verify and not report["verify"]["ok"]:
        if args.json:
            print(json.dumps({**summary, **report}))
        else:
            print(format_summary(summary) + "\n")
            _print_checks(checks)
        return 1
    indices = _check_indices(reader, [i for group in args.decode for i in group])
    if indices:
        report["decoded"] = _decode_sequences(reader, indices, args)
    if args.histogram:
        report["histogram"] = str(_write_histogram(reader, summary, args.histogram))

    if args.json:
        print(json.dumps({**summary, **report}))
        return 0
    print(format_summary(summary))
    if args.verify:
        print()
        _print_checks(checks)
    for entry in report.get("decoded", []):
        print()
        print(_format_decoded(entry, args.max_chars))
    if "histogram" in report:
        print(f"\nwrote the sequence length histogram to {report['histogram']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 1 verification failed, 2 error)."""
    args = build_parser().parse_args(argv)
    try:
        reader = _open_reader(pair_prefix(args.prefix), args.multimodal)
        try:
            return _run(reader, args)
        finally:
            reader.close()
    except (DataFileError, _UsageError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the files changed or became unreadable while being inspected
        print(f"error: cannot read '{args.prefix}': {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
