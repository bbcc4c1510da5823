"""What the pipeline reads of a tokenizer: one protocol, and one reader for any tokenizer object.

Owns: ``Tokenizer``, the members the library reads (special-token ids, vocabulary size, identity, name), and
``read_tokenizer``, which presents any tokenizer object as one, whichever of the two accepted namings it uses:
Hugging Face's (``eos_token_id``, ``pad_token_id``, ``bos_token_id``, ``fingerprint``, ``name_or_path``: the
library's ``TextTokenizer``) or Megatron's (``eod``, ``eos``, ``pad``, ``bos``, ``special_tokens_dict``,
``unique_identifiers``: the objects megatron-core's datasets take). A ``transformers`` tokenizer object is read
through the ``TextTokenizer`` that ``text.build_tokenizer`` makes of it (its vocabulary size counts the added
tokens, and its identity is a vocabulary hash, where the object's own ``vocab_size`` and class name would not).
Nothing else reads a tokenizer's attributes by name. Not responsible for: loading or converting tokenizers, or
pickling them (``text.build_tokenizer``), or what a path makes of the ids (the Indexed path's pad rule is
``indexed.indexed_pretrain_dataset.resolve_special_tokens``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
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


@dataclass(frozen=True, eq=False)
class _TokenizerView:
    """``Tokenizer`` over a tokenizer object, read once (its identity on first use: a fingerprint may hash the
    vocabulary)."""

    source: object = field(repr=False)
    eod: int | None = field(init=False)
    eos: int | None = field(init=False)
    pad: int | None = field(init=False)
    bos: int | None = field(init=False)
    vocab_size: int | None = field(init=False)
    special_tokens: Mapping[str, int] = field(init=False)
    name: str = field(init=False)

    def __post_init__(self) -> None:
        source = self.source
        values = {
            "eod": _first(source, ("eod", "eos_token_id")),
            "eos": _first(source, ("eos", "eos_token_id")),
            "pad": _first(source, ("pad", "pad_token_id")),
            "bos": _first(source, ("bos", "bos_token_id")),
            "vocab_size": getattr(source, "vocab_size", None),
            "special_tokens": dict(getattr(source, "special_tokens_dict", None) or {}),
            "name": str(_first(source, ("name_or_path",)) or type(source).__name__),
        }
        for member, value in values.items():
            object.__setattr__(self, member, value)

    @cached_property
    def identity(self) -> object:
        found = _first(self.source, ("fingerprint", "unique_identifiers"))
        return type(self.source).__name__ if found is None else found


def read_tokenizer(tokenizer: object) -> Tokenizer:
    """``tokenizer`` as a ``Tokenizer``: its members read once, under either accepted naming (see the module); a
    ``Tokenizer`` it returned is returned as is, so a caller that reads many times reads the object once.

    Example::

        tokens = read_tokenizer(AutoTokenizer.from_pretrained(path))  # or a TextTokenizer, a Megatron tokenizer
        tokens.eod, tokens.pad, tokens.identity
    """
    if isinstance(tokenizer, _TokenizerView):
        return tokenizer
    from hyper_parallel.data.text.build_tokenizer import build_tokenizer, is_transformers_tokenizer

    return _TokenizerView(build_tokenizer(tokenizer) if is_transformers_tokenizer(tokenizer) else tokenizer)
