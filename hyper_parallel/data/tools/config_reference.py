"""The configuration reference: every ``_target_`` a pipeline config names, with its keys, written from the code.

    hp-data config-reference                                   # print the Markdown
    hp-data config-reference --output docs/configuration.md    # write it
    hp-data config-reference --check docs/configuration.md     # exit 1 when the file is out of date

Owns: which building blocks the reference documents and in which order (the top-level nodes of a pipeline, then
each node's targets: the dataset builders, their ``data_config`` and ``data_transform``, the collators, the
loaders and their packing policy, ``ParallelBatch``, ``PackingSchedulerConfig``, the model assets, and offline
preparation's settings), and rendering them as deterministic Markdown (stable order, no object addresses).
Every parameter and field is read from the code: its type (``typing.get_type_hints``), its default
(``inspect.signature``, ``dataclasses.fields``) and its description (the ``Args:``/``Attributes:`` sections of
the docstrings), so the reference changes when the code does. Not
responsible for: the nodes and the values each receives (``batching.pipeline_nodes``, read here), what the keys do
(the targets), checking a config (``instantiate``, ``build_dataloaders``), or the prose guides of ``docs/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

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
from hyper_parallel.data.batching.pipeline_nodes import NODES, RUNTIME_VALUES
from hyper_parallel.data.batching.pipeline_nodes import node as node_row
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.file_writes import write_atomically
from hyper_parallel.data.indexed.indexed_data_config import IndexedDataConfig
from hyper_parallel.data.instantiate import LIBRARY_TARGET_MODULES, TARGET_KEY, check_config
from hyper_parallel.data.mixture.build_mixture import MixtureSource, build_mixture_dataset
from hyper_parallel.data.parallel.data_schedule_utils import PackingSchedulerConfig
from hyper_parallel.data.text.build_data_transform import DATA_TRANSFORM_REGISTRY, build_llm_data_transform
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset, build_online_text_dataset
from hyper_parallel.data.text.build_tokenizer import build_tokenizer
from hyper_parallel.data.text.chat_template import CHAT_TEMPLATE_REGISTRY, build_chat_template
from hyper_parallel.data.text.online.online_dataset import OnlineDataConfig
from hyper_parallel.data.tools.cli import command_parser

__all__ = ["NO_DESCRIPTION", "REGENERATE_COMMAND", "build_parser", "main", "pipeline_values", "render_reference"]

NO_DESCRIPTION = "(no description)"
REGENERATE_COMMAND = "hp-data config-reference --output docs/configuration.md"

# -- what the pipeline gives each node -----------------------------------------------------------------------------


def pipeline_values(name: str) -> dict[str, tuple[str, str]]:
    """What ``build_dataloaders`` passes to the ``_target_`` nodes of a top-level node (nested ones included): the
    values its row of the node table receives (``pipeline_nodes.NODE_TABLE``), each by parameter name to the
    targets that name it, unless the config sets that key.

    Args:
        name: a top-level node of a pipeline config (``NODES``).

    Returns:
        ``{parameter name: (when it is given, what is given)}``; empty for the nodes that receive nothing.

    Example::

        >>> sorted(pipeline_values("get_batch"))
        ['eod_token_id', 'parallel_context', 'scheduler']
    """
    return {value: (RUNTIME_VALUES[value].when, RUNTIME_VALUES[value].source) for value in node_row(name).receives}


# -- docstrings ----------------------------------------------------------------------------------------------------

_NAMES_SECTION = re.compile(r"^(Args|Arguments|Attributes|Parameters):$")
_TEXT_SECTION = re.compile(r"^(Returns|Raises|Example|Examples|Yields|Notes?)\b.*:$")
_ENTRY = re.compile(r"^(\**\w+(?:\s*,\s*\**\w+)*)\s*(?:\([^)]*\))?:(?:\s+(.*))?$")


def _lines(obj: object) -> list[str]:
    """The lines of ``obj``'s docstring, indentation removed (``inspect.getdoc``, which cleans it once)."""
    return (inspect.getdoc(obj) or "").splitlines()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _section(lines: list[str], header: re.Pattern) -> list[str]:
    """The lines of the first section whose header matches, up to the next line indented as little as it."""
    for start, line in enumerate(lines):
        if header.match(line.strip()):
            body = []
            for inner in lines[start + 1 :]:
                if inner.strip() and _indent(inner) <= _indent(line):
                    break
                body.append(inner)
            return body
    return []


def _join(lines: Iterable[str]) -> str:
    return " ".join(" ".join(lines).split())


def _documented_names(obj: object) -> dict[str, str]:
    """``{name: description}`` from the ``Args:``/``Attributes:`` section of ``obj``'s docstring (Google style);
    an entry naming several parameters (``dp_rank, dp_world_size: ...``) describes each of them."""
    body = _section(_lines(obj), _NAMES_SECTION)
    entry_indent = min((_indent(line) for line in body if line.strip()), default=0)
    entries: list[tuple[list[str], list[str]]] = []
    for line in body:
        if line.strip() and _indent(line) == entry_indent:
            match = _ENTRY.match(line.strip())
            names = [name.strip().lstrip("*") for name in match.group(1).split(",")] if match else []
            entries.append((names, [match.group(2) or ""] if match else []))
        elif entries:
            entries[-1][1].append(line)
    return {name: _join(text) for names, text in entries for name in names if _join(text)}


def _summary(obj: object) -> str:
    """The first paragraph of the docstring."""
    paragraph = []
    for line in _lines(obj):
        if not line.strip() or _NAMES_SECTION.match(line.strip()) or _TEXT_SECTION.match(line.strip()):
            break
        paragraph.append(line)
    return _join(paragraph)


def _returns(obj: object) -> str:
    return _join(_section(_lines(obj), re.compile(r"^Returns:$")))


# -- types and defaults --------------------------------------------------------------------------------------------

_SHORT_MODULES = ("builtins", "typing", "collections.abc")


def _type_name(annotation: object) -> str:
    """A type as a reader writes it: ``int | None``, ``Sequence[str]``, ``OnlineDataConfig``, ``os.PathLike``."""
    if annotation is inspect.Parameter.empty:
        return "any"
    if isinstance(annotation, str):
        return annotation
    if annotation is type(None):
        return "None"
    if annotation is typing.Any:
        return "Any"
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(map(_type_name, arguments))
    if origin is typing.Literal:
        return f"Literal[{', '.join(map(repr, arguments))}]"
    if origin is not None:
        inner = ", ".join("..." if argument is Ellipsis else _type_name(argument) for argument in arguments)
        return f"{_type_name(origin)}[{inner}]" if inner else _type_name(origin)
    if isinstance(annotation, type):
        module = annotation.__module__
        if module in _SHORT_MODULES or module.startswith("hyper_parallel."):
            return annotation.__qualname__
        return f"{module.split('.')[0]}.{annotation.__qualname__}"
    return _checked_text(repr(annotation), "type")


def _checked_text(text: str, what: str) -> str:
    if re.search(r" at 0x[0-9a-f]+", text):
        raise DataConfigError(f"the {what} {text} shows an object address, which would change on every run")
    return text


def _value(value: object) -> str:
    """A default as YAML writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple | list):
        return f"[{', '.join(map(_value, value))}]"
    return _checked_text(repr(value), "default")


def _field_default(field: dataclasses.Field) -> str | None:
    """The rendered default of a dataclass field, or None when it is required."""
    if field.default is not dataclasses.MISSING:
        return f"`{_value(field.default)}`"
    if field.default_factory is not dataclasses.MISSING:
        factory = field.default_factory
        return f"`{factory.__name__}()`" if isinstance(factory, type) else "computed when built"
    return None


# -- the reference's entries ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Key:
    """One row: a parameter or field."""

    name: str
    type: str
    default: str | None  # None: required
    given: str  # the "given by the pipeline" column: "" when the config (or nobody) sets it
    description: str


@dataclass(frozen=True)
class _Entry:
    """One building block: its heading, ``_target_`` (None for what is not a node) and keys."""

    title: str
    target: str | None
    summary: str
    keys: tuple[_Key, ...]
    notes: tuple[str, ...] = ()
    flags: dict[str, str] | None = None  # field -> command-line flag (offline preparation)


def _target_path(obj: Callable) -> str:
    """The shortest ``_target_`` that names ``obj``: its package's when the package exports it, else its module's;
    checked as a config would be."""
    parts = obj.__module__.split(".")
    candidates = [".".join(parts[:end]) for end in range(1, len(parts) + 1)]
    for module in candidates:
        if module not in LIBRARY_TARGET_MODULES:
            continue
        path = f"{module}.{obj.__qualname__}"
        try:
            check_config({TARGET_KEY: path, "_partial_": True})
        except DataConfigError:
            continue
        return path
    raise DataConfigError(
        f"{obj.__module__}.{obj.__qualname__} cannot be named by a config's _target_; document it without a target"
    )


def _described(name: str, sources: tuple[object, ...]) -> str:
    for source in sources:
        description = _documented_names(source).get(name)
        if description:
            return description
    return NO_DESCRIPTION


def _callable_entry(
    obj: Callable,
    node: str,
    *,
    title: str | None = None,
    also_documented_by: tuple[object, ...] = (),
    only: Callable[[inspect.Parameter], bool] = lambda parameter: True,
    called_through: Callable | None = None,
    notes: tuple[str, ...] = (),
    target: bool = True,
) -> _Entry:
    """A function's or class's parameters; a class is described by its docstring, then its ``__init__``'s.

    ``called_through``: the target that calls ``obj`` with its keys (``build_llm_data_transform`` for the
    transforms): the pipeline gives only the values that target names as parameters.
    """
    function = obj.__init__ if inspect.isclass(obj) and not dataclasses.is_dataclass(obj) else obj
    hints = typing.get_type_hints(function)
    sources = (obj, function, *also_documented_by) if function is not obj else (obj, *also_documented_by)
    named = _keyword_names(called_through or obj)
    given = {name: value for name, value in pipeline_values(node).items() if name in named}
    keys = []
    for name, parameter in inspect.signature(obj).parameters.items():
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) or not only(parameter):
            continue
        default = None if parameter.default is inspect.Parameter.empty else f"`{_value(parameter.default)}`"
        keys.append(
            _Key(
                name=name,
                type=_type_name(hints.get(name, parameter.annotation)),
                default=default,
                given=given[name][0] if name in given else "",
                description=_described(name, sources),
            )
        )
    return _Entry(
        title=title or obj.__qualname__,
        target=_target_path(obj) if target else None,
        summary=_summary(obj),
        keys=tuple(keys),
        notes=(*notes, *((f"Returns: {_returns(obj)}",) if _returns(obj) else ())),
    )


def _keyword_names(target: Callable) -> set[str]:
    """The parameters the pipeline's values can reach: those given by keyword (``**kwargs`` does not count)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {name for name, parameter in inspect.signature(target).parameters.items() if parameter.kind in kinds}


def _dataclass_entry(
    cls: type, node: str | None, *, notes: tuple[str, ...] = (), flags: dict[str, str] | None = None
) -> _Entry:
    hints = typing.get_type_hints(cls)
    given = pipeline_values(node) if node else {}
    keys = tuple(
        _Key(
            name=field.name,
            type=_type_name(hints.get(field.name, field.type)),
            default=_field_default(field),
            given=given[field.name][0] if field.name in given else "",
            description=_described(field.name, (cls,)),
        )
        for field in dataclasses.fields(cls)
        if field.init
    )
    target = _target_path(cls) if node else None
    return _Entry(cls.__qualname__, target, _summary(cls), keys, notes, flags)


def _keyword_only(parameter: inspect.Parameter) -> bool:
    return parameter.kind is inspect.Parameter.KEYWORD_ONLY


def _transform_entries() -> list[_Entry]:
    """One entry per ``data_type``: the options ``build_llm_data_transform`` passes on (keyword-only parameters)."""
    return [
        _callable_entry(
            transform,
            "dataset",
            title=f"data_type: {data_type} ({transform.__qualname__})",
            only=_keyword_only,
            called_through=build_llm_data_transform,
            target=False,
            notes=(f"Options of `build_llm_data_transform` with `data_type: {data_type}`.",),
        )
        for data_type, transform in DATA_TRANSFORM_REGISTRY.items()
    ]


def _option_groups_note() -> str:
    groups = []
    for group in (BatchLayout, SamplerOptions, WorkerOptions):
        names = ", ".join(f"`{field.name}`" for field in dataclasses.fields(group))
        groups.append(f"`{group.__qualname__}` ({_summary(group).rstrip('.')}): {names}")
    return "The loader options, checked in three groups: " + "; ".join(groups) + "."


def _offline_flags() -> dict[str, str]:
    """Each ``OfflinePreparationConfig`` field's flag of ``hp-data prepare``."""
    from hyper_parallel.data.tools.offline_preparation import build_parser as preparation_parser

    return {
        action.dest: action.option_strings[0]
        for action in preparation_parser()._actions
        if action.option_strings and action.dest != "help"
    }


def _entries() -> dict[str, list[_Entry]]:
    """The documented building blocks, grouped by the node (or section) that holds them, in reading order."""
    from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig

    loader_docs = (FixedBatchDataLoader, BatchLayout, SamplerOptions, WorkerOptions)
    return {
        "model_assets": [
            _callable_entry(build_tokenizer, "model_assets"),
            _callable_entry(
                build_chat_template,
                "model_assets",
                notes=(f"Template names: {', '.join(f'`{name}`' for name in CHAT_TEMPLATE_REGISTRY)}.",),
            ),
        ],
        "dataset": [
            _callable_entry(
                build_online_text_dataset,
                "dataset",
                notes=("`data_config`: the keys of OnlineDataConfig; `data_transform`: build_llm_data_transform.",),
            ),
            _dataclass_entry(
                OnlineDataConfig,
                "dataset",
                notes=("The `data_config` mapping of build_online_text_dataset (or a node with this `_target_`).",),
            ),
            _callable_entry(
                build_llm_data_transform,
                "dataset",
                notes=("The options of each `data_type` follow.",),
            ),
            *_transform_entries(),
            _callable_entry(
                build_indexed_text_dataset,
                "dataset",
                notes=("`data_config`: the keys of IndexedDataConfig.",),
            ),
            _dataclass_entry(
                IndexedDataConfig,
                "dataset",
                notes=("The `data_config` mapping of build_indexed_text_dataset (or a node with this `_target_`).",),
            ),
            _callable_entry(
                build_mixture_dataset,
                "dataset",
                notes=("Each entry of `sources`: the keys of MixtureSource; a guide in docs/mixtures.md.",),
            ),
            _dataclass_entry(
                MixtureSource,
                "dataset",
                notes=("An entry of the `sources` list of build_mixture_dataset; `dataset` is a dataset node.",),
            ),
        ],
        "collate_fn": [
            _callable_entry(build_online_text_collate_fn, "collate_fn"),
            _callable_entry(build_indexed_collate_fn, "collate_fn"),
        ],
        "dataloader": [
            _callable_entry(
                FixedBatchDataLoader, "dataloader", also_documented_by=loader_docs, notes=(_option_groups_note(),)
            ),
            _callable_entry(DynamicBatchDataLoader, "dataloader", also_documented_by=loader_docs),
            _callable_entry(
                TextTokenBatcher,
                "dataloader",
                notes=("The default `packing_policy` of DynamicBatchDataLoader, or a node of its own there.",),
            ),
        ],
        "get_batch": [_callable_entry(ParallelBatch, "get_batch")],
        "packing_scheduler": [_dataclass_entry(PackingSchedulerConfig, "packing_scheduler")],
        "offline": [
            _dataclass_entry(
                OfflinePreparationConfig,
                None,
                notes=("The settings of `hp-data prepare` (and `hp-data prepare-hf`), by field and flag.",),
                flags=_offline_flags(),
            )
        ],
    }


# -- the nodes -----------------------------------------------------------------------------------------------------

_DEBUG_KEYS = (
    _Key(
        "check_dataset",
        "str | None",
        "`null`",
        "",
        "the level of the dataset logs (`debug`, `info`, `warn` or `warning`, `error`) on rank 0 "
        "(`enable_dataset_logging`); null follows the global level.",
    ),
)


# -- Markdown ------------------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.lower())
    return text.replace(" ", "-")


def _table(keys: Iterable[_Key], flags: dict[str, str] | None = None) -> list[str]:
    if flags is not None:
        lines = ["| Field | Flag | Type | Default | Description |", "| --- | --- | --- | --- | --- |"]
        for key in keys:
            flag = f"`{flags[key.name]}`" if key.name in flags else ""
            cells = (f"`{key.name}`", flag, f"`{key.type}`", key.default or "required", key.description)
            lines.append("| " + " | ".join(map(_cell, cells)) + " |")
        return lines
    lines = ["| Key | Type | Default | Given by the pipeline | Description |", "| --- | --- | --- | --- | --- |"]
    for key in keys:
        cells = (f"`{key.name}`", f"`{key.type}`", key.default or "required", key.given, key.description)
        lines.append("| " + " | ".join(map(_cell, cells)) + " |")
    return lines


def _entry_lines(entry: _Entry, level: str = "###") -> list[str]:
    lines = [f"{level} {entry.title}", ""]
    if entry.target is not None:
        lines += [f"`{TARGET_KEY}: {entry.target}`", ""]
    if entry.summary:
        lines += [entry.summary, ""]
    lines += [*_table(entry.keys, entry.flags), ""]
    for note in entry.notes:
        lines += [note, ""]
    return lines


_INTRO = """\
# Configuration reference

<!-- Generated from the code by `hp-data config-reference`; do not edit. Regenerate with
     `{command}` (a test fails while this file is out of date). -->

A pipeline config (YAML, read by `build_dataloaders`) is a mapping of top-level nodes. A node with `{target}` is
built by calling that class or function with the node's other keys as keyword arguments, nested nodes first;
`_args_` gives positional arguments and `_partial_: true` returns a `functools.partial`. A config may name the
public classes and functions of these modules only: {modules}.

The pipeline also gives each node's targets, by parameter name, the values marked "Given by the pipeline" below
(the tokenizer, batch sizes, ranks, seed...): a key written in the node wins over them. Every key of a `_target_`
node is checked against the target's signature before anything is built, so a misspelt key fails at once, naming
the closest one; `data_config` keys are checked the same way when the dataset is built.

```yaml
dataset:                                  # a top-level node
  _target_: hyper_parallel.data.text.build_dataset.build_online_text_dataset   # one of its targets, below
  data_path: /data/train.jsonl            # a key of that target; tokenizer, dp_rank, seed... come from the pipeline
  data_transform:                         # a nested node
    _target_: hyper_parallel.data.text.build_data_transform.build_llm_data_transform
    data_type: plaintext
    max_seq_len: 4096
  data_config:                            # a mapping of OnlineDataConfig's fields
    dataset_type: mapping
```

Guides: [online.md](online.md), [indexed.md](indexed.md), [mixtures.md](mixtures.md), [distributed.md](distributed.md),
[offline.md](offline.md).
"""


def render_reference() -> str:
    """The Markdown of the configuration reference (``docs/configuration.md``), the same on every run.

    Raises:
        DataConfigError: a documented target that a config could not name, or a default that would render as an
            object address.
    """
    entries = _entries()
    modules = ", ".join(f"`{module}`" for module in sorted(LIBRARY_TARGET_MODULES))
    lines = [_INTRO.format(command=REGENERATE_COMMAND, target=TARGET_KEY, modules=modules)]
    lines += ["## Contents", ""]
    headings = ["Top-level nodes", *(f"The {node} node" for node in NODES)]
    headings += ["Values the pipeline gives", "Offline preparation"]
    lines += [f"- [{heading}](#{_anchor(heading)})" for heading in headings] + [""]

    lines += ["## Top-level nodes", "", "| Node | Required | What it holds | Targets |", "| --- | --- | --- | --- |"]
    for node in NODES:
        required, holds = node_row(node).required, node_row(node).docs
        targets = ", ".join(f"`{entry.title}`" for entry in entries.get(node, []) if entry.target is not None)
        link = f"[`{node}`](#{_anchor(f'The {node} node')})"
        lines.append(f"| {link} | {'yes' if required else 'no'} | {_cell(holds)} | {targets} |")
    lines += [
        "",
        "`build_dataloaders` builds them in this order: model_assets, packing_scheduler, get_batch and collate_fn on "
        "every rank, then dataset and a dataloader per split on the ranks that read data.",
        "",
    ]

    for node in NODES:
        lines += [f"## The {node} node", ""]
        required, holds = node_row(node).required, node_row(node).docs
        lines += [f"{'Required' if required else 'Optional'}: {holds}.", ""]
        if node == "debug":
            lines += [*_table(_DEBUG_KEYS), ""]
        for entry in entries.get(node, []):
            lines += _entry_lines(entry, "####" if entry.title.startswith("data_type:") else "###")

    lines += [
        "## Values the pipeline gives",
        "",
        "| Value | Given to | What the pipeline passes |",
        "| --- | --- | --- |",
    ]
    given_to: dict[str, dict[str, str]] = {}
    for node in NODES:
        for name, (_, source) in pipeline_values(node).items():
            given_to.setdefault(name, {})[node] = source
    for name, by_node in given_to.items():
        sources = sorted(set(by_node.values()))
        for source in sources:
            nodes = ", ".join(f"`{node}`" for node in by_node if by_node[node] == source)
            lines.append(f"| `{name}` | {nodes} | {_cell(source)} |")
    lines += [""]

    lines += ["## Offline preparation", ""]
    for entry in entries["offline"]:
        lines += _entry_lines(entry)
    return "\n".join(lines).rstrip("\n") + "\n"


# -- command -------------------------------------------------------------------------------------------------------

_EXAMPLES = f"""\
examples:
  hp-data config-reference                                   # print the reference
  {REGENERATE_COMMAND}    # write it
  hp-data config-reference --check docs/configuration.md     # exit 1 when the file is out of date

exit status: 0 on success, 1 when --check finds the file out of date or missing, 2 on a usage error.
"""


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; every option's help carries an example."""
    parser = command_parser(
        "config-reference",
        (
            "Write the configuration reference: every _target_ a pipeline config may name, with each key's type, "
            "default, description and whether the pipeline gives it, read from the code."
        ),
        _EXAMPLES,
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--output", metavar="PATH", help="write the Markdown there, e.g. --output docs/configuration.md")
    where.add_argument(
        "--check",
        metavar="PATH",
        help="compare PATH with the reference the code gives now and exit 1 when they differ, e.g. --check "
        "docs/configuration.md",
    )
    return parser


def _first_difference(old: str, new: str) -> str:
    old_lines, new_lines = old.splitlines(), new.splitlines()
    for number, (was, now) in enumerate(zip(old_lines, new_lines, strict=False), start=1):
        if was != now:
            return f"line {number}: the file has\n  {was}\nbut the code gives\n  {now}"
    if len(old_lines) != len(new_lines):
        return f"the file has {len(old_lines)} lines but the code gives {len(new_lines)}"
    return "the lines are the same but their endings or the final newline differ"


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 1 out of date, 2 error)."""
    args = build_parser().parse_args(argv)
    try:
        reference = render_reference()
    except DataConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.check is not None:
        path = Path(args.check)
        regenerate = f"hp-data config-reference --output {args.check}"
        if not path.is_file():
            print(f"error: {path} does not exist; write it with `{regenerate}`", file=sys.stderr)
            return 1
        written = path.read_text(encoding="utf-8")
        if written != reference:
            print(
                f"error: {path} is out of date with the code ({_first_difference(written, reference)}); regenerate "
                f"it with `{regenerate}`",
                file=sys.stderr,
            )
            return 1
        print(f"{path} is up to date")
        return 0
    if args.output is not None:
        output = Path(args.output)
        if not output.parent.is_dir():
            print(
                f"error: cannot write {output}: directory {output.parent} does not exist; create it first",
                file=sys.stderr,
            )
            return 2
        try:
            write_atomically(output, reference.encode("utf-8"))
        except DataFileError as error:  # a failed write, or a link at the output's name
            print(f"error: {error}", file=sys.stderr)
            return 2
        print(f"wrote {args.output}")
        return 0
    sys.stdout.write(reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
