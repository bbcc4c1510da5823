"""Collate functions: pack variable-length Online samples into one row, stack fixed-length Indexed samples.

Owns: turning the samples of one micro-batch into a ``Batch`` (``batching.batch``: the one contract both paths
follow, documented with a worked example in the package README). Online ``ModelSample``s (``input_ids`` and
already-shifted ``labels``) are concatenated into a single ``[1, packed_length]`` row with ``cu_seq_lens`` marking
the sequence boundaries for variable-length attention; the row is padded at its tail to the multiple that
context/tensor parallelism (and the attention kernels) need, and that padding is recorded as one extra synthetic
sequence with ``IGNORE_INDEX`` labels, so that it attends only to itself; for the ``zigzag_thd`` context-parallel
layout each sample is also padded at its own end to a multiple of ``2 * cp`` (``pad_each_sequence_to``), inside its
sequence. Indexed samples, already of equal length,
are stacked into ``[micro_batch_size, seq_length]`` rows; their ``tokens`` become ``input_ids`` here (the one
place the name changes), their labels become ``IGNORE_INDEX`` where the dataset's loss mask is 0, and their
``cu_seq_lens`` end a sequence after each EOD and at each row end (``batching.sequence_boundaries``). Not responsible
for: choosing which samples form a batch (the samplers in ``parallel``), splitting the packed row across
context-parallel ranks, or tokenization.

Worked example, alignment 4, samples of lengths 3 and 2: the row holds 5 tokens plus 3 pad tokens (labels
``IGNORE_INDEX``) and ``cu_seq_lens = [0, 3, 5, 8]``; with lengths 3 and 1 it holds 4 tokens and
``cu_seq_lens = [0, 3, 4]``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.sequence_boundaries import indexed_cu_seq_lens
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError, require_int
from hyper_parallel.data.indexed.ltor_fields import positions_within_sequences
from hyper_parallel.data.parallel.batch_parallel import CP_LAYOUTS
from hyper_parallel.data.tokenizer_protocol import read_tokenizer

__all__ = [
    "IndexedStackingCollator",
    "TextPackingCollator",
    "build_indexed_collate_fn",
    "build_online_text_collate_fn",
    "indexed_batch",
    "sequence_alignment",
]

logger = get_logger(__name__)

_INT32_MAX = int(np.iinfo(np.int32).max)
_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


def sequence_alignment(
    *,
    cp_size: int = 1,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    sequence_multiple: int = 1,
    cp_layout: str = "contiguous",
) -> int:
    """Return the multiple every packed row length must be padded to.

    Context parallelism splits the row into ``cp_size`` parts (``2 * cp_size`` chunks for the zigzag layouts);
    sequence parallelism further splits each rank's part across the ``tp_size`` tensor-parallel ranks. An extra
    multiple required by the kernels (e.g. 32) is combined with that by least common multiple, so every constraint
    holds at once.

    Args:
        cp_size: context-parallel size.
        tp_size: tensor-parallel size; counts only with ``sequence_parallel``.
        sequence_parallel: whether activations are split along the sequence across tensor-parallel ranks.
        sequence_multiple: any further multiple the row length must satisfy.
        cp_layout: how ``ParallelBatch`` cuts rows across CP ranks (``parallel.batch_parallel.CP_LAYOUTS``).

    Returns:
        ``lcm(cp_size * tp_size if sequence_parallel else cp_size, 2 * cp_size for zigzag layouts when cp_size > 1,
        sequence_multiple)``.

    Raises:
        DataConfigError: a size is not a positive integer, ``sequence_parallel`` is not a bool, or the layout is
            unknown.

    Example:
        ``cp_size=2, tp_size=4, sequence_parallel=True`` gives 8; adding ``sequence_multiple=32`` gives 32, and
        ``sequence_multiple=12`` gives 24. ``cp_size=2, cp_layout="zigzag"`` gives 4.
    """
    cp = _setting(cp_size, "cp_size", "the context-parallel size of the trainer (1 without context parallelism)")
    if cp_layout not in CP_LAYOUTS:
        close = difflib.get_close_matches(str(cp_layout), CP_LAYOUTS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise DataConfigError(
            f"cp_layout is {cp_layout!r}{hint}; use one of {', '.join(CP_LAYOUTS)}, the layout of the get_batch node"
        )
    chunks = 2 * cp if cp_layout != "contiguous" and cp > 1 else cp
    tp = _setting(tp_size, "tp_size", "the tensor-parallel size of the trainer (1 without tensor parallelism)")
    multiple = _setting(
        sequence_multiple, "sequence_multiple", "a multiple the attention kernels need, such as 32 (1 for none)"
    )
    if not isinstance(sequence_parallel, bool | np.bool_):
        raise DataConfigError(
            f"sequence_parallel must be true or false, got {sequence_parallel!r} ({type(sequence_parallel).__name__});"
            " set it as the trainer does: true when activations are split along the sequence across tensor-parallel"
            " ranks"
        )
    return math.lcm(cp * tp if sequence_parallel else cp, chunks, multiple)


def _setting(value, name: str, meaning: str, minimum: int = 1) -> int:
    """``require_int`` with the fix: what the setting is and which values are valid."""
    try:
        return require_int(name, value, minimum)
    except DataConfigError as error:
        raise DataConfigError(f"{error}; set {name} to {meaning}") from None


def _field(sample: Any, key: str, index: int) -> np.ndarray:
    """Field ``key`` of sample ``index`` as a 1-D integer numpy array (no copy when it already is one)."""
    value = sample.get(key) if type(sample) is dict else None
    if type(value) is np.ndarray and value.ndim == 1 and value.dtype.kind in "iu" and len(value):
        return value  # what the transforms produce; checked without the general conversions below
    if not isinstance(sample, Mapping):
        raise DataFileError(
            f"sample {index} of the batch is a {type(sample).__name__}, not a mapping with 'input_ids' and "
            "'labels'; the dataset must return one dict per sample"
        )
    if key not in sample:
        raise DataFileError(
            f"sample {index} of the batch has no {key!r} (its keys: {sorted(map(str, sample))}); "
            "Online samples need 'input_ids' and 'labels'"
        )
    value = sample[key]
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.ndim != 1:
        raise DataFileError(
            f"sample {index} of the batch: {key!r} must be 1-D, got shape {tuple(array.shape)}; pass one "
            "unbatched sequence per sample"
        )
    if len(array) == 0:
        raise DataFileError(f"sample {index} of the batch: {key!r} is empty; drop zero-length samples before batching")
    if not np.issubdtype(array.dtype, np.integer):
        raise DataFileError(f"sample {index} of the batch: {key!r} must hold integer ids, got dtype {array.dtype}")
    return array


class TextPackingCollator:
    """Pack Online samples into one ``[1, packed_length]`` row with ``cu_seq_lens`` boundaries: a ``Batch``.

    Padding, label shift and mask polarity follow the batch contract (``batching.batch``). Picklable (plain
    attributes only), so it can be handed to ``DataLoader`` workers.

    Attributes:
        alignment: the packed length is padded at its tail to a multiple of this.
        pad_token_id: input id used for that padding (its labels are ``IGNORE_INDEX``).
        position_ids: also return ``position_ids``, restarting at 0 at every sequence (the padding included).
        pad_each_sequence_to: every sample is padded at its end to a multiple of this, inside its own sequence
            (``2 * cp_size`` for the ``zigzag_thd`` context-parallel layout; 1 for none).
    """

    def __init__(
        self, *, alignment: int = 1, pad_token_id: int = 0, position_ids: bool = False, pad_each_sequence_to: int = 1
    ) -> None:
        """Validate and store the settings.

        Args:
            alignment: multiple of the packed length, usually from ``sequence_alignment``.
            pad_token_id: a valid token id (``>= 0``); it is never trained on, but it goes through the embedding.
            pad_each_sequence_to: multiple of every sequence's length; the padding of a sequence is at its end,
                with ``pad_token_id`` inputs and ``IGNORE_INDEX`` labels, and belongs to that sequence in
                ``cu_seq_lens``. ``alignment`` must be a multiple of it, so that the tail padding is one too.

        Raises:
            DataConfigError: a setting is not a non-negative integer, the alignment or ``pad_each_sequence_to``
                is 0, or the alignment is not a multiple of ``pad_each_sequence_to``.
        """
        self.alignment = _setting(
            alignment,
            "alignment",
            "the multiple of the packed length, as sequence_alignment(cp_size=..., tp_size=..., sequence_parallel=..., "
            "sequence_multiple=...) computes it (build_online_text_collate_fn does)",
        )
        self.pad_token_id = _setting(
            pad_token_id,
            "pad_token_id",
            "a token id of the vocabulary (the padding carries no loss and is its own sequence, so 0 works)",
            minimum=0,
        )
        if not isinstance(position_ids, bool):
            raise DataConfigError(f"position_ids must be true or false, got {position_ids!r}")
        self.position_ids = position_ids
        self.pad_each_sequence_to = _setting(
            pad_each_sequence_to,
            "pad_each_sequence_to",
            "the multiple every sequence's length is padded to (2 * cp_size for the zigzag_thd layout, else 1)",
        )
        if self.alignment % self.pad_each_sequence_to:
            raise DataConfigError(
                f"alignment {self.alignment} is not a multiple of pad_each_sequence_to {self.pad_each_sequence_to}, "
                "so the tail padding would be a sequence of another multiple; set alignment to "
                f"{math.lcm(self.alignment, self.pad_each_sequence_to)} (their least common multiple)"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(alignment={self.alignment}, pad_token_id={self.pad_token_id}, "
            f"position_ids={self.position_ids}, pad_each_sequence_to={self.pad_each_sequence_to})"
        )

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> Batch:
        """Concatenate ``samples`` into one padded row.

        Args:
            samples: K mappings, each with 1-D integer ``input_ids`` and ``labels`` of the same length ``>= 1``
                (numpy arrays, lists or tensors).

        Returns:
            A ``Batch``: ``input_ids``, ``labels`` and ``loss_mask`` ``[1, packed_length]``; ``cu_seq_lens`` int32
            ``[K + 1]``, or ``[K + 2]`` when tail padding was added (the padding is its own final sequence).

        Raises:
            DataFileError: the batch is empty, or a sample is not a mapping, lacks a field, has a field that is
                not 1-D integer, is empty, or has ``input_ids`` and ``labels`` of different lengths.
        """
        if len(samples) == 0:
            raise DataFileError("the batch holds no samples; a micro-batch needs at least one sample to pack")
        inputs, labels = [], []
        for index, sample in enumerate(samples):
            ids, targets = _field(sample, "input_ids", index), _field(sample, "labels", index)
            if len(ids) != len(targets):
                raise DataFileError(
                    f"sample {index} of the batch has {len(ids)} input_ids but {len(targets)} labels; labels "
                    "must be shifted in place (one per input id, IGNORE_INDEX where there is no loss)"
                )
            inputs.append(ids)
            labels.append(targets)

        lengths = np.fromiter(map(len, inputs), dtype=np.int64, count=len(inputs))
        padded = lengths + -lengths % self.pad_each_sequence_to  # each sequence's length with its own padding
        total = int(padded.sum())
        pad = -total % self.alignment
        packed_length = total + pad
        if packed_length > _INT32_MAX:
            raise DataFileError(
                f"the packed row would hold {packed_length} tokens, more than cu_seq_lens (int32) can address; "
                "use a smaller micro-batch"
            )
        # One allocation per output; every padding is written by ``full`` and the samples by one concatenate.
        input_row = np.full(packed_length, self.pad_token_id, dtype=np.int64)
        label_row = np.full(packed_length, IGNORE_INDEX, dtype=np.int64)
        cu_seq_lens = np.zeros(len(lengths) + 1 + (pad > 0), dtype=np.int32)
        np.cumsum(padded, out=cu_seq_lens[1 : len(lengths) + 1])
        if total == lengths.sum():
            np.concatenate(inputs, out=input_row[:total])
            np.concatenate(labels, out=label_row[:total])
        else:
            # Lengths 3 and 2 padded to 4: tokens go to [0, 1, 2] and [4, 5], i.e. each token's index among the
            # samples' tokens plus the padding of the sequences before its own: [0, 0, 0, 1, 1].
            shift = np.repeat(cu_seq_lens[: len(lengths)] - (np.cumsum(lengths) - lengths), lengths)
            where = np.arange(int(lengths.sum())) + shift
            input_row[where] = np.concatenate(inputs)
            label_row[where] = np.concatenate(labels)
        if pad:
            cu_seq_lens[-1] = packed_length
        positions = positions_within_sequences(cu_seq_lens) if self.position_ids else None
        return Batch(
            input_ids=torch.from_numpy(input_row).unsqueeze(0),
            labels=torch.from_numpy(label_row).unsqueeze(0),
            cu_seq_lens=torch.from_numpy(cu_seq_lens),
            position_ids=None if positions is None else torch.from_numpy(positions).unsqueeze(0),
        )


def build_online_text_collate_fn(
    tokenizer: Any = None,
    *,
    cp_size: int = 1,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    sequence_multiple: int = 1,
    pad_token_id: int | None = None,
    position_ids: bool = False,
    cp_layout: str = "contiguous",
) -> TextPackingCollator:
    """Build the packing collator of the Online path for a parallel layout.

    Args:
        tokenizer: optional; its ``pad_token_id`` is the padding id when ``pad_token_id`` is not given.
        cp_size, tp_size, sequence_parallel, sequence_multiple, cp_layout: see ``sequence_alignment``;
            ``cp_layout="zigzag_thd"`` with ``cp_size > 1`` also pads every sequence to a multiple of
            ``2 * cp_size`` (``pad_each_sequence_to``). ``build_dataloaders`` passes the sizes and the
            ``get_batch`` node's layout.
        pad_token_id: explicit padding id; otherwise the tokenizer's, otherwise 0 (the padding carries no loss
            and is its own sequence in ``cu_seq_lens``, so any valid id works). With a tokenizer, it must lie in its
            vocabulary: the padding goes through the embedding.
        position_ids: also return ``position_ids`` that restart at every sequence of the packed row.

    Returns:
        A picklable ``TextPackingCollator``.

    Raises:
        DataConfigError: a size or the padding id is invalid, or the padding id is past the tokenizer's vocabulary.
    """
    alignment = sequence_alignment(
        cp_size=cp_size,
        tp_size=tp_size,
        sequence_parallel=sequence_parallel,
        sequence_multiple=sequence_multiple,
        cp_layout=cp_layout,
    )
    tokens = None if tokenizer is None else read_tokenizer(tokenizer)
    if pad_token_id is None and tokens is not None:
        pad_token_id = tokens.pad
    if pad_token_id is None:
        pad_token_id = 0
    collator = TextPackingCollator(
        alignment=alignment,
        pad_token_id=pad_token_id,
        position_ids=position_ids,
        pad_each_sequence_to=2 * cp_size if cp_layout == "zigzag_thd" and cp_size > 1 else 1,
    )
    check_pad_token_id(collator.pad_token_id, tokens, "collate_fn")
    return collator


def check_pad_token_id(pad_token_id: int, tokens, node: str) -> None:
    """Refuse a padding id at or past the vocabulary of ``tokens`` (a ``read_tokenizer`` result, or None when no
    tokenizer is known): the padding goes through the embedding, which has no row for it.

    Raises:
        DataConfigError: naming ``node``, the node whose ``pad_token_id`` it is, and the vocabulary.
    """
    vocab_size = None if tokens is None else tokens.vocab_size
    if vocab_size is not None and pad_token_id >= vocab_size:
        raise DataConfigError(
            f"pad_token_id {pad_token_id} is outside the vocabulary [0, {vocab_size}) of tokenizer {tokens.name}: "
            f"the padding goes through the embedding, which has no row for it. Set pad_token_id on the {node} node "
            f"to an id below {vocab_size} (0 works: the padding carries no loss), or leave it unset to use the "
            "tokenizer's"
        )


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(np.shape(value))


_INDEXED_FIELDS = ("tokens", "labels", "loss_mask")


def _stack(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The samples' fields stacked by ``default_collate``, after checking that they agree."""
    if len(samples) == 0:
        raise DataFileError("the batch holds no samples; a micro-batch needs at least one sample to stack")
    first = samples[0]
    for index, sample in enumerate(samples):
        if sample is None:
            raise DataFileError(
                f"sample {index} of the batch is None; Indexed datasets return a dict for every index (batch "
                "padding uses dataset[None], which is a dict with a zero loss mask), so check the dataset or sampler"
            )
        if not isinstance(sample, Mapping):
            raise DataFileError(f"sample {index} of the batch is a {type(sample).__name__}, not a dict of arrays")
        if sample.keys() != first.keys():
            missing = sorted(map(str, first.keys() - sample.keys()))
            extra = sorted(map(str, sample.keys() - first.keys()))
            raise DataFileError(
                f"sample {index} of the batch has different fields from sample 0 (missing {missing}, extra "
                f"{extra}); every sample of a batch must come from datasets with the same configuration"
            )
        if index:
            for key, value in sample.items():
                if _shape(value) != _shape(first[key]):
                    raise DataFileError(
                        f"sample {index} of the batch: field {key!r} has shape {_shape(value)} but sample 0's has "
                        f"{_shape(first[key])}; Indexed samples must all have seq_length tokens"
                    )
    missing = [key for key in _INDEXED_FIELDS if key not in first]
    if missing:
        raise DataFileError(
            f"the samples have no {missing} (their fields: {sorted(map(str, first))}); Indexed samples need "
            f"{list(_INDEXED_FIELDS)}, as GPTDataset returns them"
        )
    return default_collate(list(samples))


def _stacked_array(stacked: dict[str, Any], key: str) -> torch.Tensor:
    """Field ``key`` of the stacked samples, removed from ``stacked``; an error unless samples held arrays."""
    value = stacked.pop(key)
    if not isinstance(value, torch.Tensor) or value.ndim != 2:
        raise DataFileError(
            f"the samples' {key!r} did not stack into a [micro_batch_size, seq_length] tensor; each sample's "
            f"{key!r} must be a 1-D numpy array or tensor, as GPTDataset returns it"
        )
    return value


class IndexedStackingCollator:
    """Stack fixed-length Indexed samples into a ``Batch`` of ``[micro_batch_size, seq_length]`` rows.

    Each sample is a dict of equal-length arrays (``tokens``, ``labels``, ``loss_mask``, optional ``position_ids``
    and ``attention_mask``) and scalars such as ``dataset_id``; numpy arrays and torch tensors both work. Following
    the batch contract (``batching.batch``): ``tokens`` become ``input_ids``; labels are ``IGNORE_INDEX`` where
    the loss mask is 0 (padding, EOD inputs under ``eod_mask_loss``, batch-padding samples), so the batch's
    ``loss_mask`` equals the dataset's; ``cu_seq_lens`` end a sequence after each EOD input and at each row end,
    the rule of megatron-core's ``reset_position_ids``/``reset_attention_mask``, and after an EOD label not followed
    by the EOD input (``sequence_boundaries.eod_sequence_ends``, the rule ``get_batch`` uses too); the attention
    mask keeps megatron-core's polarity (True = masked out); other fields go to ``Batch.extras``. Picklable (plain
    attributes only), so it can be handed to ``DataLoader`` workers.

    Attributes:
        eod_token_id: the EOD id that ends a sequence; None makes each row one sequence.
    """

    def __init__(self, *, eod_token_id: int | None = None) -> None:
        """Validate and store the EOD id.

        Raises:
            DataConfigError: ``eod_token_id`` is given and is not a non-negative integer.
        """
        if eod_token_id is not None:
            eod_token_id = _setting(eod_token_id, "eod_token_id", "the tokenizer's EOD (EOS) token id", minimum=0)
        self.eod_token_id = eod_token_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}(eod_token_id={self.eod_token_id})"

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> Batch:
        """Stack ``samples`` into one ``Batch``.

        Raises:
            DataFileError: the batch is empty, a sample is None or not a mapping, the samples' fields differ or
                lack ``tokens``/``labels``/``loss_mask``, or a field's shape differs from sample 0's.
        """
        return indexed_batch(_stack(samples), eod_token_id=self.eod_token_id)


def indexed_batch(stacked: Mapping[str, Any], *, eod_token_id: int | None) -> Batch:
    """The ``Batch`` of Indexed samples already stacked into ``[B, S]`` tensors (megatron-core's batch dict).

    The one place where ``tokens`` becomes ``input_ids`` and the labels become ``IGNORE_INDEX`` where the loss
    mask is 0; used by ``IndexedStackingCollator`` and by readers handed a plain megatron-style dict.

    Args:
        stacked: ``tokens``, ``labels``, ``loss_mask`` ``[B, S]`` tensors, optional ``position_ids`` and
            ``attention_mask``; other fields become extras. Not modified.
        eod_token_id: the EOD id that ends a sequence; None makes each row one sequence.

    Raises:
        DataFileError: a required field is missing or is not a ``[B, S]`` tensor.
    """
    stacked = dict(stacked)
    missing = [key for key in _INDEXED_FIELDS if key not in stacked]
    if missing:
        raise DataFileError(
            f"the Indexed batch has no {missing} (its fields: {sorted(map(str, stacked))}); Indexed batches need "
            f"{list(_INDEXED_FIELDS)}, as GPTDataset's samples stacked by default_collate hold them"
        )
    tokens, labels, loss_mask = (_stacked_array(stacked, key) for key in _INDEXED_FIELDS)
    tokens = tokens.long()  # no copy for the datasets' int64
    labels = labels.long().masked_fill(loss_mask == 0, IGNORE_INDEX)  # out of place: the caller's stay unchanged
    return Batch(
        input_ids=tokens,
        labels=labels,
        cu_seq_lens=indexed_cu_seq_lens(tokens, labels, eod_token_id),
        position_ids=stacked.pop("position_ids", None),
        attention_mask=stacked.pop("attention_mask", None),
        extras=stacked,
    )


def _eod_of(tokenizer: Any) -> int:
    """The tokenizer's EOD id, found as the Indexed datasets find it (``eod``, else ``eos_token_id``)."""
    eod = read_tokenizer(tokenizer).eod
    if eod is None:
        raise DataConfigError(
            f"the tokenizer ({type(tokenizer).__name__}) has no EOD/EOS token id, so the Indexed collator cannot tell "
            "where documents end; set eod_token_id on the collate_fn node, or use a tokenizer with an EOS token"
        )
    return eod


def build_indexed_collate_fn(tokenizer: Any = None, *, eod_token_id: int | None = None) -> IndexedStackingCollator:
    """Build the collator of the Indexed path (``IndexedStackingCollator``; picklable).

    Args:
        tokenizer: its EOD id (``eod``, else ``eos_token_id``) ends the sequences of ``cu_seq_lens``, unless
            ``eod_token_id`` is given. ``build_dataloaders`` passes the pipeline's tokenizer.
        eod_token_id: explicit EOD id.

    Without either, each row is one sequence, and a warning says so.

    Raises:
        DataConfigError: the EOD id is invalid, or a tokenizer without an EOD/EOS id is given.
    """
    if eod_token_id is None and tokenizer is not None:
        eod_token_id = _eod_of(tokenizer)
    if eod_token_id is None:
        logger.warning(
            "the Indexed collator has no EOD id: cu_seq_lens mark row ends only, so each row is one sequence; "
            "pass the tokenizer (build_dataloaders does) or eod_token_id to build_indexed_collate_fn"
        )
    return IndexedStackingCollator(eod_token_id=eod_token_id)
