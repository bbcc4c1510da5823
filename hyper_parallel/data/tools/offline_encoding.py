"""Raw records to token arrays: the work that offline preparation runs in its worker processes.

Owns: decoding and parsing one chunk of raw records, picking or rendering the text of each json key,
batch-tokenizing it (a very long text in pieces, with the ids of the whole), appending EOD and reporting empty
and malformed records with their location; for conversations and instruction records, their tokens and loss mask
through the Online conversation or instruction transform's encoding.
Not responsible for: reading files (``text.records``), partitions, packing or writing.
Kept free of heavy imports so that worker processes start quickly.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.indexed.pair_metadata import LOSS_MASK_SUFFIX
from hyper_parallel.data.text.records import RecordChunk
from hyper_parallel.data.text.text_template import TextTemplate

__all__ = [
    "EncodedChunk",
    "EncodedDocuments",
    "EncodingSettings",
    "encode_chunk",
    "encode_conversations",
    "encode_texts",
]

_FIX = "fix the record, or pass --skip-bad-records to count and skip such records"

# A tokenizer holds about 170 bytes per character of a text while encoding it (offsets, alignments, token
# strings), so a text longer than this is encoded in pieces of about this many characters, one at a time.
PIECE_CHARS = 1 << 17
# Characters each side of a cut that are encoded to check that the cut leaves the token ids unchanged.
_CUT_CONTEXT = 256
# Cuts tried per piece before the rest of the text is encoded whole, for a text where cuts keep changing the
# ids (e.g. around added tokens that strip the spaces beside them).
_CUT_TRIES = 32
# A whitespace character after a non-whitespace one: where pre-tokenizers start a new word.
_CUT_CANDIDATE = re.compile(r"(?<=\S)\s")


@dataclass(frozen=True)
class EncodingSettings:
    """What a worker needs besides the tokenizer.

    ``conversation``: a ``TextConversationTransform`` or ``InstructionTransform`` (picklable, with its own
    tokenizer and chat template) whose ``encode`` gives each record's tokens and unshifted labels; None for text.
    """

    json_keys: tuple[str, ...]
    text_template: TextTemplate | None
    append_eod: bool
    eod_id: int | None
    add_special_tokens: bool
    token_dtype: str
    conversation: object | None = None


@dataclass
class EncodedDocuments:
    """The non-empty documents of one key in one chunk, in record order.

    ``tokens`` concatenates every sequence; document ``d`` has ``sequences_per_document[d]`` sequences,
    ``sequence_lengths`` lists them all, and ``record_positions[d]`` is the record's position in the chunk.
    """

    tokens: np.ndarray
    sequence_lengths: np.ndarray
    sequences_per_document: np.ndarray
    record_positions: np.ndarray

    def select(self, mask: np.ndarray) -> EncodedDocuments:
        """The documents where ``mask`` (one bool per document) is true."""
        sequence_documents = np.repeat(np.arange(len(mask)), self.sequences_per_document)
        sequence_mask = mask[sequence_documents]
        token_mask = np.repeat(sequence_mask, self.sequence_lengths)
        return EncodedDocuments(
            tokens=self.tokens[token_mask],
            sequence_lengths=self.sequence_lengths[sequence_mask],
            sequences_per_document=self.sequences_per_document[mask],
            record_positions=self.record_positions[mask],
        )


@dataclass
class EncodedChunk:
    """Everything a worker returns for one chunk."""

    documents: dict[str, EncodedDocuments]
    records: int
    empty_documents: int = 0
    bad_records: list[str] = field(default_factory=list)


class _BadRecord(Exception):
    pass


def _parse(chunk: RecordChunk, position: int) -> dict:
    item = chunk.items[position]
    if chunk.kind == "records":
        return item
    try:
        line = item.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _BadRecord(
            f"byte {error.start} is not valid UTF-8 ({item[error.start : error.start + 4]!r}); "
            "re-encode the file as UTF-8"
        ) from None
    if chunk.kind == "text_lines":
        return {"text": line.rstrip("\r\n")}
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise _BadRecord(f"invalid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise _BadRecord(f"expected a JSON object, got {type(record).__name__}")
    return record


def _check_unicode(text: str, field: str) -> None:
    """Refuse a lone surrogate (e.g. the JSON escape ``"\\ud800"`` without its pair): no tokenizer can encode it."""
    if text.isascii():  # O(1) in CPython
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise _BadRecord(
            f"{field} holds a lone surrogate {text[error.start]!r} at character {error.start}: half of a UTF-16 pair "
            "(often a JSON escape such as \\ud800 without its partner), which is not valid Unicode"
        ) from None


def _texts(record: dict, settings: EncodingSettings) -> list[list[str]]:
    """One list of strings (sentences) per json key."""
    template = settings.text_template
    if template is not None:
        try:
            text = template.render(record)
        except DataFileError as error:
            raise _BadRecord(str(error)) from None
        _check_unicode(text, f"the text rendered by {template.name}")
        return [[text]]
    texts = []
    for key in settings.json_keys:
        if key not in record:
            raise _BadRecord(f"missing key '{key}'; the record has keys {sorted(record)}. Check --json-keys")
        value = record[key]
        if value is None:
            texts.append([])
        elif isinstance(value, str):
            _check_unicode(value, f"key '{key}'")
            texts.append([value])
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            for item, text in enumerate(value):
                _check_unicode(text, f"key '{key}' item {item}")
            texts.append(value)
        else:
            raise _BadRecord(f"key '{key}' holds {type(value).__name__}, expected a string or a list of strings")
    return texts


# -- encoding, long texts in pieces ------------------------------------------------------------------------------


def _cut_keeps_ids(tokenizer, text: str, cut: int) -> bool:
    """Whether the text around ``cut`` encodes to the ids of its two sides encoded apart."""
    left = text[max(0, cut - _CUT_CONTEXT) : cut]
    right = text[cut : cut + _CUT_CONTEXT]
    both, left_ids, right_ids = tokenizer.encode_batch_fast([left + right, left, right], add_special_tokens=False)
    return both.ids == left_ids.ids + right_ids.ids


def _next_cut(tokenizer, text: str, start: int) -> int | None:
    """The first whitespace at or after ``start`` where cutting leaves the ids unchanged, or None."""
    for tries, match in enumerate(_CUT_CANDIDATE.finditer(text, start)):
        if tries == _CUT_TRIES:
            return None
        if _cut_keeps_ids(tokenizer, text, match.start()):
            return match.start()
    return None


def _piece_bounds(tokenizer, text: str, piece_chars: int) -> list[int]:
    """Where to cut ``text`` into pieces of about ``piece_chars`` characters; ``[0, len(text)]`` for one piece."""
    bounds = [0]
    while len(text) - bounds[-1] > piece_chars:
        cut = _next_cut(tokenizer, text, bounds[-1] + piece_chars)
        if cut is None:
            break
        bounds.append(cut)
    bounds.append(len(text))
    return bounds


def _encode_in_pieces(tokenizer, text: str, add_special_tokens: bool, dtype: np.dtype, piece_chars: int):
    """The ids of ``text`` encoded whole, computed piece by piece; the Encoding itself when it takes one piece.

    Special tokens that the tokenizer adds around a text (e.g. a BOS) come from the first piece: those before its
    first token of text (sequence id None) start the result, those after its last end it.
    """
    bounds = _piece_bounds(tokenizer, text, piece_chars)
    if len(bounds) == 2:
        return tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
    first = tokenizer.encode_batch_fast([text[: bounds[1]]], add_special_tokens=add_special_tokens)[0]
    in_text = np.flatnonzero([sequence is not None for sequence in first.sequence_ids])
    if not in_text.size:  # no token of text to place the added ones around
        return tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
    ids = np.asarray(first.ids, dtype)
    parts = [ids[: in_text[-1] + 1]]
    for begin, end in zip(bounds[1:-1], bounds[2:], strict=True):
        parts.append(np.asarray(tokenizer.encode_batch_fast([text[begin:end]], add_special_tokens=False)[0].ids, dtype))
    parts.append(ids[in_text[-1] + 1 :])
    return np.concatenate(parts)


def encode_texts(
    tokenizer, texts: list[str], add_special_tokens: bool, dtype: np.dtype, piece_chars: int = PIECE_CHARS
) -> list:
    """Encode ``texts`` with a ``tokenizers.Tokenizer``: one ``Encoding`` per text, or an id array for a long one.

    Texts of more than ``piece_chars`` characters are encoded in pieces cut at whitespace, so that memory
    follows the piece, not the text. A cut is taken only where encoding a window around it whole and in two
    parts gives the same ids, so the ids equal those of the text encoded whole; a text with no such cut (or a
    tokenizer that truncates or pads) is encoded whole.
    """
    long = [i for i, text in enumerate(texts) if len(text) > piece_chars]
    if not long or tokenizer.truncation is not None or tokenizer.padding is not None:
        return tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
    encodings: list = [None] * len(texts)
    short = [i for i, text in enumerate(texts) if len(text) <= piece_chars]
    short_encodings = tokenizer.encode_batch_fast([texts[i] for i in short], add_special_tokens=add_special_tokens)
    for i, encoding in zip(short, short_encodings, strict=True):
        encodings[i] = encoding
    for i in long:
        encodings[i] = _encode_in_pieces(tokenizer, texts[i], add_special_tokens, dtype, piece_chars)
    return encodings


def _assemble(
    encodings: list, lengths: np.ndarray, string_documents: np.ndarray, kept: np.ndarray, settings: EncodingSettings
) -> EncodedDocuments:
    """Concatenate one key's encodings of the kept documents, drop empty sentences, append EOD. Vectorised.

    Example: strings ``["ab", "", "c"]`` of documents ``[0, 0, 1]`` (both kept) with EOD ``9`` give tokens
    ``a b 9 c 9``, sequence lengths ``[3, 2]`` and one sequence per document.
    """
    dtype = np.dtype(settings.token_dtype)
    if any(isinstance(e, np.ndarray) for e in encodings):  # a long text, already ids
        flat = np.concatenate([e if isinstance(e, np.ndarray) else np.asarray(e.ids, dtype) for e in encodings])
    else:
        flat = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype, int(lengths.sum()))
    string_kept = (lengths > 0) & kept[string_documents]
    if not string_kept.all():
        flat = flat[np.repeat(string_kept, lengths)]
    sequence_lengths = lengths[string_kept]
    # Every kept document has at least one non-empty sequence of this key.
    sequences_per_document = np.bincount(string_documents[string_kept], minlength=len(kept))[kept]
    if settings.append_eod and len(sequence_lengths):
        last_sequence = np.cumsum(sequences_per_document) - 1
        ends = np.cumsum(sequence_lengths)[last_sequence]
        flat = np.insert(flat, ends, np.asarray(settings.eod_id, dtype=dtype))
        sequence_lengths = sequence_lengths.copy()
        sequence_lengths[last_sequence] += 1
    return EncodedDocuments(
        tokens=flat,
        sequence_lengths=sequence_lengths,
        sequences_per_document=sequences_per_document.astype(np.int64),
        record_positions=np.empty(0, np.int64),  # filled by the caller, shared by every key
    )


def _documents(pieces: list[np.ndarray], positions: list[int], dtype: np.dtype) -> EncodedDocuments:
    """One document of one sequence per piece."""
    lengths = np.fromiter(map(len, pieces), np.int64, len(pieces))
    return EncodedDocuments(
        tokens=np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.empty(0, dtype),
        sequence_lengths=lengths,
        sequences_per_document=np.ones(len(pieces), np.int64),
        record_positions=np.asarray(positions, np.int64),
    )


def encode_conversations(chunk: RecordChunk, settings: EncodingSettings, skip_bad_records: bool) -> EncodedChunk:
    """Each record's conversation as one document of tokens, and its loss mask (1 where the token is a supervised
    target: its unshifted label is not ``IGNORE_INDEX``) as the same document of the key's mask pair."""
    (key,) = settings.json_keys
    transform = settings.conversation
    tokens: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    positions: list[int] = []
    bad: list[str] = []
    for position in range(len(chunk.items)):
        try:
            ids, labels = transform.encode(_parse(chunk, position), chunk.where(position), skip_fix=None)
        except _BadRecord as error:
            bad.append(f"{chunk.where(position)}: {error}; {_FIX}")
        except DataFileError as error:  # already names the record
            bad.append(f"{error}; {_FIX}")
        else:
            mask = (labels != IGNORE_INDEX).astype(np.uint8)
            if settings.append_eod:  # the EOD only separates documents: never a target
                ids, mask = np.append(ids, settings.eod_id), np.append(mask, np.uint8(0))
            tokens.append(ids)
            masks.append(mask)
            positions.append(position)
            continue
        if not skip_bad_records:
            break
    return EncodedChunk(
        documents={
            key: _documents(tokens, positions, np.dtype(settings.token_dtype)),
            f"{key}{LOSS_MASK_SUFFIX}": _documents(masks, positions, np.dtype(np.uint8)),
        },
        records=len(chunk.items),
        bad_records=bad,
    )


def encode_chunk(chunk: RecordChunk, tokenizer, settings: EncodingSettings, skip_bad_records: bool) -> EncodedChunk:
    """Tokenize every key of every record in ``chunk`` with a ``tokenizers.Tokenizer``.

    Malformed records are reported as ``file:line N: reason`` strings; the caller decides whether one stops
    the run. A record that is malformed, or empty in any key, is dropped from every key's output, so the
    outputs of several keys stay aligned document for document.
    """
    per_key_strings: list[list[str]] = [[] for _ in settings.json_keys]
    per_key_documents: list[list[int]] = [[] for _ in settings.json_keys]
    positions: list[int] = []
    bad: list[str] = []
    for position in range(len(chunk.items)):
        try:
            texts = _texts(_parse(chunk, position), settings)
        except _BadRecord as error:
            bad.append(f"{chunk.where(position)}: {error}; {_FIX}")
            if not skip_bad_records:
                break
            continue
        document = len(positions)
        positions.append(position)
        for strings, documents, sentences in zip(per_key_strings, per_key_documents, texts, strict=True):
            # Empty strings are dropped before tokenizing, so a BOS-adding tokenizer cannot make them non-empty.
            sentences = [s for s in sentences if s]
            strings.extend(sentences)
            documents.extend([document] * len(sentences))

    encodings = encode_texts(
        tokenizer,
        list(chain.from_iterable(per_key_strings)),
        settings.add_special_tokens,
        np.dtype(settings.token_dtype),
    )
    lengths = np.fromiter((len(e) for e in encodings), np.int64, len(encodings))
    bounds = np.cumsum([0] + [len(strings) for strings in per_key_strings])
    string_documents = [np.asarray(documents, np.int64) for documents in per_key_documents]
    kept = np.ones(len(positions), bool)
    for key_index, documents in enumerate(string_documents):
        key_lengths = lengths[bounds[key_index] : bounds[key_index + 1]]
        kept &= np.bincount(documents, weights=key_lengths, minlength=len(positions)) > 0
    record_positions = np.asarray(positions, np.int64)[kept]
    result = EncodedChunk(documents={}, records=len(chunk.items), empty_documents=int((~kept).sum()), bad_records=bad)
    for key_index, key in enumerate(settings.json_keys):
        begin, end = bounds[key_index], bounds[key_index + 1]
        encoded = _assemble(encodings[begin:end], lengths[begin:end], string_documents[key_index], kept, settings)
        encoded.record_positions = record_positions
        result.documents[key] = encoded
    return result


# -- worker-process entry points ---------------------------------------------------------------------------------

_worker_state: dict = {}


def init_worker(tokenizer_json: str, settings: EncodingSettings, skip_bad_records: bool) -> None:
    """Process-pool initializer: one single-threaded tokenizer per process (processes give the parallelism)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _worker_state.update(tokenizer=Tokenizer.from_str(tokenizer_json), settings=settings, skip=skip_bad_records)


def encode_chunk_in_worker(chunk: RecordChunk) -> EncodedChunk:
    settings = _worker_state["settings"]
    if settings.conversation is not None:
        return encode_conversations(chunk, settings, _worker_state["skip"])
    return encode_chunk(chunk, _worker_state["tokenizer"], settings, _worker_state["skip"])
