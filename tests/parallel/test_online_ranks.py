"""Online mapping sources across real gloo ranks: rank 0 writes the Arrow cache, DP ranks split each global batch."""

from __future__ import annotations

import functools
import json

from hyper_parallel.data.batching import FixedBatchDataLoader
from hyper_parallel.data.text.build_dataset import build_online_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from parallel.launch import launch

WORLD_SIZE = 2


def rank_batches(rank: int, world_size: int, data_path: str, cache: str, micro_batch_size: int = 2):
    """Every rank builds the same mapping dataset and its own DP loader; returns its batches as token lists."""
    dataset = build_online_text_dataset(
        data_path,
        {"data_type": "plaintext", "max_seq_len": 256},
        {"dataset_type": "mapping", "cache_dir": cache},
        tokenizer=str(BUNDLED_TOKENIZER_PATH),
    )
    loader = FixedBatchDataLoader(
        dataset,
        micro_batch_size=micro_batch_size,
        global_batch_size=4,
        dp_rank=rank,
        dp_world_size=world_size,
        sampler_type="cyclic",
    )
    return [batch["input_ids"][0].tolist() for batch in loader]


def test_dp_ranks_share_one_cache_and_split_every_global_batch(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": f"sentence {i} " * (1 + i % 7)}) + "\n" for i in range(30)))
    cache = str(tmp_path / "hf_cache")
    reports = launch(functools.partial(rank_batches, data_path=str(path), cache=cache), tmp_path, WORLD_SIZE)
    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    single = rank_batches(0, 1, str(path), str(tmp_path / "single_cache"), micro_batch_size=4)
    # with one rank and micro batch 4, each batch is a whole global batch: rank 0's half followed by rank 1's
    per_rank = [r["value"] for r in reports]
    assert len(per_rank[0]) == len(per_rank[1]) == len(single) == 30 // 4
    for step, whole in enumerate(single):
        assert per_rank[0][step] + per_rank[1][step] == whole


def missing_on_rank_0(rank: int, world_size: int, directory: str):
    """Rank 0 opens a file that does not exist; the others would open a valid one."""
    del world_size
    path = f"{directory}/missing.jsonl" if rank == 0 else f"{directory}/present.jsonl"
    return len(
        build_online_text_dataset(
            path,
            {"data_type": "plaintext", "max_seq_len": 64},
            {"dataset_type": "mapping", "cache_dir": f"{directory}/cache"},
            tokenizer=str(BUNDLED_TOKENIZER_PATH),
        )
    )


def test_a_failure_on_rank_0_raises_on_every_rank(tmp_path):
    (tmp_path / "present.jsonl").write_text(json.dumps({"text": "a line"}) + "\n")
    reports = launch(functools.partial(missing_on_rank_0, directory=str(tmp_path)), tmp_path, WORLD_SIZE)
    assert reports[0]["error"]["type"] == "DataFileError" and "missing.jsonl" in reports[0]["error"]["message"]
    assert reports[1]["error"]["type"] == "DataFileError"
    assert "rank 0 failed to load the data" in reports[1]["error"]["message"]
