"""The example data set: the bundled Jane Austen chapters prepared for every path the example configs read.

``prepare_example_data(output_dir)`` writes, from the bundled corpus and tokenizer and with no network::

    <output_dir>/train.jsonl                        every passage, {"text", "book", "chapter"}   (Online path)
    <output_dir>/conversations.jsonl                synthetic conversations {"messages": [{"role", "content"}, ...]}
    <output_dir>/instructions.jsonl                 synthetic instruction records {"instruction", "input", "output"}
    <output_dir>/corpus_text_document.{bin,idx}     every passage, one document each, EOD appended
    <output_dir>/conversations_messages_document.{bin,idx}            conversations.jsonl through the bundled
    <output_dir>/conversations_messages_document_loss_mask.{bin,idx}  ChatML template: tokens and loss mask
    <output_dir>/instructions_text_document.{bin,idx}            instructions.jsonl through the same template,
    <output_dir>/instructions_text_document_loss_mask.{bin,idx}  packed with its loss mask into records of 1024 + 1
    <output_dir>/train_text_document.{bin,idx}      train.jsonl packed into records of 4096 + 1 tokens
    <output_dir>/books/pride_and_prejudice_text_document.{bin,idx}   one book each: the prefixes of a blend
    <output_dir>/books/emma_text_document.{bin,idx}

A passage is a whole chapter when its text fits ``EXAMPLE_MAX_SEQ_LEN`` (4096) tokens, the ``max_seq_len`` of the
example configs; a longer chapter is cut between paragraphs into the fewest passages that fit, of near-equal
size, so that its passages joined by a blank line are its text. Every record is then one sample of the Online
configs, which ``FixedBatchDataLoader`` (one sample per record) needs as much as the token-budget loader does.

The conversations are derived from the chapters: a user asks how a chapter begins and the assistant quotes its
opening (some with a system message, some with a follow-up turn), or a user quotes an opening sentence and the
assistant names the book and chapter. Every one has a supervised assistant turn and fits a 4096-token window
under the bundled tokenizer's ChatML template. The instruction records ask the same two questions in the Alpaca
form: the quoted sentence, when there is one, is the ``input``.

Every file is written under a temporary name and renamed when complete, and a second call rewrites the same
bytes, so ``hp-data quickstart`` and the example configs under ``examples/`` can rely on the paths.

Owns: the example file names, the synthetic conversations and instructions, and the order in which outputs are prepared.
Not responsible for: tokenizing and writing the ``.bin``/``.idx`` pairs (``tools.offline_preparation``), what the
quickstart prints (``tools.quickstart``).
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hyper_parallel.data.errors import require_int
from hyper_parallel.data.file_writes import write_atomically
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer
from hyper_parallel.data.text.records import RecordChunk
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
from hyper_parallel.data.tools.offline_preparation import RecordSource, run_offline_preparation

__all__ = [
    "BLEND_BOOKS",
    "BUNDLED_CORPUS_PATH",
    "EXAMPLE_MAX_SEQ_LEN",
    "EXAMPLE_PACK_TO_SEQ_LEN",
    "EXAMPLE_SFT_PACK_TO_SEQ_LEN",
    "ExampleData",
    "book_prefix_name",
    "example_conversations",
    "example_instructions",
    "example_passages",
    "prepare_example_data",
    "read_bundled_chapters",
]

BUNDLED_CORPUS_PATH = BUNDLED_TOKENIZER_PATH.parent / "corpus" / "austen_chapters.jsonl.gz"
# The books prepared as separate prefixes, in the order of ``ExampleData.blend_prefixes``.
BLEND_BOOKS = ("Pride & Prejudice", "Emma")
EXAMPLE_PACK_TO_SEQ_LEN = 4096
# The instruction records are packed, with their loss mask, into records of this many tokens + 1.
EXAMPLE_SFT_PACK_TO_SEQ_LEN = 1024
# The max_seq_len of the Online example configs (and seq_length of the Indexed ones): every passage fits it.
EXAMPLE_MAX_SEQ_LEN = 4096
_PARAGRAPH_BREAK = "\n\n"

_SYSTEM_PROMPT = "You are a literary assistant. Quote Jane Austen's novels exactly as written."
# An answer quotes whole paragraphs up to about this many characters: far below 4096 tokens with the prompt.
_PASSAGE_CHARACTERS = 1200
# Very short paragraphs (a letter's date line) are joined to the next ones up to at least this many characters.
_MIN_PASSAGE_CHARACTERS = 200
_MAX_QUOTED_SENTENCE = 300
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class ExampleData:
    """Where ``prepare_example_data`` wrote each example file.

    Attributes:
        train_jsonl: every passage as ``{"text", "book", "chapter"}``, one JSON line each (Online configs).
        conversations_jsonl: the synthetic conversations, ``{"messages": [...]}`` per line (SFT configs).
        instructions_jsonl: the synthetic instruction records, ``{"instruction", "input", "output"}`` per line (the
            instruction SFT config).
        corpus_prefix: ``.bin``/``.idx`` prefix with one document per passage, EOD appended (Indexed configs).
        conversations_prefix: ``.bin``/``.idx`` prefix of the conversations rendered by the bundled tokenizer's chat
            template, one document each, EOD appended, with its loss-mask pair ``<prefix>_loss_mask`` (the Indexed
            SFT config).
        instructions_prefix: ``.bin``/``.idx`` prefix of the instruction records rendered by the bundled
            tokenizer's chat template, EOD appended, packed with its loss-mask pair into records of
            ``EXAMPLE_SFT_PACK_TO_SEQ_LEN + 1`` tokens (the packed Indexed SFT config).
        packed_prefix: ``.bin``/``.idx`` prefix of ``train_jsonl`` packed into records of
            ``EXAMPLE_PACK_TO_SEQ_LEN + 1`` tokens (``is_dataset_from_mr`` configs).
        blend_prefixes: one ``.bin``/``.idx`` prefix per book of ``BLEND_BOOKS``, in that order (blend configs).
    """

    train_jsonl: Path
    conversations_jsonl: Path
    instructions_jsonl: Path
    corpus_prefix: Path
    conversations_prefix: Path
    instructions_prefix: Path
    packed_prefix: Path
    blend_prefixes: tuple[Path, ...]


def book_prefix_name(book: str) -> str:
    """The file name stem of a book's prefix: ``"Pride & Prejudice"`` -> ``"pride_and_prejudice"``."""
    return re.sub(r"[^a-z0-9]+", "_", book.lower().replace("&", "and")).strip("_")


def read_bundled_chapters() -> list[dict]:
    """The bundled corpus: one dict per chapter with ``text``, ``title``, ``book`` and ``chapter``, in file order."""
    with gzip.open(BUNDLED_CORPUS_PATH, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def _near_equal_parts(paragraphs: Sequence[str], sizes: Sequence[int], parts: int) -> list[str]:
    """The paragraphs in ``parts`` consecutive groups, each cut at the paragraph end nearest its share of the
    total size; fewer groups when two shares end at the same paragraph."""
    ends = np.cumsum(sizes)
    targets = ends[-1] * np.arange(1, parts) / parts
    cuts = np.unique(np.abs(ends[None, :-1] - targets[:, None]).argmin(axis=1) + 1)  # after paragraph 0 to n - 2
    bounds = [0, *cuts.tolist(), len(paragraphs)]
    return [_PARAGRAPH_BREAK.join(paragraphs[start:end]) for start, end in itertools.pairwise(bounds)]


def example_passages(texts: Sequence[str], tokenizer, limit: int = EXAMPLE_MAX_SEQ_LEN) -> list[list[str]]:
    """Each text whole when it has at most ``limit`` tokens, else cut between paragraphs (at blank lines) into the
    fewest parts of at most ``limit`` tokens each, of near-equal size; a text's parts joined by a blank line are
    the text.

    Args:
        texts: the chapters.
        tokenizer: the tokenizer of the configs (a ``TextTokenizer``); tokens are counted without special tokens.
        limit: tokens a part may hold.

    Raises:
        ValueError: a single paragraph longer than ``limit`` (no cut at a blank line can make it fit).
    """
    backend = tokenizer.backend
    passages = []
    for text, encoding in zip(texts, backend.encode_batch(list(texts), add_special_tokens=False), strict=True):
        if len(encoding.ids) <= limit:
            passages.append([text])
            continue
        paragraphs = text.split(_PARAGRAPH_BREAK)
        # Each paragraph's tokens in the whole text, read off the token offsets (checked exactly below).
        starts = np.cumsum([0] + [len(paragraph) + len(_PARAGRAPH_BREAK) for paragraph in paragraphs[:-1]])
        first_tokens = np.searchsorted([start for start, _ in encoding.offsets], starts)
        sizes = np.diff(np.append(first_tokens, len(encoding.ids)))
        for parts in range(max(2, -(-len(encoding.ids) // limit)), len(paragraphs) + 1):
            candidate = _near_equal_parts(paragraphs, sizes, parts)
            if all(len(e.ids) <= limit for e in backend.encode_batch(candidate, add_special_tokens=False)):
                passages.append(candidate)
                break
        else:
            raise ValueError(f"a paragraph of {sizes.max()} tokens is longer than {limit} tokens; it cannot be cut")
    return passages


def _excerpt(paragraph: str, limit: int) -> str:
    """The paragraph cut after its last sentence that ends within ``limit`` characters (or at a word)."""
    if len(paragraph) <= limit:
        return paragraph
    cut = max((match.start() for match in _SENTENCE_END.finditer(paragraph, 0, limit)), default=0)
    if cut == 0:
        cut = paragraph.rfind(" ", 0, limit)
        return paragraph[: cut if cut > 0 else limit] + " [...]"
    return paragraph[:cut]


def _passages(text: str) -> list[str]:
    """The chapter's opening passages: paragraphs joined until long enough, each cut to ``_PASSAGE_CHARACTERS``."""
    passages: list[str] = []
    pending: list[str] = []
    for paragraph in (part.strip() for part in text.split("\n\n")):
        if not paragraph:
            continue
        pending.append(paragraph)
        joined = "\n\n".join(pending)
        if len(joined) >= _MIN_PASSAGE_CHARACTERS:
            passages.append(_excerpt(joined, _PASSAGE_CHARACTERS))
            pending = []
    if pending:
        passages.append(_excerpt("\n\n".join(pending), _PASSAGE_CHARACTERS))
    return passages


def example_conversations(chapters: Sequence[Mapping]) -> list[dict]:
    """Synthetic conversations derived from the chapters, deterministically.

    For chapter ``i`` (0-based): a user asks how the chapter begins and the assistant quotes its opening passage;
    every third such conversation starts with a system message, and every fourth (``i % 4 == 1``) continues with
    a follow-up question answered by the next passage. For every even ``i`` a second conversation quotes the
    chapter's first sentence and the assistant names the book and chapter.

    Args:
        chapters: records with ``text``, ``book`` and ``chapter`` (as ``read_bundled_chapters`` returns).

    Returns:
        ``{"messages": [{"role": ..., "content": ...}, ...]}`` dicts.
    """
    conversations = []
    for index, chapter in enumerate(chapters):
        book, number = chapter["book"], chapter["chapter"]
        passages = _passages(chapter["text"])
        messages = [{"role": "system", "content": _SYSTEM_PROMPT}] if index % 3 == 0 else []
        messages += [
            {"role": "user", "content": f"How does {book}, chapter {number} begin?"},
            {"role": "assistant", "content": passages[0]},
        ]
        if index % 4 == 1 and len(passages) > 1:
            messages += [
                {"role": "user", "content": "And what comes next?"},
                {"role": "assistant", "content": passages[1]},
            ]
        conversations.append({"messages": messages})
        if index % 2 == 0:
            sentence = _opening_sentence(passages[0])
            question = f'Which novel and chapter begin with these words?\n\n"{sentence}"'
            conversations.append(
                {
                    "messages": [
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": f"{book}, chapter {number}."},
                    ]
                }
            )
    return conversations


def _opening_sentence(passage: str) -> str:
    return _excerpt(_SENTENCE_END.split(passage, maxsplit=1)[0], _MAX_QUOTED_SENTENCE)


def example_instructions(chapters: Sequence[Mapping]) -> list[dict]:
    """Synthetic instruction records derived from the chapters, deterministically.

    For chapter ``i`` (0-based): an instruction to quote the chapter's opening passage (no input); for every odd
    ``i`` also an instruction to name the novel and chapter of a quoted opening sentence, given as the input.

    Args:
        chapters: records with ``text``, ``book`` and ``chapter`` (as ``read_bundled_chapters`` returns).

    Returns:
        ``{"instruction", "input", "output"}`` dicts (``input`` is ``""`` when there is none).
    """
    records = []
    for index, chapter in enumerate(chapters):
        book, number = chapter["book"], chapter["chapter"]
        opening = _passages(chapter["text"])[0]
        records.append(
            {"instruction": f"Quote the opening of {book}, chapter {number}.", "input": "", "output": opening}
        )
        if index % 2 == 1:
            records.append(
                {
                    "instruction": "Name the novel and chapter that begin with these words.",
                    "input": _opening_sentence(opening),
                    "output": f"{book}, chapter {number}.",
                }
            )
    return records


def _write_jsonl(path: Path, records: Iterable[Mapping]) -> None:
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    write_atomically(path, text.encode("utf-8"))


def _prepare(
    input_path: Path,
    output_prefix: Path,
    workers: int,
    pack_to_seq_len: int | None = None,
    source=None,
    key: str = "text",
    chat_template: str | None = None,
    instruction_key: str | None = None,
):
    config = OfflinePreparationConfig(
        dataset_name_or_path=str(input_path),
        output_prefix=str(output_prefix),
        tokenizer_name_or_path=str(BUNDLED_TOKENIZER_PATH),
        json_keys=(key,),
        append_eod=True,
        pack_to_seq_len=pack_to_seq_len,
        chat_template=chat_template,
        instruction_key=instruction_key,
        workers=workers,
        overwrite=True,  # the example folder is rewritten by every call, with the same bytes
    )
    run_offline_preparation(config, source)
    return Path(config.output_prefix_for(key))


def _book_source(train_jsonl: Path, records: Sequence[Mapping], book: str) -> RecordSource:
    """The records of one book, read from memory but named by their lines of ``train_jsonl`` in messages."""
    lines = [number for number, record in enumerate(records, start=1) if record["book"] == book]
    chunk = RecordChunk(
        source=str(train_jsonl),
        kind="records",
        items=[records[number - 1] for number in lines],
        locations=lines,
        location_unit="line",
        bytes_read=0,
    )
    return RecordSource(chunks=[chunk], total_records=len(lines))


def prepare_example_data(output_dir: str | os.PathLike, *, workers: int = 1) -> ExampleData:
    """Write the example files (see the module docstring) into ``output_dir``; a second call rewrites the same bytes.

    Takes a few seconds on one core. Existing example files in ``output_dir`` are replaced; nothing else there is
    touched.

    Args:
        output_dir: the folder to write into (created if missing). Paths in the result start with it as given, so
            a relative folder gives relative paths, as the example configs use.
        workers: tokenizer processes of the offline preparation.

    Returns:
        The paths of the files written.

    Raises:
        DataFileError: a file cannot be written (the message names it and the fix).
        DataConfigError: ``workers`` is not an integer of at least 1.

    Example::

        data = prepare_example_data("quickstart_output")
        IndexedDataReader(data.corpus_prefix).num_documents  # one per passage
    """
    workers = require_int("workers", workers, 1)
    output_dir = Path(output_dir)
    (output_dir / "books").mkdir(parents=True, exist_ok=True)
    chapters = read_bundled_chapters()
    passages = example_passages([chapter["text"] for chapter in chapters], build_tokenizer(BUNDLED_TOKENIZER_PATH))
    train_records = [
        {"text": passage, "book": chapter["book"], "chapter": chapter["chapter"]}
        for chapter, parts in zip(chapters, passages, strict=True)
        for passage in parts
    ]

    train_jsonl = output_dir / "train.jsonl"
    _write_jsonl(train_jsonl, train_records)
    conversations_jsonl = output_dir / "conversations.jsonl"
    _write_jsonl(conversations_jsonl, example_conversations(chapters))
    instructions_jsonl = output_dir / "instructions.jsonl"
    _write_jsonl(instructions_jsonl, example_instructions(chapters))

    corpus_prefix = _prepare(train_jsonl, output_dir / "corpus", workers)
    conversations_prefix = _prepare(
        conversations_jsonl, output_dir / "conversations", workers, key="messages", chat_template="tokenizer"
    )
    instructions_prefix = _prepare(
        instructions_jsonl,
        output_dir / "instructions",
        workers,
        pack_to_seq_len=EXAMPLE_SFT_PACK_TO_SEQ_LEN,
        chat_template="tokenizer",
        instruction_key="instruction",
    )
    packed_prefix = _prepare(train_jsonl, output_dir / "train", workers, pack_to_seq_len=EXAMPLE_PACK_TO_SEQ_LEN)
    blend_prefixes = tuple(
        _prepare(
            train_jsonl,
            output_dir / "books" / book_prefix_name(book),
            workers,
            source=_book_source(train_jsonl, train_records, book),
        )
        for book in BLEND_BOOKS
    )
    return ExampleData(
        train_jsonl=train_jsonl,
        conversations_jsonl=conversations_jsonl,
        instructions_jsonl=instructions_jsonl,
        corpus_prefix=corpus_prefix,
        conversations_prefix=conversations_prefix,
        instructions_prefix=instructions_prefix,
        packed_prefix=packed_prefix,
        blend_prefixes=blend_prefixes,
    )
