"""Small real data files for the loader tests: paragraphs of the bundled corpus and multi-turn conversations."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH

BUNDLED_CORPUS_PATH = Path(BUNDLED_TOKENIZER_PATH).parent / "corpus" / "austen_chapters.jsonl.gz"


def paragraphs(count: int) -> list[str]:
    """The first ``count`` non-empty paragraphs of the bundled novels (lengths from a few words to hundreds)."""
    found = []
    with gzip.open(BUNDLED_CORPUS_PATH, "rt", encoding="utf-8") as lines:
        for line in lines:
            for paragraph in json.loads(line)["text"].split("\n\n"):
                if paragraph.strip():
                    found.append(paragraph.strip())
                    if len(found) == count:
                        return found
    raise AssertionError("the bundled corpus has fewer paragraphs than asked")


def conversations(count: int) -> list[dict]:
    """Multi-turn conversations with system prompts, role aliases and tool turns."""
    texts = paragraphs(count * 3)
    records = []
    for index in range(count):
        question, answer, extra = texts[3 * index : 3 * index + 3]
        turns = [{"role": "human", "content": question[:200]}, {"role": "gpt", "content": answer[:300]}]
        if index % 3 == 0:
            turns.insert(0, {"role": "system", "content": "You answer questions about novels."})
        if index % 4 == 1:
            turns += [{"role": "function", "content": '{"tool": "lookup"}'}, {"role": "gpt", "content": extra[:80]}]
        records.append({"id": index, "conversation": turns})
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="session")
def plaintext_path(tmp_path_factory) -> Path:
    records = [{"id": index, "text": text} for index, text in enumerate(paragraphs(60))]
    return write_jsonl(tmp_path_factory.mktemp("plaintext") / "train.jsonl", records)


@pytest.fixture(scope="session")
def conversation_path(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("conversations") / "chat.jsonl", conversations(40))


@pytest.fixture(scope="session")
def hf_cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_cache")


INDEXED = {
    "dataset": {
        "_target_": "hyper_parallel.data.text.build_dataset.build_indexed_text_dataset",
        "data_config": {"seq_length": 32, "split": "80, 10, 10"},
    },
    "dataloader": {"_target_": "hyper_parallel.data.batching.FixedBatchDataLoader"},
    "collate_fn": {"_target_": "hyper_parallel.data.batching.build_indexed_collate_fn"},
}


def write_indexed_corpus(prefix: Path, documents: int, seed: int) -> Path:
    """A seeded Indexed pair at ``prefix``: ``documents`` documents of 5 to 89 random token ids."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(documents):
        length = int(rng.integers(5, 90))
        builder.add_document(rng.integers(2, 8000, size=length), [length])
    builder.finalize(f"{prefix}.idx")
    return prefix


@pytest.fixture(scope="module")
def indexed_config(tmp_path_factory) -> dict:
    """A pipeline config of the Indexed path (fixed batches of GPTDataset samples) over 300 random documents."""
    directory = tmp_path_factory.mktemp("indexed")
    prefix = write_indexed_corpus(directory / "corpus_text_document", documents=300, seed=3)
    config = copy.deepcopy(INDEXED)
    config["dataset"]["data_path"] = str(prefix)
    config["dataset"]["data_config"]["data_cache_path"] = str(directory / "cache")
    return config
