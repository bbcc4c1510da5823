"""A small GPT in plain PyTorch that trains on packed THD micro-batches with (dynamic) context parallelism.

Owns: the model of the packed train/eval functional test: token embeddings, pre-norm blocks (causal multi-head
attention, MLP), rotary positions from ``position_ids``, and attention over one CP rank's ``zigzag_thd`` columns
that all-gathers keys and values over the micro-batch's CP group with autograd, so the gradients of keys and values
reach the rank that computed them. Masks come from the global ``cu_seq_lens`` and the local tokens' global
columns (``attention_runtime.dense_attention_mask``): a query sees the keys of its own sequence at or before it,
whichever rank holds them. Not responsible for: data, scheduling, the CP layout's arithmetic
(``parallel.batch_parallel.cp_local_columns``), or gradient reduction across ranks (the training loop's).

Example (one rank, one micro-batch from ``get_batch_on_this_rank_for_sequence_packing``)::

    model = TinyGPT(vocab_size=64)
    logits = model(batch["tokens"], batch["position_ids"], batch["packed_seq_params"])
    loss_sum = token_loss_sum(logits, batch["labels"])
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyper_parallel.data.batching.attention_runtime import PackedSeqParams, dense_attention_mask
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.parallel.batch_parallel import cp_local_columns

__all__ = ["TinyGPT", "gather_over_cp", "token_loss_sum"]

_LAYOUT = "zigzag_thd"


class _GatherOverGroup(torch.autograd.Function):
    """All-gather along a new first dimension; the backward sums every rank's gradient of this rank's slot.

    ``torch.distributed.nn.functional.all_gather`` emulates its backward on gloo with scatters addressed by group
    rank, which fails for a group that does not start at global rank 0; an all-reduce of the stacked gradients
    gives the same sum on any backend.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.rank = group, dist.get_rank(group)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def gather_over_cp(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every CP rank's ``tensor`` stacked in group-rank order ``[cp, ...]``, differentiable (``[1, ...]`` alone)."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor.unsqueeze(0)
    return _GatherOverGroup.apply(tensor, group)


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[s, heads, head_dim]`` at integer ``positions`` ``[s]``."""
    half = x.shape[-1] // 2
    frequencies = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * frequencies[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class _CPLayout:
    """One micro-batch's CP view on this rank: its group, the global columns of every rank, the local mask."""

    def __init__(self, params: PackedSeqParams, local_length: int) -> None:
        bounds = params.cu_seqlens_q.detach().cpu().numpy()
        total = int(bounds[-1])
        self.group = params.cp_group
        size = 1 if self.group is None else dist.get_world_size(self.group)
        if params.local_cp_size is not None and params.local_cp_size != size:
            raise ValueError(f"local_cp_size {params.local_cp_size} but the CP group holds {size} ranks")
        rank = 0 if self.group is None else dist.get_rank(self.group)
        columns = [cp_local_columns(_LAYOUT, bounds, 1, total, size, r)[0] for r in range(size)]
        if len(columns[rank]) != local_length:
            raise ValueError(f"this rank holds {local_length} tokens, but its columns are {len(columns[rank])}")
        # gathered keys arrive rank after rank; this order puts them back at their global columns
        self.key_order = torch.argsort(torch.from_numpy(np.concatenate(columns)))
        mask, _ = dense_attention_mask(bounds, columns[rank][None, :], total, causal=True)
        self.may_attend = mask[0, 0]  # [s, T], True = the query sees the key


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, layout: _CPLayout) -> torch.Tensor:
        s = x.shape[0]
        q, k, v = self.qkv(x).view(s, 3, self.heads, self.head_dim).unbind(1)
        q, k = _rotate(q, positions), _rotate(k, positions)
        keys = gather_over_cp(k, layout.group).flatten(0, 1)[layout.key_order]  # [T, heads, head_dim], global order
        values = gather_over_cp(v, layout.group).flatten(0, 1)[layout.key_order]
        scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~layout.may_attend[None], float("-inf"))  # every query sees at least itself
        attended = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)
        return self.out(attended.reshape(s, -1))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = _Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, layout: _CPLayout) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), positions, layout)
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """A decoder-only transformer for one packed THD micro-batch, cut across its CP group.

    Args:
        vocab_size: token ids are below it.
        width, heads, layers: the hidden size, attention heads (``width`` must divide by it, into an even head
            size for the rotary embedding) and blocks.
    """

    def __init__(self, vocab_size: int, *, width: int = 32, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        if width % heads or (width // heads) % 2:
            raise ValueError(f"width {width} must split into {heads} heads of an even size")
        self.embedding = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, params: PackedSeqParams) -> torch.Tensor:
        """Logits ``[1, s, vocab]`` of this rank's ``s`` tokens (``tokens`` and ``position_ids`` ``[1, s]``).

        ``params`` carries the global boundaries and the CP group the micro-batch is cut across (every rank of it
        must call ``forward``, and ``backward``, for the same micro-batch).
        """
        if tokens.shape[0] != 1:
            raise ValueError(f"a packed THD micro-batch has one row, got {tokens.shape[0]}")
        layout = _CPLayout(params, tokens.shape[1])
        positions = position_ids[0]
        x = self.embedding(tokens[0])
        for block in self.blocks:
            x = block(x, positions, layout)
        return self.head(self.norm(x)).unsqueeze(0)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed next-token cross entropy over the labels that carry loss (``IGNORE_INDEX`` elsewhere)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
