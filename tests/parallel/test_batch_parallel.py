"""Specification of CP layouts and the TP broadcast.

CP layouts are pure arithmetic, checked in one process over seeded random sequence boundaries: the ranks' local
slices put back at their columns give the batch back exactly, the ranks' columns partition every row, and the
zigzag layouts give every rank the same causal-attention work. The TP broadcast runs on real gloo TP groups
(``parallel.launch``): every rank of a group holds the same tensors, the end of data and a source's failure reach
every rank for the same call, and the bytes sent are the tensors' bytes plus the header.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import pytest
import torch

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.parallel.batch_parallel import (
    CP_LAYOUTS,
    CPBatchSharder,
    TPBatchBroadcaster,
    broadcast_bytes,
    cp_local_columns,
    header_bytes,
)
from parallel.launch import grid_coordinates, grid_groups, launch

CP_SIZES = (1, 2, 4, 8)
SEEDS = range(3)


def random_batch(seed: int, cp_size: int, rows: int = 3) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """Rows of random length cut into random sequences, every length a multiple of ``2·cp`` (so every layout
    applies); fields of several dtypes and ranks. Returns the fields and ``cu_seq_lens``."""
    rng = np.random.default_rng(seed)
    unit = 2 * cp_size
    units = int(rng.integers(3, 12))
    row_length = units * unit
    lengths = []
    for _ in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, units), size=int(rng.integers(0, units - 1)), replace=False))
        lengths += (np.diff(np.concatenate([[0], cuts, [units]])) * unit).tolist()
    cu_seq_lens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    fields = {
        "input_ids": torch.from_numpy(rng.integers(0, 50_000, (rows, row_length))),
        "loss_mask": torch.from_numpy(rng.random((rows, row_length)).astype(np.float32)),
        "embedding": torch.from_numpy(rng.random((rows, row_length, 3))),
    }
    return fields, cu_seq_lens


def positions_within_sequences(cu_seq_lens: np.ndarray, rows: int, row_length: int) -> np.ndarray:
    """Each column's distance from the start of its sequence, written with a loop as an independent reference."""
    positions = np.zeros(rows * row_length, dtype=np.int64)
    for start, end in zip(cu_seq_lens[:-1], cu_seq_lens[1:], strict=True):
        positions[start:end] = np.arange(end - start)
    return positions.reshape(rows, row_length)


# -- CP layouts ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", CP_LAYOUTS)
@pytest.mark.parametrize("cp_size", CP_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_local_slices_put_back_at_their_columns_give_the_batch(layout, cp_size, seed):
    fields, cu_seq_lens = random_batch(seed, cp_size)
    rows, row_length = fields["input_ids"].shape
    rebuilt = {name: torch.full_like(tensor, -1) for name, tensor in fields.items()}
    owners = []
    for rank in range(cp_size):
        local, columns = CPBatchSharder(cp_size, rank, layout).shard(fields, torch.from_numpy(cu_seq_lens))
        assert columns.dtype == torch.int64 and list(columns.shape) == [rows, row_length // cp_size]
        assert np.array_equal(columns.numpy(), cp_local_columns(layout, cu_seq_lens, rows, row_length, cp_size, rank))
        for name, tensor in local.items():
            assert tensor.shape[:2] == (rows, row_length // cp_size) and tensor.dtype == fields[name].dtype
            rebuilt[name][torch.arange(rows)[:, None], columns] = tensor
        owners.append(columns.numpy())
    for name, tensor in fields.items():
        assert torch.equal(rebuilt[name], tensor), name
    # the ranks' columns are disjoint and cover every row
    together = np.sort(np.concatenate(owners, axis=1), axis=1)
    assert np.array_equal(together, np.tile(np.arange(row_length), (rows, 1)))


@pytest.mark.parametrize("cp_size", CP_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_zigzag_gives_every_rank_the_same_causal_work_per_row(cp_size, seed):
    """Causal attention costs a query at column c the c + 1 keys before it: zigzag balances their sum."""
    fields, _ = random_batch(seed, cp_size)
    rows, row_length = fields["input_ids"].shape
    work = [
        (cp_local_columns("zigzag", None, rows, row_length, cp_size, rank) + 1).sum(axis=1) for rank in range(cp_size)
    ]
    assert all(np.array_equal(w, work[0]) for w in work)


@pytest.mark.parametrize("cp_size", CP_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_zigzag_thd_gives_every_rank_the_same_causal_work_per_sequence(cp_size, seed):
    """Document-causal attention costs a query its position within its sequence plus one."""
    fields, cu_seq_lens = random_batch(seed, cp_size)
    rows, row_length = fields["input_ids"].shape
    positions = positions_within_sequences(cu_seq_lens, rows, row_length)
    work = []
    for rank in range(cp_size):
        columns = cp_local_columns("zigzag_thd", cu_seq_lens, rows, row_length, cp_size, rank)
        work.append((np.take_along_axis(positions, columns, axis=1) + 1).sum(axis=1))
    assert all(np.array_equal(w, work[0]) for w in work)


def test_the_worked_examples_of_the_docstring():
    two_rows = np.array([0, 8, 16])
    assert cp_local_columns("contiguous", None, 1, 8, 2, 0).tolist() == [[0, 1, 2, 3]]
    assert cp_local_columns("contiguous", None, 1, 8, 2, 1).tolist() == [[4, 5, 6, 7]]
    assert cp_local_columns("zigzag", None, 1, 8, 2, 0).tolist() == [[0, 1, 6, 7]]
    assert cp_local_columns("zigzag", None, 1, 8, 2, 1).tolist() == [[2, 3, 4, 5]]
    assert cp_local_columns("zigzag", two_rows, 2, 8, 2, 1).tolist() == [[2, 3, 4, 5]] * 2
    sequences = np.array([0, 8, 12])
    assert cp_local_columns("zigzag_thd", sequences, 1, 12, 2, 0).tolist() == [[0, 1, 6, 7, 8, 11]]
    assert cp_local_columns("zigzag_thd", sequences, 1, 12, 2, 1).tolist() == [[2, 3, 4, 5, 9, 10]]
    # cp 4, T = 16: eight chunks of two
    assert cp_local_columns("zigzag", None, 1, 16, 4, 1).tolist() == [[2, 3, 12, 13]]


def test_cp_size_1_keeps_every_field_as_it_is():
    fields, cu_seq_lens = random_batch(0, 1)
    for layout in CP_LAYOUTS:
        local, columns = CPBatchSharder(1, 0, layout).shard(fields, cu_seq_lens)
        assert all(local[name] is tensor for name, tensor in fields.items())
        assert torch.equal(columns[0], torch.arange(fields["input_ids"].shape[1]))
    # with cp 1 nothing needs to divide: an odd row, odd sequences
    assert cp_local_columns("zigzag_thd", np.array([0, 3, 7]), 1, 7, 1, 0).tolist() == [list(range(7))]


# -- CP errors ----------------------------------------------------------------------------------------------------


def test_a_row_length_the_layout_cannot_cut_names_the_layout_the_length_and_the_fix():
    with pytest.raises(DataConfigError) as contiguous:
        cp_local_columns("contiguous", None, 1, 10, 4, 0)
    message = str(contiguous.value)
    assert "contiguous CP layout" in message and "row length 10 is not a multiple of 4" in message
    assert "align the rows to a multiple of 4" in message

    with pytest.raises(DataConfigError) as zigzag:
        cp_local_columns("zigzag", None, 1, 12, 4, 0)
    message = str(zigzag.value)
    assert "zigzag CP layout" in message and "row length 12 is not a multiple of 8" in message
    assert "align the rows to a multiple of 8" in message and "or use the contiguous layout" in message


def test_a_sequence_the_zigzag_thd_layout_cannot_cut_is_named_with_the_fix():
    cu_seq_lens = np.array([0, 8, 16, 22, 32])  # two rows of 16; the third sequence is 6 long
    with pytest.raises(DataConfigError) as raised:
        cp_local_columns("zigzag_thd", cu_seq_lens, 2, 16, 2, 0)
    message = str(raised.value)
    assert "zigzag_thd CP layout" in message
    assert "sequence 2 (row 1, columns [0, 6)) has length 6, not a multiple of 4" in message
    assert "2 of the 4 sequences do not divide" in message
    assert "pad_each_sequence_to=4" in message and "or use the zigzag or contiguous layout" in message


@pytest.mark.parametrize(
    ("cu_seq_lens", "rule"),
    [
        ([0, 8, 12], "the last entry must be the token count 16, but it is 12"),
        ([0, 4, 4, 16], "it must strictly increase (no empty sequence), but entry 2 is 4 after 4"),
        ([0, 4, 12, 16], "every row end must be a boundary (no sequence crosses rows of 8), but 8 is not"),
    ],
)
def test_zigzag_thd_refuses_boundaries_that_break_the_one_boundary_rule(cu_seq_lens, rule):
    """The cut applies ``check_cu_seq_lens``, the one rule: a zero-length span is refused here too."""
    with pytest.raises(DataFileError) as raised:
        cp_local_columns("zigzag_thd", np.array(cu_seq_lens), 2, 8, 2, 0)
    prefix = f"the zigzag_thd CP cut's cu_seq_lens {cu_seq_lens} are not sequence boundaries of 16 tokens: {rule}"
    assert str(raised.value).startswith(prefix)


def test_an_unknown_layout_or_a_rank_out_of_range_is_refused():
    with pytest.raises(DataConfigError, match="cp_layout is 'ring'; use one of contiguous, zigzag, zigzag_thd"):
        CPBatchSharder(2, 0, "ring")
    with pytest.raises(DataConfigError, match=r"cp_layout is 'zigzg' \(did you mean 'zigzag'\?\)"):
        cp_local_columns("zigzg", None, 1, 8, 2, 0)
    with pytest.raises(DataConfigError, match="cp_rank 2 must be below cp_size 2"):
        CPBatchSharder(2, 2)
    with pytest.raises(DataConfigError, match="cp_rank 3 must be below cp_size 2"):
        cp_local_columns("zigzag", None, 1, 8, 2, 3)


def test_fields_of_different_rows_or_lengths_are_named():
    fields = {"input_ids": torch.zeros(2, 8, dtype=torch.int64), "labels": torch.zeros(2, 6, dtype=torch.int64)}
    with pytest.raises(DataConfigError, match=r"input_ids has shape \[2, 8\] but labels has \[2, 6\]"):
        CPBatchSharder(2, 0).shard(fields, None)


# -- TP broadcast -------------------------------------------------------------------------------------------------


def tp_batches(dp: int) -> list[dict[str, torch.Tensor] | None]:
    """What the TP source of DP coordinate ``dp`` sends: batches of changing shapes, empty tensors, every kind of
    field a parallel batch carries, then the end of data."""
    generator = torch.Generator().manual_seed(dp)
    batches: list[dict[str, torch.Tensor] | None] = []
    for rows, length in ((1, 16), (2, 8), (1, 0)):
        batches.append(
            {
                "input_ids": torch.randint(0, 50_000, (rows, length), generator=generator),
                "labels": torch.randint(-100, 50_000, (rows, length), generator=generator),
                "loss_mask": torch.rand(rows, length, generator=generator).to(torch.bfloat16),
                "cu_seq_lens": torch.arange(0, rows * length + 1, max(length, 1), dtype=torch.int32),
                "attention_mask": torch.rand(rows, 1, length, length * 2, generator=generator) < 0.5,
                "dataset_id": torch.randint(0, 3, (rows,), generator=generator, dtype=torch.int16),
            }
        )
    batches[1].pop("attention_mask")  # fields may come and go between calls
    return [*batches, None]


def _describe(fields: dict[str, torch.Tensor] | None) -> list | None:
    """Each field's name, dtype, shape and a digest of its bytes, as JSON holds them."""
    if fields is None:
        return None
    return [[name, str(t.dtype), list(t.shape), _digest(t)] for name, t in fields.items()]


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _tp_group(rank: int, world_size: int, shape: tuple[int, ...]):
    mine = None
    for ranks in grid_groups(world_size, shape, axis=len(shape) - 1):
        group = torch.distributed.new_group(ranks)
        mine = group if rank in ranks else mine
    return mine, grid_coordinates(rank, world_size, shape)


def broadcast_every_batch(rank: int, world_size: int, shape: tuple[int, ...]) -> list:
    """The TP source sends its batches, then the end of data; every rank reports what it holds after each call, the
    bytes the call sent, and the bytes ``broadcast_bytes`` predicts from what it holds."""
    group, coordinates = _tp_group(rank, world_size, shape)
    src = torch.distributed.get_process_group_ranks(group)[0]
    broadcaster = TPBatchBroadcaster(group, src)
    calls = []
    for batch in tp_batches(coordinates[0]):
        held = broadcaster.broadcast(batch if rank == src else None)
        calls.append([_describe(held), broadcaster.last_broadcast_bytes, broadcast_bytes(held)])
    return calls


@pytest.mark.parametrize("shape", [(2, 2), (1, 4)], ids=["DP2xTP2", "TP4"])
def test_every_tp_rank_holds_the_source_batch_and_ends_with_it(tmp_path, shape):
    world_size = int(np.prod(shape))
    reports = launch(functools.partial(broadcast_every_batch, shape=shape), tmp_path, world_size)

    assert [r.get("error") for r in reports] == [None] * world_size
    for rank, report in enumerate(reports):
        dp = grid_coordinates(rank, world_size, shape)[0]
        expected = [_describe(batch) for batch in tp_batches(dp)]
        held = [call[0] for call in report["value"]]
        assert held == expected, rank  # the same names, dtypes, shapes and values, then None
        sent, predicted = zip(*[call[1:] for call in report["value"]], strict=True)
        assert list(sent) == list(predicted)
        assert sent[-1] == header_bytes()  # the end of data: the header alone
    # the first batch: int64 ids and labels, bfloat16 loss mask, two int32 boundaries, a bool mask, an int16 id
    assert reports[0]["value"][0][1] == header_bytes() + 16 * (8 + 8 + 2) + 2 * 4 + 16 * 32 + 2


def refuse_or_fail(rank: int, world_size: int, case: str) -> str:
    """The TP source sends a field outside the registry, an unsupported dtype, or reports its reader's failure."""
    group, _ = _tp_group(rank, world_size, (world_size,))
    broadcaster = TPBatchBroadcaster(group, 0)
    if rank != 0:
        broadcaster.broadcast(None)
        return "no error"
    if case == "reader":
        error = DataFileError("data.jsonl, line 3: not JSON")
        broadcaster.broadcast_failure("read the next batch", error)
        raise error
    fields = {"input_ids": torch.zeros(1, 4, dtype=torch.int64)}
    fields["positions" if case == "field" else "input_ids"] = torch.zeros(1, 4, dtype=torch.complex64)
    broadcaster.broadcast(fields)
    return "no error"


@pytest.mark.parametrize("case", ["field", "dtype", "reader"])
def test_a_refused_batch_or_a_reader_failure_raises_on_every_tp_rank(tmp_path, case):
    reports = launch(functools.partial(refuse_or_fail, case=case), tmp_path, 2)

    source, receiver = reports[0]["error"], reports[1]["error"]
    expected = {
        "field": ("DataConfigError", "the field 'positions' is not in the TP broadcast registry ['input_ids', "),
        "dtype": ("DataConfigError", "the TP broadcast field 'input_ids' has dtype torch.complex64, which the "),
        "reader": ("DataFileError", "data.jsonl, line 3: not JSON"),
    }[case]
    assert source["type"] == expected[0] and source["message"].startswith(expected[1])
    assert receiver["type"] == "DataFileError"
    what = "read the next batch" if case == "reader" else "send a batch"
    relayed = f"global rank 0 (TP rank 0) failed to {what} ({source['type']}: {source['message']}); see rank 0's log"
    assert receiver["message"] == relayed


def test_without_a_tp_group_the_broadcast_returns_the_fields():
    fields = {"input_ids": torch.zeros(1, 4, dtype=torch.int64)}
    broadcaster = TPBatchBroadcaster(None, 0)
    assert broadcaster.broadcast(fields) == fields and broadcaster.broadcast(None) is None
    assert broadcaster.last_broadcast_bytes == 0
