"""Collate functions: pack variable-length Online samples into one row, stack fixed-length Indexed samples.

Owns: turning the samples of one micro-batch into a ``Batch`` (``batching.batch``: the one contract both paths
follow, documented with a worked example in the package README). Online ``ModelSample``s (``input_ids`` and
already-shifted ``labels``) are concatenated into a single ``[1, packed_length]`` row with ``cu_seq_lens`` marking
the sequence boundaries for variable-length attention. The row is padded at its tail to the multiple that the
delivery layout (``parallel.delivery_layout.DeliveryLayout.row_multiple``, and the attention kernels) needs; that
padding, with ``IGNORE_INDEX`` labels, is one extra dummy sequence (``tail_padding="append_dummy_seq"``, so that it
attends only to itself) or the end of the last sequence (``"extend_last"``). With per-sequence padding (the
layout's ``sequence_multiple``, ``2 * cp`` for ``zigzag_thd``) each sample is also padded at its own end, inside
its sequence; whenever a sequence can hold padding, the batch's ``cu_seq_lens_real`` count its real tokens beside
the padded ``cu_seq_lens``. Indexed samples, already of equal length, are stacked into ``[micro_batch_size,
seq_length]`` rows; megatron-core's names become the contract's here, once (``tokens`` to ``input_ids``,
``attention_mask`` to ``megatron_attention_mask``), their labels become ``IGNORE_INDEX`` where the dataset's loss
mask is 0, and their ``cu_seq_lens`` end a sequence after each EOD and at each row end
(``batching.sequence_boundaries``): the one place Indexed boundaries are computed. Not responsible for: choosing
which samples form a batch (the samplers in ``parallel``), the layout's arithmetic, splitting the packed row across
context-parallel ranks, or tokenization.

Worked example, alignment 4, samples of lengths 3 and 2: the row holds 5 tokens plus 3 pad tokens (labels
``IGNORE_INDEX``) and ``cu_seq_lens = [0, 3, 5, 8]``; with lengths 3 and 1 it holds 4 tokens and
``cu_seq_lens = [0, 3, 4]``. With ``"extend_last"`` the first row gives ``cu_seq_lens = [0, 3, 8]`` and
``cu_seq_lens_real = [0, 3, 5]``. Per-sequence padding to 4 with lengths 3 and 6 (alignment 4): ``cu_seq_lens =
[0, 4, 12]``, ``cu_seq_lens_real = [0, 3, 9]``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.delivery_plan import DeliveryPlan, prepare_delivery
from hyper_parallel.data.batching.sequence_boundaries import indexed_cu_seq_lens
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError, require_choice, require_int
from hyper_parallel.data.indexed.ltor_fields import positions_within_sequences
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.tokenizer_protocol import read_tokenizer

__all__ = [
    "IndexedStackingCollator",
    "TextPackingCollator",
    "build_indexed_collate_fn",
    "build_online_text_collate_fn",
    "TAIL_PADDING_POLICIES",
    "indexed_batch",
]

logger = get_logger(__name__)

_INT32_MAX = int(np.iinfo(np.int32).max)
_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)
TAIL_PADDING_POLICIES = ("append_dummy_seq", "extend_last")  # Megatron-Core's thd_tail_padding_policy


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
        tail_padding: ``"append_dummy_seq"`` or ``"extend_last"`` (``TAIL_PADDING_POLICIES``).
        records_real: the batches carry ``cu_seq_lens_real``: a sequence may hold padding (per-sequence padding,
            or the tail padding extending the last sequence). Decided here, so every batch has the same fields.
    """

    def __init__(
        self,
        *,
        alignment: int = 1,
        pad_token_id: int = 0,
        position_ids: bool = False,
        pad_each_sequence_to: int = 1,
        tail_padding: str = "append_dummy_seq",
        delivery_plan: DeliveryPlan | None = None,
    ) -> None:
        """Validate and store the settings.

        Args:
            alignment: multiple of the packed length, usually a layout's ``row_multiple``.
            pad_token_id: a valid token id (``>= 0``); it is never trained on, but it goes through the embedding.
            pad_each_sequence_to: multiple of every sequence's length; the padding of a sequence is at its end,
                with ``pad_token_id`` inputs and ``IGNORE_INDEX`` labels, and belongs to that sequence in
                ``cu_seq_lens``. ``alignment`` must be a multiple of it, so that the tail padding is one too.
            tail_padding: where the row's tail padding goes: one dummy sequence of its own (which counts its
                padding as its real tokens in ``cu_seq_lens_real``: it carries no loss and attends only itself),
                or the end of the last sequence (whose real length is unchanged).
            delivery_plan: one CP rank's ``DeliveryPlan`` (``ParallelBatch.delivery_plan``): every batch carries
                that rank's metadata as ``Batch.delivery``, computed here (in the DataLoader worker); None: none.

        Raises:
            DataConfigError: a setting is not a non-negative integer, the alignment or ``pad_each_sequence_to``
                is 0, the alignment is not a multiple of ``pad_each_sequence_to``, or the tail policy is unknown.
        """
        self.alignment = _setting(
            alignment,
            "alignment",
            "the multiple of the packed length, as DeliveryLayout.row_multiple(extra=sequence_multiple) computes it "
            "(build_online_text_collate_fn does)",
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
        self.tail_padding = require_choice(
            "tail_padding",
            tail_padding,
            TAIL_PADDING_POLICIES,
            "'append_dummy_seq' (the row's tail padding is one dummy sequence of its own) or 'extend_last' (it is "
            "added to the last sequence's padded end), Megatron-Core's thd_tail_padding_policy",
        )
        self.records_real = self.pad_each_sequence_to > 1 or (self.tail_padding == "extend_last" and self.alignment > 1)
        self.delivery_plan = _plan(delivery_plan)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(alignment={self.alignment}, pad_token_id={self.pad_token_id}, "
            f"position_ids={self.position_ids}, pad_each_sequence_to={self.pad_each_sequence_to}, "
            f"tail_padding={self.tail_padding!r}, delivery_plan={self.delivery_plan})"
        )

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> Batch:
        """Concatenate ``samples`` into one padded row.

        Args:
            samples: K mappings, each with 1-D integer ``input_ids`` and ``labels`` of the same length ``>= 1``
                (numpy arrays, lists or tensors). A sample may carry ``document_lengths`` (an Indexed row in a
                mixture): its documents are then sequences of their own, each counted in K.

        Returns:
            A ``Batch``: ``input_ids``, ``labels`` and ``loss_mask`` ``[1, packed_length]``; ``cu_seq_lens`` int32
            ``[K + 1]``, or ``[K + 2]`` when a dummy tail sequence was added; ``cu_seq_lens_real`` of as many
            entries when ``records_real``, else None.

        Raises:
            DataFileError: the batch is empty, or a sample is not a mapping, lacks a field, has a field that is
                not 1-D integer, is empty, or has ``input_ids`` and ``labels`` of different lengths.
        """
        inputs, labels = _documents(samples, *_online_fields(samples))
        return self.pack_arrays(inputs, labels, np.fromiter(map(len, inputs), dtype=np.int64, count=len(inputs)))

    def pack_arrays(self, inputs: Sequence[np.ndarray], labels: Sequence[np.ndarray], lengths: np.ndarray) -> Batch:
        """Pack sequences of ``lengths`` held by the concatenation of ``inputs`` (and of ``labels``) into one row.

        What ``__call__`` does once the samples' fields are checked; a caller that holds the sequences' tokens
        side by side (the packing scheduler) passes them as one array each, already checked, with their lengths
        (each at least 1, summing to the tokens' count).
        """
        padded = lengths + -lengths % self.pad_each_sequence_to  # each sequence's length with its own padding
        total = int(padded.sum())
        pad = -total % self.alignment
        packed_length = total + pad
        if packed_length > _INT32_MAX:
            raise DataFileError(
                f"the packed row would hold {packed_length} tokens, more than cu_seq_lens (int32) can address; "
                "use a smaller micro-batch"
            )
        dummy = pad > 0 and self.tail_padding == "append_dummy_seq"
        cu_seq_lens = _cumulative(padded, dummy)
        cu_seq_lens[-1] = packed_length  # the tail padding ends the dummy sequence, or the last one
        # Every padding is written by ``full``, the samples by one concatenate copied in (not ``out=``: that checks
        # each sample for overlap with the row, five times the copy for a micro-batch of many short samples).
        input_row = np.full(packed_length, self.pad_token_id, dtype=np.int64)
        label_row = np.full(packed_length, IGNORE_INDEX, dtype=np.int64)
        if total == lengths.sum():
            input_row[:total] = np.concatenate(inputs)
            label_row[:total] = np.concatenate(labels)
        else:
            # Lengths 3 and 2 padded to 4: tokens go to [0, 1, 2] and [4, 5], i.e. each token's index among the
            # samples' tokens plus the padding of the sequences before its own: [0, 0, 0, 1, 1].
            shift = np.repeat(cu_seq_lens[: len(lengths)] - (np.cumsum(lengths) - lengths), lengths)
            where = np.arange(int(lengths.sum())) + shift
            input_row[where] = np.concatenate(inputs)
            label_row[where] = np.concatenate(labels)
        real = None
        if self.records_real:
            real = _cumulative(lengths, dummy)
            if dummy:
                real[-1] += pad  # the dummy sequence counts its padding as its real tokens
        positions = positions_within_sequences(cu_seq_lens) if self.position_ids else None
        batch = Batch(
            input_ids=torch.from_numpy(input_row).unsqueeze(0),
            labels=torch.from_numpy(label_row).unsqueeze(0),
            cu_seq_lens=torch.from_numpy(cu_seq_lens),
            cu_seq_lens_real=None if real is None else torch.from_numpy(real),
            position_ids=None if positions is None else torch.from_numpy(positions).unsqueeze(0),
        )
        return batch if self.delivery_plan is None else prepare_delivery(batch, self.delivery_plan)


def _online_fields(samples: Sequence[Mapping[str, Any]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The samples' ``input_ids`` and ``labels``, checked to be non-empty and of equal lengths."""
    if len(samples) == 0:
        raise DataFileError("the batch holds no samples; a micro-batch needs at least one sample to pack")
    fields = _transform_fields(samples)
    return fields if fields is not None else _checked_fields(samples)


def _documents(
    samples: Sequence[Mapping[str, Any]], inputs: list[np.ndarray], labels: list[np.ndarray]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The sequences to pack: a sample carrying ``document_lengths`` (an Indexed row in a mixture) is cut into its
    documents, each a sequence of its own; any other sample is one sequence."""
    if not any("document_lengths" in sample for sample in samples):
        return inputs, labels
    cut_inputs, cut_labels = [], []
    for index, (sample, ids, targets) in enumerate(zip(samples, inputs, labels, strict=True)):
        lengths = sample.get("document_lengths")
        if lengths is None:
            cut_inputs.append(ids)
            cut_labels.append(targets)
            continue
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or (lengths <= 0).any() or int(lengths.sum()) != len(ids):
            raise DataFileError(
                f"sample {index} of the batch has document_lengths {lengths.tolist()}, which must be positive and sum "
                f"to its {len(ids)} input_ids"
            )
        cuts = np.cumsum(lengths)[:-1]
        cut_inputs += np.split(ids, cuts)
        cut_labels += np.split(targets, cuts)
    return cut_inputs, cut_labels


_INPUT_IDS, _LABELS = operator.methodcaller("get", "input_ids"), operator.methodcaller("get", "labels")
_NDIM, _DTYPE = operator.attrgetter("ndim"), operator.attrgetter("dtype")


def _transform_fields(samples: Sequence[Mapping[str, Any]]) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """The fields of samples as the transforms make them (dicts of non-empty 1-D integer arrays of equal lengths),
    checked for the whole batch at once; None when any sample is otherwise (``_checked_fields`` says which)."""
    # Checked with C-level maps over the whole batch: this runs for every micro-batch.
    if set(map(type, samples)) != {dict}:
        return None
    inputs = list(map(_INPUT_IDS, samples))
    labels = list(map(_LABELS, samples))
    arrays = inputs + labels
    if set(map(type, arrays)) != {np.ndarray} or set(map(_NDIM, arrays)) != {1}:
        return None
    if not {dtype.kind for dtype in set(map(_DTYPE, arrays))} <= {"i", "u"}:
        return None
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    if not lengths.all() or not np.array_equal(lengths[: len(inputs)], lengths[len(inputs) :]):
        return None
    return inputs, labels


def _checked_fields(samples: Sequence[Mapping[str, Any]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The fields of any samples, converted and checked one by one, naming the first that is wrong."""
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
    return inputs, labels


def _cumulative(lengths: np.ndarray, dummy: bool) -> np.ndarray:
    """int32 ``[0, cumsum(lengths)...]``, with one more entry (a copy of the last) for a dummy sequence."""
    bounds = np.zeros(len(lengths) + 1 + dummy, dtype=np.int32)
    np.cumsum(lengths, out=bounds[1 : len(lengths) + 1])
    bounds[len(lengths) + 1 :] = bounds[len(lengths)]
    return bounds


def _layout(layout: DeliveryLayout | None, loose: dict[str, Any]) -> DeliveryLayout:
    """The delivery layout: ``layout``, or one built from the loose CP/TP keywords; both is an error."""
    given = {name: value for name, value in loose.items() if value is not None}
    if layout is None:
        return DeliveryLayout(**given)
    if not isinstance(layout, DeliveryLayout):
        raise DataConfigError(
            f"layout must be a DeliveryLayout (hyper_parallel.data.parallel.delivery_layout), got "
            f"{type(layout).__name__}; build it once from the parallel context and pass it"
        )
    if given:
        raise DataConfigError(
            f"build_online_text_collate_fn got both a layout ({layout.describe()}) and {sorted(given)}; the layout "
            "holds the CP and TP sizes and the CP layout, so give either the layout or those keywords, not both"
        )
    return layout


def build_online_text_collate_fn(
    tokenizer: Any = None,
    *,
    layout: DeliveryLayout | None = None,
    sequence_multiple: int = 1,
    pad_token_id: int | None = None,
    position_ids: bool = False,
    tail_padding: str = "append_dummy_seq",
    cp_size: int | None = None,
    tp_size: int | None = None,
    sequence_parallel: bool | None = None,
    cp_layout: str | None = None,
    delivery_plan: DeliveryPlan | None = None,
) -> TextPackingCollator:
    """Build the packing collator of the Online path for a delivery layout.

    Args:
        tokenizer: optional; its ``pad_token_id`` is the padding id when ``pad_token_id`` is not given.
        layout: the ``DeliveryLayout`` the batches are delivered in: rows are padded to
            ``layout.row_multiple(extra=sequence_multiple)`` and every sequence to ``layout.sequence_multiple()``
            (``2 * cp`` with per-sequence padding). None: the layout of the loose keywords below.
        sequence_multiple: a further multiple of the row length the kernels need, such as 32 (1 for none).
        pad_token_id: explicit padding id; otherwise the tokenizer's, otherwise 0 (the padding carries no loss
            and is its own sequence in ``cu_seq_lens``, so any valid id works). With a tokenizer, it must lie in its
            vocabulary: the padding goes through the embedding.
        position_ids: also return ``position_ids`` that restart at every sequence of the packed row.
        tail_padding: ``"append_dummy_seq"`` or ``"extend_last"`` (``TextPackingCollator``).
        cp_size, tp_size, sequence_parallel, cp_layout: a convenience for ``layout=DeliveryLayout(...)`` with
            these fields (its defaults for the others); not together with ``layout``.
        delivery_plan: the data rank's ``ParallelBatch.delivery_plan``: each batch then carries that rank's
            columns, position ids and attention metadata (``Batch.delivery``), computed in the worker. Its CP size
            and layout must be the layout's.

    Returns:
        A picklable ``TextPackingCollator``.

    Raises:
        DataConfigError: a size, the layout or the padding id is invalid, both a layout and loose keywords are
            given, or the padding id is past the tokenizer's vocabulary.

    Example: ``build_online_text_collate_fn(layout=DeliveryLayout(cp_size=2, cp_layout="zigzag_thd"))`` pads
    every sequence to 4 and every row to 4; ``sequence_multiple=32`` makes rows a multiple of 32.
    """
    loose = {"cp_size": cp_size, "tp_size": tp_size, "sequence_parallel": sequence_parallel, "cp_layout": cp_layout}
    layout = _layout(layout, loose)
    multiple = _setting(
        sequence_multiple, "sequence_multiple", "a multiple the attention kernels need, such as 32 (1 for none)"
    )
    tokens = None if tokenizer is None else read_tokenizer(tokenizer)
    if pad_token_id is None and tokens is not None:
        pad_token_id = tokens.pad
    if pad_token_id is None:
        pad_token_id = 0
    collator = TextPackingCollator(
        alignment=layout.row_multiple(extra=multiple),
        pad_token_id=pad_token_id,
        position_ids=position_ids,
        pad_each_sequence_to=layout.sequence_multiple(),
        tail_padding=tail_padding,
        delivery_plan=_plan(delivery_plan, layout),
    )
    check_pad_token_id(collator.pad_token_id, tokens, "collate_fn")
    return collator


def _plan(plan: DeliveryPlan | None, layout: DeliveryLayout | None = None) -> DeliveryPlan | None:
    """``plan`` when it is a ``DeliveryPlan`` that cuts rows as ``layout`` does (None passes)."""
    if plan is None:
        return None
    if not isinstance(plan, DeliveryPlan):
        raise DataConfigError(
            f"delivery_plan must be a DeliveryPlan (ParallelBatch.delivery_plan), got {type(plan).__name__}"
        )
    if layout is not None and (plan.cp_size, plan.cp_layout) != (layout.cp_size, layout.cp_layout):
        raise DataConfigError(
            f"delivery_plan cuts rows across cp_size {plan.cp_size} in the {plan.cp_layout} layout, but the collator's "
            f"layout is {layout.describe()}; pass the same stage's layout and delivery_plan (stage.layout, "
            "stage.delivery_plan)"
        )
    return plan


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
    """The samples' fields stacked by ``default_collate``, after checking that they are dicts with the same fields.

    Shapes are checked by the stacking itself (``torch.stack`` refuses unequal ones); only when it fails are the
    samples compared field by field, to name the sample and field that differ.
    """
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
    missing = [key for key in _INDEXED_FIELDS if key not in first]
    if missing:
        raise DataFileError(
            f"the samples have no {missing} (their fields: {sorted(map(str, first))}); Indexed samples need "
            f"{list(_INDEXED_FIELDS)}, as GPTDataset returns them"
        )
    try:
        return default_collate(list(samples))
    except (RuntimeError, TypeError, ValueError) as error:
        problem = _shape_problem(samples)
        if problem is None:
            raise
        raise DataFileError(problem) from error


def _shape_problem(samples: Sequence[Mapping[str, Any]]) -> str | None:
    """The first field whose shape differs from sample 0's, said as an error message; None when all agree."""
    first = samples[0]
    for index, sample in enumerate(samples[1:], start=1):
        for key, value in sample.items():
            if _shape(value) != _shape(first[key]):
                return (
                    f"sample {index} of the batch: field {key!r} has shape {_shape(value)} but sample 0's has "
                    f"{_shape(first[key])}; Indexed samples must all have seq_length tokens"
                )
    return None


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
    by the EOD input (``sequence_boundaries.eod_sequence_ends``, the rule ``get_batch`` uses too): the one place
    the Indexed boundaries are computed; the attention mask keeps megatron-core's polarity (True = masked out) as
    ``megatron_attention_mask``; other fields go to ``Batch.extras``. With a ``layout``, rows the layout cannot cut
    are refused at the first batch (the row length is the dataset's ``seq_length``, so no sample is read to check
    it beforehand). Picklable (plain attributes only), so it can be handed to ``DataLoader`` workers.

    Attributes:
        eod_token_id: the EOD id that ends a sequence; None makes each row one sequence.
        layout: the ``DeliveryLayout`` the rows are delivered in, or None (no check of the row length).
        delivery_plan: one CP rank's ``DeliveryPlan``, whose metadata every batch carries (``Batch.delivery``), or
            None.
    """

    def __init__(
        self,
        *,
        eod_token_id: int | None = None,
        layout: DeliveryLayout | None = None,
        delivery_plan: DeliveryPlan | None = None,
    ) -> None:
        """Validate and store the EOD id, the layout and the delivery plan.

        Raises:
            DataConfigError: ``eod_token_id`` is given and is not a non-negative integer, or ``layout`` is not a
                ``DeliveryLayout``.
        """
        if eod_token_id is not None:
            eod_token_id = _setting(eod_token_id, "eod_token_id", "the tokenizer's EOD (EOS) token id", minimum=0)
        if layout is not None and not isinstance(layout, DeliveryLayout):
            raise DataConfigError(
                f"layout must be a DeliveryLayout (hyper_parallel.data.parallel.delivery_layout), got "
                f"{type(layout).__name__}; build it once from the parallel context and pass it"
            )
        self.eod_token_id = eod_token_id
        self.layout = layout
        self.delivery_plan = _plan(delivery_plan, layout)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(eod_token_id={self.eod_token_id}, layout={self.layout}, "
            f"delivery_plan={self.delivery_plan})"
        )

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> Batch:
        """Stack ``samples`` into one ``Batch``.

        Raises:
            DataFileError: the batch is empty, a sample is None or not a mapping, the samples' fields differ or
                lack ``tokens``/``labels``/``loss_mask``, or a field's shape differs from sample 0's.
            DataConfigError: the layout cannot cut rows of this length (naming ``seq_length`` and valid ones).
        """
        batch = _contract_batch(_stack(samples), self.eod_token_id, own_labels=True)
        if self.layout is not None:
            self.layout.check_row_length(batch.input_ids.shape[1])
        return batch if self.delivery_plan is None else prepare_delivery(batch, self.delivery_plan)


def indexed_batch(stacked: Mapping[str, Any], *, eod_token_id: int | None) -> Batch:
    """The ``Batch`` of Indexed samples already stacked into ``[B, S]`` tensors (megatron-core's batch dict).

    The edge where a megatron-style dict becomes the batch contract, once: ``tokens`` becomes ``input_ids``,
    ``attention_mask`` (True = masked out) becomes ``megatron_attention_mask``, and the labels become
    ``IGNORE_INDEX`` where the loss mask is 0; used by ``IndexedStackingCollator`` and by readers handed a plain
    megatron-style dict.

    Args:
        stacked: ``tokens``, ``labels``, ``loss_mask`` ``[B, S]`` tensors, optional ``position_ids`` and
            ``attention_mask``; other fields become extras. Not modified.
        eod_token_id: the EOD id that ends a sequence; None makes each row one sequence.

    Raises:
        DataFileError: a required field is missing or is not a ``[B, S]`` tensor.
    """
    return _contract_batch(dict(stacked), eod_token_id, own_labels=False)


def _contract_batch(stacked: dict[str, Any], eod_token_id: int | None, *, own_labels: bool) -> Batch:
    """``indexed_batch`` of ``stacked`` (a dict it may empty); ``own_labels``: its labels tensor is a fresh one
    (the collator's own stack), so the ``IGNORE_INDEX`` marking writes into it instead of into a copy."""
    missing = [key for key in _INDEXED_FIELDS if key not in stacked]
    if missing:
        raise DataFileError(
            f"the Indexed batch has no {missing} (its fields: {sorted(map(str, stacked))}); Indexed batches need "
            f"{list(_INDEXED_FIELDS)}, as GPTDataset's samples stacked by default_collate hold them"
        )
    tokens, labels, loss_mask = (_stacked_array(stacked, key) for key in _INDEXED_FIELDS)
    tokens = tokens.long()  # no copy for the datasets' int64
    unlearned = loss_mask == 0
    if own_labels or labels.dtype != torch.int64:  # .long() of another dtype is a fresh copy too
        labels = labels.long().masked_fill_(unlearned, IGNORE_INDEX)
    else:
        labels = labels.masked_fill(unlearned, IGNORE_INDEX)  # out of place: the caller's stay unchanged
    return Batch(
        input_ids=tokens,
        labels=labels,
        cu_seq_lens=indexed_cu_seq_lens(tokens, labels, eod_token_id),
        position_ids=stacked.pop("position_ids", None),
        megatron_attention_mask=stacked.pop("attention_mask", None),
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


def build_indexed_collate_fn(
    tokenizer: Any = None,
    *,
    eod_token_id: int | None = None,
    layout: DeliveryLayout | None = None,
    delivery_plan: DeliveryPlan | None = None,
) -> IndexedStackingCollator:
    """Build the collator of the Indexed path (``IndexedStackingCollator``; picklable).

    Args:
        tokenizer: its EOD id (``eod``, else ``eos_token_id``) ends the sequences of ``cu_seq_lens``, unless
            ``eod_token_id`` is given. ``build_dataloaders`` passes the pipeline's tokenizer.
        eod_token_id: explicit EOD id.
        layout: the ``DeliveryLayout`` the rows are delivered in; rows it cannot cut are refused at the first
            batch. None: no check.
        delivery_plan: the data rank's ``ParallelBatch.delivery_plan`` (see ``build_online_text_collate_fn``).

    Without an EOD id, each row is one sequence, and a warning says so.

    Raises:
        DataConfigError: the EOD id or the layout is invalid, or a tokenizer without an EOD/EOS id is given.
    """
    if eod_token_id is None and tokenizer is not None:
        eod_token_id = _eod_of(tokenizer)
    if eod_token_id is None:
        logger.warning(
            "the Indexed collator has no EOD id: cu_seq_lens mark row ends only, so each row is one sequence; "
            "pass the tokenizer (build_dataloaders does) or eod_token_id to build_indexed_collate_fn"
        )
    return IndexedStackingCollator(eod_token_id=eod_token_id, layout=layout, delivery_plan=delivery_plan)
