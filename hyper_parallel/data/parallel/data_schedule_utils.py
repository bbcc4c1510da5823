"""Megatron-Core's module name for the packing scheduler's planning API; the code lives in ``parallel.scheduling``.

Owns: nothing but the names (kept so that ``_target_: hyper_parallel.data.parallel.data_schedule_utils.
PackingSchedulerConfig`` and Megatron-style imports keep working). Not responsible for: anything else.
"""

from hyper_parallel.data.parallel.scheduling import (
    SCHEDULERS,
    FlopsStats,
    PackingSchedulerConfig,
    Schedule,
    ScheduledGroup,
    build_schedule,
    schedule_compute_balanced,
    schedule_dp_balanced,
    schedule_dynamic_cp,
    schedule_stats,
    sequence_cost,
)

__all__ = [
    "SCHEDULERS",
    "FlopsStats",
    "PackingSchedulerConfig",
    "Schedule",
    "ScheduledGroup",
    "build_schedule",
    "schedule_compute_balanced",
    "schedule_dp_balanced",
    "schedule_dynamic_cp",
    "schedule_stats",
    "sequence_cost",
]
