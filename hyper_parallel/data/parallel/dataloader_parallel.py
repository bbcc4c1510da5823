"""Who reads: a rank's place in the data-, context-, tensor- and pipeline-parallel grid, and building datasets on
the readers.

Owns: ``DataLoaderParallelContext`` (the DP, CP, TP and PP ranks, sizes and groups of this rank, read from a torch
``DeviceMesh`` or from process groups, and checked), the one rule of who reads (a *data rank* is TP rank 0 of PP
stage 0 of every (DP, CP) coordinate: it builds and iterates a DataLoader; its TP peers on stage 0 receive its
batches over TP, the other stages from stage 0 over PP), and
``build_on_data_ranks``, which builds datasets on the readers only: global rank 0 first (it writes the shared
caches), then the other readers (they read them), while the other ranks get None and a failure anywhere raises
everywhere. Not responsible for: what is built (the dataset builders), splitting batches across CP ranks or
sending them to TP ranks (``parallel.batch_parallel``), or composing them into model inputs (``batching``).

Example, 8 ranks as DP2 x CP2 x TP2 (TP varying fastest, as ``init_device_mesh`` lays ranks out)::

    mesh = init_device_mesh("cuda", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    context = DataLoaderParallelContext.from_mesh(mesh)
    # rank 5: dp_rank 1, cp_rank 0, tp_rank 1, tp_src 4: not a data rank, it receives rank 4's batches
    datasets = build_on_data_ranks(context, lambda: build_indexed_text_dataset(...))  # None on ranks 1, 3, 5, 7

With PP2 x DP2 x TP2 (``mesh_dim_names=("pp", "dp", "tp")``) ranks 0 and 2 are the data ranks; rank 5 (pp 1, dp 0,
tp 1) has ``pp_src`` 1: it receives its batches from rank 1 on stage 0, which received them from rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, require_int
from hyper_parallel.data.parallel.build_barrier import rank_zero_first, without_rank_collectives

T = TypeVar("T")

logger = get_logger(__name__)

__all__ = ["MESH_DIMENSIONS", "DataLoaderParallelContext", "build_on_data_ranks"]

MESH_DIMENSIONS = ("dp", "cp", "tp", "pp")


def _distributed():
    import torch.distributed as dist

    return dist


def _global_rank() -> int:
    dist = _distributed()
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _group_place(name: str, group) -> tuple[int, int, list[int]]:
    """``(rank in group, group size, global ranks of the group)`` of this rank, or an error naming the group."""
    dist = _distributed()
    if not (dist.is_available() and dist.is_initialized()):
        raise DataConfigError(
            f"{name} was given, but torch.distributed is not initialised; call init_process_group first, or pass "
            "no groups (DataLoaderParallelContext.standalone()) for a single process"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise DataConfigError(
            f"global rank {dist.get_rank()} is not a member of the {name} it was given; pass each rank the groups "
            "it belongs to (new_group returns a placeholder to the ranks outside the group)"
        )
    return rank, dist.get_world_size(group), dist.get_process_group_ranks(group)


@dataclass(frozen=True)
class DataLoaderParallelContext:
    """This rank's place in the DP x CP x TP x PP grid, and whether it reads data.

    TP rank 0 of PP stage 0 of every (DP, CP) coordinate is a data rank (``is_data_rank``, the one definition): it
    builds and iterates the DataLoader of DP rank ``dp_rank`` and shards each batch for CP rank ``cp_rank``; the
    other ranks of its TP group read nothing and receive its batches, and every later PP stage receives from stage 0
    of its (DP, CP, TP) coordinate (``pp_src``) the fields it owns. Global rank 0 is always a data rank (torch
    orders a group's ranks by global rank).

    Build one with ``from_mesh``, ``from_groups`` or ``standalone``. A context made directly from integers
    without groups describes a rank for single-process use (tests, benchmarks) and takes no collective.

    Attributes:
        dp_rank, dp_size: data-parallel rank and size (the DataLoader's ``dp_rank`` and ``dp_world_size``).
        cp_rank, cp_size: context-parallel rank and size (which part of every row this rank holds).
        tp_rank, tp_size: tensor-parallel rank and size.
        pp_rank, pp_size: pipeline-parallel stage and number of stages.
        dp_group, cp_group, tp_group, pp_group: the process groups, None where the size is 1.
        tp_src: the global rank of TP rank 0 of this rank's TP group, the source of its batches on PP stage 0 (this
            rank itself without a TP group).
        pp_src: the global rank of PP stage 0 of this rank's PP group, the source of its batches on the later
            stages (this rank itself without a PP group). A context made from integers, for one process, keeps
            the default 0 of both sources unless given.
    """

    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    dp_group: Any = None
    cp_group: Any = None
    tp_group: Any = None
    tp_src: int = 0
    pp_rank: int = 0
    pp_size: int = 1
    pp_group: Any = None
    pp_src: int = 0

    def __post_init__(self) -> None:
        for name in MESH_DIMENSIONS:
            size = require_int(f"DataLoaderParallelContext.{name}_size", getattr(self, f"{name}_size"), 1)
            rank = require_int(f"DataLoaderParallelContext.{name}_rank", getattr(self, f"{name}_rank"), 0)
            if rank >= size:
                raise DataConfigError(
                    f"DataLoaderParallelContext.{name}_rank is {rank}, but {name}_size is {size}: a rank must be "
                    f"below its size"
                )
        require_int("DataLoaderParallelContext.tp_src", self.tp_src, 0)
        require_int("DataLoaderParallelContext.pp_src", self.pp_src, 0)

    @property
    def is_data_rank(self) -> bool:
        """Whether this rank builds and iterates a DataLoader: TP rank 0 of PP stage 0. The others receive its
        batches (its TP peers over TP, the later stages over PP)."""
        return self.tp_rank == 0 and self.pp_rank == 0

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank is on PP stage 0 (it takes the tokens and the position ids)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank is on the last PP stage (it takes the labels and the loss mask)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def batch_src(self) -> int:
        """The global rank this rank's batches come from: ``tp_src`` on PP stage 0, ``pp_src`` on later stages."""
        return self.tp_src if self.is_first_stage else self.pp_src

    @classmethod
    def standalone(cls) -> DataLoaderParallelContext:
        """One process's view: every size 1, no group; this rank reads its own data."""
        rank = _global_rank()
        return cls(tp_src=rank, pp_src=rank)

    @classmethod
    def from_groups(cls, *, dp_group=None, cp_group=None, tp_group=None, pp_group=None) -> DataLoaderParallelContext:
        """Read the ranks and sizes from this rank's process groups; a group of None (or of one rank) is size 1.

        Raises:
            DataConfigError: a group is given without torch.distributed initialised, this rank is not a member of
                a group it was given, two groups share another rank than this one, or the sizes multiply to more
                than the world size.
        """
        given = {"dp": dp_group, "cp": cp_group, "tp": tp_group, "pp": pp_group}
        places = {name: _group_place(f"{name}_group", group) for name, group in given.items() if group is not None}
        _check_grid(places)
        fields: dict[str, Any] = {"tp_src": _global_rank(), "pp_src": _global_rank()}
        for name, (rank, size, members) in places.items():
            if size > 1:
                fields.update({f"{name}_rank": rank, f"{name}_size": size, f"{name}_group": given[name]})
            if name in ("tp", "pp"):
                fields[f"{name}_src"] = members[0]  # group rank 0 is the lowest global rank of the group
        return cls(**fields)

    @classmethod
    def from_mesh(cls, mesh) -> DataLoaderParallelContext:
        """Read the ranks and sizes from a torch ``DeviceMesh`` whose dimensions are named from ``dp``, ``cp``,
        ``tp`` and ``pp`` (any subset, in any order; a missing dimension is size 1).

        Example: ``from_mesh(init_device_mesh("cuda", (2, 4, 2), mesh_dim_names=("pp", "dp", "tp")))``.

        Raises:
            DataConfigError: the mesh has no dimension names, or one that is not ``dp``, ``cp``, ``tp`` or ``pp``.
        """
        names = mesh.mesh_dim_names
        if not names:
            raise DataConfigError(
                f"the DeviceMesh of shape {tuple(mesh.shape)} has no dimension names; create it with "
                f"mesh_dim_names taken from {list(MESH_DIMENSIONS)}, e.g. init_device_mesh(device, (2, 2), "
                "mesh_dim_names=('dp', 'tp'))"
            )
        unknown = [name for name in names if name not in MESH_DIMENSIONS]
        if unknown:
            raise DataConfigError(
                f"the DeviceMesh dimension {unknown[0]!r} (of {list(names)}) is not one the data loader knows; name "
                f"the dimensions from {list(MESH_DIMENSIONS)}, or pass a sub-mesh of those dimensions "
                "(mesh['dp', 'tp'])"
            )
        return cls.from_groups(**{f"{name}_group": mesh.get_group(name) for name in names})


def _check_grid(places: dict[str, tuple[int, int, list[int]]]) -> None:
    """The groups of one rank form a grid: they meet only in this rank, and fit in the world."""
    if not places:
        return
    dist = _distributed()
    me, world_size = dist.get_rank(), dist.get_world_size()
    named = list(places.items())
    for i, (first, (_, _, first_members)) in enumerate(named):
        for second, (_, _, second_members) in named[i + 1 :]:
            shared = sorted(set(first_members) & set(second_members) - {me})
            if shared:
                raise DataConfigError(
                    f"the {first}_group {first_members} and the {second}_group {second_members} of global rank {me} "
                    f"share the ranks {shared}: along different dimensions, groups meet only in this rank. Pass "
                    "each dimension's own group (grid ranks that differ only along that dimension)"
                )
    sizes = {name: size for name, (_, size, _) in places.items()}
    if math.prod(sizes.values()) > world_size:
        raise DataConfigError(
            f"the group sizes {sizes} multiply to {math.prod(sizes.values())}, more than the world size {world_size}"
            "; pass each dimension's own group"
        )


def build_on_data_ranks(context: DataLoaderParallelContext, factory: Callable[[], T]) -> T | None:
    """Build datasets on the data ranks only: global rank 0 first, then the others; None on the other ranks.

    Every rank calls it. Rank 0 runs ``factory`` first and writes the shared caches (index caches, Hugging Face
    Arrow caches); once it has finished, the other data ranks run ``factory`` and read what rank 0 wrote, while the
    ranks that are not data ranks wait and return None. Inside ``factory`` the dataset builders take no collective
    (their per-entry all-gathers and rank-0-first loads would wait for ever for the ranks that do not build): they
    coordinate through the cache's file locks, and find every entry rank 0 built already there. A failure on any
    rank raises on every rank, the others raising ``DataFileError("rank r failed to build the datasets (...)")``.
    Without a process group this is ``factory()`` on a data rank.

    Unlike the builders' own all-gathers, the data ranks do not compare their settings here: a data rank whose
    settings differ from rank 0's builds (and logs building) its own cache entries, as separate jobs would.

    Args:
        context: this rank's place; ``context.is_data_rank`` decides whether it builds.
        factory: builds and returns the datasets, e.g. ``lambda: build_indexed_text_dataset(...)``.
    """

    def build() -> T:
        with without_rank_collectives():
            return factory()

    place = (
        f"DP rank {context.dp_rank} of {context.dp_size}, CP rank {context.cp_rank} of {context.cp_size}, "
        f"TP rank {context.tp_rank} of {context.tp_size}"
    )
    if context.pp_size > 1:
        place += f", PP stage {context.pp_rank} of {context.pp_size}"
    if context.is_data_rank:
        logger.info("%s: a data rank, builds the datasets and reads its DataLoader (global rank 0 first)", place)
    else:
        logger.info("%s: reads no data, receives global rank %d's batches", place, context.batch_src)
    return rank_zero_first(build, takes_part=context.is_data_rank, what="build the datasets")
