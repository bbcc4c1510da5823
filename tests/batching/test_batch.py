"""Specification of the batch contract: fields, conventions, checks, helpers, and delivery through a DataLoader."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch

from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.build_collate_fn import build_indexed_collate_fn, build_online_text_collate_fn
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError

X = IGNORE_INDEX


def make(ids, labels, bounds, **fields) -> Batch:
    return Batch(
        input_ids=torch.tensor(ids), labels=torch.tensor(labels), cu_seq_lens=torch.tensor(bounds).int(), **fields
    )


def online_example() -> Batch:
    samples = [
        {"input_ids": np.array([11, 12, 13]), "labels": np.array([12, 13, X])},
        {"input_ids": np.array([21, 22]), "labels": np.array([X, 23])},
    ]
    return build_online_text_collate_fn(sequence_multiple=4, pad_token_id=0)(samples)


def indexed_example() -> Batch:
    samples = [
        {
            "tokens": np.array([5, 0, 7, 8]),
            "labels": np.array([0, 7, 8, 9]),
            "loss_mask": np.array([1, 0, 1, 1], np.float32),
        },
        {
            "tokens": np.array([0, 1, 2, 0]),
            "labels": np.array([1, 2, 0, 3]),
            "loss_mask": np.array([0, 1, 1, 0], np.float32),
        },
    ]
    return build_indexed_collate_fn(eod_token_id=0)(samples)


def test_the_worked_example_of_the_readme():
    """The package README's example, both paths: the same fields, dtypes and conventions."""
    online = online_example()
    assert online.input_ids.tolist() == [[11, 12, 13, 21, 22, 0, 0, 0]]
    assert online.labels.tolist() == [[12, 13, X, X, 23, X, X, X]]
    assert online.loss_mask.tolist() == [[1, 1, 0, 0, 1, 0, 0, 0]]
    assert online.cu_seq_lens.tolist() == [0, 3, 5, 8]
    assert (online.num_tokens, online.num_sequences, online.trained_tokens) == (8, 3, 3)
    indexed = indexed_example()
    assert indexed.input_ids.tolist() == [[5, 0, 7, 8], [0, 1, 2, 0]]
    assert indexed.labels.tolist() == [[0, X, 8, 9], [X, 2, 0, X]]
    assert indexed.loss_mask.tolist() == [[1, 0, 1, 1], [0, 1, 1, 0]]
    assert indexed.cu_seq_lens.tolist() == [0, 2, 4, 5, 8]
    assert (indexed.num_tokens, indexed.num_sequences, indexed.trained_tokens) == (8, 4, 5)
    for batch in (online, indexed):
        assert (batch.input_ids.dtype, batch.labels.dtype) == (torch.int64, torch.int64)
        assert (batch.loss_mask.dtype, batch.cu_seq_lens.dtype) == (torch.float32, torch.int32)
        assert torch.equal(batch.loss_mask, (batch.labels != IGNORE_INDEX).float())


def test_sequences_are_views_cut_by_cu_seq_lens():
    batch = indexed_example()
    pieces = [(ids.tolist(), labels.tolist()) for ids, labels in batch.sequences()]
    assert pieces == [([5, 0], [0, X]), ([7, 8], [8, 9]), ([0], [X]), ([1, 2, 0], [2, 0, X])]
    ids, _ = next(online_example().sequences())
    assert ids.tolist() == [11, 12, 13]


def test_the_mapping_view_is_read_only_and_names_what_it_holds():
    batch = indexed_example()
    assert list(batch) == ["input_ids", "labels", "loss_mask", "cu_seq_lens"] and len(batch) == 4
    assert "position_ids" not in batch and set(dict(batch)) == set(batch)
    for megatron_name in ("tokens", "attention_mask"):  # converted once, by indexed_batch; no alias here
        assert megatron_name not in batch and batch.get(megatron_name) is None
    with pytest.raises(KeyError, match=r"'position_ids': the batch has no such field; it holds \['input_ids'"):
        batch["position_ids"]
    with pytest.raises(TypeError):
        batch["labels"] = batch.input_ids
    with pytest.raises(AttributeError):
        batch.labels = batch.input_ids


def test_optional_fields_and_extras():
    ids = [[1, 2, 3], [4, 5, 6]]
    mask = ~torch.tril(torch.ones(3, 3, dtype=torch.bool)).expand(2, 1, 3, 3)
    batch = make(
        ids,
        ids,
        [0, 3, 6],
        position_ids=torch.tensor([[0, 1, 2], [0, 1, 2]]),
        megatron_attention_mask=mask,
        cu_seq_lens_real=torch.tensor([0, 2, 5], dtype=torch.int32),
        extras={"dataset_id": torch.tensor([4, 7])},
    )
    assert list(batch) == [
        "input_ids",
        "labels",
        "loss_mask",
        "cu_seq_lens",
        "cu_seq_lens_real",
        "position_ids",
        "megatron_attention_mask",
        "dataset_id",
    ]
    assert batch["dataset_id"].tolist() == [4, 7]
    assert batch.megatron_attention_mask[0, 0, 0].tolist() == [False, True, True]  # True = masked out
    assert repr(batch) == (
        "Batch(input_ids=int64[2, 3], labels=int64[2, 3], loss_mask=float32[2, 3], cu_seq_lens=int32[3], "
        "cu_seq_lens_real=int32[3], position_ids=int64[2, 3], megatron_attention_mask=bool[2, 1, 3, 3], "
        "dataset_id=int64[2])"
    )
    assert batch.cu_seq_lens_real.tolist() == [0, 2, 5] and batch.to("cpu") == batch
    assert batch != make(ids, ids, [0, 3, 6], position_ids=batch.position_ids, megatron_attention_mask=mask)


@pytest.mark.parametrize(
    ("bounds", "problem"),
    [
        ([0], "it must hold at least [0, 8] (one sequence), but has 1 entries"),
        ([1, 8], "the leading entry must be 0, but it is 1"),
        ([0, 3, 7], "the last entry must be the token count 8, but it is 7"),
        ([0, 3, 3, 8], "strictly increase (no empty sequence), but entry 2 is 3 after 3"),
        ([0, 5, 2, 8], "strictly increase (no empty sequence), but entry 2 is 2 after 5"),
        ([0, 3, 8], "every row end must be a boundary (no sequence crosses rows of 4), but 4 is not"),
    ],
)
def test_malformed_boundaries_are_refused(bounds, problem):
    """The one boundary rule of ``parallel.delivery_layout.check_cu_seq_lens``, with its wording."""
    with pytest.raises(DataFileError) as error:
        make([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 6, 7, 8]], bounds)
    message = str(error.value)
    assert f"Batch.cu_seq_lens {bounds}" in message and "of 8 tokens" in message and problem in message
    assert "build_indexed_collate_fn" in message  # the fix


@pytest.mark.parametrize(
    ("change", "error", "named"),
    [
        (
            {"input_ids": torch.tensor([1, 2])},
            DataFileError,
            "Batch.input_ids must be a 2-D int64 tensor, got int64[2]",
        ),
        ({"labels": torch.zeros(1, 2, dtype=torch.int32)}, DataFileError, "Batch.labels must be a 2-D int64 tensor"),
        ({"labels": torch.zeros(1, 3, dtype=torch.int64)}, DataFileError, "labels has shape [1, 3] but input_ids"),
        ({"cu_seq_lens": torch.tensor([0, 2])}, DataFileError, "Batch.cu_seq_lens must be a 1-D int32 tensor"),
        ({"labels": [[1, 2]]}, DataConfigError, "Batch.labels must be a torch.Tensor, got list"),
        ({"position_ids": torch.zeros(2, 1, dtype=torch.int64)}, DataFileError, "position_ids has shape [2, 1]"),
        (
            {"megatron_attention_mask": torch.zeros(1, 2, 2, dtype=torch.bool)},
            DataFileError,
            "Batch.megatron_attention_mask must be a 4-D bool tensor",
        ),
        (
            {"megatron_attention_mask": torch.zeros(1, 1, 2, 3, dtype=torch.bool)},
            DataFileError,
            "it must be [1, 1, 2, 2]",
        ),
        ({"extras": {"tokens": torch.zeros(1)}}, DataConfigError, "extra 'tokens' is not a valid name"),
        ({"extras": {"attention_mask": torch.zeros(1)}}, DataConfigError, "megatron-core's names"),
        ({"extras": {"cu_seq_lens_real": torch.zeros(1)}}, DataConfigError, "extra 'cu_seq_lens_real' is not"),
        ({"cu_seq_lens_real": torch.tensor([0, 2])}, DataFileError, "Batch.cu_seq_lens_real must be a 1-D int32"),
        ({"cu_seq_lens_real": [0, 2]}, DataConfigError, "Batch.cu_seq_lens_real must be a torch.Tensor"),
        ({"extras": {"dataset_id": torch.zeros(2)}}, DataFileError, "extra 'dataset_id' is [2]; an extra must be"),
        ({"extras": {"dataset_id": 3}}, DataFileError, "extra 'dataset_id' is int"),
    ],
)
def test_fields_that_break_the_contract_are_refused(change, error, named):
    fields = {
        "input_ids": torch.tensor([[1, 2]]),
        "labels": torch.tensor([[2, X]]),
        "cu_seq_lens": torch.tensor([0, 2], dtype=torch.int32),
        **change,
    }
    with pytest.raises(error) as raised:
        Batch(**fields)
    assert named in str(raised.value)


@pytest.mark.parametrize(
    ("real", "problem"),
    [
        (
            [0, 3, 3, 8],
            "Batch: cu_seq_lens_real [0, 3, 3, 8] are not sequence boundaries of 8 tokens: it must "
            "strictly increase (no empty sequence), but entry 2 is 3 after 3",
        ),
        ([1, 3, 8], "the leading entry must be 0, but it is 1"),
        ([0, 3, 5, 7, 8], "cu_seq_lens_real has 5 entries but cu_seq_lens 4; both hold the boundaries of the same 3"),
        ([0, 5, 6, 7], "sequence 0 has 5 real tokens (cu_seq_lens_real) but only 4 positions (cu_seq_lens)"),
        ([0, 4, 12, 14], "sequence 1 has 8 real tokens (cu_seq_lens_real) but only 4 positions (cu_seq_lens)"),
    ],
)
def test_real_boundaries_count_at_least_one_and_at_most_the_padded_tokens_of_each_sequence(real, problem):
    """Physical boundaries ``[0, 4, 8, 16]`` of one row: each sequence's real tokens are 1 to its span's length."""
    ids = [list(range(16))]
    fine = make(ids, ids, [0, 4, 8, 16], cu_seq_lens_real=torch.tensor([0, 1, 5, 13], dtype=torch.int32))
    assert fine.cu_seq_lens_real.tolist() == [0, 1, 5, 13]
    make(ids, ids, [0, 4, 8, 16], cu_seq_lens_real=torch.tensor([0, 4, 8, 16], dtype=torch.int32))  # no padding
    with pytest.raises(DataFileError) as error:
        make(ids, ids, [0, 4, 8, 16], cu_seq_lens_real=torch.tensor(real, dtype=torch.int32))
    assert problem in str(error.value) and "build_indexed_collate_fn" in str(error.value)


def test_equality_pickling_and_moves_keep_the_batch():
    batch = indexed_example()
    clone = pickle.loads(pickle.dumps(batch))
    assert type(clone) is Batch and clone == batch and clone is not batch
    assert clone.loss_mask.tolist() == batch.loss_mask.tolist()
    moved = batch.to("cpu")
    assert type(moved) is Batch and moved == batch and batch.to(torch.device("cpu"), non_blocking=True) == batch
    assert batch != online_example() and batch != dict(batch)
    with pytest.raises(TypeError):
        hash(batch)


class _Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        ids = np.arange(index + 1, index + 4)
        return {"input_ids": ids, "labels": np.append(ids[1:], X)}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataloader_with_workers_and_pin_memory_delivers_batches(num_workers):
    """Workers pickle the batch to the main process; ``pin_memory=True`` keeps its type. On a machine without an
    accelerator torch skips pinning (with a warning), so there the type and contents are what is checked."""
    collate = build_online_text_collate_fn(sequence_multiple=4)
    loader = torch.utils.data.DataLoader(
        _Samples(),
        batch_size=2,
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=True,
        timeout=60 * (num_workers > 0),
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*pin_memory.* no accelerator", UserWarning)
        batches = list(loader)
    assert [type(batch) for batch in batches] == [Batch] * 4
    expected = [collate([_Samples()[2 * b], _Samples()[2 * b + 1]]) for b in range(4)]
    assert batches == expected
    if torch.accelerator.is_available():
        assert all(tensor.is_pinned() for batch in batches for tensor in batch.values())


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="pinned memory needs an accelerator")
def test_pin_memory_pins_every_tensor():
    batch = Batch(
        input_ids=torch.ones(2, 4, dtype=torch.int64),
        labels=torch.ones(2, 4, dtype=torch.int64),
        cu_seq_lens=torch.tensor([0, 4, 8], dtype=torch.int32),
        extras={"dataset_id": torch.tensor([0, 1])},
    )
    pinned = batch.pin_memory()
    assert type(pinned) is Batch and pinned == batch
    assert all(tensor.is_pinned() for tensor in pinned.values()) and not batch.input_ids.is_pinned()
