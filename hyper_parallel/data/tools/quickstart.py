"""The quickstart: the bundled Jane Austen corpus from raw text to the batches of a DP x CP mesh, offline.

Steps (about 20 s on two cores):

1. prepare the example data (``tools.example_data``) that the configs under ``examples/`` read: the chapters as
   JSON lines (in passages of at most 4096 tokens), synthetic conversations and instructions, and Megatron-compatible
   ``.bin``/``.idx`` pairs (one document per passage, packed 4096-token records, one pair per book);
2. verify every pair and summarise the corpus pair; 3. decode the start of its first document;
4. cut it into train/valid/test samples with the Indexed path (megatron-core's sample order);
5. blend the two book pairs 70/30 with a weighted ``data_path`` list and show each book's share of the samples;
6. read the passages with the Online path (tokenized while loading, packed into token-budget micro-batches) and
   show that a loader restored from a saved state continues with exactly the next batch;
7. show one conversation through the bundled ChatML template with its supervised tokens marked;
8. deliver Online batches on spawned gloo ranks, DP2 x CP2: every rank builds the pipeline with
   ``build_dataloaders`` and a ``DataLoaderParallelContext`` and gets its CP slice from the ``ParallelBatch``
   ``get_batch`` node; the slices of each CP group, put back at their columns, must equal the reader's batch.

It ends with a table of every stage's batch shapes, packing efficiency (tokens that carry a loss over tokens
delivered) and throughput. Run it with ``hp-data quickstart``.

Owns: the demonstration sequence and its printout only; every step calls the public API of the package.
Not responsible for: what the example files hold (``tools.example_data``) or how any batch is made.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hyper_parallel.data.batching import DynamicBatchDataLoader, FixedBatchDataLoader
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.text.build_data_transform import TextConversationTransform
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset, build_online_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer
from hyper_parallel.data.tools.example_data import (
    BLEND_BOOKS,
    BUNDLED_CORPUS_PATH,
    EXAMPLE_MAX_SEQ_LEN,
    ExampleData,
    prepare_example_data,
)
from hyper_parallel.data.tools.preview_batches import marked_text
from hyper_parallel.data.tools.read_indexed_dataset import format_summary, summarize

__all__ = [
    "BUNDLED_CORPUS_PATH",
    "MeshDelivery",
    "StageStats",
    "closing_hints",
    "cp_slices_rebuild_batch",
    "deliver_on_mesh",
    "main",
    "mesh_pipeline_config",
    "run_quickstart",
    "stage_table",
    "supervision_marks",
]

STEPS = 8
# Every passage of the example data fits it: on the mesh every passage is one sample.
MESH_MAX_SEQ_LEN = EXAMPLE_MAX_SEQ_LEN
BLEND_WEIGHTS = (70, 30)
_TERMINAL_MARKS = ("\033[1;32m", "\033[0m")
_PLAIN_MARKS = ("[[", "]]")


def supervision_marks(stream=None) -> tuple[str, str]:
    """How supervised tokens are marked: green on a terminal, ``[[...]]`` otherwise or when ``NO_COLOR`` is set."""
    stream = sys.stdout if stream is None else stream
    terminal = hasattr(stream, "isatty") and stream.isatty()
    return _TERMINAL_MARKS if terminal and not os.environ.get("NO_COLOR") else _PLAIN_MARKS


# -- what each stage delivered ------------------------------------------------------------------------------------


@dataclass
class StageStats:
    """The batches one stage delivered: their ``input_ids`` shapes, tokens with a loss, tokens, and seconds."""

    name: str
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    valid_tokens: int = 0
    delivered_tokens: int = 0
    seconds: float = 0.0

    def add(self, batch) -> None:
        """Count one ``Batch``."""
        self.shapes.append(tuple(batch.input_ids.shape))
        self.valid_tokens += batch.trained_tokens
        self.delivered_tokens += batch.num_tokens

    @property
    def efficiency(self) -> float:
        """Tokens that carry a loss over tokens delivered (padding and unsupervised tokens lower it)."""
        return self.valid_tokens / max(self.delivered_tokens, 1)

    @property
    def shape_text(self) -> str:
        """``4 x 512``, or ``1 x 1,984-2,048`` when the widths vary."""
        rows = sorted({shape[0] for shape in self.shapes})
        widths = sorted({shape[1] for shape in self.shapes})
        row_text = f"{rows[0]}" if len(rows) == 1 else f"{rows[0]}-{rows[-1]}"
        width_text = f"{widths[0]:,}" if len(widths) == 1 else f"{widths[0]:,}-{widths[-1]:,}"
        return f"{row_text} x {width_text}"


def _measured(name: str, batches: Iterator, count: int) -> tuple[StageStats, list]:
    """Pull ``count`` batches, timing only the pulls; returns the stats and the batches."""
    stats, kept = StageStats(name), []
    for _ in range(count):
        started = time.perf_counter()
        batch = next(batches)
        stats.seconds += time.perf_counter() - started
        stats.add(batch)
        kept.append(batch)
    return stats, kept


def stage_table(stages: list[StageStats]) -> str:
    """The closing table: one row per stage."""
    header = ("stage", "batches", "input_ids shape", "loss / delivered tokens", "efficiency", "tokens/s")
    rows = [
        (
            stage.name,
            f"{len(stage.shapes)}",
            stage.shape_text,
            f"{stage.valid_tokens:,} / {stage.delivered_tokens:,}",
            f"{stage.efficiency:.1%}",
            f"{stage.delivered_tokens / max(stage.seconds, 1e-9):,.0f}",
        )
        for stage in stages
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = []
    for row in (header, *rows):
        cells = [f"{row[0]:<{widths[0]}}"] + [
            f"{cell:>{width}}" for cell, width in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  " + "  ".join(cells))
    lines.insert(1, "  " + "  ".join("-" * width for width in widths))
    return "\n".join(lines)


# -- steps 1 to 3: prepare, verify, decode ------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """No progress bar interleaves with the printout: Hugging Face ``datasets`` bars are switched off, and tqdm bars
    (offline preparation's) see no terminal on stderr; anything else written to stderr is passed on at the end."""
    import datasets

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        if enabled:
            datasets.enable_progress_bars()
        sys.stderr.write(captured.getvalue())


def _prepare(output_dir: Path, workers: int) -> ExampleData:
    print(f"1/{STEPS} preparing the example data from {BUNDLED_CORPUS_PATH.name} in {output_dir}/")
    started = time.perf_counter()
    with _quiet_progress_bars():
        data = prepare_example_data(output_dir, workers=workers)
    seconds = time.perf_counter() - started
    passages = sum(1 for _ in data.train_jsonl.open(encoding="utf-8"))
    conversations = sum(1 for _ in data.conversations_jsonl.open(encoding="utf-8"))
    instructions = sum(1 for _ in data.instructions_jsonl.open(encoding="utf-8"))
    rows = [
        (data.train_jsonl, f"{passages} passages as JSON lines", "Online configs"),
        (data.conversations_jsonl, f"{conversations} synthetic conversations", "the SFT config"),
        (data.instructions_jsonl, f"{instructions} synthetic instructions", "the instruction SFT config"),
    ]
    uses = ["Indexed configs", "offline-packed records", *(f"the blend ({book})" for book in BLEND_BOOKS)]
    uses += ["the Indexed SFT config, with its _loss_mask pair", "the packed SFT config, with its _loss_mask pair"]
    prefixes = (
        data.corpus_prefix,
        data.packed_prefix,
        *data.blend_prefixes,
        data.conversations_prefix,
        data.instructions_prefix,
    )
    for prefix, use in zip(prefixes, uses, strict=True):
        reader = IndexedDataReader(prefix)
        what = f"{reader.num_documents} documents, {reader.num_tokens:,} tokens"
        if prefix in (data.packed_prefix, data.instructions_prefix):
            what = f"{len(reader)} records of {int(reader.sequence_lengths[0]):,} tokens"
        rows.append((Path(f"{prefix}.{{bin,idx}}"), what, use))
    width = max(len(str(path.relative_to(output_dir))) for path, _, _ in rows)
    for path, what, use in rows:
        print(f"  {str(path.relative_to(output_dir)):<{width}}  {what:<38}  for {use}")
    print(f"  written in {seconds:.1f} s; a second run rewrites the same bytes")
    return data


def _verify(data: ExampleData) -> IndexedDataReader:
    prefix = data.corpus_prefix
    print(f"\n2/{STEPS} verifying every pair, and summarising {prefix}")
    for other in (data.packed_prefix, *data.blend_prefixes, prefix):
        IndexedDataReader(other).verify()
    print("verify: OK (pointers, lengths, document indices and .bin size agree in all 4 pairs)")
    reader = IndexedDataReader(prefix)
    print(format_summary(summarize(reader)))
    return reader


def _decode_first(reader: IndexedDataReader, tokenizer, preview_chars: int) -> None:
    first = reader[0]
    text = tokenizer.decode(first)
    print(f"\n3/{STEPS} the first document, {len(first)} tokens, decoded (first {preview_chars} characters):\n")
    print(text[:preview_chars] + (" [...]" if len(text) > preview_chars else ""))


# -- steps 4 and 5: the Indexed path and a blend ------------------------------------------------------------------


def _indexed(data: ExampleData, cache: Path, tokenizer, seq_length: int, batches: int) -> StageStats:
    print(f"\n4/{STEPS} samples of {seq_length} tokens, split 98/1/1, one epoch each (index cache in {cache}/)")
    splits = build_indexed_text_dataset(
        str(data.corpus_prefix),
        {"seq_length": seq_length, "split": "98, 1, 1", "data_cache_path": str(cache)},
        tokenizer=tokenizer,
    )
    for name, dataset in zip(("train", "valid", "test"), splits, strict=True):
        print(f"  {name}: {type(dataset).__name__} of {len(dataset):,} samples")
    sample = splits[0][0]
    print(f"  train[0]: tokens {tuple(sample['tokens'].shape)}, labels shifted by one; it begins:")
    print("  " + tokenizer.decode(sample["tokens"][:40].tolist()).replace("\n", " ") + " [...]")
    loader = FixedBatchDataLoader(splits[0], micro_batch_size=4)
    stats, _ = _measured("Indexed GPTDataset", iter(loader), batches)
    return stats


def _blend(data: ExampleData, cache: Path, tokenizer, seq_length: int, batches: int) -> StageStats:
    samples = 1000
    data_path = []
    for weight, prefix in zip(BLEND_WEIGHTS, data.blend_prefixes, strict=True):
        data_path += [str(weight), str(prefix)]
    print(
        f"\n5/{STEPS} blending the two books {BLEND_WEIGHTS[0]}/{BLEND_WEIGHTS[1]}: {samples:,} samples of "
        f"{seq_length} tokens from data_path {data_path}"
    )
    train, _, _ = build_indexed_text_dataset(
        data_path,
        {"seq_length": seq_length, "split": "100, 0, 0", "data_cache_path": str(cache)},
        [samples, None, None],
        tokenizer=tokenizer,
    )
    in_blend = np.bincount(train.dataset_index, minlength=len(BLEND_BOOKS))
    loader = FixedBatchDataLoader(train, micro_batch_size=4)
    stats, read = _measured(f"Indexed blend {BLEND_WEIGHTS[0]}/{BLEND_WEIGHTS[1]}", iter(loader), batches)
    ids = np.concatenate([batch["dataset_id"].numpy() for batch in read])
    in_batches = np.bincount(ids, minlength=len(BLEND_BOOKS))
    print(f"  {type(train).__name__}; each sample carries dataset_id, the index of its book in data_path")
    width = max(map(len, BLEND_BOOKS))
    for book_id, (book, weight) in enumerate(zip(BLEND_BOOKS, BLEND_WEIGHTS, strict=True)):
        print(
            f"  {book:<{width}}  weight {weight / sum(BLEND_WEIGHTS):.2f}: {in_blend[book_id]:>4} of {samples:,} "
            f"samples ({in_blend[book_id] / samples:.1%}), {in_batches[book_id]} of the first {len(ids)} read "
            f"({in_batches[book_id] / len(ids):.1%})"
        )
    return stats


# -- step 6: the Online path and an exact resume ------------------------------------------------------------------


def _online(
    data: ExampleData, cache_dir: Path, tokenizer, seq_length: int, batches: int, micro_batch_size: int = 4
) -> StageStats:
    shown = 3
    print(
        f"\n6/{STEPS} the passages read online from {data.train_jsonl}: tokenized while loading, packed into "
        f"{micro_batch_size} x {seq_length} tokens"
    )

    def loader() -> DynamicBatchDataLoader:
        dataset = build_online_text_dataset(
            str(data.train_jsonl),
            {"data_type": "plaintext", "max_seq_len": seq_length},
            {"dataset_type": "mapping", "cache_dir": str(cache_dir)},
            tokenizer=tokenizer,
        )
        return DynamicBatchDataLoader(dataset, micro_batch_size=micro_batch_size, min_buffered_samples=64)

    with _quiet_progress_bars():
        uninterrupted = loader()
    iterator = iter(uninterrupted)
    first, read = _measured("Online dynamic packing", iterator, shown)
    for number, batch in enumerate(read):
        windows = batch.num_sequences
        print(f"  batch {number}: input_ids {tuple(batch.input_ids.shape)}, {windows} windows of passages")
    state = uninterrupted.state_dict()
    rest, read = _measured(first.name, iterator, max(batches - shown, 1))
    with _quiet_progress_bars():
        restored = loader()
    restored.load_state_dict(state)
    continued = next(iter(restored))
    same = continued == read[0]
    print(
        f"  saved the loader state after batch {shown - 1}; a new loader restored from it gives batch {shown}: ", end=""
    )
    print("identical" if same else "DIFFERENT")
    if not same:
        raise RuntimeError("the restored loader did not continue with the uninterrupted batch")
    first.shapes += rest.shapes
    first.valid_tokens += rest.valid_tokens
    first.delivered_tokens += rest.delivered_tokens
    first.seconds += rest.seconds
    return first


# -- step 7: a conversation ---------------------------------------------------------------------------------------


def _conversation(data: ExampleData, tokenizer) -> None:
    conversations = [json.loads(line) for line in data.conversations_jsonl.open(encoding="utf-8")]
    # The shortest conversation with a system message and two answers shows every kind of turn.
    full = [c for c in conversations if c["messages"][0]["role"] == "system" and len(c["messages"]) == 5]
    conversation = min(full, key=lambda c: sum(len(m["content"]) for m in c["messages"]))
    transform = TextConversationTransform(tokenizer, text_keys="messages")
    (sample,) = transform(conversation)
    input_ids, labels = sample["input_ids"], sample["labels"]
    marks = supervision_marks()
    how = "in green" if marks == _TERMINAL_MARKS else f"between {marks[0]} and {marks[1]}"
    print(
        f"\n7/{STEPS} one of the {len(conversations)} conversations through the bundled ChatML template: "
        f"{len(input_ids)} tokens, {int((labels >= 0).sum())} supervised ({how}): the answers and their end of turn"
    )
    print(marked_text(input_ids, labels, tokenizer.decode, marks))


# -- step 8: a gloo mesh ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeshDelivery:
    """What ``deliver_on_mesh`` saw on every rank.

    Attributes:
        dp, cp: the mesh sizes.
        steps: micro-batches each rank received.
        reader_shapes: ``input_ids`` shapes of the batches the DP ranks' readers gave (DP rank 0, then 1, ...).
        local_shapes: ``input_ids`` shapes of the CP slices, every rank and step.
        slices_match: one entry per DP rank: the CP slices of every step, put back at their columns (the
            ``position_ids``), equal the reader's ``input_ids`` and ``labels``, every column exactly once.
        dp_ranks_differ: the DP ranks' readers never gave the same batch in the same step.
        valid_tokens, delivered_tokens: over every rank's slices (tokens with a loss, all tokens).
        seconds: the slowest rank's time in ``get_batch``.
    """

    dp: int
    cp: int
    steps: int
    reader_shapes: tuple[tuple[int, ...], ...]
    local_shapes: tuple[tuple[int, ...], ...]
    slices_match: tuple[bool, ...]
    dp_ranks_differ: bool
    valid_tokens: int
    delivered_tokens: int
    seconds: float

    def stats(self) -> StageStats:
        """The table row: the slices every rank received."""
        return StageStats(
            f"DP{self.dp} x CP{self.cp} get_batch, per rank",
            list(self.local_shapes),
            self.valid_tokens,
            self.delivered_tokens,
            self.seconds,
        )


def mesh_pipeline_config(
    train_jsonl: str | os.PathLike, max_seq_len: int = MESH_MAX_SEQ_LEN, cache_dir: str | None = None
) -> dict:
    """The pipeline every rank of step 8 builds: the Online path over ``train_jsonl``, packed rows, ``zigzag_thd``.

    Each record is one sample (``max_seq_len`` must hold the longest record, or the fixed loader refuses the
    record), so every DP rank delivers the same number of micro-batches per step, as a trainer needs.
    ``reset_position_ids`` stays off, so the ``position_ids`` of a CP slice are its tokens' columns in the reader's
    row: where each token goes back.
    """
    return {
        "dataset": {
            "_target_": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
            "data_path": str(train_jsonl),
            "data_transform": {
                "_target_": "hyper_parallel.data.text.build_data_transform.build_llm_data_transform",
                "data_type": "plaintext",
                "text_keys": "text",
                "max_seq_len": max_seq_len,
            },
            "data_config": {"dataset_type": "mapping", "cache_dir": cache_dir},
        },
        "dataloader": {"_target_": "hyper_parallel.data.batching.FixedBatchDataLoader"},
        "collate_fn": {"_target_": "hyper_parallel.data.batching.build_online_text_collate_fn"},
        "get_batch": {
            "_target_": "hyper_parallel.data.batching.ParallelBatch",
            "source_type": "online",
            "attention_mode": "packed",
            "cp_layout": "zigzag_thd",
        },
    }


class _Recording(Iterator):
    """The loader's iterator, keeping the last batch it gave (the reader's batch, before CP slicing)."""

    def __init__(self, iterator: Iterator) -> None:
        self.iterator, self.last = iterator, None

    def __next__(self):
        self.last = next(self.iterator)
        return self.last


def _gathered(tensor, group, size: int) -> list:
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def cp_slices_rebuild_batch(batch, slices: list[tuple]) -> bool:
    """Whether the CP slices of ``batch`` give it back: each slice's tokens put at its columns fill every column of
    ``batch.input_ids`` exactly once, with the batch's ``input_ids`` and ``labels``.

    Args:
        batch: the reader's ``Batch`` (``input_ids`` and ``labels`` of ``[R, T]``).
        slices: one ``(input_ids, labels, columns)`` per CP rank, each ``[R, T / cp]``; ``columns`` are the global
            columns of the local tokens (a ``ParallelBatch``'s ``position_ids`` without ``reset_position_ids``).
    """
    import torch

    ids = torch.full_like(batch.input_ids, -1)
    labels = torch.full_like(batch.labels, -1)
    filled = torch.zeros_like(batch.input_ids)
    for local_ids, local_labels, columns in slices:
        ids.scatter_(1, columns, local_ids)
        labels.scatter_(1, columns, local_labels)
        filled.scatter_add_(1, columns, torch.ones_like(columns))
    return bool((filled == 1).all()) and torch.equal(ids, batch.input_ids) and torch.equal(labels, batch.labels)


def _mesh_rank(rank: int, world_size: int, port: int, settings: dict, results) -> None:
    """One spawned rank of ``deliver_on_mesh``: build the pipeline, take ``steps`` batches, check, report."""
    import datasets
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel.data.batching.dataloader import build_dataloaders
    from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        dp, cp = settings["dp"], settings["cp"]
        mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
        context = DataLoaderParallelContext.from_mesh(mesh)
        loaders = build_dataloaders(
            mesh_pipeline_config(settings["train_jsonl"], settings["max_seq_len"], settings["cache_dir"]),
            tokenizer=settings["tokenizer"],
            micro_batch_size=settings["micro_batch_size"],
            parallel_context=context,
        )
        reader = _Recording(iter(loaders.train))
        report = {"dp": context.dp_rank, "cp": context.cp_rank, "reader": [], "local": [], "match": []}
        report.update(valid=0, delivered=0, seconds=0.0, digests=[])
        for _ in range(settings["steps"]):
            started = time.perf_counter()
            model_inputs, loss_inputs = loaders.get_batch(reader)
            report["seconds"] += time.perf_counter() - started
            local = (model_inputs["input_ids"], model_inputs["labels"], model_inputs["position_ids"])
            report["local"].append(list(local[0].shape))
            report["valid"] += int(loss_inputs["loss_mask"].sum())
            report["delivered"] += local[0].numel()
            gathered = [_gathered(tensor, context.cp_group, cp) for tensor in local] if cp > 1 else [[t] for t in local]
            if context.cp_rank == 0:
                batch = reader.last
                report["reader"].append(list(batch.input_ids.shape))
                report["digests"].append(hashlib.blake2b(batch.input_ids.numpy().tobytes()).hexdigest())
                report["match"].append(cp_slices_rebuild_batch(batch, list(zip(*gathered, strict=True))))
        reports = [None] * world_size
        dist.all_gather_object(reports, report)
        if rank == 0:
            results.put(reports)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def deliver_on_mesh(
    train_jsonl: str | os.PathLike,
    *,
    dp: int = 2,
    cp: int = 2,
    steps: int = 8,
    max_seq_len: int = MESH_MAX_SEQ_LEN,
    micro_batch_size: int = 2,
    cache_dir: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike = BUNDLED_TOKENIZER_PATH,
) -> MeshDelivery:
    """Spawn ``dp * cp`` gloo ranks on 127.0.0.1 that deliver ``steps`` Online micro-batches each, and check them.

    Every rank builds ``mesh_pipeline_config(train_jsonl, max_seq_len, cache_dir)`` with ``build_dataloaders`` and
    a ``DataLoaderParallelContext`` of a ``("dp", "cp")`` device mesh, then calls its ``get_batch``; CP rank 0 of
    each DP rank gathers its group's slices and compares them with the batch its reader gave.

    Args:
        train_jsonl: JSON lines with a ``text`` field (``ExampleData.train_jsonl``).
        dp, cp: the mesh; ``dp * cp`` processes are started.
        steps: micro-batches per rank.
        max_seq_len: the plaintext transform's window; at least the longest record, which is one sample each.
        micro_batch_size: records per micro-batch, packed into one row.
        cache_dir: the Hugging Face ``datasets`` cache of the Online source (None: its default).
        tokenizer: the tokenizer path.

    Returns:
        What every rank saw (``MeshDelivery``).

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank failed (its traceback is in the message).
    """
    import torch.multiprocessing

    settings = {
        "dp": dp,
        "cp": cp,
        "steps": steps,
        "max_seq_len": max_seq_len,
        "micro_batch_size": micro_batch_size,
        "train_jsonl": str(train_jsonl),
        "cache_dir": None if cache_dir is None else str(cache_dir),
        "tokenizer": str(tokenizer),
    }
    world_size = dp * cp
    results = torch.multiprocessing.get_context("spawn").SimpleQueue()
    args = (world_size, _free_port(), settings, results)
    torch.multiprocessing.spawn(_mesh_rank, args=args, nprocs=world_size, join=True)
    reports = sorted(results.get(), key=lambda report: (report["dp"], report["cp"]))
    readers = [report for report in reports if report["cp"] == 0]
    digests = [reader["digests"] for reader in readers]
    return MeshDelivery(
        dp=dp,
        cp=cp,
        steps=steps,
        reader_shapes=tuple(tuple(shape) for reader in readers for shape in reader["reader"]),
        local_shapes=tuple(tuple(shape) for report in reports for shape in report["local"]),
        slices_match=tuple(all(reader["match"]) and len(reader["match"]) == steps for reader in readers),
        dp_ranks_differ=all(len(set(step)) == len(step) for step in zip(*digests, strict=True)),
        valid_tokens=sum(report["valid"] for report in reports),
        delivered_tokens=sum(report["delivered"] for report in reports),
        seconds=max(report["seconds"] for report in reports),
    )


def _mesh(data: ExampleData, cache_dir: Path, dp: int, cp: int, steps: int) -> StageStats:
    print(
        f"\n8/{STEPS} delivering Online batches on a spawned gloo mesh, DP{dp} x CP{cp} ({dp * cp} processes), two "
        "whole passages per micro-batch:\n  every rank builds the pipeline with build_dataloaders and a "
        "DataLoaderParallelContext, and calls its get_batch (ParallelBatch, packed attention, zigzag_thd)"
    )
    started = time.perf_counter()
    with _quiet_progress_bars():
        delivery = deliver_on_mesh(data.train_jsonl, dp=dp, cp=cp, steps=steps, cache_dir=cache_dir)
    reader = StageStats("reader", list(delivery.reader_shapes))
    local = delivery.stats()
    print(
        f"  {steps} micro-batches per rank in {time.perf_counter() - started:.1f} s (starting the processes included)\n"
        f"  each DP rank's reader gave input_ids {reader.shape_text}; each CP rank received {local.shape_text}"
    )
    for dp_rank, match in enumerate(delivery.slices_match):
        verdict = "equal the reader's batch" if match else "DIFFER from the reader's batch"
        print(f"  DP rank {dp_rank}: the {cp} CP slices, put back at their position_ids, {verdict} (every step)")
    print(f"  the DP ranks read different batches: {'yes' if delivery.dp_ranks_differ else 'NO'}")
    if not all(delivery.slices_match) or not delivery.dp_ranks_differ:
        raise RuntimeError("the mesh did not deliver the readers' batches exactly once")
    return local


# -- the whole story ----------------------------------------------------------------------------------------------


def _display(path: Path) -> str:
    """``path`` relative to the working directory when it is inside it (what a user would type)."""
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    return str(path)


def run_quickstart(
    output_dir: str | os.PathLike,
    workers: int,
    preview_chars: int = 600,
    seq_length: int = 512,
    *,
    batches: int = 16,
    dp: int = 2,
    cp: int = 2,
) -> int:
    """Run every step (see the module docstring), printing as it goes; returns 0.

    Args:
        output_dir: where the example data and caches go.
        workers: tokenizer processes of the offline preparation.
        preview_chars: characters of the first document shown.
        seq_length: tokens per Indexed sample and per Online window.
        batches: micro-batches measured per stage (and per rank on the mesh).
        dp, cp: the mesh of step 8.

    Raises:
        RuntimeError: a restored loader or the mesh did not deliver what was expected.
    """
    output_dir = Path(output_dir)
    started = time.perf_counter()
    data = _prepare(output_dir, workers)
    reader = _verify(data)
    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    _decode_first(reader, tokenizer, preview_chars)
    cache = output_dir / "index_cache"
    online_cache = output_dir / "online_cache"
    stages = [
        _indexed(data, cache, tokenizer, seq_length, batches),
        _blend(data, cache, tokenizer, seq_length, batches),
        _online(data, online_cache, tokenizer, seq_length, batches),
    ]
    _conversation(data, tokenizer)
    stages.append(_mesh(data, online_cache, dp, cp, batches))
    print("\nwhat each stage delivered (efficiency: tokens that carry a loss / tokens delivered, padding included):")
    print(stage_table(stages))
    print(f"\ndone in {time.perf_counter() - started:.1f} s")
    print("\n" + closing_hints(data.corpus_prefix))
    return 0


def _installed(name: str) -> str:
    """The command ``name`` of the environment running this (``.venv/bin/hp-data`` after the README's set-up), so
    that every hint runs as printed; the interpreter's own path is not resolved, which would leave the venv."""
    return f"{_display(Path(sys.executable).parent)}/{name}"


def _python() -> str:
    """The interpreter running this, as ``python`` where its directory has one (every venv), as the docs write it."""
    bin_dir = Path(sys.executable).parent
    return _installed("python" if (bin_dir / "python").exists() else Path(sys.executable).name)


def closing_hints(corpus_prefix: Path) -> str:
    """What to run next, after the quickstart wrote its example data with ``corpus_prefix`` as the corpus pair."""
    hp_data, python = _installed("hp-data"), _python()
    tokenizer_path = _display(BUNDLED_TOKENIZER_PATH)
    return (
        "next:\n"
        f"  {hp_data} inspect {_display(corpus_prefix)} --decode 1 --tokenizer {tokenizer_path}\n"
        f"  {hp_data} preview examples/online_mapping_dynamic.yaml --tokenizer {tokenizer_path}\n"
        "      (from the repository root: the configs under examples/ read quickstart_output/, the default output)\n"
        f"  {python} examples/train_tiny_gpt.py   (a small GPT trained on DP2 x CP2 gloo ranks; --config takes any "
        "of examples/*.yaml)\n"
        f"  {hp_data} prepare --help   (tokenize your own files)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hp-data quickstart", description=__doc__.split("Owns:")[0])
    parser.add_argument(
        "--output-dir", default="quickstart_output", help="where to write (default: ./quickstart_output)"
    )
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="tokenizer processes")
    parser.add_argument("--seq-length", type=int, default=512, help="tokens per sample and window (default: 512)")
    parser.add_argument("--batches", type=int, default=16, help="micro-batches per stage and rank (default: 16)")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks of the mesh in step 8 (default: 2)")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel ranks of the mesh in step 8 (default: 2)")
    args = parser.parse_args(argv)
    for name in ("workers", "seq_length", "batches", "dp", "cp"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return run_quickstart(
        args.output_dir, args.workers, seq_length=args.seq_length, batches=args.batches, dp=args.dp, cp=args.cp
    )


if __name__ == "__main__":
    sys.exit(main())
