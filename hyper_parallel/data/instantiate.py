"""Build pipeline objects from YAML: ``_target_`` nodes called with their keys, runtime facts offered by name.

Owns: reading a YAML config into plain containers (``load_config``, ``load_config_text``; a value tagged with a
YAML type a config cannot hold, such as ``!!set``, ``!!binary`` or ``!!python/...``, is refused naming its key) and
turning a config tree into objects (``instantiate``). A mapping with ``_target_: dotted.path`` is called with its
other keys as keyword arguments, after its own values are built (depth-first); ``_args_`` gives positional arguments and
``_partial_: true`` returns a ``functools.partial`` instead of calling. A target is a public class or function
(or a class's classmethod) named by its canonical path, in a module under ``allowed_prefixes``; in this library,
only the pipeline building blocks of ``LIBRARY_TARGET_MODULES`` qualify, so a config cannot call the instantiation
machinery, widen its own allowlist, or reach other modules through attributes. ``context`` holds what the
trainer knows at run time (tokenizer, ranks, batch sizes, seed): each entry is passed to every target whose
signature names it and whose node does not set it. The whole tree is checked (targets, keys, required arguments)
before anything is built, so a typo deep in the config fails at once rather than after minutes of tokenizer or
dataset construction. Not responsible for: what the targets do, nor
config schemas (each target validates its own arguments).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import os
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hyper_parallel.data.errors import DataConfigError

__all__ = [
    "ARGS_KEY",
    "DEFAULT_ALLOWED_PREFIXES",
    "LIBRARY_TARGET_MODULES",
    "PARTIAL_KEY",
    "TARGET_KEY",
    "check_config",
    "instantiate",
    "load_config",
    "load_config_text",
]

TARGET_KEY = "_target_"
ARGS_KEY = "_args_"
PARTIAL_KEY = "_partial_"
_RESERVED_KEYS = (TARGET_KEY, ARGS_KEY, PARTIAL_KEY)
DEFAULT_ALLOWED_PREFIXES = ("hyper_parallel.",)
# The library's pipeline building blocks: the only hyper_parallel modules whose public classes and functions a
# config may name, whatever the allowed prefixes. The instantiation machinery, the pipeline assembly (which takes
# its own allowlist), the command-line tools and the file writers are deliberately absent.
LIBRARY_TARGET_MODULES = frozenset(
    {
        "hyper_parallel.data.batching",
        "hyper_parallel.data.batching.build_collate_fn",
        "hyper_parallel.data.batching.build_dataloader",
        "hyper_parallel.data.batching.get_batch",
        "hyper_parallel.data.batching.token_batcher",
        "hyper_parallel.data.indexed.indexed_data_config",
        "hyper_parallel.data.mixture.build_mixture",
        "hyper_parallel.data.parallel.batch_sampler",
        "hyper_parallel.data.parallel.data_schedule_utils",
        "hyper_parallel.data.text.build_data_transform",
        "hyper_parallel.data.text.build_dataset",
        "hyper_parallel.data.text.build_tokenizer",
        "hyper_parallel.data.text.chat_template",
        "hyper_parallel.data.text.online.online_dataset",
    }
)

# Parameter kinds that can be given by keyword, hence by a config key or a context entry.
_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_VARIADIC_KINDS = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


# -- loading ---------------------------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike) -> dict:
    """Read a YAML config file and return it as plain dicts, lists and scalars, interpolations resolved.

    ``${other.key}`` and ``${oc.env:VAR}`` are resolved by omegaconf; a ``???`` (mandatory) value left unset is an
    error. Parse YAML held in a string with ``load_config_text``.

    Args:
        path: the YAML file.

    Returns:
        The top-level mapping as a ``dict``.

    Raises:
        DataConfigError: the file is missing, unreadable or empty, is not valid YAML, its top level is not a
            mapping, a value carries a YAML tag a config cannot hold (``!!set``, ``!!binary``, ``!!timestamp``,
            ``!!python/...``), or an interpolation cannot be resolved. The message names the file.
    """
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        hint = "; to parse YAML text, call load_config_text" if "\n" in str(path) else ""
        raise DataConfigError(f"config file {path} does not exist; check the path{hint}") from None
    except OSError as error:
        raise DataConfigError(f"config file {path} cannot be read ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise DataConfigError(
            f"config file {path} is not UTF-8 text (byte {error.start}: {error.reason}); save it as UTF-8"
        ) from None
    return _parse_mapping(text, f"config file {path}")


def load_config_text(text: str, *, source: str = "<string>") -> dict:
    """Parse YAML text (e.g. a config embedded in a script or test) exactly as ``load_config`` reads a file.

    Args:
        text: the YAML document.
        source: how error messages name the text.

    Raises:
        DataConfigError: as ``load_config``, naming ``source``.
    """
    return _parse_mapping(text, f"config {source}")


# The YAML types omegaconf keeps as plain values; any other tag (``!!set``, ``!!binary``, ``!!python/...``, a custom
# ``!tag``) makes a value a config cannot hold, or one omegaconf would silently turn into something else.
_YAML_TAG_PREFIX = "tag:yaml.org,2002:"
_PLAIN_TAGS = frozenset(_YAML_TAG_PREFIX + name for name in ("str", "int", "float", "bool", "null", "map", "seq"))
_TAG_FIXES = {
    "set": "write a list instead, such as [a, b]",
    "omap": "write a plain mapping instead (it keeps the order of its keys)",
    "pairs": "write a plain mapping instead, or a list of [key, value] lists",
    "binary": "keep the bytes in a file and give its path",
    "timestamp": "write the date or time as a quoted string",
}
_DEFAULT_TAG_FIX = (
    "remove the tag: a config holds mappings, lists, strings, numbers, booleans and null only, and objects are "
    f"built by {TARGET_KEY} nodes"
)


class _WrittenTagReader(yaml.SafeLoader):
    """Composes YAML without resolving plain scalars, so that each node's tag is the one its text writes."""

    yaml_implicit_resolvers: dict = {}


def _parse_mapping(text: str, where: str) -> dict:
    """The YAML mapping ``text`` holds as plain containers, or a ``DataConfigError`` naming ``where`` and the key."""
    try:
        root = yaml.compose(text, Loader=_WrittenTagReader)
    except yaml.YAMLError as error:
        raise DataConfigError(f"{where} is not valid YAML: {_one_line(error)}") from None
    if root is None:
        raise DataConfigError(
            f"{where} is empty; a pipeline config is a mapping of nodes, such as dataset: and dataloader:"
        )
    if not isinstance(root, yaml.MappingNode):
        held = "a list" if isinstance(root, yaml.SequenceNode) else f"the scalar {root.value!r}"
        raise DataConfigError(
            f"{where} must hold a mapping at the top level (keys such as dataset: and dataloader:), got {held}"
        )
    _refuse_unplain_tags(root, where)
    try:
        loaded = OmegaConf.create(text)
    except yaml.YAMLError as error:
        raise DataConfigError(f"{where} is not valid YAML: {_one_line(error)}") from None
    except OmegaConfBaseException as error:
        raise DataConfigError(f"{where}: {type(error).__name__}: {_one_line(error)}; fix that key") from None
    return _to_container(loaded, where)


def _refuse_unplain_tags(root: yaml.Node, where: str) -> None:
    """Refuse the first node, in document order, whose written tag is not a plain YAML type, naming its key."""
    pending: list[tuple[yaml.Node, str]] = [(root, "")]
    seen: set[int] = set()  # an alias is the node it names: visit each once, whatever the aliases
    while pending:
        node, path = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.tag not in _PLAIN_TAGS:
            short = node.tag.removeprefix(_YAML_TAG_PREFIX)
            written = f"!!{short}" if short != node.tag else node.tag
            fix = _TAG_FIXES.get(short, _DEFAULT_TAG_FIX)
            raise DataConfigError(
                f"{where}: {_where(path)} (line {node.start_mark.line + 1}) is tagged {written}, a value a config "
                f"cannot hold; {fix}"
            )
        if isinstance(node, yaml.MappingNode):
            children = []
            for key, value in node.value:
                named = _join(path, key.value if isinstance(key, yaml.ScalarNode) else "<complex key>")
                children += [(key, named), (value, named)]
        elif isinstance(node, yaml.SequenceNode):
            children = [(value, f"{path}[{index}]") for index, value in enumerate(node.value)]
        else:
            children = []
        pending.extend(reversed(children))


def _one_line(error: Exception) -> str:
    """An error's message on one line: yaml and omegaconf spread theirs over several, the CLI prints one."""
    return " ".join(str(error).split())


def _to_container(config: DictConfig | ListConfig, where: str) -> Any:
    try:
        return OmegaConf.to_container(config, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as error:
        # omegaconf's own message names the key ("full_key: ..."); keep it whole.
        raise DataConfigError(
            f"{where}: {type(error).__name__}: {_one_line(error)}. Fix the interpolation or set the value."
        ) from None


# -- instantiation ---------------------------------------------------------------------------------------------------


def instantiate(
    config: Any,
    /,
    *,
    context: Mapping[str, Any] | None = None,
    allowed_prefixes: Sequence[str] | str = DEFAULT_ALLOWED_PREFIXES,
    path: str = "",
) -> Any:
    """Build the objects a config describes.

    Mappings with ``_target_`` are called (see the module docstring), other mappings become dicts and lists stay
    lists, their values built recursively; other values are returned as they are. The whole tree is checked
    before any target is called.

    Args:
        config: a dict/list/scalar tree, or an omegaconf ``DictConfig``/``ListConfig`` (resolved first).
        context: runtime values, e.g. ``{"tokenizer": tok, "dp_rank": 0, "micro_batch_size": 4}``. An entry is
            passed to a target only when its signature (``__init__`` for a class) has a parameter of that name
            that can be given by keyword (``**kwargs`` does not count), the node does not set it, and ``_args_``
            does not fill it. ``_partial_`` nodes receive it too.
        allowed_prefixes: module paths targets may come from, matched on whole dotted components
            (``"hyper_parallel."`` allows ``hyper_parallel.data.x`` but not ``hyper_parallel_x``). Only the caller
            sets them: no target can. A target must be a public name (in ``__all__`` where the module has one) of
            its module, defined there or, for a package, in one of its submodules; library modules must also be
            in ``LIBRARY_TARGET_MODULES``.
        path: where ``config`` sits in a larger file (e.g. ``"dataset"``), to prefix the paths in messages.

    Returns:
        The built tree.

    Raises:
        DataConfigError: a bad node: disallowed, missing or non-callable target, unknown or reserved key, missing
            required argument, malformed ``_args_``/``_partial_``. The message names the YAML path.
        Exception: whatever a target raises, unchanged, with a note naming the YAML path and the target.
    """
    prefixes = _normalise_prefixes(allowed_prefixes)
    if context is not None and not isinstance(context, Mapping):
        raise DataConfigError(f"context must be a mapping of name to value, got {type(context).__name__}")
    planner = _Planner(dict(context or {}), prefixes)
    return _execute(planner.plan(config, path))


def check_config(
    config: Any,
    /,
    *,
    context: Mapping[str, Any] | None = None,
    allowed_prefixes: Sequence[str] | str = DEFAULT_ALLOWED_PREFIXES,
    path: str = "",
) -> None:
    """Check a config tree exactly as ``instantiate`` does before it builds anything, and build nothing: so that a
    pipeline of several nodes checks them all before it builds the first. Only the names in ``context`` matter."""
    _Planner(dict(context or {}), _normalise_prefixes(allowed_prefixes)).plan(config, path)


def _normalise_prefixes(allowed_prefixes: Sequence[str] | str) -> tuple[str, ...]:
    # A lone string would otherwise be iterated character by character.
    if isinstance(allowed_prefixes, str):
        allowed_prefixes = (allowed_prefixes,)
    prefixes = tuple(str(prefix).rstrip(".") for prefix in allowed_prefixes)
    if not prefixes or not all(prefixes):
        raise DataConfigError(
            f"allowed_prefixes must be non-empty module paths such as 'hyper_parallel.', got {allowed_prefixes!r}"
        )
    return prefixes


def _is_allowed(module_path: str, prefixes: tuple[str, ...]) -> bool:
    return any(module_path == prefix or module_path.startswith(prefix + ".") for prefix in prefixes)


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _where(path: str) -> str:
    return path or "<root>"


@dataclass
class _Call:
    """A checked ``_target_`` node: what to call and the plans of its arguments."""

    path: str
    target_name: str
    target: Callable
    args: list
    kwargs: dict[str, Any]
    injected: dict[str, Any]
    partial: bool


class _Planner:
    """First pass: resolve every target and check every node's keys, building nothing."""

    def __init__(self, context: dict[str, Any], prefixes: tuple[str, ...]) -> None:
        self.context = context
        self.prefixes = prefixes

    def plan(self, node: Any, path: str) -> Any:
        if isinstance(node, DictConfig | ListConfig):
            node = _to_container(node, _where(path))
        if isinstance(node, Mapping):
            self._check_reserved_keys(node, path)
            if TARGET_KEY in node:
                return self._plan_call(node, path)
            return {key: self.plan(value, _join(path, key)) for key, value in node.items()}
        # Exact types only: a named tuple or other sequence is a value, not a config list.
        if type(node) in (list, tuple):
            return type(node)(self.plan(value, f"{path}[{index}]") for index, value in enumerate(node))
        return node

    def _check_reserved_keys(self, node: Mapping, path: str) -> None:
        for key in node:
            if not isinstance(key, str) or not key.startswith("_"):
                continue
            if key not in _RESERVED_KEYS:
                close = difflib.get_close_matches(key, _RESERVED_KEYS, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise DataConfigError(
                    f"{_join(path, key)}: keys starting with '_' are reserved for instantiation and '{key}' is not "
                    f"one of {list(_RESERVED_KEYS)}{hint}; rename or remove it"
                )
            if key != TARGET_KEY and TARGET_KEY not in node:
                raise DataConfigError(
                    f"{_join(path, key)}: '{key}' only applies beside '{TARGET_KEY}', which this node lacks; add "
                    f"'{TARGET_KEY}: <dotted.path>' or remove '{key}'"
                )

    def _plan_call(self, node: Mapping, path: str) -> _Call:
        target_name = node[TARGET_KEY]
        target = _resolve_target(target_name, _join(path, TARGET_KEY), self.prefixes)
        partial = node.get(PARTIAL_KEY, False)
        if not isinstance(partial, bool):
            raise DataConfigError(
                f"{_join(path, PARTIAL_KEY)}: must be true or false, got {partial!r} ({type(partial).__name__})"
            )
        args = node.get(ARGS_KEY, [])
        if not isinstance(args, list | tuple):
            raise DataConfigError(
                f"{_join(path, ARGS_KEY)}: must be a list of positional arguments, got {args!r}; write e.g. "
                f"'{ARGS_KEY}: [value]'"
            )
        kwargs = {key: value for key, value in node.items() if key not in _RESERVED_KEYS}
        for key in kwargs:
            if not isinstance(key, str):
                raise DataConfigError(
                    f"{_join(path, key)}: keyword argument names of {target_name} must be strings, got {key!r} "
                    f"({type(key).__name__}); quote the key in the YAML"
                )
        injected = self._check_arguments(target, target_name, path, len(args), set(kwargs), partial)
        return _Call(
            path=path,
            target_name=target_name,
            target=target,
            args=[self.plan(value, _join(path, f"{ARGS_KEY}[{index}]")) for index, value in enumerate(args)],
            kwargs={key: self.plan(value, _join(path, key)) for key, value in kwargs.items()},
            injected=injected,
            partial=partial,
        )

    def _check_arguments(
        self, target: Callable, target_name: str, path: str, num_args: int, keys: set[str], partial: bool
    ) -> dict[str, Any]:
        """Check the node's arguments against the target's signature; return the context entries to pass."""
        try:
            # For a class this is its __init__ (or __new__) without ``self``.
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            # Some builtins have no introspectable signature: call them as written, without context.
            return {}
        parameters = signature.parameters
        takes_var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        keyword_names = [name for name, p in parameters.items() if p.kind in _KEYWORD_KINDS]
        for key in sorted(keys):
            if key in keyword_names or takes_var_keyword:
                continue
            if key in parameters and parameters[key].kind is inspect.Parameter.POSITIONAL_ONLY:
                raise DataConfigError(
                    f"{_join(path, key)}: parameter '{key}' of {target_name} is positional-only; give it in "
                    f"'{ARGS_KEY}' instead"
                )
            close = difflib.get_close_matches(key, keyword_names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise DataConfigError(
                f"{_join(path, key)}: {target_name} has no parameter '{key}'{hint}; accepted parameters: "
                f"{', '.join(keyword_names) or '(none)'}. Fix or remove the key"
            )
        placeholders = [None] * num_args
        try:
            by_position = set(signature.bind_partial(*placeholders).arguments)
        except TypeError as error:
            raise DataConfigError(
                f"{_join(path, ARGS_KEY)}: {target_name}{signature} does not take {num_args} positional "
                f"argument(s) ({error}); shorten '{ARGS_KEY}' or give values by keyword"
            ) from None
        twice = sorted(keys & by_position)
        if twice:
            raise DataConfigError(
                f"{_join(path, twice[0])}: '{twice[0]}' of {target_name} is given twice, by '{ARGS_KEY}' and by "
                "this key; keep one"
            )
        # Explicit config (a key or a positional argument) wins over context.
        injected = {
            name: value
            for name, value in self.context.items()
            if name in keyword_names and name not in keys and name not in by_position
        }
        if not partial:
            given = keys | by_position | set(injected)
            missing = [
                name
                for name, p in parameters.items()
                if p.default is inspect.Parameter.empty and p.kind not in _VARIADIC_KINDS and name not in given
            ]
            if missing:
                raise DataConfigError(
                    f"{_where(path)}: {target_name} is missing required argument(s) {', '.join(missing)}; set "
                    f"them under {_where(path)}, pass them in context, or add '{PARTIAL_KEY}: true' to supply "
                    "them when calling"
                )
        # The checks above give the clearer messages; ``bind`` is the final word on what the call accepts.
        bind = signature.bind_partial if partial else signature.bind
        try:
            bind(*placeholders, **dict.fromkeys(keys | set(injected)))
        except TypeError as error:
            raise DataConfigError(
                f"{_where(path)}: the arguments do not fit {target_name}{signature} ({error}); fix the node's keys "
                f"or '{ARGS_KEY}'"
            ) from None
        return injected


def _resolve_target(target_name: Any, path: str, prefixes: tuple[str, ...]) -> Callable:
    """The class or function ``target_name`` names, by its canonical name, or a ``DataConfigError`` saying why not.

    Refused before anything is imported: malformed paths, private or dunder components, modules outside
    ``prefixes``. Refused after importing the named module: names outside its public API, attribute paths through
    other objects, aliases and re-exports from other modules, objects that are not classes or functions, and any
    ``hyper_parallel`` module that is not a pipeline building block (``LIBRARY_TARGET_MODULES``).
    """
    if not isinstance(target_name, str) or not target_name:
        raise DataConfigError(
            f"{path}: must be a dotted path such as 'hyper_parallel.data.text.build_tokenizer.build_tokenizer', "
            f"got {target_name!r}"
        )
    parts = target_name.split(".")
    if not all(part.isidentifier() for part in parts):
        raise DataConfigError(f"{path}: '{target_name}' is not a dotted path of Python names; check its spelling")
    private = [part for part in parts if part.startswith("_")]
    if private:
        raise DataConfigError(
            f"{path}: target '{target_name}' goes through the private or dunder name '{private[0]}', which is "
            "refused; name a public class or function"
        )
    allow_hint = f"pass allowed_prefixes=({', '.join(repr(p + '.') for p in prefixes)}, '<your.module>.') to allow it"
    # Checked before importing: importing a module runs its code.
    if not _is_allowed(target_name, prefixes):
        raise DataConfigError(
            f"{path}: target '{target_name}' is outside the allowed module prefixes "
            f"{[p + '.' for p in prefixes]}; {allow_hint}"
        )
    module, depth = _import_longest_module(target_name, parts, path)
    module_name, attributes = ".".join(parts[:depth]), parts[depth:]
    if not attributes:
        raise DataConfigError(
            f"{path}: target '{target_name}' is a module, not a function or class; name one of its public "
            "functions or classes"
        )
    obj = _attribute(module, module_name, attributes, target_name, path)
    defined_in = _canonical_module(obj, module, module_name, attributes, target_name, path)
    if not _is_allowed(defined_in, prefixes):
        raise DataConfigError(
            f"{path}: target '{target_name}' resolves to an object defined in module {defined_in!r}, outside the "
            f"allowed module prefixes {[p + '.' for p in prefixes]}; {allow_hint}"
        )
    if any(_is_allowed(name, ("hyper_parallel",)) for name in (module_name, defined_in)) and not (
        module_name in LIBRARY_TARGET_MODULES and defined_in in LIBRARY_TARGET_MODULES
    ):
        raise DataConfigError(
            f"{path}: target '{target_name}' is not a pipeline building block: the instantiation machinery, the "
            "pipeline assembly and the command-line tools cannot be called from a config. Name a public class or "
            f"function of one of: {', '.join(sorted(LIBRARY_TARGET_MODULES))}"
        )
    return obj


def _attribute(module: Any, module_name: str, attributes: list[str], target_name: str, path: str) -> Any:
    """Follow ``attributes`` from ``module``: one of its public names, then at most a classmethod or staticmethod."""
    exports = _exports(module)
    if attributes[0] not in exports:
        if hasattr(module, attributes[0]):
            reason = (
                f"'{attributes[0]}' is not part of the public API of {module_name} (its __all__); a config may "
                "name a module's public classes and functions only"
            )
        else:
            close = difflib.get_close_matches(attributes[0], _suggestions(module, exports), n=1)
            hint = f" (did you mean '{module_name}.{close[0]}'?)" if close else ""
            reason = f"'{module_name}' has no attribute or submodule '{attributes[0]}'{hint}; check the spelling"
        raise DataConfigError(f"{path}: target '{target_name}' cannot be used: {reason}")
    obj = getattr(module, attributes[0])
    if len(attributes) == 1:
        return obj
    method = ".".join(attributes[1:])
    kind = inspect.getattr_static(obj, method, None) if inspect.isclass(obj) and len(attributes) == 2 else None
    if not isinstance(kind, classmethod | staticmethod):
        raise DataConfigError(
            f"{path}: target '{target_name}' reaches '{method}' through '{module_name}.{attributes[0]}', which is "
            "refused; name a class or function of a module ('module.name') or a class's classmethod or "
            "staticmethod ('module.Class.method')"
        )
    return getattr(obj, method)


def _canonical_module(obj: Any, module: Any, module_name: str, attributes: list[str], target_name: str, path: str):
    """The module that defines ``obj``'s class or function, after checking that the target names it canonically:
    by its own name, in that module or in a package re-exporting it from one of its submodules, never as an alias
    or as another module's import."""
    owner = getattr(module, attributes[0])
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        raise DataConfigError(
            f"{path}: target '{target_name}' is a {type(obj).__name__}, not a function or class; point "
            f"{TARGET_KEY} at a class or function"
        )
    defined_in = getattr(owner, "__module__", None)
    own_name = getattr(owner, "__qualname__", None)
    at_home = isinstance(defined_in, str) and (
        defined_in == module_name or (hasattr(module, "__path__") and defined_in.startswith(module_name + "."))
    )
    if not at_home or own_name != attributes[0]:
        canonical = ".".join([str(defined_in), str(own_name), *attributes[1:]])
        raise DataConfigError(
            f"{path}: target '{target_name}' is '{canonical}' reached through {module_name}; name it by its "
            "canonical path (if its module is allowed)"
        )
    return defined_in


def _exports(module: Any) -> list[str]:
    """A module's public names: its ``__all__``, or else every name without a leading underscore."""
    names = getattr(module, "__all__", None)
    if names is None:
        return [name for name in vars(module) if not name.startswith("_")]
    return [name for name in names if isinstance(name, str)]


def _suggestions(module: Any, exports: list[str]) -> list[str]:
    # A package's submodules are attributes only once imported; offer them as suggestions all the same.
    if hasattr(module, "__path__"):
        return exports + [info.name for info in pkgutil.iter_modules(module.__path__)]
    return exports


def _import_longest_module(target_name: str, parts: list[str], path: str) -> tuple[Any, int]:
    """Import ``parts[:depth]`` for the largest ``depth`` that is a module; return it and ``depth``."""
    module, depth = None, 0
    for index in range(1, len(parts) + 1):
        name = ".".join(parts[:index])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name and (name == error.name or name.startswith(error.name + ".")):
                break  # ``name`` itself does not exist: the rest are attributes
            raise DataConfigError(
                f"{path}: importing '{name}' for target '{target_name}' failed because a module it imports is "
                f"missing ({error}); install it or fix that import"
            ) from error
        except Exception as error:
            error.add_note(f"while importing '{name}' for {TARGET_KEY} '{target_name}' at {path}")
            raise
        depth = index
    if module is None:
        raise DataConfigError(f"{path}: target '{target_name}' cannot be found: no module named '{parts[0]}'")
    return module, depth


def _execute(plan: Any) -> Any:
    """Second pass: build depth-first, each target after its arguments."""
    if isinstance(plan, _Call):
        args = [_execute(value) for value in plan.args]
        kwargs = {**plan.injected, **{key: _execute(value) for key, value in plan.kwargs.items()}}
        if plan.partial:
            return functools.partial(plan.target, *args, **kwargs)
        try:
            return plan.target(*args, **kwargs)
        except Exception as error:
            if isinstance(error, DataConfigError):
                error.within(plan.path)  # a target's config error is about this node: its message says where
            error.add_note(f"while building {_where(plan.path)} ({TARGET_KEY}: {plan.target_name})")
            raise
    if isinstance(plan, dict):
        return {key: _execute(value) for key, value in plan.items()}
    if type(plan) in (list, tuple):
        return type(plan)(_execute(value) for value in plan)
    return plan
