"""Provenance queries (``tools.provenance.batch_provenance``) against reading the loader up to the same micro-batch.

* **Indexed.** A seeded corpus of ``DOCUMENTS`` documents (``DOCUMENTS_QUICK`` with ``--quick``) of 20 to 2,000
  tokens, cut into GPTDataset samples of ``SEQ_LENGTH`` tokens, ``FixedBatchDataLoader`` of ``MICRO_BATCH``. Ours:
  the provenance of micro-batch ``INDEXED_BATCH`` (building the loader, index caches warm, then the sampler
  position and the index arrays). Reference: building the same loader and iterating it up to that micro-batch.
* **Online.** Seeded JSONL records of 50 to 3,000 words, plaintext windows of ``MAX_SEQ_LEN`` tokens, a mapping
  source (its Arrow cache warm) and ``DynamicBatchDataLoader``. Ours: the provenance of micro-batch
  ``ONLINE_BATCH``, with the length cache removed before every call (cold: every record up to it is tokenized)
  and with it present (warm). Reference: building the same loader and iterating it up to that micro-batch.

Every round's answer is checked: the traced spans tile the delivered micro-batch's ``cu_seq_lens``.
"""

from __future__ import annotations

import json
import logging

import numpy as np

from benchmarks.common import BenchContext, Row, log, measure
from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer
from hyper_parallel.data.tools.provenance import batch_provenance

NAME = "provenance"
TITLE = "Provenance of a micro-batch (file, record, token range) vs iterating the loader up to it"

DOCUMENTS, DOCUMENTS_QUICK = 100_000, 20_000
SEQ_LENGTH = 2048
MICRO_BATCH = 4
INDEXED_BATCH, INDEXED_BATCH_QUICK = 2_000, 500
RECORDS, RECORDS_QUICK = 2_000, 500
MAX_SEQ_LEN = 2048
ONLINE_BATCH, ONLINE_BATCH_QUICK = 400, 100
SEED = 1234
WORDS = ("the", "sister", "said", "that", "Elinor", "walked", "home", "through", "park", "while", "Marianne", "read")
INDEXED_GOAL = 0.05
ONLINE_COLD_GOAL = 1.25
ONLINE_WARM_GOAL = 0.25


def _indexed_config(context: BenchContext, tokenizer) -> dict:
    prefix = context.workdir / "provenance_corpus"
    rng = np.random.default_rng(SEED)
    lengths = rng.integers(20, 2000, size=DOCUMENTS_QUICK if context.quick else DOCUMENTS)
    tokens = rng.integers(2, 8000, size=int(lengths.sum()), dtype=np.uint16)
    tokens[np.cumsum(lengths) - 1] = tokenizer.eod
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    builder.add_documents(tokens, lengths)
    builder.finalize(f"{prefix}.idx")
    data_config = {"seq_length": SEQ_LENGTH, "split": "100, 0, 0", "data_cache_path": str(context.workdir / "cache")}
    return {
        "dataset": {
            "_target_": "hyper_parallel.data.text.build_dataset.build_indexed_text_dataset",
            "data_path": str(prefix),
            "data_config": data_config,
        },
        "dataloader": {"_target_": "hyper_parallel.data.batching.FixedBatchDataLoader"},
        "collate_fn": {"_target_": "hyper_parallel.data.batching.build_indexed_collate_fn"},
    }


def _online_config(context: BenchContext) -> dict:
    rng = np.random.default_rng(SEED)
    path = context.workdir / "provenance_records.jsonl"
    count = RECORDS_QUICK if context.quick else RECORDS
    with path.open("w") as out:
        for length in rng.integers(50, 3000, size=count).tolist():
            out.write(json.dumps({"text": " ".join(rng.choice(WORDS, size=length))}) + "\n")
    return {
        "dataset": {
            "_target_": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
            "data_path": str(path),
            "data_transform": {
                "_target_": "hyper_parallel.data.text.build_data_transform.build_llm_data_transform",
                "data_type": "plaintext",
                "text_keys": "text",
                "max_seq_len": MAX_SEQ_LEN,
            },
            "data_config": {"dataset_type": "mapping", "cache_dir": str(context.workdir / "provenance_arrow")},
        },
        "dataloader": {"_target_": "hyper_parallel.data.batching.DynamicBatchDataLoader", "min_buffered_samples": 64},
        "collate_fn": {"_target_": "hyper_parallel.data.batching.build_online_text_collate_fn"},
    }


def _iterate_to(config: dict, tokenizer, batch: int, micro_batch_size: int):
    loaders = build_dataloaders(
        config, tokenizer=tokenizer, micro_batch_size=micro_batch_size, train_valid_test_num_samples=[None, 0, 0]
    )
    for number, delivered in enumerate(loaders.train):
        if number == batch:
            return delivered
    raise AssertionError(f"the loader delivers fewer than {batch + 1} micro-batches")


def _check(sequences, delivered) -> None:
    bounds = delivered.cu_seq_lens.tolist()
    starts = [sequence.span[0] for sequence in sequences]
    assert starts == bounds[: len(starts)], "the traced spans are not the delivered micro-batch's sequences"


def _compare(context: BenchContext, config: dict, tokenizer, batch: int, micro_batch_size: int, before=None):
    """Time ours and the reference, interleaved; every answer is checked against the delivered micro-batch."""
    delivered = _iterate_to(config, tokenizer, batch, micro_batch_size)  # untimed: warms every cache
    cases = {
        "ours": lambda: batch_provenance(config, batch=batch, micro_batch_size=micro_batch_size, tokenizer=tokenizer),
        "reference": lambda: _iterate_to(config, tokenizer, batch, micro_batch_size),
    }

    def after(name, result) -> None:
        if name == "ours":
            _check(result, delivered)

    return measure(cases, context.repeats, before=before, after=after)


def _row(label: str, timings, goal: float, note: str) -> Row:
    """Our best time against the reference's, in milliseconds (lower is better)."""
    return Row.compare(
        label,
        timings["ours"].best * 1e3,
        timings["reference"].best * 1e3,
        "ms",
        goal=goal,
        note=note,
        higher_is_better=False,
    )


def run(context: BenchContext) -> list[Row]:
    logging.getLogger("hyper_parallel.data").setLevel(logging.WARNING)
    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    log("provenance: writing the Indexed corpus (untimed)")
    indexed = _indexed_config(context, tokenizer)
    batch = INDEXED_BATCH_QUICK if context.quick else INDEXED_BATCH
    timings = _compare(context, indexed, tokenizer, batch, MICRO_BATCH)
    rows = [
        _row(
            f"Indexed provenance of micro-batch {batch:,}",
            timings,
            INDEXED_GOAL,
            "ours: build the loader and trace from the index arrays; reference: build it and iterate to the "
            "micro-batch",
        )
    ]
    log("provenance: Online, cold and warm length cache")
    online = _online_config(context)
    batch = ONLINE_BATCH_QUICK if context.quick else ONLINE_BATCH
    arrow = context.workdir / "provenance_arrow"

    def drop_length_cache(name: str) -> None:
        if name == "ours":
            for cache in arrow.rglob("provenance_lengths-*.npz"):
                cache.unlink()

    cold = _compare(context, online, tokenizer, batch, 1, before=drop_length_cache)
    warm = _compare(context, online, tokenizer, batch, 1)
    for label, timing, goal in (("cold", cold, ONLINE_COLD_GOAL), ("warm", warm, ONLINE_WARM_GOAL)):
        rows.append(
            _row(
                f"Online provenance of micro-batch {batch:,}, {label} length cache",
                timing,
                goal,
                "ours: replay the windows and the packing over the records' lengths; reference: build the dynamic "
                "loader and iterate to the micro-batch",
            )
        )
    return rows
