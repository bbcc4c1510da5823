"""Index arrays of Megatron-Core's ``GPTDataset`` and ``BlendedDataset``, reproduced exactly.

Owns the pure functions that turn a split's sequence ids and lengths into the document, sample and shuffle
index arrays, and blend weights into blending indices: epoch count, the "separate final epoch" rule, the
legacy ``RandomState`` shuffles (large ones in the package's C helper), the sample boundaries and blending
schedules (sequential walks, in the C helper too), blend-weight normalisation and the builder's per-dataset
sample counts. Every array matches Megatron's values and dtypes bit for bit. Not responsible for caching, file
I/O, hashing or the dataset classes that use these arrays.

Notation, as in Megatron: ``T`` tokens per epoch, ``S`` sequence length, ``N`` requested samples, ``E`` epochs,
``x`` = 1 when every sample carries one extra token (the label of its last position), else 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed import _indexed_helpers

__all__ = [
    "GPTIndices",
    "MAX_BLENDED_DATASETS",
    "SEPARATE_FINAL_EPOCH_THRESHOLD",
    "blended_sample_counts",
    "build_blending_indices",
    "build_document_index",
    "build_exhaustive_blending_indices",
    "build_gpt_indices",
    "build_sample_index",
    "build_shuffle_index",
    "normalize_weights",
    "num_epochs",
    "num_samples_sans_final_epoch",
    "sample_count",
    "sample_index_dtype",
    "separate_final_epoch",
    "shuffle_index_dtype",
]

# The final epoch is shuffled on its own when it would supply fewer than this share of an epoch's samples.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
# Dataset ids are stored as int16, and Megatron requires strictly fewer datasets than this.
MAX_BLENDED_DATASETS = 32767

_INT32_MAX = int(np.iinfo(np.int32).max)
# Megatron switches the shuffle index to int64 at uint32.max - 1, one below where uint32 would overflow.
_UINT32_SHUFFLE_LIMIT = int(np.iinfo(np.uint32).max) - 1
# Below this length numpy's own shuffle is faster: reading and writing back a RandomState costs ~0.15 ms.
_NATIVE_SHUFFLE_MIN_SIZE = 1 << 14
_NATIVE_SHUFFLE_DTYPES = frozenset(np.dtype(t) for t in (np.int32, np.uint32, np.int64, np.uint64))


class GPTIndices(NamedTuple):
    """The three index arrays of one ``GPTDataset`` plus the epoch arithmetic that shaped them."""

    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray
    num_epochs: int
    separate_final_epoch: bool


def _where(where: str) -> str:
    return f"{where}: " if where else ""


def _check_sequence_length(sequence_length: int, where: str = "") -> None:
    if sequence_length < 1:
        raise DataConfigError(f"{_where(where)}sequence_length must be >= 1, got {sequence_length}")


def num_epochs(
    tokens_per_epoch: int,
    sequence_length: int,
    num_samples: int | None,
    add_extra_token: bool,
    where: str = "",
) -> int:
    """Return the number of epochs needed to cut ``num_samples`` samples: the smallest ``E >= 1`` with
    ``E*T >= N*S + x``.

    Megatron finds ``E`` with a linear loop that never ends when ``T == 0``; here it is a closed form, and an
    empty split raises instead of hanging.

    Args:
        tokens_per_epoch: ``T``, the split's token count.
        sequence_length: ``S``.
        num_samples: ``N``; None means exactly one epoch.
        add_extra_token: whether each sample reads ``S + 1`` tokens.
        where: prefix for error messages, e.g. the dataset prefix and split name.

    Returns:
        The epoch count ``E``.

    Raises:
        DataConfigError: the split holds no tokens but samples are requested, or an argument is out of range.

    Example:
        T=17, S=4, N=7, x=1: 7*4 + 1 = 29 tokens are needed, ceil(29 / 17) = 2 epochs.
    """
    _check_sequence_length(sequence_length, where)
    if num_samples is None:
        return 1
    if num_samples < 0:
        raise DataConfigError(f"{_where(where)}num_samples must be >= 0, got {num_samples}")
    tokens_needed = num_samples * sequence_length + int(add_extra_token)
    if tokens_per_epoch <= 0:
        if tokens_needed <= 0:
            return 1  # N = 0 without an extra token: Megatron's loop exits at once
        raise DataConfigError(
            f"{_where(where)}the split holds no tokens (tokens_per_epoch={tokens_per_epoch}) but "
            f"{num_samples} samples of {sequence_length} tokens are requested; give the split a larger share "
            "of the data (e.g. change the split string) or request no samples from it"
        )
    return max(1, -(-tokens_needed // tokens_per_epoch))


def num_samples_sans_final_epoch(
    num_epochs: int, tokens_per_epoch: int, sequence_length: int, add_extra_token: bool
) -> int:
    """Return how many samples the first ``E - 1`` epochs hold: ``((E-1)*T - x) // S``.

    With a separate final epoch this is the length of the first shuffle range of the shuffle index.
    """
    return ((num_epochs - 1) * tokens_per_epoch - int(add_extra_token)) // sequence_length


def separate_final_epoch(
    num_epochs: int,
    tokens_per_epoch: int,
    sequence_length: int,
    num_samples: int | None,
    add_extra_token: bool,
    where: str = "",
) -> bool:
    """Return whether the final epoch is shuffled apart from the earlier ones (Megatron's 80 % rule).

    A final epoch that contributes fewer than ``int(0.80 * samples_per_epoch)`` samples is kept out of the
    global shuffle, so that its few documents are not spread over the whole run.

    Args:
        num_epochs: ``E``, from :func:`num_epochs`.
        tokens_per_epoch: ``T``.
        sequence_length: ``S``.
        num_samples: ``N``; may be None only when ``E == 1``.
        add_extra_token: ``x``.
        where: prefix for error messages.

    Returns:
        True when the final epoch is separate.

    Raises:
        DataConfigError: the inputs are inconsistent (the final epoch would supply a negative number of samples,
            or more than one epoch holds); Megatron asserts here.

    Example:
        T=21, S=4, N=7, x=1, E=2: 5 samples precede the final epoch, so it supplies 2 < int(0.8 * 5) = 4:
        separate.
    """
    if num_epochs == 1:
        return False
    if num_samples is None:
        raise DataConfigError(f"{_where(where)}num_samples=None means one epoch, got num_epochs={num_epochs}")
    _check_sequence_length(sequence_length, where)
    x = int(add_extra_token)
    from_final_epoch = num_samples - num_samples_sans_final_epoch(
        num_epochs, tokens_per_epoch, sequence_length, add_extra_token
    )
    per_epoch = (tokens_per_epoch - x) // sequence_length
    if not 0 <= from_final_epoch <= per_epoch + 1:
        raise DataConfigError(
            f"{_where(where)}the final of {num_epochs} epochs would supply {from_final_epoch} samples, outside "
            f"[0, {per_epoch + 1}] (tokens_per_epoch={tokens_per_epoch}, sequence_length={sequence_length}, "
            f"num_samples={num_samples}); num_epochs does not match the other arguments"
        )
    # Float multiply then truncation, exactly as Megatron.
    return from_final_epoch < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)


def _legacy_shuffle(rng: np.random.RandomState, array: np.ndarray) -> None:
    """Shuffle ``array`` in place exactly as ``rng.shuffle(array)`` would, advancing ``rng`` exactly as it would.

    A 1-D, C-contiguous, writable ndarray of a native 4- or 8-byte integer dtype, at least
    ``_NATIVE_SHUFFLE_MIN_SIZE`` long, drawn from an MT19937 ``RandomState``, is shuffled by the C helper: it copies the
    generator state (``get_state``), runs numpy's legacy algorithm on it (the same MT19937 draws, ``random_interval``
    and swaps from the last element down) without the GIL and with the swap targets prefetched, then writes the
    advanced state back (``set_state``; the cached Gaussian is kept), so the permutation and every later draw are
    bit-identical to numpy's. Anything else goes to ``rng.shuffle``.
    """
    if (
        isinstance(rng, np.random.RandomState)
        and type(array) is np.ndarray
        and array.ndim == 1
        and array.size >= _NATIVE_SHUFFLE_MIN_SIZE
        and array.dtype in _NATIVE_SHUFFLE_DTYPES
        and array.flags.c_contiguous
        and array.flags.writeable
    ):
        state = rng.get_state(legacy=False)
        if state["bit_generator"] == "MT19937":
            key = np.array(state["state"]["key"], dtype=np.uint32)
            pos = _indexed_helpers.legacy_shuffle(array, key, state["state"]["pos"])
            rng.set_state({**state, "state": {"key": key, "pos": pos}})
            return
    rng.shuffle(array)


def build_document_index(
    indices: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """Tile the split's sequence ids ``num_epochs`` times (epoch-major) and shuffle them, as Megatron does.

    Without a separate final epoch all epochs are shuffled together in one ``rng.shuffle`` call, so documents
    of different epochs interleave. With one, the first ``E - 1`` epochs are shuffled together and then the
    final epoch on its own, consuming ``rng`` in that order. The legacy ``RandomState.shuffle`` permutation
    depends only on the seed, the length and the call order, not on the dtype.

    Args:
        indices: the split's (global) sequence ids, int32-representable.
        num_epochs: ``E >= 1``.
        rng: the dataset's ``RandomState(random_seed)``; advanced in place.
        separate_final_epoch: from :func:`separate_final_epoch`.

    Returns:
        int32 array of length ``E * len(indices)``.

    Example:
        indices [0..4], E=1, RandomState(1234): ``[4, 0, 1, 2, 3]``.
    """
    if num_epochs < 1:
        raise DataConfigError(f"num_epochs must be >= 1, got {num_epochs}")
    indices = np.asarray(indices).astype(np.int32, copy=False)
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.tile(indices, num_epochs)
        _legacy_shuffle(rng, document_index)
        return document_index
    first = build_document_index(indices, num_epochs - 1, rng, False)
    last = build_document_index(indices, 1, rng, False)
    return np.concatenate((first, last))


def sample_count(
    num_epochs: int, tokens_per_epoch: int, sequence_length: int, drop_last: bool, add_extra_token: bool
) -> int:
    """Return the number of samples in the sample index, computed exactly as Megatron's C++ does.

    With ``drop_last`` it is ``(E*T - x) // S``. Otherwise it is ``ceil(float32(E*T - x) / float32(S))``: the
    count, the division and the ceil are all single precision, so above 2**24 tokens the result can be one too
    few or one too many (a too-many count ends in a row from the last-document branch of
    :func:`build_sample_index`). A negative numerator (an empty split with an extra token) gives 0.

    Example:
        E*T - x = 2**24 + 1, S = 4096, no drop_last: float32 rounds the count to 2**24, giving 4096 samples
        where the exact ceil is 4097.
    """
    _check_sequence_length(sequence_length)
    tokens = num_epochs * tokens_per_epoch - int(add_extra_token)
    if tokens <= 0:
        return 0  # C++ truncates the division toward zero
    if drop_last:
        return tokens // sequence_length
    # An int64 -> float32 array cast rounds once, like C++; converting a Python int would go through float64.
    tokens_f32 = np.array(tokens, dtype=np.int64).astype(np.float32)
    return int(np.ceil(tokens_f32 / np.float32(sequence_length)))


def sample_index_dtype(document_index_length: int, max_sequence_length: int) -> np.dtype:
    """Return the sample index dtype Megatron's ``helpers.build_sample_idx`` picks.

    int32 when ``max(len(document_index), max(sequence_lengths)) <= INT32_MAX``, else int64. The lengths are
    those of the whole file, not only the split.
    """
    if max(document_index_length, max_sequence_length) <= _INT32_MAX:
        return np.dtype(np.int32)
    return np.dtype(np.int64)


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last: bool,
    add_extra_token: bool,
) -> np.ndarray:
    """Build the ``[n + 1, 2]`` sample index, identical in values and dtype to Megatron's ``build_sample_idx``.

    Row ``k`` is ``(position in document_index, token offset in that document)`` of the boundary between sample
    ``k - 1`` and sample ``k``; sample ``k`` reads ``S + x`` tokens from row ``k``, so with ``x = 1`` consecutive
    samples share one token. The walk over documents runs in the package's C helper, one pass as in Megatron:
    boundary ``k`` lies in the first document whose cumulative end reaches ``k*S + x``, so with ``x = 0`` a sample
    ending exactly at a document's end stores ``(d, len(d))``, zero-length documents are never chosen, and a
    boundary past the end of the data (the final partial sample without ``drop_last``) gets Megatron's
    last-document row ``(last position, len(last) - x)``.

    Example (lengths [5, 3, 7, 2], document_index [0, 1, 2, 3], S=4, E=1, T=17)::

        x=1: rows [[0,0], [0,4], [2,0], [2,4], [3,1]]
        x=0: rows [[0,0], [0,4], [1,3], [2,4], [3,1]] (+ [3,2] without drop_last)

    Args:
        sequence_lengths: int lengths of **all** sequences of the file (the dtype choice depends on its maximum).
        document_index: int array of sequence ids, from :func:`build_document_index`.
        sequence_length: ``S``.
        num_epochs: ``E``.
        tokens_per_epoch: ``T``; trusted, as in Megatron.
        drop_last: drop the final partial sample (Megatron: always for train and test).
        add_extra_token: ``x``.

    Returns:
        int32 (or int64 for more than 2**31 - 1 documents or tokens in a sequence) array of shape ``[n + 1, 2]``,
        ``n`` from :func:`sample_count`.

    Raises:
        DataConfigError: the document index is empty while samples are requested, or the final partial sample
            ends in an empty document with an extra token (Megatron's wrapper rejects the resulting offset -1).
    """
    x = int(add_extra_token)
    sequence_lengths = np.asarray(sequence_lengths)
    document_index = np.asarray(document_index)
    n = sample_count(num_epochs, tokens_per_epoch, sequence_length, drop_last, add_extra_token)
    max_length = int(sequence_lengths.max()) if sequence_lengths.size else 0
    sample_index = np.zeros((n + 1, 2), dtype=sample_index_dtype(len(document_index), max_length))
    if n == 0:
        return sample_index
    if len(document_index) == 0:
        raise DataConfigError(f"cannot cut {n} samples from an empty document index")

    _indexed_helpers.fill_sample_index(
        np.ascontiguousarray(sequence_lengths, dtype=np.int32),
        np.ascontiguousarray(document_index, dtype=np.int32),
        sample_index,
        sequence_length,
        x,
    )
    if sample_index[-1, 1] < 0:
        raise DataConfigError(
            "the final partial sample ends in an empty sequence (document index position "
            f"{len(document_index) - 1}, sequence {int(document_index[-1])}) with add_extra_token=True, "
            "which gives offset -1; Megatron rejects this index too. Use drop_last or remove empty sequences"
        )
    return sample_index


def shuffle_index_dtype(total_size: int) -> np.dtype:
    """Return the shuffle index dtype: uint32, or int64 once ``total_size >= 2**32 - 2`` (Megatron's bound)."""
    return np.dtype(np.int64) if total_size >= _UINT32_SHUFFLE_LIMIT else np.dtype(np.uint32)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Return a permutation of ``[0, total_size)`` that keeps ``[0, num_samples)`` ahead of the rest.

    ``[0, num_samples)`` is shuffled first, then (if ``num_samples < total_size``) ``[num_samples, total_size)``
    with the same ``rng``, and the two are concatenated; with a separate final epoch, ``num_samples`` is
    :func:`num_samples_sans_final_epoch` so the final epoch's samples come last.

    Args:
        num_samples: size of the first shuffle range.
        total_size: size of the whole index (the sample count ``n``).
        rng: the dataset's ``RandomState``, already advanced by :func:`build_document_index`.

    Returns:
        uint32 array (int64 from ``total_size >= 2**32 - 2``) of length ``total_size``.

    Example:
        n = 10, 5 samples before the final epoch, seed 1234 after the document shuffles of the golden case:
        ``[2, 0, 4, 3, 1, 6, 9, 5, 7, 8]``.
    """
    if not 0 <= num_samples <= total_size:
        raise DataConfigError(f"need 0 <= num_samples <= total_size, got {num_samples} and {total_size}")
    dtype = shuffle_index_dtype(total_size)
    first = np.arange(num_samples, dtype=dtype)
    _legacy_shuffle(rng, first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    _legacy_shuffle(rng, last)
    return np.concatenate((first, last))


def build_gpt_indices(
    sequence_lengths: np.ndarray,
    indices: np.ndarray,
    sequence_length: int,
    num_samples: int | None,
    random_seed: int,
    drop_last: bool,
    add_extra_token: bool,
    where: str = "",
) -> GPTIndices:
    """Build the document, sample and shuffle indices of one ``GPTDataset`` split, in Megatron's RNG order.

    A fresh ``RandomState(random_seed)`` is consumed by the document shuffle(s), then the shuffle-index
    shuffle(s).

    Args:
        sequence_lengths: lengths of all sequences of the file.
        indices: the split's sequence ids.
        sequence_length: ``S``.
        num_samples: ``N``, or None for one epoch.
        random_seed: the config's seed (the same for every prefix and split in Megatron).
        drop_last: drop the final partial sample (Megatron: True except for a validation split configured
            otherwise).
        add_extra_token: ``x``.
        where: prefix for error messages.

    Returns:
        The three arrays, the epoch count and whether the final epoch was shuffled separately.
    """
    indices = np.asarray(indices)
    tokens_per_epoch = int(np.sum(np.asarray(sequence_lengths)[indices], dtype=np.int64))
    epochs = num_epochs(tokens_per_epoch, sequence_length, num_samples, add_extra_token, where)
    separate = separate_final_epoch(epochs, tokens_per_epoch, sequence_length, num_samples, add_extra_token, where)
    rng = np.random.RandomState(random_seed)
    document_index = build_document_index(indices, epochs, rng, separate)
    sample_index = build_sample_index(
        sequence_lengths, document_index, sequence_length, epochs, tokens_per_epoch, drop_last, add_extra_token
    )
    total = sample_index.shape[0] - 1
    first = num_samples_sans_final_epoch(epochs, tokens_per_epoch, sequence_length, add_extra_token)
    shuffle_index = build_shuffle_index(first if separate else total, total, rng)
    return GPTIndices(document_index, sample_index, shuffle_index, epochs, separate)


def normalize_weights(weights: Sequence[float]) -> list[float]:
    """Return ``w / sum(w)`` in float64 numpy arithmetic as Python floats, exactly as Megatron normalises."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def blended_sample_counts(
    weights: Sequence[float], num_samples: int, surplus: float
) -> tuple[list[int], list[int], int]:
    """Return the builder's per-dataset sample targets, per-dataset buffers and the blended size.

    ``target[k] = ceil(N * w_k)``; ``buffer[k] = ceil(ceil(N * w_k) * (1 + surplus))``, the ``num_samples`` each
    mid-level dataset is built with; the blended size is ``sum(target)``, which can exceed ``N``. All in Python
    float arithmetic, as Megatron's builder.

    Args:
        weights: normalised weights (:func:`normalize_weights`); not normalised again here, because a second
            normalisation may move a weight by one ulp and change a ceil.
        num_samples: ``N``, the blended split's requested size.
        surplus: ``mid_level_dataset_surplus`` (Megatron default 0.005).

    Returns:
        ``(targets, buffers, blended_size)``.

    Example:
        w = [0.3, 0.7], N = 50, surplus 0.005: targets [15, 35], buffers [16, 36], size 50; N = 5 gives size 6.
    """
    if not np.isclose(sum(weights), 1.0):  # Megatron's own check
        raise DataConfigError(f"blend weights must be normalised (sum 1), got {list(weights)} (sum {sum(weights)})")
    if num_samples < 0:
        raise DataConfigError(f"num_samples must be >= 0, got {num_samples}")
    targets = [math.ceil(num_samples * w) for w in weights]
    buffers = [math.ceil(target * (1 + surplus)) for target in targets]
    return targets, buffers, sum(targets)


def _check_dataset_count(count: int) -> None:
    if not 1 <= count < MAX_BLENDED_DATASETS:
        raise DataConfigError(
            f"a blend needs between 1 and {MAX_BLENDED_DATASETS - 1} datasets (ids are int16), got {count}"
        )


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(dataset_index int16, dataset_sample_index int64)`` of length ``size`` for a weighted blend.

    Megatron's greedy schedule: sample ``s`` goes to the dataset with the largest ``w_k * max(s, 1) - count_k``
    (ties to the lowest ``k``), computed in the C helper.

    Args:
        weights: positive finite weights, normally already normalised (:func:`normalize_weights`).
        size: number of blended samples.

    Raises:
        DataConfigError: no datasets, too many, a weight that is not finite and positive (naming its index and
            value), or a negative size.

    Example:
        w = [0.5, 0.25, 0.25], size 8: dataset_index [0, 1, 2, 0, 0, 1, 2, 0],
        dataset_sample_index [0, 0, 0, 1, 2, 1, 1, 3].
    """
    _check_dataset_count(len(weights))
    try:
        w = np.ascontiguousarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise DataConfigError(f"blend weights must be numbers, got {list(weights)}") from error
    bad = np.flatnonzero(~(np.isfinite(w) & (w > 0)))
    if bad.size:
        k = int(bad[0])
        raise DataConfigError(f"blend weight {k} must be finite and > 0, got {weights[k]!r}")
    if size < 0:
        raise DataConfigError(f"blend size must be >= 0, got {size}")
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    _indexed_helpers.build_blending_indices(dataset_index, dataset_sample_index, w)
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(dataset_index int16, dataset_sample_index int64)`` using every sample of every dataset once.

    Megatron's schedule for a blend without a requested size: weights ``sizes[k] / sum(sizes)``, the same greedy
    rule as :func:`build_blending_indices` over the datasets not yet spent.

    Args:
        sizes: positive integral sample counts, one per dataset.

    Raises:
        DataConfigError: no datasets, too many, or a size that is not a positive integer (naming its index).

    Example:
        sizes [1, 2, 3]: dataset_index [2, 1, 0, 2, 1, 2], dataset_sample_index [0, 0, 0, 1, 1, 2].
    """
    _check_dataset_count(len(sizes))
    counts = []
    for k, value in enumerate(sizes):
        try:
            count = int(value)
        except (TypeError, ValueError, OverflowError):
            count = None
        # A zero size would never be marked spent and Megatron's loop would not end.
        if count is None or count != value or count <= 0:
            raise DataConfigError(f"blend size {k} must be a positive integer, got {value!r}")
        counts.append(count)
    n = np.array(counts, dtype=np.int64)
    total = int(n.sum())
    dataset_index = np.zeros(total, dtype=np.int16)
    dataset_sample_index = np.zeros(total, dtype=np.int64)
    _indexed_helpers.build_exhaustive_blending_indices(dataset_index, dataset_sample_index, n)
    return dataset_index, dataset_sample_index
