"""Per-rank attention metadata of the parallel delivery step against upstream's global dense mask; TP broadcast bytes;
PP bytes with field ownership against every field to every stage.

* **Input.** One packed row (``R = 1``) of ``T`` global tokens (8k, 32k and 128k; 8k and 32k with ``--quick``)
  holding documents of seeded lognormal lengths (median 1,024 tokens, sigma 1.0, each a multiple of 16 so that
  every layout up to cp 8 cuts them), the last one cut at the row end.
* **Ours.** For each CP size (1, 2, 4, 8) one rank's work, simulated in this process: rank 0's local columns are
  taken untimed (``cp_local_columns``: zigzag for dense and flex, zigzag_thd for packed, as the sharder gives them),
  then the metadata is built and timed: ``dense_attention_mask`` (bool ``[1, 1, T/cp, T]``), ``packed_seq_params``
  (THD boundaries) and ``flex_block_mask`` (a FlexAttention ``BlockMask``, blocks of 128).
* **Reference.** Upstream hyper_parallel's global dense mask ``[1, 1, T, T]``: a lower-triangular mask, then for
  every sequence start ``t`` the keys before ``t`` cut from the queries from ``t`` on, on every rank whatever cp.
  Skipped at 128k (16 GiB of bool); so is our dense mask wherever it would need more than 4 GiB.
* **Checked.** At the smallest size, our cp-1 dense mask equals the reference, and every rank's mask at cp 2 is the
  reference's rows at its columns.
* **PP bytes.** At 32k tokens (cp 1), the bytes one ``BatchRelay`` PP hop sends from stage 0 for one micro-batch
  (``pipeline_bytes``, the count the relay's ``last_pp_bytes`` reports, asserted equal in ``tests/parallel/
  test_relay.py``) with Megatron-Core's field ownership, against the same hop sending every field to every stage,
  for PP 2, 4 and 8 and two field sets: the packed micro-batch (int64 ``input_ids`` and ``labels``, the int32
  ``cu_seq_lens``, ``local_cp_size``) and Megatron's full set (adding int64 ``position_ids`` and float32
  ``loss_mask``).
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import BenchContext, Row, log, measure
from hyper_parallel.data.batching.attention_runtime import dense_attention_mask, flex_block_mask, packed_seq_params
from hyper_parallel.data.parallel.batch_parallel import (
    BROADCAST_FIELDS,
    broadcast_bytes,
    cp_local_columns,
    header_bytes,
    pipeline_bytes,
)

NAME = "parallel"
TITLE = (
    "Per-rank attention metadata (dense, packed, flex) vs upstream's global dense mask; TP broadcast bytes; PP bytes "
    "with field ownership vs every field to every stage"
)

TOKENS_FULL = (8 * 1024, 32 * 1024, 128 * 1024)
TOKENS_QUICK = (8 * 1024, 32 * 1024)
CP_SIZES = (1, 2, 4, 8)
GOAL_TOKENS = 32 * 1024  # the size the metadata goals are set at
MEDIAN_DOCUMENT = 1024
SIGMA = 1.0
SEED = 1234
MULTIPLE = 16  # 2 * the largest cp: every layout cuts every document
DENSE_LIMIT = 4 << 30  # bytes of dense mask built at most (the machine the figures were taken on has 24 GiB)
SPEED_GOAL = 1 / 50  # packed and flex at least 50x faster than the global dense mask
BYTES_GOAL = 0.01  # packed and flex metadata at most 1% of the rank's token tensors
BROADCAST_GOAL = 1.01
REPEATS_FACTOR = 3  # most builds take milliseconds: more repetitions steady the best one
TOKEN_BYTES = 8 + 8 + 8 + 4  # a rank's int64 input_ids, labels, position_ids and float32 loss_mask, per token
LAYOUTS = {"dense": "zigzag", "packed": "zigzag_thd", "flex": "zigzag"}
MODES = tuple(LAYOUTS)
MB = 1e6

_NOTE_TIME = (
    "ms to build one rank's metadata from the global cu_seq_lens and its local columns (rank 0; zigzag for dense "
    "and flex, zigzag_thd for packed), best of 3 x the run's repeats; reference: upstream's global [1, 1, T, T] "
    "mask (tril, then the keys before each sequence start cut), which every rank builds whatever cp"
)
_NOTE_PEAK = (
    "MB the process's resident set grew to while building, in an untimed run (free allocator pages handed back and "
    "VmHWM reset before, so reused memory counts too); reference: the global mask's build"
)
_NOTE_DENSE_BYTES = "bytes of the rank's [1, 1, T/cp, T] mask times cp, against the global [1, 1, T, T] mask: exactly 1"
_NOTE_METADATA = (
    f"bytes of every tensor the metadata holds (PackedSeqParams: its one boundary tensor; BlockMask: its kv, full-kv "
    f"and transposed q tables and the two int32 tensors its mask_mod reads), against the rank's token tensors "
    f"(input_ids, labels, position_ids int64 and loss_mask float32: {TOKEN_BYTES} bytes a local token)"
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
PP_SIZES = (2, 4, 8)
PIPELINE_SLACK = 1.05
RELAY_FIELDS = (*BROADCAST_FIELDS, "local_cp_size")
_NOTE_SKIPPED = f"more than {DENSE_LIMIT >> 30} GiB of bool mask"


def boundaries(tokens: int) -> np.ndarray:
    """int32 boundaries of one row of ``tokens``: seeded lognormal documents, multiples of ``MULTIPLE``."""
    rng = np.random.default_rng(SEED)
    lengths = rng.lognormal(np.log(MEDIAN_DOCUMENT), SIGMA, size=tokens // MULTIPLE)
    lengths = np.maximum(MULTIPLE, np.round(lengths / MULTIPLE).astype(np.int64) * MULTIPLE)
    ends = np.cumsum(lengths)
    return np.concatenate([[0], ends[ends < tokens], [tokens]]).astype(np.int32)


def global_dense_mask(cu_seq_lens: np.ndarray, tokens: int) -> torch.Tensor:
    """Upstream's mask: ``[1, 1, T, T]`` lower-triangular, then the keys before each sequence start cut."""
    mask = torch.ones(1, 1, tokens, tokens, dtype=torch.bool).tril_()
    for start in cu_seq_lens[1:-1].tolist():
        mask[0, 0, start:, :start] = False
    return mask


# -- memory ---------------------------------------------------------------------------------------------------------


def _release_free_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc), so that reusing them counts as growth again."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _resident_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def peak_growth(build: Callable[[], Any]) -> float | None:
    """MB the resident set peaked above its level before ``build()`` (None where Linux's VmHWM cannot be reset)."""
    _release_free_memory()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    except OSError:
        return None
    before = _resident_kib("VmRSS")
    result = build()
    peak = _resident_kib("VmHWM")
    del result
    return max(0, peak - before) * 1024 / MB


# -- sizes ----------------------------------------------------------------------------------------------------------


def metadata_bytes(metadata: Any) -> int:
    """Bytes of the distinct tensors a PackedSeqParams or BlockMask holds (with those its mask_mod reads)."""
    if hasattr(metadata, "as_tuple"):  # a BlockMask: its tables, then the mask_mod's captured tensors
        values = [*metadata.as_tuple(flatten=True), *(cell.cell_contents for cell in metadata.mask_mod.__closure__)]
    else:
        values = list(vars(metadata).values())
    tensors = {value.data_ptr(): value for value in values if isinstance(value, torch.Tensor)}
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def _label(tokens: int) -> str:
    return f"{tokens // 1024}k"


# -- one size -------------------------------------------------------------------------------------------------------


def _builders(cu_seq_lens: np.ndarray, tokens: int) -> dict[tuple[str, int], Callable[[], Any]]:
    """Each (mode, cp) case whose inputs fit, as a call that builds rank 0's metadata."""
    cases = {}
    for cp in CP_SIZES:
        columns = {mode: cp_local_columns(layout, cu_seq_lens, 1, tokens, cp, 0) for mode, layout in LAYOUTS.items()}
        if tokens * tokens // cp <= DENSE_LIMIT:
            cases["dense", cp] = lambda c=columns["dense"]: dense_attention_mask(cu_seq_lens, c, tokens)[0]
        cases["packed", cp] = lambda cp=cp: packed_seq_params(cu_seq_lens, cp_size=cp)
        cases["flex", cp] = lambda c=columns["flex"]: flex_block_mask(cu_seq_lens, c, tokens)
    return cases


def _check(cu_seq_lens: np.ndarray, tokens: int, reference: torch.Tensor) -> None:
    """Our masks are the reference's: the whole mask at cp 1, each rank's rows at its columns at cp 2."""
    whole, _ = dense_attention_mask(cu_seq_lens, cp_local_columns("zigzag", cu_seq_lens, 1, tokens, 1, 0), tokens)
    assert torch.equal(whole, reference), "dense cp 1 differs from upstream's global mask"
    for rank in range(2):
        columns = cp_local_columns("zigzag", cu_seq_lens, 1, tokens, 2, rank)
        local, _ = dense_attention_mask(cu_seq_lens, columns, tokens)
        assert torch.equal(local[0, 0], reference[0, 0, torch.from_numpy(columns[0])]), f"dense cp 2 rank {rank}"


def _cases(tokens: int) -> dict[str, Callable[[], Any]]:
    """Every build measured at one size, by row name part: ``"dense cp2"``, ..., and ``"reference"`` when it fits."""
    cu_seq_lens = boundaries(tokens)
    cases = {f"{mode} cp{cp}": build for (mode, cp), build in _builders(cu_seq_lens, tokens).items()}
    if tokens * tokens <= DENSE_LIMIT:
        cases["reference"] = lambda: global_dense_mask(cu_seq_lens, tokens)
    return cases


def _timings(context: BenchContext, tokens: int, check: bool) -> dict[str, float]:
    """Best ms of every build at one size, interleaved (milliseconds each: three times the usual repeats)."""
    cases = _cases(tokens)
    repeats = REPEATS_FACTOR * context.repeats
    log(f"{_label(tokens)} tokens, {len(boundaries(tokens)) - 1} sequences: timing {len(cases)} builds x {repeats}")
    timings = measure(cases, repeats)
    if check and "reference" in cases:
        _check(boundaries(tokens), tokens, cases["reference"]())
    return {name: timing.best * 1e3 for name, timing in timings.items()}


def _peaks(tokens: int) -> dict[str, float | None]:
    """Peak resident growth (MB) of every build at one size, one untimed run each."""
    log(f"{_label(tokens)} tokens: peak memory of each build")
    return {name: peak_growth(build) for name, build in _cases(tokens).items()}


def _size_rows(tokens: int, timings: dict[str, float], peaks: dict[str, float | None]) -> list[Row]:
    """Each mode's rows for every cp at one size (build time, peak memory, size), then the broadcast rows."""
    cu_seq_lens = boundaries(tokens)
    cases = _builders(cu_seq_lens, tokens)
    rows = []
    for mode in MODES:
        for cp in CP_SIZES:
            name = f"{mode} {_label(tokens)} cp{cp}"
            if (mode, cp) not in cases:
                rows.append(Row.skipped(f"{name}: build", _NOTE_SKIPPED, "ms"))
                continue
            goal = SPEED_GOAL if mode != "dense" and tokens == GOAL_TOKENS else None
            case = f"{mode} cp{cp}"
            rows.append(_row(f"{name}: build", timings[case], timings.get("reference"), "ms", goal, _NOTE_TIME))
            rows.append(_row(f"{name}: peak memory", peaks[case], peaks.get("reference"), "MB", None, _NOTE_PEAK))
            rows.append(_size_row(name, mode, cp, tokens, cases[mode, cp]()))
    return rows + _broadcast_rows(cu_seq_lens, tokens)


def _size_row(name: str, mode: str, cp: int, tokens: int, built: Any) -> Row:
    if mode == "dense":
        assert built.numel() * cp == tokens * tokens, "the local mask is not 1/cp of the global one"
        return Row.compare(f"{name}: mask bytes x cp", built.numel() * cp / MB, tokens**2 / MB, "MB", 1.0,
                           _NOTE_DENSE_BYTES, higher_is_better=False)  # fmt: skip
    goal = BYTES_GOAL if tokens == GOAL_TOKENS else None
    return Row.compare(f"{name}: metadata / token bytes", metadata_bytes(built) / 1e3, TOKEN_BYTES * tokens / cp / 1e3,
                       "KB", goal, _NOTE_METADATA, higher_is_better=False)  # fmt: skip


def _row(name: str, ours: float | None, reference: float | None, unit: str, goal: float | None, note: str) -> Row:
    if ours is None:
        return Row.skipped(name, "the resident set's peak cannot be reset here (Linux /proc only)", unit)
    if reference is None:
        return Row(name, ours, None, unit, None, None, f"{note} (no reference: {_NOTE_SKIPPED})", False)
    return Row.compare(name, ours, reference, unit, goal, note, higher_is_better=False)


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
    """Per size, each mode's build time, peak memory and size for every cp, then the TP and PP bytes."""
    rows = []
    for index, tokens in enumerate(TOKENS_QUICK if context.quick else TOKENS_FULL):
        timings = _timings(context, tokens, check=index == 0)
        rows += _size_rows(tokens, timings, _peaks(tokens))
    return rows + _pipeline_rows(boundaries(GOAL_TOKENS), GOAL_TOKENS)
