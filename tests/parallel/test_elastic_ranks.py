"""An elastic resume across real gloo ranks: 2 ranks gather their loader states, 3 new ranks share the rest."""

from __future__ import annotations

import functools
import json
from collections import Counter

import torch
import torch.distributed

from hyper_parallel.data.batching import DynamicBatchDataLoader, merge_rank_states
from hyper_parallel.data.mixture import build_mixture_dataset
from hyper_parallel.data.text.build_dataset import build_online_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from parallel.launch import launch


def rank_loader(rank: int, world_size: int, data_path: str, cache: str, dataset_type: str):
    dataset = build_online_text_dataset(
        data_path,
        {"data_type": "plaintext", "max_seq_len": 16},
        {"dataset_type": dataset_type, "cache_dir": cache, "shuffle_buffer_size": 8},
        tokenizer=str(BUNDLED_TOKENIZER_PATH),
        dp_rank=rank,
        dp_world_size=world_size,
    )
    options = {"micro_batch_size": 2, "global_batch_size": 2 * world_size, "drop_last": False}
    return DynamicBatchDataLoader(
        dataset, min_buffered_samples=4, dp_rank=rank, dp_world_size=world_size, sampler_type="cyclic", **options
    )


def sequences(batch) -> list[list[int]]:
    ids, bounds = batch["input_ids"][0].tolist(), batch["cu_seq_lens"].tolist()
    return [ids[start:end] for start, end in zip(bounds[:-1], bounds[1:], strict=True)]


def save_after_some_batches(
    rank: int, world_size: int, state_file: str, make_loader=None, batches: int = 3, **source
) -> list:
    """Each old rank reads ``batches`` plus its rank of batches (``make_loader``'s, default ``rank_loader``), the
    states are gathered, and rank 0 saves them merged."""
    loader = (make_loader or rank_loader)(rank, world_size, **source)
    delivered = []
    for taken, batch in enumerate(loader, start=1):
        delivered += sequences(batch)
        if taken == batches + rank:
            break
    states = [None] * world_size
    torch.distributed.all_gather_object(states, loader.state_dict())
    if rank == 0:
        torch.save(merge_rank_states(states), state_file)
    return delivered


def resume_from_merged(rank: int, world_size: int, state_file: str, **source) -> list:
    loader = rank_loader(rank, world_size, **source)
    loader.load_state_dict(torch.load(state_file, weights_only=True))
    return [sequence for batch in loader for sequence in sequences(batch)]


def test_two_gloo_ranks_hand_their_epoch_to_three(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": f"sentence {i} " * (1 + i % 9)}) + "\n" for i in range(40)))
    for dataset_type in ("mapping", "iterable"):
        source = {"data_path": str(path), "cache": str(tmp_path / "hf_cache"), "dataset_type": dataset_type}
        state_file = str(tmp_path / f"{dataset_type}.pt")
        before = launch(functools.partial(save_after_some_batches, state_file=state_file, **source), tmp_path, 2)
        after = launch(functools.partial(resume_from_merged, state_file=state_file, **source), tmp_path, 3)
        assert [r.get("error") for r in before + after] == [None] * 5
        delivered = Counter(tuple(s) for report in before + after for s in report["value"])
        whole = rank_loader(0, 1, **source)
        assert delivered == Counter(tuple(s) for batch in whole for s in sequences(batch)), dataset_type


def mixture_loader(rank: int, world_size: int, data_paths: list, cache: str):
    """A dynamic loader over a mixture of two Online files, every process building its own mixture."""
    sources = [
        {
            "name": f"part{number}",
            "weight": weight,
            "dataset": build_online_text_dataset(
                path,
                {"data_type": "plaintext", "max_seq_len": 16},
                {"cache_dir": cache},
                tokenizer=str(BUNDLED_TOKENIZER_PATH),
            ),
        }
        for number, (path, weight) in enumerate(zip(data_paths, (0.3, 0.7), strict=True))
    ]
    dataset = build_mixture_dataset(sources, on_exhausted="restart", num_samples=60, seed=2)
    options = {"micro_batch_size": 2, "global_batch_size": 2 * world_size, "drop_last": False}
    return DynamicBatchDataLoader(
        dataset, min_buffered_samples=4, dp_rank=rank, dp_world_size=world_size, sampler_type="cyclic", **options
    )


def mixture_resume(rank: int, world_size: int, state_file: str, **source) -> dict:
    loader = mixture_loader(rank, world_size, **source)
    loader.load_state_dict(torch.load(state_file, weights_only=True))
    delivered = [sequence for batch in loader for sequence in sequences(batch)]
    return {"delivered": delivered, "tally": loader.state_dict()["mixture"]["sources"]}


def test_two_gloo_ranks_hand_a_mixture_s_epoch_to_three(tmp_path):
    paths = []
    for number, count in enumerate((15, 25)):
        path = tmp_path / f"part{number}.jsonl"
        path.write_text(
            "".join(json.dumps({"text": f"part {number} line {i} " * (1 + i % 5)}) + "\n" for i in range(count))
        )
        paths.append(str(path))
    source = {"data_paths": paths, "cache": str(tmp_path / "hf_cache")}
    state_file = str(tmp_path / "mixture.pt")
    before = launch(
        functools.partial(
            save_after_some_batches, state_file=state_file, make_loader=mixture_loader, batches=2, **source
        ),
        tmp_path,
        2,
    )
    after = launch(functools.partial(mixture_resume, state_file=state_file, **source), tmp_path, 3)
    assert [r.get("error") for r in before + after] == [None] * 5
    delivered = Counter(tuple(s) for report in before for s in report["value"])
    delivered += Counter(tuple(s) for report in after for s in report["value"]["delivered"])
    whole = mixture_loader(0, 1, **source)
    assert delivered == Counter(tuple(s) for batch in whole for s in sequences(batch))
    # The new ranks' tallies continue the old ranks' sum: together, every sample of the mixture's epoch.
    samples = sum(counts["samples"] for report in after for counts in report["value"]["tally"].values())
    assert samples == 60
