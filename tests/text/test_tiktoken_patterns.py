"""A tiktoken file's pre-tokenization pattern: a well-known vocabulary brings its published one (recognised by the
file's sha256), any other file is refused without ``pattern=``, and an explicit ``pattern`` always wins.

Qwen's real qwen.tiktoken ships inside the ``dashscope`` wheel (a test dependency): it is recognised by its hash and
gives tiktoken's own ids for the bundled corpus. The OpenAI files cannot be downloaded here, so their presets are
checked against what the ``tiktoken`` package publishes for them (each file's ``expected_hash``, its ``pat_str`` and
special tokens), and the recognition by hash is tested with a synthetic file registered as a preset for the test.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import tiktoken
import tiktoken_ext.openai_public as openai_public

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.text import build_tokenizer as build_tokenizer_module
from hyper_parallel.data.text.build_tokenizer import build_tokenizer
from text.test_tokenizer_objects import (
    BUNDLED_SPECIALS,
    GPT2_PATTERN,
    QWEN_PATTERN,
    TEXTS,
    bundled_ranks,
    corpus_texts,
    write_tiktoken,
)

# Texts whose ids depend on the pattern: digit runs (Qwen splits them one by one), contractions, trailing spaces.
SPLIT_SENSITIVE = ["In 1811, 12345678 pounds; it's 3.14159", "They'LL say   \n\n  it  ", "x   \ny\r\n\r\n z  "]
QWEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"


def shifted_ranks() -> dict[bytes, int]:
    """The bundled vocabulary as Qwen lays its file out: ranks from 0, no special tokens in the file."""
    return {token: rank - 4 for token, rank in bundled_ranks().items()}


def specials_after(ranks: dict[bytes, int]) -> dict[str, int]:
    return {token: len(ranks) + i for i, token in enumerate(BUNDLED_SPECIALS)}


@pytest.fixture
def preset_file(tmp_path, monkeypatch):
    """A synthetic tiktoken file registered as a preset with Qwen's pattern and the bundled special tokens
    (the real qwen.tiktoken cannot be fetched offline; the registry is patched for this test only)."""
    ranks = shifted_ranks()
    path = write_tiktoken(tmp_path / "vocab.tiktoken", ranks)
    preset = build_tokenizer_module._TiktokenPreset("synthetic", QWEN_PATTERN, specials_after(ranks))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setitem(build_tokenizer_module._TIKTOKEN_PRESETS, digest, preset)
    return path, ranks, preset


def reference(ranks: dict[bytes, int], pattern: str, specials: dict[str, int]) -> tiktoken.Encoding:
    return tiktoken.Encoding("reference", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)


@pytest.mark.parametrize("file_name", ["vocab.tiktoken", "tiktoken.model", "tokenizer.model"])
@pytest.mark.parametrize("passed", ["file", "directory"])
def test_an_unknown_tiktoken_file_without_a_pattern_is_refused_and_loads_with_one(tmp_path, file_name, passed):
    ranks = shifted_ranks()
    specials = specials_after(ranks)
    path = write_tiktoken(tmp_path / file_name, ranks)
    target = path if passed == "file" else tmp_path
    with pytest.raises(DataConfigError) as refused:
        build_tokenizer(target, special_tokens=specials)
    message = str(refused.value)
    assert str(path) in message and "pattern=" in message
    assert "cl100k_base" in message and "qwen.tiktoken" in message  # the presets it would have recognised

    tokenizer = build_tokenizer(target, special_tokens=specials, pattern=QWEN_PATTERN)
    expected = reference(ranks, QWEN_PATTERN, specials)
    for text in [*TEXTS, *SPLIT_SENSITIVE]:
        assert tokenizer.encode(text) == expected.encode(text, allowed_special="all")


def test_a_known_tiktoken_file_brings_its_pattern_and_special_tokens(preset_file, tmp_path):
    path, ranks, preset = preset_file
    expected = reference(ranks, preset.pattern, dict(preset.special_tokens))
    gpt2 = reference(ranks, GPT2_PATTERN, dict(preset.special_tokens))
    tokenizer = build_tokenizer(path)
    for text in [*TEXTS, *SPLIT_SENSITIVE, *corpus_texts(1)]:
        assert tokenizer.encode(text) == expected.encode(text, allowed_special="all")
    assert tokenizer.encode(SPLIT_SENSITIVE[0]) != gpt2.encode(SPLIT_SENSITIVE[0])  # the pattern matters here
    assert tokenizer.eod == preset.special_tokens["<|endoftext|>"]

    # Recognised by content, not name, and with Windows line endings too.
    copy = tmp_path / "copy" / "renamed.tiktoken"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    assert build_tokenizer(copy).encode(SPLIT_SENSITIVE[0]) == tokenizer.encode(SPLIT_SENSITIVE[0])


def test_an_explicit_pattern_and_special_tokens_win_over_the_preset(preset_file):
    path, ranks, preset = preset_file
    own_specials = {"<|endoftext|>": len(ranks) + 7}
    tokenizer = build_tokenizer(path, pattern=GPT2_PATTERN, special_tokens=own_specials)
    expected = reference(ranks, GPT2_PATTERN, own_specials)
    for text in SPLIT_SENSITIVE:
        assert tokenizer.encode(text) == expected.encode(text)
    assert tokenizer.eod == len(ranks) + 7 and tokenizer.vocab_size == len(ranks) + 8


def test_a_directory_naming_its_special_tokens_keeps_them_with_the_preset_pattern(preset_file, tmp_path):
    path, ranks, preset = preset_file
    directory = tmp_path / "model"
    directory.mkdir()
    shutil.copy(path, directory / "qwen.tiktoken")
    decoder = {str(len(ranks) + 10): {"content": "<|eot|>", "special": True}}
    config = {"added_tokens_decoder": decoder, "eos_token": "<|eot|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tokenizer = build_tokenizer(directory)
    assert tokenizer.eod == len(ranks) + 10
    expected = reference(ranks, preset.pattern, {"<|eot|>": len(ranks) + 10})
    assert tokenizer.encode(SPLIT_SENSITIVE[0]) == expected.encode(SPLIT_SENSITIVE[0])


@pytest.mark.parametrize("name", ["r50k_base", "p50k_base", "cl100k_base", "o200k_base"])
def test_the_openai_presets_are_what_tiktoken_publishes(monkeypatch, name):
    """Each preset's hash, pattern and special tokens are those of tiktoken's own encoding (its constructor is run
    with the file download replaced by a recorder of the expected hash: the file itself is not available here)."""
    hashes = []

    def record_hash(url, expected_hash=None):
        hashes.append(expected_hash)
        return {}

    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", record_hash)
    published = openai_public.ENCODING_CONSTRUCTORS[name]()
    preset = build_tokenizer_module._TIKTOKEN_PRESETS[hashes[0]]
    assert preset.name == name and preset.pattern == published["pat_str"]
    assert dict(preset.special_tokens) == published["special_tokens"]


def test_the_qwen_preset_has_qwens_pattern_and_special_tokens():
    preset = build_tokenizer_module._TIKTOKEN_PRESETS[QWEN_SHA256]
    assert preset.pattern == QWEN_PATTERN
    specials = dict(preset.special_tokens)
    assert (specials["<|endoftext|>"], specials["<|im_start|>"], specials["<|im_end|>"]) == (151643, 151644, 151645)
    assert len(specials) == 208 and specials["<|extra_204|>"] == 151850


@pytest.mark.parametrize("name", [preset.name for preset in build_tokenizer_module._TIKTOKEN_PRESETS.values()])
def test_every_preset_pattern_splits_as_tiktoken_does(tmp_path, name):
    """The Rust tokenizer reads each published pattern (possessive quantifiers, ``$``) as tiktoken does."""
    preset = next(p for p in build_tokenizer_module._TIKTOKEN_PRESETS.values() if p.name == name)
    ranks = shifted_ranks()
    specials = specials_after(ranks)
    path = write_tiktoken(tmp_path / "vocab.tiktoken", ranks)
    tokenizer = build_tokenizer(path, special_tokens=specials, pattern=preset.pattern)
    expected = reference(ranks, preset.pattern, specials)
    for text in [*TEXTS, *SPLIT_SENSITIVE, *corpus_texts(2)]:
        assert tokenizer.encode(text) == expected.encode(text, allowed_special="all")


def qwen_tiktoken() -> Path:
    """Qwen's published vocabulary file, as the dashscope wheel ships it (found without importing the package)."""
    spec = importlib.util.find_spec("dashscope")
    return Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"


def test_the_real_qwen_file_is_recognised_and_gives_tiktokens_ids(caplog):
    """Loaded bare, qwen.tiktoken is recognised by its sha256 and split by Qwen's pattern: every paragraph of the
    bundled corpus gets the ids of tiktoken's own encoder over the same ranks, pattern and special tokens. A
    guessed pattern (GPT-2's, what a bare file was once split by) gives other ids for some paragraphs."""
    path = qwen_tiktoken()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == QWEN_SHA256
    with caplog.at_level("INFO", logger="hyper_parallel.data"):
        tokenizer = build_tokenizer(path)
    assert any("is qwen.tiktoken" in record.getMessage() for record in caplog.records)
    ranks = tiktoken.load.load_tiktoken_bpe(str(path))
    specials = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
    specials.update({f"<|extra_{i}|>": 151646 + i for i in range(205)})
    expected = reference(ranks, QWEN_PATTERN, specials)
    texts = [*TEXTS, *SPLIT_SENSITIVE, *corpus_texts(200)]
    wanted = [expected.encode(text, allowed_special="all") for text in texts]
    assert [tokenizer.encode(text) for text in texts] == wanted
    assert (tokenizer.eos_token_id, tokenizer.vocab_size) == (151643, 151851)
    guessed = reference(ranks, GPT2_PATTERN, specials)
    assert any(guessed.encode(text, allowed_special="all") != ids for text, ids in zip(texts, wanted, strict=True))
