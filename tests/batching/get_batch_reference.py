"""A plain reference of what ``ParallelBatch`` gives one rank, written independently of the library: Python loops
over small batches, one position at a time, from the conventions stated in docs/distributed.md.

Used by the single-process specification (``tests/batching/test_get_batch.py``) and by the multi-process tests
(``tests/parallel/test_get_batch.py``), which compare every field a rank received with this.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

MODEL_KEYS = ["input_ids", "labels", "position_ids", "attention_mask", "swa_mask", "packed_seq_params"]


def indexed_boundaries(input_ids: list[list[int]], labels: list[list[int]], eod: int) -> list[int]:
    """A sequence ends after an EOD input, after an EOD label not followed by an EOD input, and at each row end."""
    bounds = [0]
    for r, (row, targets) in enumerate(zip(input_ids, labels, strict=True)):
        width = len(row)
        for j in range(width):
            label_end = j + 1 < width and targets[j] == eod and row[j + 1] != eod
            if row[j] == eod or label_end or j == width - 1:
                bounds.append(r * width + j + 1)
    return bounds


def sequences_of_row(bounds: list[int], row: int, width: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` columns of each sequence of ``row``."""
    spans = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if row * width <= start < (row + 1) * width:
            spans.append((start - row * width, end - row * width))
    return spans


def local_columns(layout: str, spans: list[tuple[int, int]], width: int, cp: int, rank: int) -> list[int]:
    """The global columns CP rank ``rank`` holds of a row, in local order."""
    if cp == 1:
        return list(range(width))
    if layout == "contiguous":
        size = width // cp
        return list(range(rank * size, (rank + 1) * size))
    if layout == "zigzag":
        size = width // (2 * cp)
        return list(range(rank * size, (rank + 1) * size)) + list(
            range((2 * cp - 1 - rank) * size, (2 * cp - rank) * size)
        )
    columns = []
    for start, end in spans:  # zigzag_thd: each sequence in 2 * cp chunks
        size = (end - start) // (2 * cp)
        columns += list(range(start + rank * size, start + (rank + 1) * size))
        columns += list(range(start + (2 * cp - 1 - rank) * size, start + (2 * cp - rank) * size))
    return columns


def may_attend(spans, query: int, key: int, causal: bool, window: int | None) -> bool:
    """True = the query may attend the key: the same sequence, not a later key when causal, and within ``window``
    keys of the query (itself and ``window`` keys before it; as many after it too without ``causal``)."""
    same = any(start <= query < end and start <= key < end for start, end in spans)
    return same and (not causal or key <= query) and (window is None or abs(query - key) <= window)


def real_bounds(input_ids: list[list[int]], bounds: list[int], pad: int) -> list[int]:
    """The cumulative real token counts: per sequence, its tokens before the trailing ``pad`` ids; a sequence of
    padding alone counts all of its positions (it attends only itself and carries no loss)."""
    flat = [token for row in input_ids for token in row]
    real = [0]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        count = end - start
        while count and flat[start + count - 1] == pad:
            count -= 1
        real.append(real[-1] + (count or end - start))
    return real


def expected_fields(
    input_ids: list[list[int]],
    labels: list[list[int]],
    bounds: list[int],
    *,
    cp: int,
    rank: int,
    layout: str,
    causal: bool = True,
    window: int | None = None,
    reset_position_ids: bool = False,
    eod_mask_loss: bool = False,
    eod: int | None = None,
    pad: int | None = None,
    real: list[int] | None = None,
) -> dict:
    """Every field one rank must hold, as nested lists: input_ids, labels, position_ids, loss_mask, the dense
    ``attention_mask`` and ``swa_mask`` (``[R][1][s][T]``), the local columns, and the ``PackedSeqParams`` fields."""
    width = len(input_ids[0])
    out = {name: [] for name in ("input_ids", "labels", "position_ids", "loss_mask", "attention_mask", "swa_mask")}
    out["columns"] = []
    for r in range(len(input_ids)):
        spans = sequences_of_row(bounds, r, width)
        columns = local_columns(layout, spans, width, cp, rank)
        start_of = {column: start for start, end in spans for column in range(start, end)}
        out["columns"].append(columns)
        out["input_ids"].append([input_ids[r][c] for c in columns])
        out["labels"].append([labels[r][c] for c in columns])
        out["position_ids"].append([c - start_of[c] if reset_position_ids else c for c in columns])
        out["loss_mask"].append(
            [float(labels[r][c] >= 0 and not (eod_mask_loss and input_ids[r][c] == eod)) for c in columns]
        )
        out["attention_mask"].append([[[may_attend(spans, q, k, causal, None) for k in range(width)] for q in columns]])
        out["swa_mask"].append([[[may_attend(spans, q, k, causal, window) for k in range(width)] for q in columns]])
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    if real is None:  # the real boundaries: given (the collator's, tested beside it), or from the trailing pad ids
        real = real_bounds(input_ids, bounds, pad) if pad is not None else bounds
    out["packed_seq_params"] = {
        "qkv_format": "thd",
        "cu_seqlens_q": real,
        "cu_seqlens_kv": real,
        "cu_seqlens_q_padded": bounds,
        "cu_seqlens_kv_padded": bounds,
        "max_seqlen_q": max(lengths),
        "max_seqlen_kv": max(lengths),
    }
    if window is None:
        out["swa_mask"] = None
    return out


# -- comparing what a rank holds with the reference ----------------------------------------------------------


def as_lists(value):
    return value.tolist() if isinstance(value, torch.Tensor) else value


def check_rank(model_inputs, loss_inputs, expected: dict, attention_mode: str, window) -> None:
    """Every field of one rank equals the reference; keys exactly those of the contract."""
    assert list(model_inputs) == MODEL_KEYS and list(loss_inputs) == ["labels", "loss_mask"]
    for name in ("input_ids", "labels", "position_ids"):
        assert model_inputs[name].dtype == torch.int64 and as_lists(model_inputs[name]) == expected[name], name
    assert loss_inputs["labels"] is model_inputs["labels"]
    assert (
        loss_inputs["loss_mask"].dtype == torch.float32 and as_lists(loss_inputs["loss_mask"]) == expected["loss_mask"]
    )
    mask, swa, packed = model_inputs["attention_mask"], model_inputs["swa_mask"], model_inputs["packed_seq_params"]
    if attention_mode == "dense":
        assert mask.dtype == torch.bool and as_lists(mask) == expected["attention_mask"]
        assert as_lists(swa) == expected["swa_mask"]
    elif attention_mode == "flex":
        assert isinstance(mask, BlockMask) and swa is None
        wanted = expected["swa_mask"] if window is not None else expected["attention_mask"]
        assert flex_mask_values(mask).tolist() == wanted
    else:
        assert mask is None and swa is None
    if attention_mode == "packed":
        assert {name: as_lists(getattr(packed, name)) for name in expected["packed_seq_params"]} == expected[
            "packed_seq_params"
        ]
        assert packed.cu_seqlens_q.dtype == torch.int32
    else:
        assert packed is None


def flex_mask_values(block_mask: BlockMask) -> torch.Tensor:
    """bool ``[R, 1, s, T]``: the block mask's ``mask_mod`` at every (row, query, key), kept only in the blocks it
    computes (a pair in a skipped block is masked whatever ``mask_mod`` says)."""
    rows, _, queries, keys = (int(n) for n in block_mask.shape)
    b, q, k = torch.meshgrid(torch.arange(rows), torch.arange(queries), torch.arange(keys), indexing="ij")
    values = block_mask.mask_mod(b, torch.zeros_like(b), q, k)
    q_block, kv_block = block_mask.BLOCK_SIZE
    blocks = block_mask.to_dense()[:, 0]  # [R, query blocks, key blocks]: 1 where the block is computed
    computed = blocks[b, q // q_block, k // kv_block].bool()
    return (values & computed)[:, None]
