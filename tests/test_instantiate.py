"""Specification of ``hyper_parallel.data.instantiate``: YAML files to plain containers, ``_target_`` trees to objects
(depth-first, ``_args_``, ``_partial_``), runtime context offered by parameter name, and a ``DataConfigError`` naming
the YAML path for every bad node, raised before anything is built.

The targets below live in this module; ``ALLOWED`` adds it to the allowed prefixes."""

from __future__ import annotations

import functools
import importlib
import sys

import pytest
from omegaconf import OmegaConf

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.indexed_data_config import IndexedDataConfig
from hyper_parallel.data.instantiate import instantiate, load_config, load_config_text
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, TextTokenizer

HERE = __name__
ALLOWED = ("hyper_parallel.", f"{HERE}.")


# -- targets -------------------------------------------------------------------------------------------------------


def make_leaf(name, log, scale=1):
    log.append(name)
    return {"leaf": name, "scale": scale}


def make_parent(first, second, log, label="parent"):
    log.append(label)
    return {"label": label, "first": first, "second": second}


def total(*values, start=0):
    return start + sum(values)


def positional_only(a, b, /, c=0):
    return (a, b, c)


def needs_context(tokenizer, dp_rank, micro_batch_size=1, **options):
    return {"tokenizer": tokenizer, "dp_rank": dp_rank, "micro_batch_size": micro_batch_size, "options": options}


def make_transform(data_type, text_keys, max_seq_len, log):
    log.append("transform")
    return ("transform", data_type, text_keys, max_seq_len)


def make_dataset(data_path, data_transform, log, seed=0):
    log.append("dataset")
    return {"data_path": data_path, "data_transform": data_transform, "seed": seed}


class Loader:
    def __init__(self, dataset, micro_batch_size, dp_world_size=1):
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_world_size = dp_world_size


def explode(message):
    raise RuntimeError(message)


def t(name: str) -> str:
    """The ``_target_`` of a function or class of this module."""
    return f"{HERE}.{name}"


PIPELINE_YAML = f"""
dataset:
  _target_: {t("make_dataset")}
  data_path: /data/train.jsonl
  data_transform:
    _target_: {t("make_transform")}
    data_type: plaintext
    text_keys: text
    max_seq_len: 4096
"""


@pytest.fixture
def log() -> list:
    return []


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    """``write(name, source)`` puts a module on ``sys.path``; the modules written are forgotten afterwards."""
    written: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> None:
        (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
        importlib.invalidate_caches()
        written.append(name)

    yield write
    for name in written:
        sys.modules.pop(name, None)


# -- building ------------------------------------------------------------------------------------------------------


def test_nested_targets_are_built_before_their_parent_in_key_order(log):
    """Values are built depth-first: both children (in key order) before the parent, which receives the built
    objects."""
    config = {
        "_target_": t("make_parent"),
        "first": {"_target_": t("make_leaf"), "name": "a"},
        "second": {"_target_": t("make_leaf"), "name": "b", "scale": 2},
    }

    built = instantiate(config, context={"log": log}, allowed_prefixes=ALLOWED)

    assert log == ["a", "b", "parent"]
    assert built == {"label": "parent", "first": {"leaf": "a", "scale": 1}, "second": {"leaf": "b", "scale": 2}}


def test_plain_mappings_and_lists_hold_built_values(log):
    """Mappings without ``_target_`` become dicts and lists stay lists, with targets inside built in place and
    other values untouched."""
    config = {
        "items": [{"_target_": t("make_leaf"), "name": "x"}, 3, {"inner": {"_target_": t("make_leaf"), "name": "y"}}],
        "text": "kept",
        "tuple": (1, {"_target_": t("total"), "_args_": [1, 2]}),
    }

    built = instantiate(config, context={"log": log}, allowed_prefixes=ALLOWED)

    assert built == {
        "items": [{"leaf": "x", "scale": 1}, 3, {"inner": {"leaf": "y", "scale": 1}}],
        "text": "kept",
        "tuple": (1, 3),
    }
    assert type(built["items"]) is list and type(built["items"][2]) is dict and type(built["tuple"]) is tuple
    assert instantiate(7) == 7 and instantiate(None) is None


def test_args_are_positional_and_built_first():
    """``_args_`` entries are passed positionally, after building nested targets among them."""
    config = {"_target_": t("total"), "_args_": [1, 2, {"_target_": t("total"), "_args_": [3, 4]}], "start": 10}

    assert instantiate(config, allowed_prefixes=ALLOWED) == 20
    assert instantiate({"_target_": t("positional_only"), "_args_": [1, 2], "c": 3}, allowed_prefixes=ALLOWED) == (
        1,
        2,
        3,
    )


@pytest.mark.parametrize(
    ("config", "fragments"),
    [
        ({"_target_": "positional_only", "a": 1, "b": 2}, ["x.a:", "positional-only", "_args_"]),
        ({"_target_": "positional_only", "_args_": [1, 2, 3, 4]}, ["x._args_:", "4 positional", "(a, b, /, c=0)"]),
        ({"_target_": "positional_only", "_args_": [1, 2, 3], "c": 4}, ["x.c:", "given twice"]),
        ({"_target_": "total", "_args_": 5}, ["x._args_:", "must be a list", "5"]),
    ],
)
def test_bad_positional_arguments_are_named(config, fragments):
    """Positional-only names given as keys, too many ``_args_``, a value given twice and a non-list ``_args_`` are
    ``DataConfigError``s naming the path."""
    config = {**config, "_target_": t(config["_target_"])}

    with pytest.raises(DataConfigError) as error:
        instantiate(config, allowed_prefixes=ALLOWED, path="x")
    for fragment in fragments:
        assert fragment in str(error.value)


def test_partial_returns_a_partial_without_calling(log):
    """``_partial_: true`` returns ``functools.partial`` of the target with the node's arguments; required
    arguments may be left for the call, and nothing runs until then."""
    config = {"_target_": t("make_leaf"), "_partial_": True, "scale": 3}

    built = instantiate(config, allowed_prefixes=ALLOWED)

    assert isinstance(built, functools.partial) and built.func is make_leaf
    assert log == []
    assert built("late", log) == {"leaf": "late", "scale": 3}
    assert log == ["late"]


def test_partial_receives_context(log):
    """Context entries are bound into a partial like into a call."""
    built = instantiate({"_target_": t("make_leaf"), "_partial_": True}, context={"log": log}, allowed_prefixes=ALLOWED)

    built("p")
    assert built.keywords == {"log": log} and log == ["p"]


def test_partial_must_be_a_boolean():
    """``_partial_: "yes"`` is refused, naming the key and the value."""
    with pytest.raises(DataConfigError, match=r"node\._partial_: must be true or false, got 'yes'"):
        instantiate({"_target_": t("make_leaf"), "_partial_": "yes"}, allowed_prefixes=ALLOWED, path="node")


def test_class_method_target_and_real_config_class():
    """``module.Class.method`` targets work; a library class gets its fields as keywords."""
    from_mapping = instantiate(
        {
            "_target_": "hyper_parallel.data.indexed.indexed_data_config.IndexedDataConfig.from_mapping",
            "values": {"seq_length": 32, "split": "90, 5, 5"},
        }
    )
    direct = instantiate(
        {
            "_target_": "hyper_parallel.data.indexed.indexed_data_config.IndexedDataConfig",
            "seq_length": 32,
            "split": "90, 5, 5",
        }
    )

    assert from_mapping == direct == IndexedDataConfig(seq_length=32, split="90, 5, 5")


def test_the_packing_scheduler_config_is_a_target():
    """The YAML pipeline selects the packing scheduler through ``PackingSchedulerConfig``."""
    config = instantiate(
        {
            "_target_": "hyper_parallel.data.parallel.data_schedule_utils.PackingSchedulerConfig",
            "max_seqlen_per_dp_cp_rank": 4096,
            "scheduler": "compute_balanced",
        }
    )
    assert (type(config).__name__, config.max_seqlen_per_dp_cp_rank, config.scheduler) == (
        "PackingSchedulerConfig",
        4096,
        "compute_balanced",
    )


# -- context -------------------------------------------------------------------------------------------------------


def test_context_fills_named_parameters_only():
    """A context entry reaches a target only through a parameter of its name: not through ``**kwargs`` and not
    when the signature lacks it."""
    built = instantiate(
        {"_target_": t("needs_context")},
        context={"tokenizer": "tok", "dp_rank": 3, "seed": 7, "global_batch_size": 64},
        allowed_prefixes=ALLOWED,
    )

    assert built == {"tokenizer": "tok", "dp_rank": 3, "micro_batch_size": 1, "options": {}}


def test_explicit_config_wins_over_context():
    """A key set in the node, or a parameter filled by ``_args_``, is not overridden by context."""
    config = {"_target_": t("needs_context"), "_args_": ["from args"], "dp_rank": 5, "extra": True}

    built = instantiate(
        config, context={"tokenizer": "from context", "dp_rank": 0, "micro_batch_size": 8}, allowed_prefixes=ALLOWED
    )

    assert built == {"tokenizer": "from args", "dp_rank": 5, "micro_batch_size": 8, "options": {"extra": True}}


def test_context_reaches_nested_nodes_and_class_init(log):
    """Context is offered at every depth, including classes (through ``__init__``), while plain mappings are left
    as written."""
    config = {
        "loaders": [
            {
                "_target_": t("Loader"),
                "dataset": {"wrapped": {"_target_": t("make_leaf"), "name": "deep"}},
            }
        ],
        "plain": {"name": "untouched"},
    }

    built = instantiate(
        config, context={"log": log, "micro_batch_size": 4, "dp_world_size": 8}, allowed_prefixes=ALLOWED
    )

    loader = built["loaders"][0]
    assert isinstance(loader, Loader)
    assert (loader.micro_batch_size, loader.dp_world_size) == (4, 8)
    assert loader.dataset == {"wrapped": {"leaf": "deep", "scale": 1}}
    assert log == ["deep"]
    assert built["plain"] == {"name": "untouched"}


def test_context_satisfies_required_arguments_left_out_of_the_yaml(log):
    """The pipeline YAML omits what the trainer knows (``log``, ``seed``); context supplies it."""
    config = load_config_text(PIPELINE_YAML)["dataset"]

    built = instantiate(config, context={"log": log, "seed": 11}, allowed_prefixes=ALLOWED, path="dataset")

    assert built == {
        "data_path": "/data/train.jsonl",
        "data_transform": ("transform", "plaintext", "text", 4096),
        "seed": 11,
    }
    assert log == ["transform", "dataset"]


def test_context_must_be_a_mapping():
    with pytest.raises(DataConfigError, match="context must be a mapping"):
        instantiate({"_target_": t("total")}, context=[("start", 1)], allowed_prefixes=ALLOWED)


# -- bad keys --------------------------------------------------------------------------------------------------------


def test_unknown_key_names_path_target_suggestion_and_accepted_names(log):
    """A misspelt key is refused with its full YAML path, the target, a close match and the accepted names; the
    check runs before any target is built."""
    config = load_config_text(PIPELINE_YAML)
    transform = config["dataset"]["data_transform"]
    transform["max_seq_lenn"] = transform.pop("max_seq_len")
    config["tokenizer"] = {"_target_": t("make_leaf"), "name": "built first?"}
    config = {"tokenizer": config.pop("tokenizer"), **config}

    with pytest.raises(DataConfigError) as error:
        instantiate(config, context={"log": log}, allowed_prefixes=ALLOWED)

    message = str(error.value)
    assert message.startswith("dataset.data_transform.max_seq_lenn: ")
    assert f"{HERE}.make_transform has no parameter 'max_seq_lenn'" in message
    assert "did you mean 'max_seq_len'?" in message
    assert "accepted parameters: data_type, text_keys, max_seq_len, log" in message
    assert log == []


def test_unknown_key_of_a_real_library_class():
    """The same for ``IndexedDataConfig``, under a ``path`` given by the caller."""
    config = {"_target_": "hyper_parallel.data.indexed.indexed_data_config.IndexedDataConfig", "seq_lenght": 8}

    with pytest.raises(DataConfigError) as error:
        instantiate(config, path="dataset.data_config")

    message = str(error.value)
    assert message.startswith("dataset.data_config.seq_lenght: ")
    assert "IndexedDataConfig has no parameter 'seq_lenght' (did you mean 'seq_length'?)" in message
    assert "random_seed" in message


def test_missing_required_arguments_are_listed():
    """Required parameters neither in the node nor in context are named with the node's path."""
    config = load_config_text(PIPELINE_YAML)
    del config["dataset"]["data_transform"]["data_type"], config["dataset"]["data_transform"]["text_keys"]

    with pytest.raises(DataConfigError) as error:
        instantiate(config["dataset"], context={"log": []}, allowed_prefixes=ALLOWED, path="dataset")

    message = str(error.value)
    assert message.startswith("dataset.data_transform: ")
    assert "missing required argument(s) data_type, text_keys;" in message
    assert "max_seq_len" not in message


@pytest.mark.parametrize(
    ("config", "fragments"),
    [
        ({"_targt_": "x.y", "a": 1}, ["node._targt_:", "reserved", "(did you mean '_target_'?)"]),
        ({"_private": 1}, ["node._private:", "reserved"]),
        ({"_args_": [1]}, ["node._args_:", "only applies beside '_target_'"]),
        ({"_partial_": True}, ["node._partial_:", "only applies beside '_target_'"]),
        ({"_target_": f"{HERE}.total", "_extra_": 1}, ["node._extra_:", "reserved"]),
    ],
)
def test_reserved_keys(config, fragments):
    """Keys starting with ``_`` other than ``_target_``/``_args_``/``_partial_`` are refused, and ``_args_`` and
    ``_partial_`` need a ``_target_``."""
    with pytest.raises(DataConfigError) as error:
        instantiate({"node": config}, allowed_prefixes=ALLOWED)
    for fragment in fragments:
        assert fragment in str(error.value)


# -- targets: security and resolution ------------------------------------------------------------------------------


def test_disallowed_target_is_refused_before_import(tmp_path, module_dir):
    """A target outside ``allowed_prefixes`` is refused without importing its module (importing runs code); the
    message says how to allow it, and allowing it works."""
    marker = tmp_path / "imported.txt"
    module_dir(
        "hp_instantiate_side_effect",
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('yes')\n\ndef build():\n    return 'built'\n",
    )
    config = {"step": {"_target_": "hp_instantiate_side_effect.build"}}

    with pytest.raises(DataConfigError) as error:
        instantiate(config)

    message = str(error.value)
    assert message.startswith("step._target_: target 'hp_instantiate_side_effect.build' is outside")
    assert "allowed_prefixes=('hyper_parallel.', '<your.module>.')" in message
    assert not marker.exists() and "hp_instantiate_side_effect" not in sys.modules
    assert instantiate(config, allowed_prefixes=("hp_instantiate_side_effect",)) == {"step": "built"}
    assert marker.exists()


# Every escape below would create MARKER if it ran anything; the tests check that it never exists.
_RUN = ["touch MARKER"]


def _escape(target: str, **keys) -> dict:
    return {"_target_": target, "_args_": _RUN, **keys}


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        # Outside the allowed prefixes, refused before import.
        (_escape("os.system"), "outside the allowed module prefixes"),
        (_escape("posix.system"), "outside the allowed module prefixes"),
        (_escape("subprocess.Popen"), "outside the allowed module prefixes"),
        (_escape("builtins.eval"), "outside the allowed module prefixes"),
        (_escape("importlib.import_module"), "outside the allowed module prefixes"),
        (_escape("functools.partial"), "outside the allowed module prefixes"),
        (_escape("hyper_parallel_evil.build"), "outside the allowed module prefixes"),  # not a whole component
        # Attribute paths through allowed modules: imports of theirs, not their public API.
        (_escape("hyper_parallel.data.text.build_tokenizer.os.system"), "not part of the public API"),
        (_escape("hyper_parallel.data.text.build_tokenizer.Path"), "not part of the public API"),
        (_escape("hyper_parallel.data.instantiate.importlib.import_module"), "not part of the public API"),
        (_escape("hyper_parallel.data.instantiate.functools.partial"), "not part of the public API"),
        (_escape("hyper_parallel.data.text.build_dataset.build_tokenizer"), "not part of the public API"),
        (
            _escape("hyper_parallel.data.indexed.indexed_data_config.IndexedDataConfig.from_mapping.__func__"),
            "private or dunder name '__func__'",
        ),
        (
            _escape("hyper_parallel.data.indexed.indexed_data_config.IndexedDataConfig.__init__.__globals__"),
            "private or dunder name '__init__'",
        ),
        (
            _escape("hyper_parallel.data.text.build_dataset.build_indexed_text_dataset.__globals__"),
            "private or dunder name '__globals__'",
        ),
        (_escape("hyper_parallel.data.errors.DataConfigError.__subclasses__"), "private or dunder name"),
        (_escape("hyper_parallel.data.text.build_tokenizer.TextTokenizer.decode"), "through"),
        # The instantiation machinery and everything that is not a pipeline building block.
        (
            {
                "_target_": "hyper_parallel.data.instantiate.instantiate",
                "_args_": [{"_target_": "hyper_parallel.data.instantiate.load_config_text", "text": "a: 1"}],
                "allowed_prefixes": ["os", "posix"],
            },
            "not a pipeline building block",
        ),
        (_escape("hyper_parallel.data.instantiate._resolve_target"), "private or dunder name '_resolve_target'"),
        (_escape("hyper_parallel.data.instantiate._Planner"), "private or dunder name '_Planner'"),
        (_escape("hyper_parallel.data.instantiate.load_config"), "not a pipeline building block"),
        (_escape("hyper_parallel.data.instantiate.load_config_text"), "not a pipeline building block"),
        (
            {"_target_": "hyper_parallel.data.batching.dataloader.build_dataloaders", "config": "x.yaml"},
            "not a pipeline building block",
        ),
        (_escape("hyper_parallel.data.tools.offline_preparation.main"), "not a pipeline building block"),
        (_escape("hyper_parallel.data.tools.cli.main"), "not a pipeline building block"),
        (_escape("hyper_parallel.data.indexed.io.IndexedDatasetBuilder"), "not a pipeline building block"),
        (_escape("hyper_parallel.data.parallel.build_barrier.rank_zero_first"), "not a pipeline building block"),
    ],
)
def test_escapes_are_refused_before_anything_runs(config, fragment, tmp_path, monkeypatch):
    """No config naming anything but a public building block runs it, nested or partial, whatever it asks."""
    monkeypatch.chdir(tmp_path)
    for node in (config, {"outer": [config]}, {**config, "_partial_": True}):
        with pytest.raises(DataConfigError) as error:
            instantiate(node, path="dataset")
        assert fragment in str(error.value)
        assert "dataset" in str(error.value).split(":")[0]
    assert not (tmp_path / "MARKER").exists()


ESCAPE_PIPELINE = """
dataset:
  _target_: hyper_parallel.data.instantiate.instantiate
  _args_:
    - _target_: hyper_parallel.data.instantiate.load_config_text
      text: "{_target_: posix.system, _args_: ['touch MARKER']}"
  allowed_prefixes: [os, posix]
dataloader:
  _target_: hyper_parallel.data.batching.FixedBatchDataLoader
"""


def test_a_config_cannot_widen_its_allowlist_through_build_dataloaders(tmp_path, monkeypatch):
    """The escape of a config that calls ``instantiate`` itself, with its own ``allowed_prefixes``, on a config
    built by ``load_config_text``: refused when the pipeline is built, and nothing runs."""
    from hyper_parallel.data.batching.dataloader import build_dataloaders

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataConfigError, match="dataset._target_: .* is not a pipeline building block"):
        build_dataloaders(load_config_text(ESCAPE_PIPELINE))
    assert not (tmp_path / "MARKER").exists()


def test_preview_refuses_the_escape_with_exit_status_2(tmp_path, monkeypatch, capsys):
    """``hp-data preview`` on the same config: the tool's one-line error, and nothing runs."""
    from hyper_parallel.data.tools.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "escape.yaml").write_text(ESCAPE_PIPELINE, encoding="utf-8")

    assert main(["preview", "escape.yaml", "--tokenizer", str(BUNDLED_TOKENIZER_PATH)]) == 2
    assert "is not a pipeline building block" in capsys.readouterr().err
    assert not (tmp_path / "MARKER").exists()


def test_user_modules_expose_only_their_own_public_classes_and_functions(module_dir, tmp_path, monkeypatch):
    """With a user prefix allowed, its public API works; its imports, aliases, callable objects and names left out
    of its ``__all__`` do not."""
    monkeypatch.chdir(tmp_path)
    module_dir(
        "hp_instantiate_user",
        "import functools\nimport os\nfrom os import system\n\n"
        "__all__ = ['build', 'Builder', 'system', 'alias', 'run_later', 'os']\n\n"
        "def build(value):\n    return ('built', value)\n\n"
        "def hidden(value):\n    return value\n\n"
        "class Builder:\n    def __init__(self, value):\n        self.value = value\n\n"
        "    @classmethod\n    def make(cls, value):\n        return cls(value)\n\n"
        "alias = build\n"
        "run_later = functools.partial(system, 'touch MARKER')\n",
    )
    allowed = ("hp_instantiate_user",)

    assert instantiate({"_target_": "hp_instantiate_user.build", "value": 1}, allowed_prefixes=allowed) == ("built", 1)
    assert (
        instantiate({"_target_": "hp_instantiate_user.Builder.make", "value": 2}, allowed_prefixes=allowed).value == 2
    )
    refused = {
        "hp_instantiate_user.system": "'posix.system' reached through hp_instantiate_user",
        "hp_instantiate_user.alias": "'hp_instantiate_user.build' reached through hp_instantiate_user",
        "hp_instantiate_user.run_later": "is a partial, not a function or class",
        "hp_instantiate_user.hidden": "not part of the public API",
        "hp_instantiate_user.os.system": "through 'hp_instantiate_user.os'",
        "hp_instantiate_user": "is a module, not a function or class",
    }
    for target, fragment in refused.items():
        with pytest.raises(DataConfigError) as error:
            instantiate({"_target_": target, "_args_": _RUN}, allowed_prefixes=allowed)
        assert fragment in str(error.value), target
    assert not (tmp_path / "MARKER").exists()


@pytest.mark.parametrize(
    "target",
    [
        # The targets of the design's config examples, and the canonical paths of re-exported names.
        "hyper_parallel.data.batching.DynamicBatchDataLoader",
        "hyper_parallel.data.batching.FixedBatchDataLoader",
        "hyper_parallel.data.batching.build_dataloader.FixedBatchDataLoader",
        "hyper_parallel.data.batching.build_indexed_collate_fn",
        "hyper_parallel.data.batching.build_online_text_collate_fn",
        "hyper_parallel.data.text.build_data_transform.build_llm_data_transform",
        "hyper_parallel.data.text.build_dataset.build_indexed_text_dataset",
        "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
        "hyper_parallel.data.text.build_tokenizer.build_tokenizer",
        "hyper_parallel.data.indexed.indexed_data_config.IndexedDataConfig.from_mapping",
    ],
)
def test_pipeline_building_blocks_resolve(target):
    built = instantiate({"_target_": target, "_partial_": True})
    assert isinstance(built, functools.partial)


def test_allowed_prefixes_are_checked():
    """An empty prefix is an error (it would allow nothing); a lone string is one prefix, not its characters."""
    with pytest.raises(DataConfigError, match="allowed_prefixes must be non-empty"):
        instantiate({}, allowed_prefixes=("",))
    assert instantiate({"_target_": f"{HERE}.total", "_args_": [2]}, allowed_prefixes=HERE) == 2


@pytest.mark.parametrize(
    ("target", "fragments"),
    [
        (
            "hyper_parallel.data.no_such_module.build",
            ["'hyper_parallel.data' has no attribute or submodule 'no_such_module'"],
        ),
        (
            "hyper_parallel.data.text.build_tokenizer.build_tokenizr",
            [
                "has no attribute or submodule 'build_tokenizr'",
                "hyper_parallel.data.text.build_tokenizer.build_tokenizer'?",
            ],
        ),
        (
            "hyper_parallel.data.indexd.indexed_data_config.IndexedDataConfig",
            ["(did you mean 'hyper_parallel.data.indexed'?)"],
        ),
        ("hp_no_such_top_level_module.build", ["no module named 'hp_no_such_top_level_module'"]),
        ("hyper_parallel..data", ["not a dotted path of Python names"]),
        ("hyper_parallel.data.text.build_tokenizer.BUNDLED_TOKENIZER_PATH", ["not a function or class"]),
    ],
)
def test_unresolvable_target_names_path_and_target(target, fragments):
    """A missing module or attribute, a malformed path or a non-callable is a ``DataConfigError`` naming the YAML
    path and the target, with a close match where there is one."""
    config = {"dataset": {"data_config": {"_target_": target}}}

    with pytest.raises(DataConfigError) as error:
        instantiate(config, allowed_prefixes=("hyper_parallel.", "hp_no_such_top_level_module"))

    message = str(error.value)
    assert message.startswith("dataset.data_config._target_: ")
    assert f"'{target}'" in message
    for fragment in fragments:
        assert fragment in message


def test_missing_dependency_of_a_target_module(module_dir):
    """A module that exists but imports a missing one is reported as such, not as a misspelt target."""
    module_dir("hp_instantiate_broken", "import hp_instantiate_absent_dependency\n\ndef build():\n    return 1\n")

    with pytest.raises(DataConfigError) as error:
        instantiate({"_target_": "hp_instantiate_broken.build"}, allowed_prefixes=("hp_instantiate_broken",))

    message = str(error.value)
    assert "importing 'hp_instantiate_broken' for target 'hp_instantiate_broken.build' failed" in message
    assert "hp_instantiate_absent_dependency" in message


def test_target_must_be_a_non_empty_string():
    with pytest.raises(DataConfigError, match=r"a\._target_: must be a dotted path .* got 3"):
        instantiate({"a": {"_target_": 3}})


# -- errors raised by targets --------------------------------------------------------------------------------------


def test_error_inside_a_target_keeps_its_type_and_gains_a_note(log):
    """An exception raised by a target propagates as itself, with a note naming the YAML path and the target;
    the parent is never called."""
    config = {
        "outer": {
            "_target_": t("make_parent"),
            "first": {"_target_": t("make_leaf"), "name": "ok"},
            "second": [{"_target_": t("explode"), "message": "inner failure"}],
        }
    }

    with pytest.raises(RuntimeError) as error:
        instantiate(config, context={"log": log}, allowed_prefixes=ALLOWED)

    assert type(error.value) is RuntimeError and str(error.value) == "inner failure"
    assert error.value.__notes__ == [f"while building outer.second[0] (_target_: {HERE}.explode)"]
    assert log == ["ok"]


def test_library_validation_error_gains_a_note():
    """A ``DataConfigError`` from a library class (``seq_length: 0``) starts with the node's YAML path and gains a
    note naming the target."""
    config = load_config_text(
        "data_config:\n  _target_: hyper_parallel.data.indexed.indexed_data_config.IndexedDataConfig\n  seq_length: 0\n"
    )

    with pytest.raises(DataConfigError) as error:
        instantiate(config, path="dataset")

    assert str(error.value) == "dataset.data_config: seq_length must be an integer >= 1, got 0"
    assert error.value.__notes__ == [
        "while building dataset.data_config "
        "(_target_: hyper_parallel.data.indexed.indexed_data_config.IndexedDataConfig)"
    ]


# -- omegaconf and files -------------------------------------------------------------------------------------------


def test_dictconfig_and_listconfig_are_resolved_first(log):
    """omegaconf containers are accepted, their interpolations resolved, at the top or nested in plain data."""
    config = OmegaConf.create(
        {
            "width": 4096,
            "transform": {
                "_target_": t("make_transform"),
                "data_type": "plaintext",
                "text_keys": "text",
                "max_seq_len": "${width}",
            },
        }
    )

    built = instantiate(config, context={"log": log}, allowed_prefixes=ALLOWED)
    nested = instantiate(
        {"items": OmegaConf.create([{"_target_": t("total"), "_args_": [1, 2]}])}, allowed_prefixes=ALLOWED
    )

    assert built == {"width": 4096, "transform": ("transform", "plaintext", "text", 4096)}
    assert nested == {"items": [3]}


def test_unresolvable_dictconfig_interpolation():
    config = OmegaConf.create({"dataset": {"max_seq_len": "${nowhere}"}})

    with pytest.raises(DataConfigError, match="Interpolation key 'nowhere' not found"):
        instantiate(config)


def test_load_config_resolves_interpolations_into_plain_containers(tmp_path, monkeypatch):
    """A YAML file is read into plain dicts and lists with ``${...}`` and ``${oc.env:...}`` resolved, and builds a
    real tokenizer."""
    monkeypatch.setenv("HP_INSTANTIATE_TEST_SEQ", "2048")
    path = tmp_path / "pipeline.yaml"
    path.write_text(
        f"""
tokenizer_dir: {BUNDLED_TOKENIZER_PATH}
seq_len: ${{oc.decode:${{oc.env:HP_INSTANTIATE_TEST_SEQ}}}}
tokenizer:
  _target_: hyper_parallel.data.text.build_tokenizer.build_tokenizer
  name_or_path: ${{tokenizer_dir}}
lengths: ["${{seq_len}}", 1]
""",
        encoding="utf-8",
    )

    config = load_config(path)

    assert type(config) is dict and type(config["tokenizer"]) is dict and type(config["lengths"]) is list
    assert config["tokenizer"]["name_or_path"] == str(BUNDLED_TOKENIZER_PATH)
    assert config["seq_len"] == 2048 and config["lengths"] == [2048, 1]
    tokenizer = instantiate(config["tokenizer"], path="tokenizer")
    assert isinstance(tokenizer, TextTokenizer) and tokenizer.name_or_path == str(BUNDLED_TOKENIZER_PATH)
    assert tokenizer.eos_token_id is not None


def test_context_tokenizer_reaches_a_real_factory():
    """A loaded tokenizer offered as context is passed to a library factory that names it."""
    config = {"_target_": "hyper_parallel.data.text.build_tokenizer.build_tokenizer", "_partial_": True}

    factory = instantiate(config, context={"name_or_path": BUNDLED_TOKENIZER_PATH, "tokenizer": object()})

    assert factory.keywords == {"name_or_path": BUNDLED_TOKENIZER_PATH}
    assert factory().vocab_size > 0


def test_missing_config_file_is_named(tmp_path):
    missing = tmp_path / "absent.yaml"

    with pytest.raises(DataConfigError, match=f"config file {missing} does not exist"):
        load_config(missing)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("a: [1, 2\nb: 3\n", ["is not valid YAML", "line"]),
        ("- 1\n- 2\n", ["must hold a mapping at the top level", "got a list"]),
        ("5\n", ["must hold a mapping at the top level", "got the scalar '5'"]),
        ("just text\n", ["must hold a mapping at the top level", "got the scalar 'just text'"]),
        ("", ["is empty", "dataset: and dataloader:"]),
        ("# only a comment\n", ["is empty", "dataset: and dataloader:"]),
        ("null: 1\n", ["KeyValidationError", "fix that key"]),
        ("a: 1\nb: ${c}\n", ["Interpolation key 'c' not found", "full_key: b"]),
        ("a: ???\n", ["Missing mandatory value", "full_key: a"]),
        ("a: 1\na: 2\n", ["is not valid YAML", "duplicate key"]),
    ],
)
def test_bad_config_files_are_named(tmp_path, text, fragments):
    """Invalid YAML, a non-mapping top level, an unresolvable interpolation and an unset ``???`` are
    ``DataConfigError``s naming the file; ``load_config_text`` reports the same under its ``source``."""
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")

    with pytest.raises(DataConfigError) as from_file:
        load_config(path)
    with pytest.raises(DataConfigError) as from_text:
        load_config_text(text, source="inline.yaml")

    assert str(from_file.value).startswith(f"config file {path}")
    assert str(from_text.value).startswith("config inline.yaml")
    for fragment in fragments:
        assert fragment in str(from_file.value) and fragment in str(from_text.value)


UNPLAIN_TAGS = {
    # YAML text: (the key it names, the tag, a fragment of the fix)
    "set": ("dataset:\n  keys: !!set {a, b}\n", "dataset.keys (line 2)", "!!set", "write a list"),
    "binary": ("dataset:\n  blob: !!binary aGVsbG8=\n", "dataset.blob (line 2)", "!!binary", "give its path"),
    "omap": ("dataset: !!omap [a: 1, b: 2]\n", "dataset (line 1)", "!!omap", "plain mapping"),
    "pairs": ("dataset:\n  - !!pairs [a: 1]\n", "dataset[0] (line 2)", "!!pairs", "plain mapping"),
    "timestamp": ("a:\n  b:\n    when: !!timestamp 2001-12-14\n", "a.b.when (line 3)", "!!timestamp", "quoted"),
    "python-object": ("a: !!python/object/apply:os.system [ls]\n", "a (line 1)", "!!python/object", "_target_"),
    "python-tuple": ("a: [1, !!python/tuple [1, 2]]\n", "a[1] (line 1)", "!!python/tuple", "remove the tag"),
    "custom": ("a:\n  b: !include other.yaml\n", "a.b (line 2)", "!include", "remove the tag"),
    "binary-key": ("a:\n  !!binary aGk=: 1\n", "a.aGk= (line 2)", "!!binary", "give its path"),
    "root-set": ("!!set {a, b}\n", "<root> (line 1)", "!!set", "write a list"),
    "under-alias": ("x: &shared {v: !!set {a}}\ny: *shared\n", "x.v (line 1)", "!!set", "write a list"),
}


@pytest.mark.parametrize("name", list(UNPLAIN_TAGS))
def test_yaml_tags_a_config_cannot_hold_name_the_file_the_key_and_the_fix(tmp_path, name):
    """A value tagged with a YAML type omegaconf cannot hold (or would silently turn into a tuple or bytes) is one
    ``DataConfigError`` naming the file, the key, its line, the tag and the fix; nothing is constructed."""
    text, key, tag, fix = UNPLAIN_TAGS[name]
    path = tmp_path / "tagged.yaml"
    path.write_text(text, encoding="utf-8")

    with pytest.raises(DataConfigError) as from_file:
        load_config(path)
    with pytest.raises(DataConfigError) as from_text:
        load_config_text(text, source="inline.yaml")

    assert str(from_file.value).startswith(f"config file {path}: {key} is tagged {tag}")
    assert str(from_text.value).startswith(f"config inline.yaml: {key} is tagged {tag}")
    assert fix in str(from_file.value) and "\n" not in str(from_file.value)


def test_a_config_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\u00e9\n".encode("latin-1"))

    with pytest.raises(DataConfigError, match=f"config file {path} is not UTF-8 text .*; save it as UTF-8"):
        load_config(path)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(DataConfigError, match=f"config file {tmp_path} cannot be read"):
        load_config(tmp_path)
