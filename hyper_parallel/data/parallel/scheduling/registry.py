"""The planners by name.

Owns: ``SCHEDULERS`` (a scheduler's name -> its planning function, every one with the same keyword signature) and
``planner``, the lookup whose error lists the valid names. Not responsible for: validating the rest of the settings
(``parallel.scheduling.config``) or calling a planner (``parallel.scheduling.plan``).
"""

from __future__ import annotations

from collections.abc import Callable

from hyper_parallel.data.errors import require_choice
from hyper_parallel.data.parallel.scheduling.compute_balanced import schedule_compute_balanced
from hyper_parallel.data.parallel.scheduling.dp_balanced import schedule_dp_balanced
from hyper_parallel.data.parallel.scheduling.dynamic_cp import schedule_dynamic_cp
from hyper_parallel.data.parallel.scheduling.schedule import Schedule

__all__ = ["SCHEDULERS", "STATIC_SCHEDULERS", "planner"]

SCHEDULERS: dict[str, Callable[..., Schedule]] = {
    "dp_balanced": schedule_dp_balanced,
    "dynamic_cp": schedule_dynamic_cp,
    "compute_balanced": schedule_compute_balanced,
}
STATIC_SCHEDULERS = ("dp_balanced", "compute_balanced")  # one CP size, the layout's, for every group


def planner(name: str) -> Callable[..., Schedule]:
    """The planning function of scheduler ``name``.

    Raises:
        DataConfigError: an unknown name, with the closest valid one and the list of all.
    """
    return SCHEDULERS[require_choice("scheduler", name, tuple(SCHEDULERS), "the packing scheduler's algorithm")]
