"""Specification of long records in offline preparation: a text far longer than a tokenizer can hold in memory
at once is encoded in pieces, with exactly the ids of the whole text, and memory follows its size."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers
from tokenizers.processors import TemplateProcessing

from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.tools.offline_encoding import encode_texts

WORDS = [
    "The", "family", "of", "Dashwood,", "naïve", "café", "—", "日本語", "1811!", "<|endoftext|>", "...", "x",
    "'s", "12345678", "\"Marianne\"", "(said", "she)", "ok;",
]  # fmt: skip
SEPARATORS = [" ", " ", " ", " ", "  ", "\n", "\n\n", "\t", " \n", ""]
PIECE = 1000  # characters per piece in the identity tests, so that a 60,000-character text takes about 60


def random_text(characters: int, seed: int) -> str:
    """Words, digits, punctuation, special tokens and runs of spaces and newlines, reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    count = characters // 5
    words = rng.choice(np.array(WORDS, dtype=object), count)
    separators = rng.choice(np.array(SEPARATORS, dtype=object), count)
    return "".join(w + s for w, s in zip(words, separators, strict=True))[:characters]


def _bundled() -> Tokenizer:
    return Tokenizer.from_file(str(BUNDLED_TOKENIZER_PATH / "tokenizer.json"))


def _with_bos_and_eos() -> Tokenizer:
    tokenizer = _bundled()
    tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A <|im_end|>", special_tokens=[("<|im_start|>", 2), ("<|im_end|>", 3)]
    )
    return tokenizer


def _sentencepiece_like() -> Tokenizer:
    """A normalizer that marks the start of the text: cutting anywhere would add a marker mid-text."""
    tokenizer = _bundled()
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return tokenizer


def _one_word_metaspace() -> Tokenizer:
    tokenizer = _bundled()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    return tokenizer


def _stripping_added_token() -> Tokenizer:
    """An added token that swallows the spaces around it, so that a cut beside it would change the ids."""
    tokenizer = _bundled()
    tokenizer.add_special_tokens([AddedToken("x", lstrip=True, rstrip=True)])
    return tokenizer


TOKENIZERS = {
    "bundled": _bundled,
    "bos and eos": _with_bos_and_eos,
    "sentencepiece-like": _sentencepiece_like,
    "one-word metaspace": _one_word_metaspace,
    "stripping added token": _stripping_added_token,
}


def ids_of(encoded) -> list[int]:
    return encoded.tolist() if isinstance(encoded, np.ndarray) else encoded.ids


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_long_texts_get_the_ids_of_the_whole_text(name, add_special_tokens):
    """Texts longer than a piece, among short ones, encode to exactly the ids of each text encoded whole, with
    tokenizers that add special tokens around the text, mark its start, or strip spaces around added tokens."""
    tokenizer = TOKENIZERS[name]()
    texts = ["short", random_text(60_000, seed=1), "", random_text(30_000, seed=2), "tail"]
    encoded = encode_texts(tokenizer, texts, add_special_tokens, np.dtype(np.int32), piece_chars=PIECE)
    for text, result in zip(texts, encoded, strict=True):
        assert ids_of(result) == tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        assert len(result) == len(ids_of(result))


@pytest.mark.parametrize(
    "text",
    ["日本語の文章" * 2000, "x" * 12_000, "word " * 2000 + "y" * 8000],
    ids=["no whitespace", "one long word", "long tail without whitespace"],
)
def test_long_texts_without_cuts_are_encoded_whole(text):
    """A long text offering no whitespace to cut at is still encoded correctly."""
    tokenizer = _bundled()
    (encoded,) = encode_texts(tokenizer, [text], True, np.dtype(np.int32), piece_chars=PIECE)
    assert ids_of(encoded) == tokenizer.encode(text).ids


# -- one large record through the command, memory measured -------------------------------------------------------

RECORD_MB = 4
# Peak memory growth allowed while preparing one record, as a multiple of its size; encoding it whole took
# about 170 times its size in the worker.
GROWTH_BOUND = 30

_MEASURE = """
import json, resource, sys
from pathlib import Path

from hyper_parallel.data.tools.offline_preparation import main

SELF, CHILDREN = resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN


def peak(who):
    return resource.getrusage(who).ru_maxrss * 1024  # Linux reports KiB


def prepare(work, name, tokenizer):
    data, prefix = str(work / f"{name}.jsonl"), str(work / name)
    argv = ["--dataset-name-or-path", data, "--output-prefix", prefix, "--tokenizer-name-or-path", tokenizer]
    assert main([*argv, "--workers", "1"]) == 0


if __name__ == "__main__":
    work, tokenizer = Path(sys.argv[1]), sys.argv[2]
    prepare(work, "small", tokenizer)  # first, so that both baselines hold every import and a started worker
    before = {"main": peak(SELF), "worker": peak(CHILDREN)}
    prepare(work, "big", tokenizer)
    growth = {"main": peak(SELF) - before["main"], "worker": peak(CHILDREN) - before["worker"]}

    from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
    from hyper_parallel.data.text.build_tokenizer import build_tokenizer

    text = json.loads((work / "big.jsonl").read_text(encoding="utf-8"))["text"]
    whole = build_tokenizer(tokenizer).backend.encode(text).ids + [0]
    written = IndexedDataReader(work / "big_text_document")[0].tolist()
    print(json.dumps({"growth": growth, "tokens": len(written), "identical": written == whole}))
"""


def test_one_large_record_takes_memory_in_proportion_to_its_size(tmp_path):
    """Preparing a single record of several MB grows neither the main process nor the worker by more than
    ``GROWTH_BOUND`` times its size, and writes exactly the ids of the text encoded whole, plus EOD."""
    rng = np.random.default_rng(8)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocabulary = np.array(["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(5000)], dtype=object)
    text = " ".join(rng.choice(vocabulary, RECORD_MB * 1_000_000 // 5))[: RECORD_MB * 1_000_000]
    (tmp_path / "big.jsonl").write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    (tmp_path / "small.jsonl").write_text(json.dumps({"text": "a small record"}) + "\n", encoding="utf-8")
    script = tmp_path / "measure.py"
    script.write_text(_MEASURE, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(BUNDLED_TOKENIZER_PATH)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    size = (tmp_path / "big.jsonl").stat().st_size
    assert report["identical"] and report["tokens"] > size // 4
    for process, growth in report["growth"].items():
        assert growth < GROWTH_BOUND * size, f"{process} grew by {growth / size:.0f}x the record size"
