"""Specification of ``indexed_helpers``: bit-for-bit parity with megatron-core's GPT and blending index arrays.

megatron-core 0.16.1 is the reference: its compiled ``helpers_cpp``, its ``gpt_dataset`` private builders and a
``GPTDataset`` built in memory (mock config, so nothing is cached). The golden values were generated with the
upstream megatron-core implementation.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from megatron.core.datasets import gpt_dataset as megatron_gpt
from megatron.core.datasets import helpers as megatron_helpers
from megatron.core.datasets import helpers_cpp
from megatron.core.datasets.blended_megatron_dataset_builder import _get_size_per_split_per_dataset
from megatron.core.datasets.utils import Split
from megatron.core.datasets.utils import normalize as megatron_normalize

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed import _indexed_helpers, indexed_helpers
from hyper_parallel.data.indexed.indexed_helpers import (
    MAX_BLENDED_DATASETS,
    _legacy_shuffle,
    blended_sample_counts,
    build_blending_indices,
    build_document_index,
    build_exhaustive_blending_indices,
    build_gpt_indices,
    build_sample_index,
    build_shuffle_index,
    normalize_weights,
    num_epochs,
    sample_count,
    sample_index_dtype,
    separate_final_epoch,
    shuffle_index_dtype,
)

# -- megatron references ---------------------------------------------------------------------------------------


class _Tokenizer:
    vocab_size = 1000
    unique_identifiers = {"class": "_Tokenizer"}
    eod = 0
    pad = 1


def megatron_gpt_dataset(
    sequence_lengths: np.ndarray,
    indices: np.ndarray,
    sequence_length: int,
    num_samples: int | None,
    seed: int,
    drop_last: bool,
    add_extra_token: bool,
) -> megatron_gpt.GPTDataset:
    """A real megatron ``GPTDataset`` over an in-memory length array (no blend: mock config, no cache)."""
    config = megatron_gpt.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=sequence_length,
        split="1,0,0",
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        add_extra_token_to_sequence=add_extra_token,
        drop_last_partial_validation_sequence=drop_last,
    )
    low_level = SimpleNamespace(sequence_lengths=sequence_lengths)
    # drop_last only applies to the validation split in megatron.
    split = Split.valid if not drop_last else Split.train
    return megatron_gpt.GPTDataset(low_level, "prefix", indices, num_samples, split, config)


def megatron_num_epochs(tokens_per_epoch: int, sequence_length: int, num_samples: int | None, x: bool) -> int:
    owner = SimpleNamespace(
        num_samples=num_samples, config=SimpleNamespace(sequence_length=sequence_length, add_extra_token_to_sequence=x)
    )
    return megatron_gpt.GPTDataset._get_num_epochs(owner, tokens_per_epoch)


def megatron_blending(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    helpers_cpp.build_blending_indices(dataset_index, dataset_sample_index, weights, len(weights), size, False)
    return dataset_index, dataset_sample_index


def megatron_exhaustive(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    dataset_index = np.zeros(sum(sizes), dtype=np.int16)
    dataset_sample_index = np.zeros(sum(sizes), dtype=np.int64)
    helpers_cpp.build_exhaustive_blending_indices(dataset_index, dataset_sample_index, sizes, len(sizes))
    return dataset_index, dataset_sample_index


@pytest.fixture(autouse=True)
def _quiet_megatron_logs():
    # megatron logs every in-memory build ("Unable to save ..."); the arrays do not depend on it.
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def random_lengths(rng: np.random.Generator, count: int) -> np.ndarray:
    """int32 lengths mixing empty, tiny, medium and long sequences."""
    kind = rng.choice(4, size=count, p=[0.15, 0.35, 0.35, 0.15])
    upper = np.array([1, 4, 60, 2000])[kind]
    lower = np.array([0, 1, 1, 100])[kind]
    return rng.integers(lower, upper).astype(np.int32)


def assert_same_array(got: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} != {expected.dtype}"
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    assert np.array_equal(got, expected), f"{what}: first difference at {np.argwhere(got != expected)[:1].tolist()}"


# -- golden values ----------------------------------------------------------------------------------------------


def test_legacy_shuffle_golden_order():
    # megatron-core shuffles with the legacy RandomState; its order for seed 1234 over arange(10):
    golden = [7, 2, 9, 1, 0, 8, 4, 5, 6, 3]
    values = np.arange(10)
    np.random.RandomState(1234).shuffle(values)
    assert values.tolist() == golden
    assert build_document_index(np.arange(10), 1, np.random.RandomState(1234), False).tolist() == golden


@pytest.mark.parametrize(
    ("add_extra_token", "drop_last", "rows"),
    [
        # Section 9: build_sample_idx(sizes=[5,3,7,2], doc=[0,1,2,3], S=4, E=1, T=17).
        (True, True, [[0, 0], [0, 4], [2, 0], [2, 4], [3, 1]]),
        (True, False, [[0, 0], [0, 4], [2, 0], [2, 4], [3, 1]]),
        (False, True, [[0, 0], [0, 4], [1, 3], [2, 4], [3, 1]]),
        (False, False, [[0, 0], [0, 4], [1, 3], [2, 4], [3, 1], [3, 2]]),
    ],
)
def test_sample_index_golden(add_extra_token, drop_last, rows):
    sizes = np.array([5, 3, 7, 2], dtype=np.int32)
    doc = np.array([0, 1, 2, 3], dtype=np.int32)
    got = build_sample_index(sizes, doc, 4, 1, 17, drop_last, add_extra_token)
    assert got.dtype == np.int32
    assert got.tolist() == rows
    assert_same_array(got, megatron_helpers.build_sample_idx(sizes, doc, 4, 1, 17, drop_last, add_extra_token))


# Section 9 golden GPTDataset cases: lengths [5,3,7,2,4], seed 1234, S=4, train split.
GPT_GOLDEN = [
    pytest.param(
        7,
        True,
        2,
        True,
        [4, 0, 1, 2, 3, 3, 2, 1, 0, 4],
        [[0, 0], [1, 0], [1, 4], [3, 0], [3, 4], [4, 1], [6, 1], [6, 5], [7, 2], [8, 3], [9, 2]],
        [2, 0, 4, 3, 1, 6, 9, 5, 7, 8],
        id="N7-x1",
    ),
    pytest.param(
        7,
        False,
        2,
        True,
        [4, 0, 1, 2, 3, 3, 2, 1, 0, 4],
        [[0, 0], [0, 4], [1, 4], [2, 3], [3, 4], [4, 1], [6, 1], [6, 5], [7, 2], [8, 3], [9, 2]],
        [2, 0, 4, 3, 1, 6, 9, 5, 7, 8],
        id="N7-x0",
    ),
    pytest.param(
        12,
        True,
        3,
        True,
        [2, 2, 4, 1, 0, 3, 4, 0, 1, 3, 0, 4, 3, 2, 1],
        [
            [0, 0],
            [0, 4],
            [1, 1],
            [1, 5],
            [2, 2],
            [3, 2],
            [4, 3],
            [6, 0],
            [7, 0],
            [7, 4],
            [9, 0],
            [10, 2],
            [11, 1],
            [12, 1],
            [13, 3],
            [14, 0],
        ],
        [3, 9, 2, 1, 7, 5, 4, 0, 8, 6, 14, 11, 13, 10, 12],
        id="N12-x1",
    ),
    pytest.param(
        None,
        True,
        1,
        False,
        [4, 0, 1, 2, 3],
        [[0, 0], [1, 0], [1, 4], [3, 0], [3, 4], [4, 1]],
        [3, 2, 1, 0, 4],
        id="Nnone-x1",
    ),
]


@pytest.mark.parametrize(("n", "x", "epochs", "separate", "doc", "rows", "shuffle"), GPT_GOLDEN)
def test_gpt_indices_golden(n, x, epochs, separate, doc, rows, shuffle):
    lengths = np.array([5, 3, 7, 2, 4], dtype=np.int32)
    assert num_epochs(21, 4, n, x) == epochs
    assert separate_final_epoch(epochs, 21, 4, n, x) is separate
    got = build_gpt_indices(lengths, np.arange(5, dtype=np.int32), 4, n, 1234, True, x)
    assert (got.num_epochs, got.separate_final_epoch) == (epochs, separate)
    assert got.document_index.dtype == np.int32 and got.document_index.tolist() == doc
    assert got.sample_index.dtype == np.int32 and got.sample_index.tolist() == rows
    assert got.shuffle_index.dtype == np.uint32 and got.shuffle_index.tolist() == shuffle
    assert got.sample_index.shape[0] - 1 == len(shuffle)  # __len__


def test_blending_golden():
    # Section 9 / 3.1 checked examples; the [.3, .7] sample index follows from its dataset index.
    dataset_index, sample_index = build_blending_indices([0.5, 0.25, 0.25], 8)
    assert dataset_index.tolist() == [0, 1, 2, 0, 0, 1, 2, 0]
    assert sample_index.tolist() == [0, 0, 0, 1, 2, 1, 1, 3]
    dataset_index, sample_index = build_blending_indices([0.3, 0.7], 10)
    assert dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert sample_index.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]
    assert (dataset_index.dtype, sample_index.dtype) == (np.int16, np.int64)
    dataset_index, sample_index = build_exhaustive_blending_indices([1, 2, 3])
    assert dataset_index.tolist() == [2, 1, 0, 2, 1, 2]
    assert sample_index.tolist() == [0, 0, 0, 1, 1, 2]


def test_builder_sample_counts_golden():
    # Section 9: w=[.3,.7], surplus 0.005: children num_samples [16, 36], size 50; N=5 gives size 6.
    assert blended_sample_counts([0.3, 0.7], 50, 0.005) == ([15, 35], [16, 36], 50)
    assert blended_sample_counts([0.3, 0.7], 5, 0.005)[2] == 6
    # Section 3.4: N = 1000 with three equal weights gives 1002.
    assert blended_sample_counts(normalize_weights([1, 1, 1]), 1000, 0.005)[2] == 1002


# -- epoch arithmetic ------------------------------------------------------------------------------------------


def test_num_epochs_matches_megatron_loop():
    rng = np.random.default_rng(11)
    for _ in range(500):
        tokens = int(rng.integers(1, 5000))
        seq = int(rng.integers(1, 300))
        n = None if rng.random() < 0.1 else int(rng.integers(0, 200 * tokens // seq + 2))
        x = bool(rng.integers(2))
        assert num_epochs(tokens, seq, n, x) == megatron_num_epochs(tokens, seq, n, x), (tokens, seq, n, x)


def test_num_epochs_closed_form_at_scale():
    # A linear loop would take 10**12 steps here.
    assert num_epochs(1, 4096, 10**9, True) == 4096 * 10**9 + 1
    assert num_epochs(4096 * 10**9, 4096, 10**9, False) == 1
    assert num_epochs(4096 * 10**9, 4096, 10**9, True) == 2


def test_empty_split_raises_instead_of_hanging():
    with pytest.raises(DataConfigError, match=r"^data/web valid: the split holds no tokens"):
        num_epochs(0, 4, 10, True, where="data/web valid")
    with pytest.raises(DataConfigError, match="holds no tokens"):
        num_epochs(0, 4, 0, True)  # N*S + x = 1 > 0: megatron hangs here too
    # Megatron returns at once when nothing is needed or requested.
    assert num_epochs(0, 4, 0, False) == 1 == megatron_num_epochs(0, 4, 0, False)
    assert num_epochs(0, 4, None, True) == 1 == megatron_num_epochs(0, 4, None, True)


def test_separate_final_epoch_threshold_and_consistency():
    # T=21, S=4, x=1: 5 samples per epoch, int(0.8 * 5) = 4.
    assert separate_final_epoch(2, 21, 4, 8, True) is True  # final epoch supplies 3
    assert separate_final_epoch(2, 21, 4, 9, True) is False  # supplies 4, not < 4
    assert separate_final_epoch(1, 21, 4, 3, True) is False
    with pytest.raises(DataConfigError, match=r"the final of 2 epochs would supply -1 samples, outside \[0, 6\]"):
        separate_final_epoch(2, 21, 4, 4, True)
    with pytest.raises(DataConfigError, match="would supply 7 samples"):
        separate_final_epoch(2, 21, 4, 12, True)
    with pytest.raises(DataConfigError, match="^ds: "):
        separate_final_epoch(3, 21, 4, None, True, where="ds")


# -- sample index ----------------------------------------------------------------------------------------------


def test_sample_index_matches_megatron_randomised():
    rng = np.random.default_rng(2024)
    seen = Counter()
    for case in range(400):
        lengths = random_lengths(rng, int(rng.integers(1, 40)))
        begin = int(rng.integers(0, len(lengths)))
        end = int(rng.integers(begin + 1, len(lengths) + 1))
        epochs = int(rng.integers(1, 5))
        doc = np.tile(np.arange(begin, end, dtype=np.int32), epochs)
        rng.shuffle(doc)
        seq = int(rng.choice([1, 2, 3, 4, 5, 8, 16, 33, 128]))
        x = bool(rng.integers(2))
        drop = bool(rng.integers(2))
        tokens = int(lengths[begin:end].sum(dtype=np.int64))
        if tokens == 0 and x and seq == 1:
            continue  # megatron computes -1 samples here and writes out of bounds
        context = (case, lengths.tolist(), doc.tolist(), seq, epochs, tokens, drop, x)
        try:
            expected = megatron_helpers.build_sample_idx(lengths, doc, seq, epochs, tokens, drop, x)
        except AssertionError:
            # The wrapper rejects offset -1: a final partial sample ending in an empty sequence with x = 1.
            with pytest.raises(DataConfigError, match="offset -1"):
                build_sample_index(lengths, doc, seq, epochs, tokens, drop, x)
            seen["rejected"] += 1
            continue
        assert_same_array(build_sample_index(lengths, doc, seq, epochs, tokens, drop, x), expected, str(context))
        ends = lengths[doc[expected[:, 0]]]
        seen["cases"] += 1
        seen["empty sequences"] += bool((lengths[doc] == 0).any())
        seen["offset == length"] += bool(not x and (expected[1:, 1] == ends[1:]).any())
        seen["last-document branch"] += (len(expected) - 1) * seq + x > epochs * tokens  # final partial sample
        seen["S = 1"] += seq == 1
        seen["several epochs"] += epochs > 1
        seen["no samples"] += len(expected) == 1
    # The generator must keep exercising each edge case, or this test would prove less than it claims.
    assert seen["cases"] >= 300
    for edge in ["empty sequences", "offset == length", "last-document branch", "S = 1", "several epochs"]:
        assert seen[edge] >= 10, (edge, seen)
    assert seen["rejected"] >= 1 and seen["no samples"] >= 1, seen


def test_sample_index_float32_count_matches_megatron():
    # megatron-core counts in float32: T = 33,554,434, S = 2, x = 1 without drop_last gives 16,777,216 samples,
    # not the exact 16,777,217.
    assert sample_count(1, 33_554_434, 2, False, True) == 16_777_216
    assert sample_count(1, 33_554_434, 2, True, True) == 16_777_216
    # Short of the exact ceil (4097) because float32(2**24 + 1) == 2**24.
    assert sample_count(1, 2**24 + 2, 4096, False, True) == 4096
    # One more than the exact ceil (11,184,818): float32(33554454) / 3 rounds up to 11184819. Megatron then emits
    # a final row from its last-document branch; compare the whole index.
    lengths = np.array([16_777_227, 16_777_227], dtype=np.int32)
    doc = np.array([0, 1], dtype=np.int32)
    expected = megatron_helpers.build_sample_idx(lengths, doc, 3, 1, 33_554_454, False, False)
    assert expected.shape[0] - 1 == 11_184_819
    assert_same_array(build_sample_index(lengths, doc, 3, 1, 33_554_454, False, False), expected)


def test_sample_index_dtype_choice():
    # helpers.py: int32 when max(len(document_index), max(sequence_lengths)) <= INT32_MAX, else int64.
    assert sample_index_dtype(2**31 - 1, 0) == np.int32
    assert sample_index_dtype(0, 2**31 - 1) == np.int32
    assert sample_index_dtype(2**31, 5) == np.int64
    assert sample_index_dtype(5, 2**31) == np.int64


def test_sample_index_int64_variant_matches_megatron():
    # A sequence outside the split longer than INT32_MAX switches the whole index to int64, in megatron too.
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 50, 30).astype(np.int64)
    lengths[29] = 2**31 + 7
    doc = np.tile(np.arange(0, 20, dtype=np.int32), 2)
    rng.shuffle(doc)
    tokens = int(lengths[:20].sum())
    for drop, x in [(True, True), (False, False), (False, True)]:
        expected = megatron_helpers.build_sample_idx(lengths, doc, 7, 2, tokens, drop, x)
        assert expected.dtype == np.int64
        assert_same_array(build_sample_index(lengths, doc, 7, 2, tokens, drop, x), expected)


def test_sample_index_without_samples():
    lengths = np.array([0, 0, 3], dtype=np.int32)
    got = build_sample_index(lengths, np.array([0, 1], dtype=np.int32), 4, 1, 0, True, True)
    assert got.tolist() == [[0, 0]] and got.dtype == np.int32
    empty = build_sample_index(lengths, np.array([], dtype=np.int32), 4, 1, 0, False, False)
    assert empty.tolist() == [[0, 0]]
    with pytest.raises(DataConfigError, match="empty document index"):
        build_sample_index(lengths, np.array([], dtype=np.int32), 4, 1, 10, True, False)


def test_sample_index_large_input_matches_megatron():
    # Sanity at scale (no timing assertion): 250k sequences x 2 epochs, realistic lengths.
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 4096, 250_000).astype(np.int32)
    doc = build_document_index(np.arange(len(lengths)), 2, np.random.RandomState(3), False)
    tokens = int(lengths.sum(dtype=np.int64))
    expected = megatron_helpers.build_sample_idx(lengths, doc, 512, 2, tokens, True, True)
    assert_same_array(build_sample_index(lengths, doc, 512, 2, tokens, True, True), expected)


# -- document and shuffle indices, full pipeline ---------------------------------------------------------------


def test_document_and_shuffle_index_match_megatron_private_builders():
    rng = np.random.default_rng(99)
    for _ in range(150):
        seed = int(rng.integers(0, 2**32))
        begin = int(rng.integers(0, 1000))
        indices = np.arange(begin, begin + int(rng.integers(0, 60)), dtype=np.int32)
        epochs = int(rng.integers(1, 6))
        separate = bool(rng.integers(2))
        total = int(rng.integers(0, 300))
        first = int(rng.integers(0, total + 1))
        ours, theirs = np.random.RandomState(seed), np.random.RandomState(seed)
        assert_same_array(
            build_document_index(indices, epochs, ours, separate),
            megatron_gpt._build_document_index(indices, epochs, theirs, separate),
            "document index",
        )
        assert_same_array(
            build_shuffle_index(first, total, ours), megatron_gpt._build_shuffle_index(first, total, theirs), "shuffle"
        )
        assert ours.randint(2**31) == theirs.randint(2**31)  # same number of draws consumed


# -- the native legacy shuffle: RandomState.shuffle bit for bit -------------------------------------------------

SHUFFLE_SIZES = [0, 1, 2, 3, 4, 5, 7, 8, 9, 100, 255, 256, 257, 623, 624, 625, 1000, 1023, 1024, 1025, 65535, 65536]
SHUFFLE_SEEDS = [0, 1, 1234, 2**31 - 1, 2**32 - 1]
SHUFFLE_DTYPES = [np.int32, np.uint32, np.int64, np.uint64]


def native_shuffle(rng: np.random.RandomState, array: np.ndarray) -> None:
    """Shuffle with the C helper alone, carrying ``rng``'s state in and out."""
    state = rng.get_state(legacy=False)
    key = np.array(state["state"]["key"], dtype=np.uint32)
    pos = _indexed_helpers.legacy_shuffle(array, key, state["state"]["pos"])
    rng.set_state({**state, "state": {"key": key, "pos": pos}})


def assert_same_generator(ours: np.random.RandomState, theirs: np.random.RandomState) -> None:
    got, expected = ours.get_state(), theirs.get_state()
    assert got[0] == expected[0] and got[2:] == expected[2:]
    assert np.array_equal(got[1], expected[1])


@pytest.mark.parametrize("dtype", SHUFFLE_DTYPES)
def test_native_shuffle_matches_randomstate(dtype):
    # One generator through every size in turn, so the shuffles start at many positions of the MT19937 block.
    for seed in SHUFFLE_SEEDS:
        ours, theirs = np.random.RandomState(seed), np.random.RandomState(seed)
        for size in SHUFFLE_SIZES:
            got, expected = np.arange(size, dtype=dtype), np.arange(size, dtype=dtype)
            native_shuffle(ours, got)
            theirs.shuffle(expected)
            assert_same_array(got, expected, f"seed {seed}, size {size}")
            assert_same_generator(ours, theirs)
        assert ours.randint(2**31, size=8).tolist() == theirs.randint(2**31, size=8).tolist()


@pytest.mark.parametrize("dtype", [np.uint32, np.int64])
def test_legacy_shuffle_matches_randomstate_on_large_arrays(dtype):
    # Sizes around powers of two change the rejection mask; two shuffles in a row, as the index builders do.
    for seed, sizes in [(1234, [2**20 + 17, 2**17 - 1]), (7, [2**18, 2**18 + 1]), (2**32 - 1, [300_001, 2**16])]:
        ours, theirs = np.random.RandomState(seed), np.random.RandomState(seed)
        for size in sizes:
            got, expected = np.arange(size, dtype=dtype), np.arange(size, dtype=dtype)
            _legacy_shuffle(ours, got)
            theirs.shuffle(expected)
            assert_same_array(got, expected, f"seed {seed}, size {size}")
        assert_same_generator(ours, theirs)
        assert ours.randint(2**31, size=8).tolist() == theirs.randint(2**31, size=8).tolist()
        assert ours.random_sample() == theirs.random_sample()


def test_legacy_shuffle_keeps_the_cached_gaussian(monkeypatch):
    monkeypatch.setattr(indexed_helpers, "_NATIVE_SHUFFLE_MIN_SIZE", 0)
    ours, theirs = np.random.RandomState(5), np.random.RandomState(5)
    assert ours.standard_normal() == theirs.standard_normal()  # leaves the second normal of the pair cached
    got, expected = np.arange(5000), np.arange(5000)
    _legacy_shuffle(ours, got)
    theirs.shuffle(expected)
    assert_same_array(got, expected)
    assert_same_generator(ours, theirs)
    assert ours.standard_normal() == theirs.standard_normal()


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(40_000, dtype=np.int64)[::2],  # not contiguous
        lambda: np.arange(20_000, dtype=np.int16),
        lambda: np.arange(20_000, dtype=np.float64),
        lambda: np.arange(20_000, dtype=">i8"),
        lambda: np.arange(40_000, dtype=np.int32).reshape(20_000, 2),
        lambda: np.arange(100, dtype=np.int64),  # below the size where the C helper pays off
        lambda: list(range(100)),
    ],
    ids=["strided", "int16", "float64", "big-endian", "2-d", "small", "list"],
)
def test_legacy_shuffle_falls_back_to_randomstate(make):
    ours, theirs = np.random.RandomState(3), np.random.RandomState(3)
    got, expected = make(), make()
    _legacy_shuffle(ours, got)
    theirs.shuffle(expected)
    assert np.array_equal(np.asarray(got), np.asarray(expected))
    assert_same_generator(ours, theirs)


def test_legacy_shuffle_other_bit_generators_and_read_only_arrays():
    ours, theirs = np.random.RandomState(np.random.PCG64(11)), np.random.RandomState(np.random.PCG64(11))
    got, expected = np.arange(20_000), np.arange(20_000)
    _legacy_shuffle(ours, got)
    theirs.shuffle(expected)
    assert_same_array(got, expected)
    read_only = np.arange(20_000)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _legacy_shuffle(np.random.RandomState(0), read_only)


def test_native_shuffle_refuses_bad_state():
    key = np.zeros(624, dtype=np.uint32)
    with pytest.raises(ValueError, match="pos must be in"):
        _indexed_helpers.legacy_shuffle(np.arange(4), key, 625)
    with pytest.raises(ValueError, match="key must hold 624 words"):
        _indexed_helpers.legacy_shuffle(np.arange(4), key[:10], 0)
    with pytest.raises(TypeError, match="4- or 8-byte items"):
        _indexed_helpers.legacy_shuffle(np.arange(4, dtype=np.int16), key, 0)


@pytest.mark.parametrize("end_token", [-1, 0, 7])
def test_fill_token_lists_writes_the_lists_back_to_back(end_token):
    """The documents' ids in order, ``end_token`` after each one when it is >= 0; empty documents and ids beyond
    32 bits are kept as they are."""
    documents = [[5, 1, 2], [], [2**40, 3], [9]]
    expected = [token for ids in documents for token in ids + ([end_token] if end_token >= 0 else [])]
    out = np.full(len(expected), -99, dtype=np.int64)
    _indexed_helpers.fill_token_lists(documents, end_token, out)
    assert out.tolist() == expected


def test_fill_token_lists_refuses_what_it_cannot_copy():
    out = np.empty(3, dtype=np.int64)
    with pytest.raises(ValueError, match="hold 2 tokens but out has 3"):
        _indexed_helpers.fill_token_lists([[1, 2]], -1, out)
    with pytest.raises(ValueError, match="more tokens than out's 3"):
        _indexed_helpers.fill_token_lists([[1, 2], [3]], 0, out)
    with pytest.raises(TypeError, match="document 1 is a tuple, expected a list"):
        _indexed_helpers.fill_token_lists([[1], (2, 3)], -1, out)
    with pytest.raises(TypeError, match="token 1 of document 0 is a float, expected an int"):
        _indexed_helpers.fill_token_lists([[1, 2.0, 3]], -1, out)
    with pytest.raises(OverflowError):
        _indexed_helpers.fill_token_lists([[1, 2**70, 3]], -1, out)
    with pytest.raises(TypeError, match="8-byte items"):
        _indexed_helpers.fill_token_lists([[1, 2, 3]], -1, np.empty(3, dtype=np.int32))


def test_shuffle_index_dtype_threshold_matches_megatron(monkeypatch):
    # Read megatron's switch point without allocating 2**32 entries: record the dtype it asks arange for.
    requested = []

    def fake_arange(start, stop, step, dtype):
        requested.append(np.dtype(dtype))
        return np.arange(0, dtype=dtype)

    fake_numpy = SimpleNamespace(iinfo=np.iinfo, uint32=np.uint32, int64=np.int64, arange=fake_arange)
    fake_numpy.concatenate = np.concatenate
    monkeypatch.setattr(megatron_gpt, "numpy", fake_numpy)
    for total in [2**32 - 3, 2**32 - 2, 2**32 - 1]:
        requested.clear()
        megatron_gpt._build_shuffle_index(total, total, np.random.RandomState(0))
        assert shuffle_index_dtype(total) == requested[0], total
    assert shuffle_index_dtype(2**32 - 3) == np.uint32 and shuffle_index_dtype(2**32 - 2) == np.int64


def test_gpt_indices_match_megatron_dataset():
    rng = np.random.default_rng(31337)
    seen = Counter()
    for case in range(200):
        lengths = random_lengths(rng, int(rng.integers(1, 50)))
        begin = int(rng.integers(0, len(lengths)))
        end = int(rng.integers(begin, len(lengths) + 1))
        indices = np.arange(begin, end, dtype=np.int32)
        tokens = int(lengths[begin:end].sum(dtype=np.int64))
        seq = int(rng.choice([1, 2, 3, 4, 8, 16, 64]))
        x = bool(rng.integers(2))
        drop = bool(rng.integers(2))
        seed = int(rng.integers(0, 2**31))
        if tokens == 0:
            if x and seq == 1:
                continue  # megatron writes out of bounds (-1 samples)
            n = None  # megatron hangs on an empty split with samples requested
        else:
            n = None if rng.random() < 0.2 else int(rng.integers(0, 4 * tokens // seq + 2))
        context = (case, lengths.tolist(), begin, end, seq, n, seed, drop, x)
        try:
            reference = megatron_gpt_dataset(lengths, indices, seq, n, seed, drop, x)
        except AssertionError:
            with pytest.raises(DataConfigError, match="offset -1"):
                build_gpt_indices(lengths, indices, seq, n, seed, drop, x)
            seen["rejected"] += 1
            continue
        got = build_gpt_indices(lengths, indices, seq, n, seed, drop, x)
        assert_same_array(got.document_index, reference.document_index, f"document index {context}")
        assert_same_array(got.sample_index, reference.sample_index, f"sample index {context}")
        assert_same_array(got.shuffle_index, reference.shuffle_index, f"shuffle index {context}")
        assert got.num_epochs * len(indices) == len(reference.document_index)
        seen["cases"] += 1
        seen["separate"] += got.separate_final_epoch
        seen["several epochs"] += got.num_epochs > 1
    assert seen["cases"] >= 150 and seen["separate"] >= 20 and seen["several epochs"] >= 50, seen


# -- blending --------------------------------------------------------------------------------------------------


def random_blend_weights(rng: np.random.Generator) -> list[float]:
    kind = int(rng.integers(5))
    if kind == 0:
        return [1 / 3] * 3
    if kind == 1:
        return [0.1] * 10
    count = int(rng.integers(1, 7))
    if kind == 2:  # integer-like weights that tie after normalisation
        return normalize_weights(rng.integers(1, 4, count).tolist())
    if kind == 3:  # very uneven
        return normalize_weights((10.0 ** rng.uniform(-6, 0, count)).tolist())
    return normalize_weights(rng.random(count).tolist())


def test_blending_indices_match_megatron_randomised():
    rng = np.random.default_rng(77)
    for case in range(320):
        weights = random_blend_weights(rng)
        size = int(10 ** rng.uniform(0, 5)) if case else 0
        got = build_blending_indices(weights, size)
        expected = megatron_blending(weights, size)
        assert_same_array(got[0], expected[0], f"dataset index {weights} {size}")
        assert_same_array(got[1], expected[1], f"dataset sample index {weights} {size}")


def test_exhaustive_blending_indices_match_megatron_randomised():
    rng = np.random.default_rng(78)
    for case in range(320):
        count = int(rng.integers(1, 7))
        if case % 4 == 0:
            sizes = [int(rng.integers(1, 500))] * count  # exact ties
        else:
            sizes = [int(10 ** rng.uniform(0, 4.3)) for _ in range(count)]
        got = build_exhaustive_blending_indices(sizes)
        expected = megatron_exhaustive(sizes)
        assert_same_array(got[0], expected[0], f"dataset index {sizes}")
        assert_same_array(got[1], expected[1], f"dataset sample index {sizes}")
        assert np.array_equal(np.bincount(got[0], minlength=count), sizes)


def test_normalize_and_sample_counts_match_megatron():
    rng = np.random.default_rng(3)
    for _ in range(300):
        raw = (rng.random(int(rng.integers(1, 8))) * 10 ** rng.uniform(-3, 3)).tolist()
        weights = normalize_weights(raw)
        assert weights == megatron_normalize(raw)
        assert all(type(w) is float for w in weights)
        n = int(rng.integers(0, 10**7))
        surplus = float(rng.choice([0.0, 0.005, 0.1]))
        targets, buffers, size = blended_sample_counts(weights, n, surplus)
        assert targets == [row[0] for row in _get_size_per_split_per_dataset(weights, [n])]
        assert buffers == [row[0] for row in _get_size_per_split_per_dataset(weights, [n], surplus)]
        assert size == sum(targets) >= n


# -- refusals --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([0.5, 0.0, 0.5], "blend weight 1 must be finite and > 0, got 0.0"),
        ([0.5, 0.5, -0.1], "blend weight 2 must be finite and > 0, got -0.1"),
        ([float("nan"), 1.0], "blend weight 0 must be finite and > 0, got nan"),
        ([1.0, float("inf")], "blend weight 1 must be finite and > 0, got inf"),
        (["a", 1.0], "blend weights must be numbers"),
        ([], "between 1 and 32766 datasets"),
        ([1.0] * MAX_BLENDED_DATASETS, "got 32767"),
    ],
)
def test_blending_refuses_bad_weights(weights, message):
    with pytest.raises(DataConfigError, match=re.escape(message)):
        build_blending_indices(weights, 10)


def test_blending_accepts_the_largest_dataset_count():
    weights = normalize_weights([1.0] * (MAX_BLENDED_DATASETS - 1))
    got = build_blending_indices(weights, 1000)
    expected = megatron_blending(weights, 1000)
    assert_same_array(got[0], expected[0])
    assert_same_array(got[1], expected[1])


def test_blending_refuses_negative_size():
    with pytest.raises(DataConfigError, match="blend size must be >= 0, got -1"):
        build_blending_indices([1.0], -1)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ([3, 0], "blend size 1 must be a positive integer, got 0"),
        ([-2], "blend size 0 must be a positive integer, got -2"),
        ([1, 2, 1.5], "blend size 2 must be a positive integer, got 1.5"),
        ([1, "x"], "blend size 1 must be a positive integer, got 'x'"),
        ([], "between 1 and 32766 datasets"),
    ],
)
def test_exhaustive_blending_refuses_bad_sizes(sizes, message):
    with pytest.raises(DataConfigError, match=re.escape(message)):
        build_exhaustive_blending_indices(sizes)


def test_exhaustive_blending_accepts_integral_floats():
    # Megatron allows float weights with integral values for an exhaustive blend.
    assert_same_array(build_exhaustive_blending_indices([2.0, 3.0])[0], megatron_exhaustive([2, 3])[0])


def test_other_refusals():
    with pytest.raises(DataConfigError, match="sequence_length must be >= 1"):
        num_epochs(10, 0, 1, True)
    with pytest.raises(DataConfigError, match="num_samples must be >= 0"):
        num_epochs(10, 4, -1, True)
    with pytest.raises(DataConfigError, match="num_epochs must be >= 1"):
        build_document_index(np.arange(3), 0, np.random.RandomState(0), False)
    with pytest.raises(DataConfigError, match="0 <= num_samples <= total_size"):
        build_shuffle_index(5, 4, np.random.RandomState(0))
    with pytest.raises(DataConfigError, match="must be normalised"):
        blended_sample_counts([30, 70], 10, 0.0)
