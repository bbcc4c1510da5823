"""Specification of the simple blends of packed records: ``simple_blend_locations`` (``inter``: one record from
each source in turn; ``intra``: one source after another) and ``SimpleBlendedDataset`` built through
``build_indexed_text_dataset`` with ``is_dataset_from_mr: true``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.indexed_simple_blended_dataset import SimpleBlendedDataset, simple_blend_locations

from .megatron_reference import split_ranges
from .test_indexed_pretrain_dataset import (
    assert_samples_equal,
    build_splits,
    expected_packed_sample,
    packed_records,
    write_records,
)

MODES = ("inter", "intra")


def reference_locations(sizes: Sequence[int], mode: str) -> list[tuple[int, int]]:
    """``(dataset_id, sample_id)`` rows by plain loops: rounds of one record per non-exhausted source (``inter``),
    or every record of each source in source order (``intra``)."""
    if mode == "intra":
        return [(source, sample) for source, size in enumerate(sizes) for sample in range(size)]
    return [
        (source, sample)
        for sample in range(max(sizes, default=0))
        for source, size in enumerate(sizes)
        if sample < size
    ]


# -- locations ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("inter", [[0, 0], [1, 0], [0, 1], [0, 2]]), ("intra", [[0, 0], [0, 1], [0, 2], [1, 0]])],
)
def test_locations_of_the_documented_example(mode, expected):
    """Sizes [3, 1]: ``inter`` gives (0,0) (1,0) (0,1) (0,2) and ``intra`` (0,0) (0,1) (0,2) (1,0), as int64
    ``[n, 2]`` rows."""
    locations = simple_blend_locations([3, 1], mode)

    assert locations.dtype == np.int64 and locations.shape == (4, 2)
    assert locations.tolist() == expected


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("mode", MODES)
def test_locations_equal_the_reference_for_random_sizes(mode, seed):
    """For random source counts and sizes (zeros included), the rows equal the plain-loop reference."""
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(0, 30, size=rng.integers(1, 8))]
    sizes[int(rng.integers(len(sizes)))] = 0 if seed % 3 == 0 else sizes[0]

    locations = simple_blend_locations(sizes, mode)

    assert locations.shape == (sum(sizes), 2)
    assert [tuple(row) for row in locations.tolist()] == reference_locations(sizes, mode)


@pytest.mark.parametrize("mode", MODES)
def test_locations_of_empty_sources(mode):
    """Sources without records contribute nothing; no records at all give no rows."""
    assert simple_blend_locations([0, 2, 0], mode).tolist() == [[1, 0], [1, 1]]
    assert simple_blend_locations([0, 0], mode).shape == (0, 2)


def test_unknown_mode_is_refused_naming_it():
    """A mode other than ``inter`` or ``intra`` is a ``DataConfigError`` naming it."""
    with pytest.raises(DataConfigError, match="'round_robin'"):
        simple_blend_locations([1, 2], "round_robin")


# -- SimpleBlendedDataset through the entry point -----------------------------------------------------------------


SPLIT = "8, 1, 1"
RECORD_COUNTS = (12, 5, 30)


@pytest.fixture
def sources(tmp_path) -> list[tuple[str, np.ndarray]]:
    """Three packed prefixes of 12, 5 and 30 records, each with its records."""
    result = []
    for k, count in enumerate(RECORD_COUNTS):
        records = packed_records(count, seed=100 + k)
        result.append((write_records(tmp_path / f"source{k}_text_document", records), records))
    return result


def build_blend(data_path, tokenizer, mode: str, sizes=None) -> tuple:
    return build_splits(data_path, tokenizer, sizes, split=SPLIT, is_dataset_from_mr=True, simple_blend=mode)


def expected_split_samples(sources, split_index: int, mode: str) -> tuple[list[dict], list[tuple[int, int]]]:
    """The samples (with ``dataset_id``) of one split of the simple blend, and their locations."""
    ranges = [split_ranges(SPLIT, len(records))[split_index] for _, records in sources]
    rows = reference_locations([end - begin for begin, end in ranges], mode)
    samples = [
        {"dataset_id": source, **expected_packed_sample(sources[source][1][ranges[source][0] + sample])}
        for source, sample in rows
    ]
    return samples, rows


@pytest.mark.parametrize("mode", MODES)
def test_simple_blend_takes_every_record_in_the_documented_order(sources, tokenizer, mode):
    """Each split is a ``SimpleBlendedDataset`` over the sources' split ranges; its samples carry the ``dataset_id``
    (an int) of their source and come in the mode's order, every record once."""
    splits = build_blend([prefix for prefix, _ in sources], tokenizer, mode)

    for split_index, dataset in enumerate(splits):
        expected, rows = expected_split_samples(sources, split_index, mode)
        assert type(dataset) is SimpleBlendedDataset and dataset.mode == mode
        assert len(dataset) == len(rows)
        samples = [dataset[i] for i in range(len(dataset))]
        assert all(type(sample["dataset_id"]) is int for sample in samples)
        assert_samples_equal(samples, expected, f"{mode} split {split_index}")
        assert_samples_equal(dataset.__getitems__(range(len(dataset))), expected, f"{mode} split {split_index}")


@pytest.mark.parametrize("mode", MODES)
def test_simple_blend_ignores_weights(sources, tokenizer, mode):
    """A weighted blend list gives the same simple blend as the bare prefixes: every record once, in mode order."""
    weighted = [value for k, (prefix, _) in enumerate(sources) for value in (str(10 * k + 1), prefix)]
    train = build_blend(weighted, tokenizer, mode)[0]

    expected, _ = expected_split_samples(sources, 0, mode)
    assert_samples_equal(train.__getitems__(range(len(train))), expected, mode)


@pytest.mark.parametrize("mode", MODES)
def test_requested_size_takes_the_first_locations_and_never_more_than_the_total(sources, tokenizer, mode):
    """A requested size keeps the first rows of the order; more samples than the split's records is a
    ``DataConfigError`` naming both counts (records are not repeated)."""
    prefixes = [prefix for prefix, _ in sources]
    expected, rows = expected_split_samples(sources, 0, mode)
    train = build_blend(prefixes, tokenizer, mode, [20, None, None])[0]
    assert len(train) == 20
    assert_samples_equal([train[i] for i in range(20)], expected[:20], mode)

    with pytest.raises(DataConfigError, match=f"holds {len(rows)} records") as error:
        build_blend(prefixes, tokenizer, mode, [len(rows) + 1, None, None])
    assert f"{len(rows) + 1} samples were requested" in str(error.value)


@pytest.mark.parametrize("mode", MODES)
def test_simple_blend_without_packed_records_is_refused_before_reading(tmp_path, tokenizer, mode):
    """``simple_blend`` with ``is_dataset_from_mr: false`` is a ``DataConfigError`` of the config, raised before any
    file is opened (here the prefixes do not even exist)."""
    missing = [str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")]

    with pytest.raises(DataConfigError, match="set is_dataset_from_mr: true") as error:
        build_splits(missing, tokenizer, split=SPLIT, simple_blend=mode)
    assert f"simple_blend: '{mode}'" in str(error.value)
