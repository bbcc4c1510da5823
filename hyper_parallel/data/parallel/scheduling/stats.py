"""What one step's schedule costs: the FLOPs inputs, packing efficiency and per-rank cost balance.

Owns: ``FlopsStats`` (and its float64 tensor form for a broadcast) and ``schedule_stats``. Not responsible for:
planning (``parallel.scheduling.plan``) or sending the statistics (the delivery stage).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import numpy as np
import torch

from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.parallel.scheduling.config import PackingSchedulerConfig, sequence_cost
from hyper_parallel.data.parallel.scheduling.schedule import Schedule

__all__ = ["FlopsStats", "schedule_stats"]


@dataclass(frozen=True)
class FlopsStats:
    """What one step's schedule costs, the same on every rank.

    Attributes:
        num_micro_batches: the step's micro-batch count.
        seqlen_sum: the sum of the scheduled sequences' padded lengths (Megatron-Core's FLOPs input).
        seqlen_squared_sum: the sum of their squares.
        valid_tokens: real tokens scheduled (every token of the global batch, once).
        scheduled_tokens: the tokens the ranks hold: over micro-batches and positions, the local packed length.
        packing_efficiency: ``valid_tokens / scheduled_tokens``.
        max_rank_cost, mean_rank_cost: per position, the sum over the step's micro-batches of its group's cost
            (``sequence_cost`` of the padded lengths) divided by the group's CP size; their max and mean.
    """

    num_micro_batches: int
    seqlen_sum: float
    seqlen_squared_sum: float
    valid_tokens: int
    scheduled_tokens: int
    packing_efficiency: float
    max_rank_cost: float
    mean_rank_cost: float

    @property
    def imbalance(self) -> float:
        """``max_rank_cost / mean_rank_cost`` (1.0 when the mean is 0)."""
        return self.max_rank_cost / self.mean_rank_cost if self.mean_rank_cost else 1.0

    def as_tensor(self) -> torch.Tensor:
        """The fields in order as float64 ``[8]`` (what a broadcast sends)."""
        return torch.tensor([float(value) for value in astuple(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> FlopsStats:
        """The inverse of ``as_tensor``."""
        values = torch.as_tensor(tensor, dtype=torch.float64).reshape(-1).tolist()
        if len(values) != len(fields(cls)):
            raise ValueError(f"FlopsStats.from_tensor needs {len(fields(cls))} values, got {len(values)}")
        return cls(*(int(round(v)) if f.type == "int" else v for f, v in zip(fields(cls), values, strict=True)))


def schedule_stats(
    schedule: Schedule, lengths: np.ndarray, config: PackingSchedulerConfig, *, layout: DeliveryLayout
) -> FlopsStats:
    """The ``FlopsStats`` of ``schedule`` over sequences of ``lengths`` (global id order), laid out by ``layout``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    groups = [group for groups in schedule.micro_batches for group in groups]
    counts = np.fromiter((len(group.sequence_ids) for group in groups), dtype=np.int64, count=len(groups))
    sizes = np.fromiter((group.cp_size for group in groups), dtype=np.int64, count=len(groups))
    ids = np.fromiter((i for group in groups for i in group.sequence_ids), dtype=np.int64, count=int(counts.sum()))
    owner = np.repeat(np.arange(len(groups)), counts)
    real = lengths[ids]
    multiple = np.fromiter((layout.sequence_multiple(int(c)) for c in sizes), dtype=np.int64, count=len(groups))
    padded = real + -real % multiple[owner]
    totals = np.bincount(owner, weights=padded, minlength=len(groups)).astype(np.int64)
    group_cost = np.bincount(owner, weights=sequence_cost(padded, config), minlength=len(groups))
    local = np.fromiter(
        (layout.local_length(int(total), int(c)) for total, c in zip(totals, sizes, strict=True)),
        dtype=np.int64,
        count=len(groups),
    )
    positions = schedule.num_positions
    firsts = np.fromiter((group.first_position for group in groups), dtype=np.int64, count=len(groups))
    per_rank = group_cost / np.maximum(sizes, 1)
    # Each group adds its per-rank cost to the positions of its block: a difference array over positions.
    delta = np.bincount(firsts, weights=per_rank, minlength=positions + 1)
    delta -= np.bincount(firsts + sizes, weights=per_rank, minlength=positions + 1)
    rank_cost = np.cumsum(delta)[:positions]
    scheduled = int((local * sizes).sum())
    valid = int(real.sum())
    return FlopsStats(
        num_micro_batches=schedule.num_micro_batches,
        seqlen_sum=float(padded.sum()),
        seqlen_squared_sum=float((padded.astype(np.float64) ** 2).sum()),
        valid_tokens=valid,
        scheduled_tokens=scheduled,
        packing_efficiency=valid / scheduled if scheduled else 0.0,
        max_rank_cost=float(rank_cost.max()) if positions else 0.0,
        mean_rank_cost=float(rank_cost.mean()) if positions else 0.0,
    )
