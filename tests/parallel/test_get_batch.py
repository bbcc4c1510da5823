"""Multi-process specification of ParallelBatch: real pipelines delivering to real gloo ranks in DP x CP x TP grids.

Every rank builds the same pipeline with ``build_dataloaders(..., parallel_context=...)`` (loaders on the data ranks
only) and calls its ``get_batch`` until the data ends. The data ranks record the reader's batch they pulled and
compare every field they deliver with the plain reference of ``batching/get_batch_reference.py``; every rank reports
a digest of its fields and its local tokens with their positions. The test then checks, across ranks: TP peers
hold identical tensors, the CP slices put together by their positions are the reader's batch, and every rank of a
TP group stopped at the same call. Many cases run inside one launch, so the processes start once per grid.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from batching.get_batch_reference import check_rank, expected_fields, flex_mask_values, indexed_boundaries
from batching.test_pipeline_get_batch import Recording, design_config, write_documents

from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.batching.delivery_plan import prepare_delivery
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer
from parallel.launch import grid_coordinates, grid_groups, launch

MAX_STEPS = 40  # a loader that never ends fails the case instead of the deadline
BUNDLED_CORPUS = Path(BUNDLED_TOKENIZER_PATH).parent / "corpus" / "austen_chapters.jsonl.gz"


# -- data ---------------------------------------------------------------------------------------------------------


def short_texts(count: int) -> list[str]:
    """``count`` texts of 2 to 18 words, cut from the bundled novels' paragraphs."""
    texts, rng = [], np.random.default_rng(0)
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as lines:
        for line in lines:
            for paragraph in json.loads(line)["text"].split("\n\n"):
                words = paragraph.split()
                if len(words) >= 2:
                    texts.append(" ".join(words[: int(rng.integers(2, 19))]))
                if len(texts) == count:
                    return texts
    raise AssertionError("the bundled corpus has fewer paragraphs than asked")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """A JSONL of 24 short texts (one bad record in a copy of it), an Indexed corpus of them with EODs, and one of
    about 1M tokens for the design's Indexed config (seq_length 4096, split "98, 1, 1": two samples in each 1 %
    split, one per DP rank)."""
    root = tmp_path_factory.mktemp("get_batch_data")
    texts = short_texts(24)
    good, bad = root / "train.jsonl", root / "bad.jsonl"
    good.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    records = [{"text": text} for text in texts]
    records[9] = {"text": ["not", "a", "string"]}  # read by DP rank 1 at its third step
    bad.write_text("".join(json.dumps(record) + "\n" for record in records))
    prefix = root / "corpus_text_document"
    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for text in texts:
        ids = [*tokenizer.encode(text), tokenizer.eos_token_id]
        builder.add_document(np.asarray(ids), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    documents = write_documents(root / "documents_text_document", count=10_000, eod=tokenizer.eos_token_id)
    paths = {"online": str(good), "bad": str(bad), "indexed": str(prefix), "documents": documents}
    return paths | {"cache": str(root / "cache")}


def pipeline_config(case: dict, data: dict) -> dict:
    """The pipeline of ``case``: an Online (mapping or iterable, fixed or dynamic loader) or Indexed source, or one
    of the design's configs as written there."""
    if "design" in case:
        path = data["online" if case["design"] == "online" else "documents"]
        return design_config(case["design"], path, Path(data["cache"]) / case["design"])
    get_batch = {"_target_": "hyper_parallel.data.batching.ParallelBatch", "source_type": case["source"]}
    get_batch |= {key: case[key] for key in ("cp_layout", "attention_mode") if key in case} | case.get("settings", {})
    if case["source"] == "indexed":
        return {
            "dataset": {
                "_target_": "hyper_parallel.data.text.build_dataset.build_indexed_text_dataset",
                "data_path": data["indexed"],
                "data_config": {"seq_length": 16, "split": "100, 0, 0", "data_cache_path": data["cache"]},
            },
            "dataloader": {"_target_": "hyper_parallel.data.batching.FixedBatchDataLoader"},
            "collate_fn": {"_target_": "hyper_parallel.data.batching.build_indexed_collate_fn"},
            "get_batch": get_batch,
        }
    dynamic = case.get("loader") == "dynamic"
    return {
        "dataset": {
            "_target_": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
            "data_path": data[case.get("path", "online")],
            "data_transform": {
                "_target_": "hyper_parallel.data.text.build_data_transform.build_llm_data_transform",
                "data_type": "plaintext",
                "text_keys": "text",
                "max_seq_len": 16 if dynamic else 64,
            },
            "data_config": {"dataset_type": case.get("dataset_type", "mapping"), "cache_dir": data["cache"]},
        },
        "dataloader": {
            "_target_": f"hyper_parallel.data.batching.{'Dynamic' if dynamic else 'Fixed'}BatchDataLoader",
            **({"min_buffered_samples": 4} if dynamic else {}),
        },
        "collate_fn": {"_target_": "hyper_parallel.data.batching.build_online_text_collate_fn"},
        "get_batch": get_batch,
    }


# -- what each rank does ------------------------------------------------------------------------------------------


def grid_context(
    rank: int, world_size: int, grid: tuple[int, int, int], mesh: bool = False
) -> DataLoaderParallelContext:
    """This rank's context in a DP x CP x TP grid (TP fastest), read from a ``DeviceMesh`` or from process groups
    (every rank creates every group, in one order)."""
    if mesh:
        from torch.distributed.device_mesh import init_device_mesh

        names = [name for name, size in zip(("dp", "cp", "tp"), grid, strict=True) if size > 1]
        shape = tuple(size for size in grid if size > 1)
        return DataLoaderParallelContext.from_mesh(init_device_mesh("cpu", shape, mesh_dim_names=tuple(names)))
    groups = {}
    for axis, name in enumerate(("dp", "cp", "tp")):
        if grid[axis] == 1:
            continue
        for ranks in grid_groups(world_size, grid, axis):
            group = torch.distributed.new_group(ranks)
            if rank in ranks:
                groups[f"{name}_group"] = group
    return DataLoaderParallelContext.from_groups(**groups)


def digest(model_inputs: dict, loss_inputs: dict) -> str:
    """A digest of every field a rank holds (a BlockMask by the mask it computes)."""
    hasher = hashlib.sha256()
    for name, value in [*model_inputs.items(), *loss_inputs.items()]:
        if value is None:
            hasher.update(f"{name}:none".encode())
            continue
        if not isinstance(value, torch.Tensor):
            value = flex_mask_values(value) if name == "attention_mask" else torch.tensor(
                [getattr(value, field).tolist() if isinstance(getattr(value, field), torch.Tensor) else
                 getattr(value, field) for field in ("max_seqlen_q", "max_seqlen_kv")]
            )  # fmt: skip
        hasher.update(f"{name}:{value.dtype}:{list(value.shape)}".encode())
        hasher.update(value.contiguous().view(torch.uint8).numpy().tobytes())
    if model_inputs["packed_seq_params"] is not None:
        packed = model_inputs["packed_seq_params"]
        hasher.update(b"".join(getattr(packed, f).numpy().tobytes() for f in ("cu_seqlens_q", "cu_seqlens_kv_padded")))
    return hasher.hexdigest()


def check_against_reference(get_batch, reader, model_inputs, loss_inputs) -> None:
    """On a data rank: every delivered field equals the plain reference for this rank's CP coordinate."""
    ids, labels = reader.input_ids.tolist(), reader.labels.tolist()
    if get_batch.source_type == "online":
        bounds = reader.cu_seq_lens.tolist()
    else:
        bounds = indexed_boundaries(ids, labels, get_batch.eod_token_id)
    expected = expected_fields(
        ids, labels, bounds, cp=get_batch.context.cp_size, rank=get_batch.context.cp_rank, layout=get_batch.cp_layout,
        causal=get_batch.causal, window=get_batch.sliding_window, reset_position_ids=get_batch.reset_position_ids,
        eod_mask_loss=get_batch.eod_mask_loss, eod=get_batch.eod_token_id,
        real=None if reader.cu_seq_lens_real is None else reader.cu_seq_lens_real.tolist(),
    )  # fmt: skip
    check_rank(model_inputs, loss_inputs, expected, get_batch.attention_mode, get_batch.sliding_window)


def deliver(case: dict, data: dict, context: DataLoaderParallelContext, tokenizer) -> dict:
    """Build the case's pipeline on this rank and deliver every batch; what the test compares across ranks."""
    config = pipeline_config(case, data)
    micro_batch_size = case.get("micro_batch_size", 2)
    loaders = build_dataloaders(
        config, tokenizer=tokenizer, micro_batch_size=micro_batch_size, parallel_context=context
    )
    get_batch = loaders.get_batch
    assert (loaders.train is not None) == context.is_data_rank
    iterator = None
    if context.is_data_rank:  # "prepared": the metadata computed beside the loader, as a collator with the plan does
        batches = iter(loaders.train)
        if case.get("prepared"):
            batches = (prepare_delivery(batch, get_batch.delivery_plan) for batch in batches)
        iterator = Recording(batches)
    steps, limit = [], case.get("steps", MAX_STEPS)
    while len(steps) < limit:
        try:
            model_inputs, loss_inputs = get_batch(iterator)
        except StopIteration:
            return {"steps": steps}
        step = {
            "digest": digest(model_inputs, loss_inputs),
            "input_ids": model_inputs["input_ids"].tolist(),
            "columns": None,
        }
        if not get_batch.reset_position_ids:
            step["columns"] = model_inputs["position_ids"].tolist()  # the global columns of the local tokens
        if context.is_data_rank:
            if case.get("reference", True):
                check_against_reference(get_batch, iterator.last, model_inputs, loss_inputs)
            step["reader"] = iterator.last.input_ids.tolist()
        steps.append(step)
    if "steps" in case:
        return {"steps": steps}
    raise AssertionError(f"the loader did not end within {MAX_STEPS} steps")


def deliver_cases(
    rank: int, world_size: int, *, grid: tuple[int, int, int], cases: list[dict], data: dict, mesh: bool = False
) -> list:
    context = grid_context(rank, world_size, grid, mesh)
    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    return [deliver(case, data, context, tokenizer) for case in cases]


# -- the cases and their checks -----------------------------------------------------------------------------------


def cases_for(cp: int) -> list[dict]:
    """Every source with every layout and attention mode a CP size of ``cp`` takes (packed needs zigzag_thd)."""
    cases = []
    for source, extra in [("online", {}), ("online", {"dataset_type": "iterable"}), ("indexed", {})]:
        layouts = ["contiguous", "zigzag"] + (["zigzag_thd"] if source == "online" else [])
        for layout in layouts:
            modes = ["dense", "flex", "none"] + (["packed"] if layout == "zigzag_thd" else [])
            for mode in modes:
                cases.append({"source": source, "cp_layout": layout, "attention_mode": mode, **extra})
    return cases


# The design's Online mapping + dynamic batch config (one batch of all 24 texts per DP rank), and its Indexed
# variable-length documents config for three steps of 4096-token rows (too long for the Python reference: the TP
# digests and the CP slices are checked).
DESIGN_CASES = [{"design": "online"}, {"design": "indexed", "micro_batch_size": 1, "steps": 3, "reference": False}]


# Batches that carry the data rank's metadata (Batch.delivery): its TP peers, which compute theirs from the relayed
# boundaries, must hold the same fields (the digests), and the data rank the reference's.
PREPARED_CASES = [
    {"source": "online", "cp_layout": "zigzag_thd", "attention_mode": "packed", "prepared": True},
    {"source": "online", "cp_layout": "zigzag", "attention_mode": "flex", "prepared": True},
    {"source": "indexed", "cp_layout": "contiguous", "attention_mode": "dense", "prepared": True},
]


def check_reports(reports: list[dict], grid: tuple[int, int, int], cases: list[dict]) -> None:
    world_size = len(reports)
    errors = [(r["rank"], r.get("error")) for r in reports if r.get("error")]
    assert not errors, errors
    place = {rank: grid_coordinates(rank, world_size, grid) for rank in range(world_size)}
    for index, case in enumerate(cases):
        results = {r["rank"]: r["value"][index] for r in reports}
        for tp_group in grid_groups(world_size, grid, axis=2):
            # every TP rank delivers the same batches and stops at the same call
            counts = {rank: len(results[rank]["steps"]) for rank in tp_group}
            assert len(set(counts.values())) == 1 and min(counts.values()) > 0, (case, counts)
            digests = {rank: [s["digest"] for s in results[rank]["steps"]] for rank in tp_group}
            assert all(d == digests[tp_group[0]] for d in digests.values()), (case, tp_group)
        for cp_group in grid_groups(world_size, grid, axis=1):
            if place[cp_group[0]][2] != 0:
                continue  # the data ranks of one DP rank, one per CP rank, are the CP group of TP rank 0
            readers = cp_group
            first = results[readers[0]]["steps"]
            for rank in readers:
                assert len(results[rank]["steps"]) == len(first), case
            for step, reference in enumerate(first):
                if reference["columns"] is None:
                    continue
                batch = torch.tensor(reference["reader"])
                together = torch.full_like(batch, -1)
                rows = torch.arange(batch.shape[0])[:, None]
                for rank in readers:
                    held = results[rank]["steps"][step]
                    assert held["reader"] == reference["reader"], case  # the CP ranks of a DP rank read one batch
                    columns = torch.tensor(held["columns"])
                    assert (together[rows, columns] == -1).all(), case  # no column held by two ranks
                    together[rows, columns] = torch.tensor(held["input_ids"])
                assert torch.equal(together, batch), (case, step)


@pytest.mark.parametrize(
    ("grid", "cases"),
    [
        pytest.param((2, 2, 2), cases_for(2) + DESIGN_CASES + PREPARED_CASES, id="dp2-cp2-tp2-mesh"),
        pytest.param(
            (2, 1, 2),
            [
                {"source": "online", "attention_mode": "dense"},
                {"source": "indexed", "attention_mode": "packed"},
                {"source": "online", "dataset_type": "iterable", "attention_mode": "flex", "loader": "dynamic"},
                {
                    "source": "online",
                    "attention_mode": "dense",
                    "settings": {"reset_position_ids": True, "sliding_window": 4},
                },
            ],
            id="dp2-tp2",
        ),  # fmt: skip
        pytest.param(
            (1, 4, 1),
            [
                {"source": "online", "cp_layout": layout, "attention_mode": mode}
                for layout, mode in [
                    ("contiguous", "dense"),
                    ("zigzag", "flex"),
                    ("zigzag_thd", "packed"),
                    ("zigzag_thd", "dense"),
                ]
            ]
            + [
                {
                    "source": "indexed",
                    "cp_layout": "zigzag",
                    "attention_mode": "dense",
                    "settings": {"eod_mask_loss": True},
                }
            ],
            id="cp4",
        ),  # fmt: skip
    ],
)
def test_every_rank_delivers_its_part_of_the_readers_batch(tmp_path, data, grid, cases):
    worker = functools.partial(deliver_cases, grid=grid, cases=cases, data=data, mesh=grid == (2, 2, 2))
    reports = launch(worker, tmp_path, world_size=int(np.prod(grid)), deadline_s=120)
    check_reports(reports, grid, cases)


# -- a reader's failure --------------------------------------------------------------------------------------------


def deliver_until_failure(rank: int, world_size: int, *, data: dict) -> dict:
    """DP2 x TP2 over a file whose record 9 is not text: the DP rank whose share holds it fails when reading it."""
    context = grid_context(rank, world_size, (2, 1, 2))
    config = pipeline_config({"source": "online", "path": "bad", "attention_mode": "dense"}, data)
    tokenizer = str(BUNDLED_TOKENIZER_PATH)
    loaders = build_dataloaders(config, tokenizer=tokenizer, micro_batch_size=2, parallel_context=context)
    iterator = iter(loaders.train) if context.is_data_rank else None
    steps = 0
    try:
        while True:
            loaders.get_batch(iterator)
            steps += 1
    except StopIteration:
        return {"steps": steps, "ended": True}
    except Exception as error:  # noqa: BLE001 - what each rank raised is the result
        return {"steps": steps, "error": f"{type(error).__name__}: {error}"}


def test_a_readers_failure_raises_on_every_rank_of_its_tp_group_and_the_others_go_on(tmp_path, data):
    """The data rank raises the reader's error; its TP peer raises it too, in the same call, naming the data rank;
    the other DP rank's TP group reads on to the end of its data."""
    reports = launch(functools.partial(deliver_until_failure, data=data), tmp_path, world_size=4)
    values = [report["value"] for report in reports]
    failed = [tp_group for tp_group in ([0, 1], [2, 3]) if "error" in values[tp_group[0]]]
    assert len(failed) == 1, values
    (source, peer), (other, other_peer) = failed[0], [2, 3] if failed[0] == [0, 1] else [0, 1]
    assert values[source]["steps"] == values[peer]["steps"] < 6
    assert values[source]["error"].startswith("DataFileError: record 9 of ")
    assert "field 'text' holds list, expected a string" in values[source]["error"]
    relayed = values[peer]["error"]
    prefix = (
        f"DataFileError: global rank {source} (the data rank) failed to read the next batch (DataFileError: record 9"
    )
    assert relayed.startswith(prefix) and relayed.endswith(f"see rank {source}'s log"), relayed
    assert values[other] == values[other_peer] == {"steps": 6, "ended": True}
