"""Tokenizer adapter: load a local Hugging Face tokenizer and expose what the data pipeline needs.

Owns: resolving a tokenizer directory or ``tokenizer.json``, its special-token ids (and how to name a missing
EOS), its vocabulary size and a content fingerprint for cache keys, and pickling it without the ``transformers``
tokenizer it loaded. A local tokenizer is read with ``tokenizers`` alone (fast start-up); ``transformers`` is
imported only when the full tokenizer is asked for (``.hf``, e.g. for chat templates).
Not responsible for: reading other tokenizer objects (``tokenizer_protocol``), chat templates (``chat_template``)
or record transforms.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError

__all__ = ["BUNDLED_TOKENIZER_PATH", "TextTokenizer", "build_tokenizer"]

logger = get_logger("hyper_parallel.data.text.build_tokenizer")

BUNDLED_TOKENIZER_PATH = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"

# Tried in order for the end-of-document token of a bare tokenizer.json that has no config beside it.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
_SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# Special tokens whose name suggests an end of text (e.g. DeepSeek's "<｜end▁of▁sentence｜>"), offered as the EOS.
_EOS_LIKE = re.compile(r"end|eos|eot", re.IGNORECASE)
_LISTED_SPECIAL_TOKENS = 8
# What a Hugging Face Hub repository id looks like: "gpt2" or "org/name", nothing path-like.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@dataclass(frozen=True)
class TextTokenizer:
    """A loaded tokenizer.

    Attributes:
        backend: the ``tokenizers.Tokenizer`` (Rust) used for encoding on hot paths.
        name_or_path: where it came from.
        eos_token_id, pad_token_id, bos_token_id: special-token ids, None when the tokenizer has none.
    """

    backend: object
    name_or_path: str
    eos_token_id: int | None
    pad_token_id: int | None
    bos_token_id: int | None

    def __post_init__(self) -> None:
        # A tokenizer.json may carry truncation or padding settings (saved from a training script): they would cut
        # or pad every text this library encodes, so they are turned off here, once, for every path.
        settings = [name for name in ("truncation", "padding") if getattr(self.backend, name, None) is not None]
        if settings:
            logger.warning(
                "tokenizer %s sets %s; turned off, so that no text is cut or padded when it is encoded",
                self.name_or_path,
                " and ".join(settings),
            )
            self.backend.no_truncation()
            self.backend.no_padding()

    def __getstate__(self) -> dict:
        # The transformers tokenizer is heavy to pickle (to every DataLoader worker) and reloads on first use.
        return {name: value for name, value in self.__dict__.items() if name != "hf"}

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added special tokens included (what the token dtype must hold)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int | None:
        """Megatron's name for the end-of-document token: the EOS token."""
        return self.eos_token_id

    @cached_property
    def hf(self):
        """The ``transformers`` tokenizer (imported on first use), for chat templates and HF-only features."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        path = Path(self.name_or_path)
        if path.is_file():
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        return AutoTokenizer.from_pretrained(self.name_or_path, local_files_only=path.is_dir())

    @cached_property
    def fingerprint(self) -> str:
        """A short hash of the vocabulary (token -> id, added tokens included): what the ids mean, stable across
        machines and paths, and unlike a hash of the serialized tokenizer, across ``tokenizers`` releases that
        write the same tokenizer differently."""
        ordered = sorted(self.backend.get_vocab(with_added_tokens=True).items(), key=lambda item: (item[1], item[0]))
        return hashlib.sha256(json.dumps(ordered, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def eos_help(self) -> str:
        """For a tokenizer without EOS: the special tokens it has, and how to name one of them the EOS."""
        special = sorted((i, t.content) for i, t in self.backend.get_added_tokens_decoder().items() if t.special)
        if not special:
            return "it has no special tokens at all; use a tokenizer saved with its special tokens"
        listed = ", ".join(f"{token!r} (id {i})" for i, token in special[:_LISTED_SPECIAL_TOKENS])
        more = f" and {len(special) - _LISTED_SPECIAL_TOKENS} more" if len(special) > _LISTED_SPECIAL_TOKENS else ""
        eos_like = next((token for _, token in special if _EOS_LIKE.search(token)), "<the EOS token>")
        path = Path(self.name_or_path)
        directory = path if path.is_dir() else path.parent
        return (
            f"its special tokens are {listed}{more}; name the EOS in {directory / 'tokenizer_config.json'}, "
            f"e.g. {json.dumps({'eos_token': eos_like}, ensure_ascii=False)}, and pass the directory {directory}"
        )


def _token_content(value) -> str | None:
    """A special token as written in a config: a string or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _special_token_ids(backend, directory: Path | None) -> dict[str, int | None]:
    names: dict[str, str | None] = {"eos": None, "pad": None, "bos": None}
    bare = True  # no file beside tokenizer.json names the special tokens
    for file_name in _SPECIAL_TOKEN_FILES if directory else ():
        path = directory / file_name
        if not path.is_file():
            continue
        bare = False
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise DataConfigError(
                f"{path}: invalid JSON ({error}); fix or regenerate it with save_pretrained"
            ) from None
        for role in names:
            names[role] = names[role] or _token_content(config.get(f"{role}_token"))
    if names["eos"] is None and bare:
        vocab = backend.get_vocab(with_added_tokens=True)
        names["eos"] = next((t for t in _EOS_CANDIDATES if t in vocab), None)
    ids = {}
    for role, token in names.items():
        ids[role] = None if token is None else backend.token_to_id(token)
        if token is not None and ids[role] is None:
            raise DataConfigError(f"the {role} token {token!r} named in {directory} is not in the vocabulary")
    return ids


def _missing_path_error(name: str, path: Path) -> DataConfigError:
    """``name`` (``path`` once expanded) does not exist: say so, naming its first missing part."""
    missing = path
    while not missing.parent.exists() and missing.parent != missing:
        missing = missing.parent
    detail = "" if missing == path else f" ({missing} does not exist)"
    return DataConfigError(
        f"no such file or directory: {name}{detail}; pass an existing tokenizer directory (holding tokenizer.json) "
        "or a tokenizer.json file"
    )


def _hub_error(name: str) -> DataConfigError:
    return DataConfigError(
        f"tokenizer '{name}' is not a local directory or tokenizer.json file. Downloading from the Hugging Face "
        "Hub is disabled (offline); download it on a connected machine with "
        f"`AutoTokenizer.from_pretrained('{name}').save_pretrained(DIR)` and pass DIR instead"
    )


def _from_transformers(name: str) -> TextTokenizer:
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in {"1", "true", "yes", "on"}:
        raise _hub_error(name)
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(name)
    except Exception as error:  # noqa: BLE001 - any Hub failure gets the same actionable message
        raise _hub_error(name) from error
    if not getattr(hf, "is_fast", False):
        raise DataConfigError(f"tokenizer '{name}' has no fast (Rust) implementation; save it with tokenizer.json")
    return TextTokenizer(hf.backend_tokenizer, name, hf.eos_token_id, hf.pad_token_id, hf.bos_token_id)


def build_tokenizer(name_or_path: str | os.PathLike) -> TextTokenizer:
    """Load a tokenizer from a Hugging Face tokenizer directory or a ``tokenizer.json`` file.

    Special tokens come from ``tokenizer_config.json``/``special_tokens_map.json`` beside ``tokenizer.json``;
    a bare ``tokenizer.json`` (a file, or a directory without those files) gets its EOS from common names such
    as ``<|endoftext|>`` or ``</s>``. A name that is not a local path is taken for a Hub repository id
    (``gpt2``, ``org/name``) and tried only when ``HF_HUB_OFFLINE`` is not set; anything path-like that does
    not exist (absolute, ``./dir``, ``a/b/c``, ``dir/``, ``*.json``) is a "no such file or directory" error.
    """
    from tokenizers import Tokenizer

    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        tokenizer_file, directory = path / "tokenizer.json", path
        if not tokenizer_file.is_file():
            raise DataConfigError(
                f"tokenizer directory {path} has no tokenizer.json; save the tokenizer with a fast (Rust) "
                "implementation, e.g. `AutoTokenizer.from_pretrained(...).save_pretrained(DIR)`"
            )
    elif path.is_file():
        if path.suffix != ".json":
            raise DataConfigError(f"tokenizer file {path} is not a tokenizer.json; pass it or its directory")
        tokenizer_file, directory = path, None
    elif _HUB_NAME.fullmatch(name) and not name.endswith(".json"):
        return _from_transformers(name)
    else:
        raise _missing_path_error(name, path)
    try:
        backend = Tokenizer.from_file(str(tokenizer_file))
    except Exception as error:  # noqa: BLE001 - the Rust loader raises a bare Exception
        raise DataConfigError(f"{tokenizer_file}: not a valid tokenizer.json ({error})") from None
    ids = _special_token_ids(backend, directory)
    return TextTokenizer(backend, str(path), ids["eos"], ids["pad"], ids["bos"])
