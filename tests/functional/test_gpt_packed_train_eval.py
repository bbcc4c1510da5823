"""A small GPT trains and evaluates on the packing scheduler's micro-batches: 4 gloo ranks, DP2 x CP2.

The counterpart of Megatron-Core's ``gpt_packed_train_eval`` functional test, on CPU. Synthetic pre-tokenized
records with seeded long-tailed lengths (prompt parts without loss, answers with loss) are written as JSONL and
read by the library's real Online loaders, built from a YAML-style pipeline whose ``packing_scheduler`` node
selects the scheduler. Every step, each rank wraps its loader's iterator with ``wrap_data_iterator`` and takes its
micro-batches with ``get_batch_on_this_rank_for_sequence_packing``; ``TinyGPT`` attends across the micro-batch's
CP group by all-gathering keys and values. Gradients are summed over every rank and divided by the step's loss
tokens, counted over every rank. Two modes, in one launch: static (``dp_balanced``, the fixed loader, CP 2) and
dynamic (``dynamic_cp`` with CP sizes 1 and 2, the dynamic loader).

What is checked, per mode: finite training and evaluation losses and gradient norms, the same on every rank;
equal micro-batch counts on every rank in every step; the CP sizes used (static: 2 only; dynamic: 1 and 2, in
training and in evaluation); evaluation over the whole validation split takes the loss on every one of its
loss-carrying labels exactly once (counted from the records written here); and a checkpoint (model, optimizer and
data-loader state, each rank's file renamed into place, then a completion marker) that loads into a fresh model,
optimizer and loader, the restored loader yielding the batch the running one yields next. No loss value is
claimed. Run it with ``.venv/bin/python -m pytest tests/functional/test_gpt_packed_train_eval.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from parallel.launch import launch
from torch.distributed.device_mesh import init_device_mesh

from hyper_parallel.data.batching.attention_runtime import packed_seq_params
from hyper_parallel.data.batching.data_schedule import get_batch_on_this_rank_for_sequence_packing, wrap_data_iterator
from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.parallel.batch_parallel import cp_local_columns
from hyper_parallel.data.parallel.process_groups import ProcessGroupCollection

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # the model of the training example
from tiny_gpt import TinyGPT, token_loss_sum  # noqa: E402

WORLD_SIZE = 4  # DP2 x CP2
VOCAB = 64
MAX_SEQLEN = 32  # max_seqlen_per_dp_cp_rank: a record longer than about 32 tokens needs CP 2
MICRO_BATCH_SIZE = 2  # records per fetched micro-batch (the dynamic loader: a token budget of 2 * 64)
NUM_MICROBATCHES = 2  # fetched per DP rank and step
TRAIN_STEPS = 3
TRAIN_RECORDS, VALID_RECORDS = 160, 24  # each DP rank's share of the validation split fills whole micro-batches
MODES = {
    "static": {"scheduler": "dp_balanced", "loader": "FixedBatchDataLoader", "options": {}, "dynamic_cp_sizes": ()},
    "dynamic": {
        "scheduler": "dynamic_cp",
        "loader": "DynamicBatchDataLoader",
        "options": {"min_buffered_samples": 8},
        "dynamic_cp_sizes": (1, 2),
    },
}


# -- data ---------------------------------------------------------------------------------------------------------


def records(count: int, seed: int) -> list[dict]:
    """Pre-tokenized records of long-tailed lengths (3 to 60 tokens); the first part is a prompt without loss."""
    rng = np.random.default_rng(seed)
    written = []
    for _ in range(count):
        length = int(np.clip(rng.lognormal(2.7, 0.7), 3, 60))
        ids = rng.integers(1, VOCAB, length)
        labels = ids.copy()
        labels[: int(rng.integers(1, length - 1))] = IGNORE_INDEX  # the prompt; at least one answer label is left
        written.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return written


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def loss_labels(rows: list[dict]) -> int:
    """Labels that carry loss after the identity transform's shift (``labels[1:]``)."""
    return sum(sum(label != IGNORE_INDEX for label in row["labels"][1:]) for row in rows)


def pipeline(directory: Path, mode: str) -> dict:
    return {
        "dataset": {
            "_target_": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
            "data_path": str(directory / "train.jsonl"),
            "data_transform": {
                "_target_": "hyper_parallel.data.text.build_data_transform.build_llm_data_transform",
                "data_type": "identity",
                "max_seq_len": 64,
            },
            "data_config": {"dataset_type": "iterable", "valid_data_path": str(directory / "valid.jsonl")},
        },
        "dataloader": {"_target_": f"hyper_parallel.data.batching.{MODES[mode]['loader']}", **MODES[mode]["options"]},
        "packing_scheduler": {
            "_target_": "hyper_parallel.data.parallel.data_schedule_utils.PackingSchedulerConfig",
            "max_seqlen_per_dp_cp_rank": MAX_SEQLEN,
            "scheduler": MODES[mode]["scheduler"],
        },
    }


# -- the ranks ----------------------------------------------------------------------------------------------------


def run_step(model, iterator, config, groups: ProcessGroupCollection, dynamic: bool, *, train: bool) -> dict:
    """One step's micro-batches on this rank: summed token loss and loss tokens, gradients accumulated (train)."""
    wrapped, count, _ = wrap_data_iterator(iterator, config, NUM_MICROBATCHES, pg_collection=groups)
    loss_sum, tokens, sizes = 0.0, 0, []
    for _ in range(count):
        batch = get_batch_on_this_rank_for_sequence_packing(wrapped, pg_collection=groups, dynamic_cp=dynamic)
        with torch.set_grad_enabled(train):
            loss = token_loss_sum(
                model(batch["tokens"], batch["position_ids"], batch["packed_seq_params"]), batch["labels"]
            )
            if train:
                loss.backward()  # every rank of the micro-batch's CP group runs it: the key/value gather's backward
        loss_sum += float(loss.detach())
        tokens += int(batch["loss_mask"].sum())
        sizes.append(batch["packed_seq_params"].local_cp_size)
    return {"count": count, "loss_sum": loss_sum, "tokens": tokens, "cp_sizes": sizes}


def global_sums(*values: float) -> list[float]:
    totals = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(totals)
    return totals.tolist()


def save_checkpoint(directory: Path, rank: int, state: dict) -> Path:
    """This rank's file, renamed into place; rank 0 marks the checkpoint complete once every rank's is."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{rank}.pt"
    partial = path.with_suffix(".pt.partial")
    torch.save(state, partial)
    os.replace(partial, path)
    dist.barrier()
    if rank == 0:
        marker = directory / "complete.json"
        marker.with_suffix(".partial").write_text(json.dumps({"ranks": dist.get_world_size()}), encoding="utf-8")
        os.replace(marker.with_suffix(".partial"), marker)
    dist.barrier()
    return path


def build(directory: Path, mode: str, groups: ProcessGroupCollection):
    return build_dataloaders(
        pipeline(directory, mode),
        micro_batch_size=MICRO_BATCH_SIZE,
        seed=7,
        pg_collection=groups,
    )


def train_and_evaluate(directory: str, modes: tuple[str, ...], rank: int, world_size: int) -> dict:
    """Train, checkpoint and evaluate in each of ``modes``, one after the other, on this rank."""
    directory = Path(directory)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    reports = {}
    for mode in modes:
        settings = MODES[mode]
        groups = ProcessGroupCollection.from_mesh(mesh, dynamic_cp_sizes=settings["dynamic_cp_sizes"])
        dynamic = settings["scheduler"] == "dynamic_cp"
        loaders = build(directory, mode, groups)
        torch.manual_seed(0)  # the same initial weights on every rank
        model = TinyGPT(VOCAB)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        report = {"loader": type(loaders.train).__name__, "train": [], "eval": None}
        train_iterator = iter(loaders.train)
        for _ in range(TRAIN_STEPS):
            optimizer.zero_grad(set_to_none=False)
            step = run_step(model, train_iterator, loaders.packing_scheduler, groups, dynamic, train=True)
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)  # every rank's tokens are distinct: the sum is the step's gradient
            loss_sum, tokens = global_sums(step["loss_sum"], step["tokens"])
            for parameter in model.parameters():
                parameter.grad /= tokens  # the mean over the step's loss tokens, wherever they were
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0))
            optimizer.step()
            report["train"].append({**step, "loss": loss_sum / tokens, "global_tokens": tokens, "grad_norm": grad_norm})

        saved = save_checkpoint(
            directory / f"checkpoint_{mode}",
            rank,
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "data": loaders.train.state_dict()},
        )
        report["checkpoint"] = check_checkpoint(directory, mode, groups, saved, model, optimizer, train_iterator)

        model.eval()
        loss_sum = tokens = 0.0
        valid_iterator, sizes, counts = iter(loaders.valid), [], []
        while True:
            try:
                step = run_step(model, valid_iterator, loaders.packing_scheduler, groups, dynamic, train=False)
            except StopIteration:  # every DP rank's validation data is over, on every rank at once
                break
            loss_sum, tokens = loss_sum + step["loss_sum"], tokens + step["tokens"]
            sizes += step["cp_sizes"]
            counts.append(step["count"])
        loss_sum, tokens = global_sums(loss_sum, tokens)
        report["eval"] = {"loss": loss_sum / tokens, "global_tokens": tokens, "cp_sizes": sizes, "counts": counts}
        reports[mode] = report
    return reports


def check_checkpoint(directory, mode, groups, saved: Path, model, optimizer, train_iterator) -> dict:
    """Load this rank's file into a fresh model, optimizer and loader; compare with the running ones."""
    state = torch.load(saved, weights_only=True)
    fresh = TinyGPT(VOCAB)
    fresh.load_state_dict(state["model"])
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    fresh_optimizer.load_state_dict(state["optimizer"])
    restored = build(directory, mode, groups).train
    restored.load_state_dict(state["data"])
    expected, resumed = next(train_iterator), next(iter(restored))  # the running loader's next batch is consumed
    return {
        "complete": (saved.parent / "complete.json").is_file() and not list(saved.parent.glob("*.partial")),
        "model_equal": all(
            torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
        ),
        "optimizer_steps": [float(s["step"]) for s in fresh_optimizer.state_dict()["state"].values()][:1],
        "optimizer_equal": all(
            torch.equal(optimizer.state[p]["exp_avg_sq"], fresh_optimizer.state[q]["exp_avg_sq"])
            for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
        ),
        "data_resumes": torch.equal(expected.input_ids, resumed.input_ids)
        and torch.equal(expected.labels, resumed.labels),
    }


# -- the test -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    directory = tmp_path_factory.mktemp("gpt_packed_train_eval")
    write_jsonl(directory / "train.jsonl", records(TRAIN_RECORDS, seed=1))
    write_jsonl(directory / "valid.jsonl", records(VALID_RECORDS, seed=2))
    found = launch(
        functools.partial(train_and_evaluate, str(directory), tuple(MODES)), directory, world_size=WORLD_SIZE
    )
    assert [report.get("error") for report in found] == [None] * WORLD_SIZE
    return [report["value"] for report in found]


@pytest.mark.parametrize("mode", list(MODES))
def test_training_and_evaluation_losses_and_gradient_norms_are_finite_and_agree_on_every_rank(reports, mode):
    runs = [report[mode] for report in reports]
    assert {run["loader"] for run in runs} == {MODES[mode]["loader"]}
    for step in range(TRAIN_STEPS):
        steps = [run["train"][step] for run in runs]
        assert len({s["count"] for s in steps}) == 1, "every rank runs the same number of micro-batches"
        assert steps[0]["count"] >= 1 and steps[0]["global_tokens"] > 0
        assert sum(s["tokens"] for s in steps) == steps[0]["global_tokens"]
        for name in ("loss", "grad_norm"):
            values = [s[name] for s in steps]
            assert all(math.isfinite(v) and v > 0 for v in values)
            assert max(values) - min(values) <= 1e-9 * max(values), f"{name} differs across ranks"
    evaluations = [run["eval"] for run in runs]
    assert all(math.isfinite(e["loss"]) and e["loss"] > 0 for e in evaluations)
    assert len({e["loss"] for e in evaluations}) == 1 and len({tuple(e["counts"]) for e in evaluations}) == 1


@pytest.mark.parametrize("mode", list(MODES))
def test_evaluation_covers_every_validation_label_once(reports, mode):
    expected = loss_labels(records(VALID_RECORDS, seed=2))
    assert {report[mode]["eval"]["global_tokens"] for report in reports} == {expected}


@pytest.mark.parametrize("mode", list(MODES))
def test_training_and_evaluation_run_the_expected_cp_sizes(reports, mode):
    """Static packing cuts every micro-batch across the CP group of 2; dynamic CP uses both sizes, in training and
    in evaluation."""
    expected = {2} if mode == "static" else {1, 2}
    trained = {size for report in reports for step in report[mode]["train"] for size in step["cp_sizes"]}
    evaluated = {size for report in reports for size in report[mode]["eval"]["cp_sizes"]}
    assert trained == expected and evaluated == expected


@pytest.mark.parametrize("mode", list(MODES))
def test_the_checkpoint_is_complete_and_loads_into_a_fresh_model_optimizer_and_loader(reports, mode):
    for report in reports:
        checkpoint = report[mode]["checkpoint"]
        assert checkpoint["complete"] and checkpoint["model_equal"] and checkpoint["optimizer_equal"]
        assert checkpoint["optimizer_steps"] == [float(TRAIN_STEPS)]
        assert checkpoint["data_resumes"], "the restored loader continues where the saved one stopped"


# -- the model's context parallelism --------------------------------------------------------------------------------


def cp2_against_cp1(rank: int, world_size: int) -> dict:
    """Logits and summed gradients of one packed micro-batch cut across CP 2, and of the whole on one rank."""
    bounds = np.array([0, 8, 12, 24], dtype=np.int32)  # three sequences, each a multiple of 2 * cp
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, VOCAB, (1, 24), generator=generator)
    labels = torch.randint(1, VOCAB, (1, 24), generator=generator)
    labels[0, :3] = labels[0, 9:12] = IGNORE_INDEX
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in np.diff(bounds)])).unsqueeze(0)
    torch.manual_seed(0)
    model = TinyGPT(VOCAB)
    whole = dataclasses.replace(packed_seq_params(bounds), cp_group=None, local_cp_size=1)
    whole_logits = model(tokens, positions, whole)
    token_loss_sum(whole_logits, labels).backward()
    whole_grads = [parameter.grad.clone() for parameter in model.parameters()]
    model.zero_grad()

    group = dist.new_group([0, 1])
    columns = torch.from_numpy(cp_local_columns("zigzag_thd", bounds, 1, 24, 2, rank)[0])
    cut = dataclasses.replace(packed_seq_params(bounds, cp_size=2), cp_group=group, local_cp_size=2)
    logits = model(tokens[:, columns], positions[:, columns], cut)
    token_loss_sum(logits, labels[:, columns]).backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
    return {
        "logits": float((logits - whole_logits[:, columns]).abs().max()),
        "grads": max(float((p.grad - g).abs().max()) for p, g in zip(model.parameters(), whole_grads, strict=True)),
        "scale": float(whole_logits.abs().max()),
    }


def test_the_model_cut_across_two_cp_ranks_computes_what_it_computes_on_one(tmp_path):
    """The reference for the model's CP attention: the same micro-batch on one rank, without any gather."""
    reports = launch(cp2_against_cp1, tmp_path, world_size=2)
    assert [report.get("error") for report in reports] == [None, None]
    for report in reports:
        value = report["value"]
        assert value["scale"] > 0.1
        assert value["logits"] < 1e-5 and value["grads"] < 1e-5, value
