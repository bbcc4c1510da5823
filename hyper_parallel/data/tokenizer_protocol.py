"""What the pipeline reads of a tokenizer: one protocol, and one reader for any tokenizer object.

Owns: ``Tokenizer``, the members the library reads (special-token ids, vocabulary size, identity, name), and
``read_tokenizer``, which presents any tokenizer object as one, whichever of the two accepted namings it uses:
Hugging Face's (``eos_token_id``, ``pad_token_id``, ``bos_token_id``, ``fingerprint``, ``name_or_path``: the
library's ``TextTokenizer``) or Megatron's (``eod``, ``eos``, ``pad``, ``bos``, ``special_tokens_dict``,
``unique_identifiers``: the objects megatron-core's datasets take). Nothing else reads a tokenizer's attributes by
name. Not responsible for: loading tokenizers or pickling them (``text.build_tokenizer``), or what a path makes
of the ids (the Indexed path's pad rule is ``indexed.indexed_pretrain_dataset.resolve_special_tokens``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["Tokenizer", "read_tokenizer"]


class Tokenizer(Protocol):
    """The members of a tokenizer the pipeline reads; ``read_tokenizer`` gives them for any tokenizer object.

    An id is None when the tokenizer has no such token.
    """

    @property
    def eod(self) -> int | None:
        """The end-of-document id appended to documents: ``eod``, else ``eos_token_id``."""

    @property
    def eos(self) -> int | None:
        """The end-of-sequence id: ``eos``, else ``eos_token_id`` (Megatron tokenizers may tell it from ``eod``)."""

    @property
    def pad(self) -> int | None:
        """The padding id: ``pad``, else ``pad_token_id``."""

    @property
    def bos(self) -> int | None:
        """The beginning-of-sequence id: ``bos``, else ``bos_token_id``."""

    @property
    def vocab_size(self) -> int | None:
        """Token ids in the vocabulary, added tokens included: ``vocab_size``."""

    @property
    def special_tokens(self) -> Mapping[str, int]:
        """Role -> id of the special tokens a Megatron tokenizer lists (``special_tokens_dict``); may be empty."""

    @property
    def identity(self) -> object:
        """What the token ids mean, for cache keys: ``fingerprint`` (a vocabulary hash), else
        ``unique_identifiers``, else the class name."""

    @property
    def name(self) -> str:
        """For messages: ``name_or_path``, else the class name."""


def _first(source: object, names: tuple[str, ...]) -> Any:
    """The first of ``names`` that ``source`` has with a value other than None, else None."""
    for name in names:
        value = getattr(source, name, None)
        if value is not None:
            return value
    return None


class _TokenizerView:
    """``Tokenizer`` over a tokenizer object; each member is read from the object when asked for."""

    __slots__ = ("source",)

    def __init__(self, source: object) -> None:
        self.source = source

    @property
    def eod(self) -> int | None:
        return _first(self.source, ("eod", "eos_token_id"))

    @property
    def eos(self) -> int | None:
        return _first(self.source, ("eos", "eos_token_id"))

    @property
    def pad(self) -> int | None:
        return _first(self.source, ("pad", "pad_token_id"))

    @property
    def bos(self) -> int | None:
        return _first(self.source, ("bos", "bos_token_id"))

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.source, "vocab_size", None)

    @property
    def special_tokens(self) -> Mapping[str, int]:
        return dict(getattr(self.source, "special_tokens_dict", None) or {})

    @property
    def identity(self) -> object:
        found = _first(self.source, ("fingerprint", "unique_identifiers"))
        return type(self.source).__name__ if found is None else found

    @property
    def name(self) -> str:
        return str(_first(self.source, ("name_or_path",)) or type(self.source).__name__)


def read_tokenizer(tokenizer: object) -> Tokenizer:
    """``tokenizer`` as a ``Tokenizer``: its members read under either accepted naming (see the module)."""
    return tokenizer if isinstance(tokenizer, _TokenizerView) else _TokenizerView(tokenizer)
