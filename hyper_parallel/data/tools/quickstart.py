"""The quickstart: the whole offline path on the bundled corpus and tokenizer, with no network.

Steps: tokenize the bundled Jane Austen chapters into a Megatron-compatible ``.bin``/``.idx`` pair, verify the
pair, print its summary, decode the start of the first document, then cut it into train/valid/test samples of
fixed length with the Indexed path (megatron-core's sample order) and show one. Run it with ``hp-data quickstart``.

Owns: the demonstration sequence only; every step calls the public API of the other tools.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
from hyper_parallel.data.tools.offline_preparation import run_offline_preparation
from hyper_parallel.data.tools.read_indexed_dataset import format_summary, summarize

__all__ = ["BUNDLED_CORPUS_PATH", "main", "run_quickstart"]

BUNDLED_CORPUS_PATH = BUNDLED_TOKENIZER_PATH.parent / "corpus" / "austen_chapters.jsonl.gz"


def run_quickstart(output_dir: str | os.PathLike, workers: int, preview_chars: int = 600, seq_length: int = 512) -> int:
    output_dir = Path(output_dir)
    print(f"1/4 tokenizing the bundled corpus {BUNDLED_CORPUS_PATH.name} into {output_dir}/")
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
    print(f"\n2/4 verifying and summarising {prefix}")
    reader = IndexedDataReader(prefix)
    reader.verify()
    print("verify: OK (pointers, lengths, document indices and .bin size agree)")
    print(format_summary(summarize(reader)))

    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    first = reader[0]
    text = tokenizer.decode(first)
    print(f"\n3/4 the first document, {len(first)} tokens, decoded (first {preview_chars} characters):\n")
    print(text[:preview_chars] + (" [...]" if len(text) > preview_chars else ""))

    cache = output_dir / "index_cache"
    print(f"\n4/4 samples of {seq_length} tokens, split 98/1/1, one epoch each (index cache in {cache}/)")
    splits = build_indexed_text_dataset(
        prefix, {"seq_length": seq_length, "split": "98, 1, 1", "data_cache_path": str(cache)}, tokenizer=tokenizer
    )
    for name, dataset in zip(("train", "valid", "test"), splits, strict=True):
        print(f"  {name}: {type(dataset).__name__} of {len(dataset):,} samples")
    sample = splits[0][0]
    print(f"  train[0]: tokens {tuple(sample['tokens'].shape)}, labels shifted by one; it begins:")
    print("  " + tokenizer.decode(sample["tokens"][:40].tolist()).replace("\n", " ") + " [...]")
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
    parser.add_argument("--seq-length", type=int, default=512, help="tokens per sample in step 4 (default: 512)")
    args = parser.parse_args(argv)
    return run_quickstart(args.output_dir, args.workers, seq_length=args.seq_length)


if __name__ == "__main__":
    sys.exit(main())
