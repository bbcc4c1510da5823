"""Mixtures: the cost per sample of reading through a mixture against reading its source alone, and of planning.

The source is one Indexed GPTDataset (seq 1024) over a seeded corpus of lognormal document lengths. The loader
rows read it with ``FixedBatchDataLoader`` (micro-batches of 8, no workers, the default in-order sampler) alone and
through a mixture of the same dataset under two names, 0.7 : 0.3, ``on_exhausted: restart`` over as many samples:
reads in the same order (``shuffle: false``), plus the plan, the reads split by source and the tally. A mixed
batch is checked to hold rows of the source. The planning row times ``MixtureOrder`` built and planned over a
whole mixture against drawing as many Philox uniforms alone (the draw it is built on).
"""

from __future__ import annotations

import numpy as np

from benchmarks.bench_indexed_dataset import BenchTokenizer
from benchmarks.common import BenchContext, Row, log, measure
from hyper_parallel.data.batching import FixedBatchDataLoader
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.mixture import build_mixture_dataset
from hyper_parallel.data.mixture.mixture_order import MixtureOrder
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset

NAME = "mixture"
TITLE = "mixture overhead per sample against one source, and planning"

SEQ_LENGTH = 1024
MICRO_BATCH = 8
SEED = 1234
DOCUMENTS = {False: 40_000, True: 8_000}
PLANNED = {False: 10_000_000, True: 1_000_000}
VOCAB = 50_000


def _source(context: BenchContext):
    rng = np.random.default_rng(SEED)
    prefix = context.workdir / "mixture_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    lengths = np.maximum(1, rng.lognormal(6.4, 0.9, size=DOCUMENTS[context.quick]).astype(np.int64))
    tokens = rng.integers(2, VOCAB, size=int(lengths.sum()), dtype=np.uint16)
    builder.add_documents(tokens, lengths)
    builder.finalize(f"{prefix}.idx")
    config = {"seq_length": SEQ_LENGTH, "split": "100, 0, 0", "data_cache_path": str(context.workdir / "cache")}
    return build_indexed_text_dataset(str(prefix), config, tokenizer=BenchTokenizer(), synchronize=False)[0]


def _read(loader) -> int:
    return sum(len(batch.input_ids) for batch in loader)


def run(context: BenchContext) -> list[Row]:
    source = _source(context)
    mixture = build_mixture_dataset(
        [{"name": "a", "weight": 0.7, "dataset": source}, {"name": "b", "weight": 0.3, "dataset": source}],
        on_exhausted="restart",
        num_samples=len(source),
        seed=SEED,
        shuffle=False,  # each source in record order, as the source alone is read: the rows compare like reads
    )
    log(f"{len(source):,} samples of {SEQ_LENGTH} tokens, alone and mixed")
    first = next(iter(FixedBatchDataLoader(mixture, micro_batch_size=MICRO_BATCH)))
    rows_of_source = {tuple(row) for row in np.stack([source[i]["tokens"].numpy() for i in range(len(source))])}
    assert all(tuple(row) in rows_of_source for row in first.input_ids.tolist())
    timings = measure(
        {
            "alone": lambda: _read(FixedBatchDataLoader(source, micro_batch_size=MICRO_BATCH)),
            "mixed": lambda: _read(FixedBatchDataLoader(mixture, micro_batch_size=MICRO_BATCH)),
        },
        context.repeats,
    )
    samples = len(source) - len(source) % MICRO_BATCH
    rows = [
        Row.compare(
            f"mixture of 2, fixed loader: samples/s vs one source (seq {SEQ_LENGTH})",
            samples / timings["mixed"].best,
            samples / timings["alone"].best,
            "samples/s",
            note="the same GPTDataset read alone, same loader settings",
        )
    ]

    planned = PLANNED[context.quick]

    def plan() -> int:
        order = MixtureOrder(
            [0.5, 0.3, 0.2], [None] * 3, strategy="weighted", on_exhausted="restart", seed=SEED, num_samples=planned
        )
        return len(order.plan(0, planned)[0])

    def draw() -> int:
        return len(np.random.Generator(np.random.Philox(key=SEED)).random(planned))

    timings = measure({"plan": plan, "draw": draw}, context.repeats)
    rows.append(
        Row.compare(
            f"mixture plan of {planned:,} samples: samples/s vs Philox draws",
            planned / timings["plan"].best,
            planned / timings["draw"].best,
            "samples/s",
            note="MixtureOrder built and planned over a mixture of 3 weighted sources, against the uniforms alone",
        )
    )
    return rows
