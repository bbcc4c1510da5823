"""The packing scheduler across DP x CP ranks: one step's sequences re-scheduled, packed and delivered per rank.

Owns: the distributed half of the scheduler. ``BasePackingScheduler.run`` fetches a step's micro-batches on the data
ranks (TP rank 0 of PP stage 0; the CP ranks of a DP replica fetch identical data), unpacks them into sequences by
their boundaries, gathers every DP rank's sequences, schedules them (``get_groups_and_subsamples``, the pure
algorithms of ``parallel.data_schedule_utils``), packs this rank's groups and shares the micro-batch count and the
step's statistics with the TP and PP peers, so every rank runs the same number of micro-batches.
``wrap_data_iterator`` is the entry point; ``get_batch_on_this_rank_for_sequence_packing`` delivers one packed
micro-batch per call (TP, then PP broadcast, then this CP rank's ``zigzag_thd`` slice with the micro-batch's CP
size); ``get_batch_on_this_cp_rank`` is that slice alone. Not responsible for: the scheduling algorithms, alignment
and packing arithmetic (``parallel.data_schedule_utils``), the process groups (``parallel.process_groups``), the
layout's columns and the broadcast protocol (``parallel.batch_parallel``), or attention metadata
(``batching.attention_runtime``).

A packed micro-batch (what the wrapped iterator yields on a data rank) is a ``Batch``: ``input_ids`` and ``labels``
``[1, P]``, ``cu_seq_lens`` int32 over the packed sequences (each padded at its end to a multiple of ``2 * c``
when its CP size ``c`` is above 1, then one masked padding sequence up to ``P``), and the extra ``local_cp_size``
(int64 ``[1]``). ``P = c * local_length``; every rank of the micro-batch's CP group holds ``local_length`` tokens.

Example (every rank)::

    groups = ProcessGroupCollection.from_mesh(mesh, dynamic_cp_sizes=(1, 2, 4))
    config = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=8192, scheduler="dynamic_cp")
    iterator, num_micro_batches, stats = wrap_data_iterator(iter(loader), config, 8, pg_collection=groups)
    for _ in range(num_micro_batches):
        batch = get_batch_on_this_rank_for_sequence_packing(iterator, pg_collection=groups, dynamic_cp=True)
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from hyper_parallel.data.batching.attention_runtime import packed_seq_params
from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.scheduled_packing import pack_group
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError, require_int
from hyper_parallel.data.indexed.ltor_fields import positions_within_sequences
from hyper_parallel.data.parallel.batch_parallel import TPBatchBroadcaster, cp_local_columns
from hyper_parallel.data.parallel.data_schedule_utils import (
    FlopsStats,
    PackingSchedulerConfig,
    Schedule,
    build_schedule,
    schedule_stats,
)
from hyper_parallel.data.parallel.process_groups import ProcessGroupCollection

__all__ = [
    "PACKED_BATCH_FIELDS",
    "SCHEDULER_CLASSES",
    "BasePackingScheduler",
    "ComputeBalancedScheduler",
    "DefaultDynamicCPScheduler",
    "DpBalancedScheduler",
    "get_batch_on_this_cp_rank",
    "get_batch_on_this_rank_for_sequence_packing",
    "wrap_data_iterator",
]

# What a data rank sends its TP, then PP, peers for one packed micro-batch, in this order on every rank.
PACKED_BATCH_FIELDS = ("input_ids", "labels", "cu_seq_lens", "local_cp_size")
_ERROR_FIELDS = ("error_type", "error_message")
_ERROR_TYPES = (DataFileError, DataConfigError)  # re-raised as themselves on the peers; others as DataFileError
_LAYOUT = "zigzag_thd"


def _dist():
    import torch.distributed as dist

    return dist


# -- sharing one rank's outcome with its TP and PP peers ---------------------------------------------------------


class _Relay:
    """Sends a data rank's fields, its end of data, or its error over TP within PP stage 0, then over PP.

    Every rank calls ``relay`` for the same step. Errors travel as fields, so every peer raises the data rank's
    error type and message (``DataFileError`` for a type outside ``_ERROR_TYPES``), and the data rank its own.
    """

    def __init__(self, pg_collection: ProcessGroupCollection, field_names: Sequence[str], device) -> None:
        names = (*field_names, *_ERROR_FIELDS)
        on_first_stage = pg_collection.pp_rank == 0
        self.tp = (
            TPBatchBroadcaster(pg_collection.tp, pg_collection.tp_src(), device, names) if on_first_stage else None
        )
        self.pp = TPBatchBroadcaster(pg_collection.pp, pg_collection.pp_src(), device, names)
        self.is_data_rank = pg_collection.is_data_rank

    def relay(self, produce: Callable[[], dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor] | None:
        own_error, payload = None, None
        if self.tp is not None:
            if self.is_data_rank:
                try:
                    payload = produce()
                except Exception as error:
                    own_error, payload = error, _error_fields(error)
            payload = self.tp.broadcast(payload)
        payload = self.pp.broadcast(payload)
        if own_error is not None:
            raise own_error
        if payload is not None and "error_message" in payload:
            kind = int(payload["error_type"][0])
            message = bytes(payload["error_message"].cpu().tolist()).decode("utf-8", "replace")
            raise (_ERROR_TYPES[kind] if kind < len(_ERROR_TYPES) else DataFileError)(message)
        return payload


def _error_fields(error: BaseException) -> dict[str, torch.Tensor]:
    known = [i for i, kind in enumerate(_ERROR_TYPES) if type(error) is kind]
    message = str(error) if known else f"{type(error).__name__}: {error}"
    text = torch.frombuffer(bytearray(message.encode("utf-8")), dtype=torch.uint8) if message else torch.zeros(0)
    return {
        "error_type": torch.tensor([known[0] if known else len(_ERROR_TYPES)], dtype=torch.int64),
        "error_message": text.to(torch.uint8),
    }


# -- unpacking a fetched micro-batch -------------------------------------------------------------------------------


def _field(item: Mapping, names: tuple[str, ...], where: str) -> Any:
    for name in names:
        if name in item and item[name] is not None:
            return item[name]
    raise DataFileError(
        f"{where} has no {' or '.join(names)}; the packing scheduler takes Batches (the online collator's output) "
        f"or mappings with input_ids (or tokens), labels and cu_seq_lens (or cu_seqlens); it holds {sorted(item)}"
    )


def _integer_tensor(value: Any, name: str, where: str) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise DataFileError(f"{where}: {name} must hold integers, got {tensor.dtype}")
    return tensor.reshape(-1).to(torch.int64)


def unpack_sequences(item: Any, where: str = "a micro-batch") -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """``(input_ids, labels, lengths)`` of one fetched micro-batch: its rows flattened and its non-empty spans.

    Every span of ``cu_seq_lens`` is a sequence, prompt-only ones included (their labels are all
    ``IGNORE_INDEX``); zero-length spans (Megatron-style right-padded boundaries) are skipped.

    Raises:
        DataFileError: the item is not a ``Batch`` or a mapping with the fields, or its boundaries do not start at 0,
            decrease, or end elsewhere than at its token count.
    """
    if isinstance(item, Batch):
        ids, labels, bounds = item.input_ids, item.labels, item.cu_seq_lens
    elif isinstance(item, Mapping):
        ids = _field(item, ("input_ids", "tokens"), where)
        labels = _field(item, ("labels",), where)
        bounds = _field(item, ("cu_seq_lens", "cu_seqlens"), where)
    else:
        raise DataFileError(
            f"{where} is a {type(item).__name__}; the packing scheduler takes Batches (the online collator's output) "
            "or mappings with input_ids, labels and cu_seq_lens"
        )
    ids, labels = _integer_tensor(ids, "input_ids", where), _integer_tensor(labels, "labels", where)
    if ids.numel() != labels.numel():
        raise DataFileError(f"{where}: input_ids hold {ids.numel()} tokens but labels {labels.numel()}")
    bounds = _integer_tensor(bounds, "cu_seq_lens", where).numpy()
    if bounds.size < 1 or bounds[0] != 0 or bounds[-1] != ids.numel() or (np.diff(bounds) < 0).any():
        shown = bounds.tolist() if bounds.size <= 12 else [*bounds[:5].tolist(), "...", *bounds[-5:].tolist()]
        raise DataFileError(
            f"{where}: cu_seq_lens {shown} must start at 0, never decrease, and end at the {ids.numel()} tokens"
        )
    lengths = np.diff(bounds)
    return ids, labels, lengths[lengths > 0]


# -- the schedulers ------------------------------------------------------------------------------------------------


class BasePackingScheduler(ABC):
    """Re-schedules one step's sequences across the DP x CP ranks; ``run`` does the whole step.

    Subclasses name their algorithm (``scheduler``, a value of ``PackingSchedulerConfig.scheduler``) and implement
    ``get_groups_and_subsamples``.

    Args:
        config: the scheduler's settings; ``config.scheduler`` must be the subclass's.
        pg_collection: this rank's groups; scheduling uses ``dp`` (the gather), ``tp`` and ``pp`` (sharing the
            outcome), and, for dynamic CP, the sizes of ``dynamic_cp``.
        device: where the outcome is broadcast (``"cuda"`` with NCCL); packed micro-batches stay on the CPU.

    Raises:
        DataConfigError: a config of another scheduler, a collection of the wrong type, or (dynamic CP) a collection
            without dynamic CP groups, all before any data is read.
    """

    scheduler = ""

    def __init__(self, config: PackingSchedulerConfig, *, pg_collection: ProcessGroupCollection, device="cpu") -> None:
        if not isinstance(config, PackingSchedulerConfig):
            raise DataConfigError(f"config must be a PackingSchedulerConfig, got {type(config).__name__}")
        if config.scheduler != self.scheduler:
            raise DataConfigError(
                f"{type(self).__name__} runs the {self.scheduler!r} scheduler, but config.scheduler is "
                f"{config.scheduler!r}; use SCHEDULER_CLASSES[{config.scheduler!r}] (wrap_data_iterator picks it)"
            )
        if not isinstance(pg_collection, ProcessGroupCollection):
            raise DataConfigError(
                f"pg_collection must be a ProcessGroupCollection (ProcessGroupCollection.from_mesh), got "
                f"{type(pg_collection).__name__}"
            )
        self.config = config
        self.pg_collection = pg_collection
        self.device = torch.device(device)
        self.vpp_size = config.vpp_size if config.vpp_size is not None else 1
        group = config.microbatch_group_size_per_vp_stage or pg_collection.pp_size
        self.vpp_group = group if self.vpp_size > 1 else 1
        self.layout = config.layout(cp_size=pg_collection.cp_size, tp_size=pg_collection.tp_size)
        self._relay = _Relay(pg_collection, ("outcome",), self.device)

    @abstractmethod
    def get_groups_and_subsamples(self, lengths: np.ndarray) -> Schedule:
        """The schedule of a step's sequences, from their lengths in global id order (the same on every rank)."""

    def _build(self, lengths: np.ndarray, dynamic_cp_sizes: Sequence[int] = ()) -> Schedule:
        groups = self.pg_collection
        return build_schedule(
            self.config,
            np.asarray(lengths, dtype=np.int64),
            layout=self.layout,
            dp_size=groups.dp_size,
            dynamic_cp_sizes=tuple(dynamic_cp_sizes),
            vpp_group=self.vpp_group,
        )

    def run(self, data_iterator: Iterator | None, num_microbatches: int) -> tuple[Any, int, FlopsStats]:
        """Fetch, schedule, reroute and pack one step; every rank returns the same count and statistics.

        Args:
            data_iterator: on data ranks (TP rank 0 of PP stage 0), the loader's iterator; CP ranks of one DP
                replica must yield identical micro-batches. Ignored elsewhere.
            num_microbatches: how many micro-batches each data rank fetches (fewer when its data ends).

        Returns:
            ``(iterator, num_micro_batches, stats)``: on data ranks an iterator over this rank's packed micro-batches
            (a list of ``vpp_size`` iterators over the same micro-batches when ``vpp_size > 1``), None elsewhere;
            the step's micro-batch count; its ``FlopsStats``.

        Raises:
            StopIteration: every DP rank's iterator was exhausted before yielding anything, on every rank.
            DataFileError: the fetched micro-batches hold no sequence, or one is malformed (the same error on every
                rank; a DP rank whose own micro-batch is malformed raises its own error, the others name it).
            DataConfigError: a sequence no allowed CP size can hold, on every rank.
        """
        num_microbatches = require_int("num_microbatches", num_microbatches, 1)
        packed: list[Batch] = []

        def produce() -> dict[str, torch.Tensor] | None:
            step = self._exchange(data_iterator, num_microbatches)
            if step is None:
                return None
            lengths, ids, labels = step
            schedule = self.get_groups_and_subsamples(lengths)
            packed.extend(self._pack(schedule, lengths, ids, labels))
            stats = schedule_stats(schedule, lengths, self.config, layout=self.layout)
            count = torch.tensor([schedule.num_micro_batches], dtype=torch.float64)
            return {"outcome": torch.cat([count, stats.as_tensor().to(torch.float64)])}

        outcome = self._relay.relay(produce)
        if outcome is None:
            raise StopIteration
        values = outcome["outcome"].cpu()
        num_micro_batches, stats = int(values[0]), FlopsStats.from_tensor(values[1:])
        if not self.pg_collection.is_data_rank:
            return None, num_micro_batches, stats
        if self.vpp_size > 1:
            return [iter(list(packed)) for _ in range(self.vpp_size)], num_micro_batches, stats
        return iter(packed), num_micro_batches, stats

    # -- the data ranks ----------------------------------------------------------------------------------------------

    def _exchange(self, data_iterator, count: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor] | None:
        """All-gather over DP the fetched sequences: ``(lengths, input_ids, labels)`` in global id order, or None
        when no DP rank fetched anything."""
        dp_group, dp_size = self.pg_collection.dp, self.pg_collection.dp_size
        local_error, items, ids, labels, lengths = None, 0, torch.zeros(0, dtype=torch.int64), None, np.zeros(0)
        try:
            items, ids, labels, lengths = self._fetch(data_iterator, count)
        except Exception as error:
            local_error = error
        header = torch.tensor([local_error is not None, items, lengths.size, ids.numel()], dtype=torch.int64)
        headers = _all_gather(dp_group, dp_size, header).reshape(dp_size, 4)
        failed = torch.nonzero(headers[:, 0]).flatten().tolist()
        if local_error is not None:
            raise local_error
        if failed:
            raise DataFileError(
                f"DP rank {failed[0]} failed to read its micro-batches for the packing scheduler (DP ranks {failed} "
                f"failed); see DP rank {failed[0]}'s log for its error"
            )
        if int(headers[:, 1].sum()) == 0:
            return None
        counts, sizes = headers[:, 2].tolist(), headers[:, 3].tolist()
        if sum(counts) == 0:
            raise DataFileError(
                f"the global batch holds no sequence: the DP ranks fetched {headers[:, 1].tolist()} micro-batches, "
                "but their cu_seq_lens hold only zero-length spans; check the loader's boundaries (every sequence "
                "needs at least one token)"
            )
        if dp_size == 1:
            return lengths.astype(np.int64), ids, labels
        all_lengths = _all_gather_varying(dp_group, torch.from_numpy(lengths.astype(np.int64))[None], counts)
        tokens = _all_gather_varying(dp_group, torch.stack([ids, labels]), sizes)
        return all_lengths[0].numpy(), tokens[0], tokens[1]

    def _fetch(self, data_iterator, count: int) -> tuple[int, torch.Tensor, torch.Tensor, np.ndarray]:
        if data_iterator is None or not isinstance(data_iterator, Iterator):
            raise DataConfigError(
                f"the packing scheduler on a data rank (TP rank 0 of PP stage 0) needs the loader's iterator, got "
                f"{type(data_iterator).__name__}; pass iter(loader), kept across steps"
            )
        ids, labels, lengths, items = [], [], [], 0
        for _ in range(count):
            try:
                item = next(data_iterator)
            except StopIteration:
                break
            item_ids, item_labels, item_lengths = unpack_sequences(item, f"micro-batch {items} of this step")
            ids.append(item_ids)
            labels.append(item_labels)
            lengths.append(item_lengths)
            items += 1
        if not items:
            return 0, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), np.zeros(0, np.int64)
        return items, torch.cat(ids), torch.cat(labels), np.concatenate(lengths).astype(np.int64)

    def _pack(self, schedule: Schedule, lengths: np.ndarray, ids: torch.Tensor, labels: torch.Tensor) -> list[Batch]:
        """This rank's packed micro-batches: for each, its group's sequences, padded and filled to its length."""
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        position = self.pg_collection.position
        packed = []
        for micro_batch in range(schedule.num_micro_batches):
            group = schedule.group_at(micro_batch, position)
            chosen = list(group.sequence_ids)
            sequences = [(ids[starts[k] : starts[k + 1]], labels[starts[k] : starts[k + 1]]) for k in chosen]
            padded_total = int(self.layout.padded_lengths(lengths[chosen], group.cp_size).sum()) if chosen else 0
            local_length = self.layout.local_length(padded_total, group.cp_size)
            packed.append(
                pack_group(
                    sequences,
                    cp_size=group.cp_size,
                    local_length=local_length,
                    pad_token_id=self.config.pad_token_id,
                )
            )
        return packed


def _all_gather(group, size: int, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` of every rank of ``group``, stacked along a new first dimension."""
    if size == 1:
        return tensor[None]
    gathered = [torch.empty_like(tensor) for _ in range(size)]
    _dist().all_gather(gathered, tensor, group=group)
    return torch.stack(gathered)


def _all_gather_varying(group, tensor: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """Every rank's ``[F, widths[r]]`` tensor, concatenated along the last dimension in rank order."""
    padded = torch.zeros(tensor.shape[0], max(widths), dtype=tensor.dtype)
    padded[:, : tensor.shape[1]] = tensor
    gathered = _all_gather(group, len(widths), padded)
    return torch.cat([part[:, :width] for part, width in zip(gathered, widths, strict=True)], dim=1)


class DpBalancedScheduler(BasePackingScheduler):
    """Megatron-Core's DP-balanced packing: sequences in their order, next-fit up to each DP replica's capacity;
    the micro-batch count is a multiple of the DP size (times the VPP group)."""

    scheduler = "dp_balanced"

    def get_groups_and_subsamples(self, lengths: np.ndarray) -> Schedule:
        return self._build(lengths)


class DefaultDynamicCPScheduler(BasePackingScheduler):
    """Dynamic context parallelism: a CP size per packed group, from the sizes of ``pg_collection.dynamic_cp``
    only, balancing the per-rank cost across the DP x CP ranks."""

    scheduler = "dynamic_cp"

    def __init__(self, config: PackingSchedulerConfig, *, pg_collection: ProcessGroupCollection, device="cpu") -> None:
        super().__init__(config, pg_collection=pg_collection, device=device)
        if not pg_collection.dynamic_cp:
            raise DataConfigError(
                "the dynamic_cp scheduler chooses among the runtime CP sizes of pg_collection.dynamic_cp, which is "
                "empty; build the collection with ProcessGroupCollection.from_mesh(mesh, dynamic_cp_sizes=(1, 2, ...))"
            )

    def get_groups_and_subsamples(self, lengths: np.ndarray) -> Schedule:
        return self._build(lengths, self.pg_collection.dynamic_cp_sizes)


class ComputeBalancedScheduler(BasePackingScheduler):
    """Static CP; sequences assigned so that every DP rank's estimated step cost (``a*L + b*L^2``) is balanced."""

    scheduler = "compute_balanced"

    def get_groups_and_subsamples(self, lengths: np.ndarray) -> Schedule:
        return self._build(lengths)


SCHEDULER_CLASSES: dict[str, type[BasePackingScheduler]] = {
    "dp_balanced": DpBalancedScheduler,
    "dynamic_cp": DefaultDynamicCPScheduler,
    "compute_balanced": ComputeBalancedScheduler,
}


def wrap_data_iterator(
    data_iterator: Iterator | None,
    config: PackingSchedulerConfig,
    num_microbatches: int,
    *,
    pg_collection: ProcessGroupCollection,
    device="cpu",
) -> tuple[Any, int, FlopsStats]:
    """One step of the packing scheduler: ``(new_iterator, new_num_microbatches, flops_stats)`` on every rank.

    Every rank calls it once per step. The data ranks (TP rank 0 of PP stage 0) fetch ``num_microbatches``
    micro-batches from ``data_iterator``; ``config.scheduler`` picks the algorithm (``SCHEDULER_CLASSES``).

    Args:
        data_iterator: the loader's iterator on data ranks (the online collator's ``Batch`` es; use alignment 1:
            the scheduler pads), None elsewhere.
        config: the scheduler's settings.
        num_microbatches: micro-batches each data rank fetches for this step.
        pg_collection: this rank's groups.
        device: where the outcome is broadcast.

    Returns:
        See ``BasePackingScheduler.run``.

    Raises:
        DataConfigError: bad settings (before any data is read); see ``run`` for the rest.
    """
    if not isinstance(config, PackingSchedulerConfig):
        raise DataConfigError(
            f"config must be a PackingSchedulerConfig, got {type(config).__name__}; build one with "
            "PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=...)"
        )
    scheduler = SCHEDULER_CLASSES[config.scheduler](config, pg_collection=pg_collection, device=device)
    return scheduler.run(data_iterator, num_microbatches)


# -- delivering one packed micro-batch -------------------------------------------------------------------------------


def _renamed(new_name: str, new_value: Any, new_default: Any, old_name: str, old_value: Any) -> Any:
    """The value of a renamed keyword: the old one (with a ``DeprecationWarning``) when given."""
    if old_value is None:
        return new_value
    warnings.warn(
        f"{old_name} is deprecated; use {new_name} (hybrid context parallelism is now called dynamic context "
        "parallelism)",
        DeprecationWarning,
        stacklevel=3,
    )
    if new_value is not new_default and new_value != old_value:
        raise DataConfigError(
            f"{old_name}={old_value!r} and {new_name}={new_value!r} contradict each other; {old_name} is the "
            f"deprecated name of {new_name}: pass {new_name} only"
        )
    return old_value


def _dynamic_keywords(dynamic_cp, dynamic_cp_group_func, is_hybrid_cp, hybrid_cp_group_func):
    dynamic_cp = _renamed("dynamic_cp", dynamic_cp, False, "is_hybrid_cp", is_hybrid_cp)
    group_func = _renamed("dynamic_cp_group_func", dynamic_cp_group_func, None, "hybrid_cp_group_func",
                          hybrid_cp_group_func)  # fmt: skip
    if not isinstance(dynamic_cp, bool):
        raise DataConfigError(f"dynamic_cp must be true or false, got {dynamic_cp!r}")
    if group_func is not None and not callable(group_func):
        raise DataConfigError(
            f"dynamic_cp_group_func must be callable (runtime CP size -> group), got {type(group_func).__name__}"
        )
    return dynamic_cp, group_func


def _local_cp_size(batch: Mapping) -> int | None:
    value = batch.get("local_cp_size")
    if value is None:
        return None
    return require_int("the batch's local_cp_size", int(torch.as_tensor(value).reshape(-1)[0]), 1, DataFileError)


def _group_size_rank(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    dist = _dist()
    return dist.get_world_size(group), dist.get_rank(group)


def _choose_cp_group(batch: Mapping, cp_group, dynamic_cp: bool, group_func) -> tuple[Any, int, int]:
    """``(group, size, rank)`` the batch is cut across: its legacy ``hybrid_cp_group``, the dynamic group of its
    ``local_cp_size``, or ``cp_group``."""
    local_size = _local_cp_size(batch)
    legacy = batch.get("hybrid_cp_group")
    if legacy is not None:
        if cp_group is not None and cp_group is not legacy:
            raise DataConfigError(
                "the batch carries a hybrid_cp_group and a different cp_group was passed; pass one of them"
            )
        group = legacy
    elif dynamic_cp:
        if local_size is None:
            raise DataFileError(
                "dynamic CP cuts each micro-batch across its own CP size, but the batch has no local_cp_size; feed "
                "the packing scheduler's micro-batches (wrap_data_iterator), or call without dynamic_cp"
            )
        if group_func is None:
            raise DataConfigError(
                "dynamic CP needs the group of each runtime CP size: pass dynamic_cp_group_func (size -> group), "
                "e.g. pg_collection.dynamic_cp.get"
            )
        group = group_func(local_size)
    else:
        group = cp_group
    size, rank = _group_size_rank(group)
    if local_size is not None and local_size != size:
        raise DataConfigError(
            f"the micro-batch was packed for a CP size of {local_size}, but its CP group holds {size} ranks; under "
            "dynamic CP pass dynamic_cp=True (the scheduler 'dynamic_cp'), otherwise the static CP group the "
            "scheduler packed for"
        )
    return group, size, rank


def _cut(batch: Mapping, tokens_key: str, size: int, rank: int) -> dict[str, Any]:
    """Every ``[R, T]`` tensor of ``batch`` at this CP rank's ``zigzag_thd`` columns; the rest as it is."""
    tokens = batch[tokens_key]
    rows, row_length = tokens.shape
    bounds = _integer_tensor(_field(batch, ("cu_seq_lens", "cu_seqlens"), "the batch"), "cu_seq_lens", "the batch")
    columns = torch.from_numpy(cp_local_columns(_LAYOUT, bounds.numpy(), rows, row_length, size, rank))
    row_index = torch.arange(rows)[:, None]
    cut = {}
    for name, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (rows, row_length):
            value = value[row_index, columns.to(value.device)] if size > 1 else value
        cut[name] = value
    return cut


def get_batch_on_this_cp_rank(
    batch: Mapping[str, Any],
    cp_group=None,
    *,
    dynamic_cp: bool = False,
    dynamic_cp_group_func: Callable[[int], Any] | None = None,
    is_hybrid_cp: bool | None = None,
    hybrid_cp_group_func: Callable[[int], Any] | None = None,
) -> dict[str, Any]:
    """This CP rank's part of a packed batch: every ``[R, T]`` tensor at its ``zigzag_thd`` columns.

    The CP group is the batch's legacy ``hybrid_cp_group`` when it carries one; else, with ``dynamic_cp``, the group
    ``dynamic_cp_group_func(local_cp_size)`` of the batch's ``local_cp_size``; else ``cp_group``. Other entries
    (``cu_seq_lens``, scalars, groups) are returned as they are.

    Args:
        batch: ``tokens`` or ``input_ids`` ``[R, T]``, ``cu_seq_lens`` (or ``cu_seqlens``) over the rows flattened,
            every sequence a multiple of ``2 * size`` long; any other ``[R, T]`` tensors (labels, loss_mask,
            position_ids).
        cp_group: the static CP group (None: one rank, nothing is cut).
        dynamic_cp: cut across the micro-batch's own CP size.
        dynamic_cp_group_func: runtime CP size -> this rank's group of that size.
        is_hybrid_cp, hybrid_cp_group_func: deprecated names of ``dynamic_cp`` and ``dynamic_cp_group_func``
            (``DeprecationWarning``).

    Raises:
        DataConfigError: contradicting keywords, a missing group function, or a group whose size is not the batch's
            ``local_cp_size``.
        DataFileError: dynamic CP without ``local_cp_size``, or boundaries that do not divide.
    """
    dynamic_cp, group_func = _dynamic_keywords(dynamic_cp, dynamic_cp_group_func, is_hybrid_cp, hybrid_cp_group_func)
    if not isinstance(batch, Mapping):
        raise DataFileError(f"get_batch_on_this_cp_rank takes a mapping of fields, got {type(batch).__name__}")
    tokens_key = "tokens" if "tokens" in batch else "input_ids"
    if tokens_key not in batch:
        raise DataFileError(f"the batch has neither tokens nor input_ids; it holds {sorted(batch)}")
    _, size, rank = _choose_cp_group(batch, cp_group, dynamic_cp, group_func)
    return _cut(batch, tokens_key, size, rank)


def get_batch_on_this_rank_for_sequence_packing(
    data_iterator: Iterator | Sequence[Iterator] | None,
    *,
    pg_collection: ProcessGroupCollection,
    dynamic_cp: bool = False,
    dynamic_cp_group_func: Callable[[int], Any] | None = None,
    vpp_size: int | None = None,
    vp_stage: int | None = None,
    is_hybrid_cp: bool | None = None,
    hybrid_cp_group_func: Callable[[int], Any] | None = None,
    sequence_parallel: bool = False,
    device="cpu",
) -> dict[str, Any]:
    """The next packed micro-batch on this rank: its CP slice, with THD metadata.

    Every rank calls it once per micro-batch. The data rank (TP rank 0 of PP stage 0) reads the next packed
    micro-batch; it goes to the TP peers, then from PP stage 0 to the other stages; each rank keeps its CP rank's
    ``zigzag_thd`` columns for the micro-batch's CP size (its ``local_cp_size``): under dynamic CP the group is
    ``dynamic_cp_group_func(size)`` or ``pg_collection.dynamic_cp[size]``, else ``pg_collection.cp``.

    Args:
        data_iterator: the wrapped iterator (``wrap_data_iterator``) on data ranks, or the list of per-VPP-stage
            iterators (then ``vp_stage`` picks one); ignored elsewhere.
        pg_collection: this rank's groups.
        dynamic_cp: the micro-batches were scheduled by ``dynamic_cp``.
        dynamic_cp_group_func: runtime CP size -> group (default ``pg_collection.dynamic_cp``).
        vpp_size, vp_stage: virtual pipeline stages and this call's stage.
        is_hybrid_cp, hybrid_cp_group_func: deprecated names of ``dynamic_cp`` and ``dynamic_cp_group_func``.
        sequence_parallel: also record the TP x CP group (``pg_collection.tp_cp``, or ``dynamic_tp_cp[size]``).
        device: where the broadcast runs and the tensors are returned.

    Returns:
        ``tokens``, ``labels`` (int64 ``[1, s]``), ``loss_mask`` (float32 ``[1, s]``), ``position_ids`` (int64
        ``[1, s]``, restarting at 0 at every sequence) and ``packed_seq_params`` (``qkv_format="thd"``, the global
        boundaries, ``max_seqlen``, ``cp_group``, ``local_cp_size``, and ``tp_cp_group`` with sequence parallelism).

    Raises:
        StopIteration: the data rank's iterator is exhausted, on every rank of its TP and PP groups.
        DataConfigError: contradicting or bad keywords (before anything is read), a CP size without a group.
        DataFileError: a malformed micro-batch, on every rank of the TP and PP groups.
    """
    dynamic_cp, group_func = _dynamic_keywords(dynamic_cp, dynamic_cp_group_func, is_hybrid_cp, hybrid_cp_group_func)
    if not isinstance(pg_collection, ProcessGroupCollection):
        raise DataConfigError(f"pg_collection must be a ProcessGroupCollection, got {type(pg_collection).__name__}")
    if not isinstance(sequence_parallel, bool):
        raise DataConfigError(f"sequence_parallel must be true or false, got {sequence_parallel!r}")
    if group_func is None and dynamic_cp:
        group_func = _dynamic_group_lookup(pg_collection.dynamic_cp, "dynamic_cp")
    iterator = _stage_iterator(data_iterator, vpp_size, vp_stage) if pg_collection.is_data_rank else None
    device = torch.device(device)

    def produce() -> dict[str, torch.Tensor] | None:
        if iterator is None or not isinstance(iterator, Iterator):
            raise DataConfigError(
                f"the data rank (TP rank 0 of PP stage 0) needs the wrapped iterator, got {type(iterator).__name__}"
                "; pass the iterator wrap_data_iterator returned"
            )
        try:
            item = next(iterator)
        except StopIteration:
            return None
        ids, labels, lengths = unpack_sequences(item, "the packed micro-batch")
        width = int(torch.as_tensor(item["input_ids"] if "input_ids" in item else item["tokens"]).shape[-1])
        bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        fields = {"input_ids": ids.reshape(-1, width), "labels": labels.reshape(-1, width)}
        fields["cu_seq_lens"] = torch.from_numpy(bounds)
        local_size = _local_cp_size(item)
        if local_size is not None:
            fields["local_cp_size"] = torch.tensor([local_size], dtype=torch.int64)
        return fields

    received = _Relay(pg_collection, PACKED_BATCH_FIELDS, device).relay(produce)
    if received is None:
        raise StopIteration
    return _build_packed(received, pg_collection, dynamic_cp, group_func, sequence_parallel, device)


def _dynamic_group_lookup(groups: Mapping[int, Any], name: str) -> Callable[[int], Any]:
    def lookup(size: int):
        if size not in groups:
            raise DataConfigError(
                f"the micro-batch uses a runtime CP size of {size}, but pg_collection.{name} has groups of sizes "
                f"{sorted(groups)} only; create that size's groups (from_mesh(mesh, dynamic_cp_sizes=...))"
            )
        return groups[size]

    return lookup


def _stage_iterator(data_iterator, vpp_size, vp_stage):
    if vpp_size is not None and require_int("vpp_size", vpp_size, 1) > 1:
        if not isinstance(data_iterator, Sequence):
            return data_iterator
        stage = require_int("vp_stage", vp_stage, 0)
        if stage >= len(data_iterator):
            raise DataConfigError(f"vp_stage {stage} is not below the {len(data_iterator)} VPP iterators")
        return data_iterator[stage]
    return data_iterator


def _build_packed(received, pg_collection, dynamic_cp, group_func, sequence_parallel, device) -> dict[str, Any]:
    input_ids, labels, cu_seq_lens = (received[name] for name in PACKED_BATCH_FIELDS[:3])
    rows, row_length = input_ids.shape
    bounds = cu_seq_lens.cpu().numpy()
    positions = torch.from_numpy(positions_within_sequences(bounds).reshape(rows, row_length))
    full = {
        "tokens": input_ids,
        "labels": labels,
        "loss_mask": (labels != IGNORE_INDEX).to(torch.float32),
        "position_ids": positions.to(input_ids.device),
        "cu_seq_lens": cu_seq_lens,
    }
    if "local_cp_size" in received:
        full["local_cp_size"] = received["local_cp_size"]
    group, size, rank = _choose_cp_group(full, pg_collection.cp, dynamic_cp, group_func)
    cut = _cut(full, "tokens", size, rank)
    tp_cp_group = None
    if sequence_parallel:
        tp_cp_group = (
            _dynamic_group_lookup(pg_collection.dynamic_tp_cp, "dynamic_tp_cp")(size)
            if dynamic_cp
            else pg_collection.tp_cp
        )
    params = replace(
        packed_seq_params(bounds, cp_size=size, device=device),
        cp_group=group,
        local_cp_size=size,
        tp_cp_group=tp_cp_group,
    )
    result = {name: cut[name].to(device) for name in ("tokens", "labels", "loss_mask", "position_ids")}
    result["packed_seq_params"] = params
    return result
