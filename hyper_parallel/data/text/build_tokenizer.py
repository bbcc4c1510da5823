"""Tokenizer adapter: load a local Hugging Face tokenizer and expose what the data pipeline needs.

Owns: resolving a tokenizer directory or ``tokenizer.json``, its special-token ids, its vocabulary size and an
identity string for cache keys. Not responsible for: chat templates (``chat_template``) or record transforms.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from hyper_parallel.data.errors import DataConfigError

__all__ = ["BUNDLED_TOKENIZER_PATH", "TextTokenizer", "build_tokenizer"]

BUNDLED_TOKENIZER_PATH = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"

# Names tried, in order, for the end-of-document token of a bare tokenizer.json without a config.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")


@dataclass(frozen=True)
class TextTokenizer:
    """A loaded tokenizer. ``hf`` is the ``transformers`` fast tokenizer; ``name_or_path`` where it came from."""

    hf: object
    name_or_path: str

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer`` (Rust), used for batch encoding on hot paths."""
        return self.hf.backend_tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added special tokens included (what the token dtype must hold)."""
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eod(self) -> int | None:
        """Megatron's name for the end-of-document token: the EOS token."""
        return self.eos_token_id

    @cached_property
    def fingerprint(self) -> str:
        """A short content hash of the tokenizer, stable across machines and paths."""
        return hashlib.sha256(self.backend.to_str().encode("utf-8")).hexdigest()[:16]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _hub_error(name: str) -> DataConfigError:
    return DataConfigError(
        f"tokenizer '{name}' is not a local directory or tokenizer.json file. Downloading from the Hugging Face "
        "Hub is disabled (offline); download it on a connected machine with "
        f"`AutoTokenizer.from_pretrained('{name}').save_pretrained(DIR)` and pass DIR instead"
    )


def build_tokenizer(name_or_path: str | os.PathLike) -> TextTokenizer:
    """Load a tokenizer from a Hugging Face tokenizer directory or a ``tokenizer.json`` file.

    A Hub name is tried only when ``HF_HUB_OFFLINE`` is not set; otherwise it is a clear error at once.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".json":
            raise DataConfigError(
                f"tokenizer file {path} is not a tokenizer.json; pass a Hugging Face tokenizer directory or its "
                "tokenizer.json"
            )
        hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
        vocab = hf.get_vocab()
        eos = next((t for t in _EOS_CANDIDATES if t in vocab), None)
        if eos is not None:
            hf.eos_token = eos
        return TextTokenizer(hf, str(path))
    if path.is_dir():
        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as error:
            raise DataConfigError(
                f"could not load a tokenizer from directory {path}: {error}. The directory needs tokenizer.json "
                "(and usually tokenizer_config.json), as written by `save_pretrained`."
            ) from error
        if not getattr(hf, "is_fast", False):
            raise DataConfigError(f"tokenizer in {path} has no fast (Rust) implementation; save it with tokenizer.json")
        return TextTokenizer(hf, str(path))
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in {"1", "true", "yes", "on"}:
        raise _hub_error(name)
    try:
        hf = AutoTokenizer.from_pretrained(name)
    except Exception as error:  # noqa: BLE001 - any Hub failure gets the same actionable message
        raise _hub_error(name) from error
    return TextTokenizer(hf, name)
