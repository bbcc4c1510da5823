"""Helpers of the parity tests: one build description run through both our builder and megatron-core's.

megatron-core 0.16.1 is the test-only reference implementation. A ``BuildSpec`` holds every setting of a build;
``build_ours`` turns it into a ``data_config`` for ``build_indexed_text_dataset`` and ``build_megatron`` into a
``GPTDatasetConfig`` for ``BlendedMegatronDatasetBuilder``. The ``assert_*`` functions compare what the two
builds return: dataset kinds, lengths, every index array (values and dtypes) and sample contents.
"""

from __future__ import annotations

import logging
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.utils import get_blend_from_list

from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset

SPLITS = ("train", "valid", "test")
GPT_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
BLEND_INDEX_NAMES = ("dataset_index", "dataset_sample_index")
SAMPLE_KEYS = ("tokens", "labels", "loss_mask")
LTOR_KEYS = ("position_ids", "attention_mask")

logging.getLogger("megatron").setLevel(logging.ERROR)


# -- inputs -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParityTokenizer:
    """The smallest tokenizer both implementations accept; the same instance is given to both."""

    eod: int
    pad: int
    vocab_size: int = 100_000

    @property
    def unique_identifiers(self) -> dict:
        return {"class": type(self).__name__, "eod": self.eod, "pad": self.pad, "vocab_size": self.vocab_size}


Document = list[np.ndarray]  # the sequences of one document (usually one; none for an empty document)


def write_prefix(prefix: Path, documents: Sequence[Document], dtype) -> str:
    """Write ``<prefix>.bin``/``.idx`` with our ``IndexedDatasetBuilder``; returns the prefix as a string."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for sequences in documents:
        tokens = np.concatenate(sequences) if sequences else np.zeros(0, dtype=dtype)
        builder.add_document(tokens.astype(dtype), [len(s) for s in sequences])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def sequence_lengths(documents: Sequence[Document]) -> np.ndarray:
    """Tokens per sequence, flattened over documents, as in the ``.idx`` file."""
    return np.array([len(s) for sequences in documents for s in sequences], dtype=np.int64)


def split_ranges(split: str, num_sequences: int) -> list[tuple[int, int] | None]:
    """Sequence ranges of the three splits, by megatron-core's own split functions."""
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [
        None if bookend is None else (int(round(bookend[0] * num_sequences)), int(round(bookend[1] * num_sequences)))
        for bookend in matrix
    ]


def epoch_regime(tokens_per_epoch: int, seq_length: int, num_samples: int | None, extra: int) -> tuple[int, bool]:
    """``(epochs, separate_final_epoch)`` of a GPT dataset by megatron-core's own arithmetic: its linear search for
    the epochs that hold ``num_samples``, and a separate last epoch when that epoch supplies fewer than 80% of an
    epoch's samples."""
    if num_samples is None:
        return 1, False
    epochs = 1
    while epochs * tokens_per_epoch < num_samples * seq_length + extra:
        epochs += 1
    if epochs == 1:
        return 1, False
    per_epoch = (tokens_per_epoch - extra) // seq_length
    from_final = num_samples - ((epochs - 1) * tokens_per_epoch - extra) // seq_length
    return epochs, from_final < int(0.80 * per_epoch)


# -- one build, two implementations -------------------------------------------------------------------------------


DataPath = str | list[str]


@dataclass(frozen=True)
class BuildSpec:
    """Every setting of one build, in the vocabulary of our ``IndexedDataConfig``."""

    seq_length: int
    sizes: tuple[int | None, int | None, int | None]
    data_path: DataPath | None = None
    per_split_paths: tuple[DataPath | None, DataPath | None, DataPath | None] | None = None
    split: str = "969, 30, 1"
    random_seed: int = 1234
    add_extra_token_to_sequence: bool = True
    drop_last_partial_validation_sequence: bool = True
    mid_level_dataset_surplus: float = 0.005
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = True
    create_ltor_fields_in_dataloader: bool = False

    def data_config(self, cache_dir: Path) -> dict:
        """Our ``data_config`` mapping, as a YAML file would give it."""
        config = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("sizes", "data_path", "per_split_paths", "seq_length")
        }
        config["seq_length"] = self.seq_length
        config["data_cache_path"] = str(cache_dir)
        if self.per_split_paths is not None:
            for name, path in zip(SPLITS, self.per_split_paths, strict=True):
                config[f"{name}_data_path"] = path
        return config

    def megatron_config(self, tokenizer: ParityTokenizer, cache_dir: Path) -> GPTDatasetConfig:
        """The equivalent ``GPTDatasetConfig``; blend lists are parsed by megatron-core's ``get_blend_from_list``."""
        blend = blend_per_split = split = None
        if self.per_split_paths is not None:
            blend_per_split = [None if p is None else get_blend_from_list(_as_list(p)) for p in self.per_split_paths]
        else:
            blend = get_blend_from_list(_as_list(self.data_path))
            split = self.split
        return GPTDatasetConfig(
            random_seed=self.random_seed,
            sequence_length=self.seq_length,
            blend=blend,
            blend_per_split=blend_per_split,
            split=split,
            path_to_cache=str(cache_dir),
            tokenizer=tokenizer,
            reset_position_ids=self.reset_position_ids,
            reset_attention_mask=self.reset_attention_mask,
            eod_mask_loss=self.eod_mask_loss,
            create_attention_mask=self.create_attention_mask,
            add_extra_token_to_sequence=self.add_extra_token_to_sequence,
            drop_last_partial_validation_sequence=self.drop_last_partial_validation_sequence,
            mid_level_dataset_surplus=self.mid_level_dataset_surplus,
        )


def _as_list(path: DataPath) -> list[str]:
    return path.split() if isinstance(path, str) else list(path)


def build_ours(spec: BuildSpec, tokenizer: ParityTokenizer, cache_dir: Path, warned: list | None = None) -> tuple:
    """``(train, valid, test)`` from the public entry point; the warnings it gives are appended to ``warned``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        splits = build_indexed_text_dataset(spec.data_path, spec.data_config(cache_dir), list(spec.sizes), tokenizer)
    if warned is not None:
        warned += [str(w.message) for w in caught]
    return splits


def is_megatron_refusal(error: Exception) -> bool:
    """Whether megatron-core refused the configuration on purpose: a sample index with a negative offset (a final
    partial validation sample that ends in an empty sequence, with the extra token), or a blend that asks a source
    for more samples than it has."""
    if isinstance(error, IndexError):
        return "oversamples" in str(error)
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, AssertionError) and any(frame.name == "build_sample_idx" for frame in frames)


def build_megatron(spec: BuildSpec, tokenizer: ParityTokenizer, cache_dir: Path) -> list:
    """``[train, valid, test]`` from megatron-core's ``BlendedMegatronDatasetBuilder``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = spec.megatron_config(tokenizer, cache_dir)
        return BlendedMegatronDatasetBuilder(MegatronGPTDataset, list(spec.sizes), lambda: True, config).build()


def forget_cached_masks(dataset) -> None:
    """Drop megatron-core's per-dataset cache of the LTR fields (and of its GPT sources, for a blend).

    Without the reset and EOD options megatron-core computes the fields once and caches them, but it caches the
    very tensor whose loss mask it then zeroes at the first sample's pad labels: every later sample inherits those
    zeros, so its samples depend on the order in which they are read. Ours do not (see
    ``test_samples_do_not_depend_on_the_reading_order``).
    """
    for gpt_dataset in getattr(dataset, "datasets", [dataset]):
        gpt_dataset.masks_and_position_ids_are_cached = False


def megatron_sample(dataset, idx: int | None, fresh: bool = True) -> dict:
    """megatron-core's sample ``idx``; ``fresh``: as the first sample read from the dataset."""
    if fresh:
        forget_cached_masks(dataset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dataset[idx]


# -- comparisons --------------------------------------------------------------------------------------------------


def assert_array_equal(ours: np.ndarray, theirs: np.ndarray, where: str) -> None:
    """Equal values and equal dtypes."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.dtype == theirs.dtype, f"{where}: dtype {ours.dtype} != megatron's {theirs.dtype}"
    assert ours.shape == theirs.shape, f"{where}: shape {ours.shape} != megatron's {theirs.shape}"
    if not np.array_equal(ours, theirs):
        first = np.flatnonzero((ours != theirs).reshape(-1))[0]
        raise AssertionError(
            f"{where}: values differ, first at flat position {first}: {ours.reshape(-1)[first]} != megatron's "
            f"{theirs.reshape(-1)[first]}"
        )


def assert_gpt_indices_equal(ours, theirs, where: str) -> None:
    """A GPT dataset's kind, length and document/sample/shuffle indices."""
    assert type(ours).__name__ == type(theirs).__name__ == "GPTDataset", where
    assert len(ours) == len(theirs), f"{where}: len {len(ours)} != megatron's {len(theirs)}"
    assert ours.num_samples == theirs.num_samples, f"{where}: num_samples {ours.num_samples} != {theirs.num_samples}"
    assert ours.dataset_path == theirs.dataset_path, (
        f"{where}: dataset_path {ours.dataset_path} != {theirs.dataset_path}"
    )
    assert_array_equal(ours.indices, theirs.indices, f"{where}.indices")
    for name in GPT_INDEX_NAMES:
        assert_array_equal(getattr(ours, name), getattr(theirs, name), f"{where}.{name}")


def assert_indices_equal(ours, theirs, where: str) -> None:
    """A split's top-level dataset (plain or blended) and, for a blend, each of its sources."""
    if theirs is None:
        assert ours is None, f"{where}: ours is {type(ours).__name__}, megatron's is None"
        return
    assert ours is not None, f"{where}: ours is None, megatron's is {type(theirs).__name__}"
    assert type(ours).__name__ == type(theirs).__name__, f"{where}: {type(ours).__name__} != {type(theirs).__name__}"
    if type(theirs).__name__ == "GPTDataset":
        assert_gpt_indices_equal(ours, theirs, where)
        return
    assert len(ours) == len(theirs), f"{where}: len {len(ours)} != megatron's {len(theirs)}"
    assert ours.size == theirs.size, f"{where}: size {ours.size} != megatron's {theirs.size}"
    for name in BLEND_INDEX_NAMES:
        assert_array_equal(getattr(ours, name), getattr(theirs, name), f"{where}.{name}")
    assert len(ours.datasets) == len(theirs.datasets), f"{where}: source counts differ"
    for k, (mine, reference) in enumerate(zip(ours.datasets, theirs.datasets, strict=True)):
        assert_gpt_indices_equal(mine, reference, f"{where}.datasets[{k}]")


def assert_sample_equal(ours: dict, theirs: dict, where: str, ltor: bool) -> None:
    """One sample: the same keys (LTR fields only when ``ltor``), dtypes and values."""
    expected_keys = set(SAMPLE_KEYS)
    if ltor:
        expected_keys |= {k for k in LTOR_KEYS if k in theirs}
    if "dataset_id" in theirs:
        expected_keys.add("dataset_id")
        assert type(ours["dataset_id"]) is int, f"{where}: dataset_id is {type(ours['dataset_id']).__name__}"
        assert ours["dataset_id"] == int(theirs["dataset_id"]), f"{where}: dataset_id differs"
    assert set(ours) == expected_keys, f"{where}: keys {sorted(ours)} != {sorted(expected_keys)}"
    for key in expected_keys - {"dataset_id"}:
        mine, reference = ours[key], theirs[key]
        assert isinstance(mine, torch.Tensor), f"{where}[{key}] is {type(mine).__name__}, not a tensor"
        assert mine.dtype == reference.dtype, f"{where}[{key}]: dtype {mine.dtype} != megatron's {reference.dtype}"
        assert mine.shape == reference.shape, f"{where}[{key}]: shape {tuple(mine.shape)} != {tuple(reference.shape)}"
        assert torch.equal(mine, reference), f"{where}[{key}]: {mine.tolist()} != megatron's {reference.tolist()}"


def sample_positions(length: int, rng: np.random.Generator, limit: int = 200) -> list[int]:
    """Every position of a small dataset, else ``limit`` positions drawn without replacement, plus the ends."""
    if length <= limit:
        return list(range(length))
    drawn = rng.choice(length, size=limit - 2, replace=False)
    return sorted({0, length - 1, *(int(i) for i in drawn)})


def assert_samples_equal(ours, theirs, where: str, rng: np.random.Generator, ltor: bool = False, limit: int = 200):
    """Samples of one dataset at every position (or a seeded subset of ``limit`` for large datasets), read one at a
    time and all at once (``__getitems__``, as torch's ``DataLoader`` reads them)."""
    assert len(ours) == len(theirs), f"{where}: len {len(ours)} != megatron's {len(theirs)}"
    positions = sample_positions(len(theirs), rng, limit)
    batch = ours.__getitems__(positions)
    assert len(batch) == len(positions), f"{where}: __getitems__ returned {len(batch)} of {len(positions)} samples"
    for idx, from_batch in zip(positions, batch, strict=True):
        reference = megatron_sample(theirs, idx)
        assert_sample_equal(ours[idx], reference, f"{where}[{idx}]", ltor)
        assert_sample_equal(from_batch, reference, f"{where}.__getitems__[{idx}]", ltor)


def assert_builds_equal(ours: Sequence, theirs: Sequence, rng: np.random.Generator, ltor: bool = False) -> None:
    """All three splits: kinds, lengths, index arrays and samples."""
    for name, mine, reference in zip(SPLITS, ours, theirs, strict=True):
        assert_indices_equal(mine, reference, name)
        if reference is not None:
            assert_samples_equal(mine, reference, name, rng, ltor)
