"""Megatron-compatible indexed datasets: the ``.idx``/``.bin`` reader and writer."""

from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder

__all__ = ["IndexedDataReader", "IndexedDatasetBuilder"]
