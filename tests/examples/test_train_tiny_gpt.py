"""The training example (examples/train_tiny_gpt.py) learns, resumes exactly, and feeds every rank its part.

Short runs of the example's own per-rank function on real gloo ranks, over the bundled corpus through the Online
path (the example's default pipeline), with a tiny model:

- run A trains ``STEPS`` steps on DP2 x CP2; run B trains ``SAVED_AT`` steps, saves, and new processes resume it
  to ``STEPS``. Their batches (every step's tokens, labels, positions and loss mask on every rank) and losses must
  be bit-identical, and A's loss must fall;
- A's CP slices, put together by an independent ``zigzag_thd`` reference (each sequence in four chunks, rank 0
  holding chunks 0 and 3), are the batches a loader of that DP rank reads, built here in one process;
- a DP2 x CP2 x TP2 run: the two TP ranks of every (DP, CP) coordinate train on identical batches, and the DP
  replicas on different ones;
- the model on ``ParallelBatch``'s micro-batches cut across CP 2, in each attention mode and layout it takes
  (packed ``zigzag_thd``, dense ``zigzag`` and ``contiguous``), gives the loss and gradients of the whole
  micro-batch on one rank; and a dense micro-batch of several rows gives each row's logits alone.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from parallel.launch import launch
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_tiny_gpt  # noqa: E402
from tiny_gpt import CPAttention, TinyGPT  # noqa: E402

from hyper_parallel.data.batching.attention_runtime import dense_attention_mask  # noqa: E402
from hyper_parallel.data.batching.dataloader import build_dataloaders  # noqa: E402
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext  # noqa: E402
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer  # noqa: E402

STEPS, SAVED_AT = 24, 10
SEQ_LEN, MICRO_BATCH_SIZE = 32, 2
EARLY_LATE = 5  # steps averaged at each end of run A
LOSS_DROP = 1.0  # nats between the early and late means; the run drops about 2 (from 9.1, ln 8192 = 9.01)
DEADLINE_S = 120.0


def arguments(tmp: Path, *extra: str) -> list[str]:
    small = ["--seq-len", str(SEQ_LEN), "--micro-batch-size", str(MICRO_BATCH_SIZE), "--width", "32", "--heads", "2"]
    return [*small, "--layers", "1", "--lr", "1e-2", "--cache-dir", str(tmp / "hf_cache"), "--quiet", *extra]


def run(tmp: Path, name: str, argv: list[str]) -> list[dict]:
    """Every rank's record of one run of the example (its per-rank function on a fresh set of gloo ranks)."""
    args = train_tiny_gpt.parse_args(argv)
    directory = tmp / name
    directory.mkdir()
    worker = functools.partial(train_tiny_gpt.run_rank, args, keep_batches=True)
    reports = launch(worker, directory, world_size=args.dp * args.cp * args.tp, deadline_s=DEADLINE_S)
    assert [report.get("error") for report in reports] == [None] * len(reports)
    return [report["value"] for report in reports]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("train_tiny_gpt")
    save_dir = tmp / "checkpoints"
    found = {"A": run(tmp, "A", arguments(tmp, "--steps", str(STEPS)))}
    found["B saved"] = run(tmp, "B1", arguments(tmp, "--steps", str(SAVED_AT), "--save-dir", str(save_dir)))
    found["checkpoint"] = sorted(path.relative_to(save_dir).as_posix() for path in save_dir.rglob("*"))
    found["latest"] = json.loads((save_dir / "latest.json").read_text(encoding="utf-8"))
    resumed = arguments(tmp, "--steps", str(STEPS), "--save-dir", str(save_dir), "--resume")
    found["B resumed"] = run(tmp, "B2", resumed)
    found["TP"] = run(tmp, "TP", arguments(tmp, "--steps", "3", "--tp", "2"))
    found["tmp"] = tmp
    return found


def test_the_loss_falls_and_is_the_same_on_every_rank(runs):
    records = runs["A"]
    assert {(r["dp"], r["cp"], r["tp"]) for r in records} == {(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)}
    losses = records[0]["losses"]
    assert len(losses) == STEPS and all(r["losses"] == losses for r in records)
    early, late = np.mean(losses[:EARLY_LATE]), np.mean(losses[-EARLY_LATE:])
    assert early > 8.5, "an untrained model predicts about uniformly over 8192 tokens"
    assert early - late > LOSS_DROP, losses


def test_a_resumed_run_trains_on_the_same_batches_with_the_same_losses(runs):
    uninterrupted, saved, resumed = runs["A"], runs["B saved"], runs["B resumed"]
    assert runs["latest"]["step"] == SAVED_AT
    steps = f"step_{SAVED_AT:07d}"
    assert runs["checkpoint"] == ["latest.json", steps, *(f"{steps}/{f}" for f in sorted(
        ["trainer.pt", "data_rank0.pt", "data_rank1.pt", "data_rank2.pt", "data_rank3.pt"]))]  # fmt: skip
    for a, first, second in zip(uninterrupted, saved, resumed, strict=True):
        assert (first["first_step"], second["first_step"]) == (0, SAVED_AT)
        assert len(set(a["digests"])) == STEPS, "every step trains on other data"
        assert first["digests"] + second["digests"] == a["digests"]
        assert first["losses"] + second["losses"] == a["losses"]  # exactly: the same weights, optimizer and data


def zigzag_halves(cu_seq_lens: list[int]) -> list[np.ndarray]:
    """For CP 2, the global columns each rank holds: every sequence in 4 chunks, rank r its chunks r and 3 - r."""
    held = [[], []]
    for start, end in zip(cu_seq_lens[:-1], cu_seq_lens[1:], strict=True):
        chunks = np.array_split(np.arange(start, end), 4)
        for rank in (0, 1):
            held[rank] += [chunks[rank], chunks[3 - rank]]
    return [np.concatenate(columns) for columns in held]


def test_the_cp_slices_put_together_are_the_batches_the_reader_reads(runs):
    by_place = {(r["dp"], r["cp"]): r["batches"] for r in runs["A"]}
    cache_dir = str(runs["tmp"] / "hf_cache")
    for dp_rank in (0, 1):
        reader = build_dataloaders(
            train_tiny_gpt.default_pipeline(SEQ_LEN, cache_dir),
            tokenizer=BUNDLED_TOKENIZER_PATH,
            micro_batch_size=MICRO_BATCH_SIZE,
            dp_rank=dp_rank,
            dp_world_size=2,
            cp_size=2,
        ).train
        for step, batch in zip(range(STEPS), reader, strict=False):
            bounds = batch.cu_seq_lens.tolist()
            starts = np.repeat(bounds[:-1], np.diff(bounds))
            positions = np.arange(bounds[-1]) - starts  # the distance from the start of the sequence
            for cp_rank, columns in enumerate(zigzag_halves(bounds)):
                delivered = by_place[dp_rank, cp_rank][step]
                assert delivered["input_ids"] == [batch.input_ids[0, columns].tolist()]
                assert delivered["labels"] == [batch.labels[0, columns].tolist()]
                assert delivered["position_ids"] == [positions[columns].tolist()]


def test_tp_peers_train_on_identical_batches(runs):
    records = runs["TP"]
    assert len(records) == 8
    places = {}
    for record in records:
        places.setdefault((record["dp"], record["cp"]), []).append(record)
    assert sorted(places) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for peers in places.values():
        assert sorted(r["tp"] for r in peers) == [0, 1]
        assert peers[0]["batches"] == peers[1]["batches"] and peers[0]["digests"] == peers[1]["digests"]
    assert places[0, 0][0]["digests"] != places[1, 0][0]["digests"], "the DP replicas read other data"
    assert all(r["losses"] == records[0]["losses"] for r in records)


# -- the model on every delivery mode -------------------------------------------------------------------------------

DELIVERY = [("packed", "zigzag_thd"), ("dense", "zigzag"), ("dense", "contiguous")]


def loss_and_gradients(model, model_inputs, loss_inputs, cp_layout: str, cp_group) -> tuple[float, torch.Tensor]:
    """The summed loss and flat gradients of one micro-batch, summed over the CP group."""
    model.zero_grad()
    attention = CPAttention.from_model_inputs(model_inputs, cp_layout=cp_layout, cp_group=cp_group)
    logits = model(model_inputs["input_ids"], model_inputs["position_ids"], attention)
    loss, _ = train_tiny_gpt.masked_loss_sum(logits, loss_inputs)
    loss.backward()
    summed = torch.cat([loss.detach().reshape(1), *(p.grad.flatten() for p in model.parameters())])
    if cp_group is not None:
        dist.all_reduce(summed, group=cp_group)
    return float(summed[0]), summed[1:]


def delivery_against_one_rank(cache_dir: str, rank: int, world_size: int) -> dict:
    """Per delivery mode: the first micro-batch cut across CP 2 against the same micro-batch whole on one rank."""
    context = DataLoaderParallelContext.from_mesh(init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)))
    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    torch.manual_seed(0)
    model = TinyGPT(8192, width=32, heads=2, layers=2)
    found = {}
    for mode, layout in DELIVERY:
        config = train_tiny_gpt.default_pipeline(SEQ_LEN, cache_dir)
        config["get_batch"].update(attention_mode=mode, cp_layout=layout)
        cut = build_dataloaders(config, tokenizer=tokenizer, micro_batch_size=4, parallel_context=context)
        whole = build_dataloaders(config, tokenizer=tokenizer, micro_batch_size=4, cp_size=2)  # the same rows
        read = next(iter(whole.train))
        whole_loss, whole_grads = loss_and_gradients(model, *whole.get_batch(iter([read])), layout, None)
        model_inputs, loss_inputs = cut.get_batch(iter(cut.train))
        loss, grads = loss_and_gradients(model, model_inputs, loss_inputs, layout, context.cp_group)
        found[f"{mode} {layout}"] = {
            "local_tokens": model_inputs["input_ids"].shape[1],
            "sequences": len(read.cu_seq_lens) - 1,
            "loss": [loss, whole_loss],
            "grads": float((grads - whole_grads).abs().max()),
            "grad_scale": float(whole_grads.abs().max()),
        }
    return found


def test_the_model_cut_across_cp_computes_the_whole_micro_batch_in_every_delivery_mode(runs):
    directory = runs["tmp"] / "delivery"
    directory.mkdir()
    reports = launch(functools.partial(delivery_against_one_rank, str(runs["tmp"] / "hf_cache")), directory, 2)
    assert [report.get("error") for report in reports] == [None, None]
    for name in (f"{mode} {layout}" for mode, layout in DELIVERY):
        for report in reports:
            value = report["value"][name]
            assert value["sequences"] >= 2, "a micro-batch of several windows: attention must not cross them"
            loss, whole_loss = value["loss"]
            assert whole_loss > 100 and abs(loss - whole_loss) <= 1e-5 * whole_loss, (name, value)
            assert value["grad_scale"] > 1e-3 and value["grads"] <= 1e-4 * value["grad_scale"], (name, value)


def test_a_dense_micro_batch_of_several_rows_gives_each_rows_logits_alone():
    """Rows are independent: two rows with their own documents give what each row gives on its own."""
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (2, 12), generator=generator)
    bounds = np.array([0, 5, 12, 15, 24])  # row 0: documents of 5 and 7 tokens; row 1: of 3 and 9
    columns = np.tile(np.arange(12), (2, 1))
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in np.diff(bounds)]).reshape(2, 12))
    mask, _ = dense_attention_mask(bounds, columns, 12, causal=True)
    torch.manual_seed(0)
    model = TinyGPT(64)

    def logits(rows: slice, row_mask: torch.Tensor) -> torch.Tensor:
        model_inputs = {"input_ids": tokens[rows], "attention_mask": row_mask, "packed_seq_params": None}
        attention = CPAttention.from_model_inputs(model_inputs, cp_layout="contiguous", cp_group=None)
        return model(tokens[rows], positions[rows], attention)

    both = logits(slice(0, 2), mask)
    for row in (0, 1):
        alone = logits(slice(row, row + 1), mask[row : row + 1])
        torch.testing.assert_close(both[row : row + 1], alone, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(both[0], both[1])


def summary_of(losses: list[float], first_step: int = 0) -> str:
    return train_tiny_gpt.summary({"losses": losses, "first_step": first_step, "tokens": 1024, "seconds": 2.0})


@pytest.mark.parametrize(
    ("steps", "window"), [(2, 1), (3, 1), (4, 2), (19, 9), (20, 10), (21, 10), (300, 10)]
)  # fmt: skip
def test_the_summary_compares_the_first_and_last_steps_in_windows_that_never_overlap(steps, window):
    losses = [float(step) for step in range(steps)]  # each step's loss is its index: a mean names its steps
    line = summary_of(losses)
    first, last = np.mean(losses[:window]), np.mean(losses[-window:])
    assert losses[window - 1] < losses[-window], "the windows share no step"
    unit = "step" if window == 1 else f"{window} steps"
    assert f"mean loss {first:.3f} over the first {unit} -> {last:.3f} over the last {unit};" in line, line
    assert line.startswith(f"steps 0-{steps}: ") and line.endswith("1,024 tokens in 2.0 s, 512 tokens/s")


def test_the_summary_of_a_one_step_run_says_there_is_nothing_to_compare():
    line = summary_of([8.403], first_step=100)
    assert line.startswith("steps 100-101: loss 8.403 at its only step, nothing to compare;"), line
    assert "->" not in line
