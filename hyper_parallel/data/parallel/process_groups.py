"""The process groups of the packing scheduler: one caller-owned collection of this rank's TP, PP, DP and CP groups.

Owns: ``ProcessGroupCollection`` (this rank's ``tp``, ``pp``, ``dp``, ``cp``, ``dp_cp`` and ``tp_cp`` groups, plus the
``dynamic_cp`` and ``dynamic_tp_cp`` groups keyed by runtime CP size), its sizes and ranks, and ``from_mesh``, which
creates every group from a torch ``DeviceMesh`` in the same order on every rank. Not responsible for: choosing CP
sizes (``parallel.scheduling``), moving data (``parallel.batch_parallel``), or who reads
(``parallel.dataloader_parallel``, to which ``is_data_rank`` and ``parallel_context`` delegate).

Vocabulary: the scheduling domain is the ``dp * cp`` DP x CP ranks of one (TP, PP) coordinate; a rank's *position*
in it is ``dp_rank * cp + cp_rank`` (DP-major). A dynamic CP group of size ``c`` is an aligned block of ``c``
consecutive positions (positions ``[b*c, (b+1)*c)``) with the same TP and PP coordinates; its TP x CP group adds
every TP rank of those positions (``tp * c`` ranks).

Example, 8 ranks as DP2 x CP2 x TP2::

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    groups = ProcessGroupCollection.from_mesh(mesh, dynamic_cp_sizes=(1, 2, 4))
    # rank 5 (dp 1, cp 0, tp 1): position 2; dynamic_cp[2] holds ranks [5, 7], dynamic_cp[4] ranks [1, 3, 5, 7],
    # dynamic_tp_cp[2] ranks [4, 5, 6, 7]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any

import numpy as np

from hyper_parallel.data.errors import DataConfigError, require_int
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext

__all__ = ["PROCESS_GROUP_DIMENSIONS", "ProcessGroupCollection", "group_size_rank"]

PROCESS_GROUP_DIMENSIONS = ("pp", "dp", "cp", "tp")  # the grid's axes, outermost first, as the groups are built


def _dist():
    import torch.distributed as dist

    return dist


def _size(group) -> int:
    return 1 if group is None else _dist().get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else _dist().get_rank(group)


def group_size_rank(group) -> tuple[int, int]:
    """``(size, this rank's rank)`` in ``group``; ``(1, 0)`` for None (a group of this rank alone)."""
    return _size(group), _rank(group)


@dataclass(frozen=True)
class ProcessGroupCollection:
    """This rank's process groups for packed, context-parallel delivery; a group of None is size 1.

    Attributes:
        tp, pp, dp, cp: the tensor-, pipeline-, data- and (static) context-parallel groups.
        dp_cp: the DP x CP ranks of this rank's (TP, PP) coordinate, the scheduling domain.
        tp_cp: the TP x CP ranks of this rank's (DP, PP) coordinate (the static layout with sequence parallelism).
        dynamic_cp: runtime CP size -> this rank's group of that size (an aligned block of consecutive positions).
        dynamic_tp_cp: runtime CP size -> the TP x CP group of that block (``tp * size`` ranks).

    Raises:
        DataConfigError: a ``dynamic_cp`` or ``dynamic_tp_cp`` key that is not an integer >= 1, a group whose size
            is not its key (``tp * key`` for ``dynamic_tp_cp``), or a size that does not divide ``dp * cp``.
    """

    tp: Any = None
    pp: Any = None
    dp: Any = None
    cp: Any = None
    dp_cp: Any = None
    tp_cp: Any = None
    dynamic_cp: Mapping[int, Any] = field(default_factory=dict)
    dynamic_tp_cp: Mapping[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("dynamic_cp", "dynamic_tp_cp"):
            groups = getattr(self, name)
            if not isinstance(groups, Mapping):
                raise DataConfigError(
                    f"ProcessGroupCollection.{name} must map runtime CP sizes to groups, got {type(groups).__name__}"
                )
            checked = {}
            for size, group in groups.items():
                key = require_int(f"ProcessGroupCollection.{name} key", size, 1)
                self._check_dynamic_size(name, key, group)
                checked[key] = group
            object.__setattr__(self, name, MappingProxyType(dict(sorted(checked.items()))))

    def _check_dynamic_size(self, name: str, size: int, group) -> None:
        domain = self.dp_size * self.cp_size
        if domain % size:
            raise DataConfigError(
                f"ProcessGroupCollection.{name} has a group of runtime CP size {size}, which does not divide the "
                f"dp * cp = {domain} ranks of the scheduling domain; use sizes that divide {domain}"
            )
        expected = size * (self.tp_size if name == "dynamic_tp_cp" else 1)
        if group is not None and _size(group) != expected:
            raise DataConfigError(
                f"ProcessGroupCollection.{name}[{size}] holds {_size(group)} ranks, not {expected}"
                f"{' (tp * size)' if name == 'dynamic_tp_cp' else ''}; pass the group of that size"
            )

    # -- sizes and ranks ---------------------------------------------------------------------------------------------

    @property
    def tp_size(self) -> int:
        return _size(self.tp)

    @property
    def pp_size(self) -> int:
        return _size(self.pp)

    @property
    def dp_size(self) -> int:
        return _size(self.dp)

    @property
    def cp_size(self) -> int:
        return _size(self.cp)

    @property
    def tp_rank(self) -> int:
        return _rank(self.tp)

    @property
    def pp_rank(self) -> int:
        return _rank(self.pp)

    @property
    def dp_rank(self) -> int:
        return _rank(self.dp)

    @property
    def cp_rank(self) -> int:
        return _rank(self.cp)

    @property
    def position(self) -> int:
        """This rank's position in the DP x CP domain: ``dp_rank * cp_size + cp_rank``."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def dynamic_cp_sizes(self) -> tuple[int, ...]:
        """The runtime CP sizes a dynamic CP scheduler may choose, ascending."""
        return tuple(sorted(self.dynamic_cp))

    @property
    def is_data_rank(self) -> bool:
        """Whether this rank reads and schedules data: ``DataLoaderParallelContext.is_data_rank`` (TP rank 0 of PP
        stage 0), the one rule."""
        return self.parallel_context().is_data_rank

    def tp_src(self) -> int:
        """The global rank of TP rank 0 of this rank's TP group (this rank without a TP group)."""
        return self.parallel_context().tp_src

    def pp_src(self) -> int:
        """The global rank of PP stage 0 of this rank's PP group (this rank without a PP group)."""
        return self.parallel_context().pp_src

    def parallel_context(self) -> DataLoaderParallelContext:
        """The loader's view of this rank (DP, CP, TP, PP): ``DataLoaderParallelContext.from_groups`` of the
        ``dp``, ``cp``, ``tp`` and ``pp`` groups, read once."""
        return self._context

    @cached_property
    def _context(self) -> DataLoaderParallelContext:
        return DataLoaderParallelContext.from_groups(
            dp_group=self.dp, cp_group=self.cp, tp_group=self.tp, pp_group=self.pp
        )

    # -- building from a mesh ----------------------------------------------------------------------------------------

    @classmethod
    def from_mesh(cls, mesh, dynamic_cp_sizes: Sequence[int] = ()) -> ProcessGroupCollection:
        """This rank's groups from a ``DeviceMesh`` whose dimensions are named from ``dp``, ``cp``, ``tp``, ``pp``.

        Every rank must call it, with the same arguments: it creates the ``dp_cp``, ``tp_cp`` and dynamic groups of
        the whole grid in the same order everywhere (``torch.distributed.new_group``), each distinct set of ranks
        once; the ``tp``, ``pp``, ``dp`` and ``cp`` groups are the mesh's own (None for a dimension it lacks).

        Args:
            mesh: the ``DeviceMesh`` (any subset of the four dimensions, in any order).
            dynamic_cp_sizes: runtime CP sizes to create groups for; each must divide ``dp * cp``. Size 1 gives
                single-rank groups.

        Returns:
            The collection; ``dp_cp`` and ``tp_cp`` are None where they would hold one rank.

        Raises:
            DataConfigError: a mesh without dimension names or with an unknown one, a mesh whose ranks along a
                dimension do not follow its coordinates, or a dynamic CP size that is not an integer >= 1 dividing
                ``dp * cp``.

        Example: ``ProcessGroupCollection.from_mesh(init_device_mesh("cuda", (4, 2), mesh_dim_names=("dp", "cp")),
        dynamic_cp_sizes=(1, 2, 4, 8))``.
        """
        names = tuple(mesh.mesh_dim_names or ())
        unknown = [name for name in names if name not in PROCESS_GROUP_DIMENSIONS]
        if not names or unknown:
            what = f"dimension {unknown[0]!r} (of {list(names)})" if unknown else "no dimension names"
            raise DataConfigError(
                f"the DeviceMesh of shape {tuple(mesh.shape)} has {what}; name its dimensions from "
                f"{list(PROCESS_GROUP_DIMENSIONS)}, e.g. init_device_mesh(device, (2, 2), mesh_dim_names=('dp', 'cp'))"
            )
        grid = _grid(mesh, names)
        mesh_groups = {name: mesh.get_group(name) for name in names}
        for name, group in mesh_groups.items():
            if mesh.get_local_rank(name) != _rank(group):
                raise DataConfigError(
                    f"the DeviceMesh's {name} dimension orders its ranks {_dist().get_process_group_ranks(group)} "
                    f"against their coordinates; build the mesh with init_device_mesh (ranks increasing along "
                    "every dimension)"
                )
        pp, dp, cp, tp = grid.shape
        domain = dp * cp
        sizes = _dynamic_sizes(dynamic_cp_sizes, domain)
        me = _dist().get_rank()
        created = _GroupMaker(me)
        # Each family: every group of the grid, in one order; this rank keeps the one it belongs to.
        positions = grid.transpose(0, 3, 1, 2).reshape(pp, tp, domain)  # [pp, tp, position]
        dp_cp = created.family(positions.reshape(-1, domain)) if domain > 1 else None
        tp_cp = created.family(grid.reshape(pp * dp, cp * tp)) if cp * tp > 1 else None
        dynamic_cp, dynamic_tp_cp = {}, {}
        for size in sizes:
            dynamic_cp[size] = created.family(positions.reshape(-1, size))
            blocks = grid.reshape(pp, domain // size, size * tp)  # consecutive positions x every TP rank
            dynamic_tp_cp[size] = created.family(blocks.reshape(-1, size * tp))
        return cls(
            tp=mesh_groups.get("tp"),
            pp=mesh_groups.get("pp"),
            dp=mesh_groups.get("dp"),
            cp=mesh_groups.get("cp"),
            dp_cp=dp_cp,
            tp_cp=tp_cp,
            dynamic_cp=dynamic_cp,
            dynamic_tp_cp=dynamic_tp_cp,
        )


def _grid(mesh, names: tuple[str, ...]) -> np.ndarray:
    """The mesh's global ranks as int64 ``[pp, dp, cp, tp]`` (a missing dimension has size 1)."""
    ranks = mesh.mesh.detach().cpu().numpy().astype(np.int64)
    order = [names.index(name) for name in PROCESS_GROUP_DIMENSIONS if name in names]
    ranks = ranks.transpose(order)
    shape = [mesh.size(names.index(name)) if name in names else 1 for name in PROCESS_GROUP_DIMENSIONS]
    return ranks.reshape(shape)


def _dynamic_sizes(dynamic_cp_sizes: Sequence[int], domain: int) -> tuple[int, ...]:
    if isinstance(dynamic_cp_sizes, str | bytes) or not isinstance(dynamic_cp_sizes, Sequence):
        raise DataConfigError(
            f"dynamic_cp_sizes must be a list of runtime CP sizes, got {dynamic_cp_sizes!r}; e.g. (1, 2, 4)"
        )
    sizes = sorted({require_int("dynamic_cp_sizes entry", size, 1) for size in dynamic_cp_sizes})
    bad = [size for size in sizes if domain % size]
    if bad:
        divisors = [c for c in range(1, domain + 1) if domain % c == 0]
        raise DataConfigError(
            f"dynamic_cp_sizes holds {bad[0]}, which does not divide the dp * cp = {domain} ranks of the scheduling "
            f"domain (a dynamic CP group is an aligned block of positions); choose sizes from {divisors}"
        )
    return tuple(sizes)


class _GroupMaker:
    """Creates each distinct set of ranks once; every rank makes the same calls in the same order."""

    def __init__(self, me: int) -> None:
        self.me = me
        self.groups: dict[tuple[int, ...], Any] = {}

    def family(self, members: np.ndarray) -> Any:
        """Create the groups of every row of ``members``; return this rank's."""
        mine = None
        for row in members.tolist():
            key = tuple(sorted(row))
            if key not in self.groups:
                self.groups[key] = _dist().new_group(list(key))
            if self.me in key:
                mine = self.groups[key]
        if mine is None:  # pragma: no cover - every rank is in every family's grid
            raise DataConfigError(f"global rank {self.me} is in none of the groups {members.tolist()}")
        return mine
