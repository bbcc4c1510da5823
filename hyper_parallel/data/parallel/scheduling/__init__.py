"""Planning a packing schedule: pure arithmetic on the step's sequence lengths, the same on every rank.

Owns: the settings (``config``), the ``Schedule`` value (``schedule``), the planners by name (``registry``: one
module per scheduler, ``dp_balanced``, ``dynamic_cp``, ``compute_balanced``, with the cost-balanced placement the last
two share in ``balanced``), the dispatcher with its checks (``plan``), the idle-position pass (``fill``) and the
step's statistics (``stats``). Not responsible for: collectives, fetching or packing data (``batching``), the
process groups (``parallel.process_groups``), or the alignment arithmetic (``parallel.delivery_layout``: the planner
takes a ``DeliveryLayout`` and uses its methods).

Vocabulary: ``R = dp * cp`` positions (the DP x CP ranks of one TP/PP coordinate), a rank's position being
``dp_rank * cp + cp_rank``. Global sequence ids are DP-rank-major. A group of CP size ``c`` occupies the aligned
block of positions ``[b*c, (b+1)*c)``; its sequences are padded by ``layout.padded_lengths(L, c)`` and every rank of
the block holds ``layout.local_length(total, c)`` tokens of them, at most ``max_seqlen_per_dp_cp_rank``. "Ranks" in
the guarantees are the DP replicas for the static schedulers (``dp_balanced``, ``compute_balanced``: every CP rank
of a replica shares its group) and the ``R`` DP x CP positions for ``dynamic_cp``.

Guarantees of ``build_schedule`` (Megatron-Core's), for every scheduler:

* every sequence is scheduled exactly once; each group's padded tokens fit its ranks (``capacity``); a group holds
  at most ``group_sequence_limit`` sequences (``max_num_seqs``, ``thd_max_packed_sequences``);
* every micro-batch covers every position with aligned blocks, so every rank runs the same micro-batch count, and
  that count is a multiple of the VPP group;
* **no micro-batch is empty on every rank**: when the step's sequences cannot fill the VPP multiple of
  micro-batches, ``build_schedule`` raises a ``DataConfigError`` instead of adding an empty one;
* **no idle rank while a sequence can fill it**: a group of padding only is left only where no move can give it
  work. For the static schedulers that means the step holds fewer sequences than groups (``S < M * dp``, every
  group then holding one sequence, the padding groups in the last slots of the last micro-batches); so with
  ``S >= M * dp``, in particular with one micro-batch and ``S >= dp``, no replica idles. For ``dynamic_cp`` an idle
  position is left only when no neighbouring group can grow over it, no group of two or more sequences holds one
  that fits an idle aligned block there, and the micro-batch's sequences do not fit one group of all ``R``
  positions;
* determinism: the same lengths and settings give the same schedule.

Example::

    config = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=10)
    schedule = build_schedule(config, np.array([6, 3, 5, 4, 2]), layout=config.layout(cp_size=1, tp_size=1), dp_size=2)
    # two micro-batches: DP rank 0 gets sequences [0, 1] then [4]; DP rank 1 gets [2] then [3]
"""

from hyper_parallel.data.parallel.scheduling.compute_balanced import schedule_compute_balanced
from hyper_parallel.data.parallel.scheduling.config import (
    CP_PARTITION_MODES,
    THD_TAIL_PADDING_POLICIES,
    PackingSchedulerConfig,
    sequence_cost,
)
from hyper_parallel.data.parallel.scheduling.dp_balanced import schedule_dp_balanced
from hyper_parallel.data.parallel.scheduling.dynamic_cp import schedule_dynamic_cp
from hyper_parallel.data.parallel.scheduling.fill import fill_idle_positions
from hyper_parallel.data.parallel.scheduling.plan import build_schedule
from hyper_parallel.data.parallel.scheduling.registry import SCHEDULERS, STATIC_SCHEDULERS, planner
from hyper_parallel.data.parallel.scheduling.schedule import Schedule, ScheduledGroup
from hyper_parallel.data.parallel.scheduling.stats import FlopsStats, schedule_stats

__all__ = [
    "CP_PARTITION_MODES",
    "SCHEDULERS",
    "STATIC_SCHEDULERS",
    "THD_TAIL_PADDING_POLICIES",
    "FlopsStats",
    "PackingSchedulerConfig",
    "Schedule",
    "ScheduledGroup",
    "build_schedule",
    "fill_idle_positions",
    "planner",
    "schedule_compute_balanced",
    "schedule_dp_balanced",
    "schedule_dynamic_cp",
    "schedule_stats",
    "sequence_cost",
]
