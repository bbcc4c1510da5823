"""The Online path (records read with Hugging Face ``datasets``, tokenized when read, packed into token-budget
micro-batches): throughput vs the bare tokenizer, packing efficiency, and the cost of an exact resume.

* **Throughput.** The bundled Jane Austen paragraphs (the corpus of the ``offline`` group) are written as JSONL
  and read through ``build_online_text_dataset`` (plaintext transform) and ``DynamicBatchDataLoader`` to the end of
  the epoch: reading the records, tokenizing, cutting windows, choosing micro-batches and the packing collate. The
  reference encodes the same texts, already in memory, one by one with ``Tokenizer.encode`` in this process. Both
  run in interleaved rounds; the token totals are asserted equal.
* **Packing.** Pre-tokenized records with seeded lognormal lengths (many short, a few of a whole sequence) go
  through the ``identity`` transform and the dynamic loader; the efficiency is the share of the micro-batches'
  token budget filled with real tokens, with and without the sample buffer.
* **Resume.** A loader stopped half way through the epoch is restored in a fresh loader with ``load_state_dict``;
  the time to its first batch is compared with a fresh loader's time to its first batch at the start of the epoch.
  The restored batches are asserted equal to the uninterrupted run's.
* **Elastic resume.** The loaders of two DP ranks stopped half way through their shares are merged
  (``merge_rank_states``) and restored at three ranks; the time to the first batch of new rank 0 (merge, load and
  the batch) is compared with a fresh rank 0 of three ranks' first batch. Every sequence of the epoch is asserted
  delivered once over the old ranks and the new ones.
"""

from __future__ import annotations

import copy
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_offline import _quiet_project_logging, corpus_path, load_paragraphs, repeat_to_tokens, write_jsonl
from benchmarks.common import BenchContext, Row, log, measure
from hyper_parallel.data.batching import build_dataloader
from hyper_parallel.data.batching.batch import Batch

NAME = "online"
TITLE = "Online read + tokenize + dynamic batching vs bare tokenizers; packing efficiency; resume"

TOKENS_FULL = 900_000  # about the whole bundled corpus once (4 MB of text)
TOKENS_QUICK = 200_000
MAX_SEQ_LEN = 2048
MICRO_BATCH = 4
MIN_BUFFERED = 200
SHUFFLE_BUFFER = 1_000  # records of the iterable source's shuffle buffer (a tenth of the full corpus)
WORKERS = 2
SOURCES = ("mapping", "iterable")
THROUGHPUT_GOAL = 0.8
BATCHED_ENCODE_GOAL = 0.85  # against the transform's own tokenizer call, the gap is the pipeline's per-record work
# The texts the plaintext transform encodes per call in these loaders (no workers): the dynamic loader's reads of
# records, several fetched at once in the main process.
RECORDS_PER_CALL = build_dataloader._RECORDS_PER_READ * build_dataloader._READS_PER_FETCH_IN_PROCESS

PACK_MAX_SEQ_LEN = 4096
PACK_MICRO_BATCH = 1
PACK_RECORDS_FULL = 3_000
PACK_RECORDS_QUICK = 1_000
PACK_MEDIAN = 300  # tokens; lognormal sigma below gives a mean of ~620 and ~1.5% records of a whole sequence
PACK_SIGMA = 1.2
PACK_SEED = 1234
PACKING_GOAL = 0.95

RESUME_GOAL = 2.0
RESUME_REPEATS_FACTOR = 3  # the first batch takes tens of milliseconds: more repetitions steady the best one
ELASTIC_SIZES = (2, 3)  # the DP size the states are saved at, and the one they are restored at


@contextmanager
def _quiet() -> Iterator[None]:
    """No project progress logging, no Hugging Face progress bars, one tokenizer thread (restored afterwards)."""
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    # One tokenizer thread on both sides, so the ratios compare work, not thread pools.
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with _quiet_project_logging():
            yield
    finally:
        if bars:
            datasets.enable_progress_bars()
        if parallelism is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = parallelism


def build_source(jsonl: Path, kind: str, data_transform, cache_dir: Path, shuffle_buffer_size: int = SHUFFLE_BUFFER):
    """The Online dataset of ``jsonl`` as a mapping or iterable source (a mapping source writes its Arrow cache)."""
    from hyper_parallel.data.text.build_dataset import build_online_text_dataset

    data_config = {"dataset_type": kind, "cache_dir": str(cache_dir), "shuffle_buffer_size": shuffle_buffer_size}
    return build_online_text_dataset(str(jsonl), data_transform, data_config)


def source_opener(jsonl: Path, data_transform, cache_dir: Path) -> Callable[[str], Any]:
    """``open_source(kind)``: the mapping dataset, built once (its Arrow cache written now, untimed), or a new iterable
    dataset; a stream keeps its cursor, so every loader that must start at the beginning of the epoch gets its own.
    """
    mapping = build_source(jsonl, "mapping", data_transform, cache_dir)

    def open_source(kind: str):
        return mapping if kind == "mapping" else build_source(jsonl, kind, data_transform, cache_dir)

    return open_source


def dynamic_loader(dataset, **options: Any):
    from hyper_parallel.data.batching import DynamicBatchDataLoader

    settings = {
        "micro_batch_size": MICRO_BATCH,
        "max_seq_len": MAX_SEQ_LEN,
        "min_buffered_samples": MIN_BUFFERED,
        "num_workers": 0,
        "drop_last": False,  # every record is read, so the token total can be checked against the reference
    }
    loader = DynamicBatchDataLoader(dataset, **{**settings, **options})
    assert loader.collate_fn.alignment == 1, "the token counts assume packed rows without tail padding"
    return loader


def real_tokens(batch: Batch) -> int:
    """Tokens of a packed batch: all of them, as the default collator (alignment 1) adds no tail padding."""
    return batch.num_tokens


def same_batch(a: Batch, b: Batch) -> bool:
    return a == b  # the same fields holding equal tensors


# -- throughput -----------------------------------------------------------------------------------------------


def corpus_texts(tokenizer, target: int) -> list[str]:
    """Corpus paragraphs, repeated in order until they hold ``target`` tokens (counting only what is needed)."""
    paragraphs = load_paragraphs(corpus_path())
    counts: list[int] = []
    total = 0
    for text in paragraphs:
        counts.append(len(tokenizer.encode(text, add_special_tokens=False).ids))
        total += counts[-1]
        if total >= target:
            break
    return repeat_to_tokens(paragraphs[: len(counts)], counts, target)


def throughput_rows(
    context: BenchContext, texts: list[str], open_source: Callable[[str], Any], tokenizer
) -> tuple[list[Row], dict[str, list]]:
    """Bare encode vs the loaders over each source; returns the rows and each source's uninterrupted batches."""

    def encode_bare() -> int:
        return sum(len(tokenizer.encode(text, add_special_tokens=False).ids) for text in texts)

    def encode_batches_bare() -> int:
        # the call the plaintext transform makes, on reads of the same size, without the pipeline around it
        return sum(
            len(encoding.ids)
            for start in range(0, len(texts), RECORDS_PER_CALL)
            for encoding in tokenizer.encode_batch_fast(
                texts[start : start + RECORDS_PER_CALL], add_special_tokens=False
            )
        )

    sources: dict[str, Any] = {}

    def drain(kind: str, workers: int) -> Callable[[], list]:
        def to_the_end() -> list:
            return list(dynamic_loader(sources[kind], num_workers=workers))

        return to_the_end

    cases: dict[str, Callable[[], Any]] = {"bare": encode_bare, "bare batches": encode_batches_bare}
    cases.update({kind: drain(kind, 0) for kind in SOURCES})
    cases[f"mapping x{WORKERS}"] = drain("mapping", WORKERS)
    tokens: dict[str, int] = {}
    batches: dict[str, list] = {}

    def before(name: str) -> None:
        for kind in SOURCES:
            if name.startswith(kind):
                sources[kind] = open_source(kind)

    def after(name: str, result: Any) -> None:
        count = result if name.startswith("bare") else sum(real_tokens(batch) for batch in result)
        if name not in tokens:
            tokens[name] = count
            if name in SOURCES:
                batches[name] = result
        assert count == tokens["bare"], f"{name}: {count:,} tokens delivered, the bare encode gives {tokens['bare']:,}"

    megabytes = sum(len(text.encode("utf-8")) for text in texts) / 1e6
    log(f"throughput: {len(texts):,} docs, {megabytes:.1f} MB, {len(cases)} cases, {context.repeats} rounds")
    with _quiet():
        timings = measure(cases, context.repeats, before, after)

    total = tokens["bare"]
    bare = total / timings["bare"].best
    bare_batches = total / timings["bare batches"].best
    setup = (
        f"max_seq_len {MAX_SEQ_LEN}, micro_batch_size {MICRO_BATCH}, min_buffered_samples {MIN_BUFFERED}, a fresh "
        f"loader per round, Arrow cache built before timing"
    )
    common = (
        f"ref: Tokenizer.encode(text, add_special_tokens=False) one by one over the texts in memory, one thread; "
        f"{len(texts):,} docs, {total:,} tokens, {megabytes:.1f} MB. ours: DynamicBatchDataLoader to the end of the "
        f"epoch (read record, plaintext transform, batching, packing collate), {setup}; token totals asserted equal"
    )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows = [
        Row.compare(
            "online mapping: tokens/s", total / timings["mapping"].best, bare, "tokens/s", THROUGHPUT_GOAL, common
        ),
        Row.compare(
            "online iterable: tokens/s",
            total / timings["iterable"].best,
            bare,
            "tokens/s",
            THROUGHPUT_GOAL,
            f"streaming source, shuffle buffer of {SHUFFLE_BUFFER:,} records; otherwise as the mapping row",
        ),
        Row.compare(
            "online mapping: tokens/s vs batched encode",
            total / timings["mapping"].best,
            bare_batches,
            "tokens/s",
            BATCHED_ENCODE_GOAL,
            f"ref: Tokenizer.encode_batch_fast over reads of {RECORDS_PER_CALL} texts in memory, one thread (the "
            "call the transform makes, so the ratio is the pipeline's own overhead)",
        ),
        Row.compare(
            "online iterable: tokens/s vs batched encode",
            total / timings["iterable"].best,
            bare_batches,
            "tokens/s",
            BATCHED_ENCODE_GOAL,
            "as the row above, streaming source",
        ),
        Row.compare(
            f"online mapping, {WORKERS} workers: tokens/s",
            total / timings[f"mapping x{WORKERS}"].best,
            bare,
            "tokens/s",
            note=(
                f"num_workers={WORKERS} on {cores} usable cores (worker start-up included), against the same "
                "one-thread reference; information only"
            ),
        ),
    ]
    return rows, batches


# -- packing --------------------------------------------------------------------------------------------------


def write_token_records(path: Path, records: int, seed: int) -> np.ndarray:
    """Pre-tokenized JSONL records with lognormal lengths clipped to one sequence; returns the record lengths.

    A record of ``n`` ids gives one sample of ``n - 1`` tokens after the identity transform's shift, so the
    clip at ``PACK_MAX_SEQ_LEN + 1`` ids stands for the full windows a long document is cut into.
    """
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(PACK_MEDIAN), PACK_SIGMA, records).astype(np.int64), 2, PACK_MAX_SEQ_LEN + 1)
    with path.open("w", encoding="utf-8") as f:
        for length in lengths:
            ids = rng.integers(0, 8192, int(length)).tolist()
            f.write(json.dumps({"input_ids": ids}, separators=(",", ":")) + "\n")
    return lengths


def packing_rows(context: BenchContext) -> list[Row]:
    records = PACK_RECORDS_QUICK if context.quick else PACK_RECORDS_FULL
    jsonl = context.workdir / "online_packing.jsonl"
    lengths = write_token_records(jsonl, records, PACK_SEED)
    expected = int((lengths - 1).sum())
    transform = {"data_type": "identity", "max_seq_len": PACK_MAX_SEQ_LEN}
    budget = PACK_MICRO_BATCH * PACK_MAX_SEQ_LEN
    full = int((lengths - 1 >= PACK_MAX_SEQ_LEN).sum())
    log(f"packing: {records:,} records, {expected:,} tokens, budget {budget}")

    efficiency: dict[int, tuple[float, int]] = {}
    with _quiet():
        for buffered in (MIN_BUFFERED, 1):
            # File order (no shuffle buffer): the lengths are already in random order.
            dataset = build_source(jsonl, "iterable", transform, context.workdir / "online_cache", 0)
            loader = dynamic_loader(
                dataset, micro_batch_size=PACK_MICRO_BATCH, max_seq_len=PACK_MAX_SEQ_LEN, min_buffered_samples=buffered
            )
            count = tokens = 0
            for batch in loader:
                count += 1
                tokens += real_tokens(batch)
            assert tokens == expected, f"packing delivered {tokens:,} tokens, the records hold {expected:,}"
            efficiency[buffered] = (tokens / (count * budget), count)
    jsonl.unlink(missing_ok=True)

    lower_bound = -(-expected // budget)
    description = (
        f"{records:,} records, lognormal lengths (median {PACK_MEDIAN}, sigma {PACK_SIGMA}, seed {PACK_SEED}) clipped "
        f"to one sequence ({full} records of a whole one), {expected:,} tokens; identity transform, max_seq_len "
        f"{PACK_MAX_SEQ_LEN}, micro_batch_size {PACK_MICRO_BATCH}; efficiency = real tokens / (micro-batches x "
        f"budget {budget}), the end-of-epoch flush included; ref: every micro-batch full ({lower_bound} micro-batches)"
    )
    return [
        Row.compare(
            f"packing, min_buffered_samples={MIN_BUFFERED}",
            efficiency[MIN_BUFFERED][0],
            1.0,
            "fill",
            PACKING_GOAL,
            f"{efficiency[MIN_BUFFERED][1]} micro-batches; {description}",
        ),
        Row.compare(
            "packing, min_buffered_samples=1",
            efficiency[1][0],
            1.0,
            "fill",
            note=f"{efficiency[1][1]} micro-batches: no buffer, a batch is chosen as soon as a budget's worth arrived",
        ),
    ]


# -- resume ---------------------------------------------------------------------------------------------------


def resume_row(context: BenchContext, kind: str, open_source: Callable[[str], Any], uninterrupted: list) -> Row:
    """Time load_state_dict + first batch vs a fresh first batch; assert the restored run equals the uninterrupted."""
    stop = len(uninterrupted) // 2
    with _quiet():
        loader = dynamic_loader(open_source(kind))
        batches = iter(loader)
        for _ in range(stop):
            next(batches)
        state = copy.deepcopy(loader.state_dict())
        del batches, loader

        loaders: dict[str, Any] = {}

        def before(name: str) -> None:
            loaders[name] = dynamic_loader(open_source(kind))
            if name == "resumed":
                loaders["state"] = copy.deepcopy(state)  # a new copy, as if read back from a checkpoint

        def fresh() -> dict:
            return next(iter(loaders["fresh"]))

        def resumed() -> dict:
            loader = loaders["resumed"]
            loader.load_state_dict(loaders["state"])
            return next(iter(loader))

        def after(name: str, batch: dict) -> None:
            expected = uninterrupted[stop if name == "resumed" else 0]
            assert same_batch(batch, expected), f"{kind}: the {name} first batch differs from the uninterrupted run's"

        timings = measure({"fresh": fresh, "resumed": resumed}, context.repeats * RESUME_REPEATS_FACTOR, before, after)

        # Once, untimed: the restored loader delivers exactly the rest of the uninterrupted epoch.
        loader = dynamic_loader(open_source(kind))
        loader.load_state_dict(copy.deepcopy(state))
        rest = list(loader)
    assert len(rest) == len(uninterrupted) - stop and all(map(same_batch, rest, uninterrupted[stop:])), (
        f"{kind}: the resumed run differs from the uninterrupted one"
    )
    saved = f"state saved after {stop} of {len(uninterrupted)} batches"
    if kind == "mapping":
        note = (
            f"{saved} with state_dict() and deep-copied before each round; ours: load_state_dict + the first batch "
            "of a fresh loader; ref: a fresh loader's first batch at the start of the epoch; loader construction "
            "untimed on both sides; the resumed first batch and the whole rest of the epoch are asserted equal to "
            "the uninterrupted run's"
        )
    else:
        note = (
            f"{saved}; streaming source: the fresh start first fills the {SHUFFLE_BUFFER:,}-record shuffle buffer, "
            "which the state carries; otherwise as the mapping resume row"
        )
    return Row.compare(
        f"resume {kind}: load_state_dict + 1st batch",
        timings["resumed"].best * 1e3,
        timings["fresh"].best * 1e3,
        "ms",
        RESUME_GOAL,
        note,
        higher_is_better=False,
    )


def sequences(batches: list[Batch]) -> Counter:
    """The token sequences of packed batches, as a multiset."""
    found = Counter()
    for batch in batches:
        ids, bounds = batch["input_ids"].reshape(-1).tolist(), batch["cu_seq_lens"].tolist()
        found.update(tuple(ids[start:end]) for start, end in zip(bounds[:-1], bounds[1:], strict=True))
    return found


def elastic_resume_run(context: BenchContext, rank_loader, stop: int, what: str, setting: str) -> tuple[Row, list]:
    """The ranks of the first of ``ELASTIC_SIZES`` (``rank_loader(rank, size)`` builds a loader) read ``stop``
    batches each and save their states; merge + load + first batch on rank 0 of the second size is timed against a
    fresh rank 0's first batch there, construction untimed, the states deep-copied before each round as if read back
    from checkpoints; then, untimed, every new rank is restored from the merged states and read to the end of the
    epoch. Returns the row (``elastic resume <what> ...``, its note opened by ``setting``) and every batch delivered,
    by the old ranks and the new, for the caller to check."""
    from hyper_parallel.data.batching import merge_rank_states

    old_size, new_size = ELASTIC_SIZES
    delivered, states = [], []
    for rank in range(old_size):
        loader = rank_loader(rank, old_size)
        batches = iter(loader)
        delivered += [next(batches) for _ in range(stop)]
        states.append(copy.deepcopy(loader.state_dict()))
        del batches, loader
    loaders: dict[str, Any] = {}

    def before(name: str) -> None:
        loaders[name] = rank_loader(0, new_size)
        loaders["states"] = copy.deepcopy(states)

    def resumed() -> Batch:
        loader = loaders["resumed"]
        loader.load_state_dict(merge_rank_states(loaders["states"]))
        return next(iter(loader))

    cases = {"fresh": lambda: next(iter(loaders["fresh"])), "resumed": resumed}
    timings = measure(cases, context.repeats * RESUME_REPEATS_FACTOR, before)
    merged = merge_rank_states(copy.deepcopy(states))
    for rank in range(new_size):
        loader = rank_loader(rank, new_size)
        loader.load_state_dict(merged)
        delivered += list(loader)
    row = Row.compare(
        f"elastic resume {what} {old_size} -> {new_size} ranks: merge + load_state_dict + 1st batch",
        timings["resumed"].best * 1e3,
        timings["fresh"].best * 1e3,
        "ms",
        RESUME_GOAL,
        f"{setting}; the states of {old_size} ranks saved after {stop} batches each, deep-copied before each round; "
        f"ours: merge_rank_states + load_state_dict on rank 0 of {new_size} + its first batch; ref: a fresh rank 0 "
        f"of {new_size}'s first batch; loader construction untimed on both sides; every sequence of the epoch is "
        "asserted delivered once over the old and the new ranks",
        higher_is_better=False,
    )
    return row, delivered


def elastic_resume_row(context: BenchContext, kind: str, jsonl: Path, transform, uninterrupted: list) -> Row:
    """Time merge + load + first batch at the new DP size vs a fresh first batch there; assert every sequence of the
    epoch is delivered once across the change."""
    from hyper_parallel.data.text.build_dataset import build_online_text_dataset

    cache = context.workdir / "online_cache"
    data_config = {"dataset_type": kind, "cache_dir": str(cache), "shuffle_buffer_size": SHUFFLE_BUFFER}

    def rank_loader(rank: int, size: int):
        dataset = build_online_text_dataset(str(jsonl), transform, data_config, dp_rank=rank, dp_world_size=size)
        return dynamic_loader(dataset, dp_rank=rank, dp_world_size=size, global_batch_size=MICRO_BATCH * size)

    stop = len(uninterrupted) // (2 * ELASTIC_SIZES[0])  # half of each old rank's share of the epoch
    with _quiet():
        row, delivered = elastic_resume_run(context, rank_loader, stop, kind, "stops at half of each share")
    assert sequences(delivered) == sequences(uninterrupted), f"{kind}: the elastic resume lost or repeated records"
    return row


def run(context: BenchContext) -> list[Row]:
    """Throughput (bare encode and the loaders, interleaved), then packing, then resume on the same datasets."""
    from hyper_parallel.data.text.build_data_transform import build_llm_data_transform
    from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer

    text_tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    backend = text_tokenizer.backend
    texts = corpus_texts(backend, TOKENS_QUICK if context.quick else TOKENS_FULL)
    jsonl = context.workdir / "online_corpus.jsonl"
    write_jsonl(texts, jsonl)
    transform = build_llm_data_transform("plaintext", text_tokenizer, max_seq_len=MAX_SEQ_LEN)
    log("online: building the mapping source's Arrow cache (untimed)")
    with _quiet():
        open_source = source_opener(jsonl, transform, context.workdir / "online_cache")

    rows, uninterrupted = throughput_rows(context, texts, open_source, backend)
    rows += packing_rows(context)
    log("resume: mapping and iterable")
    rows += [resume_row(context, kind, open_source, uninterrupted[kind]) for kind in SOURCES]
    log("elastic resume: mapping and iterable")
    rows += [elastic_resume_row(context, kind, jsonl, transform, uninterrupted[kind]) for kind in SOURCES]
    return rows
