"""Raw records to token arrays: the work that offline preparation runs in its worker processes.

Owns: decoding and parsing one chunk of raw records, picking or rendering the text of each json key,
batch-tokenizing it, appending EOD and reporting empty and malformed records with their location.
Not responsible for: reading files (``text.online.online_utils``), partitions, packing or writing.
Kept free of heavy imports so that worker processes start quickly.
"""

from __future__ import annotations

import json
import os
import string
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from hyper_parallel.data.text.online.online_utils import RecordChunk

__all__ = ["EncodedChunk", "EncodedDocuments", "EncodingSettings", "encode_chunk", "template_fields"]

_FIX = "fix the record, or pass --skip-bad-records to count and skip such records"


@dataclass(frozen=True)
class EncodingSettings:
    """What a worker needs besides the tokenizer."""

    json_keys: tuple[str, ...]
    text_template: str | None
    append_eod: bool
    eod_id: int | None
    add_special_tokens: bool
    token_dtype: str


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


def template_fields(template: str) -> list[str]:
    """Record fields that a ``str.format`` template reads, e.g. ``["title", "text"]``."""
    return [name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(template) if name]


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


def _texts(record: dict, settings: EncodingSettings) -> list[list[str]]:
    """One list of strings (sentences) per json key."""
    if settings.text_template is not None:
        try:
            return [[settings.text_template.format_map(record)]]
        except (KeyError, IndexError) as error:
            raise _BadRecord(
                f"missing key {error} used by --text-template; the record has keys {sorted(record)}"
            ) from None
    texts = []
    for key in settings.json_keys:
        if key not in record:
            raise _BadRecord(f"missing key '{key}'; the record has keys {sorted(record)}. Check --json-keys")
        value = record[key]
        if value is None:
            texts.append([])
        elif isinstance(value, str):
            texts.append([value])
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            texts.append(value)
        else:
            raise _BadRecord(f"key '{key}' holds {type(value).__name__}, expected a string or a list of strings")
    return texts


def _assemble(
    encodings: list, lengths: np.ndarray, string_documents: np.ndarray, kept: np.ndarray, settings: EncodingSettings
) -> EncodedDocuments:
    """Concatenate one key's encodings of the kept documents, drop empty sentences, append EOD. Vectorised.

    Example: strings ``["ab", "", "c"]`` of documents ``[0, 0, 1]`` (both kept) with EOD ``9`` give tokens
    ``a b 9 c 9``, sequence lengths ``[3, 2]`` and one sequence per document.
    """
    dtype = np.dtype(settings.token_dtype)
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

    encodings = tokenizer.encode_batch_fast(
        list(chain.from_iterable(per_key_strings)), add_special_tokens=settings.add_special_tokens
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
    return encode_chunk(chunk, _worker_state["tokenizer"], _worker_state["settings"], _worker_state["skip"])
