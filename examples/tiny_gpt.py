"""A small GPT in plain PyTorch that trains on packed micro-batches cut across a context-parallel (CP) group.

Owns: the model of the training example (``train_tiny_gpt.py``) and of the packed train/eval functional test:
token embeddings, pre-norm blocks (causal multi-head attention, MLP), rotary positions from ``position_ids``, and
attention over one CP rank's tokens that all-gathers keys and values over the CP group with autograd, so the
gradients of keys and values reach the rank that computed them. Which keys a query sees comes from the batch's
attention metadata (``CPAttention``): the global THD boundaries of ``PackedSeqParams`` (the ``zigzag_thd``
layout: ``cu_seqlens_q_padded`` place the sequences and their padding in the row, ``cu_seqlens_q`` count each
sequence's real tokens, as Transformer Engine reads them), or the dense mask ``ParallelBatch`` builds
(``contiguous`` and ``zigzag``); either way a real token sees the real tokens of its own sequence at or before it,
whichever rank holds them, never another document and never padding, and a padding position sees only the
padding before it in its own span. Not responsible
for: data, the CP layouts' arithmetic (``parallel.batch_parallel.cp_local_columns``), the masks themselves
(``batching.attention_runtime``), or gradient reduction across ranks (the training loop's).

Example (one rank, one micro-batch from ``ParallelBatch`` with ``attention_mode: packed``)::

    model = TinyGPT(vocab_size=8192)
    model_inputs, loss_inputs = get_batch(data_iterator)
    attention = CPAttention.from_model_inputs(model_inputs, cp_layout="zigzag_thd", cp_group=context.cp_group)
    logits = model(model_inputs["input_ids"], model_inputs["position_ids"], attention)
    loss_sum = token_loss_sum(logits, loss_inputs["labels"])
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyper_parallel.data.batching.attention_runtime import PackedSeqParams, dense_attention_mask
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.parallel.batch_parallel import cp_local_columns

__all__ = ["CPAttention", "TinyGPT", "gather_over_cp", "token_loss_sum"]


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


def _group_size_and_rank(group) -> tuple[int, int]:
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


class CPAttention:
    """One micro-batch's attention on this rank: its CP group, where gathered keys go, which keys each query sees.

    Build it with ``from_packed`` or ``from_model_inputs``. Every rank of ``group`` must run the model (forward
    and backward) on the same micro-batch.

    Args:
        group: the CP process group the rows are cut across (None: one rank holds them whole).
        key_order: int64 ``[R, T]``: for each global column, its index among the keys gathered rank after rank
            (every rank's ``s`` local keys in its local order).
        may_attend: bool ``[R, s, T]``: True where the local query may attend the key at that global column.
    """

    def __init__(self, group, key_order: torch.Tensor, may_attend: torch.Tensor) -> None:
        size, _ = _group_size_and_rank(group)
        rows, local, total = may_attend.shape
        if tuple(key_order.shape) != (rows, total) or local * size != total:
            raise ValueError(
                f"a CP group of {size} ranks holding {local} tokens of {total} per row needs key_order [{rows}, "
                f"{total}], got {list(key_order.shape)}"
            )
        self.group, self.key_order, self.may_attend = group, key_order, may_attend

    @classmethod
    def from_packed(cls, params: PackedSeqParams, local_length: int, cp_group=None) -> CPAttention:
        """Causal attention over one packed THD row cut in the ``zigzag_thd`` layout.

        Args:
            params: the global boundaries: ``cu_seqlens_q_padded`` (the physical layout the columns are cut from)
                and ``cu_seqlens_q`` (each sequence's real tokens, at the start of its padded span); its
                ``cp_group`` when set (the packing scheduler's), else ``cp_group`` (``ParallelBatch``'s params
                record no group: pass the context's).
            local_length: how many tokens this rank holds.
        """
        group = params.cp_group if params.cp_group is not None else cp_group
        size, rank = _group_size_and_rank(group)
        if params.local_cp_size is not None and params.local_cp_size != size:
            raise ValueError(f"local_cp_size {params.local_cp_size} but the CP group holds {size} ranks")
        padded = params.cu_seqlens_q_padded.detach().cpu().numpy().astype(np.int64)
        real = params.cu_seqlens_q.detach().cpu().numpy().astype(np.int64)
        total = int(padded[-1])
        columns = [cp_local_columns("zigzag_thd", padded, 1, total, size, r) for r in range(size)]
        if columns[rank].shape[1] != local_length:
            raise ValueError(f"this rank holds {local_length} tokens, but its columns are {columns[rank].shape[1]}")
        mask, _ = dense_attention_mask(_real_and_padding_spans(padded, real), columns[rank], total, causal=True)
        return cls(group, _key_order(columns), mask[:, 0])

    @classmethod
    def from_model_inputs(cls, model_inputs: Mapping, *, cp_layout: str, cp_group) -> CPAttention:
        """The attention of a ``ParallelBatch`` micro-batch (its ``model_inputs``), in either attention mode.

        Args:
            model_inputs: ``ParallelBatch``'s first output; ``attention_mode`` ``packed`` (one row, ``zigzag_thd``
                with CP) or ``dense`` (any rows, ``contiguous`` or ``zigzag``; its ``swa_mask`` when present).
            cp_layout: the ``get_batch`` node's ``cp_layout``.
            cp_group: the CP group of this rank (``DataLoaderParallelContext.cp_group``).

        Raises:
            ValueError: ``flex`` or ``none`` attention, or a dense mask over ``zigzag_thd`` columns (the dense mode
                does not deliver the boundaries that place them: use ``packed`` with ``zigzag_thd``).
        """
        rows, local = model_inputs["input_ids"].shape
        params = model_inputs.get("packed_seq_params")
        if params is not None:
            if rows != 1:
                raise ValueError(f"a packed THD micro-batch has one row, got {rows}")
            return cls.from_packed(params, local, cp_group)
        mask = model_inputs.get("swa_mask")
        mask = model_inputs.get("attention_mask") if mask is None else mask
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise ValueError(
                "the model takes get_batch's attention_mode 'packed' or 'dense'; this batch has neither "
                "packed_seq_params nor a dense bool attention_mask (flex and none are not supported)"
            )
        size, _ = _group_size_and_rank(cp_group)
        if cp_layout == "zigzag_thd" and size > 1:
            raise ValueError("a dense mask over zigzag_thd columns cannot be placed; use attention_mode 'packed'")
        total = local * size
        columns = [cp_local_columns(cp_layout, None, rows, total, size, r) for r in range(size)]
        return cls(cp_group, _key_order(columns), mask[:, 0])


def _real_and_padding_spans(padded: np.ndarray, real: np.ndarray) -> np.ndarray:
    """Boundaries that make each sequence's real tokens one span and its padding another.

    Example: padded ``[0, 4, 12]`` with real ``[0, 3, 9]``: ``[0, 3, 4, 10, 12]``; the real tokens of a sequence
    then attend only each other, and its padding only itself (so every query sees at least one key).
    """
    real_ends = padded[:-1] + np.diff(real)
    return np.union1d(padded, real_ends).astype(np.int32)


def _key_order(columns: list[np.ndarray]) -> torch.Tensor:
    """Gathered keys arrive rank after rank; this order puts them back at their global columns, row by row."""
    return torch.argsort(torch.from_numpy(np.concatenate(columns, axis=1)), dim=1)


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[R, s, heads, head_dim]`` at integer ``positions`` ``[R, s]``."""
    half = x.shape[-1] // 2
    frequencies = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[..., None] * frequencies
    cos, sin = angles.cos()[..., None, :], angles.sin()[..., None, :]
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attention: CPAttention) -> torch.Tensor:
        rows, s = x.shape[:2]
        q, k, v = self.qkv(x).view(rows, s, 3, self.heads, self.head_dim).unbind(2)
        q, k = _rotate(q, positions), _rotate(k, positions)
        row_index = torch.arange(rows)[:, None]

        def every_rank(local: torch.Tensor) -> torch.Tensor:  # [R, T, heads, head_dim], global column order
            gathered = gather_over_cp(local, attention.group).transpose(0, 1).flatten(1, 2)
            return gathered[row_index, attention.key_order]

        keys, values = every_rank(k), every_rank(v)
        scores = torch.einsum("rqhd,rkhd->rhqk", q, keys) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~attention.may_attend[:, None], float("-inf"))  # a query always sees itself
        attended = torch.einsum("rhqk,rkhd->rqhd", scores.softmax(dim=-1), values)
        return self.out(attended.reshape(rows, s, -1))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = _Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attention: CPAttention) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), positions, attention)
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """A decoder-only transformer for one micro-batch of ``R`` rows, each cut across its CP group.

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

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor, attention: CPAttention | PackedSeqParams
    ) -> torch.Tensor:
        """Logits ``[R, s, vocab]`` of this rank's tokens (``tokens`` and ``position_ids`` ``[R, s]``).

        ``attention`` is a ``CPAttention``, or the ``PackedSeqParams`` of one packed row that record their CP
        group (the packing scheduler's); every rank of the CP group must call ``forward``, and ``backward``, for
        the same micro-batch.
        """
        if isinstance(attention, PackedSeqParams):
            if tokens.shape[0] != 1:
                raise ValueError(f"a packed THD micro-batch has one row, got {tokens.shape[0]}")
            attention = CPAttention.from_packed(attention, tokens.shape[1])
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x, position_ids, attention)
        return self.head(self.norm(x))


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed next-token cross entropy over the labels that carry loss (``IGNORE_INDEX`` elsewhere)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
