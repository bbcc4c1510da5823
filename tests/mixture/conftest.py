"""Real sources for the mixture tests: Online JSON lines of the bundled novels' paragraphs and an Indexed
``.bin``/``.idx`` pair of other paragraphs tokenized by the bundled tokenizer, each document ended by its EOD."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from batching.conftest import paragraphs, write_jsonl

from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset
from hyper_parallel.data.tokenizer_protocol import read_tokenizer

SEQ_LENGTH = 64  # the Indexed rows' length


@pytest.fixture(scope="session")
def novel_paragraphs() -> list[str]:
    return paragraphs(240)


@pytest.fixture(scope="session")
def online_paths(tmp_path_factory, novel_paragraphs) -> tuple[Path, Path]:
    """Two JSON-lines files of 40 and 60 paragraphs (short ones, so that every record fits one window)."""
    directory = tmp_path_factory.mktemp("online")
    short = [text[:300] for text in novel_paragraphs]
    first = write_jsonl(directory / "first.jsonl", [{"text": text} for text in short[:40]])
    second = write_jsonl(directory / "second.jsonl", [{"text": text} for text in short[40:100]])
    return first, second


@pytest.fixture(scope="session")
def indexed_prefix(tmp_path_factory, novel_paragraphs, tokenizer) -> Path:
    """An Indexed pair of 140 paragraphs, each tokenized and ended by the tokenizer's EOD."""
    eod = read_tokenizer(tokenizer).eod
    prefix = tmp_path_factory.mktemp("indexed") / "novels_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for text in novel_paragraphs[100:]:
        ids = [*tokenizer.encode(text), eod]
        builder.add_document(np.asarray(ids, dtype=np.int32), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return prefix


def indexed_train_split(indexed_prefix: Path, tokenizer, cache_dir: Path):
    """The Indexed pair as one train split of ``SEQ_LENGTH``-token rows."""
    config = {"seq_length": SEQ_LENGTH, "split": "100, 0, 0", "data_cache_path": str(cache_dir)}
    return build_indexed_text_dataset(str(indexed_prefix), config, tokenizer=tokenizer, synchronize=False)[0]


def pairs_of(batch, records_by_tokens) -> Counter:
    """The (source, record) pairs of a batch's sequences; the collator's padding sequence is no record."""
    found = Counter()
    for ids, labels in batch.sequences():
        key = tuple(ids.tolist())
        if key in records_by_tokens:
            found[records_by_tokens[key]] += 1
        else:
            assert (labels == IGNORE_INDEX).all(), "a delivered sequence is no record of any source"
    return found


def take_pairs(loaders, counts, records_by_tokens) -> Counter:
    """The pairs of the first ``counts[r]`` batches of each rank's loader (None: to the end of the epoch)."""
    found = Counter()
    for loader, count in zip(loaders, counts, strict=True):
        for taken, batch in enumerate(loader, start=1):
            found += pairs_of(batch, records_by_tokens)
            if taken == count:
                break
    return found
