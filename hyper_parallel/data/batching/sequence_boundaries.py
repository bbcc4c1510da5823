"""Global sequence boundaries of a collated batch: where each packed or EOD-separated sequence starts and ends.

Owns: the validated int32 ``cu_seq_lens`` that the parallel delivery step (``batching.get_batch``) shards, broadcasts
and builds attention metadata from; the Indexed path's rule for where a sequence ends (``eod_sequence_ends``, the
one rule the Indexed collator uses too, so a batch's ``cu_seq_lens`` and ``IndexedBoundaryResolver`` agree); each
position's sequence span within its row (``row_boundaries``); and the real boundaries of padded sequences
(``real_boundaries``: the cumulative real token counts of the same sequences, Transformer Engine's ``cu_seqlens``
beside its ``cu_seqlens_padded``). The one rule every boundary list follows is ``parallel.delivery_layout.
check_cu_seq_lens``. Not responsible for: turning "ends here" marks into boundaries (``indexed.ltor_fields.
cu_seq_lens_from_ends``), cutting rows across context-parallel ranks (``parallel.batch_parallel``), or the masks
built from the boundaries (``batching.attention_runtime``).

Boundaries are global: over the batch's ``R`` rows of ``T`` tokens flattened one after another, a leading 0, strictly
increasing, ending at ``R * T``, and every row end is one (no sequence crosses rows), as the batch contract says.

The Indexed rule. A sequence ends after position ``j`` of a row when

* ``input_ids[j]`` is the EOD: GPTDataset rows carry each document's EOD as an input, and it belongs to the document
  it ends (megatron-core's ``reset_position_ids``/``reset_attention_mask`` rule, as ``indexed.ltor_fields``); or
* ``labels[j]`` is the EOD and ``input_ids[j + 1]`` is not: the EOD is predicted but never fed, as in rows laid out
  with each document's EOD only as a target; or
* ``j`` is the last column of the row.

On GPTDataset rows the second clause never adds a boundary (there ``labels[j] == input_ids[j + 1]``, so an EOD
label is followed by the EOD input that the first clause already ends on), which keeps megatron-core's boundaries
exactly. Worked example (the golden example of hyper_parallel upstream), seq_length 8, EOD 9, documents
``[3, 4, 5, 9]`` and ``[1, 2, 9]`` laid out as::

    input_ids  [[3, 4, 5, 1, 2, 0, 0, 0]]
    labels     [[4, 5, 9, 2, 9, -100, -100, -100]]
    ends after      2        4           7         (labels 9 at columns 2 and 4; the row end)
    cu_seq_lens [0, 3, 5, 8]

and the GPTDataset row ``input_ids [5, 9, 7, 8]`` (labels ``[9, 7, 8, 2]``) ends after column 1 and at the row
end: ``[0, 2, 4]``. The rule reads the batch's labels, which are ``IGNORE_INDEX`` where no loss is taken: an EOD that
is only a target and carries no loss leaves no trace, so a dataset that lays documents out that way must keep the
loss on the EOD target (GPTDataset rows always carry the EOD input, so they do not depend on it).

Upstream hyper_parallel also stops reading a row at its first pair of adjacent EODs, taking the rest of the row as
padding. That is not adopted: an empty document (a record that tokenizes to nothing) legitimately gives two
adjacent EODs, and treating everything after them as one sequence would let the following documents attend each
other. Adjacent EODs here make a one-token sequence each, as megatron-core's reset masks do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hyper_parallel.data.errors import DataConfigError, DataFileError, require_int
from hyper_parallel.data.indexed.ltor_fields import cu_seq_lens_from_ends
from hyper_parallel.data.parallel.delivery_layout import check_cu_seq_lens, shown_boundaries

__all__ = [
    "IndexedBoundaryResolver",
    "OnlineBoundaryResolver",
    "eod_sequence_ends",
    "indexed_cu_seq_lens",
    "real_boundaries",
    "row_boundaries",
]

_INT32_MAX = np.iinfo(np.int32).max
_FIX = (
    "build batches with the library's collators (TextPackingCollator, build_indexed_collate_fn), whose boundaries "
    "follow the batch contract"
)


def row_boundaries(cu_seq_lens: Any, rows: int, row_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Each position's sequence as a span of columns of its row: ``(starts, ends)``, int64 ``[rows, row_length]``.

    Position ``(r, t)`` belongs to the sequence of columns ``starts[r, t] <= column < ends[r, t]`` of row ``r``
    (a vectorised form of each row's boundaries: sequences never cross rows).

    Raises:
        DataFileError: ``cu_seq_lens`` are not valid boundaries of ``rows`` rows of ``row_length``.

    Example: boundaries ``[0, 3, 5, 8]`` of one row of 8 give starts ``[[0, 0, 0, 3, 3, 5, 5, 5]]`` and ends
    ``[[3, 3, 3, 5, 5, 8, 8, 8]]``.
    """
    rows, row_length = require_int("rows", rows, 1), require_int("row_length", row_length, 1)
    bounds = check_cu_seq_lens(cu_seq_lens, rows * row_length, "row_boundaries", row_length=row_length)
    bounds = bounds.cpu().numpy().astype(np.int64)
    lengths = np.diff(bounds)
    offsets = np.arange(0, rows * row_length, row_length, dtype=np.int64)[:, None]
    starts = np.repeat(bounds[:-1], lengths).reshape(rows, row_length) - offsets
    ends = np.repeat(bounds[1:], lengths).reshape(rows, row_length) - offsets
    return starts, ends


def _own_end(cu_seq_lens: Any) -> int:
    """The last entry of 1-D boundaries (1 when there is none), for checking them against their own end."""
    if isinstance(cu_seq_lens, torch.Tensor):
        cu_seq_lens = cu_seq_lens.detach().cpu()
    values = np.asarray(cu_seq_lens)
    return max(int(values[-1]), 1) if values.ndim == 1 and values.size and values.dtype.kind in "iu" else 1


def real_boundaries(cu_seq_lens_real: Any, cu_seq_lens: torch.Tensor, where: str) -> torch.Tensor:
    """``cu_seq_lens_real`` as int32, once checked to count the real tokens of the sequences of ``cu_seq_lens``.

    ``cu_seq_lens`` are the physical (padded) boundaries, already checked; ``cu_seq_lens_real`` are the cumulative
    real token counts of the same sequences: the one boundary rule (a leading 0, strictly increasing, so no
    sequence without a real token), as many entries, and each real length at most its padded length.

    Raises:
        DataFileError: naming the rule broken, the sequence and both lengths.

    Example: padded ``[0, 4, 12]`` with real ``[0, 3, 8]``: sequence 0 holds 3 real tokens and 1 padding, sequence
    1 holds 5 and 3; real ``[0, 5, 8]`` is refused (5 real tokens in a sequence of 4).
    """
    real = check_cu_seq_lens(cu_seq_lens_real, _own_end(cu_seq_lens_real), f"{where}: cu_seq_lens_real")
    padded = cu_seq_lens.detach().cpu().numpy().astype(np.int64)
    if real.numel() != len(padded):
        raise DataFileError(
            f"{where}: cu_seq_lens_real has {real.numel()} entries but cu_seq_lens {len(padded)}; both hold the "
            f"boundaries of the same {len(padded) - 1} sequences (real tokens, and with their padding); {_FIX}"
        )
    real_lengths, padded_lengths = np.diff(real.cpu().numpy().astype(np.int64)), np.diff(padded)
    if (over := np.flatnonzero(real_lengths > padded_lengths)).size:
        at = int(over[0])
        raise DataFileError(
            f"{where}: sequence {at} has {real_lengths[at]} real tokens (cu_seq_lens_real) but only "
            f"{padded_lengths[at]} positions (cu_seq_lens); a sequence's padding is added to its real tokens, never "
            f"taken from them; {_FIX}"
        )
    return real


# -- the Indexed rule ----------------------------------------------------------------------------------------------


def eod_sequence_ends(input_ids: torch.Tensor, labels: torch.Tensor, eod_token_id: int) -> np.ndarray:
    """bool ``[R, T]``: True after the positions where a sequence ends, by the Indexed rule (module docstring).

    Row ends are not marked here; ``cu_seq_lens_from_ends`` adds them.
    """
    is_eod = input_ids == eod_token_id
    ends = is_eod.clone()
    ends[:, :-1] |= (labels[:, :-1] == eod_token_id) & ~is_eod[:, 1:]
    return ends.cpu().numpy()


def indexed_cu_seq_lens(input_ids: torch.Tensor, labels: torch.Tensor, eod_token_id: int | None) -> torch.Tensor:
    """int32 ``cu_seq_lens`` of ``[R, T]`` Indexed rows by the Indexed rule; each row one sequence without an EOD id.

    Raises:
        DataFileError: the rows hold more tokens than int32 boundaries can address.
    """
    if input_ids.numel() > _INT32_MAX:
        raise DataFileError(
            f"the batch holds {input_ids.numel()} tokens ({list(input_ids.shape)}), more than cu_seq_lens (int32) can "
            "address; use a smaller micro_batch_size"
        )
    if eod_token_id is None:
        ends = np.zeros(tuple(input_ids.shape), dtype=bool)
    else:
        ends = eod_sequence_ends(input_ids, labels, eod_token_id)
    return torch.from_numpy(cu_seq_lens_from_ends(ends).astype(np.int32))


# -- resolvers -----------------------------------------------------------------------------------------------------


def _rows(batch: Any, name: str, *aliases: str) -> torch.Tensor:
    """Field ``name`` (or an alias) of ``batch`` as a 2-D integer tensor; a ``DataFileError`` otherwise."""
    if not isinstance(batch, Mapping):
        raise DataFileError(
            f"the boundary resolver received a {type(batch).__name__}, not a batch; pass the collator's Batch"
        )
    key = next((key for key in (name, *aliases) if key in batch), None)
    value = batch[key] if key is not None else None
    if not isinstance(value, torch.Tensor) or value.ndim != 2 or value.is_floating_point():
        found = "missing" if key is None else f"{type(value).__name__} {list(getattr(value, 'shape', []))}"
        raise DataFileError(
            f"the batch's {name!r} is {found}; the boundary resolver needs [R, T] integer tensors; {_FIX}"
        )
    return value


class OnlineBoundaryResolver:
    """The Online packing collator's ``cu_seq_lens``, checked: ``resolver(batch) -> int32 [K + 1]``.

    The tail padding the collator adds is its own sequence, so the boundaries cover every position.
    """

    def __call__(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Validated global boundaries of ``batch`` (a ``Batch`` or a mapping with ``input_ids``, ``cu_seq_lens``).

        Raises:
            DataFileError: the batch has no ``cu_seq_lens`` or they break a rule (which one is named).
        """
        input_ids = _rows(batch, "input_ids")
        if "cu_seq_lens" not in batch:
            raise DataFileError(
                "the Online batch has no 'cu_seq_lens'; Online batches come from TextPackingCollator, which records "
                "the packed sequences' boundaries (use build_online_text_collate_fn as the loader's collate_fn)"
            )
        return check_cu_seq_lens(
            batch["cu_seq_lens"],
            input_ids.numel(),
            "the Online collator's cu_seq_lens",
            row_length=input_ids.shape[1],
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class IndexedBoundaryResolver:
    """Boundaries of ``[R, T]`` Indexed rows from EOD tokens and row ends: ``resolver(batch) -> int32 [K + 1]``.

    The rule is the module docstring's, shared with the Indexed collator. When the batch already carries
    ``cu_seq_lens`` (the collator's), they must be these, or the row ends only (a collator built without an EOD
    id); anything else means the collator and this resolver were given different EOD ids, which is an error
    rather than a silent choice.

    Attributes:
        eod_token_id: the EOD id.
    """

    def __init__(self, eod_token_id: int) -> None:
        """Raises ``DataConfigError`` unless ``eod_token_id`` is an integer ``>= 0``."""
        self.eod_token_id = require_int("eod_token_id", eod_token_id, 0)

    def __call__(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Validated global boundaries of ``batch`` (a ``Batch``, or a mapping with ``input_ids``/``tokens`` and
        ``labels`` whose labels are ``IGNORE_INDEX`` where no loss is taken).

        Raises:
            DataFileError: the batch lacks ``input_ids`` or ``labels``, their shapes differ, or they hold more tokens
                than int32 boundaries address.
            DataConfigError: the batch's own ``cu_seq_lens`` come from another EOD id.
        """
        input_ids, labels = _rows(batch, "input_ids", "tokens"), _rows(batch, "labels")
        if labels.shape != input_ids.shape:
            raise DataFileError(
                f"the batch's labels have shape {list(labels.shape)} but its input_ids {list(input_ids.shape)}; "
                f"they must match (one label per position); {_FIX}"
            )
        rows, row_length = input_ids.shape
        where = f"the Indexed boundaries (EOD {self.eod_token_id})"
        bounds = check_cu_seq_lens(
            indexed_cu_seq_lens(input_ids, labels, self.eod_token_id), rows * row_length, where, row_length=row_length
        )
        carried = batch.get("cu_seq_lens")
        if carried is not None:
            self._check_agrees(torch.as_tensor(carried).cpu(), bounds, rows, row_length)
        return bounds

    def _check_agrees(self, carried: torch.Tensor, bounds: torch.Tensor, rows: int, row_length: int) -> None:
        if torch.equal(carried.long(), bounds.long()):
            return
        row_ends = torch.arange(0, rows * row_length + 1, row_length)
        if torch.equal(carried.long(), row_ends):
            return  # a collator without an EOD id: its row ends are a subset of these boundaries
        raise DataConfigError(
            f"the batch's cu_seq_lens {shown_boundaries(carried.numpy())} are not those of EOD id "
            f"{self.eod_token_id} ({shown_boundaries(bounds.numpy())}): the Indexed collator was built with another "
            "EOD id than get_batch; give "
            "both the tokenizer's EOD id (eod_token_id)"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(eod_token_id={self.eod_token_id})"
