"""Planning one step: from every sequence's real length to the ``Schedule`` of the DP x CP positions.

Owns: ``build_schedule`` (the dispatcher every rank runs identically on the gathered lengths), the checks of the
lengths, of the dynamic CP sizes and of every sequence's fit, the pass that gives idle positions work, and the
refusal of a micro-batch left without any sequence. Not responsible for: the algorithms (``SCHEDULERS``), the
alignment arithmetic (``DeliveryLayout``), or collectives and data (the delivery stage in ``batching``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np

from hyper_parallel.data.errors import DataConfigError, DataFileError, require_int
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.parallel.scheduling.config import PackingSchedulerConfig, sequence_cost
from hyper_parallel.data.parallel.scheduling.fill import fill_idle_positions
from hyper_parallel.data.parallel.scheduling.registry import STATIC_SCHEDULERS, planner
from hyper_parallel.data.parallel.scheduling.schedule import Schedule

__all__ = ["build_schedule"]


def build_schedule(
    config: PackingSchedulerConfig,
    lengths: np.ndarray,
    *,
    layout: DeliveryLayout,
    dp_size: int,
    dynamic_cp_sizes: Sequence[int] = (),
    vpp_group: int = 1,
) -> Schedule:
    """The step's schedule by ``config.scheduler``, from every sequence's real length in global id order.

    Args:
        config: the scheduler's settings.
        lengths: int lengths (``>= 1``) of the step's sequences, DP-rank-major global id order.
        layout: the delivery layout (``config.layout(cp_size=..., tp_size=...)``): the static CP and TP sizes,
            the alignment and the per-sequence padding.
        dp_size: the DP size (``R = dp_size * layout.cp_size`` positions).
        dynamic_cp_sizes: the runtime CP sizes of the dynamic CP groups (``dynamic_cp`` only; each divides ``R``);
            sizes below ``min_dynamic_context_parallel_size`` are not used.
        vpp_group: the micro-batch count is a multiple of this (the VPP stage group; 1 without VPP).

    Returns:
        The ``Schedule``: ``vpp_group`` divides its micro-batch count; every micro-batch holds a sequence; a group
        holds at most ``config.group_sequence_limit`` sequences; idle positions are given work where a sequence can
        fill them (``parallel.scheduling.fill``).

    Raises:
        DataFileError: ``lengths`` is empty (the global batch holds no sequence) or holds a length below 1.
        DataConfigError: a sequence that no allowed CP size can hold (naming its global id, length and padded
            length, and the setting to raise), bad sizes, ``dynamic_cp`` without usable dynamic CP sizes, or a VPP
            group the step's sequences cannot fill (a micro-batch would hold none).
    """
    if not isinstance(config, PackingSchedulerConfig):
        raise DataConfigError(f"config must be a PackingSchedulerConfig, got {type(config).__name__}")
    if not isinstance(layout, DeliveryLayout):
        raise DataConfigError(
            f"layout must be a DeliveryLayout, got {type(layout).__name__}; build it with "
            "config.layout(cp_size=..., tp_size=...)"
        )
    dp = require_int("dp_size", dp_size, 1)
    group = require_int("vpp_group", vpp_group, 1)
    lengths = _checked_lengths(lengths)
    static = config.scheduler in STATIC_SCHEDULERS
    sizes = [layout.cp_size] if static else _dynamic_sizes(config, dynamic_cp_sizes, dp * layout.cp_size)
    capacity = _capacity(layout, sizes[-1])  # the largest size's multiple is a multiple of every smaller one's
    _check_fits(lengths, capacity, sizes, config, layout, static=static)
    limit = config.group_sequence_limit
    schedule = planner(config.scheduler)(
        lengths,
        layout=layout,
        dp_size=dp,
        cp_sizes=tuple(sizes),
        capacity=capacity,
        vpp_group=group,
        max_num_seqs=limit,
        cost=partial(sequence_cost, config=config),
    )
    schedule = fill_idle_positions(
        schedule, lengths, layout=layout, capacity=capacity, cp_sizes=sizes, max_num_seqs=limit
    )
    _check_every_micro_batch_holds_a_sequence(schedule, len(lengths), group)
    return schedule


def _capacity(layout: DeliveryLayout, largest: int) -> int:
    multiple = layout.local_multiple(largest)
    if layout.alignment == "max" and layout.max_seqlen_per_rank % multiple:
        raise DataConfigError(
            f"pad_packed_seq_alignment='max' pads every rank to max_seqlen_per_dp_cp_rank "
            f"{layout.max_seqlen_per_rank}, which is not a multiple of the CP-local multiple {multiple} of CP size "
            f"{largest}; set max_seqlen_per_dp_cp_rank to a multiple of {multiple}"
        )
    return layout.local_capacity(largest)


def _checked_lengths(lengths) -> np.ndarray:
    array = np.asarray(lengths)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise DataFileError(f"lengths must be a 1-D integer array, got shape {array.shape} of {array.dtype}")
    if array.size == 0:
        raise DataFileError(
            "the global batch holds no sequence: no DP rank fetched a sequence this step, so there is nothing to "
            "schedule; check that the loader yields micro-batches with at least one non-empty sequence"
        )
    array = array.astype(np.int64)
    if int(array.min()) < 1:
        bad = int(np.argmin(array))
        raise DataFileError(f"sequence {bad} of the global batch has length {int(array[bad])}; lengths must be >= 1")
    return array


def _dynamic_sizes(config: PackingSchedulerConfig, dynamic_cp_sizes: Sequence[int], positions: int) -> list[int]:
    sizes = sorted({require_int("dynamic CP size", size, 1) for size in dynamic_cp_sizes})
    for size in sizes:
        if positions % size:
            raise DataConfigError(
                f"dynamic CP size {size} does not divide the {positions} DP x CP ranks; use sizes that divide it"
            )
    usable = [size for size in sizes if size >= config.min_dynamic_context_parallel_size]
    for smaller, larger in zip(usable[:-1], usable[1:], strict=True):
        if larger % smaller:
            raise DataConfigError(
                f"dynamic CP sizes {usable} do not nest: {larger} is not a multiple of {smaller}, so their aligned "
                "blocks could leave positions no allowed size covers; use sizes that each divide the next (powers "
                "of two such as 1, 2, 4, 8, or 1, 3, 6)"
            )
    if not usable:
        raise DataConfigError(
            f"scheduler='dynamic_cp' has no dynamic CP size to use: the process groups hold sizes {sizes} and "
            f"min_dynamic_context_parallel_size is {config.min_dynamic_context_parallel_size}; build "
            "ProcessGroupCollection.from_mesh(mesh, dynamic_cp_sizes=...) with sizes that divide dp * cp, and at "
            "least one >= min_dynamic_context_parallel_size"
        )
    return usable


def _check_fits(
    lengths: np.ndarray,
    capacity: int,
    sizes: Sequence[int],
    config: PackingSchedulerConfig,
    layout: DeliveryLayout,
    *,
    static: bool,
) -> None:
    largest = sizes[-1]
    padded = layout.padded_lengths(lengths, largest)
    over = np.flatnonzero(padded > capacity * largest)
    if not over.size:
        return
    index = int(over[np.argmax(lengths[over])])
    multiple = layout.local_multiple(largest)
    needed = -(-int(padded[index]) // (largest * multiple)) * multiple
    fix = (
        f"raise max_seqlen_per_dp_cp_rank to at least {needed}, or use a larger context-parallel size"
        if static
        else f"raise max_seqlen_per_dp_cp_rank to at least {needed}, or add larger dynamic CP sizes than "
        f"{largest} (dynamic_cp_sizes of ProcessGroupCollection.from_mesh)"
    )
    raise DataConfigError(
        f"sequence {index} of the global batch (length {int(lengths[index])}, padded to {int(padded[index])} for CP "
        f"size {largest}) does not fit {largest} rank(s) of {capacity} tokens (max_seqlen_per_dp_cp_rank "
        f"{config.max_seqlen_per_dp_cp_rank}, aligned); {len(over)} sequence(s) are too long; {fix}"
    )


def _check_every_micro_batch_holds_a_sequence(schedule: Schedule, sequences: int, vpp_group: int) -> None:
    empty = [m for m, groups in enumerate(schedule.micro_batches) if not any(g.sequence_ids for g in groups)]
    if not empty:
        return
    raise DataConfigError(
        f"the step's {sequences} sequence(s) cannot fill its {schedule.num_micro_batches} micro-batches: the VPP "
        f"alignment needs a multiple of {vpp_group} micro-batches (microbatch_group_size_per_vp_stage, with "
        f"vpp_size > 1), and micro-batch(es) {empty[:8]} would hold no sequence on any rank; fetch more micro-batches "
        "per step (num_microbatches), or use a smaller microbatch_group_size_per_vp_stage"
    )
