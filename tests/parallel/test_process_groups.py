"""ProcessGroupCollection over real gloo ranks: from_mesh on torch's init_device_mesh, every group checked.

Each group's expected members are derived from the rank grid by brute force (every rank with the same TP and PP
coordinates whose DP x CP position falls in the same aligned block), and each group is used: an all-reduce of the
global ranks over it must give the sum of those members.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.parallel.process_groups import ProcessGroupCollection
from parallel.launch import launch

DIMS = ("pp", "dp", "cp", "tp")


def members(group) -> list[int]:
    return [] if group is None else torch.distributed.get_process_group_ranks(group)


def summed(group, rank: int) -> int:
    value = torch.tensor([rank])
    if group is not None:
        torch.distributed.all_reduce(value, group=group)
    return int(value)


def describe_groups(rank: int, world_size: int, shape: tuple[int, ...], names: tuple[str, ...], sizes) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    groups = ProcessGroupCollection.from_mesh(mesh, dynamic_cp_sizes=sizes)
    report = {name: members(getattr(groups, name)) for name in ("tp", "pp", "dp", "cp", "dp_cp", "tp_cp")}
    report["sizes"] = [groups.tp_size, groups.pp_size, groups.dp_size, groups.cp_size]
    report["position"] = groups.position
    report["dynamic_cp"] = {str(c): members(g) for c, g in groups.dynamic_cp.items()}
    report["dynamic_tp_cp"] = {str(c): members(g) for c, g in groups.dynamic_tp_cp.items()}
    report["sums"] = {str(c): summed(g, rank) for c, g in groups.dynamic_cp.items()}
    report["tp_cp_sums"] = {str(c): summed(g, rank) for c, g in groups.dynamic_tp_cp.items()}
    context = groups.parallel_context()
    report["context"] = [context.dp_rank, context.cp_rank, context.tp_rank, context.tp_src]
    return report


def error_cases(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    unnamed = init_device_mesh("cpu", (4,))
    odd = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    outcomes = {}
    for name, call in {
        "size 3 of 4": lambda: ProcessGroupCollection.from_mesh(mesh, dynamic_cp_sizes=(1, 3)),
        "size 0": lambda: ProcessGroupCollection.from_mesh(mesh, dynamic_cp_sizes=(0,)),
        "size as text": lambda: ProcessGroupCollection.from_mesh(mesh, dynamic_cp_sizes="2"),
        "unnamed": lambda: ProcessGroupCollection.from_mesh(unnamed),
        "unknown dim": lambda: ProcessGroupCollection.from_mesh(odd),
        "wrong group size": lambda: ProcessGroupCollection(
            dp=mesh.get_group("dp"), cp=mesh.get_group("cp"), dynamic_cp={4: mesh.get_group("cp")}
        ),
    }.items():
        try:
            call()
            outcomes[name] = None
        except DataConfigError as error:
            outcomes[name] = str(error)
    return outcomes


def grids(rank: int, world_size: int) -> dict:
    """Every case of one launch: the 8-rank DP2 x CP2 x TP2 grid, then a PP2 x CP2 x TP2 one, then the errors."""
    reports = {"dp_cp_tp": describe_groups(rank, world_size, (2, 2, 2), ("dp", "cp", "tp"), (1, 2, 4))}
    reports["pp_cp_tp"] = describe_groups(rank, world_size, (2, 2, 2), ("pp", "cp", "tp"), (2, 1))
    reports["tp_dp_cp"] = describe_groups(rank, world_size, (2, 2, 2), ("tp", "dp", "cp"), (4,))
    reports["errors"] = error_cases(rank, world_size) if rank < 4 else None
    return reports


def coordinates(rank: int, shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, int]:
    """``rank``'s coordinate along each of the four dimensions (0 for a missing one); the last axis is fastest."""
    place, rest = {}, rank
    for name, size in reversed(list(zip(names, shape, strict=True))):
        place[name], rest = rest % size, rest // size
    return {name: place.get(name, 0) for name in DIMS}


def expected(rank: int, shape, names, size: int, with_tp: bool) -> list[int]:
    """Brute force: the ranks sharing ``rank``'s PP (and TP unless ``with_tp``) coordinate whose position is in the
    same aligned block of ``size`` positions."""
    sizes = {name: dict(zip(names, shape, strict=True)).get(name, 1) for name in DIMS}
    me = coordinates(rank, shape, names)

    def position(c):
        return c["dp"] * sizes["cp"] + c["cp"]

    found = []
    for other in range(8):
        c = coordinates(other, shape, names)
        if c["pp"] == me["pp"] and (with_tp or c["tp"] == me["tp"]) and position(c) // size == position(me) // size:
            found.append(other)
    return found


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    found = launch(functools.partial(grids), tmp_path_factory.mktemp("groups"), world_size=8)
    assert [report.get("error") for report in found] == [None] * 8
    return [report["value"] for report in found]


@pytest.mark.parametrize(
    ("case", "shape", "names", "sizes"),
    [
        ("dp_cp_tp", (2, 2, 2), ("dp", "cp", "tp"), (1, 2, 4)),
        ("pp_cp_tp", (2, 2, 2), ("pp", "cp", "tp"), (1, 2)),
        ("tp_dp_cp", (2, 2, 2), ("tp", "dp", "cp"), (4,)),
    ],
)
def test_from_mesh_builds_every_group_of_the_grid(reports, case, shape, names, sizes):
    dims = dict(zip(names, shape, strict=True))
    domain = dims.get("dp", 1) * dims.get("cp", 1)
    for rank, report in enumerate(r[case] for r in reports):
        me = coordinates(rank, shape, names)
        assert report["sizes"] == [dims.get(name, 1) for name in ("tp", "pp", "dp", "cp")]
        assert report["position"] == me["dp"] * dims.get("cp", 1) + me["cp"]
        for name in ("tp", "pp", "dp", "cp"):
            if name not in dims:
                assert report[name] == []
                continue
            along = [o for o in range(8) if all(coordinates(o, shape, names)[d] == me[d] for d in DIMS if d != name)]
            assert report[name] == along
        assert report["dp_cp"] == (expected(rank, shape, names, domain, False) if domain > 1 else [])
        same_dp = [o for o in range(8) if all(coordinates(o, shape, names)[d] == me[d] for d in ("pp", "dp"))]
        assert report["tp_cp"] == same_dp
        assert sorted(report["dynamic_cp"]) == [str(c) for c in sorted(sizes)]
        for c in sizes:
            group = expected(rank, shape, names, c, False)
            assert report["dynamic_cp"][str(c)] == group and report["sums"][str(c)] == sum(group)
            tp_group = expected(rank, shape, names, c, True)
            assert len(tp_group) == c * dims.get("tp", 1)
            assert report["dynamic_tp_cp"][str(c)] == tp_group and report["tp_cp_sums"][str(c)] == sum(tp_group)
        dp_rank, cp_rank, tp_rank, tp_src = report["context"]
        assert (dp_rank, cp_rank, tp_rank) == (me["dp"], me["cp"], me["tp"])
        assert tp_src == min(
            o for o in range(8) if all(coordinates(o, shape, names)[d] == me[d] for d in DIMS if d != "tp")
        )


def test_from_mesh_errors_name_the_setting(reports):
    for report in reports[:4]:
        errors = report["errors"]
        assert "dynamic_cp_sizes holds 3" in errors["size 3 of 4"] and "[1, 2, 4]" in errors["size 3 of 4"]
        assert "dynamic_cp_sizes entry must be an integer >= 1, got 0" in errors["size 0"]
        assert "dynamic_cp_sizes must be a list" in errors["size as text"]
        assert "no dimension names" in errors["unnamed"]
        assert "'ep'" in errors["unknown dim"] and "['pp', 'dp', 'cp', 'tp']" in errors["unknown dim"]
        assert "dynamic_cp[4] holds 2 ranks, not 4" in errors["wrong group size"]


def test_a_collection_without_groups_is_one_rank():
    groups = ProcessGroupCollection()
    assert (groups.tp_size, groups.pp_size, groups.dp_size, groups.cp_size, groups.position) == (1, 1, 1, 1, 0)
    assert groups.is_data_rank and groups.dynamic_cp_sizes == ()
    assert groups.parallel_context().dp_size == 1
    single = ProcessGroupCollection(dynamic_cp={1: None})
    assert single.dynamic_cp_sizes == (1,)


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({0: None}, "key must be an integer >= 1, got 0"),
        ({"2": None}, "key must be an integer >= 1"),
        ({2: None}, "does not divide the dp * cp = 1"),
    ],
)
def test_dynamic_keys_are_checked(mapping, message):
    with pytest.raises(DataConfigError, match=message.replace("*", r"\*")):
        ProcessGroupCollection(dynamic_cp=mapping)


def test_the_dynamic_groups_are_read_only():
    groups = ProcessGroupCollection(dynamic_cp={1: None})
    with pytest.raises(TypeError):
        groups.dynamic_cp[2] = None  # type: ignore[index]
    assert list(itertools.islice(groups.dynamic_cp, 2)) == [1]
