"""One scheduled step's data on the data ranks: fetch, exchange over DP, and pack the planned groups into batches.

Owns: reading a step's micro-batches into sequences (``fetch_sequences``: each ``Batch`` split at its checked
``cu_seq_lens``), what the step header every data rank of the DP x CP domain all-gathers holds and what is decided
from it (its failure, its counts, its ``num_microbatches`` and one digest of the scheduler settings, compared so that
ranks that disagree fail alike instead of duplicating data or hanging), the DP exchange of the sequences themselves,
and packing this rank's planned groups into ``Batch`` es (``pack_group``: each sequence padded for CP inside its own
boundaries, one padding sequence filling the row; ``pack_rank_groups``). Not responsible for: the collectives
(``parallel.step_exchange``, watched for hung ranks) and the message naming the settings that differ
(``parallel.rank_agreement``), planning which sequences share a group (``parallel.scheduling``), the alignment
arithmetic (``parallel.delivery_layout``), relaying the outcome to TP peers and PP stages or cutting a row over CP
ranks (``batching.get_batch``, ``parallel.batch_parallel``).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.build_collate_fn import TextPackingCollator
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError, require_int
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.parallel.rank_agreement import check_ranks_agree, settings_digest
from hyper_parallel.data.parallel.step_exchange import all_gather_parts, gather_step_headers

__all__ = ["FetchedStep", "exchange_sequences", "fetch_sequences", "pack_group", "pack_rank_groups"]


def pack_group(
    sequences: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    cp_size: int,
    local_length: int,
    pad_token_id: int,
    pad_each_sequence_to: int | None = None,
    tail_padding: str = "append_dummy_seq",
) -> Batch:
    """One group's sequences packed into the ``[1, P]`` row its ranks share, ``P = cp_size * local_length``.

    Each sequence is padded at its end to a multiple of ``2 * cp_size`` (when ``cp_size > 1``), inside its own
    boundaries; one padding sequence fills the row up to ``P``. Padding holds ``pad_token_id`` and
    ``IGNORE_INDEX`` labels. A group without sequences is one padding sequence.

    Args:
        sequences: ``(input_ids, labels)`` of each sequence, 1-D int64 of equal length, in packing order.
        cp_size: the group's CP size.
        local_length: every rank's CP-local length (``local_packed_length``; even when ``cp_size > 1``).
        pad_token_id: the padding's input id.
        pad_each_sequence_to: the multiple each sequence is padded to (``DeliveryLayout.sequence_multiple``); None
            is ``2 * cp_size`` above one CP rank (``zigzag_thd``), else 1.
        tail_padding: where the padding up to ``P`` goes (``thd_tail_padding_policy``): one dummy sequence of its
            own (``append_dummy_seq``) or the last sequence's padded end (``extend_last``).

    Returns:
        A ``Batch`` with ``input_ids``/``labels`` ``[1, P]``, ``cu_seq_lens`` int32 and the extra
        ``local_cp_size`` (int64 ``[1]``).

    Raises:
        DataConfigError: a size below 1, an odd ``local_length`` with ``cp_size > 1``, or sequences whose padded
            lengths exceed ``P``.
        DataFileError: a sequence that is empty or whose ids and labels differ in length.

    Example:
        lengths 3 and 2, ``cp_size=2, local_length=6``: P = 12, ``cu_seq_lens = [0, 4, 8, 12]``.
    """
    cp, row, multiple = _group_row(cp_size, local_length, pad_each_sequence_to)
    if not sequences:
        return _padding_group(cp, row, pad_token_id)
    samples = [
        {"input_ids": np.asarray(ids).reshape(-1), "labels": np.asarray(labels).reshape(-1)}
        for ids, labels in sequences
    ]
    lengths = np.fromiter((len(sample["input_ids"]) for sample in samples), dtype=np.int64, count=len(samples))
    _check_fits(lengths, multiple, cp, row)
    return _with_cp_size(_collator(row, multiple, pad_token_id, tail_padding)(samples), cp)


def _group_row(cp_size: int, local_length: int, pad_each_sequence_to: int | None) -> tuple[int, int, int]:
    """``(cp, row, multiple)`` of a group: its CP size, its row's length and every sequence's padding multiple."""
    cp = require_int("cp_size", cp_size, 1)
    local = require_int("local_length", local_length, 1)
    multiple = (
        (2 * cp if cp > 1 else 1)
        if pad_each_sequence_to is None
        else require_int("pad_each_sequence_to", pad_each_sequence_to, 1)
    )
    if local * cp % multiple:
        raise DataConfigError(
            f"local_length {local} with cp_size {cp} gives a row of {local * cp} tokens, not a multiple of "
            f"2 * cp_size = {multiple} that the zigzag_thd layout needs; use an even local_length (local_packed_length)"
        )
    return cp, local * cp, multiple


def _check_fits(lengths: np.ndarray, multiple: int, cp: int, row: int) -> None:
    total = int((lengths + -lengths % multiple).sum())
    if total > row:
        raise DataConfigError(
            f"the group's {lengths.size} sequences hold {total} tokens once padded for CP size {cp}, more than the "
            f"{row} of its row (local_length {row // cp} x cp_size {cp}); the schedule and local_packed_length "
            "disagree"
        )


def _padding_group(cp: int, row: int, pad_token_id: int) -> Batch:
    """A group without sequences: one padding sequence filling its row."""
    return Batch(
        input_ids=torch.full((1, row), pad_token_id, dtype=torch.int64),
        labels=torch.full((1, row), IGNORE_INDEX, dtype=torch.int64),
        cu_seq_lens=torch.tensor([0, row], dtype=torch.int32),
        extras={"local_cp_size": torch.tensor([cp], dtype=torch.int64)},
    )


def _collator(row: int, multiple: int, pad_token_id: int, tail_padding: str) -> TextPackingCollator:
    return TextPackingCollator(
        alignment=row, pad_token_id=pad_token_id, pad_each_sequence_to=multiple, tail_padding=tail_padding
    )


def _with_cp_size(packed: Batch, cp: int) -> Batch:
    """``packed`` with the extra ``local_cp_size``: the collator's Batch was checked when it was built and the extra
    has its one row's entry, so the boundaries are not checked a second time."""
    packed = copy.copy(packed)
    object.__setattr__(packed, "extras", {"local_cp_size": torch.tensor([cp], dtype=torch.int64)})
    return packed


# -- fetching a step ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FetchedStep:
    """The sequences of a step's micro-batches, their rows flattened one after another.

    Attributes:
        items: how many micro-batches were read (fewer than asked when the data ended).
        input_ids, labels: int64 ``[N]``, every sequence's tokens in order.
        lengths: int64 ``[K]``, each sequence's length (every one at least 1).
    """

    items: int
    input_ids: torch.Tensor
    labels: torch.Tensor
    lengths: np.ndarray

    @classmethod
    def empty(cls) -> FetchedStep:
        nothing = torch.zeros(0, dtype=torch.int64)
        return cls(0, nothing, nothing, np.zeros(0, np.int64))


def _sequences(batch: object, where: str) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    if not isinstance(batch, Batch):
        raise DataFileError(
            f"{where} is a {type(batch).__name__}; the packing scheduler takes Batches (the collators' output). "
            "Convert a megatron-style dict once with build_collate_fn.indexed_batch, or use "
            "build_online_text_collate_fn as the loader's collate_fn"
        )
    ids, labels = batch.input_ids.reshape(-1), batch.labels.reshape(-1)
    # A Batch checked its boundaries when it was built (``check_cu_seq_lens``: every span at least 1 token, every
    # row end a boundary), and its ids and labels are int64 of one shape.
    return ids, labels, np.diff(batch.cu_seq_lens.cpu().numpy()).astype(np.int64)


def fetch_sequences(data_iterator: Iterator, count: int) -> FetchedStep:
    """Read up to ``count`` micro-batches (``Batch`` es) and split them into sequences at their boundaries.

    Raises:
        DataConfigError: ``data_iterator`` is not an iterator.
        DataFileError: an item is not a ``Batch`` (whose construction checked its ``cu_seq_lens`` by the one rule,
            ``check_cu_seq_lens``: zero-length spans are refused).
    """
    if not isinstance(data_iterator, Iterator):
        raise DataConfigError(
            f"the packing scheduler on a data rank (TP rank 0 of PP stage 0) needs the loader's iterator, got "
            f"{type(data_iterator).__name__}; pass iter(loader), kept across steps"
        )
    parts = []
    for item in data_iterator:
        parts.append(_sequences(item, f"micro-batch {len(parts)} of this step"))
        if len(parts) == count:
            break
    if not parts:
        return FetchedStep.empty()
    ids, labels, lengths = zip(*parts, strict=True)
    return FetchedStep(len(parts), torch.cat(ids), torch.cat(labels), np.concatenate(lengths))


# -- the step header and the DP exchange ----------------------------------------------------------------------------

_HEADER = ("failed", "items", "sequences", "tokens", "position", "num_microbatches")
_AGREEMENT = (
    "the packing scheduler's settings (every DP x CP rank of a step must schedule with the same "
    "PackingSchedulerConfig and num_microbatches)"
)


def _settings(config: object, num_microbatches: int) -> dict[str, dict[str, object]]:
    """What ranks of one step must agree on: every field of the scheduler config and ``num_microbatches``."""
    return {
        "packing_scheduler": {f.name: getattr(config, f.name) for f in fields(config)},
        "schedule": {"num_microbatches": num_microbatches},
    }


def _digest_words(settings: dict[str, dict[str, object]]) -> list[int]:
    """``settings_digest(settings)`` as four int64 header words."""
    digest = settings_digest(settings)
    return [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, len(digest), 8)]


@functools.lru_cache(maxsize=16)
def _settings_words(config: object, num_microbatches: int) -> tuple[int, ...]:
    """The header words of a (frozen, hashable) scheduler config's settings: computed once per config and count."""
    return tuple(_digest_words(_settings(config, num_microbatches)))


def _check_agreement(headers: np.ndarray, config: object, num_microbatches: int, group) -> None:
    """Raise the same ``DataConfigError`` on every rank when the ranks' settings differ: every rank decides from the
    same gathered digests, so either all of them or none make ``check_ranks_agree``'s naming collectives."""
    digests = headers[:, len(_HEADER) :]
    if not (digests == digests[0]).all():
        check_ranks_agree(_settings(config, num_microbatches), group=group, what=_AGREEMENT)


def exchange_sequences(
    fetched: FetchedStep | BaseException,
    *,
    config: object,
    num_microbatches: int,
    domain_group,
    domain_size: int,
    dp_group,
    dp_size: int,
    position: int,
    cp_size: int,
) -> FetchedStep | None:
    """Every DP rank's sequences of the step, in global id order; None when no DP rank read anything.

    Every data rank of the DP x CP domain calls it once per step: one all-gather of a fixed-size header (failure,
    counts, position, ``num_microbatches`` and a digest of the scheduler settings), then, when every rank read its
    micro-batches and agrees, one exchange over DP of the lengths and tokens side by side.

    Args:
        fetched: this rank's ``fetch_sequences``, or the error it raised.
        config: the scheduler config (a dataclass) whose every field the ranks must agree on.
        num_microbatches: the micro-batches each rank was asked for.
        domain_group, domain_size: the DP x CP group of the header; dp_group, dp_size: the group of the exchange.
        position: this rank's ``dp_rank * cp_size + cp_rank``; cp_size: the static CP size (to place ranks).

    Raises:
        The rank's own error on that rank; ``DataFileError`` naming the failed DP rank on the others; the same
        ``DataConfigError`` on every rank when their settings differ (``check_ranks_agree``: each differing field
        with its value per global rank); ``DataFileError`` when the step holds no sequence; ``CollectiveTimeout``
        naming the ranks that never reached the step header (or the exchange).
    """
    error = fetched if isinstance(fetched, BaseException) else None
    step = FetchedStep.empty() if error is not None else fetched
    counts = [error is not None, step.items, step.lengths.size, step.input_ids.numel(), position, num_microbatches]
    header = torch.tensor(counts + list(_settings_words(config, num_microbatches)), dtype=torch.int64)
    headers = gather_step_headers(header, group=domain_group, size=domain_size).numpy()  # decided on in numpy
    failed = sorted({int(p) // cp_size for p in headers[headers[:, 0] != 0, 4].tolist()})
    if error is not None:
        raise error
    if failed:
        raise DataFileError(
            f"DP rank {failed[0]} failed to read its micro-batches for the packing scheduler (DP ranks {failed} "
            f"failed); see DP rank {failed[0]}'s log for its error"
        )
    _check_agreement(headers, config, num_microbatches, domain_group)
    if int(headers[:, 1].sum()) == 0:
        return None
    if int(headers[:, 2].sum()) == 0:
        raise DataFileError(f"the global batch holds no sequence: the DP ranks fetched {headers[:, 1].tolist()} "
                            "micro-batches without tokens; check the loader")  # fmt: skip
    if dp_size == 1:
        return step
    ours = headers[:, 4] % cp_size == position % cp_size  # the DP ranks of this CP rank, in DP order
    counts, sizes = headers[ours, 2].tolist(), headers[ours, 3].tolist()
    # One exchange per step: each DP rank's lengths, input ids and labels side by side in one row.
    mine = torch.cat([torch.from_numpy(step.lengths), step.input_ids, step.labels])[None]
    widths = [count + 2 * size for count, size in zip(counts, sizes, strict=True)]
    parts = [
        piece
        for part, count, size in zip(all_gather_parts(mine, widths, group=dp_group), counts, sizes, strict=True)
        for piece in torch.split(part[0], [count, size, size])
    ]
    lengths, input_ids, labels = (torch.cat(parts[field::3]) for field in range(3))
    return FetchedStep(int(headers[ours, 1].sum()), input_ids, labels, lengths.numpy())


# -- packing this rank's groups -------------------------------------------------------------------------------------


def pack_rank_groups(
    schedule,
    step: FetchedStep,
    *,
    position: int,
    layout: DeliveryLayout,
    pad_token_id: int,
    tail_padding: str = "append_dummy_seq",
) -> list[Batch]:
    """This rank's packed micro-batches: for each micro-batch of ``schedule``, its group's sequences, padded for the
    group's CP size and filled to ``layout.local_length`` per rank.

    Args:
        schedule: the step's plan (``micro_batches``, ``group_at(micro_batch, position)`` with ``sequence_ids`` and
            ``cp_size``).
        step: the sequences in global id order (``exchange_sequences``).
        position: this rank's place in the DP x CP domain.
        layout: the delivery layout (the padding multiple and every rank's local length).
        pad_token_id: the padding's input id.
    """
    starts = np.cumsum(step.lengths) - step.lengths
    input_ids, labels = step.input_ids.numpy(), step.labels.numpy()
    packed = []
    for micro_batch in range(schedule.num_micro_batches):
        group = schedule.group_at(micro_batch, position)
        chosen = np.asarray(group.sequence_ids, dtype=np.int64)
        lengths = step.lengths[chosen]
        padded_total = int(layout.padded_lengths(lengths, group.cp_size).sum()) if chosen.size else 0
        cp, row, multiple = _group_row(
            group.cp_size, layout.local_length(padded_total, group.cp_size), layout.sequence_multiple(group.cp_size)
        )
        if not chosen.size:
            packed.append(_padding_group(cp, row, pad_token_id))
            continue
        _check_fits(lengths, multiple, cp, row)
        # Every token of the group's sequences, in packing order: one gather from the step's tokens (the
        # sequences were checked when their micro-batches were fetched).
        offsets = np.cumsum(lengths) - lengths
        where = np.arange(int(lengths.sum())) + np.repeat(starts[chosen] - offsets, lengths)
        collator = _collator(row, multiple, pad_token_id, tail_padding)
        packed.append(_with_cp_size(collator.pack_arrays([input_ids[where]], [labels[where]], lengths), cp))
    return packed
