"""Specification of ``read_tokenizer``: one reading of any tokenizer object, under Hugging Face's names (the
library's ``TextTokenizer``) or Megatron's (the objects megatron-core's datasets take)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hyper_parallel.data.tokenizer_protocol import read_tokenizer


def test_the_library_tokenizer_is_read_under_hugging_face_names(tokenizer):
    tokens = read_tokenizer(tokenizer)
    assert (tokens.eod, tokens.eos, tokens.pad, tokens.bos) == (0, 0, 1, None)
    assert tokens.vocab_size == tokenizer.vocab_size == 8192
    assert tokens.special_tokens == {}
    assert tokens.identity == tokenizer.fingerprint
    assert tokens.name == tokenizer.name_or_path


class MegatronStyle:
    """A Megatron-style tokenizer: ``eod`` may differ from ``eos``, ids of special tokens by role, an identity."""

    eod, eos, pad, bos, vocab_size = 3, 2, 5, 1, 100
    special_tokens_dict = {"eos_token": 2, "pad_token": 5}

    @property
    def unique_identifiers(self) -> dict:
        return {"class": "MegatronStyle", "vocab_size": self.vocab_size}


def test_a_megatron_style_tokenizer_is_read_under_its_own_names():
    tokens = read_tokenizer(MegatronStyle())
    assert (tokens.eod, tokens.eos, tokens.pad, tokens.bos, tokens.vocab_size) == (3, 2, 5, 1, 100)
    assert tokens.special_tokens == {"eos_token": 2, "pad_token": 5}
    assert tokens.identity == {"class": "MegatronStyle", "vocab_size": 100}
    assert tokens.name == "MegatronStyle"


@pytest.mark.parametrize(
    ("attributes", "expected"),
    [
        ({"eod": None, "eos_token_id": 7}, {"eod": 7, "eos": 7}),
        ({"eod": 4, "eos": None, "eos_token_id": 7}, {"eod": 4, "eos": 7}),
        ({"pad": None, "pad_token_id": 9}, {"pad": 9}),
        ({"pad": 0, "pad_token_id": 9}, {"pad": 0}),
        ({}, {"eod": None, "eos": None, "pad": None, "bos": None, "vocab_size": None, "special_tokens": {}}),
    ],
)
def test_each_member_is_the_first_name_with_a_value(attributes, expected):
    """An attribute that is None falls through to the other name; 0 is an id, not a missing one."""
    tokens = read_tokenizer(SimpleNamespace(**attributes))
    assert {member: getattr(tokens, member) for member in expected} == expected


def test_identity_falls_back_to_the_class_name():
    assert read_tokenizer(SimpleNamespace(eod=0)).identity == "SimpleNamespace"
    assert read_tokenizer(SimpleNamespace(fingerprint="abc", unique_identifiers={"a": 1})).identity == "abc"


def test_reading_a_read_tokenizer_gives_it_back(tokenizer):
    tokens = read_tokenizer(tokenizer)
    assert read_tokenizer(tokens) is tokens
