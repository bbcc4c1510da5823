"""The ``hp-data`` command: one entry point for the package's tools.

Each subcommand is a module that also runs on its own with ``python -m hyper_parallel.data.tools.<module>``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["COMMANDS", "command_parser", "main"]

# subcommand -> (module, one-line description)
COMMANDS = {
    "quickstart": ("quickstart", "run the offline path on the bundled corpus and tokenizer"),
    "prepare": ("offline_preparation", "tokenize local JSON/JSONL/Parquet/CSV/Arrow/text files into .bin/.idx"),
    "prepare-hf": ("huggingface_offline", "tokenize a saved or local Hugging Face dataset into .bin/.idx"),
    "inspect": ("read_indexed_dataset", "summarise, verify, decode or plot a .bin/.idx pair"),
    "preview": ("preview_batches", "show the batches of a pipeline config, trained tokens marked (--html: a page)"),
    "provenance": ("provenance", "name the file, record and token range of every sequence of a micro-batch"),
    "prepare-cache": ("prepare_cache", "build a training run's index caches ahead of training"),
    "sequences-per-dataset": (
        "build_sequences_per_dataset",
        "write the {prefix: [sequences, documents]} file for per_dataset_sequences_path",
    ),
    "config-reference": (
        "config_reference",
        "write the configuration reference: every _target_ of a pipeline config and its keys",
    ),
}


def command_parser(command: str, description: str, examples: str | None = None) -> argparse.ArgumentParser:
    """The parser every tool starts from: ``hp-data <command>`` (its usage line, also when the module runs as
    ``python -m``), a description and worked examples kept as written."""
    return argparse.ArgumentParser(
        prog=f"hp-data {command}",
        description=description,
        epilog=examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: hp-data COMMAND [options]   (hp-data COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<{width}}  {description}" for name, (_, description) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command '{command}'\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"hyper_parallel.data.tools.{COMMANDS[command][0]}")
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
