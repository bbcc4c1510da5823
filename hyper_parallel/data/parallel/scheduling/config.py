"""The packing scheduler's settings.

Owns: ``PackingSchedulerConfig`` (validated when built, from Python or YAML through ``_target_``), the layout value
it implies (``PackingSchedulerConfig.layout``), the per-group sequence limit it implies, and the cost model of a
sequence (``sequence_cost``). Not responsible for: the alignment arithmetic (``parallel.delivery_layout``), the
algorithms (``parallel.scheduling.dp_balanced`` and siblings) or moving data.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from hyper_parallel.data.errors import DataConfigError, require_choice, require_int
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.parallel.scheduling.registry import planner

__all__ = ["CP_PARTITION_MODES", "THD_TAIL_PADDING_POLICIES", "PackingSchedulerConfig", "sequence_cost"]

CP_PARTITION_MODES = {"zigzag": "zigzag_thd", "contiguous": "contiguous"}  # Megatron's name -> the layout's
THD_TAIL_PADDING_POLICIES = ("append_dummy_seq", "extend_last")

_BOOL_FIELDS = (
    "mxfp8",
    "sequence_parallel",
    "pad_sequences_for_cp",
    "deterministic_mode",
    "cuda_graphs",
    "router_z_loss",
)
_DYNAMIC_CONFLICTS = {
    "deterministic_mode": "the CP size of every packed micro-batch depends on the step's lengths, so the reduction "
    "order of attention and gradients changes from step to step and results cannot be bitwise reproducible",
    "cuda_graphs": "a CUDA graph is captured for fixed communicators and shapes, and dynamic CP changes the CP group "
    "and the local shapes per micro-batch",
    "router_z_loss": "the router z-loss is averaged over the static CP group, which dynamic CP replaces per "
    "micro-batch, so the loss would be scaled wrongly",
}


@dataclass(frozen=True)
class PackingSchedulerConfig:
    """Settings of the packing scheduler, validated when built (from Python or YAML through ``_target_``).

    Attributes:
        max_seqlen_per_dp_cp_rank: the most tokens (real and padding) one rank holds per micro-batch, CP-local.
        scheduler: one of ``SCHEDULERS``: ``dp_balanced`` (Megatron-Core's order-preserving packing, static CP),
            ``dynamic_cp`` (a CP size per packed group from the dynamic CP sizes), ``compute_balanced`` (static CP,
            balancing each rank's estimated cost ``cost_linear * L + cost_quadratic * L**2``).
        pad_packed_seq_alignment: an int ``N`` (``1 <= N <= max_seqlen_per_dp_cp_rank``): a rank's CP-local
            packed length is a multiple of ``N`` (before sequence parallelism); or ``"max"``: every rank's local
            length is ``max_seqlen_per_dp_cp_rank`` (fixed shapes).
        mxfp8: a rank's shard after sequence parallelism must be a multiple of 32 tokens (MXFP8 blocks).
        sequence_parallel: the CP-local length is split over the TP ranks, so it is a multiple of the TP size.
        pad_sequences_for_cp: every sequence is padded at its end to ``2 * cp`` under CP (Megatron's per-sequence
            CP padding); False needs ``cp_partition_mode="contiguous"``.
        cp_partition_mode: ``"zigzag"`` (each sequence cut in ``2 * cp`` chunks, Transformer Engine's THD layout)
            or ``"contiguous"`` (each CP rank holds one contiguous slice of the packed row).
        thd_tail_padding_policy: ``"append_dummy_seq"`` (the row's padding tail is one extra masked sequence) or
            ``"extend_last"`` (it extends the last real sequence's padded end); the packer applies it.
        thd_max_packed_sequences: a fixed ``cu_seqlens`` capacity (None: none): a group holds at most this many
            sequences, the dummy tail sequence included under ``append_dummy_seq`` (so at most N - 1 real ones).
        vpp_size: virtual pipeline stages (None or 1: none).
        microbatch_group_size_per_vp_stage: with ``vpp_size > 1``, the micro-batch count is a multiple of this
            (default: the pipeline-parallel size, as in Megatron-Core); unused without VPP.
        max_num_seqs: at most this many real sequences in one group (None: no limit).
        min_dynamic_context_parallel_size: the smallest CP size ``dynamic_cp`` gives a group (default 1).
        min_dynamic_cp_size: deprecated alias of ``min_dynamic_context_parallel_size`` (a ``DeprecationWarning``).
        deterministic_mode, cuda_graphs, router_z_loss: the trainer's settings; each is refused with
            ``dynamic_cp``. ``cuda_graphs`` also needs fixed shapes: alignment ``"max"``.
        cost_linear, cost_quadratic: ``a`` and ``b`` of a sequence's estimated cost ``a*L + b*L**2`` (the defaults
            are a 7B model's ``12 h**2 L + 2 h L**2`` with ``h = 4096``, divided by ``2 h``).
        pad_token_id: input id written in padding (its labels are ``IGNORE_INDEX``).

    Raises:
        DataConfigError: a field of the wrong type or out of range, an unknown name (with the closest one), an
            alignment above ``max_seqlen_per_dp_cp_rank``, CUDA graphs without alignment ``"max"``, ``dynamic_cp``
            with deterministic mode, CUDA graphs or the router z-loss, per-sequence CP padding off with the zigzag
            partition, or the two minimum dynamic CP sizes given differently (naming the field, value and fix).

    Example:
        ``PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=8192, scheduler="dynamic_cp",
        min_dynamic_context_parallel_size=2)``
    """

    max_seqlen_per_dp_cp_rank: int
    scheduler: str = "dp_balanced"
    pad_packed_seq_alignment: int | str = 1
    mxfp8: bool = False
    sequence_parallel: bool = False
    pad_sequences_for_cp: bool = True
    cp_partition_mode: str = "zigzag"
    thd_tail_padding_policy: str = "append_dummy_seq"
    thd_max_packed_sequences: int | None = None
    vpp_size: int | None = None
    microbatch_group_size_per_vp_stage: int | None = None
    max_num_seqs: int | None = None
    min_dynamic_context_parallel_size: int | None = None
    min_dynamic_cp_size: int | None = None
    deterministic_mode: bool = False
    cuda_graphs: bool = False
    router_z_loss: bool = False
    cost_linear: float = 24576.0
    cost_quadratic: float = 1.0
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        limit = _config_int(
            "max_seqlen_per_dp_cp_rank", self.max_seqlen_per_dp_cp_rank, 1, "the tokens one rank holds per micro-batch"
        )
        planner(self.scheduler)
        require_choice(
            "cp_partition_mode", self.cp_partition_mode, tuple(CP_PARTITION_MODES), "how a packed row is cut over CP"
        )
        require_choice(
            "thd_tail_padding_policy",
            self.thd_tail_padding_policy,
            THD_TAIL_PADDING_POLICIES,
            "where the row's tail padding goes (its own dummy sequence, or the last sequence's padded end)",
        )
        self._check_alignment(limit)
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool | np.bool_):
                raise DataConfigError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
        for name, meaning in (
            ("vpp_size", "the virtual pipeline stages of the trainer"),
            ("microbatch_group_size_per_vp_stage", "the micro-batches of one VPP stage group"),
            ("max_num_seqs", "the most real sequences of one packed group"),
        ):
            if getattr(self, name) is not None:
                _config_int(name, getattr(self, name), 1, f"None or {meaning}")
        self._check_thd_capacity()
        object.__setattr__(self, "min_dynamic_context_parallel_size", self._min_dynamic_size())
        object.__setattr__(self, "min_dynamic_cp_size", None)
        _config_int("pad_token_id", self.pad_token_id, 0, "a token id of the vocabulary (0 works: it is masked)")
        self._check_costs()
        self._check_combinations(limit)

    def _check_alignment(self, limit: int) -> None:
        alignment = self.pad_packed_seq_alignment
        if alignment == "max":
            return
        if isinstance(alignment, str):
            raise DataConfigError(
                f"pad_packed_seq_alignment is {alignment!r}; use an integer N (the CP-local length is a multiple "
                "of N) or 'max' (every rank holds max_seqlen_per_dp_cp_rank tokens)"
            )
        alignment = _config_int("pad_packed_seq_alignment", alignment, 1, "an integer N, or 'max'")
        if alignment > limit:
            raise DataConfigError(
                f"pad_packed_seq_alignment {alignment} is above max_seqlen_per_dp_cp_rank {limit}, so no "
                f"aligned length fits on a rank; use an alignment <= {limit}, or 'max'"
            )

    def _check_thd_capacity(self) -> None:
        if self.thd_max_packed_sequences is None:
            return
        dummy = self.thd_tail_padding_policy == "append_dummy_seq"
        _config_int(
            "thd_max_packed_sequences",
            self.thd_max_packed_sequences,
            2 if dummy else 1,
            "None or the cu_seqlens capacity in sequences"
            + (
                " (at least 2 under thd_tail_padding_policy 'append_dummy_seq': one slot is the dummy tail)"
                if dummy
                else ""
            ),
        )

    def _min_dynamic_size(self) -> int:
        new, old = self.min_dynamic_context_parallel_size, self.min_dynamic_cp_size
        meaning = "the smallest dynamic CP size (1 for any)"
        if new is not None:
            _config_int("min_dynamic_context_parallel_size", new, 1, meaning)
        if old is None:
            return 1 if new is None else new
        _config_int("min_dynamic_cp_size", old, 1, meaning)
        if new is not None and new != old:
            raise DataConfigError(
                f"min_dynamic_context_parallel_size is {new} but its deprecated alias min_dynamic_cp_size is {old}; "
                "give only min_dynamic_context_parallel_size"
            )
        warnings.warn(
            "min_dynamic_cp_size is deprecated; use min_dynamic_context_parallel_size (Megatron-Core's name)",
            DeprecationWarning,
            stacklevel=4,
        )
        return old

    def _check_costs(self) -> None:
        for name in ("cost_linear", "cost_quadratic"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
                raise DataConfigError(f"{name} must be a number >= 0, got {value!r} ({type(value).__name__})")
            if not math.isfinite(value) or value < 0:
                raise DataConfigError(f"{name} must be a finite number >= 0, got {value}")
        if self.cost_linear == 0 and self.cost_quadratic == 0:
            raise DataConfigError(
                "cost_linear and cost_quadratic are both 0, so every sequence would cost nothing; set at least one "
                "(the defaults 24576 and 1 model a 7B transformer)"
            )

    def _check_combinations(self, limit: int) -> None:
        if self.scheduler == "dynamic_cp":
            for name, reason in _DYNAMIC_CONFLICTS.items():
                if getattr(self, name):
                    raise DataConfigError(
                        f"scheduler='dynamic_cp' cannot run with {name}=True: {reason}; set {name}=False, or use a "
                        "static scheduler ('dp_balanced' or 'compute_balanced')"
                    )
        if self.cuda_graphs and self.pad_packed_seq_alignment not in ("max", limit):
            raise DataConfigError(
                f"cuda_graphs=True needs fixed shapes, but pad_packed_seq_alignment is "
                f"{self.pad_packed_seq_alignment!r}; set pad_packed_seq_alignment to 'max' (or to "
                f"max_seqlen_per_dp_cp_rank, {limit})"
            )
        if not self.pad_sequences_for_cp and self.cp_partition_mode != "contiguous":
            raise DataConfigError(
                f"pad_sequences_for_cp=False leaves sequences unpadded, but cp_partition_mode "
                f"{self.cp_partition_mode!r} cuts every sequence into 2 * cp chunks, which needs the padding; set "
                "cp_partition_mode='contiguous', or pad_sequences_for_cp=True"
            )

    @property
    def group_sequence_limit(self) -> int | None:
        """The most real sequences of one group: ``max_num_seqs`` and the ``cu_seqlens`` capacity (less the dummy
        tail slot under ``append_dummy_seq``), whichever is smaller; None when neither is set."""
        limits = [self.max_num_seqs] if self.max_num_seqs is not None else []
        if self.thd_max_packed_sequences is not None:
            dummy = self.thd_tail_padding_policy == "append_dummy_seq"
            limits.append(self.thd_max_packed_sequences - dummy)
        return min(limits) if limits else None

    def layout(self, *, cp_size: int, tp_size: int) -> DeliveryLayout:
        """The ``DeliveryLayout`` of scheduled batches on a grid of static ``cp_size`` and ``tp_size``.

        Example:
            ``PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=64).layout(cp_size=2, tp_size=1)`` is the
            ``zigzag_thd`` layout with per-sequence padding, alignment 1 and 64 tokens per rank.
        """
        return DeliveryLayout(
            cp_size=cp_size,
            cp_layout=CP_PARTITION_MODES[self.cp_partition_mode],
            tp_size=tp_size,
            sequence_parallel=self.sequence_parallel,
            mxfp8=self.mxfp8,
            alignment=self.pad_packed_seq_alignment,
            pad_sequences=self.pad_sequences_for_cp,
            max_seqlen_per_rank=self.max_seqlen_per_dp_cp_rank,
        )


# The public home of the settings is Megatron-Core's module name, which the design's configs write as ``_target_``
# (``hyper_parallel.data.parallel.data_schedule_utils.PackingSchedulerConfig``, a re-export of this class).
PackingSchedulerConfig.__module__ = "hyper_parallel.data.parallel.data_schedule_utils"


def sequence_cost(lengths: np.ndarray, config: PackingSchedulerConfig) -> np.ndarray:
    """The estimated cost ``cost_linear * L + cost_quadratic * L**2`` of each length, float64."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return config.cost_linear * lengths + config.cost_quadratic * lengths * lengths


def _config_int(name: str, value, minimum: int, meaning: str) -> int:
    try:
        return require_int(name, value, minimum)
    except DataConfigError as error:
        raise DataConfigError(f"{error}; set it to {meaning}") from None
