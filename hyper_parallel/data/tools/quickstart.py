"""The quickstart: both data paths on the bundled corpus and tokenizer, with no network.

Steps: tokenize the bundled Jane Austen chapters into a Megatron-compatible ``.bin``/``.idx`` pair, verify the
pair, print its summary, decode the start of the first document, then cut it into train/valid/test samples of
fixed length with the Indexed path (megatron-core's sample order) and show one. Finally read the same chapters
with the Online path (tokenized while loading, packed into token-budget micro-batches) and show that a loader
restored from a saved state continues with exactly the next batches. Run it with ``hp-data quickstart``.

Owns: the demonstration sequence only; every step calls the public API of the other tools.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hyper_parallel.data.batching import DynamicBatchDataLoader
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset, build_online_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
from hyper_parallel.data.tools.offline_preparation import run_offline_preparation
from hyper_parallel.data.tools.read_indexed_dataset import format_summary, summarize

__all__ = ["BUNDLED_CORPUS_PATH", "main", "run_quickstart"]

BUNDLED_CORPUS_PATH = BUNDLED_TOKENIZER_PATH.parent / "corpus" / "austen_chapters.jsonl.gz"


def run_quickstart(output_dir: str | os.PathLike, workers: int, preview_chars: int = 600, seq_length: int = 512) -> int:
    output_dir = Path(output_dir)
    print(f"1/5 tokenizing the bundled corpus {BUNDLED_CORPUS_PATH.name} into {output_dir}/")
    config = OfflinePreparationConfig(
        dataset_name_or_path=str(BUNDLED_CORPUS_PATH),
        output_prefix=str(output_dir / "austen"),
        tokenizer_name_or_path=str(BUNDLED_TOKENIZER_PATH),
        json_keys=("text",),
        append_eod=True,
        workers=workers,
        overwrite=True,  # the quickstart's own output folder: a rerun replaces the previous run's pair
    )
    summary = run_offline_preparation(config)
    print(summary.table())

    prefix = summary.outputs["text"]
    print(f"\n2/5 verifying and summarising {prefix}")
    reader = IndexedDataReader(prefix)
    reader.verify()
    print("verify: OK (pointers, lengths, document indices and .bin size agree)")
    print(format_summary(summarize(reader)))

    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    first = reader[0]
    text = tokenizer.decode(first)
    print(f"\n3/5 the first document, {len(first)} tokens, decoded (first {preview_chars} characters):\n")
    print(text[:preview_chars] + (" [...]" if len(text) > preview_chars else ""))

    cache = output_dir / "index_cache"
    print(f"\n4/5 samples of {seq_length} tokens, split 98/1/1, one epoch each (index cache in {cache}/)")
    splits = build_indexed_text_dataset(
        prefix, {"seq_length": seq_length, "split": "98, 1, 1", "data_cache_path": str(cache)}, tokenizer=tokenizer
    )
    for name, dataset in zip(("train", "valid", "test"), splits, strict=True):
        print(f"  {name}: {type(dataset).__name__} of {len(dataset):,} samples")
    sample = splits[0][0]
    print(f"  train[0]: tokens {tuple(sample['tokens'].shape)}, labels shifted by one; it begins:")
    print("  " + tokenizer.decode(sample["tokens"][:40].tolist()).replace("\n", " ") + " [...]")
    online_quickstart(output_dir / "online_cache", tokenizer, seq_length)
    print(
        f"\nnext: `hp-data inspect {prefix} --decode 1 --tokenizer {BUNDLED_TOKENIZER_PATH}`, prepare your own "
        "files with `hp-data prepare --help`, or preview a pipeline config with `hp-data preview --help`"
    )
    return 0


def online_quickstart(cache_dir: Path, tokenizer, seq_length: int, micro_batch_size: int = 4, shown: int = 3) -> None:
    """Step 5: the chapters through the Online path, and an exact resume from a saved loader state."""
    print(
        f"\n5/5 the chapters read online: tokenized while loading, packed into {micro_batch_size} x {seq_length} tokens"
    )

    def loader() -> DynamicBatchDataLoader:
        dataset = build_online_text_dataset(
            BUNDLED_CORPUS_PATH,
            {"data_type": "plaintext", "max_seq_len": seq_length},
            {"dataset_type": "mapping", "cache_dir": str(cache_dir)},
            tokenizer=tokenizer,
        )
        return DynamicBatchDataLoader(dataset, micro_batch_size=micro_batch_size, min_buffered_samples=64)

    uninterrupted = loader()
    batches = iter(uninterrupted)
    for number in range(shown):
        batch = next(batches)
        windows = batch.num_sequences
        print(f"  batch {number}: input_ids {tuple(batch.input_ids.shape)}, {windows} windows of chapters")
    state = uninterrupted.state_dict()
    expected = next(batches)
    restored = loader()
    restored.load_state_dict(state)
    continued = next(iter(restored))
    same = continued == expected
    print(
        f"  saved the loader state after batch {shown - 1}; a new loader restored from it gives batch {shown}: ", end=""
    )
    print("identical" if same else "DIFFERENT")
    if not same:
        raise RuntimeError("the restored loader did not continue with the uninterrupted batch")


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
