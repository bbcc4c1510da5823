"""Mid-level datasets of the Indexed path: fixed-length samples for causal LM pre-training.

* ``GPTDataset``: variable-length documents packed into samples across document boundaries, through the
  document, sample and shuffle indices of megatron-core (same values, dtypes and order for the same inputs).
* ``GPTFromMRDataset``: records already packed offline to ``seq_length + add_extra_token`` tokens, read as is.
* ``MockGPTDataset``: ``GPTDataset`` over synthetic documents (``MockGPTLowLevelDataset``).

Every sample is ``{"tokens", "labels", "loss_mask"}`` (int64, int64, float32; ``labels[i]`` is the target of
``tokens[i]``), plus ``position_ids`` and ``attention_mask`` with ``create_ltor_fields_in_dataloader``. The loss
mask is always there because it is the only record of padding (pad ids are replaced by 0, as upstream).

A ``GPTDataset`` or ``GPTFromMRDataset`` whose prefix has a loss-mask pair ``<prefix>_loss_mask``
(``read_loss_mask``) reads it over the same token ranges as the tokens: for a sample of tokens ``t[0..S]`` with
mask ``m[0..S]``, ``loss_mask[i]`` is also 0 and ``labels[i]`` is ``IGNORE_INDEX`` where ``m[i + 1]`` (the mask of
the target ``t[i + 1]``) is 0.

Every sample holds token ids only: a dataset over an ``IndexedDataReader`` has it check the ids it reads
(``IndexedDataReader.check_token_ids``: an integer dtype, the ``.meta.json``'s dtype, ids in the tokenizer's
vocabulary).

Owns: assembling samples and their index caches. Not responsible for: splits and blends
(``indexed_split_builder``), reading files or checking token ids (``indexed_data_reader``), batching.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.index_cache import CacheOptions, ExpectedArray, IndexCache, array_property
from hyper_parallel.data.indexed.indexed_data_config import IndexedDataConfig
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.indexed.indexed_helpers import build_gpt_indices, num_epochs, sample_count
from hyper_parallel.data.indexed.ltor_fields import ltor_fields
from hyper_parallel.data.indexed.object_storage import open_reader, pair_exists
from hyper_parallel.data.indexed.pair_metadata import loss_mask_prefix
from hyper_parallel.data.tokenizer_protocol import read_tokenizer

__all__ = [
    "GPTDataset",
    "GPTFromMRDataset",
    "MockGPTDataset",
    "MockGPTLowLevelDataset",
    "open_loss_mask",
    "resolve_special_tokens",
]

logger = get_logger(__name__)

_SENTINEL_PAD = -1  # never a token id, so real tokens are never masked as padding
_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


def resolve_special_tokens(tokenizer, allow_ambiguous_pad_tokens: bool) -> tuple[int, int]:
    """``(eod, pad)`` ids as megatron-core resolves them.

    The pad id is the tokenizer's, or -1 when it has none or when it equals another special token (EOS/EOD, or
    any entry of ``special_tokens_dict``), unless ``allow_ambiguous_pad_tokens``.
    """
    tokens = read_tokenizer(tokenizer)
    eod, pad = tokens.eod, tokens.pad
    if eod is None:
        raise DataConfigError("the tokenizer has no EOD/EOS token id; the Indexed path needs one")
    if pad is None:
        return int(eod), _SENTINEL_PAD
    others = [v for k, v in tokens.special_tokens.items() if k != "pad_token"] or [tokens.eos, eod]
    if pad in others:
        if not allow_ambiguous_pad_tokens:
            warnings.warn(
                f"the tokenizer's pad id {pad} equals another special token; padding uses -1 instead so that real "
                "tokens are never masked (set allow_ambiguous_pad_tokens to keep it)",
                stacklevel=3,
            )
            return int(eod), _SENTINEL_PAD
        warnings.warn(f"the tokenizer's pad id {pad} equals another special token; keeping it", stacklevel=3)
    return int(eod), int(pad)


_PREPARE_AGAIN = "prepare the conversations again with `hp-data prepare --chat-template ...`, which writes both"


def open_loss_mask(tokens: IndexedDataReader, config: IndexedDataConfig) -> IndexedDataReader | None:
    """The loss-mask pair of the token pair ``tokens`` as ``config.read_loss_mask`` asks, checked to hold 0/1
    integers in the same documents of the same lengths; None when it is not read.

    Raises:
        DataFileError: ``required`` and no mask pair, half a pair, or a pair of another dtype or other lengths.
    """
    if config.read_loss_mask == "off":
        return None
    prefix = loss_mask_prefix(tokens.path_prefix)
    if not pair_exists(prefix):
        if config.read_loss_mask == "required":
            raise DataFileError(
                f"{tokens.path_prefix} has no loss-mask pair {prefix}.{{bin,idx}}, but read_loss_mask is "
                f"'required'; {_PREPARE_AGAIN}, or set read_loss_mask: auto to train on every token of such prefixes"
            )
        return None
    mask = open_reader(
        prefix, config.mmap_bin_files, block_bytes=config.object_block_bytes, cache_bytes=config.object_cache_bytes
    )
    if mask.dtype.kind not in "ui":
        raise DataFileError(
            f"{prefix}: a loss mask holds integers 0/1, but its .idx says {mask.dtype}; {_PREPARE_AGAIN}"
        )
    lengths, expected = mask.sequence_lengths, tokens.sequence_lengths
    if len(lengths) != len(expected) or not np.array_equal(lengths, expected):
        if len(lengths) != len(expected):
            differs = f"{len(lengths)} sequences where the tokens have {len(expected)}"
        else:
            first = int(np.argmax(lengths != expected))
            differs = f"sequence {first} of {int(lengths[first])} entries where the tokens have {int(expected[first])}"
        raise DataFileError(
            f"{prefix}: the loss mask does not match the tokens of {tokens.path_prefix}: it has {differs}, so its "
            f"entries would mark the wrong tokens; {_PREPARE_AGAIN}, or remove the mask pair"
        )
    if not np.array_equal(mask.document_indices, tokens.document_indices):
        raise DataFileError(
            f"{prefix}: the loss mask groups its sequences into other documents than the tokens of "
            f"{tokens.path_prefix}; {_PREPARE_AGAIN}"
        )
    return mask


def _checked_mask(pair: IndexedDataReader, entries: np.ndarray) -> np.ndarray:
    """``entries`` read from the loss-mask pair ``pair``, refused unless they are 0/1."""
    if entries.size and entries.max() > 1:
        raise DataFileError(
            f"{pair.path_prefix}: a loss mask holds 0 and 1 only, but it holds {int(entries.max())}; {_PREPARE_AGAIN}"
        )
    return entries


def _file_identity(low_level) -> dict[str, int] | None:
    """The sizes and modification times of the pair behind ``low_level`` (None for mock data): in the cache key,
    so that data rewritten with the same counts builds new indices instead of reusing the old ones."""
    return getattr(low_level, "file_identity", None)


class _SampleMaker:
    """Turns rows of ``seq_length + x`` token ids into sample dicts (shift, padding rule, LTR fields)."""

    def __init__(self, config: IndexedDataConfig, eod: int, pad: int) -> None:
        self.config = config
        self.eod = eod
        self.pad = pad
        self.length = config.seq_length + config.extra_token
        # Without per-document resets the LTR fields do not depend on the tokens: compute them once and share
        # them between samples, as upstream does.
        self._constant_fields = None
        self._constant_ready = not (config.reset_position_ids or config.reset_attention_mask or config.eod_mask_loss)

    @property
    def _constant(self):
        """``(loss_mask, position_ids, attention_mask)`` shared by every sample, or None; made on first use."""
        if self._constant_ready and self._constant_fields is None:
            fields = self._fields(np.zeros(self.config.seq_length, np.int64))
            self._constant_fields = (
                fields.loss_mask,
                torch.from_numpy(fields.position_ids),
                None if fields.attention_mask is None else torch.from_numpy(fields.attention_mask),
            )
        return self._constant_fields

    def _fields(self, tokens: np.ndarray):
        config = self.config
        return ltor_fields(
            tokens,
            self.eod,
            config.reset_position_ids,
            config.reset_attention_mask,
            config.eod_mask_loss,
            config.create_ltor_fields_in_dataloader and config.create_attention_mask,
        )

    def pad_rows(self, texts: Sequence[np.ndarray], fill: int | None = None) -> np.ndarray:
        """Stack texts into a ``[B, seq_length + x]`` matrix, padding short ones with ``fill`` (default: the pad id;
        then as int64)."""
        if all(len(text) == self.length for text in texts):
            return np.stack(texts)  # keeps the file dtype: the pad search is cheaper on narrow ids
        matrix = np.full((len(texts), self.length), self.pad if fill is None else fill, dtype=np.int64)
        for row, text in zip(matrix, texts, strict=True):
            row[: len(text)] = text
        return matrix

    def __call__(
        self, raw: np.ndarray, padding_rows: np.ndarray | None = None, supervised: np.ndarray | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """Samples of the rows of ``raw`` (``[B, seq_length + x]`` token ids, any integer dtype; short samples
        already padded with the pad id); ``padding_rows`` get a zero loss mask. ``supervised`` (the loss mask pair's
        entries of the same tokens, 0 where padded) takes the loss and the label off every target it marks 0."""
        x, length = self.config.extra_token, self.config.seq_length
        if x:
            # One int64 copy; tokens and labels are overlapping views of it (each sample's rows are contiguous).
            text = raw.astype(np.int64)
            tokens, labels = text[:, :length], text[:, 1:]
        else:
            tokens = raw.astype(np.int64)
            labels = np.empty_like(tokens)
            labels[:, :-1] = tokens[:, 1:]
            labels[:, -1] = 0  # the last position has no target: a pad label, masked below
        if self._constant is not None:
            loss_mask = np.repeat(self._constant[0][None], len(raw), axis=0)
            per_row = None
        else:
            per_row = [self._fields(row) for row in tokens]
            loss_mask = np.stack([fields.loss_mask for fields in per_row])
        # Pad positions are rare: find them once in the raw ids (a -1 sentinel cannot occur in unsigned data).
        is_pad = None if self.pad < 0 and raw.dtype.kind == "u" else raw == self.pad
        if is_pad is None or not is_pad.any():  # any() is a quarter of the flat search that finds them
            rows = columns = np.empty(0, np.int64)
        else:
            rows, columns = divmod(np.flatnonzero(is_pad), raw.shape[1])  # ~10x faster than 2-D nonzero
        # labels[:, j] is the id at text column j + 1; it is a pad label where that id is the pad
        label = columns >= 1
        loss_mask[rows[label], columns[label] - 1] = 0.0
        if x:
            text[rows, columns] = 0  # zeroes the pad in tokens and labels at once
        else:
            loss_mask[:, -1] = 0.0
            tokens[rows, columns] = 0
            labels[rows[label], columns[label] - 1] = 0
        if padding_rows is not None and padding_rows.any():
            loss_mask[padding_rows] = 0.0
        if supervised is not None:
            # the target of position i is token i + 1; with x = 0 the last position has none
            targets = np.zeros(tokens.shape, dtype=bool)
            targets[:, : supervised.shape[1] - 1] = supervised[:, 1:] != 0
            loss_mask[~targets] = 0.0
            labels = np.where(targets, labels, IGNORE_INDEX)  # a new array: with x, labels are a view of tokens
        tokens_t, labels_t, loss_t = torch.from_numpy(tokens), torch.from_numpy(labels), torch.from_numpy(loss_mask)
        # unbind makes the row views in one call: indexing row by row costs more than the rest of the batch
        samples = [
            {"tokens": t, "labels": lab, "loss_mask": m}
            for t, lab, m in zip(tokens_t.unbind(), labels_t.unbind(), loss_t.unbind(), strict=True)
        ]
        if self.config.create_ltor_fields_in_dataloader:
            for b, sample in enumerate(samples):
                if per_row is None:
                    position_ids, attention_mask = self._constant[1], self._constant[2]
                else:
                    position_ids = torch.from_numpy(per_row[b].position_ids)
                    mask = per_row[b].attention_mask
                    attention_mask = None if mask is None else torch.from_numpy(mask)
                if attention_mask is not None:
                    sample["attention_mask"] = attention_mask
                sample["position_ids"] = position_ids
        return samples


class _MidLevelDataset(torch.utils.data.Dataset):
    """What the mid-level datasets share: their inputs, the sample maker, and item access through ``texts``.

    Args:
        low_level: an ``IndexedDataReader`` (or ``MockGPTLowLevelDataset``).
        dataset_path: the prefix, recorded in cache keys and messages; None for mock data.
        indices: the split's sequence ids (a contiguous range).
        num_samples: samples to provide; None means exactly one epoch of the split.
        split: ``"train"``, ``"valid"`` or ``"test"``.
        config: the Indexed-path settings.
        tokenizer: any tokenizer object ``tokenizer_protocol.read_tokenizer`` reads (its EOD and pad ids).
        cache_options: where and how its index caches are read and built (``IndexedDataConfig.cache_options``).
    """

    kind = ""

    def __init__(
        self,
        low_level,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        split: str,
        config: IndexedDataConfig,
        tokenizer,
        cache_options: CacheOptions,
    ) -> None:
        self.dataset = low_level
        self.dataset_path = dataset_path
        self.indices = np.asarray(indices, dtype=np.int32)
        self.num_samples = num_samples
        self.split = split
        self.config = config
        tokens = read_tokenizer(tokenizer)
        if isinstance(low_level, IndexedDataReader):
            low_level.check_token_ids(tokens.vocab_size)
        eod, pad = resolve_special_tokens(tokens, config.allow_ambiguous_pad_tokens)
        self._make_sample = _SampleMaker(config, eod, pad)
        self._length = 0

    def __len__(self) -> int:
        return self._length

    @property
    def eod_token_id(self) -> int:
        """The id that ends documents in the samples (what a collator reads to tell sequences apart)."""
        return self._make_sample.eod

    def _positions(self, indices: Sequence[int]) -> np.ndarray:
        """Checked, non-negative sample positions."""
        idx = np.asarray(indices, dtype=np.int64)
        if not len(idx) or idx.view(np.uint64).max() < self._length:  # one pass: a negative index wraps past it
            return idx
        if idx.min() < -self._length or idx.max() >= self._length:
            raise IndexError(
                f"a sample index in {list(indices)[:8]} is out of range for {self.dataset_path} ({self.split} split) "
                f"with {self._length} samples"
            )
        return np.where(idx < 0, idx + self._length, idx)

    def texts(self, indices: Sequence[int]) -> np.ndarray:
        """``[B, seq_length + x]`` token ids of the samples, short ones padded with the pad id."""
        raise NotImplementedError

    def rows(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray | None]:
        """``texts(indices)``, and the loss-mask entries of the same tokens (0 where padded) or None without a
        loss-mask pair."""
        return self.texts(indices), None

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        """Sample ``idx``; ``None`` is a batch-padding sample (sample 0 with a zero loss mask), as upstream."""
        if idx is None:
            return self.__getitems__([idx])[0]
        if not -self._length <= idx < self._length:
            self._positions([idx])  # raises the descriptive IndexError
        texts, supervised = self.rows([idx + self._length if idx < 0 else idx])
        return self._make_sample(texts, None, supervised)[0]

    def __getitems__(self, indices: Sequence[int | None]) -> list[dict[str, torch.Tensor]]:
        """Many samples at once (torch's DataLoader calls this when it exists), read in one go."""
        if not len(indices):
            return []
        padding = np.array([i is None for i in indices])
        texts, supervised = self.rows([0 if i is None else i for i in indices])
        return self._make_sample(texts, padding, supervised)


class GPTDataset(_MidLevelDataset):
    """Fixed-length samples cut across variable-length documents, in megatron-core's order.

    The document, sample and shuffle indices are built once (``build_gpt_indices``) and cached; see
    ``_MidLevelDataset`` for the arguments.
    """

    kind = "GPTDataset"

    def __init__(self, low_level, dataset_path, indices, num_samples, split, config, tokenizer, cache_options):
        super().__init__(low_level, dataset_path, indices, num_samples, split, config, tokenizer, cache_options)
        self._drop_last = split != "valid" or config.drop_last_partial_validation_sequence
        begin, end = (self.indices.item(0), self.indices.item(-1) + 1) if len(self.indices) else (0, 0)
        if end - begin != len(self.indices):
            raise DataConfigError(f"{dataset_path}: a split's sequence ids must be one contiguous range")
        self.tokens_per_epoch = int(low_level.sequence_lengths[begin:end].sum(dtype=np.int64))
        self.loss_mask_pair = open_loss_mask(low_level, config) if isinstance(low_level, IndexedDataReader) else None
        self.unique_identifiers = {
            "class": self.kind,
            "dataset_path": dataset_path,
            "num_samples": num_samples,
            "index_split": split,
            "random_seed": config.random_seed,
            "sequence_length": config.seq_length,
            "split": config.split,
            "add_extra_token_to_sequence": config.add_extra_token_to_sequence,
            "drop_last_partial_sequence": self._drop_last,
            "sequences": [begin, end],
            "tokens_per_epoch": self.tokens_per_epoch,
            "tokenizer": read_tokenizer(tokenizer).identity,
            "data_files": _file_identity(low_level),
        }
        cache = IndexCache(cache_options.directory_for(dataset_path), self.kind, split, self.unique_identifiers)
        samples = self._expected_length()  # a cached entry of another length is another entry's, never read
        expected = {"sample_index": ExpectedArray((samples + 1, 2)), "shuffle_index": ExpectedArray((samples,))}
        self._arrays: Mapping[str, np.ndarray] = cache.get_or_build(
            _INDEX_NAMES, self._build_indices, cache_options, expected
        )
        self._length = samples
        logger.debug(
            "%s %s: %s samples of %d tokens from %s tokens",
            self.kind,
            self._where(),
            f"{self._length:,}",
            config.seq_length,
            f"{self.tokens_per_epoch:,}",
        )

    def _where(self) -> str:
        return (
            f"{self.dataset_path or 'mock data'} ({self.split} split, sequences {self.unique_identifiers['sequences']})"
        )

    def _expected_length(self) -> int:
        """The sample count without opening the indices (``defer_npy_index_mmap``), exactly as they are built."""
        config = self.config
        epochs = num_epochs(
            self.tokens_per_epoch,
            config.seq_length,
            self.num_samples,
            config.add_extra_token_to_sequence,
            self._where(),
        )
        return sample_count(
            epochs, self.tokens_per_epoch, config.seq_length, self._drop_last, config.add_extra_token_to_sequence
        )

    def _build_indices(self) -> dict[str, np.ndarray]:
        config = self.config
        indices = build_gpt_indices(
            self.dataset.sequence_lengths,
            self.indices,
            config.seq_length,
            self.num_samples,
            config.random_seed,
            self._drop_last,
            config.add_extra_token_to_sequence,
            self._where(),
        )
        return {name: getattr(indices, name) for name in _INDEX_NAMES}

    document_index = array_property("document_index")
    sample_index = array_property("sample_index")
    shuffle_index = array_property("shuffle_index")

    def _text_of(self, idx: int) -> np.ndarray:
        """One sample's token ids with plain-integer arithmetic: cheaper than the vectorised path for one sample."""
        x = self.config.extra_token
        j = self.shuffle_index.item(idx)
        d0, o0 = self.sample_index[j].tolist()
        d1, o1 = self.sample_index[j + 1].tolist()
        documents = self.document_index
        if d0 == d1:
            return self.dataset.get(documents.item(d0), offset=o0, length=o1 - o0 + x)
        pieces = [(documents.item(d0), o0, None)]
        pieces += [(d, 0, None) for d in documents[d0 + 1 : d1].tolist()]
        pieces.append((documents.item(d1), 0, o1 + x))
        return self.dataset.join(pieces)

    def texts(self, indices: Sequence[int]) -> np.ndarray:
        """``[B, seq_length + x]`` token ids of many samples, padded with the pad id, in few numpy calls.

        Every sample is a run of pieces (a document tail, whole documents, a document head): pieces ``d0 .. d1``
        of the document index, the first starting at ``o0``, the last ending at ``o1 + x``. All pieces of all
        samples are listed at once and read with one ``gather`` on the low-level data.
        """
        if len(indices) == 1 and 0 <= indices[0] < self._length:
            return self._make_sample.pad_rows([self._text_of(int(indices[0]))])
        pieces = self._pieces(indices)
        return self._stacked(self.dataset.gather(*pieces[:3]), pieces)

    def rows(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray | None]:
        if self.loss_mask_pair is None:
            return self.texts(indices), None
        pieces = self._pieces(indices)
        supervised = _checked_mask(self.loss_mask_pair, self.loss_mask_pair.gather(*pieces[:3]))
        return self._stacked(self.dataset.gather(*pieces[:3]), pieces), self._stacked(supervised, pieces, fill=0)

    def _pieces(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """``(sequences, starts, lengths)`` of every piece of the samples, in order, then one past each sample's last
        piece and the sample count."""
        rows = self.shuffle_index[self._positions(indices)]
        sample_index = self.sample_index
        (d0, o0), (d1, o1) = sample_index[rows].T, sample_index[rows + 1].T
        counts = d1 - d0 + 1  # pieces per sample
        last = np.cumsum(counts)  # one past each sample's last piece
        first = last - counts
        # piece k of the batch is document-index entry (its sample's d0) + (k - its sample's first piece)
        documents = self.document_index[np.arange(last.item(-1)) + np.repeat(d0 - first, counts)]
        starts = np.zeros(len(documents), np.int64)
        starts[first] = o0
        ends = self.dataset.sequence_lengths[documents].astype(np.int64)
        ends[last - 1] = o1 + self.config.extra_token
        return documents, starts, ends - starts, last, len(rows)

    def _stacked(self, flat: np.ndarray, pieces, fill: int | None = None) -> np.ndarray:
        """The gathered ``flat`` values of ``pieces`` as ``[B, seq_length + x]`` rows, short ones padded."""
        _, _, lengths, last, samples = pieces
        if len(flat) == samples * self._make_sample.length:
            return flat.reshape(samples, -1)
        sample_ends = np.cumsum(lengths)[last - 1]
        return self._make_sample.pad_rows(np.split(flat, sample_ends[:-1]), fill)


class GPTFromMRDataset(_MidLevelDataset):
    """Offline-packed records (``offline_preparation --pack-to-seq-len``), read in split order, no index cache.

    Each record must hold exactly ``seq_length + add_extra_token_to_sequence`` tokens and no pad token, unless
    ``skip_data_check``. See ``_MidLevelDataset`` for the arguments.
    """

    kind = "GPTFromMRDataset"

    def __init__(self, low_level, dataset_path, indices, num_samples, split, config, tokenizer, cache_options):
        super().__init__(low_level, dataset_path, indices, num_samples, split, config, tokenizer, cache_options)
        self._record_length = config.seq_length + config.extra_token
        if num_samples is not None and num_samples > len(self.indices):
            raise DataConfigError(
                f"{dataset_path} ({split} split) holds {len(self.indices)} packed records but {num_samples} samples "
                "were requested; packed records are not repeated. Request fewer samples, give the split a larger "
                "share, or prepare more data"
            )
        self._length = len(self.indices) if num_samples is None else num_samples
        if not config.skip_data_check:
            lengths = np.asarray(low_level.sequence_lengths)[self.indices]
            wrong = np.flatnonzero(lengths != self._record_length)
            if wrong.size:
                record = int(self.indices[wrong[0]])
                raise DataFileError(
                    f"{dataset_path}: record {record} has {int(lengths[wrong[0]])} tokens, but packed records must "
                    f"have seq_length + add_extra_token_to_sequence = {self._record_length} ({wrong.size} records "
                    "differ). Prepare the data with --pack-to-seq-len "
                    f"{config.seq_length}, or set is_dataset_from_mr: false for variable-length documents"
                )
        self.loss_mask_pair = open_loss_mask(low_level, config) if isinstance(low_level, IndexedDataReader) else None
        self.unique_identifiers = {
            "class": self.kind,
            "dataset_path": dataset_path,
            "num_samples": self._length,
            "index_split": split,
            "sequence_length": config.seq_length,
            "split": config.split,
            "data_files": _file_identity(low_level),
        }
        begin, end = (int(self.indices[0]), int(self.indices[-1]) + 1) if len(self.indices) else (0, 0)
        logger.debug(
            "%s %s (%s split, records [%d, %d)): %s samples of %d tokens",
            self.kind,
            dataset_path,
            split,
            begin,
            end,
            f"{self._length:,}",
            config.seq_length,
        )

    def _records(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The record ids of the samples and their lengths."""
        records = self.indices[self._positions(indices)].astype(np.int64)
        return records, np.asarray(self.dataset.sequence_lengths)[records].astype(np.int64)

    def _read(self, pair, records: np.ndarray, lengths: np.ndarray, fill: int | None = None) -> np.ndarray:
        """``[B, seq_length + x]`` values of ``records`` in ``pair`` (the tokens or their loss mask); unchecked
        records are cut or padded with ``fill`` (default: the pad id) to that length."""
        flat = pair.gather(records, np.zeros_like(records), lengths)
        if self.config.skip_data_check:
            pieces = np.split(flat, np.cumsum(lengths[:-1]))
            return self._make_sample.pad_rows([piece[: self._record_length] for piece in pieces], fill)
        return flat.reshape(len(records), self._record_length)

    def rows(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray | None]:
        if self.loss_mask_pair is None:
            return self.texts(indices), None
        records, lengths = self._records(indices)
        supervised = _checked_mask(self.loss_mask_pair, self._read(self.loss_mask_pair, records, lengths, fill=0))
        return self._checked_texts(records, lengths), supervised

    def texts(self, indices: Sequence[int]) -> np.ndarray:
        return self._checked_texts(*self._records(indices))

    def _checked_texts(self, records: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        text = self._read(self.dataset, records, lengths)
        if self.config.skip_data_check:
            return text
        has_pad = (text == self._make_sample.pad).any(axis=1)
        if has_pad.any():
            record = int(records[np.argmax(has_pad)])
            raise DataFileError(
                f"{self.dataset_path}: record {record} contains the pad token {self._make_sample.pad}; packed records "
                "must be packed without padding. Re-pack the data, or set skip_data_check: true to accept it"
            )
        return text


class MockGPTLowLevelDataset:
    """100,000 synthetic documents, as megatron-core's mock: document i is ``[1, 2, ..., L-1] % vocab`` + EOD.

    Lengths are drawn uniformly from [1, 4096) by ``numpy.random.default_rng(0)``.
    """

    size = 100_000
    max_sequence_length = 4096

    def __init__(self, vocab_size: int, eod: int) -> None:
        self.vocab_size = vocab_size
        self.eod = eod
        rng = np.random.default_rng(seed=0)
        self.sequence_lengths = rng.integers(1, self.max_sequence_length, size=self.size, dtype=np.int32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        length = int(self.sequence_lengths[idx])
        return np.concatenate([(np.arange(length - 1) + 1) % self.vocab_size, [self.eod]]).astype(np.int64)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset : offset + length]

    def gather(self, sequence_ids, offsets, lengths) -> np.ndarray:
        pieces = [self.get(int(i), int(o), int(n)) for i, o, n in zip(sequence_ids, offsets, lengths, strict=True)]
        return np.concatenate(pieces) if pieces else np.empty(0, np.int64)

    def join(self, pieces: Sequence[tuple[int, int, int | None]]) -> np.ndarray:
        return np.concatenate([self.get(i, offset, length) for i, offset, length in pieces])


class MockGPTDataset(GPTDataset):
    """``GPTDataset`` over ``MockGPTLowLevelDataset`` (``mock_data: true``); indices are kept in memory."""

    kind = "MockGPTDataset"
