"""Tokenizer adapter: turn whatever names a tokenizer into the ``TextTokenizer`` the data pipeline encodes with.

Owns: the one place where tokenizer objects are normalised (``build_tokenizer``): a local Hugging Face tokenizer
directory or ``tokenizer.json``, a ``transformers`` tokenizer object (``PreTrainedTokenizerFast`` and the v5
backends with a Rust tokenizer, such as ``TokenizersBackend``) with its own special tokens and chat template, and a
tiktoken-format tokenizer (a ``*.tiktoken`` file of ``base64-token rank`` lines plus special tokens, as Qwen and
others ship), converted once into a Rust tokenizer with ``transformers``' ``TikTokenConverter``, with the published
split pattern of well-known tiktoken files; and refusing a tokenizer directory that declares custom code, which is
never run. Also its
special-token ids (and how to name a missing EOS), its vocabulary size and a content fingerprint for cache keys,
and pickling it without the ``transformers`` tokenizer it built. A local tokenizer is read with ``tokenizers``
alone (fast start-up); ``transformers`` is imported only when the full tokenizer is asked for (``.hf``, e.g. for
chat templates), always with ``trust_remote_code=False``.
Not responsible for: reading the special ids of tokenizer objects that are not converted (Megatron tokenizers:
``tokenizer_protocol``), chat templates (``chat_template``) or record transforms.
"""

from __future__ import annotations

import ast
import base64
import functools
import hashlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from numbers import Integral
from pathlib import Path

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError

__all__ = ["BUNDLED_TOKENIZER_PATH", "TextTokenizer", "build_tokenizer", "is_transformers_tokenizer"]

logger = get_logger("hyper_parallel.data.text.build_tokenizer")

BUNDLED_TOKENIZER_PATH = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"

# Tried in order for the end-of-document token of a bare tokenizer.json that has no config beside it.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
_SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")
_SPECIAL_ROLES = ("eos", "pad", "bos")
# Special tokens whose name suggests an end of text (e.g. DeepSeek's "<｜end▁of▁sentence｜>"), offered as the EOS.
_EOS_LIKE = re.compile(r"end|eos|eot", re.IGNORECASE)
_LISTED_SPECIAL_TOKENS = 8
# What a Hugging Face Hub repository id looks like: "gpt2" or "org/name", nothing path-like.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# Names under which tiktoken-format vocabularies ship besides "*.tiktoken" (Kimi's, Llama 3's original/ folder);
# a "tokenizer.model" may also be a SentencePiece model, told apart by its first line.
_TIKTOKEN_FILE_NAMES = ("tiktoken.model", "tokenizer.model")
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} [0-9]+")
# What an added token of a tiktoken tokenizer may set, as in a tokenizer_config.json's added_tokens_decoder.
_ADDED_TOKEN_FLAGS = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
# The files of a tokenizer directory where transformers looks for custom code (auto_map) or a tokenizer class.
_CODE_DECLARING_FILES = ("tokenizer_config.json", "config.json")
# Tokenizer classes transformers loads by name besides those of its AutoTokenizer registry.
_GENERIC_TOKENIZER_CLASSES = frozenset(
    {"PreTrainedTokenizerFast", "PreTrainedTokenizer", "TokenizersBackend", "PythonBackend", "SentencePieceBackend"}
)


@dataclass(frozen=True)
class _TiktokenPreset:
    """A well-known tiktoken vocabulary: its published pre-tokenization pattern and special tokens."""

    name: str
    pattern: str
    special_tokens: Mapping[str, int]


# The published split patterns: tiktoken's (tiktoken_ext/openai_public.py) and Qwen's (PAT_STR, tokenization_qwen.py).
_R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]"""
    r"""|\s+(?!\S)|\s"""
)
_O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
_QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
_CL100K_SPECIALS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}
_QWEN_SPECIALS = {
    token: 151643 + offset
    for offset, token in enumerate(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *(f"<|extra_{i}|>" for i in range(205))]
    )
}
# sha256 of each published file (tiktoken's expected_hash; Qwen's from its Git LFS pointer) -> its preset.
_TIKTOKEN_PRESETS = {
    "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930": _TiktokenPreset(
        "r50k_base", _R50K_PATTERN, {"<|endoftext|>": 50256}
    ),
    "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069": _TiktokenPreset(
        "p50k_base", _R50K_PATTERN, {"<|endoftext|>": 50256}
    ),
    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7": _TiktokenPreset(
        "cl100k_base", _CL100K_PATTERN, _CL100K_SPECIALS
    ),
    "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d": _TiktokenPreset(
        "o200k_base", _O200K_PATTERN, {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}
    ),
    "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186": _TiktokenPreset(
        "qwen.tiktoken", _QWEN_PATTERN, _QWEN_SPECIALS
    ),
}


@dataclass(frozen=True)
class TextTokenizer:
    """A loaded tokenizer.

    Attributes:
        backend: the ``tokenizers.Tokenizer`` (Rust) used for encoding on hot paths.
        name_or_path: where it came from.
        eos_token_id, pad_token_id, bos_token_id: special-token ids, None when the tokenizer has none.
        hf_settings: how ``.hf`` is built around ``backend`` when it cannot be loaded from ``name_or_path`` (a
            ``transformers`` tokenizer object, a tiktoken file): the named special tokens (``eos_token``, ...) and
            the ``chat_template``, which chat templates render with. None: ``.hf`` loads ``name_or_path``.
    """

    backend: object
    name_or_path: str
    eos_token_id: int | None
    pad_token_id: int | None
    bos_token_id: int | None
    hf_settings: Mapping[str, object] | None = field(default=None, compare=False)

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
        # The transformers tokenizer is heavy to pickle (to every DataLoader worker) and is built again on first use.
        return {name: value for name, value in self.__dict__.items() if name != "hf"}

    @cached_property
    def vocab_size(self) -> int:
        """Token ids the vocabulary spans, added special tokens included: the largest id + 1 (what the token dtype
        must hold; a tiktoken vocabulary may leave ids unused)."""
        return max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @property
    def eod(self) -> int | None:
        """Megatron's name for the end-of-document token: the EOS token."""
        return self.eos_token_id

    @cached_property
    def hf(self):
        """The ``transformers`` tokenizer (imported on first use), for chat templates and HF-only features."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        if self.hf_settings is not None:
            return PreTrainedTokenizerFast(tokenizer_object=self.backend, **self.hf_settings)
        path = Path(self.name_or_path)
        if path.is_file():
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        # Never code of the directory's own (transformers would otherwise ask on stdin whether to run it).
        return AutoTokenizer.from_pretrained(self.name_or_path, local_files_only=path.is_dir(), trust_remote_code=False)

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
        if _is_tiktoken_file(path):
            return f"its special tokens are {listed}{more}; pass eos_token={eos_like!r} to build_tokenizer"
        if self.hf_settings is not None:
            return (
                f"its special tokens are {listed}{more}; name the EOS on the transformers tokenizer before passing "
                f"it, e.g. tokenizer.eos_token = {eos_like!r}"
            )
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


def _read_config(path: Path) -> dict:
    """A JSON config beside a tokenizer; {} when there is none."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise DataConfigError(f"{path}: invalid JSON ({error}); fix or regenerate it with save_pretrained") from None
    if not isinstance(config, dict):
        raise DataConfigError(f"{path}: expected a JSON object, got {type(config).__name__}; regenerate it")
    return config


def _special_token_ids(backend, directory: Path | None) -> dict[str, int | None]:
    names: dict[str, str | None] = dict.fromkeys(_SPECIAL_ROLES)
    bare = True  # no file beside tokenizer.json names the special tokens
    for file_name in _SPECIAL_TOKEN_FILES if directory else ():
        path = directory / file_name
        if not path.is_file():
            continue
        bare = False
        config = _read_config(path)
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


def _class_references(auto_map) -> list[str]:
    """The class references of an ``auto_map`` in any shape: a dict of auto class -> reference or ``[slow, fast]``
    pair (nested as deep as it goes), a list, or one string."""
    if isinstance(auto_map, str):
        return [auto_map]
    if isinstance(auto_map, Mapping):
        auto_map = list(auto_map.values())
    if isinstance(auto_map, (list, tuple)):
        return [reference for item in auto_map for reference in _class_references(item)]
    return []


@functools.cache
def _registered_tokenizer_classes() -> frozenset[str]:
    """The classes of transformers' AutoTokenizer registry (``TOKENIZER_MAPPING_NAMES``), read from its source:
    importing ``transformers`` takes seconds of a start-up that otherwise does not need it. Empty if not found."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    source = Path(next(iter(spec.submodule_search_locations))) / "models" / "auto" / "tokenization_auto.py"
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return frozenset()
    names: set[str] = set()
    for node in ast.walk(tree):
        targets = [target.id for target in getattr(node, "targets", ()) if isinstance(target, ast.Name)]
        if isinstance(node, ast.Assign) and "TOKENIZER_MAPPING_NAMES" in targets:
            for pair in ast.walk(node.value):
                if isinstance(pair, ast.Tuple) and len(pair.elts) == 2:
                    names.update(
                        constant.value
                        for constant in ast.walk(pair.elts[1])
                        if isinstance(constant, ast.Constant) and isinstance(constant.value, str)
                    )
    return frozenset(names)


def _is_builtin_tokenizer_class(name: str) -> bool:
    """Whether ``name`` is a tokenizer class of ``transformers`` itself (a pre-v5 ``...Fast`` name included)."""
    known = _GENERIC_TOKENIZER_CLASSES | _registered_tokenizer_classes()
    if name in known or name.removesuffix("Fast") in known:
        return True
    # A name the registry's source does not list: transformers' own lookup decides (imported only for such names).
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    found = tokenizer_class_from_name(name)
    return isinstance(found, type) and found.__module__.startswith("transformers.")


def _refuse_custom_code(directory: Path, tiktoken_file: Path | None = None) -> None:
    """Refuse a tokenizer directory that declares code of its own (an ``auto_map``, or a ``tokenizer_class`` that
    is not a ``transformers`` class): that code is never run, and the ids read from its tokenizer.json or tiktoken
    file without it may not be the ones it gives."""
    declared = []
    for file_name in _CODE_DECLARING_FILES:
        config = _read_config(directory / file_name)
        auto_map = config.get("auto_map")
        if auto_map:
            references = _class_references(auto_map)
            modules = {reference.split("--")[-1].rpartition(".")[0] for reference in references}
            code = [f"{module}.py" for module in sorted(modules) if (directory / f"{module}.py").is_file()]
            shown = ", ".join(references) if references else json.dumps(auto_map)
            declared.append(f"auto_map in {file_name}: {shown}" + (f" ({', '.join(code)})" if code else ""))
        tokenizer_class = config.get("tokenizer_class")
        if tokenizer_class is not None and not (
            isinstance(tokenizer_class, str) and _is_builtin_tokenizer_class(tokenizer_class)
        ):
            declared.append(f"tokenizer_class in {file_name}: {tokenizer_class!r}, which is not a transformers class")
    if not declared:
        return
    alternative = (
        f", or pass the tiktoken file {tiktoken_file} itself (its ranks are read without that code) with its "
        "special_tokens and pattern"
        if tiktoken_file is not None
        else ""
    )
    raise DataConfigError(
        f"tokenizer directory {directory} declares custom code ({'; '.join(declared)}); code from a data or "
        "tokenizer directory is never run. Review that code; to use it, load the tokenizer in your own Python "
        f"script with `tokenizer = AutoTokenizer.from_pretrained({str(directory)!r}, trust_remote_code=True)` and "
        f"pass the object instead of the path (build_tokenizer(tokenizer), or build_dataloaders(config, "
        f"tokenizer=tokenizer)){alternative}"
    )


def _missing_path_error(name: str, path: Path) -> DataConfigError:
    """``name`` (``path`` once expanded) does not exist: say so, naming its first missing part."""
    missing = path
    while not missing.parent.exists() and missing.parent != missing:
        missing = missing.parent
    detail = "" if missing == path else f" ({missing} does not exist)"
    return DataConfigError(
        f"no such file or directory: {name}{detail}; pass an existing tokenizer directory (holding tokenizer.json) "
        "or a tokenizer.json or tiktoken file"
    )


def _hub_error(name: str) -> DataConfigError:
    return DataConfigError(
        f"tokenizer '{name}' is not a local directory or tokenizer.json file. Downloading from the Hugging Face "
        "Hub is disabled (offline); download it on a connected machine with "
        f"`AutoTokenizer.from_pretrained('{name}').save_pretrained(DIR)` and pass DIR instead"
    )


def is_transformers_tokenizer(tokenizer: object) -> bool:
    """Whether ``tokenizer`` is a ``transformers`` tokenizer object. Checked without importing ``transformers``:
    an object of it can only exist once it is imported."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(tokenizer, transformers.PreTrainedTokenizerBase)


def _from_transformers_object(hf) -> TextTokenizer:
    """A ``transformers`` tokenizer as a ``TextTokenizer`` with its own special tokens and chat template.

    Its Rust tokenizer is copied: ``transformers`` sets truncation and padding on it for a call that asks for
    them, and they must not cut the texts this library encodes.
    """
    from tokenizers import Tokenizer

    name = str(getattr(hf, "name_or_path", "") or type(hf).__name__)
    backend = getattr(hf, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise DataConfigError(
            f"tokenizer {name} is a {type(hf).__name__} without a fast (Rust) tokenizer; load it with "
            "AutoTokenizer.from_pretrained from a directory holding tokenizer.json (save_pretrained of a fast "
            "tokenizer writes one) and pass that"
        )
    backend = Tokenizer.from_str(backend.to_str())
    settings: dict[str, object] = dict(hf.special_tokens_map)
    if getattr(hf, "chat_template", None):
        settings["chat_template"] = hf.chat_template
    return TextTokenizer(backend, name, hf.eos_token_id, hf.pad_token_id, hf.bos_token_id, settings)


def _from_hub(name: str) -> TextTokenizer:
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in {"1", "true", "yes", "on"}:
        raise _hub_error(name)
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - any Hub failure gets the same actionable message
        raise _hub_error(name) from error
    return _from_transformers_object(hf)


def _is_tiktoken_file(path: Path) -> bool:
    """Whether ``path`` is a tiktoken-format vocabulary: ``*.tiktoken``, or a known name whose first line is one
    ``base64-token rank`` pair (a SentencePiece ``tokenizer.model`` is binary)."""
    if path.suffix == ".tiktoken":
        return True
    if path.name not in _TIKTOKEN_FILE_NAMES or not path.is_file():
        return False
    with path.open("rb") as file:
        return _TIKTOKEN_LINE.fullmatch(file.readline().rstrip(b"\r\n")) is not None


def _read_tiktoken_ranks(path: Path, content: bytes) -> dict[bytes, int]:
    """The mergeable tokens of a tiktoken file (``content`` read from ``path``): token bytes -> rank (its id)."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError(f"{len(fields)} fields")
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except ValueError as error:  # binascii.Error is a ValueError
            raise DataConfigError(
                f"{path}, line {number}: {line[:60]!r} is not a 'base64-token rank' line ({error}); pass the "
                "tiktoken file as shipped"
            ) from None
        if token in ranks or rank < 0:
            problem = f"token {token!r} appears twice" if token in ranks else f"rank {rank} is negative"
            raise DataConfigError(f"{path}, line {number}: {problem}; pass the tiktoken file as shipped")
        ranks[token] = rank
    if not ranks:
        raise DataConfigError(f"{path} holds no tokens; pass a tiktoken file of 'base64-token rank' lines")
    if len(set(ranks.values())) != len(ranks):
        raise DataConfigError(f"{path}: two tokens share a rank; pass the tiktoken file as shipped")
    return ranks


def _tiktoken_added_tokens(special_tokens, config: dict, source: str) -> dict[str, dict]:
    """content -> added-token entry (``id``, ``special`` and the flags): ``special_tokens`` when given, else the
    ``added_tokens_decoder`` of the tokenizer_config.json beside the file."""
    if special_tokens is not None:
        if not isinstance(special_tokens, Mapping):
            raise DataConfigError(
                f"special_tokens must map each special token to its id, e.g. {{'<|endoftext|>': 151643}}, got "
                f"{type(special_tokens).__name__}"
            )
        entries = {content: {"id": token_id, "special": True} for content, token_id in special_tokens.items()}
        source = "special_tokens"
    else:
        decoder = config.get("added_tokens_decoder") or {}
        entries = {}
        for token_id, entry in decoder.items():
            content = _token_content(entry)
            if content is None or not str(token_id).isdigit():
                raise DataConfigError(
                    f"{source}: added_tokens_decoder entry {token_id!r}: {entry!r} is not an id -> "
                    "{'content': ..., 'special': ...} entry; regenerate it with save_pretrained"
                )
            flags = entry if isinstance(entry, dict) else {}
            entries[content] = {
                "id": int(token_id),
                "special": bool(flags.get("special", True)),
                **{flag: bool(flags.get(flag, default)) for flag, default in _ADDED_TOKEN_FLAGS.items()},
            }
    for content, entry in entries.items():
        token_id = entry["id"]
        if not isinstance(content, str) or not content:
            raise DataConfigError(f"{source}: a special token must be a non-empty string, got {content!r}")
        if isinstance(token_id, bool) or not isinstance(token_id, Integral) or token_id < 0:
            raise DataConfigError(f"{source}: the id of {content!r} must be a non-negative integer, got {token_id!r}")
    return entries


def _tiktoken_backend(ranks: dict[bytes, int], added: dict[str, dict], pattern: str, where: str):
    """The Rust tokenizer of a tiktoken vocabulary: byte-level BPE over ``ranks`` (``transformers``'
    ``TikTokenConverter`` derives the merges), ``pattern`` splitting the text first, and the added tokens at their
    own ids."""
    from tokenizers import Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class RanksConverter(TikTokenConverter):
        """``TikTokenConverter`` over ranks already read (it would read the file with the ``tiktoken`` package)."""

        def load_tiktoken_bpe(self, tiktoken_url):  # noqa: ARG002 - the ranks are given
            return ranks

    try:
        serialized = json.loads(RanksConverter(pattern=pattern).converted().to_str())
    except Exception as error:  # noqa: BLE001 - the Rust side raises a bare Exception for a bad regex
        raise DataConfigError(f"{where}: cannot build the tokenizer ({error}); check pattern") from None
    vocab = serialized["model"]["vocab"]
    taken = {token_id: token for token, token_id in vocab.items()}
    seen: dict[int, str] = {}
    for content, entry in added.items():
        token_id = entry["id"]
        clash = taken.get(token_id, seen.get(token_id))
        if clash is not None or content in vocab:
            what = f"id {token_id} is already {clash!r}" if clash is not None else "it is a mergeable token"
            raise DataConfigError(
                f"{where}: special token {content!r}: {what}; give each special token an id of its own, outside the "
                "ranks of the tiktoken file"
            )
        seen[token_id] = content
    # In the model's vocabulary too, so that each keeps its id (the Rust tokenizer appends new tokens after it).
    vocab.update({content: entry["id"] for content, entry in added.items()})
    serialized["added_tokens"] = [
        {**_ADDED_TOKEN_FLAGS, "content": content, **entry}
        for content, entry in sorted(added.items(), key=lambda item: item[1]["id"])
    ]
    return Tokenizer.from_str(json.dumps(serialized, ensure_ascii=False))


def _tiktoken_preset(file: Path, content: bytes, pattern: str | None) -> _TiktokenPreset | None:
    """The preset of a well-known tiktoken file, recognised by its content's sha256 (line endings as published).
    A file that is none of them needs its ``pattern``: the file does not say how text is split before BPE, and
    another split gives other ids for some texts."""
    digest = hashlib.sha256(content.replace(b"\r\n", b"\n")).hexdigest()
    preset = _TIKTOKEN_PRESETS.get(digest)
    if preset is None and pattern is None:
        known = ", ".join(preset.name for preset in _TIKTOKEN_PRESETS.values())
        raise DataConfigError(
            f"tiktoken file {file} (sha256 {digest[:16]}...) is none of the known vocabularies ({known}), and a "
            "tiktoken file does not say how its text is split before BPE; pass pattern=, the model's own "
            "pre-tokenization regex (PAT_STR or pat_str in the model's tokenization code), to build_tokenizer"
        )
    return preset


def _load_tiktoken(file: Path, directory: Path | None, options: dict) -> TextTokenizer:
    """A tiktoken file (in ``directory`` when one was passed, whose tokenizer_config.json and chat_template.jinja
    name the special tokens and the chat template unless ``options`` do; a known file's preset fills in the
    pattern and special tokens that neither names)."""
    config_path = (directory or file.parent) / "tokenizer_config.json"
    config = _read_config(config_path) if directory else {}
    content = file.read_bytes()
    ranks = _read_tiktoken_ranks(file, content)
    preset = _tiktoken_preset(file, content, options.get("pattern"))
    special_tokens = options.get("special_tokens")
    if special_tokens is None and not config.get("added_tokens_decoder") and preset is not None:
        special_tokens = preset.special_tokens
    added = _tiktoken_added_tokens(special_tokens, config, str(config_path))
    pattern = options.get("pattern")
    if pattern is None:  # _tiktoken_preset refused a file without pattern= that no preset knows
        pattern = preset.pattern
    if preset is not None:
        logger.info("tiktoken file %s is %s: its published pattern is used unless pattern= is given", file, preset.name)
    backend = _tiktoken_backend(ranks, added, pattern, str(file))
    names = {
        role: options.get(f"{role}_token") or _token_content(config.get(f"{role}_token")) for role in _SPECIAL_ROLES
    }
    if names["eos"] is None:
        names["eos"] = next((token for token in _EOS_CANDIDATES if token in added), None)
    ids = {}
    for role, token in names.items():
        ids[role] = None if token is None else backend.token_to_id(token)
        if token is not None and ids[role] is None:
            raise DataConfigError(
                f"the {role} token {token!r} of {file} is not one of its special tokens "
                f"({', '.join(sorted(added)) or 'none'}); add it to special_tokens with its id"
            )
    template = options.get("chat_template")
    if template is None and directory is not None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    template = template or config.get("chat_template")
    settings = {f"{role}_token": token for role, token in names.items() if token is not None}
    if template:
        settings["chat_template"] = template
    logger.info("tiktoken tokenizer %s: %d tokens, %d special", file, backend.get_vocab_size(), len(added))
    return TextTokenizer(backend, str(file), ids["eos"], ids["pad"], ids["bos"], settings)


def _tiktoken_file_in(directory: Path) -> Path | None:
    found = [
        path
        for path in [*sorted(directory.glob("*.tiktoken")), *(directory / name for name in _TIKTOKEN_FILE_NAMES)]
        if path.is_file() and _is_tiktoken_file(path)
    ]
    if len(found) > 1:
        raise DataConfigError(
            f"tokenizer directory {directory} holds several tiktoken files ({', '.join(p.name for p in found)}); "
            "pass the one to use"
        )
    return found[0] if found else None


def build_tokenizer(
    name_or_path,
    *,
    special_tokens: Mapping[str, int] | None = None,
    pattern: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    bos_token: str | None = None,
    chat_template: str | None = None,
) -> TextTokenizer:
    """The ``TextTokenizer`` of a tokenizer path or object: what every part of the pipeline that takes a tokenizer
    goes through.

    Accepted:

    - a ``TextTokenizer``, returned as is;
    - a ``transformers`` tokenizer object with a fast (Rust) tokenizer: ``AutoTokenizer.from_pretrained(...)``,
      ``PreTrainedTokenizerFast`` or the v5 ``TokenizersBackend``. Its own special tokens (``eos_token_id``,
      ``pad_token_id``, ``bos_token_id``) and ``chat_template`` are used; its Rust tokenizer is copied, so settings
      made on it later (truncation, padding) do not reach the pipeline;
    - a Hugging Face tokenizer directory or ``tokenizer.json`` file. Special tokens come from
      ``tokenizer_config.json``/``special_tokens_map.json`` beside ``tokenizer.json``; a bare ``tokenizer.json``
      (a file, or a directory without those files) gets its EOS from common names such as ``<|endoftext|>``;
    - a tiktoken file (``*.tiktoken``, ``tiktoken.model``, or a ``tokenizer.model`` of ``base64-token rank``
      lines), or a directory holding one and no ``tokenizer.json``. Its special tokens are ``special_tokens``, else
      the ``added_tokens_decoder`` of the directory's ``tokenizer_config.json``; the EOS is ``eos_token``, else that
      config's, else a common name among the special tokens. Text is split by ``pattern`` before BPE: a file
      does not say how, so a well-known one (``r50k_base``, ``p50k_base``, ``cl100k_base``, ``o200k_base``, Qwen's
      ``qwen.tiktoken``, recognised by the sha256 of its content) brings its published pattern, and special tokens
      when neither ``special_tokens`` nor the directory names any; any other file needs ``pattern``, the model's
      own (e.g. Qwen's splits digits one by one, cl100k's keeps up to three). An explicit ``pattern`` always wins.
      The chat template is ``chat_template``, else the directory's.
      ``build_tokenizer(...).hf.save_pretrained(DIR)`` writes it as a ``tokenizer.json`` directory, for the
      command line;
    - a name that is not a local path is taken for a Hub repository id (``gpt2``, ``org/name``) and tried only
      when ``HF_HUB_OFFLINE`` is not set; anything path-like that does not exist (absolute, ``./dir``, ``a/b/c``,
      ``dir/``, ``*.json``) is a "no such file or directory" error.

    Args:
        name_or_path: one of the above: a ``TextTokenizer``, a ``transformers`` tokenizer object, a Hugging Face
            tokenizer directory or ``tokenizer.json``, a tiktoken file, or a Hub repository id.
        special_tokens, pattern, eos_token, pad_token, bos_token, chat_template: for a tiktoken file only (see
            above): ``special_tokens`` maps each special token to its id, ``pattern`` splits the text before BPE,
            ``eos_token``/``pad_token``/``bos_token`` name those special tokens and ``chat_template`` is the Jinja
            chat template.

    Returns:
        The ``TextTokenizer``.

    Raises:
        DataConfigError: anything else, a missing or malformed file, a special token that is not in the vocabulary,
            or tiktoken options for a tokenizer that is not a tiktoken file.

    Example::

        qwen = build_tokenizer(
            "/models/Qwen-7B/qwen.tiktoken",
            special_tokens={"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645},
            pattern=r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
            r"|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
        )
    """
    given = {
        "special_tokens": special_tokens,
        "pattern": pattern,
        "eos_token": eos_token,
        "pad_token": pad_token,
        "bos_token": bos_token,
        "chat_template": chat_template,
    }
    options = {name: value for name, value in given.items() if value is not None}
    loaded = _load(name_or_path, options)
    from_tiktoken_file = isinstance(name_or_path, (str, os.PathLike)) and _is_tiktoken_file(Path(loaded.name_or_path))
    if options and not from_tiktoken_file:
        raise DataConfigError(
            f"{', '.join(options)} apply to tiktoken files only, but tokenizer {loaded.name_or_path} is not one; "
            "remove them (a Hugging Face tokenizer names its special tokens and chat template in its own files)"
        )
    return loaded


def _load(tokenizer, options: dict) -> TextTokenizer:
    from tokenizers import Tokenizer

    if isinstance(tokenizer, TextTokenizer):
        return tokenizer
    if is_transformers_tokenizer(tokenizer):
        return _from_transformers_object(tokenizer)
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise DataConfigError(
            f"tokenizer must be a TextTokenizer, a transformers tokenizer object (AutoTokenizer.from_pretrained) or "
            f"the path of a tokenizer directory, tokenizer.json or tiktoken file; got {type(tokenizer).__name__}"
        )
    name = os.fspath(tokenizer)
    path = Path(name).expanduser()
    if path.is_dir():
        tokenizer_file, directory = path / "tokenizer.json", path
        tiktoken_file = None if tokenizer_file.is_file() else _tiktoken_file_in(path)
        _refuse_custom_code(path, tiktoken_file)
        if not tokenizer_file.is_file():
            if tiktoken_file is not None:
                return _load_tiktoken(tiktoken_file, path, options)
            raise DataConfigError(
                f"tokenizer directory {path} has no tokenizer.json; save the tokenizer with a fast (Rust) "
                "implementation, e.g. `AutoTokenizer.from_pretrained(...).save_pretrained(DIR)`, or pass a "
                "directory holding a tiktoken file"
            )
    elif path.is_file():
        if _is_tiktoken_file(path):
            return _load_tiktoken(path, None, options)
        if path.suffix != ".json":
            raise DataConfigError(
                f"tokenizer file {path} is not a tokenizer.json or a tiktoken file (*.tiktoken); pass it or its "
                "directory"
            )
        tokenizer_file, directory = path, None
    elif _HUB_NAME.fullmatch(name) and not name.endswith((".json", ".tiktoken")):
        return _from_hub(name)
    else:
        raise _missing_path_error(name, path)
    try:
        backend = Tokenizer.from_file(str(tokenizer_file))
    except Exception as error:  # noqa: BLE001 - the Rust loader raises a bare Exception
        raise DataConfigError(f"{tokenizer_file}: not a valid tokenizer.json ({error})") from None
    ids = _special_token_ids(backend, directory)
    return TextTokenizer(backend, str(path), ids["eos"], ids["pad"], ids["bos"])
