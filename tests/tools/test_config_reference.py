"""Specification of the configuration reference (``hp-data config-reference``, ``docs/configuration.md``).

The committed reference is what the code gives now; every parameter of the pipeline's targets and every field of
their settings is in it, under the ``_target_`` a config writes; the values the pipeline gives are marked, and
what it is declared to give each node is what ``build_dataloaders`` passes (recorded by targets of this module);
``--check`` fails on a stale file and names the command that regenerates it.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from hyper_parallel.data.batching import (
    BatchLayout,
    DynamicBatchDataLoader,
    FixedBatchDataLoader,
    ParallelBatch,
    SamplerOptions,
    TextTokenBatcher,
    WorkerOptions,
    build_indexed_collate_fn,
    build_online_text_collate_fn,
)
from hyper_parallel.data.batching.dataloader import NODES, build_dataloaders
from hyper_parallel.data.batching.pipeline_nodes import RUNTIME_VALUES
from hyper_parallel.data.indexed.indexed_data_config import IndexedDataConfig
from hyper_parallel.data.instantiate import check_config
from hyper_parallel.data.parallel.data_schedule_utils import PackingSchedulerConfig
from hyper_parallel.data.text.build_data_transform import (
    IdentityDataTransform,
    PlaintextTransform,
    TextConversationTransform,
    build_llm_data_transform,
)
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset, build_online_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer
from hyper_parallel.data.text.chat_template import build_chat_template
from hyper_parallel.data.text.online.online_dataset import OnlineDataConfig
from hyper_parallel.data.tools.cli import main
from hyper_parallel.data.tools.config_reference import pipeline_values, render_reference
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "hp-data config-reference --output docs/configuration.md"

# The targets the examples and docs write, by the _target_ they write it with.
TARGETS = {
    "hyper_parallel.data.text.build_dataset.build_online_text_dataset": build_online_text_dataset,
    "hyper_parallel.data.text.build_dataset.build_indexed_text_dataset": build_indexed_text_dataset,
    "hyper_parallel.data.text.build_data_transform.build_llm_data_transform": build_llm_data_transform,
    "hyper_parallel.data.text.online.online_dataset.OnlineDataConfig": OnlineDataConfig,
    "hyper_parallel.data.indexed.indexed_data_config.IndexedDataConfig": IndexedDataConfig,
    "hyper_parallel.data.batching.build_online_text_collate_fn": build_online_text_collate_fn,
    "hyper_parallel.data.batching.build_indexed_collate_fn": build_indexed_collate_fn,
    "hyper_parallel.data.batching.FixedBatchDataLoader": FixedBatchDataLoader,
    "hyper_parallel.data.batching.DynamicBatchDataLoader": DynamicBatchDataLoader,
    "hyper_parallel.data.batching.TextTokenBatcher": TextTokenBatcher,
    "hyper_parallel.data.batching.ParallelBatch": ParallelBatch,
    "hyper_parallel.data.parallel.data_schedule_utils.PackingSchedulerConfig": PackingSchedulerConfig,
    "hyper_parallel.data.text.build_tokenizer.build_tokenizer": build_tokenizer,
    "hyper_parallel.data.text.chat_template.build_chat_template": build_chat_template,
}
TRANSFORMS = {
    "plaintext": PlaintextTransform,
    "conversation": TextConversationTransform,
    "identity": IdentityDataTransform,
}
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


@pytest.fixture(scope="module")
def reference() -> str:
    return render_reference()


def _sections(text: str) -> dict[str, str]:
    """Heading line -> the text up to the next heading."""
    parts = re.split(r"^(#{2,4} .*)$", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def _section_of_target(text: str, target: str) -> str:
    found = [body for body in _sections(text).values() if f"`_target_: {target}`" in body]
    assert len(found) == 1, f"{target} is documented {len(found)} times"
    return found[0]


def _rows(section: str) -> dict[str, list[str]]:
    """The table rows of a section by their first cell's name: ``{name: [cells...]}``."""
    rows = {}
    for line in section.splitlines():
        match = re.match(r"^\| `(\w+)` \|", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
    return rows


def _parameters(obj) -> list[str]:
    return [name for name, p in inspect.signature(obj).parameters.items() if p.kind not in _VARIADIC]


# -- the committed file --------------------------------------------------------------------------------------------


def test_the_committed_reference_is_what_the_code_gives(reference):
    """docs/configuration.md is never stale: it equals the reference generated from the code now."""
    committed = COMMITTED.read_text(encoding="utf-8") if COMMITTED.is_file() else ""
    assert committed == reference, (
        f"docs/configuration.md is out of date with the code; regenerate it with `{REGENERATE}`"
    )


def test_the_reference_is_deterministic(reference):
    """Two renders are the same and show no object address (the committed file, written by another process, is
    compared above)."""
    assert render_reference() == reference
    assert not re.search(r"0x[0-9a-f]{6,}", reference)


# -- what it holds -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_parameter_and_field_of_each_target_is_documented_under_its_target(reference, target):
    """Each target a config names has its own section, headed by the ``_target_`` line a config writes (which a
    config may name), with a row for every parameter (or dataclass field) and a description for each."""
    check_config({"_target_": target, "_partial_": True})  # the documented target is one a config may name
    obj = TARGETS[target]
    expected = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else _parameters(obj)
    rows = _rows(_section_of_target(reference, target))
    assert list(rows) == expected
    assert all(cells[-1] for cells in rows.values())


@pytest.mark.parametrize("data_type", sorted(TRANSFORMS))
def test_every_option_of_each_data_type_is_documented(reference, data_type):
    """build_llm_data_transform passes its keyword options to the transform of the data type: each has a row."""
    transform = TRANSFORMS[data_type]
    options = [
        name
        for name, p in inspect.signature(transform.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    (section,) = [
        body for heading, body in _sections(reference).items() if heading.startswith(f"#### data_type: {data_type} ")
    ]
    assert list(_rows(section)) == options


def test_the_loaders_list_every_loader_option_with_its_group_description(reference):
    """Both loaders document every field of the three option groups; the dynamic loader borrows the fixed loader's
    and the groups' descriptions."""
    option_names = [f.name for group in (BatchLayout, SamplerOptions, WorkerOptions) for f in dataclasses.fields(group)]
    for loader in ("FixedBatchDataLoader", "DynamicBatchDataLoader"):
        rows = _rows(_section_of_target(reference, f"hyper_parallel.data.batching.{loader}"))
        assert set(option_names) <= set(rows)
        assert rows["num_workers"][-1] == "worker processes that fetch and transform (0: the main process does)."
        assert rows["dataset"][-1].startswith("the dataset of this DP rank")
    scheduler = _rows(
        _section_of_target(reference, "hyper_parallel.data.parallel.data_schedule_utils.PackingSchedulerConfig")
    )
    # one docstring entry names two fields: both rows carry it
    assert scheduler["cost_linear"][-1] == scheduler["cost_quadratic"][-1]
    assert "estimated cost" in scheduler["cost_linear"][-1]


def test_offline_preparation_fields_are_documented_with_their_flags(reference):
    """Every OfflinePreparationConfig field has a row naming the hp-data prepare flag that sets it."""
    (section,) = [body for heading, body in _sections(reference).items() if heading == "### OfflinePreparationConfig"]
    rows = _rows(section)
    assert list(rows) == [f.name for f in dataclasses.fields(OfflinePreparationConfig)]
    assert rows["token_dtype"][1] == "`--dtype`"
    assert rows["pack_to_seq_len"][1] == "`--pack-to-seq-len`"
    assert rows["workers"][3] == "computed when built"  # the CPU count of the machine that runs it: not rendered


def test_every_top_level_node_is_described(reference):
    """The node table has one described row per node of a pipeline config, required ones marked."""
    (table,) = [body for heading, body in _sections(reference).items() if heading == "## Top-level nodes"]
    rows = {}
    for line in table.splitlines():
        match = re.match(r"^\| \[`(\w+)`\]", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
    assert list(rows) == list(NODES)
    assert {node for node, cells in rows.items() if cells[1] == "yes"} == {"dataset", "dataloader"}
    assert all(cells[2] and cells[2] != "(no description)" for cells in rows.values())
    for node in NODES:
        assert f"## The {node} node" in reference


# -- values given by the pipeline ----------------------------------------------------------------------------------

GIVEN_COLUMN = 3


@pytest.mark.parametrize(
    ("target", "given", "not_given"),
    [
        (
            "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
            ("tokenizer", "dp_rank", "dp_world_size", "seed"),
            ("data_path", "data_transform", "data_config"),
        ),
        (
            "hyper_parallel.data.text.build_dataset.build_indexed_text_dataset",
            ("tokenizer", "seed", "layout", "train_valid_test_num_samples"),
            ("data_path",),
        ),
        ("hyper_parallel.data.text.build_data_transform.build_llm_data_transform", ("tokenizer",), ("data_type",)),
        (
            "hyper_parallel.data.batching.FixedBatchDataLoader",
            ("dataset", "collate_fn", "micro_batch_size", "global_batch_size", "dp_rank", "dp_world_size", "seed"),
            ("num_workers", "sampler_type", "drop_last"),
        ),
        (
            "hyper_parallel.data.batching.DynamicBatchDataLoader",
            ("dataset", "collate_fn", "micro_batch_size", "seed", "layout"),
            ("max_seq_len", "min_buffered_samples", "packing_policy"),
        ),
        (
            "hyper_parallel.data.batching.build_online_text_collate_fn",
            ("tokenizer", "layout"),
            (
                "sequence_multiple",
                "pad_token_id",
                "position_ids",
                "cp_size",
                "tp_size",
                "sequence_parallel",
                "cp_layout",
            ),
        ),
        ("hyper_parallel.data.batching.build_indexed_collate_fn", ("tokenizer", "layout"), ("eod_token_id",)),
        (
            "hyper_parallel.data.batching.ParallelBatch",
            ("parallel_context", "eod_token_id"),
            ("source_type", "cp_layout", "attention_mode"),
        ),
        (
            "hyper_parallel.data.parallel.data_schedule_utils.PackingSchedulerConfig",
            ("sequence_parallel",),
            ("max_seqlen_per_dp_cp_rank", "scheduler", "pad_token_id"),
        ),
        ("hyper_parallel.data.indexed.indexed_data_config.IndexedDataConfig", (), ("random_seed", "seq_length")),
        ("hyper_parallel.data.text.chat_template.build_chat_template", ("tokenizer",), ("name_or_template",)),
        ("hyper_parallel.data.text.build_tokenizer.build_tokenizer", (), ("name_or_path", "chat_template")),
    ],
)
def test_values_given_by_the_pipeline_are_marked(reference, target, given, not_given):
    """The tokenizer, batch sizes, ranks, seed, built dataset and collator, parallel context, EOD id and the batch
    layout are marked where the pipeline passes them (each node's row of the node table); settings the config
    writes are not, nor values another node receives (the loose CP/TP keywords of the Online collator)."""
    rows = _rows(_section_of_target(reference, target))
    assert [name for name in given if not rows[name][GIVEN_COLUMN]] == []
    assert [name for name in not_given if rows[name][GIVEN_COLUMN]] == []


def test_transform_options_are_not_marked_as_given(reference):
    """The transforms' options reach them through build_llm_data_transform's **kwargs, which the pipeline's values
    never fill: none is marked, whatever its name."""
    for data_type in TRANSFORMS:
        (section,) = [b for h, b in _sections(reference).items() if h.startswith(f"#### data_type: {data_type} ")]
        assert [name for name, cells in _rows(section).items() if cells[GIVEN_COLUMN]] == []


# Targets of this module that record the names build_dataloaders offers them. Each takes every name any documented
# target has, and every runtime value, so whatever the pipeline offers is recorded.
RECORDED: dict[str, dict] = {}
_OFFERABLE = sorted(
    {name for obj in TARGETS.values() for name in _parameters(obj)}
    | {name for name in inspect.signature(build_dataloaders).parameters}
    | {name for transform in TRANSFORMS.values() for name in _parameters(transform)}
    | set(RUNTIME_VALUES)
)


def _recording(name: str, key: str, built):
    """A target ``name`` of this module that records what it is offered under ``key`` and returns ``built``."""

    def record(**offered):
        RECORDED[key] = offered
        return built() if callable(built) else built

    record.__name__ = record.__qualname__ = name
    record.__signature__ = inspect.Signature(
        [inspect.Parameter(offerable, inspect.Parameter.KEYWORD_ONLY, default=None) for offerable in _OFFERABLE]
    )
    return record


record_tokenizer = _recording(
    "record_tokenizer", "model_assets.tokenizer", lambda: build_tokenizer(BUNDLED_TOKENIZER_PATH)
)
record_chat_template = _recording("record_chat_template", "model_assets.chat_template", "a chat template")
record_dataset = _recording("record_dataset", "dataset", "a dataset")
record_collate_fn = _recording("record_collate_fn", "collate_fn", "a collator")
record_dataloader = _recording("record_dataloader", "dataloader", "a loader")
record_get_batch = _recording("record_get_batch", "get_batch", "a get_batch")
record_packing_scheduler = _recording(
    "record_packing_scheduler", "packing_scheduler", lambda: PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=64)
)
ALLOWED = ("hyper_parallel.", f"{__name__}.")


def _node(name: str) -> dict:
    return {"_target_": f"{__name__}.record_{name}"}


def _build(config: dict, **runtime) -> dict[str, dict]:
    RECORDED.clear()
    build_dataloaders(config, allowed_prefixes=ALLOWED, **runtime)
    return dict(RECORDED)


def _declared(node: str, *conditional_absent: str) -> set[str]:
    return set(pipeline_values(node)) - set(conditional_absent)


def test_the_declared_values_are_what_build_dataloaders_passes_each_node():
    """pipeline_values (the reference's "Given by the pipeline") names exactly what build_dataloaders offers each
    node: recorded with and without a chat template, with a ParallelBatch get_batch node and with a packing
    scheduler."""
    base = {"dataset": _node("dataset"), "collate_fn": _node("collate_fn"), "dataloader": _node("dataloader")}
    assets = {"model_assets": {"tokenizer": _node("tokenizer"), "chat_template": _node("chat_template")}}

    recorded = _build({**base, **assets, "get_batch": _node("get_batch")}, seed=3)
    assert set(recorded["model_assets.tokenizer"]) == set()  # built first, with nothing offered
    assert set(recorded["model_assets.chat_template"]) == _declared("model_assets") == {"tokenizer"}
    for node in ("dataset", "dataloader", "get_batch"):
        assert set(recorded[node]) == _declared(node), node
    # the plan is offered only by a ParallelBatch
    assert set(recorded["collate_fn"]) == _declared("collate_fn", "delivery_plan")
    assert recorded["dataloader"]["dataset"] == "a dataset" and recorded["dataloader"]["collate_fn"] == "a collator"
    assert recorded["dataset"]["chat_template"] == "a chat template"

    with_parallel_batch = {
        **base,
        "get_batch": {"_target_": "hyper_parallel.data.batching.ParallelBatch", "source_type": "online"},
    }
    recorded = _build(with_parallel_batch, tokenizer=str(BUNDLED_TOKENIZER_PATH))
    assert set(recorded["collate_fn"]) == _declared("collate_fn")
    assert recorded["collate_fn"]["layout"].cp_layout == "contiguous"
    assert recorded["collate_fn"]["delivery_plan"].cp_layout == "contiguous"
    assert set(recorded["dataset"]) == _declared("dataset", "chat_template", "seed")

    scheduled = {**base, "packing_scheduler": _node("packing_scheduler")}
    recorded = _build(scheduled, cp_size=2, tp_size=2, sequence_parallel=True, micro_batch_size=3)
    assert set(recorded["packing_scheduler"]) == _declared("packing_scheduler")
    assert recorded["packing_scheduler"]["sequence_parallel"] is True
    # the collator under a scheduler does not pad: it is given a layout without CP or TP, as documented
    layout = recorded["collate_fn"]["layout"]
    assert "delivery_plan" not in recorded["collate_fn"]  # the scheduler re-packs the loader's rows
    assert (layout.cp_size, layout.tp_size, layout.sequence_parallel) == (1, 1, False)
    assert recorded["dataloader"]["micro_batch_size"] == 3


# -- the command ---------------------------------------------------------------------------------------------------


def test_output_writes_the_reference_and_check_accepts_it(tmp_path, capsys, reference):
    path = tmp_path / "configuration.md"
    assert main(["config-reference", "--output", str(path)]) == 0
    assert path.read_text(encoding="utf-8") == reference
    assert main(["config-reference", "--check", str(path)]) == 0
    assert "is up to date" in capsys.readouterr().out
    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out == reference


def test_check_fails_on_a_stale_file_and_names_the_command_that_regenerates_it(tmp_path, capsys, reference):
    """A changed row, a missing final newline or a missing file: exit 1, the message says which line differs and
    how to regenerate it."""
    path = tmp_path / "configuration.md"
    lines = reference.splitlines(keepends=True)
    row = next(index for index, line in enumerate(lines) if line.startswith("| `seq_length` |"))
    lines[row] = lines[row].replace("tokens per sample", "tokens per row")
    path.write_text("".join(lines), encoding="utf-8")
    assert main(["config-reference", "--check", str(path)]) == 1
    error = capsys.readouterr().err
    assert f"{path} is out of date" in error and f"line {row + 1}:" in error and "tokens per row" in error
    assert error.rstrip().endswith(f"regenerate it with `hp-data config-reference --output {path}`")

    path.write_text(reference.rstrip("\n"), encoding="utf-8")
    assert main(["config-reference", "--check", str(path)]) == 1
    assert "final newline" in capsys.readouterr().err

    missing = tmp_path / "absent.md"
    assert main(["config-reference", "--check", str(missing)]) == 1
    assert f"{missing} does not exist; write it with `hp-data config-reference --output {missing}`" in (
        capsys.readouterr().err
    )


def test_output_into_a_missing_directory_is_refused(tmp_path, capsys):
    target = tmp_path / "no" / "configuration.md"
    assert main(["config-reference", "--output", str(target)]) == 2
    assert "does not exist; create it first" in capsys.readouterr().err
    assert not target.exists()


def test_help_names_the_command_and_output_and_check_exclude_each_other(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["config-reference", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hp-data config-reference ")
    assert "--output PATH" in out and "--check PATH" in out and REGENERATE in out
    assert main(["--help"]) == 0
    assert "  config-reference " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["config-reference", "--output", str(tmp_path / "a.md"), "--check", str(tmp_path / "b.md")])
    assert exit_info.value.code == 2
