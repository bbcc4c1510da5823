"""ParallelBatch: one collated micro-batch to ``(model_inputs, loss_inputs)`` on every rank of a DP x CP x TP mesh.

Owns: the last step of the pipeline. On a data rank (TP rank 0 of its (DP, CP) coordinate) it pulls the next
batch, normalises it to the batch contract (an Indexed megatron-style dict is renamed in ``indexed_batch``, the one
place), resolves the global sequence boundaries, keeps this CP rank's columns (``CPBatchSharder``) and broadcasts
the CP-local tokens and labels with the global ``cu_seq_lens`` to its TP peers (``TPBatchBroadcaster``). Every
rank then builds the same position ids, loss mask and attention metadata from those, so TP peers agree without
sending them. The end of the data, and a failure of the reader, reach every rank of the TP group in the same call.
Not responsible for: reading files or choosing samples (the loaders), the layouts' arithmetic and the collectives
(``parallel.batch_parallel``), where sequences end (``batching.sequence_boundaries``), the masks themselves
(``batching.attention_runtime``).

Outputs, for ``R`` rows of ``T`` tokens and ``s = T // cp`` local columns (docs/distributed.md states the
conventions once)::

    model_inputs = {"input_ids": [R, s], "labels": [R, s], "position_ids": [R, s],
                    "attention_mask": bool [R, 1, s, T] (dense: True = may attend) | BlockMask (flex) | None,
                    "swa_mask": bool [R, 1, s, T] (dense with sliding_window) | None,
                    "packed_seq_params": PackedSeqParams (packed) | None}
    loss_inputs = {"labels": [R, s], "loss_mask": float32 [R, s]}
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from hyper_parallel.data.batching.attention_runtime import (
    PackedSeqParams,
    dense_attention_mask,
    flex_block_mask,
    packed_seq_params,
)
from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.build_collate_fn import indexed_batch
from hyper_parallel.data.batching.sequence_boundaries import IndexedBoundaryResolver, OnlineBoundaryResolver
from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError, require_int
from hyper_parallel.data.indexed.ltor_fields import positions_within_sequences
from hyper_parallel.data.parallel.batch_parallel import (
    CP_LAYOUTS,
    CPBatchSharder,
    TPBatchBroadcaster,
    cp_local_columns,
)
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext

__all__ = ["ATTENTION_MODES", "MODEL_INPUT_KEYS", "LOSS_INPUT_KEYS", "SOURCE_TYPES", "ParallelBatch"]

logger = get_logger(__name__)

SOURCE_TYPES = ("online", "indexed")
ATTENTION_MODES = ("dense", "packed", "flex", "none")
MODEL_INPUT_KEYS = ("input_ids", "labels", "position_ids", "attention_mask", "swa_mask", "packed_seq_params")
LOSS_INPUT_KEYS = ("labels", "loss_mask")
_SENT = ("input_ids", "labels", "cu_seq_lens")  # what the data rank sends its TP peers; the rest is rebuilt


def _shape_of(value: Any) -> str:
    """A model input's type and shape for a log line (never its values): ``bool[2, 1, 8, 16]``, ``None``."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, PackedSeqParams):
        return f"PackedSeqParams({len(value.cu_seqlens_q) - 1} sequences)"
    shape = getattr(value, "shape", None)  # a FlexAttention BlockMask
    return type(value).__name__ + ("" if shape is None else str(list(shape)))


def _choice(name: str, value: Any, choices: tuple[str, ...], meaning: str) -> str:
    """``value`` when it is one of ``choices``; else a ``DataConfigError`` with the closest name."""
    if isinstance(value, str) and value in choices:
        return value
    close = difflib.get_close_matches(str(value), choices, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise DataConfigError(f"{name} is {value!r}{hint}; use one of {', '.join(choices)}: {meaning}")


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise DataConfigError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
    return value


class ParallelBatch:
    """Deliver each micro-batch as ``(model_inputs, loss_inputs)`` on every rank: ``get_batch(data_iterator)``.

    Args:
        source_type: ``"online"`` (the packing collator's ``cu_seq_lens``) or ``"indexed"`` (boundaries after each
            EOD token and at each row end).
        parallel_context: this rank's ``DataLoaderParallelContext``; None is a single process.
        attention_mode: ``"dense"`` (a bool mask of the local queries against all keys), ``"packed"``
            (``PackedSeqParams`` for THD kernels), ``"flex"`` (a FlexAttention ``BlockMask``) or ``"none"``.
        cp_layout: which columns each CP rank holds: ``"contiguous"``, ``"zigzag"`` or ``"zigzag_thd"``; with
            more than one CP rank, ``"packed"`` needs ``"zigzag_thd"`` (the layout Transformer Engine's THD
            attention expects), which needs Online batches whose sequences are padded to ``2 * cp``.
        causal: queries see only keys at or before their own column.
        sliding_window: ``w``, with dense or flex attention: a query also sees only itself and the ``w`` keys
            before it (``query - w <= key``; and ``key <= query + w`` without ``causal``), Transformer Engine's
            window ``(w, 0)``; a Hugging Face ``sliding_window`` counts the query too, so it is ``w + 1``. None for
            no window.
        reset_position_ids: position ids restart at 0 at every sequence (else the global columns).
        eod_mask_loss: the loss mask is also 0 where the input is the EOD token.
        eod_token_id: the EOD id; needed by indexed sources and by ``eod_mask_loss``.
        device: where the returned tensors are (and where the TP broadcast runs: ``"cuda"`` with NCCL).

    Raises:
        DataConfigError: an unknown name (with the closest one), a flag that is not a bool, a window that is not a
            positive integer, a missing ``eod_token_id``, or a layout that the attention mode cannot use.
    """

    def __init__(
        self,
        source_type: str,
        *,
        parallel_context: DataLoaderParallelContext | None = None,
        attention_mode: str = "dense",
        cp_layout: str = "contiguous",
        causal: bool = True,
        sliding_window: int | None = None,
        reset_position_ids: bool = False,
        eod_mask_loss: bool = False,
        eod_token_id: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.source_type = _choice("source_type", source_type, SOURCE_TYPES, "the kind of loader feeding it")
        self.attention_mode = _choice(
            "attention_mode", attention_mode, ATTENTION_MODES, "the attention metadata the model takes"
        )
        self.cp_layout = _choice("cp_layout", cp_layout, CP_LAYOUTS, "how a row is cut across context-parallel ranks")
        self.causal = _flag("causal", causal)
        self.reset_position_ids = _flag("reset_position_ids", reset_position_ids)
        self.eod_mask_loss = _flag("eod_mask_loss", eod_mask_loss)
        self.sliding_window = self._window(sliding_window)
        self.eod_token_id = self._eod(eod_token_id)
        self.device = torch.device(device)
        context = parallel_context if parallel_context is not None else DataLoaderParallelContext.standalone()
        if not isinstance(context, DataLoaderParallelContext):
            raise DataConfigError(
                f"parallel_context must be a DataLoaderParallelContext (from_mesh, from_groups or standalone), got "
                f"{type(context).__name__}"
            )
        self.context = context
        self._check_layout()
        if self.source_type == "online":
            self._resolve = OnlineBoundaryResolver()
        else:
            self._resolve = IndexedBoundaryResolver(self.eod_token_id)
        self._sharder = CPBatchSharder(context.cp_size, context.cp_rank, self.cp_layout)
        self._broadcaster = TPBatchBroadcaster(context.tp_group, context.tp_src, device=self.device)
        self._shapes: tuple | None = None  # the shape signature of the last batch logged
        reads = "reads the loader" if context.is_data_rank else f"receives global rank {context.tp_src}'s batches"
        logger.info(
            "ParallelBatch: %s source, %s attention, CP rank %d of %d (%s layout), TP rank %d of %d, %s, on %s",
            self.source_type,
            self.attention_mode,
            context.cp_rank,
            context.cp_size,
            self.cp_layout,
            context.tp_rank,
            context.tp_size,
            reads,
            self.device,
        )

    def _window(self, sliding_window: Any) -> int | None:
        if sliding_window is None:
            return None
        try:
            window = require_int("sliding_window", sliding_window, 1)
        except DataConfigError as error:
            raise DataConfigError(
                f"{error}; set it to how many keys before its own a query sees (Transformer Engine's window (w, 0)), "
                "or null for no window"
            ) from None
        if self.attention_mode in ("packed", "none"):
            raise DataConfigError(
                f"sliding_window {window} has no effect with attention_mode {self.attention_mode!r}: only dense and "
                "flex masks carry a window. Give the window to the attention kernel instead (Transformer Engine: "
                f"window_size=({window}, 0)), and set sliding_window to null"
            )
        return window

    def _eod(self, eod_token_id: Any) -> int | None:
        if eod_token_id is not None:
            return require_int("eod_token_id", eod_token_id, 0)
        needs = [why for why, needed in (("indexed boundaries", self.source_type == "indexed"),
                                         ("eod_mask_loss", self.eod_mask_loss)) if needed]  # fmt: skip
        if needs:
            raise DataConfigError(
                f"eod_token_id is not set, but {' and '.join(needs)} need it; set eod_token_id to the tokenizer's "
                "EOD (EOS) id, or build the pipeline with a tokenizer (build_dataloaders offers its EOD id)"
            )
        return None

    def _check_layout(self) -> None:
        cp = self.context.cp_size
        if cp == 1:
            return
        if self.attention_mode == "packed" and self.cp_layout != "zigzag_thd":
            raise DataConfigError(
                f"attention_mode 'packed' with cp_size {cp} needs cp_layout 'zigzag_thd', got {self.cp_layout!r}: "
                "THD attention with context parallelism (Transformer Engine) expects every sequence cut in 2 * cp "
                "chunks. Set cp_layout: zigzag_thd, or use attention_mode dense or flex"
            )
        if self.cp_layout == "zigzag_thd" and self.source_type == "indexed":
            raise DataConfigError(
                f"cp_layout 'zigzag_thd' with cp_size {cp} needs every sequence padded to a multiple of {2 * cp}, "
                "which Indexed rows (documents cut at EOD tokens) are not; use cp_layout contiguous or zigzag for "
                "indexed sources"
            )

    def __repr__(self) -> str:
        context = self.context
        return (
            f"{type(self).__name__}(source_type={self.source_type!r}, attention_mode={self.attention_mode!r}, "
            f"cp_layout={self.cp_layout!r}, causal={self.causal}, sliding_window={self.sliding_window}, "
            f"reset_position_ids={self.reset_position_ids}, eod_mask_loss={self.eod_mask_loss}, "
            f"eod_token_id={self.eod_token_id}, device={str(self.device)!r}, cp={context.cp_rank}/{context.cp_size}, "
            f"tp={context.tp_rank}/{context.tp_size})"
        )

    # -- one step -------------------------------------------------------------------------------------------------

    def __call__(self, data_iterator: Iterator | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The next micro-batch on this rank: ``(model_inputs, loss_inputs)``.

        Args:
            data_iterator: the loader's iterator (``iter(loader)``) on data ranks; other ranks may pass None.

        Raises:
            StopIteration: the data rank's iterator is exhausted; every rank of its TP group raises it in the same
                call.
            DataFileError, DataConfigError: the batch breaks the contract, or its boundaries cannot be cut into this
                layout; a reader's error is raised on the data rank and on its TP peers.
        """
        sent = None
        if self.context.is_data_rank:
            try:
                sent = self._read(data_iterator)
            except Exception as error:
                self._broadcaster.broadcast_failure("read the next batch", error)  # the TP peers raise it too
                raise
        received = self._broadcaster.broadcast(sent)
        if received is None:
            raise StopIteration
        return self._build(received)

    def _check_loss_tokens(self, batch: Batch) -> None:
        """Under ``eod_mask_loss``, which masks the EOD inputs here, refuse a micro-batch left without a token that
        carries a loss (its mean loss would be NaN on every CP rank): the mask is taken over the whole batch before
        it is cut. Without it the loader's rule stands (a transform refuses a record without a loss token)."""
        if not self.eod_mask_loss or bool(((batch.labels >= 0) & (batch.input_ids != self.eod_token_id)).any()):
            return
        raise DataFileError(
            f"get_batch: no token of the micro-batch of {batch.input_ids.shape[0]} row(s) carries a loss (each has an "
            "IGNORE_INDEX label or an EOD input, masked by eod_mask_loss), so its loss would be NaN; remove the "
            "documents that hold only EOD tokens from the data, or set eod_mask_loss to false"
        )

    def _read(self, data_iterator: Iterator | None) -> dict[str, torch.Tensor] | None:
        """On the data rank: the CP-local fields and the global boundaries of the next batch; None at the end."""
        if data_iterator is None or not isinstance(data_iterator, Iterator):
            raise DataConfigError(
                f"get_batch on a data rank (tp_rank 0) needs the loader's iterator, got {type(data_iterator).__name__}"
                "; call get_batch(iter(loader)) with one iterator kept across steps"
            )
        try:
            batch = next(data_iterator)
        except StopIteration:
            return None
        batch = self._as_batch(batch)
        self._check_loss_tokens(batch)
        cu_seq_lens = self._resolve(batch)
        local, _ = self._sharder.shard({"input_ids": batch.input_ids, "labels": batch.labels}, cu_seq_lens)
        return {**local, "cu_seq_lens": cu_seq_lens}

    def _as_batch(self, batch: Any) -> Batch:
        if isinstance(batch, Batch):
            return batch
        if self.source_type == "indexed" and isinstance(batch, Mapping) and "tokens" in batch:
            return indexed_batch(batch, eod_token_id=self.eod_token_id)
        raise DataFileError(
            f"get_batch received a {type(batch).__name__} from the loader; it takes a Batch (the collators' "
            "output) or, for indexed sources, a megatron-style dict with tokens, labels and loss_mask. Use "
            "build_online_text_collate_fn or build_indexed_collate_fn as the loader's collate_fn"
        )

    def _build(self, received: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Every rank: position ids, loss mask and attention metadata from the local tokens and global boundaries."""
        input_ids, labels, cu_seq_lens = (received[name] for name in _SENT)
        rows, local = input_ids.shape
        row_length = local * self.context.cp_size
        bounds = cu_seq_lens.cpu().numpy()
        columns = cp_local_columns(self.cp_layout, bounds, rows, row_length, self.context.cp_size, self.context.cp_rank)
        loss_mask = labels >= 0
        if self.eod_mask_loss:
            loss_mask &= input_ids != self.eod_token_id
        attention_mask = swa_mask = packed = None
        if self.attention_mode == "dense":
            attention_mask, swa_mask = dense_attention_mask(
                bounds, columns, row_length, causal=self.causal, sliding_window=self.sliding_window, device=self.device
            )
        elif self.attention_mode == "flex":
            attention_mask = flex_block_mask(
                bounds, columns, row_length, causal=self.causal, sliding_window=self.sliding_window,
                device=self.device,
            )  # fmt: skip
        elif self.attention_mode == "packed":
            packed = packed_seq_params(bounds, cp_size=self.context.cp_size, device=self.device)
        device = self.device
        model_inputs = {
            "input_ids": input_ids.to(device),
            "labels": labels.to(device),
            "position_ids": torch.from_numpy(self._positions(bounds, columns, row_length)).to(device),
            "attention_mask": attention_mask,
            "swa_mask": swa_mask,
            "packed_seq_params": packed,
        }
        loss_inputs = {"labels": model_inputs["labels"], "loss_mask": loss_mask.to(device, torch.float32)}
        if logger.isEnabledFor(logging.DEBUG):
            self._log_shapes(model_inputs, row_length)
        return model_inputs, loss_inputs

    def _log_shapes(self, model_inputs: dict[str, Any], row_length: int) -> None:
        """Log the delivered shapes at the first batch and whenever they change, never per batch."""
        shapes = tuple((name, _shape_of(value)) for name, value in model_inputs.items())
        if shapes == self._shapes:
            return
        first, self._shapes = self._shapes is None, shapes
        context = self.context
        logger.debug(
            "get_batch %s: %s; rows of %d tokens, %d columns on CP rank %d of %d (%s), TP rank %d of %d",
            "first batch" if first else "shapes changed",
            ", ".join(f"{name} {shape}" for name, shape in shapes),
            row_length,
            row_length // context.cp_size,
            context.cp_rank,
            context.cp_size,
            self.cp_layout,
            context.tp_rank,
            context.tp_size,
        )

    def _positions(self, bounds: np.ndarray, columns: np.ndarray, row_length: int) -> np.ndarray:
        """int64 ``[R, s]``: the local tokens' global columns, or their distances from their sequences' starts."""
        if not self.reset_position_ids:
            return np.ascontiguousarray(columns, dtype=np.int64)
        within = positions_within_sequences(bounds).reshape(len(columns), row_length)
        return np.take_along_axis(within, columns, axis=1)
