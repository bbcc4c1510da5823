"""Mixtures: the cost per sample of reading through a mixture against reading its source alone, and of planning.

The source is one Indexed GPTDataset (seq 1024) over a seeded corpus of lognormal document lengths. The loader
rows read it with ``FixedBatchDataLoader`` (micro-batches of 8, no workers, the default in-order sampler) alone and
through a mixture of the same dataset under two names, 0.7 : 0.3, ``on_exhausted: restart`` over as many samples:
reads in the same order (``shuffle: false``), plus the plan, the reads split by source and the tally. A mixed
batch is checked to hold rows of the source. The planning row times ``MixtureOrder`` built and planned over a
whole mixture against drawing as many Philox uniforms alone (the draw it is built on). The elastic row times the
resume of a mixture with a streaming source at another DP size (merge, load, first batch) against a fresh loader's
first batch at that size.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from benchmarks.bench_indexed_dataset import BenchTokenizer
from benchmarks.bench_online import MICRO_BATCH as ONLINE_MICRO_BATCH
from benchmarks.bench_online import (
    corpus_texts,
    dynamic_loader,
    elastic_resume_run,
    write_jsonl,
)
from benchmarks.common import BenchContext, Row, log, measure
from hyper_parallel.data.batching import FixedBatchDataLoader
from hyper_parallel.data.constants import IGNORE_INDEX
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
STREAM_TOKENS = {False: 400_000, True: 100_000}  # of the streamed source of the elastic row


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
    rows.append(_elastic_stream_row(context, source))
    return rows


def _sequences(batches) -> Counter:
    """The token sequences of packed batches that carry a loss (the collator's padding left out), as a multiset."""
    found = Counter()
    for batch in batches:
        for ids, labels in batch.sequences():
            if (labels != IGNORE_INDEX).any():
                found[tuple(ids.tolist())] += 1
    return found


def _elastic_stream_row(context: BenchContext, indexed) -> Row:
    """A mixture of a stream of corpus paragraphs and the Indexed rows (``reweight``: an epoch is one pass of each):
    merge + load + first batch at the new DP size against a fresh first batch there; the old ranks' batches and the
    new ranks' rest of the epoch are asserted to hold the epoch of one rank alone, each sequence once."""
    from hyper_parallel.data.text.build_dataset import build_online_text_dataset
    from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer

    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    jsonl = context.workdir / "mixture_stream.jsonl"
    write_jsonl(corpus_texts(tokenizer.backend, STREAM_TOKENS[context.quick]), jsonl)
    transform = {"data_type": "plaintext", "text_keys": "text", "max_seq_len": SEQ_LENGTH * 2}
    data_config = {"dataset_type": "iterable", "shuffle_buffer_size": 1000}
    rows = min(len(indexed), 2_000)  # of the Indexed source per pass, about as many tokens as the stream

    def rank_loader(rank: int, size: int):
        streamed = build_online_text_dataset(
            str(jsonl), transform, data_config, tokenizer=tokenizer, dp_rank=rank, dp_world_size=size
        )
        entries = [
            {"name": "stream", "weight": 0.5, "dataset": streamed},
            {"name": "rows", "weight": 0.5, "dataset": indexed, "max_samples": rows},
        ]
        mixture = build_mixture_dataset(entries, on_exhausted="reweight", seed=SEED)
        return dynamic_loader(mixture, dp_rank=rank, dp_world_size=size, global_batch_size=ONLINE_MICRO_BATCH * size)

    uninterrupted = _sequences(list(rank_loader(0, 1)))
    setting = (
        f"a stream of {STREAM_TOKENS[context.quick]:,} tokens of paragraphs (shuffle buffer 1,000) and {rows:,} "
        "Indexed rows mixed 0.5 : 0.5 (reweight), DynamicBatchDataLoader as in the online group"
    )
    row, delivered = elastic_resume_run(context, rank_loader, 20, "of a stream mixture", setting)
    assert _sequences(delivered) == uninterrupted, "the elastic resume of the stream mixture lost or repeated records"
    return row
