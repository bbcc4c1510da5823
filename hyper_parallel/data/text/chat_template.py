"""Chat templates: turn a conversation into token ids and per-token labels that supervise chosen messages.

Owns: normalizing raw messages (role aliases, ``role_map``, field checks; other fields are kept for the
template), the ``ChatTemplate`` interface, the named templates (``tokenizer``, ``gpt_oss``, ``chatml``,
``llama2``, ``default``) and their registry, and the bounded sandbox Jinja templates render in (the one
``transformers`` uses, where nothing a template builds may pass ``TEMPLATE_SIZE_LIMIT``). Labels returned here
are **unshifted**: ``labels[i]`` is ``input_ids[i]`` where the token is supervised and ``IGNORE_INDEX``
elsewhere; shifting into next-token targets is the transform's job (``build_data_transform``).
Not responsible for: picking the conversation out of a record, shifting, truncation or batching.

Supervision: a message with a truthy ``loss_mask`` is supervised, one with a falsy ``loss_mask`` is not, and
without ``loss_mask`` only ``assistant`` messages are. Within a supervised message the role header (e.g.
``<|im_start|>assistant\\n``) is not supervised by default; the content and the end-of-turn tokens are. With
``supervise_role_header=True`` the header is supervised too, as upstream hyper_parallel does.
"""

from __future__ import annotations

import functools
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from numbers import Integral
from pathlib import Path

import numpy as np
from jinja2 import Environment, TemplateError, nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.text.build_tokenizer import build_tokenizer
from hyper_parallel.data.tokenizer_protocol import read_tokenizer

__all__ = [
    "CANONICAL_ROLES",
    "CHAT_TEMPLATE_REGISTRY",
    "ROLE_ALIASES",
    "ChatMLTemplate",
    "ChatTemplate",
    "DefaultChatTemplate",
    "GptOssChatTemplate",
    "Llama2ChatTemplate",
    "TEMPLATE_SIZE_LIMIT",
    "TERMINAL_REWRITES",
    "TokenizerChatTemplate",
    "build_chat_template",
    "is_supervised",
    "message_keys",
    "normalize_messages",
]

logger = get_logger("hyper_parallel.data.text.chat_template")

CANONICAL_ROLES = ("system", "user", "assistant", "tool")

# Lower-cased role name -> canonical role. Covers ShareGPT (human/gpt), Gemini (model) and tool-call formats.
ROLE_ALIASES: dict[str, str] = {
    **{role: role for role in CANONICAL_ROLES},
    "human": "user",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "function": "tool",
    "observation": "tool",
}

_KNOWN_ROLES_TEXT = (
    f"known roles: {', '.join(CANONICAL_ROLES)} "
    f"(aliases: {', '.join(f'{alias}->{role}' for alias, role in ROLE_ALIASES.items() if alias != role)})"
)


def _preview(value, limit: int = 60) -> str:
    """A short repr for error messages, so that a long value cannot flood a log."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _resolve_role(role: str, role_map: Mapping | None) -> str | None:
    """The canonical role of ``role``: ``role_map`` first (exact, then lower-cased key), then the aliases."""
    if role_map:
        mapped = role_map.get(role)
        if mapped is None:
            mapped = role_map.get(role.lower())
        if mapped is not None:
            canonical = ROLE_ALIASES.get(mapped.lower()) if isinstance(mapped, str) else None
            if canonical is None:
                raise DataConfigError(
                    f"role_map maps {role!r} to {_preview(mapped)}, which is not a role; map it to one of "
                    f"{', '.join(CANONICAL_ROLES)}"
                )
            return canonical
    return ROLE_ALIASES.get(role.lower())


def _flag(value, name: str) -> bool:
    # bool("false") is True: a quoted YAML value must not silently mean the opposite
    if not isinstance(value, bool | np.bool_):
        raise DataConfigError(
            f"{name} must be true or false, got {value!r} ({type(value).__name__}); write it unquoted"
        )
    return bool(value)


def _check_loss_mask(value, where: str, position: int) -> bool | int:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, Integral) and int(value) in (0, 1):
        return int(value)
    raise DataFileError(
        f"{where}: message {position}: field 'loss_mask' must be true/false or 0/1, got {_preview(value)}; "
        "fix the value or drop the field (then only assistant messages are supervised)"
    )


_OPENAI_KEYS = ("role", "content")
_SHAREGPT_KEYS = ("from", "value")


def message_keys(messages, role_key: str | None, content_key: str | None) -> tuple[str, str]:
    """The fields of a conversation's messages that hold the speaker and the text: those given, and for those left
    None ``role``/``content``, or ShareGPT's ``from``/``value`` when the first message has ``from`` and no
    ``role``."""
    if role_key is not None and content_key is not None:
        return role_key, content_key
    listed = isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)) and len(messages) > 0
    # a list read from Parquet arrives as an object array
    listed = listed or (isinstance(messages, np.ndarray) and messages.ndim == 1 and messages.size > 0)
    first = messages[0] if listed else None
    sharegpt = isinstance(first, Mapping) and "from" in first and "role" not in first
    default_role, default_content = _SHAREGPT_KEYS if sharegpt else _OPENAI_KEYS
    return role_key or default_role, content_key or default_content


def normalize_messages(
    messages,
    *,
    role_key: str | None = None,
    content_key: str | None = None,
    role_map: Mapping[str, str] | None = None,
    where: str = "record",
) -> list[dict]:
    """Check raw messages and return new dicts with canonical roles, keeping every other field of a message.

    Args:
        messages: a non-empty list of mappings (a tuple or an object array, as read from Parquet, also works).
        role_key, content_key: the fields that hold the speaker and the text. None: ``role`` and ``content``, or
            ShareGPT's ``from`` and ``value`` when the first message has ``from`` and no ``role``
            (``message_keys``).
        role_map: raw role -> role; tried before the built-in aliases (exact key, then lower-cased key), so it
            can also override an alias. Values may be canonical roles or aliases. A role neither in it nor a
            known role is an error naming the role and the map.
        where: the record, for error messages (e.g. ``"record 17 of /data/train.jsonl"``).

    Returns:
        New dicts ``{"role", "content", ...}``: the canonical role, the text, ``loss_mask`` (as bool or 0/1) when
        the message has a non-null one, and every other field as it is (``metadata``, ``tool_calls``, ``name``...),
        which a ``tokenizer`` chat template sees. The ``role_key`` and ``content_key`` fields become ``role`` and
        ``content``.

    Raises:
        DataFileError: the conversation, a message, a role, a content or a ``loss_mask`` is malformed.
        DataConfigError: ``role_map`` maps a role to something that is not a role.
    """
    role_key, content_key = message_keys(messages, role_key, content_key)
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, (Sequence, np.ndarray)):
        raise DataFileError(
            f"{where}: the conversation must be a list of messages, got {type(messages).__name__}; store it as a "
            f"list of {{'{role_key}': ..., '{content_key}': ...}} objects, or point text_keys at such a field"
        )
    if len(messages) == 0:
        raise DataFileError(f"{where}: the conversation has no messages; remove the record or add messages")
    replaced = {role_key, content_key, "loss_mask"}  # written again below, normalized
    normalized = []
    for position, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise DataFileError(
                f"{where}: message {position} is a {type(message).__name__}, expected an object with "
                f"'{role_key}' and '{content_key}' fields; fix the record"
            )
        role = message.get(role_key)
        if role is None:
            raise DataFileError(
                f"{where}: message {position} has no '{role_key}' field (its fields: {sorted(map(str, message))}); "
                "add it, or set role_key to the field that names the speaker"
            )
        if not isinstance(role, str) or not role:
            raise DataFileError(
                f"{where}: message {position}: field '{role_key}' must be a non-empty string, got {_preview(role)}; "
                "fix the record"
            )
        canonical = _resolve_role(role, role_map)
        if canonical is None:
            covered = f"role_map (which maps {_preview(sorted(role_map), 120)}) does not cover it; " if role_map else ""
            raise DataFileError(
                f"{where}: message {position}: unknown role {_preview(role)} in field '{role_key}'; {covered}"
                f"{_KNOWN_ROLES_TEXT}. Map it with role_map, e.g. role_map={{{role!r}: 'user'}}"
            )
        if content_key not in message:
            raise DataFileError(
                f"{where}: message {position} has no '{content_key}' field (its fields: "
                f"{sorted(map(str, message))}); add it, or set content_key to the field that holds the text"
            )
        content = message[content_key]
        if not isinstance(content, str):
            raise DataFileError(
                f"{where}: message {position}: field '{content_key}' must be a string, got "
                f'{"null" if content is None else type(content).__name__}; use "" for an empty message and '
                "flatten multi-part content into one string"
            )
        entry = {"role": canonical, "content": content}
        entry.update((key, value) for key, value in message.items() if key not in replaced and key not in entry)
        loss_mask = message.get("loss_mask")
        if loss_mask is not None:
            entry["loss_mask"] = _check_loss_mask(loss_mask, where, position)
        normalized.append(entry)
    return normalized


def is_supervised(message: Mapping) -> bool:
    """Whether a normalized message carries loss: its ``loss_mask`` when present, else ``role == "assistant"``."""
    loss_mask = message.get("loss_mask")
    if loss_mask is None:
        return message["role"] == "assistant"
    return bool(loss_mask)


def _as_arrays(ids: list[int], labels: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)


class ChatTemplate(ABC):
    """Encodes normalized messages (see ``normalize_messages``) into ``input_ids`` and unshifted ``labels``.

    Subclasses are picklable so that they can travel to data-loader workers. A template carries its tokenizer
    (``.tokenizer``, a ``TextTokenizer``), so a transform given a template needs no tokenizer of its own.

    Porting from upstream hyper_parallel: ``encode_messages`` returns ``(input_ids, labels)`` int64 arrays instead
    of a dict of lists with ``attention_mask``, takes ``where`` instead of ``max_seq_len`` and never truncates
    (see docs/porting.md).
    """

    name: str = ""
    # attribute -> method of the Rust tokenizer that a subclass keeps bound for speed; a bound method cannot be
    # pickled, so it is left out of the pickled state and bound again after unpickling.
    _BACKEND_METHODS: dict[str, str] = {}

    def __init__(self, tokenizer, *, supervise_role_header: bool = False):
        """
        Args:
            tokenizer: anything ``build_tokenizer`` takes: a ``TextTokenizer``, a ``transformers`` tokenizer object
                (its special tokens and chat template are used), or a tokenizer path.
            supervise_role_header: also supervise the role header of every supervised message (e.g.
                ``<|im_start|>assistant\\n``), as upstream hyper_parallel does; by default only the content and the
                end-of-turn tokens are.

        Raises:
            DataConfigError: ``supervise_role_header`` is not a bool, or the tokenizer lacks what the template needs.
        """
        self.tokenizer = build_tokenizer(tokenizer)
        self.supervise_role_header = _flag(supervise_role_header, "supervise_role_header")
        self._bind_backend()

    def _bind_backend(self) -> None:
        for attribute, method in self._BACKEND_METHODS.items():
            setattr(self, attribute, getattr(self.tokenizer.backend, method))

    def __getstate__(self):
        return {name: value for name, value in self.__dict__.items() if name not in self._BACKEND_METHODS}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._bind_backend()

    @abstractmethod
    def encode_messages(self, messages: Sequence[Mapping], where: str = "record") -> tuple[np.ndarray, np.ndarray]:
        """Token ids and labels of the same length, both int64.

        Args:
            messages: normalized messages (canonical roles, string contents, optional ``loss_mask``).
            where: the record, for error messages.

        Returns:
            ``(input_ids, labels)`` with ``labels[i] == input_ids[i]`` where supervised, else ``IGNORE_INDEX``.
        """

    def __repr__(self) -> str:
        # The repr names the labels a template gives (a resumed loader compares it); the default adds nothing.
        header = ", supervise_role_header=True" if self.supervise_role_header else ""
        return f"{type(self).__name__}(tokenizer={read_tokenizer(self.tokenizer).name!r}{header})"


def _special_id(tokenizer, token: str, template: str) -> int:
    token_id = tokenizer.backend.token_to_id(token)
    if token_id is None:
        raise DataConfigError(
            f"chat_template '{template}' needs the token {token} but tokenizer "
            f"{read_tokenizer(tokenizer).name} has none; use chat_template='tokenizer' (the tokenizer's own "
            "template) or 'default'"
        )
    return token_id


def _required_eos(tokenizer, template: str) -> int:
    if tokenizer.eos_token_id is None:
        raise DataConfigError(
            f"chat_template '{template}' ends turns with the EOS token but tokenizer "
            f"{read_tokenizer(tokenizer).name} has none; set eos_token in its tokenizer_config.json or use "
            "chat_template='chatml' or 'tokenizer'"
        )
    return tokenizer.eos_token_id


class _PiecewiseTemplate(ChatTemplate):
    """A template written in Python: each message is a header and a body, encoded separately; the header is
    supervised only with ``supervise_role_header``.

    Pieces are tokenized on their own and concatenated, so no token spans a piece boundary and the label
    boundary always falls between tokens. Constant pieces (role headers, separators) are encoded once.
    """

    _BACKEND_METHODS = {"_encode_text": "encode"}

    def __init__(self, tokenizer, *, supervise_role_header: bool = False):
        super().__init__(tokenizer, supervise_role_header=supervise_role_header)
        self._constants: dict[str, list[int]] = {}

    def _encode(self, text: str) -> list[int]:
        return self._encode_text(text, add_special_tokens=False).ids if text else []

    def _constant(self, text: str) -> list[int]:
        ids = self._constants.get(text)
        if ids is None:
            ids = self._constants[text] = self._encode(text)
        return ids

    @abstractmethod
    def _pieces(self, messages: Sequence[Mapping]) -> Iterator[tuple[list[int], list[int], bool]]:
        """``(header_ids, body_ids, body_supervised)`` for each message, in order."""

    def encode_messages(self, messages: Sequence[Mapping], where: str = "record") -> tuple[np.ndarray, np.ndarray]:
        ids: list[int] = []
        labels: list[int] = []
        for header, body, supervised in self._pieces(messages):
            ids += header
            labels += header if supervised and self.supervise_role_header else [IGNORE_INDEX] * len(header)
            ids += body
            labels += body if supervised else [IGNORE_INDEX] * len(body)
        return _as_arrays(ids, labels)


class ChatMLTemplate(_PiecewiseTemplate):
    """``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message.

    A supervised message contributes its content, ``<|im_end|>`` and the newline, and with
    ``supervise_role_header`` its header ``<|im_start|>{role}\\n`` too. The markers are the tokenizer's own special
    tokens, never text. Unlike upstream hyper_parallel's ``chatml``, the content is not stripped.
    """

    name = "chatml"

    def __init__(self, tokenizer, *, supervise_role_header: bool = False):
        super().__init__(tokenizer, supervise_role_header=supervise_role_header)
        self.im_start_id = _special_id(self.tokenizer, "<|im_start|>", self.name)
        self.im_end_id = _special_id(self.tokenizer, "<|im_end|>", self.name)

    def _pieces(self, messages):
        newline = self._constant("\n")
        for message in messages:
            header = [self.im_start_id, *self._constant(f"{message['role']}\n")]
            body = [*self._encode(message["content"]), self.im_end_id, *newline]
            yield header, body, is_supervised(message)


class Llama2ChatTemplate(_PiecewiseTemplate):
    """Llama 2 chat format, tokenized turn by turn as in Meta's reference code.

    - user: BOS (when the tokenizer has one) + ``[INST] {content} [/INST]``; system messages right before a
      user message go inside it as ``<<SYS>>\\n{content}\\n<</SYS>>\\n\\n`` and share its supervision (a system
      message with no user message after it gets an ``[INST]`` turn of its own);
    - assistant: `` {content} `` + EOS, all of it supervised when the message is;
    - tool: BOS + ``[TOOL] {content} [/TOOL]``.

    Each turn is one encoded string (no separate header), so a supervised user or tool turn is supervised whole
    and ``supervise_role_header`` changes nothing.
    """

    name = "llama2"

    def __init__(self, tokenizer, *, supervise_role_header: bool = False):
        super().__init__(tokenizer, supervise_role_header=supervise_role_header)
        self.eos_id = _required_eos(self.tokenizer, self.name)
        self.bos = [] if self.tokenizer.bos_token_id is None else [self.tokenizer.bos_token_id]

    def _pieces(self, messages):
        system = ""
        for position, message in enumerate(messages):
            role, content, supervised = message["role"], message["content"], is_supervised(message)
            if role == "system":
                system += f"<<SYS>>\n{content}\n<</SYS>>\n\n"
                following = messages[position + 1]["role"] if position + 1 < len(messages) else None
                if following in ("system", "user"):
                    continue
                content = ""  # no user turn follows: the system text gets an instruction turn of its own
            if role in ("system", "user"):
                yield [], [*self.bos, *self._encode(f"[INST] {system}{content} [/INST]")], supervised
                system = ""
            elif role == "assistant":
                yield [], [*self._encode(f" {content} "), self.eos_id], supervised
            else:
                yield [], [*self.bos, *self._encode(f"[TOOL] {content} [/TOOL]")], supervised


class DefaultChatTemplate(_PiecewiseTemplate):
    """A plain format for tokenizers without a chat template: ``{Role}: {content}`` + EOS + ``\\n`` per message.

    A supervised message contributes its stripped content, the EOS token and the newline, and with
    ``supervise_role_header`` its header ``{Role}: `` too.
    """

    name = "default"

    def __init__(self, tokenizer, *, supervise_role_header: bool = False):
        super().__init__(tokenizer, supervise_role_header=supervise_role_header)
        self.eos_id = _required_eos(self.tokenizer, self.name)

    def _pieces(self, messages):
        newline = self._constant("\n")
        for message in messages:
            header = self._constant(f"{message['role'].title()}: ")
            body = [*self._encode(message["content"].strip()), self.eos_id, *newline]
            yield header, body, is_supervised(message)


# Stands in for a message's content to find where the template puts it (and so where the role header ends).
_CONTENT_PROBE = "\u2063hp-data-content-probe\u2063"

# Checked once when the template is built, so a template that cannot be rendered incrementally fails at start-up.
_PROBE_CONVERSATION = (
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "Once upon a time."},
)

_NOT_INCREMENTAL_FIX = (
    "this chat template is not incrementally renderable, so per-message labels cannot be derived from it; "
    "use a named template such as chat_template='chatml' (or 'llama2', 'default')"
)

# The one rewrite of earlier text that incremental rendering tolerates: gpt-oss ends the last assistant turn of a
# conversation with <|return|> and every earlier one with <|end|>, so adding a message after an assistant turn
# turns the final token of the previous render into <|end|>. Used when the tokenizer has both tokens.
TERMINAL_REWRITES: dict[str, str] = {"<|return|>": "<|end|>"}


# -- bounded rendering of Jinja chat templates --------------------------------------------------------------------

# The most characters a render, or any string built while rendering, may hold (and the most items of a list): far
# above any conversation a sample holds, far below what would exhaust a host's memory.
TEMPLATE_SIZE_LIMIT = 16 * 2**20

# Widths and precisions in %-style and {}-style format strings.
_FORMAT_WIDTHS = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d+))?|\{[^{}]*?:[^{}\d]*(\d*)(?:\.(\d+))?[^{}]*\}")


class _TemplateLimitError(Exception):
    """A render went past ``TEMPLATE_SIZE_LIMIT``; the chat template turns it into a ``DataConfigError``."""


def _refuse_size(size: int, what: str) -> None:
    if size > TEMPLATE_SIZE_LIMIT:
        raise _TemplateLimitError(f"{what} would hold {size:,} characters or items")


def _size(value) -> int:
    return len(value) if isinstance(value, str | list | tuple) else 0


def _refuse_wide_format(text) -> None:
    if isinstance(text, str) and ("%" in text or "{" in text):
        for match in _FORMAT_WIDTHS.finditer(text):
            _refuse_size(max((int(number) for number in match.groups() if number), default=0), "a format width")


def _refuse_large_arguments(name: str, receiver, args, kwargs) -> None:
    """Refuse a call that would build a string past the limit, before it is made: a width or count argument past
    it (``center``, ``ljust``, ``zfill``, ``indent``, ``wordwrap``...), or a join, replace, indent or format whose
    result would be."""
    values = (*args, *kwargs.values())
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool):
            _refuse_size(value, f"'{name}' with the argument {value}")
    if name == "join":
        separator, items = (receiver, args[0]) if isinstance(receiver, str) else (args[0] if args else "", receiver)
        if isinstance(items, list | tuple) and isinstance(separator, str):
            total = sum(_size(item) for item in items) + len(separator) * len(items)
            _refuse_size(total, "'join'")
    elif name == "replace" and isinstance(receiver, str) and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        _refuse_size(len(receiver) + (receiver.count(old) if old else len(receiver) + 1) * len(new), "'replace'")
    elif name == "indent" and isinstance(receiver, str) and args:
        width = args[0] if isinstance(args[0], int) else _size(args[0])
        _refuse_size(len(receiver) + (receiver.count("\n") + 1) * width, "'indent'")
    elif name in ("format", "format_map"):
        _refuse_wide_format(receiver)


def _bounded_filter(name: str, function):
    @functools.wraps(function)
    def bounded(*args, **kwargs):
        # filters that take the environment or context get it first; the value filtered comes next
        offset = 1 if args and isinstance(args[0], Environment | Context | EvalContext) else 0
        value, rest = (args[offset], args[offset + 1 :]) if len(args) > offset else (None, ())
        _refuse_large_arguments(name, value, rest, kwargs)
        result = function(*args, **kwargs)
        _refuse_size(_size(result), f"the '{name}' filter")
        return result

    return bounded


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """``tojson`` as ``transformers`` renders it (no HTML escaping; its options), built piece by piece up to the
    limit."""
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    pieces, total = [], 0
    for piece in encoder.iterencode(value):
        total += len(piece)
        _refuse_size(total, "the 'tojson' filter")
        pieces.append(piece)
    return "".join(pieces)


def _raise_exception(message):
    raise TemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _bounded_range(*args) -> range:
    numbers = range(*args)
    if len(numbers) > MAX_RANGE:
        raise _TemplateLimitError(f"range{args} has {len(numbers):,} items, past the sandbox's {MAX_RANGE:,}")
    return numbers


class _BoundedBuffer(list):
    """The buffer of a captured block (``{% set x %}``, a macro, a filter block): refuses to grow past the limit."""

    characters = 0

    def append(self, piece) -> None:
        self.characters += len(piece) if isinstance(piece, str) else 0
        _refuse_size(self.characters, "a captured block")
        super().append(piece)

    def extend(self, pieces) -> None:
        for piece in pieces:
            self.append(piece)


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``~`` and captured blocks to calls that check their size."""

    def buffer(self, frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.bounded_buffer()")

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.bounded_concat((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (``transformers``' marker of assistant text) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox ``transformers`` renders chat templates in (immutable builtins, ``trim_blocks``,
    ``lstrip_blocks``, loop controls, its ``tojson``, ``raise_exception`` and ``strftime_now``), where nothing a
    template builds may pass ``TEMPLATE_SIZE_LIMIT``: operators, ``~``, filters, method calls, ``range``,
    captured blocks and the render itself are checked before they allocate. The checked operators are also never
    folded when the template is compiled."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, function) for name, function in self.filters.items()}
        self.globals.update(range=_bounded_range, raise_exception=_raise_exception, strftime_now=_strftime_now)

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            count, sequence = (right, left) if isinstance(right, int) else (left, right)
            if isinstance(count, int) and isinstance(sequence, str | list | tuple):
                _refuse_size(len(sequence) * max(count, 0), "a repetition with '*'")
            elif isinstance(left, int) and isinstance(right, int):
                _refuse_size((left.bit_length() + right.bit_length()) // 8, "a product of integers")
        elif operator == "+":
            if isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
                _refuse_size(len(left) + len(right), "a sum with '+'")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                _refuse_size(right * left.bit_length() // 8, "a power with '**'")
        elif operator == "%":
            _refuse_wide_format(left)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - the sandbox's own signature
        bound = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        _refuse_large_arguments(getattr(bound, "__name__", ""), getattr(bound, "__self__", None), args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        _refuse_size(_size(result), f"the call of '{getattr(bound, '__name__', 'a function')}'")
        return result

    @staticmethod
    def bounded_buffer() -> _BoundedBuffer:
        return _BoundedBuffer()

    @staticmethod
    def bounded_concat(values) -> str:
        pieces = [value if isinstance(value, str) else str(value) for value in values]
        _refuse_size(sum(map(len, pieces)), "a concatenation with '~'")
        return "".join(pieces)


@functools.lru_cache(maxsize=32)
def _compiled_template(source: str):
    """The template compiled once per process, as ``transformers`` caches its own."""
    return _BoundedSandbox().from_string(source)


def _template_messages(messages: Sequence[Mapping]) -> list[dict]:
    """The messages as ``transformers`` hands them to a template: fields that are None dropped, and a message's
    reasoning offered under ``reasoning_content`` and ``thinking`` whichever name it came under."""
    shown = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next(
            (message[key] for key in ("reasoning_content", "thinking", "reasoning") if key in message), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        shown.append(message)
    return shown


def _render_bounded(source: str, messages: Sequence[Mapping], context: Mapping) -> str:
    """Render ``source`` for ``messages`` in the bounded sandbox, counting the output as it is produced."""
    pieces, total = [], 0
    variables = {**context, "messages": _template_messages(messages)}
    for piece in _compiled_template(source).generate(tools=None, documents=None, **variables):
        total += len(piece)
        _refuse_size(total, "the render")
        pieces.append(piece)
    return "".join(pieces)


class TokenizerChatTemplate(ChatTemplate):
    """The tokenizer's own Jinja chat template, rendered incrementally to find each message's tokens.

    Messages ``[:1]``, ``[:2]``, ... are rendered as ``apply_chat_template(..., tokenize=False)`` renders them,
    in a sandbox where nothing the template builds may pass ``TEMPLATE_SIZE_LIMIT`` characters (a template that
    would is a ``DataConfigError`` naming it, before the memory is taken); the text of message ``k`` is what
    the render of ``[:k+1]`` adds to the render of ``[:k]``. Every field of a message reaches the template
    (``tool_calls``, ``metadata``...). Every render must extend the previous one, as text and as tokens (each
    render is tokenized in full), otherwise the template rewrites earlier messages and a ``DataConfigError``
    says so. One rewrite is tolerated (``TERMINAL_REWRITES``, when the tokenizer has both
    tokens): a previous render that ends with gpt-oss's ``<|return|>`` may continue with ``<|end|>`` in its place;
    that token then belongs to the earlier message, with the ``<|end|>`` id as its label when it is supervised.

    For a supervised message the prefix is also rendered with ``add_generation_prompt=True``: that header (e.g.
    ``<|im_start|>assistant\\n``) is not supervised, only the content and the end-of-turn text after it. When the
    generation prompt does not match the message (a supervised non-assistant message, or a template without
    one), the header is found by rendering the message with a placeholder content; failing that, the whole
    message is supervised. With ``supervise_role_header`` no header is searched: every token a supervised
    message adds is supervised, as upstream hyper_parallel does.

    The compiled Jinja template is cached per process; this class keeps the template text, so a
    pickled copy renders the same way after the tokenizer is reloaded in a worker. The template is checked
    once on a short conversation when built, so a template that rewrites earlier messages fails at start-up.
    Cost: all prefixes are rendered in one batched call and tokenized in one batch, so the work grows with the
    square of the number of messages (about 1 ms for a 4-message exchange, tens of ms for 40 long turns); the
    named templates are linear.
    """

    name = "tokenizer"
    _BACKEND_METHODS = {"_encode_batch": "encode_batch"}

    def __init__(self, tokenizer, template: str | None = None, *, supervise_role_header: bool = False):
        """
        Args:
            tokenizer: anything ``build_tokenizer`` takes; its ``hf`` tokenizer's special tokens reach the template
                by name (for a ``transformers`` tokenizer object: the object's own).
            template: a Jinja template to use instead of the tokenizer's own (``tokenizer.chat_template``).
            supervise_role_header: also supervise each supervised message's role header (see ``ChatTemplate``).

        Raises:
            DataConfigError: the tokenizer has no chat template, or the template rewrites earlier messages.
        """
        super().__init__(tokenizer, supervise_role_header=supervise_role_header)
        explicit = template is not None
        if template is None:
            template = getattr(self.tokenizer.hf, "chat_template", None)
            if isinstance(template, dict):
                template = template.get("default")
        if not isinstance(template, str) or not template.strip():
            raise DataConfigError(
                f"tokenizer {read_tokenizer(self.tokenizer).name} has no chat template; add a "
                "chat_template.jinja (or chat_template in tokenizer_config.json) to the tokenizer directory, or use "
                "a named template: chat_template='chatml', 'llama2' or 'default'"
            )
        self.template = template
        self.template_source = self._describe_source(explicit)
        # what transformers offers a template besides the messages: the special tokens by name
        self._template_context = dict(self.tokenizer.hf.special_tokens_map)
        token_id = self.tokenizer.backend.token_to_id
        # (text ending a render, text replacing it, the id it had, the id it gets) for the tokens this tokenizer has
        self.terminal_rewrites = tuple(
            (old, new, token_id(old), token_id(new))
            for old, new in TERMINAL_REWRITES.items()
            if token_id(old) is not None and token_id(new) is not None
        )
        self._check_with_probe()

    def _check_with_probe(self) -> None:
        try:
            self.encode_messages(_PROBE_CONVERSATION, where="the check conversation of chat_template='tokenizer'")
        except DataConfigError:
            raise
        except Exception as error:  # noqa: BLE001 - a template may reject the probe; real records decide then
            logger.debug("chat template check skipped: %s: %s", type(error).__name__, error)

    def _describe_source(self, explicit: bool) -> str:
        """Where the template comes from, for messages: the file of the tokenizer directory, or the argument."""
        name = read_tokenizer(self.tokenizer).name
        if explicit:
            return f"the chat template passed as template= (tokenizer {name})"
        for file_name in ("chat_template.jinja", "tokenizer_config.json"):
            if (Path(name) / file_name).is_file():
                return f"the chat template in {Path(name) / file_name}"
        return f"the chat template of tokenizer {name}"

    def _render(self, conversations: list[list[Mapping]], add_generation_prompt: bool = False) -> list[str]:
        context = {**self._template_context, "add_generation_prompt": add_generation_prompt}
        try:
            return [_render_bounded(self.template, messages, context) for messages in conversations]
        except _TemplateLimitError as error:
            raise DataConfigError(
                f"{self.template_source}: {error}, past the limit of {TEMPLATE_SIZE_LIMIT:,} a chat template may "
                "build (TEMPLATE_SIZE_LIMIT); fix the template, or use a named template such as "
                "chat_template='chatml'"
            ) from None

    def _render_prefixes(self, messages: list[Mapping], where: str) -> list[str]:
        try:
            return self._render([messages[: k + 1] for k in range(len(messages))])
        except DataConfigError:
            raise
        except Exception as error:  # noqa: BLE001 - Jinja templates raise anything; find the message
            failure, k = error, len(messages) - 1
            for position in range(len(messages)):
                try:
                    self._render([messages[: position + 1]])
                except Exception as first_error:  # noqa: BLE001
                    failure, k = first_error, position
                    break
            raise DataFileError(
                f"{where}: the chat template failed on message {k} (role '{messages[k]['role']}'): "
                f"{type(failure).__name__}: {failure}; fix the conversation (e.g. the order of roles the "
                "template expects) or use another chat_template such as 'chatml'"
            ) from None

    def _try_render(self, conversations: list[list[Mapping]], add_generation_prompt: bool = False) -> list[str] | None:
        if not conversations:
            return []
        try:
            return self._render(conversations, add_generation_prompt)
        except DataConfigError:
            raise
        except Exception:  # noqa: BLE001 - a failed header search only means the header is supervised
            return None

    def _kept_prefixes(
        self, messages: list[Mapping], renders: list[str], where: str
    ) -> list[tuple[str, tuple[int, int] | None]]:
        """For each message ``k``: the render of ``messages[:k]`` as it stands at the start of ``renders[k]``, and
        the ``(old id, new id)`` of its final token when a terminal rewrite changed it.

        Raises:
            DataConfigError: a render is not the previous one extended, nor it with a terminal rewrite.
        """
        kept: list[tuple[str, tuple[int, int] | None]] = []
        previous = ""
        for k, text in enumerate(renders):
            if text.startswith(previous):
                kept.append((previous, None))
            else:
                rewritten = next(
                    (
                        (f"{previous[: -len(old)]}{new}", (old_id, new_id))
                        for old, new, old_id, new_id in self.terminal_rewrites
                        if previous.endswith(old) and text.startswith(f"{previous[: -len(old)]}{new}")
                    ),
                    None,
                )
                if rewritten is None:
                    what = "shrinks the text" if len(text) < len(previous) else "rewrites the text of earlier messages"
                    raise self._prefix_error(where, k, messages[k]["role"], what)
                kept.append(rewritten)
            previous = text
        return kept

    def _header_ends(
        self, messages: list[Mapping], supervised: list[bool], renders: list[str], kept: list[str]
    ) -> dict[int, str]:
        """For each supervised message ``k``: the render up to the end of its role header (within ``renders[k]``)."""
        ends: dict[int, str] = {}
        with_prompt = [k for k in range(1, len(messages)) if supervised[k] and messages[k]["role"] == "assistant"]
        prompted = self._try_render([messages[:k] for k in with_prompt], add_generation_prompt=True) or []
        for k, text in zip(with_prompt, prompted, strict=False):
            if len(text) > len(kept[k]) and text.startswith(kept[k]) and renders[k].startswith(text):
                ends[k] = text
        searched = [k for k in range(len(messages)) if supervised[k] and k not in ends]
        probed = self._try_render([[*messages[:k], {**messages[k], "content": _CONTENT_PROBE}] for k in searched])
        for k, text in zip(searched, probed or [], strict=False):
            found = text.find(_CONTENT_PROBE, len(kept[k]))
            if found >= 0 and text.startswith(kept[k]) and renders[k].startswith(text[:found]):
                ends[k] = text[:found]
        return ends

    def _prefix_error(self, where: str, k: int, role: str, what: str) -> DataConfigError:
        return DataConfigError(
            f"{where}: adding message {k} (role '{role}') {what}: the render of messages[:{k}] is not a prefix of "
            f"the render of messages[:{k + 1}]; {_NOT_INCREMENTAL_FIX}"
        )

    def encode_messages(self, messages: Sequence[Mapping], where: str = "record") -> tuple[np.ndarray, np.ndarray]:
        messages = list(messages)  # every field reaches the template; loss_mask is only read here
        supervised = [is_supervised(m) for m in messages]
        renders = self._render_prefixes(messages, where)
        kept = self._kept_prefixes(messages, renders, where)
        header_ends = {}
        if any(supervised) and not self.supervise_role_header:
            header_ends = self._header_ends(messages, supervised, renders, [text for text, _ in kept])

        # One batch encode of every boundary: [header end of k,] render of [:k+1], for each message k.
        texts: list[str] = []
        for k, text in enumerate(renders):
            if k in header_ends:
                texts.append(header_ends[k])
            texts.append(text)
        encodings = [encoding.ids for encoding in self._encode_batch(texts, add_special_tokens=False)]

        ids = encodings[-1]
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        final = np.asarray(ids, dtype=np.int64)
        done: list[int] = []  # tokens of the render of the messages so far
        index = 0
        for k in range(len(renders)):
            header = encodings[index] if k in header_ends else None
            index += header is not None
            tokens = encodings[index]
            index += 1
            rewrite = kept[k][1]
            if rewrite is not None and done and done[-1] == rewrite[0]:
                done = [*done[:-1], rewrite[1]]  # the earlier message's terminal token, as it now stands
            if tokens[: len(done)] != done:
                raise self._prefix_error(where, k, messages[k]["role"], "changes the tokens of earlier messages")
            body_start = len(done)
            if header is not None:
                # A token may merge the end of the header with the start of the content; it then counts as content.
                body_start = len(header)
                if tokens[:body_start] != header:
                    body_start = next(
                        (i for i, (a, b) in enumerate(zip(header, tokens, strict=False)) if a != b),
                        min(len(header), len(tokens)),
                    )
                body_start = max(body_start, len(done))
            if supervised[k]:
                labels[body_start : len(tokens)] = final[body_start : len(tokens)]
            done = tokens
        return final, labels


class GptOssChatTemplate(TokenizerChatTemplate):
    """gpt-oss's Jinja template (the tokenizer's own), as upstream hyper_parallel's ``gpt_oss`` template.

    The same rendering as ``tokenizer``, which already tolerates gpt-oss's ``<|return|>`` -> ``<|end|>`` rewrite;
    this name also checks, when built, that the tokenizer has both tokens.
    """

    name = "gpt_oss"

    def __init__(self, tokenizer, template: str | None = None, *, supervise_role_header: bool = False):
        """
        Args:
            tokenizer, template, supervise_role_header: see ``TokenizerChatTemplate``.

        Raises:
            DataConfigError: the tokenizer lacks ``<|return|>`` or ``<|end|>``, or has no chat template.
        """
        text_tokenizer = build_tokenizer(tokenizer)
        for token in (*TERMINAL_REWRITES, *TERMINAL_REWRITES.values()):
            _special_id(text_tokenizer, token, self.name)
        super().__init__(text_tokenizer, template, supervise_role_header=supervise_role_header)


CHAT_TEMPLATE_REGISTRY: dict[str, type[ChatTemplate]] = {
    TokenizerChatTemplate.name: TokenizerChatTemplate,
    ChatMLTemplate.name: ChatMLTemplate,
    Llama2ChatTemplate.name: Llama2ChatTemplate,
    DefaultChatTemplate.name: DefaultChatTemplate,
    GptOssChatTemplate.name: GptOssChatTemplate,
}


def build_chat_template(
    name_or_template: str | ChatTemplate, tokenizer, *, supervise_role_header: bool | None = None
) -> ChatTemplate:
    """A chat template by registry name, or ``name_or_template`` itself when it already is one.

    Args:
        name_or_template: ``tokenizer`` (the tokenizer's own Jinja template), ``gpt_oss`` (the same, for a
            tokenizer with gpt-oss's ``<|return|>`` and ``<|end|>``), ``chatml``, ``llama2``, ``default``, or a
            ``ChatTemplate`` instance (returned as is).
        tokenizer: anything ``build_tokenizer`` takes (a ``TextTokenizer``, a ``transformers`` tokenizer object, a
            tokenizer path); not needed for a ``ChatTemplate`` instance, which carries its own.
        supervise_role_header: also supervise the role header of supervised messages, as upstream hyper_parallel
            does. None: the instance's own setting, or False for a name.

    Raises:
        DataConfigError: an unknown name, a tokenizer that lacks what the template needs, or a
            ``supervise_role_header`` that contradicts the instance's.

    Example::

        template = build_chat_template("chatml", "path/to/tokenizer", supervise_role_header=True)
        ids, labels = template.encode_messages(normalize_messages(record["conversation"]))
    """
    if supervise_role_header is not None:
        supervise_role_header = _flag(supervise_role_header, "supervise_role_header")
    if isinstance(name_or_template, ChatTemplate):
        if supervise_role_header is not None and supervise_role_header != name_or_template.supervise_role_header:
            raise DataConfigError(
                f"chat_template {name_or_template!r} was built with supervise_role_header="
                f"{name_or_template.supervise_role_header}, but supervise_role_header={supervise_role_header} is "
                "also given; build the template with the setting you want and leave the option unset"
            )
        return name_or_template
    template_class = CHAT_TEMPLATE_REGISTRY.get(name_or_template) if isinstance(name_or_template, str) else None
    if template_class is None:
        raise DataConfigError(
            f"unknown chat_template {_preview(name_or_template)}; use one of {', '.join(CHAT_TEMPLATE_REGISTRY)} "
            "or pass a ChatTemplate instance"
        )
    if tokenizer is None:
        raise DataConfigError(
            f"chat_template '{name_or_template}' needs a tokenizer; pass tokenizer=<path or tokenizer object>"
        )
    return template_class(tokenizer, supervise_role_header=bool(supervise_role_header))
