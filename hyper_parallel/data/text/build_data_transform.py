"""Record transforms of the Online path: one raw record in, a list of ModelSamples out.

Owns: picking the text or conversation out of a record (with fallback keys and ``str.format_map``
templates), tokenizing it, cutting plain text into windows, applying chat templates, shifting labels into
next-token targets, rejecting records that would carry no loss, and ``build_llm_data_transform`` (the
``data_transform._target_`` of YAML configs). A ModelSample is ``{"input_ids", "labels"}``: two int64 arrays
of the same length (at least 1) where ``labels[i]`` is the target for ``input_ids[i]`` and ``IGNORE_INDEX``
means no loss (see ``constants``).
Not responsible for: reading files (``text.records``), chat formats (``chat_template``),
shuffling, packing, padding or batching.

Every transform is a picklable callable ``transform(record, where="record") -> list[ModelSample]`` with a
``max_seq_len`` attribute; ``where`` (e.g. ``"record 17 of /data/train.jsonl"``) is named in every error
and warning. ``on_invalid_record="skip"`` turns a per-record ``DataFileError`` into a warning and ``[]``.
"""

from __future__ import annotations

import difflib
import inspect
import itertools
from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import TypeAlias

import numpy as np

from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed._indexed_helpers import fill_token_lists
from hyper_parallel.data.text.build_tokenizer import build_tokenizer
from hyper_parallel.data.text.chat_template import (
    ROLE_ALIASES,
    ChatTemplate,
    _flag,
    build_chat_template,
    normalize_messages,
)
from hyper_parallel.data.text.text_template import TextTemplate

__all__ = [
    "DATA_TRANSFORM_REGISTRY",
    "IdentityDataTransform",
    "InstructionTransform",
    "ModelSample",
    "PlaintextTransform",
    "TextConversationTransform",
    "build_llm_data_transform",
]

logger = get_logger("hyper_parallel.data.text.build_data_transform")

ModelSample: TypeAlias = dict[str, np.ndarray]

_ON_INVALID = ("error", "skip")


def _positive_int(value, name: str, *, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise DataConfigError(
            f"{name} must be a positive integer{' or None' if optional else ''}, got {value!r}; "
            "set it to the model's context length in tokens, e.g. 4096"
        )
    return int(value)


def _field_name(value, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise DataConfigError(f"{name} must be a non-empty field name, got {value!r}")
    return value


def _key_list(value, name: str) -> tuple[str, ...]:
    keys = (value,) if isinstance(value, str) else value
    if (
        not isinstance(keys, Sequence)
        or isinstance(keys, bytes)
        or not keys
        or not all(isinstance(k, str) and k for k in keys)
    ):
        raise DataConfigError(
            f"{name} must be a field name or a non-empty list of field names (tried in order), got {value!r}"
        )
    return tuple(keys)


def _as_tokenizer(tokenizer, data_type: str):
    if tokenizer is None:
        raise DataConfigError(
            f"data_type '{data_type}' needs a tokenizer; pass tokenizer=<path of a Hugging Face tokenizer "
            "directory>, a transformers tokenizer object or a loaded TextTokenizer"
        )
    return build_tokenizer(tokenizer)


def _template_tokenizer(tokenizer, chat_template, data_type: str):
    """The tokenizer of a chat transform: ``tokenizer``, else the one a ``ChatTemplate`` carries; both given, they
    must be the same tokenizer (the template encodes with its own)."""
    if not isinstance(chat_template, ChatTemplate):
        return _as_tokenizer(tokenizer, data_type)
    if tokenizer is None:
        return chat_template.tokenizer
    tokenizer = _as_tokenizer(tokenizer, data_type)
    if tokenizer is not chat_template.tokenizer and tokenizer.fingerprint != chat_template.tokenizer.fingerprint:
        raise DataConfigError(
            f"chat_template {chat_template!r} encodes with another tokenizer than tokenizer "
            f"{tokenizer.name_or_path} (their vocabularies differ); pass only the template, which carries its "
            "tokenizer, or build it with this tokenizer"
        )
    return tokenizer


def _record_keys(record: Mapping) -> list[str]:
    return sorted(map(str, record))


def _check_record(record, where: str) -> None:
    if type(record) is not dict and not isinstance(record, Mapping):  # dicts first: the ABC check is slow
        raise DataFileError(
            f"{where}: expected a record with named fields (a JSON object), got {type(record).__name__}; "
            "fix the data file"
        )


class _RecordTransform:
    """What every transform shares: ``max_seq_len``, ``on_invalid_record`` and the skip-or-raise decision."""

    def __init__(self, max_seq_len: int | None, on_invalid_record: str, *, max_seq_len_required: bool = False):
        self.max_seq_len = _positive_int(max_seq_len, "max_seq_len", optional=not max_seq_len_required)
        if on_invalid_record not in _ON_INVALID:
            raise DataConfigError(
                f"on_invalid_record must be 'error' or 'skip', got {on_invalid_record!r}; 'skip' logs a warning "
                "naming each invalid record and drops it"
            )
        self.on_invalid_record = on_invalid_record

    def __call__(self, record: Mapping, where: str = "record") -> list[ModelSample]:
        return self._guarded(self._transform, record, where)

    def batch(self, records: Sequence[Mapping], wheres: Sequence[str]) -> list[list[ModelSample]]:
        """Transform several records at once; the same result as calling the transform on each."""
        return [self(record, where) for record, where in zip(records, wheres, strict=True)]

    def _guarded(self, step, record: Mapping, where: str, *args):
        """``step(record, where, *args)``, with an invalid record raised or skipped as configured."""
        try:
            _check_record(record, where)
            return step(record, where, *args)
        except DataFileError as error:
            if self.on_invalid_record == "error":
                raise
            logger.warning("skipped invalid record: %s", error)
            return []

    def _transform(self, record: Mapping, where: str) -> list[ModelSample]:
        raise NotImplementedError


def _pick(record: Mapping, keys: tuple[str, ...], where: str, what: str):
    """The value of the first of ``keys`` that the record has with a non-null value."""
    for key in keys:
        value = record.get(key)
        if value is not None:
            return key, value
    raise DataFileError(
        f"{where}: no {what} field: tried text_keys {list(keys)} (absent or null); the record has fields "
        f"{_record_keys(record)}. Set text_keys to the field that holds the {what}, or a list of fallbacks"
    )


class PlaintextTransform(_RecordTransform):
    """Plain text (pretraining): tokenize, append EOS, cut into next-token windows of ``max_seq_len``.

    A document of ``n`` tokens ``t`` gives ``n - 1`` pairs ``(t[i], t[i + 1])``, cut into consecutive windows
    of ``max_seq_len`` pairs (the last may be shorter): ``input_ids = t[s : s + L]``,
    ``labels = t[s + 1 : s + 1 + L]``. No token is lost: the windows' ``input_ids`` followed by the last label
    are the document.
    """

    def __init__(
        self,
        tokenizer,
        *,
        max_seq_len: int,
        text_keys: str | Sequence[str] = "text",
        text_template: str | None = None,
        append_eos: bool = True,
        on_invalid_record: str = "error",
    ):
        """
        Args:
            tokenizer: anything ``build_tokenizer`` takes: a ``TextTokenizer``, a ``transformers`` tokenizer object
                (its EOS is appended), or the path of a tokenizer directory, ``tokenizer.json`` or tiktoken file.
            max_seq_len: tokens per window.
            text_keys: the field with the text, or fields tried in order (the first non-null one is used).
            text_template: a ``str.format_map`` template over the record that replaces ``text_keys``, e.g.
                ``"### Instruction:\\n{instruction}\\n\\n### Response:\\n{output}"``.
            append_eos: end every document with the EOS token; a tokenizer without one is refused (set
                ``append_eos: false`` to train on documents without an end token).
            on_invalid_record: ``"error"`` raises on an invalid record; ``"skip"`` warns and returns ``[]``.

        Raises:
            DataConfigError: an invalid option, or ``append_eos`` with a tokenizer that has no EOS token.
        """
        super().__init__(max_seq_len, on_invalid_record, max_seq_len_required=True)
        self.tokenizer = _as_tokenizer(tokenizer, "plaintext")
        self.text_keys = _key_list(text_keys, "text_keys")
        self.text_template = None if text_template is None else TextTemplate(text_template)
        self.append_eos = _flag(append_eos, "append_eos")
        self.eos_token_id = self.tokenizer.eos_token_id if self.append_eos else None
        if self.append_eos and self.eos_token_id is None:
            # Refused as offline preparation refuses it: documents without an end would run into each other.
            raise DataConfigError(
                f"tokenizer {self.tokenizer.name_or_path} has no EOS token to append; {self.tokenizer.eos_help()}; "
                "or set append_eos: false"
            )

    def _text(self, record: Mapping, where: str) -> str:
        if self.text_template is not None:
            try:
                return self.text_template.render(record)
            except DataFileError as error:
                raise DataFileError(f"{where}: {error}. Fix the record or the template") from None
        key, value = _pick(record, self.text_keys, where, "text")
        if not isinstance(value, str):
            raise DataFileError(
                f"{where}: field '{key}' holds {type(value).__name__}, expected a string; point text_keys at a "
                "text field (use data_type 'conversation' for lists of messages)"
            )
        return value

    def _transform(self, record: Mapping, where: str) -> list[ModelSample]:
        ids = self.tokenizer.backend.encode(self._text(record, where), add_special_tokens=False).ids
        (samples,) = self._document_windows([ids])
        return self._checked_windows(record, where, samples)

    def batch(self, records: Sequence[Mapping], wheres: Sequence[str]) -> list[list[ModelSample]]:
        """Tokenize the records' texts in one call and cut every window from one block of tokens (same samples
        as one record at a time, a fraction of the per-record cost). A record's ``wheres`` entry is read only to
        name it in an error or a warning."""
        if len(wheres) != len(records):
            raise ValueError(f"{len(records)} records were given with {len(wheres)} names")
        # A dict whose first text key holds a string is the common case, read without the general lookup.
        first = self.text_keys[0] if self.text_template is None else None
        texts = [
            text
            if type(record) is dict and type(text := record.get(first)) is str
            else self._text_or_error(record, wheres[position])
            for position, record in enumerate(records)
        ]
        valid = [position for position, text in enumerate(texts) if isinstance(text, str)]
        encodings = self.tokenizer.backend.encode_batch_fast([texts[p] for p in valid], add_special_tokens=False)
        for position, samples in zip(valid, self._document_windows([e.ids for e in encodings]), strict=True):
            texts[position] = samples
        # Errors are raised (or skipped) in record order, as one record at a time would.
        return [
            samples
            if type(samples) is list
            else self._guarded(self._checked_windows, records[position], wheres[position], samples)
            for position, samples in enumerate(texts)
        ]

    def _text_or_error(self, record: Mapping, where: str) -> str | DataFileError:
        try:
            _check_record(record, where)
            return self._text(record, where)
        except DataFileError as error:
            return error

    def _document_windows(self, documents: Sequence[list[int]]) -> list[list[ModelSample] | int]:
        """Each document's windows, cut from one array of all their tokens (EOS appended); a document of fewer
        than the 2 tokens a next-token pair needs gives its token count instead."""
        lengths = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
        end_token = -1 if self.eos_token_id is None else self.eos_token_id
        lengths += end_token >= 0
        ends = np.cumsum(lengths)
        tokens = np.empty(int(ends[-1:].sum()), dtype=np.int64)
        fill_token_lists(documents, end_token, tokens)  # the C helper: the id lists read in place, EOS after each
        targets = np.empty_like(tokens)  # separate memory, so editing labels in place cannot change input_ids
        targets[:-1] = tokens[1:]  # the target of a document's token is the next one (its last token has none)
        window = self.max_seq_len
        windows: list[list[ModelSample] | int] = []
        for start, end, length in zip((ends - lengths).tolist(), (ends - 1).tolist(), lengths.tolist(), strict=True):
            if length < 2:
                windows.append(length)
            elif end - start <= window:
                windows.append([{"input_ids": tokens[start:end], "labels": targets[start:end]}])
            else:
                cuts = [*range(start, end, window), end]
                windows.append(
                    [{"input_ids": tokens[a:b], "labels": targets[a:b]} for a, b in itertools.pairwise(cuts)]
                )
        return windows

    def _checked_windows(
        self, record: Mapping, where: str, samples: list[ModelSample] | int | DataFileError
    ) -> list[ModelSample]:
        """A document's windows, or the error of a record without text or with too few tokens."""
        del record  # the record is only named in errors, through ``where``
        if isinstance(samples, DataFileError):
            raise samples
        if type(samples) is int:
            raise DataFileError(
                f"{where}: the text has {samples} token(s) with EOS, fewer than the 2 a next-token pair needs; "
                "remove empty records or set on_invalid_record='skip'"
            )
        return samples

    def __repr__(self) -> str:
        template = None if self.text_template is None else self.text_template.template
        return (
            f"PlaintextTransform(max_seq_len={self.max_seq_len}, text_keys={list(self.text_keys)}, "
            f"text_template={template!r}, append_eos={self.append_eos}, on_invalid_record={self.on_invalid_record!r})"
        )


class _ChatTransform(_RecordTransform):
    """What the conversation and instruction transforms share: a chat template (with the tokenizer it encodes
    with), the messages of a record encoded through it, the shift, and the refusal of a record without loss.

    Subclasses say how a record becomes messages (``_messages``).
    """

    data_type = ""  # the name in DATA_TRANSFORM_REGISTRY, for messages

    def __init__(self, tokenizer, max_seq_len, chat_template, supervise_role_header, on_invalid_record):
        super().__init__(max_seq_len, on_invalid_record)
        if isinstance(tokenizer, ChatTemplate):
            if isinstance(chat_template, ChatTemplate) or chat_template != "tokenizer":
                raise DataConfigError(
                    f"two chat templates given: {tokenizer!r} in place of the tokenizer and chat_template="
                    f"{chat_template!r}; pass the ChatTemplate once, as chat_template="
                )
            tokenizer, chat_template = None, tokenizer
        self.tokenizer = _template_tokenizer(tokenizer, chat_template, self.data_type)
        self.chat_template = build_chat_template(
            chat_template, self.tokenizer, supervise_role_header=supervise_role_header
        )

    def _messages(self, record: Mapping, where: str) -> tuple[list[dict], str]:
        """The record's normalized messages, and where they are (the record and its field) for messages."""
        raise NotImplementedError

    def _no_loss_fix(self) -> str:
        """How to give a record without a supervised token some loss, for its error."""
        raise NotImplementedError

    def encode(
        self, record: Mapping, where: str = "record", *, skip_fix: str | None = "set on_invalid_record='skip'"
    ) -> tuple[np.ndarray, np.ndarray]:
        """The record's token ids and **unshifted** labels (``labels[i]`` is ``ids[i]`` where supervised, else
        ``IGNORE_INDEX``), as offline preparation writes them; ``__call__`` shifts them into a ModelSample.

        ``skip_fix`` ends the error of a record without loss: how to skip such records (None: not said, for a
        caller that says it itself).

        Raises:
            DataFileError: the record is malformed, or no token after the first is supervised (no loss).
        """
        _check_record(record, where)
        messages, at = self._messages(record, where)
        ids, labels = self.chat_template.encode_messages(messages, where=at)
        if not (labels[1:] != IGNORE_INDEX).any():
            raise DataFileError(
                f"{at}: no message is supervised, so the record carries no loss (roles: "
                f"{[m['role'] for m in messages]}); {self._no_loss_fix()}{f', or {skip_fix}' if skip_fix else ''}"
            )
        return ids, labels

    def _transform(self, record: Mapping, where: str) -> list[ModelSample]:
        ids, labels = self.encode(record, where)
        return [{"input_ids": ids[:-1], "labels": labels[1:]}]


class TextConversationTransform(_ChatTransform):
    """A conversation (SFT): normalize the messages, apply a chat template, shift; one ModelSample per record.

    Only supervised messages carry loss (assistant messages, or per-message ``loss_mask``); their role header
    (``<|im_start|>assistant\\n``) too with ``supervise_role_header``. Fields of a message other than its role
    and content reach the chat template. No truncation: a conversation longer than ``max_seq_len`` is returned
    whole. A conversation without any supervised target is an invalid record, never returned.

    Example, without a separate tokenizer (the template carries one)::

        template = build_chat_template("chatml", "path/to/tokenizer")
        transform = TextConversationTransform(chat_template=template, text_keys="messages")
        # or, as upstream hyper_parallel writes it: TextConversationTransform(template, text_keys="messages")

    Messages are ``{"role", "content"}`` or, recognised by their ``from`` field, ShareGPT's ``{"from", "value"}``
    (its ``human`` and ``gpt`` are aliases of user and assistant); ``role_key`` and ``content_key`` name other
    fields, and ``role_map`` other roles.
    """

    data_type = "conversation"

    def __init__(
        self,
        tokenizer=None,
        *,
        max_seq_len: int | None = None,
        chat_template: str | ChatTemplate = "tokenizer",
        text_keys: str | Sequence[str] = "conversation",
        role_key: str | None = None,
        content_key: str | None = None,
        role_map: Mapping[str, str] | None = None,
        supervise_role_header: bool | None = None,
        on_invalid_record: str = "error",
    ):
        """
        Args:
            tokenizer: anything ``build_tokenizer`` takes (a ``transformers`` tokenizer object brings its own chat
                template and special tokens); optional when ``chat_template`` is a ``ChatTemplate``, which carries
                its tokenizer. A ``ChatTemplate`` given here (upstream hyper_parallel's first argument) is the chat
                template.
            max_seq_len: the model's context length, for the loader; conversations are not truncated.
            chat_template: ``tokenizer`` (the tokenizer's own Jinja template), ``gpt_oss``, ``chatml``,
                ``llama2``, ``default`` or a ``ChatTemplate``.
            text_keys: the field with the list of messages, or fields tried in order.
            role_key, content_key: the message fields that hold the speaker and the text. None: ``role`` and
                ``content``, or ``from`` and ``value`` for a conversation whose first message has ``from`` and no
                ``role`` (ShareGPT).
            role_map: raw role -> role, applied before the built-in aliases (e.g. ``{"narrator": "system"}``).
            supervise_role_header: also supervise the role header of supervised messages, as upstream
                hyper_parallel does. None: the ``ChatTemplate``'s own setting, or False for a named template.
            on_invalid_record: ``"error"`` raises on an invalid record; ``"skip"`` warns and returns ``[]``.

        Raises:
            DataConfigError: an invalid option, two chat templates, or a template and a tokenizer that differ.
        """
        super().__init__(tokenizer, max_seq_len, chat_template, supervise_role_header, on_invalid_record)
        self.text_keys = _key_list(text_keys, "text_keys")
        self.role_key = None if role_key is None else _field_name(role_key, "role_key")
        self.content_key = None if content_key is None else _field_name(content_key, "content_key")
        self.role_map = _check_role_map(role_map)

    def _messages(self, record: Mapping, where: str) -> tuple[list[dict], str]:
        key, raw_messages = _pick(record, self.text_keys, where, "conversation")
        at = f"{where}, field '{key}'"
        messages = normalize_messages(
            raw_messages, role_key=self.role_key, content_key=self.content_key, role_map=self.role_map, where=at
        )
        return messages, at

    def _no_loss_fix(self) -> str:
        return 'add an assistant turn, or set "loss_mask": true on the messages to learn'

    def __repr__(self) -> str:
        return (
            f"TextConversationTransform(max_seq_len={self.max_seq_len}, chat_template={self.chat_template!r}, "
            f"text_keys={list(self.text_keys)}, on_invalid_record={self.on_invalid_record!r})"
        )


class InstructionTransform(_ChatTransform):
    """An instruction record (Alpaca style) as a two-turn conversation through a chat template (SFT).

    ``{"instruction", "input", "output"}`` becomes ``user: instruction`` (followed by a blank line and the input
    when the record has a non-empty one) and ``assistant: output``; only the answer carries loss, as in
    ``TextConversationTransform``, with the same template options. One ModelSample per record, never truncated.

    Example::

        transform = InstructionTransform("path/to/tokenizer", chat_template="chatml", output_key="response")
        (sample,) = transform({"instruction": "Name a colour.", "response": "Blue."})
    """

    data_type = "instruction"

    def __init__(
        self,
        tokenizer=None,
        *,
        max_seq_len: int | None = None,
        chat_template: str | ChatTemplate = "tokenizer",
        instruction_key: str = "instruction",
        input_key: str = "input",
        output_key: str = "output",
        supervise_role_header: bool | None = None,
        on_invalid_record: str = "error",
    ):
        """
        Args:
            tokenizer: anything ``build_tokenizer`` takes; optional when ``chat_template`` is a ``ChatTemplate``
                (see ``TextConversationTransform``).
            max_seq_len: the model's context length, for the loader; records are not truncated.
            chat_template: ``tokenizer`` (the tokenizer's own Jinja template), ``gpt_oss``, ``chatml``,
                ``llama2``, ``default`` or a ``ChatTemplate``.
            instruction_key: the field with the instruction (required).
            input_key: the field with the optional input appended to the instruction (absent, null or ``""``:
                none).
            output_key: the field with the answer the model learns (required).
            supervise_role_header: also supervise the assistant turn's role header. None: the ``ChatTemplate``'s
                own setting, or False for a named template.
            on_invalid_record: ``"error"`` raises on an invalid record; ``"skip"`` warns and returns ``[]``.

        Raises:
            DataConfigError: an invalid option, two chat templates, or a template and a tokenizer that differ.
        """
        super().__init__(tokenizer, max_seq_len, chat_template, supervise_role_header, on_invalid_record)
        self.instruction_key = _field_name(instruction_key, "instruction_key")
        self.input_key = _field_name(input_key, "input_key")
        self.output_key = _field_name(output_key, "output_key")

    def _text(self, record: Mapping, key: str, option: str, where: str, *, required: bool) -> str | None:
        value = record.get(key)
        if value is None:
            if not required:
                return None
            raise DataFileError(
                f"{where}: no '{key}' field (absent or null); the record has fields {_record_keys(record)}. Add it, "
                f"or set {option} to the field that holds it"
            )
        if not isinstance(value, str):
            raise DataFileError(
                f"{where}: field '{key}' holds {type(value).__name__}, expected a string; fix the record or set "
                f"{option} to a text field"
            )
        return value

    def _messages(self, record: Mapping, where: str) -> tuple[list[dict], str]:
        instruction = self._text(record, self.instruction_key, "instruction_key", where, required=True)
        extra = self._text(record, self.input_key, "input_key", where, required=False)
        output = self._text(record, self.output_key, "output_key", where, required=True)
        prompt = f"{instruction}\n\n{extra}" if extra else instruction
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}], where

    def _no_loss_fix(self) -> str:
        return "check the chat template, which must supervise the assistant turn"

    def __repr__(self) -> str:
        return (
            f"InstructionTransform(max_seq_len={self.max_seq_len}, chat_template={self.chat_template!r}, "
            f"instruction_key={self.instruction_key!r}, input_key={self.input_key!r}, "
            f"output_key={self.output_key!r}, on_invalid_record={self.on_invalid_record!r})"
        )


def _check_role_map(role_map) -> dict[str, str] | None:
    if role_map is None:
        return None
    if not isinstance(role_map, Mapping):
        raise DataConfigError(f"role_map must be a mapping of raw role -> role, got {type(role_map).__name__}")
    for raw, role in role_map.items():
        if not isinstance(raw, str) or not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
            raise DataConfigError(
                f"role_map entry {raw!r}: {role!r} is invalid; map role names to one of system, user, assistant, "
                "tool (or an alias such as human, gpt)"
            )
    return dict(role_map)


def _token_array(value, where: str, key: str) -> np.ndarray:
    array = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    if array is None or array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        described = type(value).__name__ if array is None else f"{array.dtype} array of shape {array.shape}"
        raise DataFileError(
            f"{where}: field '{key}' must be a flat list of integer token ids, got {described}; re-tokenize the record"
        )
    return array.astype(np.int64, copy=False)


class IdentityDataTransform(_RecordTransform):
    """Pre-tokenized records: ``input_ids`` and optional ``labels`` (default: the ``input_ids``).

    Unless ``labels_are_shifted``, labels are shifted like a tokenized document: ``input_ids = ids[:-1]``,
    ``labels = labels[1:]``. No truncation. Ids are integers >= 0 and, with a tokenizer, below its vocabulary size.
    """

    def __init__(
        self,
        tokenizer=None,
        *,
        max_seq_len: int | None = None,
        input_ids_key: str = "input_ids",
        labels_key: str = "labels",
        labels_are_shifted: bool = False,
        on_invalid_record: str = "error",
    ):
        """
        Args:
            tokenizer: optional; anything ``build_tokenizer`` takes. Given, every id and label must lie in its
                vocabulary (ids made by another tokenizer would be wrong tokens); ``build_dataloaders`` passes the
                pipeline's.
            max_seq_len: the model's context length, for the loader; records are not truncated.
            input_ids_key, labels_key: the record fields with the token ids and the labels.
            labels_are_shifted: the labels are already next-token targets, as long as the ``input_ids``.
            on_invalid_record: ``"error"`` raises on an invalid record; ``"skip"`` warns and returns ``[]``.
        """
        super().__init__(max_seq_len, on_invalid_record)
        self.input_ids_key = _field_name(input_ids_key, "input_ids_key")
        self.labels_key = _field_name(labels_key, "labels_key")
        self.labels_are_shifted = _flag(labels_are_shifted, "labels_are_shifted")
        # Only the size and name are kept: the transform is pickled to every loader worker.
        self.vocab_size, self._vocabulary_of = None, None
        if tokenizer is not None:
            tokenizer = build_tokenizer(tokenizer)
            self.vocab_size, self._vocabulary_of = tokenizer.vocab_size, tokenizer.name_or_path

    def _check_vocabulary(self, ids: np.ndarray, where: str, key: str) -> None:
        """Refuse an id of ``ids`` (field ``key``) at or past the tokenizer's vocabulary size."""
        if self.vocab_size is not None and ids.size and ids.max() >= self.vocab_size:
            position = int(np.argmax(ids >= self.vocab_size))
            raise DataFileError(
                f"{where}: field '{key}' holds the id {int(ids[position])} at position {position}, outside the "
                f"vocabulary [0, {self.vocab_size}) of tokenizer {self._vocabulary_of}; re-tokenize the record with "
                "this tokenizer, or configure the tokenizer its ids were made with"
            )

    def _transform(self, record: Mapping, where: str) -> list[ModelSample]:
        if record.get(self.input_ids_key) is None:
            raise DataFileError(
                f"{where}: no '{self.input_ids_key}' field; the record has fields {_record_keys(record)}. "
                "Set input_ids_key to the field with the token ids"
            )
        ids = _token_array(record[self.input_ids_key], where, self.input_ids_key)
        if ids.size and ids.min() < 0:
            raise DataFileError(
                f"{where}: field '{self.input_ids_key}' holds the negative id {int(ids.min())}; token ids are >= 0"
            )
        self._check_vocabulary(ids, where, self.input_ids_key)
        raw_labels = record.get(self.labels_key)
        labels = ids if raw_labels is None else _token_array(raw_labels, where, self.labels_key)
        if len(labels) != len(ids):
            raise DataFileError(
                f"{where}: '{self.labels_key}' has {len(labels)} entries but '{self.input_ids_key}' has {len(ids)}; "
                "they must be equally long"
            )
        bad = labels[(labels < 0) & (labels != IGNORE_INDEX)]
        if bad.size:
            raise DataFileError(
                f"{where}: field '{self.labels_key}' holds {int(bad[0])}; labels are token ids or {IGNORE_INDEX} "
                "(no loss)"
            )
        if raw_labels is not None:
            self._check_vocabulary(labels, where, self.labels_key)
        if not self.labels_are_shifted:
            ids, labels = ids[:-1], labels[1:]
        if len(ids) == 0:
            raise DataFileError(
                f"{where}: field '{self.input_ids_key}' is too short for a training pair "
                f"({'1 token needed' if self.labels_are_shifted else '2 tokens needed before the shift'})"
            )
        if not (labels != IGNORE_INDEX).any():
            raise DataFileError(
                f"{where}: every label is {IGNORE_INDEX}, so the record carries no loss; fix its "
                f"'{self.labels_key}' or set on_invalid_record='skip'"
            )
        return [{"input_ids": ids.copy(), "labels": labels.copy()}]

    def __repr__(self) -> str:
        return (
            f"IdentityDataTransform(max_seq_len={self.max_seq_len}, input_ids_key={self.input_ids_key!r}, "
            f"labels_key={self.labels_key!r}, labels_are_shifted={self.labels_are_shifted})"
        )


DATA_TRANSFORM_REGISTRY: dict[str, type[_RecordTransform]] = {
    "plaintext": PlaintextTransform,
    "conversation": TextConversationTransform,
    "instruction": InstructionTransform,
    "identity": IdentityDataTransform,
}


def _did_you_mean(value, names) -> str:
    close = difflib.get_close_matches(value, list(names), n=1) if isinstance(value, str) else []
    return f" (did you mean '{close[0]}'?)" if close else ""


def build_llm_data_transform(data_type: str = "plaintext", tokenizer=None, **kwargs) -> _RecordTransform:
    """Build a record transform by name: the ``data_transform._target_`` of YAML configs.

    Args:
        data_type: ``plaintext`` (``PlaintextTransform``), ``conversation`` (``TextConversationTransform``),
            ``instruction`` (``InstructionTransform``) or ``identity`` (``IdentityDataTransform``; the tokenizer,
            when given, bounds the ids).
        tokenizer: anything ``build_tokenizer`` takes: a ``TextTokenizer``, a ``transformers`` tokenizer object, or
            the path of a tokenizer directory, ``tokenizer.json`` or tiktoken file. Not needed for ``conversation``
            and ``instruction`` when ``chat_template`` is a ``ChatTemplate``, which carries its tokenizer.
        **kwargs: the options of that transform, e.g. ``text_keys``, ``max_seq_len``, ``chat_template``.

    Raises:
        DataConfigError: an unknown ``data_type`` or option, a missing tokenizer, an invalid option value.
    """
    transform_class = DATA_TRANSFORM_REGISTRY.get(data_type) if isinstance(data_type, str) else None
    if transform_class is None:
        raise DataConfigError(
            f"unknown data_type {data_type!r}{_did_you_mean(data_type, DATA_TRANSFORM_REGISTRY)}; use one of "
            f"{', '.join(DATA_TRANSFORM_REGISTRY)}"
        )
    parameters = inspect.signature(transform_class.__init__).parameters
    options = [name for name, parameter in parameters.items() if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(kwargs) - set(options))
    if unknown:
        raise DataConfigError(
            f"unknown option(s) {unknown} for data_type '{data_type}'{_did_you_mean(unknown[0], options)}; its "
            f"options are {options}. Fix or remove the key"
        )
    missing = [name for name in options if name not in kwargs and parameters[name].default is inspect.Parameter.empty]
    if missing:
        raise DataConfigError(f"data_type '{data_type}' requires the option(s) {missing}, e.g. max_seq_len: 4096")
    # Each transform normalizes the tokenizer (a conversation's may come with its template; identity's is optional).
    return transform_class(tokenizer, **kwargs)
