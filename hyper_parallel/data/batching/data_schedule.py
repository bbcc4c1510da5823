"""Megatron-Core's names for the packing scheduler, as thin views over the one delivery stage (``ParallelBatch``).

Owns: the Megatron entry points and their keys. ``wrap_data_iterator`` is ``ParallelBatch.schedule`` returning
Megatron's ``(iterator, num_micro_batches, stats)``; ``get_batch_on_this_rank_for_sequence_packing`` is
``ParallelBatch.deliver`` returning Megatron's dict (``tokens``, ``labels``, ``loss_mask``, ``position_ids``,
``packed_seq_params``); ``get_batch_on_this_cp_rank`` cuts a Megatron-keyed batch (converted once, here, at the
edge) with the stage's CP sharder; the scheduler classes name the algorithms; and the deprecated hybrid CP keywords
and batch key, accepted with a ``DeprecationWarning``. Not responsible for: fetching, planning, packing, relaying or
cutting (``batching.get_batch``, ``batching.scheduled_packing``, ``parallel``).

Example (every rank)::

    groups = ProcessGroupCollection.from_mesh(mesh, dynamic_cp_sizes=(1, 2, 4))
    config = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=8192, scheduler="dynamic_cp")
    iterator, num_micro_batches, stats = wrap_data_iterator(iter(loader), config, 8, pg_collection=groups)
    for _ in range(num_micro_batches):
        batch = get_batch_on_this_rank_for_sequence_packing(iterator, pg_collection=groups, dynamic_cp=True)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hyper_parallel.data.batching.get_batch import ParallelBatch, ScheduledStep, dynamic_group_lookup
from hyper_parallel.data.errors import DataConfigError, DataFileError, require_int
from hyper_parallel.data.parallel.batch_parallel import CPBatchSharder
from hyper_parallel.data.parallel.data_schedule_utils import FlopsStats, PackingSchedulerConfig, Schedule
from hyper_parallel.data.parallel.delivery_layout import check_cu_seq_lens
from hyper_parallel.data.parallel.process_groups import ProcessGroupCollection, group_size_rank

__all__ = [
    "SCHEDULER_CLASSES",
    "BasePackingScheduler",
    "ComputeBalancedScheduler",
    "DefaultDynamicCPScheduler",
    "DpBalancedScheduler",
    "get_batch_on_this_cp_rank",
    "get_batch_on_this_rank_for_sequence_packing",
    "megatron_batch",
    "wrap_data_iterator",
]

_LAYOUT = "zigzag_thd"


def _stage(pg_collection: Any, config: PackingSchedulerConfig | None = None, **settings) -> ParallelBatch:
    """The delivery stage Megatron's names view: THD attention, ``zigzag_thd``, positions restarting per sequence."""
    if not isinstance(pg_collection, ProcessGroupCollection):
        raise DataConfigError(
            f"pg_collection must be a ProcessGroupCollection (ProcessGroupCollection.from_mesh), got "
            f"{type(pg_collection).__name__}"
        )
    return ParallelBatch(
        attention_mode="packed", cp_layout=None if config is not None else _LAYOUT, reset_position_ids=True,
        scheduler=config, pg_collection=pg_collection, **settings,
    )  # fmt: skip


# -- the schedulers ---------------------------------------------------------------------------------------------------


class BasePackingScheduler:
    """One scheduler of ``PackingSchedulerConfig.scheduler``; ``run`` does a whole step (``wrap_data_iterator``).

    Args:
        config: the scheduler's settings; ``config.scheduler`` must be the subclass's.
        pg_collection: this rank's groups.
        device: where the outcome is relayed (``"cuda"`` with NCCL).

    Raises:
        DataConfigError: a config of another scheduler, a collection of the wrong type, or (dynamic CP) a collection
            without dynamic CP groups, all before any data is read.
    """

    scheduler = ""

    def __init__(self, config: PackingSchedulerConfig, *, pg_collection: ProcessGroupCollection, device="cpu") -> None:
        if not isinstance(config, PackingSchedulerConfig):
            raise DataConfigError(
                f"config must be a PackingSchedulerConfig, got {type(config).__name__}; build one with "
                "PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=...)"
            )
        if config.scheduler != self.scheduler:
            raise DataConfigError(
                f"{type(self).__name__} runs the {self.scheduler!r} scheduler, but config.scheduler is "
                f"{config.scheduler!r}; use SCHEDULER_CLASSES[{config.scheduler!r}] (wrap_data_iterator picks it)"
            )
        self.config = config
        self.stage = _stage(pg_collection, config, sequence_parallel=config.sequence_parallel, device=device)

    def get_groups_and_subsamples(self, lengths: np.ndarray) -> Schedule:
        """The schedule of a step's sequences, from their lengths in global id order (``ParallelBatch.plan``)."""
        return self.stage.plan(lengths)

    def run(self, data_iterator: Iterator | None, num_microbatches: int) -> tuple[Any, int, FlopsStats]:
        """``(iterator, num_micro_batches, stats)`` of one step; see ``wrap_data_iterator``."""
        step = self.stage.schedule(data_iterator, num_microbatches)
        vpp_size = self.config.vpp_size or 1
        if vpp_size > 1 and step.micro_batches is not None:
            return [step.packed_iterator() for _ in range(vpp_size)], len(step), step.stats
        return step.packed_iterator(), len(step), step.stats


class DpBalancedScheduler(BasePackingScheduler):
    """Megatron-Core's DP-balanced packing: sequences in their order, next-fit up to each DP replica's capacity."""

    scheduler = "dp_balanced"


class DefaultDynamicCPScheduler(BasePackingScheduler):
    """Dynamic context parallelism: a CP size per packed group, from the sizes of ``pg_collection.dynamic_cp``."""

    scheduler = "dynamic_cp"


class ComputeBalancedScheduler(BasePackingScheduler):
    """Static CP; sequences assigned so that every DP rank's estimated step cost (``a*L + b*L^2``) is balanced."""

    scheduler = "compute_balanced"


SCHEDULER_CLASSES: dict[str, type[BasePackingScheduler]] = {
    "dp_balanced": DpBalancedScheduler,
    "dynamic_cp": DefaultDynamicCPScheduler,
    "compute_balanced": ComputeBalancedScheduler,
}


def wrap_data_iterator(
    data_iterator: Iterator | None,
    config: PackingSchedulerConfig,
    num_microbatches: int,
    *,
    pg_collection: ProcessGroupCollection,
    device="cpu",
) -> tuple[Any, int, FlopsStats]:
    """One step of the packing scheduler: ``(new_iterator, new_num_microbatches, flops_stats)`` on every rank.

    Every rank calls it once per step (once per evaluation iteration too); ``ParallelBatch.schedule`` does the step.

    Returns:
        On data ranks an iterator over this rank's packed micro-batches (a list of ``vpp_size`` iterators over the
        same micro-batches when ``vpp_size > 1``), None elsewhere; the step's micro-batch count; its ``FlopsStats``.

    Raises:
        StopIteration: every DP rank's data has ended, on every rank (ends an evaluation everywhere at once).
        DataConfigError: bad settings (before any data is read), or ranks whose ``num_microbatches`` or scheduler
            config differ (on every rank, naming the field and the values per rank).
    """
    if not isinstance(config, PackingSchedulerConfig):
        raise DataConfigError(
            f"config must be a PackingSchedulerConfig, got {type(config).__name__}; build one with "
            "PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=...)"
        )
    scheduler = SCHEDULER_CLASSES[config.scheduler](config, pg_collection=pg_collection, device=device)
    return scheduler.run(data_iterator, num_microbatches)


# -- delivering one packed micro-batch ------------------------------------------------------------------------------


def _renamed(new_name: str, new_value: Any, new_default: Any, old_name: str, old_value: Any) -> Any:
    """The value of a renamed keyword: the old one (with a ``DeprecationWarning``) when given."""
    if old_value is None:
        return new_value
    warnings.warn(
        f"{old_name} is deprecated; use {new_name} (hybrid context parallelism is now called dynamic context "
        "parallelism)",
        DeprecationWarning,
        stacklevel=3,
    )
    if new_value is not new_default and new_value != old_value:
        raise DataConfigError(
            f"{old_name}={old_value!r} and {new_name}={new_value!r} contradict each other; {old_name} is the "
            f"deprecated name of {new_name}: pass {new_name} only"
        )
    return old_value


def _dynamic_keywords(dynamic_cp, dynamic_cp_group_func, is_hybrid_cp, hybrid_cp_group_func):
    dynamic_cp = _renamed("dynamic_cp", dynamic_cp, False, "is_hybrid_cp", is_hybrid_cp)
    group_func = _renamed("dynamic_cp_group_func", dynamic_cp_group_func, None, "hybrid_cp_group_func",
                          hybrid_cp_group_func)  # fmt: skip
    if not isinstance(dynamic_cp, bool):
        raise DataConfigError(f"dynamic_cp must be true or false, got {dynamic_cp!r}")
    if group_func is not None and not callable(group_func):
        raise DataConfigError(
            f"dynamic_cp_group_func must be callable (runtime CP size -> group), got {type(group_func).__name__}"
        )
    return dynamic_cp, group_func


def megatron_batch(model_inputs: Mapping[str, Any], loss_inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The stage's outputs under Megatron's keys: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``,
    ``packed_seq_params`` (a field this PP stage does not own is None)."""
    return {
        "tokens": model_inputs["input_ids"],
        "labels": loss_inputs["labels"],
        "loss_mask": loss_inputs["loss_mask"],
        "position_ids": model_inputs["position_ids"],
        "packed_seq_params": model_inputs["packed_seq_params"],
    }


def _stage_iterator(data_iterator, vpp_size, vp_stage):
    if vpp_size is not None and require_int("vpp_size", vpp_size, 1) > 1:
        if not isinstance(data_iterator, Sequence):
            return data_iterator
        stage = require_int("vp_stage", vp_stage, 0)
        if stage >= len(data_iterator):
            raise DataConfigError(f"vp_stage {stage} is not below the {len(data_iterator)} VPP iterators")
        return data_iterator[stage]
    return data_iterator


def get_batch_on_this_rank_for_sequence_packing(
    data_iterator: Iterator | Sequence[Iterator] | ScheduledStep | None,
    *,
    pg_collection: ProcessGroupCollection,
    dynamic_cp: bool = False,
    dynamic_cp_group_func: Callable[[int], Any] | None = None,
    vpp_size: int | None = None,
    vp_stage: int | None = None,
    is_hybrid_cp: bool | None = None,
    hybrid_cp_group_func: Callable[[int], Any] | None = None,
    sequence_parallel: bool = False,
    mtp_stages: Sequence[int] = (),
    device="cpu",
) -> dict[str, Any]:
    """The next packed micro-batch on this rank, under Megatron's keys (``ParallelBatch.deliver``).

    Every rank calls it once per micro-batch. The data rank (TP rank 0 of PP stage 0) reads the next packed
    micro-batch; it is relayed to the TP peers and the other PP stages, and every rank keeps its CP rank's
    ``zigzag_thd`` columns for the micro-batch's CP size (under dynamic CP the group is
    ``dynamic_cp_group_func(size)`` or ``pg_collection.dynamic_cp[size]``, else ``pg_collection.cp``).

    Args:
        data_iterator: the wrapped iterator (``wrap_data_iterator``) on data ranks, or the list of per-VPP-stage
            iterators (then ``vp_stage`` picks one); ignored elsewhere.
        pg_collection: this rank's groups.
        dynamic_cp: the micro-batches were scheduled by ``dynamic_cp``.
        dynamic_cp_group_func: runtime CP size -> group (default ``pg_collection.dynamic_cp``).
        vpp_size, vp_stage: virtual pipeline stages and this call's stage.
        is_hybrid_cp, hybrid_cp_group_func: deprecated names of ``dynamic_cp`` and ``dynamic_cp_group_func``.
        sequence_parallel: also record the TP x CP group (``pg_collection.tp_cp``, or ``dynamic_tp_cp[size]``).
        mtp_stages: PP stages that also receive tokens and position ids.
        device: where the relay runs and the tensors are returned.

    Returns:
        ``megatron_batch``: ``tokens``, ``labels`` (int64 ``[1, s]``), ``loss_mask`` (float32), ``position_ids``
        (restarting at 0 at every sequence) and ``packed_seq_params`` (THD, with ``cp_group``, ``local_cp_size`` and
        ``tp_cp_group`` with sequence parallelism); fields this PP stage does not own are None.

    Raises:
        StopIteration: the data rank's iterator is exhausted, on every rank of its TP and PP groups.
        DataConfigError: contradicting or bad keywords (before anything is read), a CP size without a group.
        DataFileError: a malformed micro-batch, on every rank of the TP and PP groups.
    """
    dynamic_cp, group_func = _dynamic_keywords(dynamic_cp, dynamic_cp_group_func, is_hybrid_cp, hybrid_cp_group_func)
    if not isinstance(sequence_parallel, bool):
        raise DataConfigError(f"sequence_parallel must be true or false, got {sequence_parallel!r}")
    if dynamic_cp and group_func is None and isinstance(pg_collection, ProcessGroupCollection):
        group_func = dynamic_group_lookup(pg_collection.dynamic_cp, "dynamic_cp")
    stage = _stage(
        pg_collection, sequence_parallel=sequence_parallel, dynamic_cp_group_func=group_func if dynamic_cp else None,
        mtp_stages=mtp_stages, device=device,
    )  # fmt: skip
    iterator = _stage_iterator(data_iterator, vpp_size, vp_stage) if pg_collection.is_data_rank else None
    if isinstance(iterator, ScheduledStep):
        iterator = iterator.packed_iterator()
    return megatron_batch(*stage.deliver(iterator))


# -- the CP cut of a Megatron-keyed batch --------------------------------------------------------------------------


def _choose_cp_group(batch: Mapping, cp_group, dynamic_cp: bool, group_func) -> tuple[int, int]:
    """``(size, rank)`` the batch is cut across: its legacy ``hybrid_cp_group``, the dynamic group of its
    ``local_cp_size``, or ``cp_group``."""
    value = batch.get("local_cp_size")
    local_size = None if value is None else int(torch.as_tensor(value).reshape(-1)[0])
    legacy = batch.get("hybrid_cp_group")
    if legacy is not None:
        warnings.warn(
            "the batch key hybrid_cp_group is deprecated; the scheduler's micro-batches carry local_cp_size and "
            "dynamic_cp_group_func gives its group",
            DeprecationWarning,
            stacklevel=3,
        )
        if cp_group is not None and cp_group is not legacy:
            raise DataConfigError(
                "the batch carries a hybrid_cp_group and a different cp_group was passed; pass one of them"
            )
        group = legacy
    elif dynamic_cp:
        if local_size is None:
            raise DataFileError(
                "dynamic CP cuts each micro-batch across its own CP size, but the batch has no local_cp_size; feed "
                "the packing scheduler's micro-batches (wrap_data_iterator), or call without dynamic_cp"
            )
        if group_func is None:
            raise DataConfigError(
                "dynamic CP needs the group of each runtime CP size: pass dynamic_cp_group_func (size -> group), "
                "e.g. pg_collection.dynamic_cp.get"
            )
        group = group_func(local_size)
    else:
        group = cp_group
    size, rank = group_size_rank(group)
    if local_size is not None and local_size != size:
        raise DataConfigError(
            f"the micro-batch was packed for a CP size of {local_size}, but its CP group holds {size} ranks; under "
            "dynamic CP pass dynamic_cp=True (the scheduler 'dynamic_cp'), otherwise the static CP group the "
            "scheduler packed for"
        )
    return size, rank


def get_batch_on_this_cp_rank(
    batch: Mapping[str, Any],
    cp_group=None,
    *,
    dynamic_cp: bool = False,
    dynamic_cp_group_func: Callable[[int], Any] | None = None,
    is_hybrid_cp: bool | None = None,
    hybrid_cp_group_func: Callable[[int], Any] | None = None,
) -> dict[str, Any]:
    """This CP rank's part of a Megatron-keyed packed batch: every ``[R, T]`` tensor at its ``zigzag_thd`` columns.

    The CP group is the batch's legacy ``hybrid_cp_group`` when it carries one (``DeprecationWarning``); else, with
    ``dynamic_cp``, ``dynamic_cp_group_func(local_cp_size)``; else ``cp_group``. Other entries (``cu_seqlens``,
    scalars, groups) are returned as they are.

    Args:
        batch: ``tokens`` ``[R, T]``, ``cu_seqlens`` over the rows flattened (Megatron's keys; ``input_ids`` and
            ``cu_seq_lens`` are read too, here at the edge), every sequence a multiple of ``2 * size`` long; any
            other ``[R, T]`` tensors (labels, loss_mask, position_ids).
        cp_group: the static CP group (None: one rank, nothing is cut).
        dynamic_cp, dynamic_cp_group_func: cut across the micro-batch's own CP size, and its group.
        is_hybrid_cp, hybrid_cp_group_func: deprecated names of ``dynamic_cp`` and ``dynamic_cp_group_func``.

    Raises:
        DataConfigError: contradicting keywords, a missing group function, or a group whose size is not the batch's
            ``local_cp_size``.
        DataFileError: no tokens or boundaries, dynamic CP without ``local_cp_size``, or boundaries that break the
            contract or do not divide.
    """
    dynamic_cp, group_func = _dynamic_keywords(dynamic_cp, dynamic_cp_group_func, is_hybrid_cp, hybrid_cp_group_func)
    if not isinstance(batch, Mapping):
        raise DataFileError(f"get_batch_on_this_cp_rank takes a mapping of fields, got {type(batch).__name__}")
    tokens_key = next((key for key in ("tokens", "input_ids") if key in batch), None)
    bounds_key = next((key for key in ("cu_seqlens", "cu_seq_lens") if key in batch), None)
    if tokens_key is None or bounds_key is None:
        raise DataFileError(f"the batch needs tokens and cu_seqlens; it holds {sorted(batch)}")
    size, rank = _choose_cp_group(batch, cp_group, dynamic_cp, group_func)
    rows, row_length = batch[tokens_key].shape
    bounds = check_cu_seq_lens(batch[bounds_key], rows * row_length, "the batch's cu_seqlens", row_length=row_length)
    grid = {
        name: value
        for name, value in batch.items()
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (rows, row_length)
    }
    local, _ = CPBatchSharder(size, rank, _LAYOUT).shard(grid, bounds)
    return {name: local.get(name, value) for name, value in batch.items()}
