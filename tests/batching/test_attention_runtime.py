"""Attention metadata of one CP rank: for every layout, CP size and rank, attention of the local queries against all
keys with the dense mask equals attention on each document alone; the masks implied by PackedSeqParams (read as
Transformer Engine's THD layout) and by the FlexAttention BlockMask (expanded here, and only here, to tokens) equal
the dense mask."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from hyper_parallel.data.batching.attention_runtime import (
    THD_FIELDS,
    PackedSeqParams,
    attention_params,
    dense_attention_mask,
    flex_block_mask,
    packed_seq_params,
)
from hyper_parallel.data.batching.build_collate_fn import build_online_text_collate_fn, indexed_batch
from hyper_parallel.data.batching.sequence_boundaries import IndexedBoundaryResolver, OnlineBoundaryResolver
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.parallel.batch_parallel import CP_LAYOUTS, cp_local_columns
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout

CP_SIZES = (1, 2, 4, 8)
EOD = 1
WINDOW = 3


@dataclass(frozen=True)
class Case:
    """A collated batch's boundaries, and the documents as generated (not as the boundaries say)."""

    cu_seq_lens: torch.Tensor
    rows: int
    row_length: int
    documents: list[tuple[int, int, int]]  # (row, first column, end column) of each document's real tokens
    real: np.ndarray  # bool [R, T]: a document's token, not padding


def online_case(seed: int, cp: int, layout: str) -> Case:
    """Samples of 1 to 40 tokens packed by the real collator for the layout (tail and per-sequence padding)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 41, size=int(rng.integers(3, 9)))
    samples = [{"input_ids": rng.integers(2, 100, size=n), "labels": rng.integers(2, 100, size=n)} for n in lengths]
    batch = build_online_text_collate_fn(cp_size=cp, cp_layout=layout, pad_token_id=0)(samples)
    width = batch.input_ids.shape[1]
    step = 2 * cp if layout == "zigzag_thd" and cp > 1 else 1
    starts = np.concatenate([[0], np.cumsum(-(-lengths // step) * step)[:-1]])
    documents = [(0, int(a), int(a + n)) for a, n in zip(starts, lengths, strict=True)]
    real = np.zeros((1, width), dtype=bool)
    for _, first, end in documents:
        real[0, first:end] = True
    return Case(OnlineBoundaryResolver()(batch), 1, width, documents, real)


def indexed_case(seed: int, rows: int = 3, row_length: int = 64) -> Case:
    """GPTDataset-like rows: documents of 0 to 12 tokens each ended by an EOD, cut into rows (empty documents give
    adjacent EODs); labels are the next tokens."""
    rng = np.random.default_rng(seed)
    tokens, owner = [], []
    while len(tokens) <= rows * row_length:
        document = [*rng.integers(2, 100, size=int(rng.integers(0, 13))).tolist(), EOD]
        owner += [len(set(owner))] * len(document)
        tokens += document
    stream, owner = np.array(tokens), np.array(owner)
    flat = owner[: rows * row_length].reshape(rows, row_length)
    documents = []
    for row in range(rows):
        cuts = np.flatnonzero(np.diff(flat[row])) + 1
        edges = [0, *cuts.tolist(), row_length]
        documents += [(row, a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    stacked = {
        "tokens": torch.from_numpy(stream[: rows * row_length].reshape(rows, row_length)),
        "labels": torch.from_numpy(stream[1 : rows * row_length + 1].reshape(rows, row_length)),
        "loss_mask": torch.ones(rows, row_length),
    }
    batch = indexed_batch(stacked, eod_token_id=EOD)
    return Case(IndexedBoundaryResolver(EOD)(batch), rows, row_length, documents, np.ones((rows, row_length), bool))


def cases():
    for layout in CP_LAYOUTS:
        for cp in CP_SIZES:
            yield pytest.param("online", cp, layout, id=f"online-{layout}-cp{cp}")
            if layout != "zigzag_thd":  # Indexed documents are not padded to 2*cp
                yield pytest.param("indexed", cp, layout, id=f"indexed-{layout}-cp{cp}")


def make_case(source: str, cp: int, layout: str) -> Case:
    seed = 1000 * cp + CP_LAYOUTS.index(layout)
    return online_case(seed, cp, layout) if source == "online" else indexed_case(seed)


# -- references -------------------------------------------------------------------------------------------------------


def qkv(case: Case, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(case.rows, 2, case.row_length, 8, generator=generator, dtype=torch.float64) for _ in "qkv")


def per_document_attention(case: Case, q, k, v, window: int | None = None) -> torch.Tensor:
    """Causal attention computed on each document alone (optionally with the window), placed at its columns."""
    out = torch.zeros_like(q)
    for row, first, end in case.documents:
        span = torch.arange(end - first)
        allowed = span[None, :] <= span[:, None]
        if window is not None:
            allowed &= span[:, None] - span[None, :] <= window
        part = slice(first, end)
        out[row, :, part] = F.scaled_dot_product_attention(q[row, :, part], k[row, :, part], v[row, :, part], allowed)
    return out


def at_columns(tensor: torch.Tensor, columns: np.ndarray) -> torch.Tensor:
    """``tensor[r, :, columns[r]]`` for ``[R, H, T, D]``."""
    index = torch.from_numpy(columns)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
    return torch.gather(tensor, 2, index)


def expand_block_mask(block_mask, rows: int, local: int, row_length: int) -> torch.Tensor:
    """The token-level mask ``[R, s, T]`` a BlockMask means: full blocks, and partial blocks where mask_mod says."""
    q_block, kv_block = block_mask.BLOCK_SIZE
    kv_blocks = -(-row_length // kv_block)

    def dense(counts, indices):
        listed = torch.arange(indices.shape[-1]) < counts[..., None]
        table = torch.zeros(*indices.shape[:-1], kv_blocks + 1, dtype=torch.bool)
        table.scatter_(-1, torch.where(listed, indices, kv_blocks).long(), True)
        return table[:, 0, :, :kv_blocks]

    queries, keys = torch.arange(local), torch.arange(row_length)
    partial = dense(block_mask.kv_num_blocks, block_mask.kv_indices)[:, queries // q_block][:, :, keys // kv_block]
    full = dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)[:, queries // q_block][
        :, :, keys // kv_block
    ]
    decided = block_mask.mask_mod(torch.arange(rows)[:, None, None], 0, queries[None, :, None], keys[None, None, :])
    assert not (partial & full).any()
    return full | (partial & decided)


def exact_block_tables(block_mask, mask: torch.Tensor) -> bool:
    """Whether the BlockMask lists exactly the blocks with some allowed pair, as full exactly those with all (a block
    holding padding past the queries or keys is never full, as in create_block_mask)."""
    rows, local, width = mask.shape
    q_block, kv_block = block_mask.BLOCK_SIZE
    q_blocks, kv_blocks = -(-local // q_block), -(-width // kv_block)

    padded = torch.zeros(rows, q_blocks * q_block, kv_blocks * kv_block, dtype=torch.bool)
    padded[:, :local, :width] = mask
    pooled = padded.view(rows, q_blocks, q_block, kv_blocks, kv_block).transpose(2, 3).flatten(-2)
    some, every = pooled.any(-1), pooled.all(-1)
    listed = torch.zeros(rows, q_blocks, kv_blocks + 1, dtype=torch.bool)
    for counts, indices, wanted in (
        (block_mask.kv_num_blocks, block_mask.kv_indices, some & ~every),
        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, every),
    ):
        listed.zero_()
        valid = torch.arange(indices.shape[-1]) < counts[..., None]
        listed.scatter_(-1, torch.where(valid, indices, kv_blocks)[:, 0].long(), True)
        if not torch.equal(listed[..., :kv_blocks], wanted):
            return False
    return True


def thd_positions(params: PackedSeqParams, cp: int, rank: int) -> torch.Tensor:
    """The flattened positions a rank holds under Transformer Engine's THD partition, read from the params alone:
    every (padded) sequence in 2*cp chunks, chunk ``rank`` then chunk ``2*cp-1-rank``; without CP, every position."""
    bounds = params.cu_seqlens_q_padded.tolist()
    if cp == 1:
        return torch.arange(bounds[-1])
    held = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        chunk = (end - start) // (2 * cp)
        for index in (rank, 2 * cp - 1 - rank):
            held += range(start + index * chunk, start + (index + 1) * chunk)
    return torch.tensor(held)


def thd_mask(params: PackedSeqParams, positions: torch.Tensor) -> torch.Tensor:
    """What THD causal attention lets each held position attend, over all positions: same sequence, not later, and
    within the sequence's real length (``cu_seqlens_q``; the rest of its padded span is padding)."""
    padded = params.cu_seqlens_q_padded.long()
    keys = torch.arange(int(padded[-1]))
    sequence = torch.searchsorted(padded, keys, right=True) - 1
    real = keys - padded[sequence] < (params.cu_seqlens_q.long()[sequence + 1] - params.cu_seqlens_q.long()[sequence])
    same = sequence[positions][:, None] == sequence[None, :]
    return same & (keys[None, :] <= positions[:, None]) & real[None, :]


def block_diagonal(mask: torch.Tensor) -> torch.Tensor:
    """``[R, 1, s, T]`` as one ``[R * s, R * T]`` mask over the flattened rows (no row sees another)."""
    rows, _, local, width = mask.shape
    flat = torch.zeros(rows * local, rows * width, dtype=torch.bool)
    for row in range(rows):
        flat[row * local : (row + 1) * local, row * width : (row + 1) * width] = mask[row, 0]
    return flat


# -- the worked example ------------------------------------------------------------------------------------------------


def test_worked_example():
    """The module docstring's example: one row of 8, sequences [0, 3) [3, 5) [5, 8), cp 2 zigzag, rank 0."""
    columns = cp_local_columns("zigzag", None, 1, 8, 2, 0)
    assert columns.tolist() == [[0, 1, 6, 7]]
    mask, swa = dense_attention_mask(torch.tensor([0, 3, 5, 8], dtype=torch.int32), columns, 8, sliding_window=1)
    assert mask.shape == (1, 1, 4, 8) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1, 1],
    ]
    assert swa[0, 0, 3].int().tolist() == [0, 0, 0, 0, 0, 0, 1, 1]  # the query and the 1 key before it


def test_the_padding_attends_only_itself_and_nothing_attends_it():
    """Online tail padding is a sequence of its own: boundaries [0, 3, 5, 8], the padding is columns 5..7."""
    mask, _ = dense_attention_mask([0, 3, 5, 8], np.arange(8)[None], 8)
    assert not mask[0, 0, :5, 5:].any() and not mask[0, 0, 5:, :5].any()
    assert mask[0, 0, 5:, 5:].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


# -- attention equals attention on each document alone --------------------------------------------------------------


@pytest.mark.parametrize("source, cp, layout", list(cases()))
def test_local_attention_equals_each_document_alone(source, cp, layout):
    case = make_case(source, cp, layout)
    q, k, v = qkv(case)
    expected = per_document_attention(case, q, k, v)
    expected_swa = per_document_attention(case, q, k, v, window=WINDOW)
    seen = np.zeros((case.rows, case.row_length), dtype=int)
    for rank in range(cp):
        columns = cp_local_columns(layout, case.cu_seq_lens, case.rows, case.row_length, cp, rank)
        mask, swa = dense_attention_mask(case.cu_seq_lens, columns, case.row_length, sliding_window=WINDOW)
        assert mask.shape == (case.rows, 1, case.row_length // cp, case.row_length)
        assert mask.numel() * cp == case.rows * case.row_length**2  # 1/cp of a global mask
        real = torch.from_numpy(np.take_along_axis(case.real, columns, axis=1))[:, None, :, None]
        for used, wanted in ((mask, expected), (swa, expected_swa)):
            out = F.scaled_dot_product_attention(at_columns(q, columns), k, v, attn_mask=used)
            torch.testing.assert_close(out * real, at_columns(wanted, columns) * real, rtol=1e-9, atol=1e-9)
        np.put_along_axis(seen, columns, np.take_along_axis(seen, columns, axis=1) + 1, axis=1)
    assert (seen == 1).all()  # the ranks' queries cover every column once


@pytest.mark.parametrize("source, cp, layout", list(cases()))
def test_the_block_mask_means_the_dense_mask(source, cp, layout):
    case = make_case(source, cp, layout)
    for rank in range(cp):
        columns = cp_local_columns(layout, case.cu_seq_lens, case.rows, case.row_length, cp, rank)
        local = columns.shape[1]
        for window in (None, WINDOW):
            mask, _ = dense_attention_mask(case.cu_seq_lens, columns, case.row_length)
            if window is not None:
                _, mask = dense_attention_mask(case.cu_seq_lens, columns, case.row_length, sliding_window=window)
            block_mask = flex_block_mask(
                case.cu_seq_lens, columns, case.row_length, sliding_window=window, block_size=8
            )
            assert block_mask.seq_lengths == (local, case.row_length)
            assert torch.equal(expand_block_mask(block_mask, case.rows, local, case.row_length), mask[:, 0])
            assert exact_block_tables(block_mask, mask[:, 0])


@pytest.mark.parametrize("cp", CP_SIZES)
def test_packed_seq_params_under_the_thd_layout_mean_the_dense_mask(cp):
    """Read as Transformer Engine reads them, the params give each rank the columns cp_local_columns gives and the
    dense mask's visibility; without CP, Indexed rows are THD sequences too."""
    cases = [online_case(seed, cp, "zigzag_thd") for seed in range(3)]
    if cp == 1:
        cases.append(indexed_case(5))
    for case in cases:
        params = packed_seq_params(case.cu_seq_lens, cp_size=cp)
        lengths = np.diff(case.cu_seq_lens.numpy())
        assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == lengths.max()
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            value = getattr(params, name)
            assert value.dtype == torch.int32 and torch.equal(value, case.cu_seq_lens)
        for rank in range(cp):
            columns = cp_local_columns("zigzag_thd", case.cu_seq_lens, case.rows, case.row_length, cp, rank)
            positions = thd_positions(params, cp, rank)
            flat = torch.from_numpy(columns + np.arange(case.rows)[:, None] * case.row_length).reshape(-1)
            assert torch.equal(positions, flat)
            mask, _ = dense_attention_mask(case.cu_seq_lens, columns, case.row_length)
            assert torch.equal(thd_mask(params, positions), block_diagonal(mask))


def test_packed_seq_params_keep_the_real_and_the_padded_boundaries_apart():
    """Worked by hand, cp 2 (sequences padded to 4): real lengths 3, 6 and 1, padded to 4, 8 and 4, then a dummy
    tail sequence of 8 that counts its padding as its own tokens."""
    padded = torch.tensor([0, 4, 12, 16, 24], dtype=torch.int32)
    real = torch.tensor([0, 3, 9, 10, 18], dtype=torch.int32)
    params = packed_seq_params(padded, cu_seq_lens_real=real, cp_size=2)
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 3, 9, 10, 18]
    assert params.cu_seqlens_q_padded.tolist() == params.cu_seqlens_kv_padded.tolist() == [0, 4, 12, 16, 24]
    assert params.max_seqlen_q == params.max_seqlen_kv == 8  # the padded maximum, as Transformer Engine expects
    assert all(getattr(params, name).dtype == torch.int32 for name in THD_FIELDS[1:5])
    assert attention_params(params)["cu_seqlens_q"] is params.cu_seqlens_q
    same = packed_seq_params(padded, cp_size=2)  # no per-sequence padding: one tensor for both
    assert same.cu_seqlens_q is same.cu_seqlens_q_padded and same.cu_seqlens_q.tolist() == padded.tolist()


def test_packed_seq_params_of_a_collated_batch_count_its_real_tokens():
    """From the collator's batch, cp 2, rows a multiple of 32: lengths 5, 1, 8 and 3 are padded to 8, 4, 8 and 4
    (24 positions), and the 8 of tail padding are a dummy sequence or the end of the last one."""
    rng = np.random.default_rng(11)
    samples = [
        {"input_ids": rng.integers(2, 100, size=n), "labels": rng.integers(2, 100, size=n)} for n in (5, 1, 8, 3)
    ]
    expected = {
        "append_dummy_seq": ([0, 5, 6, 14, 17, 25], [0, 8, 12, 20, 24, 32], 8),
        "extend_last": ([0, 5, 6, 14, 17], [0, 8, 12, 20, 32], 12),
    }
    for tail_padding, (real, padded, longest) in expected.items():
        collator = build_online_text_collate_fn(
            layout=DeliveryLayout(cp_size=2, cp_layout="zigzag_thd"), sequence_multiple=32, tail_padding=tail_padding
        )
        batch = collator(samples)
        params = packed_seq_params(batch.cu_seq_lens, cu_seq_lens_real=batch.cu_seq_lens_real, cp_size=2)
        assert params.cu_seqlens_q.tolist() == real and params.cu_seqlens_q_padded.tolist() == padded
        assert params.max_seqlen_q == longest


def test_packed_seq_params_are_megatron_cores():
    from megatron.core.packed_seq_params import PackedSeqParams as MegatronPackedSeqParams

    params = packed_seq_params(torch.tensor([0, 4, 12, 16], dtype=torch.int32), cp_size=2)
    converted = MegatronPackedSeqParams(**vars(params))
    assert converted.qkv_format == "thd" and converted.max_seqlen_kv == 8
    assert converted.cu_seqlens_kv_padded.tolist() == [0, 4, 12, 16]


# -- other settings -------------------------------------------------------------------------------------------------


def test_without_causal_a_query_sees_its_whole_sequence_and_the_window_both_ways():
    bounds = [0, 3, 5, 10]
    columns = cp_local_columns("zigzag", bounds, 1, 10, 1, 0)
    mask, swa = dense_attention_mask(bounds, columns, 10, causal=False, sliding_window=1)
    assert mask[0, 0, 0].int().tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert mask[0, 0, 7].int().tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert swa[0, 0, 7].int().tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 0]
    block_mask = flex_block_mask(bounds, columns, 10, causal=False, sliding_window=1, block_size=4)
    assert torch.equal(expand_block_mask(block_mask, 1, 10, 10), swa[:, 0])


@pytest.mark.parametrize("row_length, block_size", [(300, 128), (96, 32), (50, 7)])
def test_block_masks_with_partial_blocks(row_length, block_size):
    """Rows and local lengths that blocks do not divide; the default block size of 128 too."""
    rng = np.random.default_rng(row_length)
    cuts = np.sort(rng.choice(np.arange(1, row_length), size=6, replace=False))
    bounds = np.concatenate([[0], cuts, [row_length, row_length * 2]])
    columns = cp_local_columns("contiguous", bounds, 2, row_length, 2, 1)
    mask, swa = dense_attention_mask(bounds, columns, row_length, sliding_window=40)
    for window, wanted in ((None, mask), (40, swa)):
        block_mask = flex_block_mask(bounds, columns, row_length, sliding_window=window, block_size=block_size)
        assert torch.equal(expand_block_mask(block_mask, 2, row_length // 2, row_length), wanted[:, 0])
        assert exact_block_tables(block_mask, wanted[:, 0])


@pytest.mark.parametrize("cp", [1, 4])
def test_block_tables_are_ordered_as_flex_attention_orders_them(cp):
    """Listed blocks first, ascending, then the others (FlexAttention's stable argsort); the query-major tables are
    those FlexAttention's own transposition of the key-major tables gives."""
    case = online_case(11, cp, "zigzag")
    columns = cp_local_columns("zigzag", case.cu_seq_lens, 1, case.row_length, cp, cp - 1)
    block_mask = flex_block_mask(case.cu_seq_lens, columns, case.row_length, block_size=8)
    for counts, indices in (
        (block_mask.kv_num_blocks, block_mask.kv_indices),
        (block_mask.full_q_num_blocks, block_mask.full_q_indices),
    ):
        listed = torch.arange(indices.shape[-1]) < counts[..., None]
        table = torch.zeros_like(listed).scatter_(-1, indices.long(), listed)  # each row's listed blocks
        expected = torch.argsort(table.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        assert torch.equal(indices, expected)
    transposed = BlockMask.from_kv_blocks(
        block_mask.kv_num_blocks,
        block_mask.kv_indices,
        block_mask.full_kv_num_blocks,
        block_mask.full_kv_indices,
        BLOCK_SIZE=8,
        seq_lengths=block_mask.seq_lengths,
    )
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(block_mask, name), getattr(transposed, name)), name


def assert_same_blocks(ours: BlockMask, reference: BlockMask) -> None:
    """Every table (key-major and query-major, partial and full), the sizes and the block size are equal."""
    assert ours.seq_lengths == reference.seq_lengths and ours.BLOCK_SIZE == reference.BLOCK_SIZE
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):  # fmt: skip
        assert torch.equal(getattr(ours, name), getattr(reference, name)), name


@pytest.mark.parametrize("source, cp, layout", [case for case in cases() if case.values[1] in (1, 4)])
def test_the_block_mask_is_create_block_masks_with_the_same_mask_mod(source, cp, layout):
    """FlexAttention's own create_block_mask, which evaluates the mask_mod on every query-key pair, gives the same
    tables as our build from the key intervals, causal or not, with or without a window."""
    case = make_case(source, cp, layout)
    for rank in range(cp):
        columns = cp_local_columns(layout, case.cu_seq_lens, case.rows, case.row_length, cp, rank)
        for causal, window in ((True, None), (True, WINDOW), (False, WINDOW)):
            ours = flex_block_mask(
                case.cu_seq_lens, columns, case.row_length, causal=causal, sliding_window=window, block_size=8
            )
            local = columns.shape[1]
            reference = create_block_mask(ours.mask_mod, case.rows, None, local, case.row_length, BLOCK_SIZE=8)
            assert_same_blocks(ours, reference)


@pytest.mark.parametrize("row_length, block_size", [(300, 128), (96, 32), (50, 7)])
def test_block_masks_with_partial_blocks_are_create_block_masks(row_length, block_size):
    """Rows and local lengths that blocks do not divide, as in test_block_masks_with_partial_blocks."""
    rng = np.random.default_rng(row_length)
    cuts = np.sort(rng.choice(np.arange(1, row_length), size=6, replace=False))
    bounds = np.concatenate([[0], cuts, [row_length, row_length * 2]])
    columns = cp_local_columns("contiguous", bounds, 2, row_length, 2, 1)
    for window in (None, 40):
        ours = flex_block_mask(bounds, columns, row_length, sliding_window=window, block_size=block_size)
        reference = create_block_mask(ours.mask_mod, 2, None, row_length // 2, row_length, BLOCK_SIZE=block_size)
        assert_same_blocks(ours, reference)


def test_flex_attention_with_the_block_mask_equals_each_document_alone():
    """FlexAttention itself (eager on CPU, which applies the mask_mod) agrees with the per-document reference."""
    case = online_case(3, 2, "zigzag_thd")
    q, k, v = (tensor.float() for tensor in qkv(case))
    expected = per_document_attention(case, q, k, v)
    columns = cp_local_columns("zigzag_thd", case.cu_seq_lens, 1, case.row_length, 2, 1)
    block_mask = flex_block_mask(case.cu_seq_lens, columns, case.row_length, block_size=16)
    real = torch.from_numpy(np.take_along_axis(case.real, columns, axis=1))[:, None, :, None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "called without torch.compile()": expected on CPU
        out = flex_attention(at_columns(q, columns), k, v, block_mask=block_mask)
    torch.testing.assert_close(out * real, at_columns(expected, columns) * real, rtol=1e-5, atol=1e-5)


# -- errors -----------------------------------------------------------------------------------------------------------


def test_bad_inputs_are_refused_with_the_rule_and_the_fix():
    columns = np.arange(8)[None]
    with pytest.raises(
        DataFileError, match=r"row_boundaries .* are not sequence boundaries of 8 tokens: the last entry"
    ):
        dense_attention_mask([0, 3, 7], columns, 8)
    with pytest.raises(DataConfigError, match="local column 8 is not a column of rows of 8"):
        dense_attention_mask([0, 8], columns + 1, 8)
    with pytest.raises(DataConfigError, match=r"local_columns must be a non-empty \[rows, local_length\] integer"):
        flex_block_mask([0, 8], np.arange(8.0)[None], 8)
    with pytest.raises(DataConfigError, match="sliding_window must be an integer >= 0, got -1"):
        dense_attention_mask([0, 8], columns, 8, sliding_window=-1)
    with pytest.raises(DataConfigError, match="causal must be true or false"):
        flex_block_mask([0, 8], columns, 8, causal="yes")
    with pytest.raises(DataConfigError, match="block_size must be an integer >= 1"):
        flex_block_mask([0, 8], columns, 8, block_size=0)
    with pytest.raises(
        DataConfigError, match=r"cuts every sequence into 4 chunks, but sequence 1 has 6 positions .*pad_sequences"
    ):
        packed_seq_params([0, 4, 10, 14], cp_size=2)
    with pytest.raises(
        DataFileError, match=r"packed_seq_params: cu_seq_lens_real \[0, 3, 3, 9\] .*\(no empty sequence\)"
    ):
        packed_seq_params([0, 4, 8, 12], cu_seq_lens_real=[0, 3, 3, 9], cp_size=2)
    with pytest.raises(DataFileError, match="sequence 1 has 5 real tokens .* but only 4 positions"):
        packed_seq_params([0, 4, 8, 12], cu_seq_lens_real=[0, 3, 8, 9], cp_size=2)
    with pytest.raises(DataFileError, match="cu_seq_lens_real has 3 entries but cu_seq_lens 4"):
        packed_seq_params([0, 4, 8, 12], cu_seq_lens_real=[0, 3, 5], cp_size=2)
    with pytest.raises(DataFileError, match="packed_seq_params .* must strictly increase"):
        packed_seq_params([0, 4, 4, 8])
    with pytest.raises(DataFileError, match=r"packed_seq_params: cu_seq_lens must be a 1-D .* shape \[1, 2\]"):
        packed_seq_params(np.array([[0, 8]]))


def test_a_fixed_capacity_repeats_the_last_boundary_and_refuses_more_sequences():
    """Static shapes (``thd_max_packed_sequences``): the kernel's boundary tensors hold capacity + 1 entries."""
    params = packed_seq_params([0, 4, 12], cu_seq_lens_real=[0, 3, 9], cp_size=2, capacity=4)
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 12, 12, 12]
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 3, 9, 9, 9]
    assert params.max_seqlen_q == 8
    with pytest.raises(DataConfigError, match="more than the fixed capacity of 1"):
        packed_seq_params([0, 4, 12], cp_size=2, capacity=1)
