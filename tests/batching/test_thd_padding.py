"""Per-sequence CP padding never changes a real token's output: the test model's THD attention, cut across real
gloo CP groups of 2 and 4 ranks, reads ``cu_seqlens_q`` (real tokens) over the layout of ``cu_seqlens_q_padded``,
and at every real token gives what the same model gives on that document alone (one document at a time, no
padding, no CP), under both tail padding policies."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from parallel.launch import launch

from hyper_parallel.data.batching.attention_runtime import packed_seq_params
from hyper_parallel.data.batching.build_collate_fn import build_online_text_collate_fn
from hyper_parallel.data.parallel.batch_parallel import cp_local_columns
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # the test model
from tiny_gpt import CPAttention, TinyGPT  # noqa: E402

VOCAB = 64
PAD = 7  # a real token id: were padding visible to a real token, its output would change
TAILS = ("append_dummy_seq", "extend_last")


def documents(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=int(n)) for n in rng.integers(1, 13, size=int(rng.integers(2, 6)))]


def alone(model: TinyGPT, document: np.ndarray) -> torch.Tensor:
    """Logits of one document on one rank, with a plain causal mask: the reference."""
    length = len(document)
    tokens = torch.from_numpy(document)[None]
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))[None]
    attention = CPAttention(None, torch.arange(length)[None], causal)
    return model(tokens, torch.arange(length)[None], attention)[0]


def packed_against_alone(rank: int, world_size: int) -> dict:
    """For three seeds and both tails: the largest gap between this rank's real tokens and each document alone."""
    group = dist.new_group(list(range(world_size)))
    layout = DeliveryLayout(cp_size=world_size, cp_layout="zigzag_thd")
    torch.manual_seed(0)
    model = TinyGPT(VOCAB)
    gap, checked, padded_sequences = 0.0, 0, 0
    for seed in range(3):
        docs = documents(seed)
        references = [alone(model, doc) for doc in docs]
        samples = [{"input_ids": doc, "labels": doc} for doc in docs]
        for tail in TAILS:
            collate = build_online_text_collate_fn(
                layout=layout, sequence_multiple=16, pad_token_id=PAD, position_ids=True, tail_padding=tail
            )
            batch = collate(samples)
            params = packed_seq_params(batch.cu_seq_lens, cu_seq_lens_real=batch.cu_seq_lens_real, cp_size=world_size)
            params = dataclasses.replace(params, cp_group=group, local_cp_size=world_size)
            total = batch.num_tokens
            columns = cp_local_columns("zigzag_thd", batch.cu_seq_lens, 1, total, world_size, rank)[0]
            with torch.no_grad():
                logits = model(batch.input_ids[:, columns], batch.position_ids[:, columns], params)[0]
            starts = np.cumsum([0, *(-(-len(doc) // (2 * world_size)) * 2 * world_size for doc in docs)])
            padded_sequences += sum(len(doc) % (2 * world_size) != 0 for doc in docs)
            for local, column in enumerate(columns.tolist()):
                doc = int(np.searchsorted(starts, column, side="right")) - 1
                if doc < len(docs) and column - starts[doc] < len(docs[doc]):  # a real token of document ``doc``
                    want = references[doc][column - starts[doc]]
                    gap = max(gap, float((logits[local] - want).abs().max()))
                    checked += 1
    return {"gap": gap, "checked": checked, "padded_sequences": padded_sequences}


@pytest.mark.parametrize("cp", [2, 4])
def test_padding_never_changes_a_real_tokens_output(tmp_path, cp):
    reports = launch(packed_against_alone, tmp_path, world_size=cp)
    assert [report.get("error") for report in reports] == [None] * cp
    real_tokens = sum(len(doc) for seed in range(3) for doc in documents(seed)) * len(TAILS)
    assert sum(report["value"]["checked"] for report in reports) == real_tokens  # every real token, once
    assert reports[0]["value"]["padded_sequences"] > 0  # the cases do pad sequences
    for report in reports:
        assert report["value"]["gap"] < 1e-5, report["value"]


def test_real_tokens_see_only_real_keys_and_padding_sees_only_padding():
    """Padded ``[0, 4, 12]``, real ``[0, 3, 9]`` on one rank: columns 3, 10 and 11 are padding; worked by hand."""
    params = packed_seq_params([0, 4, 12], cu_seq_lens_real=[0, 3, 9])
    may_attend = CPAttention.from_packed(params, 12).may_attend[0].int().tolist()
    visible = [[key for key, seen in enumerate(row) if seen] for row in may_attend]
    assert visible[:4] == [[0], [0, 1], [0, 1, 2], [3]]
    assert visible[4:10] == [list(range(4, q + 1)) for q in range(4, 10)]
    assert visible[10:] == [[10], [10, 11]]
