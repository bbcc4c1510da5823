"""The collectives of one packing-scheduler step, on plain tensors: the step header and the sequence exchange.

Owns: all-gathering a step's fixed-size header over the DP x CP domain (``gather_step_headers``), watched so that a
rank that never reaches the step is named by the others after the collective timeout (``HP_DATA_COLLECTIVE_TIMEOUT``,
see ``collective_watch``), and all-gathering tensors of varying width over DP (``all_gather_parts``: the lengths
and the tokens of every DP rank's sequences), each on the device the group's backend gathers on.
Not responsible for: what the header's columns mean, or deciding from them (``batching.scheduled_packing``),
comparing the ranks' settings (``rank_agreement``), or planning (``parallel.scheduling``).

Every rank of the group calls each function for the same collective. A group of one rank gathers nothing and needs
no process group.
"""

from __future__ import annotations

import torch

from hyper_parallel.data.parallel.build_barrier import gather_device
from hyper_parallel.data.parallel.collective_watch import watched

__all__ = ["SEQUENCE_EXCHANGE", "STEP_HEADER", "all_gather_parts", "gather_step_headers"]

STEP_HEADER = "the packing scheduler's step header"
SEQUENCE_EXCHANGE = "the packing scheduler's sequence exchange"


def _all_gather(what: str, tensor: torch.Tensor, group, size: int) -> torch.Tensor:
    """``tensor`` of every rank of ``group`` (``size`` ranks), stacked along a new first dimension, on the CPU."""
    if size == 1:
        return tensor[None]
    import torch.distributed as dist

    mine = tensor.to(gather_device(group))
    gathered = mine.new_empty((size, *mine.shape))  # every rank's part lands in its row: nothing to stack after
    watched(what, lambda: dist.all_gather(list(gathered.unbind(0)), mine, group=group, async_op=True), group=group)
    return gathered.cpu()


def gather_step_headers(header: torch.Tensor, *, group, size: int) -> torch.Tensor:
    """Every rank's step header, ``[size, F]`` in group-rank order, through ``collective_watch.watched``.

    Args:
        header: this rank's 1-D header; the same length and dtype on every rank.
        group: the DP x CP group of the step; size: its number of ranks.

    Raises:
        CollectiveTimeout: a rank did not reach the step header within the timeout; names it.
        DataFileError: the gather failed (a rank left).
    """
    return _all_gather(STEP_HEADER, header.reshape(-1), group, size)


def all_gather_parts(tensor: torch.Tensor, widths: list[int], *, group) -> list[torch.Tensor]:
    """Every rank's ``[F, widths[r]]`` tensor, in group-rank order: views of the one buffer gathered into.

    Args:
        tensor: this rank's ``[F, W]`` part (``W`` its own entry of ``widths``).
        widths: every rank's ``W``, in group-rank order (gathered beforehand, e.g. in the step header).
        group: the group; its size is ``len(widths)``.

    Example:
        widths ``[2, 0, 1]``, parts ``[[1, 2]]``, ``[[]]``, ``[[3]]``: every rank gets ``[[1, 2]]``, ``[[]]``,
        ``[[3]]``.
    """
    padded = tensor.new_zeros((tensor.shape[0], max(widths)))
    padded[:, : tensor.shape[1]] = tensor
    gathered = _all_gather(SEQUENCE_EXCHANGE, padded, group, len(widths))
    return [part[:, :width] for part, width in zip(gathered, widths, strict=True)]
