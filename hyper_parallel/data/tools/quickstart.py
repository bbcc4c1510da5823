"""The quickstart: the whole offline path on the bundled corpus and tokenizer, with no network.

Steps: tokenize the bundled Jane Austen chapters into a Megatron-compatible ``.bin``/``.idx`` pair, verify the
pair, print its summary, and decode the start of the first document. Run it with ``hp-data quickstart``.

Owns: the demonstration sequence only; every step calls the public API of the other tools.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
from hyper_parallel.data.tools.offline_preparation import run_offline_preparation
from hyper_parallel.data.tools.read_indexed_dataset import format_summary, summarize

__all__ = ["BUNDLED_CORPUS_PATH", "main", "run_quickstart"]

BUNDLED_CORPUS_PATH = BUNDLED_TOKENIZER_PATH.parent / "corpus" / "austen_chapters.jsonl.gz"


def run_quickstart(output_dir: str | os.PathLike, workers: int, preview_chars: int = 600) -> int:
    output_dir = Path(output_dir)
    print(f"1/3 tokenizing the bundled corpus {BUNDLED_CORPUS_PATH.name} into {output_dir}/")
    config = OfflinePreparationConfig(
        dataset_name_or_path=str(BUNDLED_CORPUS_PATH),
        output_prefix=str(output_dir / "austen"),
        tokenizer_name_or_path=str(BUNDLED_TOKENIZER_PATH),
        json_keys=("text",),
        append_eod=True,
        workers=workers,
    )
    summary = run_offline_preparation(config)
    print(summary.table())

    prefix = summary.outputs["text"]
    print(f"\n2/3 verifying and summarising {prefix}")
    reader = IndexedDataReader(prefix)
    reader.verify()
    print("verify: OK (pointers, lengths, document indices and .bin size agree)")
    print(format_summary(summarize(reader)))

    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    first = reader[0]
    text = tokenizer.decode(first)
    print(f"\n3/3 the first document, {len(first)} tokens, decoded (first {preview_chars} characters):\n")
    print(text[:preview_chars] + (" [...]" if len(text) > preview_chars else ""))
    print(
        f"\nnext: `python -m hyper_parallel.data.tools.read_indexed_dataset {prefix} --decode 1` "
        "or prepare your own files with `hp-data prepare --help`"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hp-data quickstart", description=__doc__.split("Owns:")[0])
    parser.add_argument(
        "--output-dir", default="quickstart_output", help="where to write (default: ./quickstart_output)"
    )
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="tokenizer processes")
    args = parser.parse_args(argv)
    return run_quickstart(args.output_dir, args.workers)


if __name__ == "__main__":
    sys.exit(main())
