"""Delivery against like-for-like references: our FlexAttention BlockMask against FlexAttention's own
``create_block_mask``, ``ParallelBatch`` per micro-batch against the collator that made the micro-batch; TP broadcast
bytes; PP bytes with field ownership against every field to every stage.

* **Input.** Packed rows of ``T`` tokens (8k, 32k and 128k; 8k and 32k with ``--quick``) holding documents of
  seeded lognormal lengths (median 1,024 tokens, sigma 1.0; multiples of 16 for the masks, so that every layout up to
  cp 8 cuts them), the last one cut at the row end.
* **BlockMask.** For cp 1, 2, 4 and 8, rank 0's zigzag columns are taken untimed (``cp_local_columns``), then ours,
  ``flex_block_mask`` (block tables from each query's key interval), is timed against
  ``torch.nn.attention.flex_attention.create_block_mask`` given our ``mask_mod`` itself (document-causal over the
  local queries; it evaluates the ``mask_mod`` on every (query, key) pair), ``Q_LEN = T / cp``, ``KV_LEN = T``, blocks
  of 128, on the same device. The two masks are asserted equal block for block (every table, key-major and
  query-major) and their bytes compared. The reference is skipped where it would evaluate more than
  ``REFERENCE_PAIRS`` pairs (tens of seconds on a CPU); our build is still timed there.
* **ParallelBatch.** One process, a ``DataLoaderParallelContext`` from integers (rank 0 of cp 1, 2, 4, 8, no group, so
  the relay sends nothing): ``ParallelBatch(attention_mode=packed | flex)`` delivers one collated micro-batch (shard,
  relay, position ids, loss mask, metadata) in the training process, timed against the Online collator
  (``build_online_text_collate_fn(layout=stage.layout, delivery_plan=stage.delivery_plan)``) packing the same samples
  in a DataLoader worker. The collator is given the stage's ``delivery_plan``, so the metadata that depends only on
  the batch and the plan (rank 0's columns, position ids, THD params or FlexAttention block tables) is computed, and
  timed, on the collator's side; the stage checks the plan, gathers the tokens, labels and loss mask and wraps the
  tables. Each timed call is a run of ``RUN`` (8) micro-batches in a row, on both sides, divided by 8: the harness
  collects garbage before every timed call, which leaves a single call of tens of microseconds timing cold caches
  rather than a trainer's steady state. Checked: the delivered tokens, labels and loss mask are the batch's at the
  rank's columns (and ``tests/batching/test_delivery_plan.py`` asserts the delivery equal to the stage's own
  computation).
* **Device.** With ``--device cuda`` both sets of rows run on the GPU: masks, tables and metadata on the device, the
  micro-batch pinned (untimed, as ``DataLoader(pin_memory=True)``'s thread does) and copied with
  ``non_blocking=True`` inside the timed delivery, each timed call ending with ``torch.cuda.synchronize``. Without a
  CUDA device those rows are skipped, with the reason, and the byte rows still run.
* **PP bytes.** At 32k tokens (cp 1), the bytes one ``BatchRelay`` PP hop sends from stage 0 for one micro-batch
  (``pipeline_bytes``, the count the relay's ``last_pp_bytes`` reports, asserted equal in ``tests/parallel/
  test_relay.py``) with Megatron-Core's field ownership, against the same hop sending every field to every stage,
  for PP 2, 4 and 8 and two field sets: the packed micro-batch (int64 ``input_ids`` and ``labels``, the int32
  ``cu_seq_lens``, ``local_cp_size``) and Megatron's full set (adding int64 ``position_ids`` and float32
  ``loss_mask``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask

from benchmarks.common import BenchContext, Row, log, measure, synchronize, unavailable_device
from hyper_parallel.data.batching.attention_runtime import flex_block_mask
from hyper_parallel.data.batching.build_collate_fn import build_online_text_collate_fn
from hyper_parallel.data.batching.get_batch import ParallelBatch
from hyper_parallel.data.parallel.batch_parallel import (
    BROADCAST_FIELDS,
    broadcast_bytes,
    cp_local_columns,
    header_bytes,
    pipeline_bytes,
)
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext

NAME = "parallel"
TITLE = (
    "Delivery vs like-for-like references: our BlockMask vs create_block_mask, ParallelBatch vs the collator; TP "
    "broadcast bytes; PP bytes with field ownership vs every field to every stage"
)

TOKENS_FULL = (8 * 1024, 32 * 1024, 128 * 1024)
TOKENS_QUICK = (8 * 1024, 32 * 1024)
CP_SIZES = (1, 2, 4, 8)
GOAL_TOKENS = 32 * 1024  # the size of the PP rows
MEDIAN_DOCUMENT = 1024
SIGMA = 1.0
SEED = 1234
VOCAB = 50_000
MULTIPLE = 16  # 2 * the largest cp: every layout cuts every document
BLOCK_SIZE = 128
REFERENCE_PAIRS = {"cpu": 1 << 28, "cuda": 1 << 33}  # (query, key) pairs create_block_mask evaluates at most
MASK_BUILD_GOAL = 0.5
MASK_BYTES_GOAL = 1.0
DELIVERY_GOAL = 0.25
DELIVERY_MODES = {"packed": "zigzag_thd", "flex": "zigzag"}
BROADCAST_GOAL = 1.01
REPEATS_FACTOR = 3  # most calls take milliseconds: more repetitions steady the best one
RUN = 8  # micro-batches per timed delivery and per timed collation: a trainer's steady state, not a call after gc
PP_SIZES = (2, 4, 8)
PIPELINE_SLACK = 1.05
RELAY_FIELDS = (*BROADCAST_FIELDS, "local_cp_size")

_NOTE_MASK_TIME = (
    "ms to build rank 0's BlockMask (zigzag columns, blocks of 128) with flex_block_mask, best of the run's repeats; "
    "reference: torch's create_block_mask(mask_mod, 1, None, T/cp, T) given our mask_mod itself (it evaluates the "
    "mask_mod on every query-key pair), same device; the two masks asserted equal block for block"
)
_NOTE_MASK_BYTES = (
    "bytes of every tensor the BlockMask holds (kv, full-kv and the transposed q tables, and the two int32 [R, s] "
    "tensors its mask_mod reads), against create_block_mask's with the same mask_mod: the same format, so 1.0 "
    "unless ours holds more"
)
_NOTE_DELIVERY = (
    "ms for ParallelBatch to deliver one micro-batch on rank 0 of the CP size in the training process (a context "
    "from integers, no group: plan check, CP gather of tokens, labels and loss mask, relay, the mode's metadata "
    "wrapped), per micro-batch of a timed run of 8 in a row, best of 3 x the run's repeats; reference: the Online "
    "collator given the stage's delivery_plan (build_online_text_collate_fn(layout=stage.layout, "
    "delivery_plan=stage.delivery_plan)) packing the same samples into that batch in a DataLoader worker (a run of 8 "
    "in a row likewise), the rank's columns, position ids and THD params or block tables included"
)
_NOTE_BROADCAST = (
    "bytes one TP broadcast sends (TPBatchBroadcaster: header, the CP-local input_ids and labels, the global int32 "
    "cu_seq_lens), against the local tensors' bytes plus the header"
)
_NOTE_PIPELINE = (
    "bytes one BatchRelay PP hop sends from stage 0 for one micro-batch with Megatron-Core's field ownership (first "
    "stage: input_ids, position_ids; last: labels, loss_mask; every stage: cu_seq_lens, local_cp_size), a header per "
    "later stage included; reference: the same hop sending every field to every stage"
)


def boundaries(tokens: int) -> np.ndarray:
    """int32 boundaries of one row of ``tokens``: seeded lognormal documents, multiples of ``MULTIPLE``."""
    rng = np.random.default_rng(SEED)
    lengths = rng.lognormal(np.log(MEDIAN_DOCUMENT), SIGMA, size=tokens // MULTIPLE)
    lengths = np.maximum(MULTIPLE, np.round(lengths / MULTIPLE).astype(np.int64) * MULTIPLE)
    ends = np.cumsum(lengths)
    return np.concatenate([[0], ends[ends < tokens], [tokens]]).astype(np.int32)


def metadata_bytes(block_mask: Any) -> int:
    """Bytes of the distinct tensors a BlockMask holds, with those its ``mask_mod`` reads."""
    captured = [cell.cell_contents for cell in block_mask.mask_mod.__closure__ or ()]
    values = [*block_mask.as_tuple(flatten=True), *captured]
    tensors = {value.data_ptr(): value for value in values if isinstance(value, torch.Tensor)}
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def check_same_blocks(ours: Any, reference: Any, where: str) -> None:
    """Every table of the two BlockMasks is equal (key-major and query-major, partial and full), as are the sizes."""
    assert ours.seq_lengths == reference.seq_lengths and ours.BLOCK_SIZE == reference.BLOCK_SIZE, where
    for mine, theirs in zip(ours.as_tuple(flatten=True), reference.as_tuple(flatten=True), strict=True):
        if isinstance(mine, torch.Tensor) or isinstance(theirs, torch.Tensor):
            assert isinstance(mine, torch.Tensor) and torch.equal(mine, theirs.to(mine.device)), where
        elif not callable(mine):
            assert mine == theirs, where


def _label(tokens: int) -> str:
    return f"{tokens // 1024}k"


def _synchronized(call: Callable[[], Any], device: str) -> Callable[[], Any]:
    """``call`` that returns only once the device has run what it queued, so that its time includes that work."""

    def timed():
        result = call()
        synchronize(device)
        return result

    return timed


# -- our BlockMask against create_block_mask --------------------------------------------------------------------


def _mask_cases(tokens: int, device: str) -> dict[str, Callable[[], Any]]:
    """The builds at one size by case name: ``"ours cp2"``, and ``"reference cp2"`` where it evaluates few enough
    (query, key) pairs."""
    cu_seq_lens = boundaries(tokens)
    cases = {}
    for cp in CP_SIZES:
        columns = cp_local_columns("zigzag", cu_seq_lens, 1, tokens, cp, 0)
        ours = _synchronized(lambda c=columns: flex_block_mask(cu_seq_lens, c, tokens, device=device), device)
        cases[f"ours cp{cp}"] = ours
        if tokens * tokens // cp <= REFERENCE_PAIRS[device]:
            mask_mod = ours().mask_mod  # the same mask_mod: the same document-causal rule over the same tensors
            cases[f"reference cp{cp}"] = _synchronized(
                lambda m=mask_mod, q=tokens // cp: create_block_mask(
                    m, 1, None, q, tokens, device=device, BLOCK_SIZE=BLOCK_SIZE
                ),
                device,
            )
    return cases


def _mask_rows(context: BenchContext, tokens: int) -> list[Row]:
    """Build time and bytes of our BlockMask against create_block_mask's, per cp, the two asserted equal."""
    cases = _mask_cases(tokens, context.device)
    log(f"{_label(tokens)} tokens: timing {len(cases)} BlockMask builds x {context.repeats} on {context.device}")
    timings = measure(cases, context.repeats)
    rows = []
    for cp in CP_SIZES:
        name = f"flex {_label(tokens)} cp{cp} on {context.device}"
        ours = cases[f"ours cp{cp}"]()
        reference_case = cases.get(f"reference cp{cp}")
        if reference_case is None:
            why = f"no reference: create_block_mask would evaluate more than {REFERENCE_PAIRS[context.device]:,} pairs"
            rows.append(Row(f"{name}: build vs create_block_mask", timings[f"ours cp{cp}"].best * 1e3, None, "ms",
                            None, None, f"{_NOTE_MASK_TIME} ({why})", False))  # fmt: skip
            continue
        reference = reference_case()
        check_same_blocks(ours, reference, f"{name}: our BlockMask differs from create_block_mask's")
        rows.append(Row.compare(f"{name}: build vs create_block_mask", timings[f"ours cp{cp}"].best * 1e3,
                                timings[f"reference cp{cp}"].best * 1e3, "ms", MASK_BUILD_GOAL, _NOTE_MASK_TIME,
                                higher_is_better=False))  # fmt: skip
        rows.append(Row.compare(f"{name}: bytes vs create_block_mask", metadata_bytes(ours) / 1e3,
                                metadata_bytes(reference) / 1e3, "KB", MASK_BYTES_GOAL, _NOTE_MASK_BYTES,
                                higher_is_better=False))  # fmt: skip
    return rows


# -- ParallelBatch against the collator ------------------------------------------------------------------------


def samples(tokens: int) -> list[dict[str, np.ndarray]]:
    """The documents of ``boundaries(tokens)`` as Online samples: seeded token ids, labels equal to the ids."""
    cu_seq_lens = boundaries(tokens).astype(np.int64)
    ids = np.random.default_rng(SEED + 1).integers(0, VOCAB, size=tokens, dtype=np.int64)
    return [{"input_ids": ids[a:b], "labels": ids[a:b]} for a, b in zip(cu_seq_lens[:-1], cu_seq_lens[1:], strict=True)]


def _delivery(mode: str, cp: int, device: str, documents: list[dict[str, np.ndarray]]):
    """``(collate, deliver, check)``: the reference, ours on one collated micro-batch, and the check of ours."""
    stage = ParallelBatch(
        parallel_context=DataLoaderParallelContext(cp_size=cp), attention_mode=mode, cp_layout=DELIVERY_MODES[mode],
        device=device,
    )  # fmt: skip
    collate = build_online_text_collate_fn(layout=stage.layout, delivery_plan=stage.delivery_plan)
    batch = collate(documents)
    if device == "cpu":
        deliver = lambda: stage(iter([batch]))  # noqa: E731
    else:
        pinned = batch.pin_memory()  # the DataLoader's pin thread, untimed
        deliver = lambda: stage(iter([pinned.to(device, non_blocking=True)]))  # noqa: E731

    def check(delivered) -> None:
        model_inputs, loss_inputs = delivered
        rows, width = batch.input_ids.shape
        columns = torch.from_numpy(cp_local_columns(stage.cp_layout, batch.cu_seq_lens, rows, width, cp, 0))
        for name, wanted in (("input_ids", batch.input_ids), ("labels", batch.labels)):
            assert torch.equal(model_inputs[name].cpu(), torch.gather(wanted, 1, columns)), f"{mode} cp{cp}: {name}"
        wanted_mask = (torch.gather(batch.labels, 1, columns) >= 0).float()
        assert torch.equal(loss_inputs["loss_mask"].cpu(), wanted_mask), f"{mode} cp{cp}: loss_mask"

    def collate_run() -> None:
        for _ in range(RUN):
            collate(documents)

    def deliver_run():
        for _ in range(RUN - 1):
            deliver()
        return deliver()

    return collate_run, _synchronized(deliver_run, device), check


def _delivery_rows(context: BenchContext, tokens: int) -> list[Row]:
    """Per mode and cp: one micro-batch's delivery against its collation, interleaved, the delivery checked."""
    documents = samples(tokens)
    repeats = REPEATS_FACTOR * context.repeats
    log(f"{_label(tokens)} tokens, {len(documents)} samples: ParallelBatch vs the collator x {repeats}")
    rows = []
    for mode in DELIVERY_MODES:
        for cp in CP_SIZES:
            collate, deliver, check = _delivery(mode, cp, context.device, documents)
            check(deliver())
            timings = measure({"collate": collate, "deliver": deliver}, repeats)
            rows.append(Row.compare(f"ParallelBatch {mode} {_label(tokens)} cp{cp} on {context.device}: delivery vs "
                                    "collation", timings["deliver"].best * 1e3 / RUN,
                                    timings["collate"].best * 1e3 / RUN, "ms",
                                    DELIVERY_GOAL, _NOTE_DELIVERY, higher_is_better=False))  # fmt: skip
    return rows


# -- bytes ----------------------------------------------------------------------------------------------------------


def _broadcast_rows(cu_seq_lens: np.ndarray, tokens: int) -> list[Row]:
    rows = []
    for cp in CP_SIZES:
        local = torch.zeros(1, tokens // cp, dtype=torch.int64)
        fields = {"input_ids": local, "labels": local.clone(), "cu_seq_lens": torch.from_numpy(cu_seq_lens)}
        tensors = 2 * local.numel() * local.element_size()
        rows.append(
            Row.compare(f"TP broadcast {_label(tokens)} cp{cp}: bytes sent", broadcast_bytes(fields) / 1e3,
                        (tensors + header_bytes()) / 1e3, "KB", BROADCAST_GOAL, _NOTE_BROADCAST,
                        higher_is_better=False)
        )  # fmt: skip
    return rows


def pipeline_goal(pp_size: int, fields: dict[str, torch.Tensor]) -> float:
    """The most a hop may send against every field to every stage: the last stage's own fields alone, once instead
    of once per later stage, with 5% for the headers and the middle stages' THD metadata."""
    last = sum(fields[name].numel() * fields[name].element_size() for name in ("labels", "loss_mask") if name in fields)
    return PIPELINE_SLACK * last / ((pp_size - 1) * sum(t.numel() * t.element_size() for t in fields.values()))


def _pipeline_rows(cu_seq_lens: np.ndarray, tokens: int) -> list[Row]:
    ids = torch.zeros(1, tokens, dtype=torch.int64)
    packed = {"input_ids": ids, "labels": ids.clone(), "cu_seq_lens": torch.from_numpy(cu_seq_lens),
              "local_cp_size": torch.ones(1, dtype=torch.int64)}  # fmt: skip
    megatron = {**packed, "position_ids": ids.clone(), "loss_mask": torch.ones(1, tokens)}
    rows = []
    for label, fields in (("packed", packed), ("megatron fields", megatron)):
        for pp in PP_SIZES:
            ours = pipeline_bytes(fields, pp, field_names=RELAY_FIELDS)
            everything = pipeline_bytes(fields, pp, owners={}, field_names=RELAY_FIELDS)
            rows.append(
                Row.compare(f"PP hop {_label(tokens)} {label} pp{pp}: bytes sent", ours / 1e3, everything / 1e3, "KB",
                            pipeline_goal(pp, fields), _NOTE_PIPELINE, higher_is_better=False)
            )  # fmt: skip
    return rows


def run(context: BenchContext) -> list[Row]:
    """Per size, the BlockMask and ParallelBatch rows on the context's device (skipped, with the reason, where it is
    missing) and the TP bytes; then the PP bytes."""
    sizes = TOKENS_QUICK if context.quick else TOKENS_FULL
    reason = unavailable_device(context.device)
    if reason is not None:
        log(f"skipping the BlockMask and ParallelBatch rows: {reason}")
    rows = []
    for tokens in sizes:
        if reason is None:
            rows += _mask_rows(context, tokens) + _delivery_rows(context, tokens)
        else:
            label = f"{_label(tokens)} on {context.device}"
            rows += [Row.skipped(f"flex {label}: build vs create_block_mask", reason, "ms"),
                     Row.skipped(f"ParallelBatch {label}: delivery vs collation", reason, "ms")]  # fmt: skip
        rows += _broadcast_rows(boundaries(tokens), tokens)
    return rows + _pipeline_rows(boundaries(GOAL_TOKENS), GOAL_TOKENS)
