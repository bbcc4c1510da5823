"""Which mid-level dataset a config asks for, and opening its low-level data.

Owns: choosing ``GPTDataset``, ``GPTFromMRDataset`` or ``MockGPTDataset``; opening a prefix's reader (or the
mock); and refusing the wrong pairing of data and setting (packed records given to ``GPTDataset``, documents
given to ``GPTFromMRDataset``) with the setting to change. Not responsible for: splits and blends.
"""

from __future__ import annotations

import numpy as np

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.indexed_data_config import IndexedDataConfig
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.indexed.indexed_pretrain_dataset import (
    GPTDataset,
    GPTFromMRDataset,
    MockGPTDataset,
    MockGPTLowLevelDataset,
)
from hyper_parallel.data.indexed.object_storage import open_reader
from hyper_parallel.data.tokenizer_protocol import read_tokenizer

__all__ = ["dataset_class", "open_low_level"]


def dataset_class(config: IndexedDataConfig) -> type:
    """The mid-level dataset class for ``config``: ``MockGPTDataset`` for mock data, ``GPTFromMRDataset`` for
    offline-packed records, else ``GPTDataset``."""
    if config.mock_data:
        return MockGPTDataset
    return GPTFromMRDataset if config.is_dataset_from_mr else GPTDataset


def _check_not_packed(reader: IndexedDataReader, prefix: str, config: IndexedDataConfig) -> None:
    lengths = reader.sequence_lengths
    record = config.seq_length + config.extra_token
    if len(lengths) >= 2 and lengths[0] == record and np.all(lengths == record):
        raise DataConfigError(
            f"{prefix}: every one of its {len(lengths)} sequences has exactly seq_length + add_extra_token_to_sequence "
            f"= {record} tokens, so it looks packed offline (--pack-to-seq-len); set is_dataset_from_mr: true to read "
            "the records as they are, or skip_data_check: true if these really are documents"
        )


def open_low_level(prefix: str | None, config: IndexedDataConfig, tokenizer):
    """The low-level data of ``prefix``: an ``IndexedDataReader`` (over object storage for a URL), or the mock
    documents for ``mock_data``."""
    if config.mock_data:
        tokens = read_tokenizer(tokenizer)
        vocab_size, eod = tokens.vocab_size, tokens.eod
        if vocab_size is None or eod is None:
            raise DataConfigError("mock_data needs a tokenizer with vocab_size and an EOD/EOS id")
        return MockGPTLowLevelDataset(int(vocab_size), int(eod))
    reader = open_reader(
        prefix, config.mmap_bin_files, block_bytes=config.object_block_bytes, cache_bytes=config.object_cache_bytes
    )
    if not config.is_dataset_from_mr and not config.skip_data_check:
        _check_not_packed(reader, prefix, config)
    return reader
