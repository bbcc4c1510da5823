"""Specification of who reads: a rank's place in the DP x CP x TP x PP grid, and building datasets on the data ranks.

The contexts are read from real torch ``DeviceMesh`` objects and process groups over gloo ranks
(``parallel.launch``) and compared with the grid arithmetic of ``grid_coordinates``; a data rank is TP rank 0 of
PP stage 0, and ``ProcessGroupCollection`` follows the same rule. ``build_on_data_ranks`` runs
on 8 ranks as DP2 x CP2 x TP2: rank 0 builds every cache entry, the other data ranks read them, the TP ranks that
do not read get None, and a failure on any data rank raises on every rank before the launcher's deadline.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from indexed.test_index_cache import write_corpus

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext, build_on_data_ranks
from hyper_parallel.data.parallel.process_groups import ProcessGroupCollection
from hyper_parallel.data.text.build_dataset import build_online_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from parallel.launch import grid_coordinates, grid_groups, launch
from parallel.test_build_barrier import build_and_digest

WORLD_SIZE = 8
GRID = (2, 2, 2)  # DP x CP x TP, TP varying fastest
DATA_RANKS = [0, 2, 4, 6]


PLACE_FIELDS = (
    "dp_rank", "dp_size", "cp_rank", "cp_size", "tp_rank", "tp_size", "pp_rank", "pp_size", "tp_src", "pp_src",
    "is_data_rank", "is_first_stage", "is_last_stage",
)  # fmt: skip


def _place(context: DataLoaderParallelContext) -> dict:
    place = {name: getattr(context, name) for name in PLACE_FIELDS}
    place["groups"] = [
        None if group is None else torch.distributed.get_process_group_ranks(group)
        for group in (context.dp_group, context.cp_group, context.tp_group, context.pp_group)
    ]
    return place


def _expected_place(rank: int, world_size: int, shape: tuple[int, ...], names: tuple[str, ...]) -> dict:
    """The place of ``rank`` in a mesh of ``shape`` named ``names``, from the grid arithmetic alone."""
    coordinates = dict(zip(names, grid_coordinates(rank, world_size, shape), strict=True))
    place, groups = {}, []
    for name in ("dp", "cp", "tp", "pp"):
        size = shape[names.index(name)] if name in names else 1
        place |= {f"{name}_rank": coordinates.get(name, 0), f"{name}_size": size}
        axis_groups = grid_groups(world_size, shape, names.index(name)) if size > 1 else []
        groups.append(next((g for g in axis_groups if rank in g), None))
    place["tp_src"] = groups[2][0] if groups[2] else rank
    place["pp_src"] = groups[3][0] if groups[3] else rank
    place["is_data_rank"] = place["tp_rank"] == 0 and place["pp_rank"] == 0
    place["is_first_stage"] = place["pp_rank"] == 0
    place["is_last_stage"] = place["pp_rank"] == place["pp_size"] - 1
    place["groups"] = groups
    return place


MESHES = [
    ((2, 2, 2), ("dp", "cp", "tp")),
    ((2, 4), ("tp", "dp")),
    ((8,), ("cp",)),
    ((4, 2), ("cp", "tp")),
    ((2, 2, 2), ("pp", "dp", "tp")),
    ((4, 2), ("pp", "tp")),
    ((2, 2, 2), ("tp", "pp", "cp")),
]


def places_in_meshes(rank: int, world_size: int) -> dict:
    """Every rank reads its place from several meshes, then from meshes the data loader refuses."""
    from torch.distributed.device_mesh import init_device_mesh

    places = [
        _place(DataLoaderParallelContext.from_mesh(init_device_mesh("cpu", s, mesh_dim_names=n))) for s, n in MESHES
    ]
    errors = []
    for names in (("dp", "ep"), None):
        try:
            DataLoaderParallelContext.from_mesh(init_device_mesh("cpu", (4, 2), mesh_dim_names=names))
        except DataConfigError as error:
            errors.append(str(error))
    return {"places": places, "errors": errors}


def test_a_device_mesh_gives_each_rank_its_place_and_whether_it_reads(tmp_path):
    reports = launch(places_in_meshes, tmp_path, WORLD_SIZE)

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    for rank, report in enumerate(reports):
        expected = [_expected_place(rank, WORLD_SIZE, shape, names) for shape, names in MESHES]
        assert report["value"]["places"] == expected, rank
        unknown, unnamed = report["value"]["errors"]
        assert unknown.startswith("the DeviceMesh dimension 'ep' (of ['dp', 'ep']) is not one the data loader knows")
        assert "name the dimensions from ['dp', 'cp', 'tp', 'pp']" in unknown
        assert unnamed.startswith("the DeviceMesh of shape (4, 2) has no dimension names; create it with")
    # DP2 x CP2 x TP2: rank 5 is dp 1, cp 0, tp 1 and receives rank 4's batches
    assert {k: reports[5]["value"]["places"][0][k] for k in ("dp_rank", "cp_rank", "tp_rank", "tp_src")} == {
        "dp_rank": 1,
        "cp_rank": 0,
        "tp_rank": 1,
        "tp_src": 4,
    }
    # PP2 x DP2 x TP2: the data ranks are TP rank 0 of stage 0 only; rank 5 (pp 1, dp 0, tp 1) takes rank 1's batches
    pp_mesh = 4
    assert [rank for rank in range(WORLD_SIZE) if reports[rank]["value"]["places"][pp_mesh]["is_data_rank"]] == [0, 2]
    assert {
        k: reports[5]["value"]["places"][pp_mesh][k] for k in ("pp_rank", "tp_rank", "pp_src", "is_last_stage")
    } == {
        "pp_rank": 1,
        "tp_rank": 1,
        "pp_src": 1,
        "is_last_stage": True,
    }


GROUP_GRID, GROUP_NAMES = (2, 2, 2), ("pp", "cp", "tp")  # PP2 x CP2 x TP2, TP varying fastest


def places_from_groups(rank: int, world_size: int) -> dict:
    """The grid's groups give the same places as the mesh; groups that do not form a grid are refused."""
    mine = {}
    for axis, name in enumerate(GROUP_NAMES):
        for ranks in grid_groups(world_size, GROUP_GRID, axis):
            group = torch.distributed.new_group(ranks)
            mine[name] = group if rank in ranks else mine.get(name)
    groups = {f"{name}_group": mine[name] for name in GROUP_NAMES}
    place = _place(DataLoaderParallelContext.from_groups(**groups))
    without_tp = _place(DataLoaderParallelContext.from_groups(pp_group=mine["pp"], cp_group=mine["cp"]))
    # Groups meeting only in rank 0, of sizes 4, 2 and 2: 16 ranks, more than the world.
    wide = [torch.distributed.new_group(ranks) for ranks in ([0, 1, 2, 3], [0, 4], [0, 5])]
    errors = []
    for refused in (
        {"pp_group": mine["pp"], "tp_group": mine["pp"]},
        dict(zip(("dp_group", "cp_group", "tp_group"), wide, strict=True)),
    ):
        try:
            DataLoaderParallelContext.from_groups(**refused)
        except DataConfigError as error:
            errors.append(str(error))
    return {"place": place, "without_tp": without_tp, "errors": errors}


def test_process_groups_give_each_rank_its_place_and_groups_that_are_no_grid_are_refused(tmp_path):
    reports = launch(places_from_groups, tmp_path, WORLD_SIZE)

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    for rank, report in enumerate(reports):
        value = report["value"]
        assert value["place"] == _expected_place(rank, WORLD_SIZE, GROUP_GRID, GROUP_NAMES)
        assert value["without_tp"] | {"groups": None} == value["place"] | {
            "tp_rank": 0,
            "tp_size": 1,
            "tp_src": rank,
            "is_data_rank": value["place"]["pp_rank"] == 0,  # without TP, every rank of stage 0 reads
            "groups": None,
        }
        same, wide = value["errors"]
        pp_group = value["place"]["groups"][3]
        assert same.startswith(f"the tp_group {pp_group} and the pp_group {pp_group} of global rank {rank} share")
        if rank == 0:
            assert wide.startswith("the group sizes {'dp': 4, 'cp': 2, 'tp': 2} multiply to 16, more than the world")
        elif rank in (1, 2, 3):
            assert wide.startswith(f"global rank {rank} is not a member of the cp_group it was given")
        else:
            assert wide.startswith(f"global rank {rank} is not a member of the dp_group it was given")
    # stage 0 of PP2 x CP2 x TP2 holds ranks 0-3; its TP rank 0 of each CP rank reads
    assert [rank for rank, r in enumerate(reports) if r["value"]["place"]["is_data_rank"]] == [0, 2]


def collection_and_context(rank: int, world_size: int) -> list:
    """``ProcessGroupCollection`` asks the context who reads: one rule, over meshes with and without PP."""
    from torch.distributed.device_mesh import init_device_mesh

    answers = []
    for shape, names in MESHES:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        groups = ProcessGroupCollection.from_mesh(mesh)
        context = groups.parallel_context()
        answers.append([groups.is_data_rank, groups.tp_src(), groups.pp_src(), _place(context)])
    return answers


def test_the_process_group_collection_follows_the_one_data_rank_rule(tmp_path):
    reports = launch(collection_and_context, tmp_path, WORLD_SIZE)

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    for rank, report in enumerate(reports):
        for (shape, names), (is_data_rank, tp_src, pp_src, place) in zip(MESHES, report["value"], strict=True):
            expected = _expected_place(rank, WORLD_SIZE, shape, names)
            assert place == expected, (rank, names)
            assert [is_data_rank, tp_src, pp_src] == [expected["is_data_rank"], expected["tp_src"], expected["pp_src"]]


def test_a_single_process_context_reads_everything_itself():
    context = DataLoaderParallelContext.standalone()
    assert (context.dp_size, context.cp_size, context.tp_size, context.tp_src, context.is_data_rank) == (
        1,
        1,
        1,
        0,
        True,
    )
    assert build_on_data_ranks(context, lambda: "built") == "built"
    simulated = DataLoaderParallelContext(dp_rank=1, dp_size=2, cp_rank=1, cp_size=4, tp_rank=1, tp_size=2)
    assert not simulated.is_data_rank
    assert build_on_data_ranks(simulated, lambda: "built") is None
    later_stage = DataLoaderParallelContext(pp_rank=1, pp_size=3, pp_src=4)  # TP rank 0, but not on stage 0
    assert not later_stage.is_data_rank and not later_stage.is_first_stage and not later_stage.is_last_stage
    assert later_stage.batch_src == 4
    assert build_on_data_ranks(later_stage, lambda: "built") is None
    with pytest.raises(DataConfigError, match="pp_rank is 2, but pp_size is 2: a rank must be below its size"):
        DataLoaderParallelContext(pp_rank=2, pp_size=2)
    with pytest.raises(DataConfigError, match="cp_rank is 4, but cp_size is 4: a rank must be below its size"):
        DataLoaderParallelContext(cp_rank=4, cp_size=4)
    with pytest.raises(DataConfigError, match="tp_group was given, but torch.distributed is not initialised"):
        DataLoaderParallelContext.from_groups(tp_group=object())


# -- building on the data ranks -----------------------------------------------------------------------------------


def _grid_context(rank: int, world_size: int) -> DataLoaderParallelContext:
    from torch.distributed.device_mesh import init_device_mesh

    del rank
    return DataLoaderParallelContext.from_mesh(init_device_mesh("cpu", GRID, mesh_dim_names=("dp", "cp", "tp")))


def build_indexed_on_data_ranks(rank: int, world_size: int, data_path: list[str], cache: str, failing: int = -1):
    """Every rank asks for the Indexed datasets; the data ranks build them. Rank ``failing`` reads a missing file."""
    context = _grid_context(rank, world_size)
    if rank == failing:
        data_path = [data_path[0], f"{data_path[1]}_missing", *data_path[2:]]
    return build_on_data_ranks(context, lambda: build_and_digest(rank, world_size, data_path, cache))


@pytest.fixture
def blend(tmp_path) -> list[str]:
    return [
        "30",
        write_corpus(tmp_path / "a_text_document", 120, seed=1),
        "70",
        write_corpus(tmp_path / "b", 200, seed=2),
    ]


def _building(report: dict) -> list[str]:
    return [message for _, message in report["logs"] if message.startswith("building the")]


def test_rank_0_builds_every_index_once_and_the_other_data_ranks_read_it(tmp_path, blend):
    cache = str(tmp_path / "cache")
    reports = launch(functools.partial(build_indexed_on_data_ranks, data_path=blend, cache=cache), tmp_path, WORLD_SIZE)
    reference = build_and_digest(0, 1, blend, str(tmp_path / "reference"))

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    assert [r["value"] for r in reports] == [reference if rank in DATA_RANKS else None for rank in range(WORLD_SIZE)]
    built = [len(_building(r)) for r in reports]
    assert built[0] == 9 and built[1:] == [0] * (WORLD_SIZE - 1)  # 3 splits x (2 sources + 1 blend), by rank 0


@pytest.mark.parametrize("failing", [0, 2])
def test_a_failing_data_rank_makes_every_rank_raise_its_message(tmp_path, blend, failing):
    worker = functools.partial(
        build_indexed_on_data_ranks, data_path=blend, cache=str(tmp_path / "cache"), failing=failing
    )
    reports = launch(worker, tmp_path, WORLD_SIZE)

    own = reports[failing]["error"]
    assert own["type"] == "DataFileError" and "_missing" in own["message"]
    relayed = f"rank {failing} failed to build the datasets ({own['type']}: {own['message']}); see rank {failing}'s log"
    others = [rank for rank in range(WORLD_SIZE) if rank != failing]
    assert [reports[rank]["error"] for rank in others] == [{"type": "DataFileError", "message": relayed}] * len(others)


def online_samples(data_path: str, cache: str) -> list[list[int]]:
    """Build an Online mapping dataset (which writes its Arrow cache) and return its samples' token ids."""
    dataset = build_online_text_dataset(
        data_path,
        {"data_type": "plaintext", "max_seq_len": 64},
        {"dataset_type": "mapping", "cache_dir": cache},
        tokenizer=str(BUNDLED_TOKENIZER_PATH),
    )
    return [sample["input_ids"].tolist() for i in range(len(dataset)) for sample in dataset[i]]


def online_on_data_ranks(rank: int, world_size: int, data_path: str, cache: str):
    """The data ranks build an Online mapping dataset, rank 0 first; the other ranks get None."""
    return build_on_data_ranks(_grid_context(rank, world_size), lambda: online_samples(data_path, cache))


def test_the_data_ranks_build_an_online_mapping_source_rank_0_first(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": f"sentence {i} " * (1 + i % 5)}) + "\n" for i in range(12)))
    worker = functools.partial(online_on_data_ranks, data_path=str(path), cache=str(tmp_path / "hf_cache"))
    reports = launch(worker, tmp_path, WORLD_SIZE)
    reference = online_samples(str(path), str(tmp_path / "single_cache"))

    assert [r.get("error") for r in reports] == [None] * WORLD_SIZE
    assert len(reference) == 12
    assert [r["value"] for r in reports] == [reference if rank in DATA_RANKS else None for rank in range(WORLD_SIZE)]
