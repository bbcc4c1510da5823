"""Specification of ``build_tokenizer``: local tokenizer directories and files, special tokens and fingerprints."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer

TEXTS = [
    "The family of Dashwood had long been settled in Sussex.",
    "naïve café — 日本語, 1811!",
    "<|endoftext|> and <|im_start|>user",
    "",
]


def copy_bundled(directory: Path) -> Path:
    shutil.copytree(BUNDLED_TOKENIZER_PATH, directory)
    return directory


def write_word_level(path: Path, words: list[str]) -> Path:
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(path))
    return path


def test_directory_and_tokenizer_json_agree():
    """The bundled directory and its tokenizer.json give the same ids, EOS (id 0), vocabulary and fingerprint."""
    from_dir = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    from_file = build_tokenizer(BUNDLED_TOKENIZER_PATH / "tokenizer.json")
    for text in TEXTS:
        assert from_dir.encode(text) == from_file.encode(text)
        assert from_dir.encode(text, add_special_tokens=True) == from_dir.encode(text)
    assert from_dir.encode(TEXTS[2])[0] == 0  # special tokens in the text map to their ids
    assert from_dir.eod == from_dir.eos_token_id == from_file.eod == 0
    assert (from_dir.pad_token_id, from_dir.bos_token_id) == (1, None)
    assert from_dir.vocab_size == from_file.vocab_size == 8192
    assert from_dir.fingerprint == from_file.fingerprint
    assert from_dir.decode(from_dir.encode(TEXTS[1])) == TEXTS[1]


def test_fingerprint_follows_content_not_path(tmp_path):
    """A copy elsewhere has the same fingerprint; adding a token changes it."""
    copy = copy_bundled(tmp_path / "copy")
    assert build_tokenizer(copy).fingerprint == build_tokenizer(BUNDLED_TOKENIZER_PATH).fingerprint
    backend = Tokenizer.from_file(str(copy / "tokenizer.json"))
    backend.add_special_tokens(["<|extra|>"])
    backend.save(str(copy / "tokenizer.json"))
    changed = build_tokenizer(copy)
    assert changed.fingerprint != build_tokenizer(BUNDLED_TOKENIZER_PATH).fingerprint
    assert changed.vocab_size == 8193


def test_hf_tokenizer_renders_the_chatml_template():
    """``.hf`` is a transformers tokenizer with the bundled ChatML chat template and the same ids."""
    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.hf.eos_token_id == 0
    assert tokenizer.hf(TEXTS[0])["input_ids"] == tokenizer.encode(TEXTS[0])


def test_a_pickled_tokenizer_leaves_its_transformers_tokenizer_behind():
    """DataLoader workers receive the tokenizer by pickle: the ``transformers`` tokenizer loaded for chat templates
    stays behind (it is heavy) and is loaded again on first use; the copy encodes the same."""
    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    bare = len(pickle.dumps(tokenizer))
    tokenizer.hf  # noqa: B018 - loads it
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert len(pickle.dumps(tokenizer)) == bare
    assert "hf" in vars(tokenizer) and "hf" not in vars(copy)
    assert copy.fingerprint == tokenizer.fingerprint and copy.encode(TEXTS[1]) == tokenizer.encode(TEXTS[1])
    assert copy.hf(TEXTS[0])["input_ids"] == tokenizer.encode(TEXTS[0])


def test_directory_without_tokenizer_json_is_a_config_error(tmp_path):
    """A directory lacking tokenizer.json is a DataConfigError that says how to save a fast tokenizer."""
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(DataConfigError, match=r"has no tokenizer\.json; save the tokenizer with a fast"):
        build_tokenizer(tmp_path)


@pytest.mark.parametrize("name", ["no-such-model", "org/no-such-model"])
def test_hub_name_is_not_fetched_when_offline(name):
    """A Hub repository id that is not a local path is a clear DataConfigError while the Hub is offline."""
    with pytest.raises(DataConfigError, match=r"Downloading from the Hugging Face Hub is disabled \(offline\)"):
        build_tokenizer(name)


@pytest.mark.parametrize("name", ["{tmp}/missing", "{tmp}/a/b/tokenizer.json", "./missing", "a/b/c", "tok/"])
def test_missing_path_is_no_such_file(tmp_path, monkeypatch, name):
    """Anything path-like that does not exist is "no such file or directory", naming it and its first missing
    part, never a Hub download hint."""
    monkeypatch.chdir(tmp_path)
    name = name.format(tmp=tmp_path)
    with pytest.raises(DataConfigError) as error:
        build_tokenizer(name)
    message = str(error.value)
    assert message.startswith(f"no such file or directory: {name}") and "Hub" not in message
    if name.endswith("tokenizer.json"):
        assert f"({tmp_path / 'a'} does not exist)" in message


@pytest.mark.parametrize(
    ("file_name", "content", "message"),
    [
        ("vocab.txt", "a\nb\n", r"is not a tokenizer\.json"),
        ("tokenizer.json", "{not json", r"not a valid tokenizer\.json"),
    ],
)
def test_unusable_tokenizer_file_is_a_config_error(tmp_path, file_name, content, message):
    """A file that is not a loadable tokenizer.json is a DataConfigError naming it."""
    (tmp_path / file_name).write_text(content)
    with pytest.raises(DataConfigError, match=message):
        build_tokenizer(tmp_path / file_name)


def test_special_tokens_from_config_dicts_and_unknown_tokens(tmp_path):
    """Special tokens may be AddedToken dicts in tokenizer_config.json; a token missing from the vocabulary is a
    DataConfigError."""
    directory = copy_bundled(tmp_path / "tok")
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = {"content": "<|im_end|>", "special": True}
    config["bos_token"] = "<|im_start|>"
    config_path.write_text(json.dumps(config))
    tokenizer = build_tokenizer(directory)
    assert (tokenizer.eod, tokenizer.bos_token_id, tokenizer.pad_token_id) == (3, 2, 1)

    config["pad_token"] = "<|no_such_token|>"
    config_path.write_text(json.dumps(config))
    with pytest.raises(
        DataConfigError, match=r"the pad token '<\|no_such_token\|>' named in .* is not in the vocabulary"
    ):
        build_tokenizer(directory)


@pytest.mark.parametrize(("words", "eod"), [(["[UNK]", "hello", "</s>"], 2), (["[UNK]", "hello", "world"], None)])
def test_bare_tokenizer_json_finds_a_common_eos(tmp_path, words, eod):
    """A bare tokenizer.json takes its EOS from common names such as ``</s>``, and has none otherwise."""
    tokenizer = build_tokenizer(write_word_level(tmp_path / "tokenizer.json", words))
    assert tokenizer.eod == eod
    assert tokenizer.encode("hello world") == [1, words.index("world") if "world" in words else 0]


def test_directory_holding_only_tokenizer_json_finds_a_common_eos(tmp_path):
    """A directory with tokenizer.json and no special-token files is bare too: its EOS comes from common names."""
    write_word_level(tmp_path / "tokenizer.json", ["[UNK]", "hello", "</s>"])
    assert build_tokenizer(tmp_path).eod == 2


def test_eos_help_lists_the_special_tokens_and_names_the_likely_eos(tmp_path):
    """Without an EOS, ``eos_help`` lists the special tokens (ids included) and shows the tokenizer_config.json
    that names the end-like one; a tokenizer without special tokens says so."""
    backend = Tokenizer.from_file(str(write_word_level(tmp_path / "tokenizer.json", ["[UNK]", "hello"])))
    backend.add_special_tokens(["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = build_tokenizer(tmp_path / "tokenizer.json")
    assert tokenizer.eod is None
    help_text = tokenizer.eos_help()
    assert "'<｜begin▁of▁sentence｜>' (id 2), '<｜end▁of▁sentence｜>' (id 3)" in help_text
    assert (
        f'name the EOS in {tmp_path / "tokenizer_config.json"}, e.g. {{"eos_token": "<｜end▁of▁sentence｜>"}}'
        in help_text
    )
    assert help_text.endswith(f"pass the directory {tmp_path}")

    plain = build_tokenizer(write_word_level(tmp_path / "plain.json", ["[UNK]", "hello"]))
    assert "no special tokens" in plain.eos_help()


def test_truncation_and_padding_saved_in_the_tokenizer_are_turned_off(tmp_path, caplog):
    """A tokenizer.json saved with truncation and padding (as training scripts leave them) must not cut or pad the
    texts the library encodes: both are turned off, with a warning naming them."""
    copy = copy_bundled(tmp_path / "copy")
    backend = Tokenizer.from_file(str(copy / "tokenizer.json"))
    backend.enable_truncation(max_length=4)
    backend.enable_padding(length=64, pad_id=1)
    backend.save(str(copy / "tokenizer.json"))
    text = " ".join(TEXTS)

    with caplog.at_level("WARNING", logger="hyper_parallel.data"):
        tokenizer = build_tokenizer(copy)

    whole = build_tokenizer(BUNDLED_TOKENIZER_PATH).encode(text)
    assert len(whole) > 4
    assert tokenizer.encode(text) == whole
    assert [encoding.ids for encoding in tokenizer.backend.encode_batch_fast([text])] == [whole]
    assert "sets truncation and padding; turned off" in caplog.text
