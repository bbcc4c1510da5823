"""Shared fixtures: the bundled real tokenizer and corpus, offline Hugging Face settings."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer  # noqa: E402

BUNDLED_CORPUS_PATH = Path(BUNDLED_TOKENIZER_PATH).parent / "corpus" / "austen_chapters.jsonl.gz"


@pytest.fixture(scope="session")
def tokenizer_path() -> Path:
    return BUNDLED_TOKENIZER_PATH


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer(BUNDLED_TOKENIZER_PATH)


@pytest.fixture(scope="session")
def corpus_path() -> Path:
    return BUNDLED_CORPUS_PATH
