"""Shared fixtures: the bundled real tokenizer and corpus, offline Hugging Face settings."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from command_runs import package_logger_kept  # noqa: E402

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


@pytest.fixture
def restore_package_logger():
    """A command's ``main`` configures the package logger (own handler, no propagation); undo that after the test."""
    with package_logger_kept():
        yield


@pytest.fixture
def logs(caplog):
    """Every record of the package at DEBUG and above, whatever an earlier test did to the package logger."""
    logger = logging.getLogger("hyper_parallel.data")
    saved = logger.propagate, list(logger.handlers)
    logger.propagate = True
    logger.handlers[:] = [h for h in logger.handlers if not getattr(h, "_hyper_parallel_data", False)]
    caplog.set_level(logging.DEBUG, logger="hyper_parallel.data")
    yield caplog
    logger.propagate, logger.handlers[:] = saved[0], saved[1]
