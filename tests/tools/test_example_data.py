"""Specification of the example data set that the quickstart and the example configs read."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.text.build_data_transform import InstructionTransform, TextConversationTransform
from hyper_parallel.data.tools.example_data import (
    EXAMPLE_MAX_SEQ_LEN,
    ExampleData,
    example_passages,
    prepare_example_data,
)

SEQ_LEN = 4096


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> ExampleData:
    return prepare_example_data(tmp_path_factory.mktemp("example") / "out", workers=1)


@pytest.fixture(scope="module")
def chapters(corpus_path) -> list[dict]:
    with gzip.open(corpus_path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_writes_the_documented_files(example):
    out = example.train_jsonl.parent
    assert example == ExampleData(
        train_jsonl=out / "train.jsonl",
        conversations_jsonl=out / "conversations.jsonl",
        instructions_jsonl=out / "instructions.jsonl",
        corpus_prefix=out / "corpus_text_document",
        conversations_prefix=out / "conversations_messages_document",
        instructions_prefix=out / "instructions_text_document",
        packed_prefix=out / "train_text_document",
        blend_prefixes=(
            out / "books" / "pride_and_prejudice_text_document",
            out / "books" / "emma_text_document",
        ),
    )
    names = set(_files(out))
    mask_prefix = example.conversations_prefix.parent / f"{example.conversations_prefix.name}_loss_mask"
    instructions_mask_prefix = example.instructions_prefix.parent / f"{example.instructions_prefix.name}_loss_mask"
    for prefix in (
        example.corpus_prefix,
        example.conversations_prefix,
        mask_prefix,
        example.instructions_prefix,
        instructions_mask_prefix,
        example.packed_prefix,
        *example.blend_prefixes,
    ):
        assert {f"{prefix.relative_to(out)}.bin", f"{prefix.relative_to(out)}.idx"} <= names
    assert not [name for name in names if ".tmp-" in name]


def _records(example) -> list[dict]:
    return [json.loads(line) for line in example.train_jsonl.read_text(encoding="utf-8").splitlines()]


def test_train_jsonl_holds_every_chapter_in_passages_that_fit_the_configs_max_seq_len(example, chapters, tokenizer):
    records = _records(example)
    assert [set(record) for record in records] == [{"text", "book", "chapter"}] * len(records)
    lengths = [len(tokenizer.encode(record["text"])) for record in records]
    assert max(lengths) <= EXAMPLE_MAX_SEQ_LEN  # one plaintext window each: FixedBatchDataLoader reads them
    # The passages of a chapter, in order and joined by a blank line, are the chapter; a chapter that fits is whole.
    rebuilt = {}
    for record in records:
        rebuilt.setdefault((record["book"], record["chapter"]), []).append(record["text"])
    assert list(rebuilt) == [(chapter["book"], chapter["chapter"]) for chapter in chapters]
    long_chapters = 0
    for chapter, passages in zip(chapters, rebuilt.values(), strict=True):
        assert "\n\n".join(passages) == chapter["text"]
        fits = len(tokenizer.encode(chapter["text"])) <= EXAMPLE_MAX_SEQ_LEN
        assert (len(passages) == 1) == fits
        long_chapters += not fits
    assert long_chapters > 50 and len(records) > len(chapters) + long_chapters - 1


def test_passages_are_the_fewest_near_equal_parts_cut_at_blank_lines(tokenizer):
    paragraphs = [" ".join(f"w{n}x{i}" for i in range(12)) for n in range(10)]
    text = "\n\n".join(paragraphs)
    limit = len(tokenizer.encode("\n\n".join(paragraphs[:3])))  # three paragraphs fit a part, four do not
    (parts,) = example_passages([text], tokenizer, limit=limit)
    assert "\n\n".join(parts) == text
    assert len(parts) == 4 and all(len(tokenizer.encode(part)) <= limit for part in parts)
    assert sorted(part.count("\n\n") + 1 for part in parts) == [2, 2, 3, 3]  # near-equal, not 3 + 3 + 3 + 1
    assert example_passages(["a short text", text], tokenizer, limit=10_000) == [["a short text"], [text]]


def test_a_paragraph_longer_than_the_limit_is_refused(tokenizer):
    with pytest.raises(ValueError, match="a paragraph of .* tokens is longer than 8 tokens"):
        example_passages(["one two\n\n" + "word " * 40], tokenizer, limit=8)


def test_corpus_pair_is_one_document_per_passage_with_eod(example, tokenizer):
    records = _records(example)
    reader = IndexedDataReader(example.corpus_prefix)
    reader.verify()
    assert reader.num_documents == len(records)
    for index in (0, 100, len(records) - 1):
        expected = tokenizer.encode(records[index]["text"], add_special_tokens=True) + [tokenizer.eod]
        assert reader[index].tolist() == expected


def test_packed_pair_is_the_corpus_stream_cut_into_fixed_records(example):
    corpus = IndexedDataReader(example.corpus_prefix)
    packed = IndexedDataReader(example.packed_prefix)
    packed.verify()
    # Records of SEQ_LEN + 1 tokens: SEQ_LEN inputs and their SEQ_LEN shifted targets.
    lengths = [len(packed[i]) for i in range(len(packed))]
    assert set(lengths) == {SEQ_LEN + 1}
    stream = np.concatenate([corpus[i] for i in range(len(corpus))])
    packed_stream = np.concatenate([packed[i] for i in range(len(packed))])
    assert len(stream) - len(packed_stream) < SEQ_LEN + 1  # only the tail is dropped
    np.testing.assert_array_equal(packed_stream, stream[: len(packed_stream)])


def test_blend_prefixes_hold_only_their_books_passages(example):
    corpus, records = IndexedDataReader(example.corpus_prefix), _records(example)
    for prefix, book in zip(example.blend_prefixes, ("Pride & Prejudice", "Emma"), strict=True):
        reader = IndexedDataReader(prefix)
        reader.verify()
        indices = [i for i, record in enumerate(records) if record["book"] == book]
        assert reader.num_documents == len(indices) > 20
        for position, index in enumerate(indices):
            np.testing.assert_array_equal(reader[position], corpus[index])


def test_a_second_call_rewrites_the_same_bytes_whatever_the_workers(example, tmp_path):
    first = _files(example.train_jsonl.parent)
    again = prepare_example_data(tmp_path, workers=2)
    assert _files(tmp_path) == first
    assert again.packed_prefix == tmp_path / "train_text_document"


def test_conversations_go_through_the_bundled_chatml_template_with_a_supervised_answer(example, tokenizer):
    conversations = [json.loads(line) for line in example.conversations_jsonl.read_text(encoding="utf-8").splitlines()]
    assert 200 <= len(conversations) <= 1000
    roles = [[message["role"] for message in conversation["messages"]] for conversation in conversations]
    assert any(r[0] == "system" for r in roles) and any(r.count("assistant") > 1 for r in roles)
    assert all(set(r) <= {"system", "user", "assistant"} and r[-1] == "assistant" for r in roles)

    bundled = TextConversationTransform(tokenizer, text_keys="messages", max_seq_len=SEQ_LEN)
    chatml = TextConversationTransform(tokenizer, text_keys="messages", max_seq_len=SEQ_LEN, chat_template="chatml")
    for conversation in conversations:
        (sample,) = bundled(conversation)
        np.testing.assert_array_equal(sample["input_ids"], chatml(conversation)[0]["input_ids"])
        assert len(sample["input_ids"]) < SEQ_LEN
        targets = sample["labels"][sample["labels"] != IGNORE_INDEX]
        # ChatML supervises each answer and its end of turn, never the prompt or the role header.
        answers = [m["content"] for m in conversation["messages"] if m["role"] == "assistant"]
        assert tokenizer.decode(targets) == "".join(f"{answer}<|im_end|>\n" for answer in answers)
    first = conversations[0]["messages"]
    assert first[1]["content"] == "How does Sense & Sensibility, chapter 1 begin?"
    assert first[2]["content"].startswith("The family of Dashwood had long been settled in Sussex.")


def test_instructions_quote_openings_or_name_the_chapter_of_a_quoted_sentence(example, chapters, tokenizer):
    records = [json.loads(line) for line in example.instructions_jsonl.read_text(encoding="utf-8").splitlines()]
    assert len(records) == len(chapters) + len(chapters) // 2  # one per chapter, a second for every odd one
    assert all(set(record) == {"instruction", "input", "output"} for record in records)
    assert records[0] == {
        "instruction": "Quote the opening of Sense & Sensibility, chapter 1.",
        "input": "",
        "output": records[0]["output"],
    }
    assert records[0]["output"].startswith("The family of Dashwood had long been settled in Sussex.")
    named = [record for record in records if record["input"]]
    assert len(named) == len(chapters) // 2
    assert named[0]["output"] == f"{chapters[1]['book']}, chapter {chapters[1]['chapter']}."
    transform = InstructionTransform(tokenizer, max_seq_len=SEQ_LEN)  # the bundled tokenizer's ChatML template
    for record in records:
        (sample,) = transform(record)
        assert len(sample["input_ids"]) < SEQ_LEN
        targets = sample["labels"][sample["labels"] != IGNORE_INDEX]
        assert tokenizer.decode(targets) == f"{record['output']}<|im_end|>\n"


def test_workers_must_be_a_positive_integer(tmp_path):
    with pytest.raises(DataConfigError, match="workers must be an integer >= 1, got 0"):
        prepare_example_data(tmp_path, workers=0)
    assert not list(tmp_path.iterdir())
