"""The training example (examples/train_tiny_gpt.py) learns, resumes exactly, and feeds every rank its part.

Short runs of the example's own per-rank function on real gloo ranks, over the bundled corpus through the Online
path (the example's default pipeline), with a tiny model:

- run A trains ``STEPS`` steps on DP2 x CP2; run B trains ``SAVED_AT`` steps, saves, and new processes resume it
  to ``STEPS``. Their batches (every step's tokens, labels, positions and loss mask on every rank) and losses must
  be bit-identical, and A's loss must fall;
- A's CP slices, put together by an independent ``zigzag_thd`` reference (each sequence in four chunks, rank 0
  holding chunks 0 and 3), are the batches a loader of that DP rank reads, built here in one process;
- a DP2 x CP2 x TP2 run: the two TP ranks of every (DP, CP) coordinate train on identical batches, and the DP
  replicas on different ones.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from parallel.launch import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_tiny_gpt  # noqa: E402

from hyper_parallel.data.batching.dataloader import build_dataloaders  # noqa: E402
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH  # noqa: E402

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
