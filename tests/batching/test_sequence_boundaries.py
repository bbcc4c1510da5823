"""Global sequence boundaries: the Online collator's, checked; the Indexed rule from EOD inputs, EOD labels and row
ends, identical to megatron-core's on GPTDataset batches and to the upstream golden example."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.build_collate_fn import (
    TextPackingCollator,
    build_indexed_collate_fn,
    indexed_batch,
)
from hyper_parallel.data.batching.sequence_boundaries import (
    IndexedBoundaryResolver,
    OnlineBoundaryResolver,
    row_boundaries,
)
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.indexed.ltor_fields import positions_within_sequences
from hyper_parallel.data.parallel.delivery_layout import check_cu_seq_lens
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset

# -- the golden example and worked examples -------------------------------------------------------------------------


def golden_batch() -> Batch:
    """seq_length 8, EOD 9, documents [3, 4, 5, 9] and [1, 2, 9]: each EOD is a target only, never an input."""
    stacked = {
        "tokens": torch.tensor([[3, 4, 5, 1, 2, 0, 0, 0]]),
        "labels": torch.tensor([[4, 5, 9, 2, 9, 0, 0, 0]]),
        "loss_mask": torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.float32),
    }
    return indexed_batch(stacked, eod_token_id=9)


def test_the_golden_example():
    """Upstream's golden example: boundaries [0, 3, 5, 8], position ids [0, 1, 2, 0, 1, 0, 1, 2]."""
    batch = golden_batch()
    assert batch.labels.tolist() == [[4, 5, 9, 2, 9, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    bounds = IndexedBoundaryResolver(9)(batch)
    assert bounds.dtype == torch.int32 and bounds.tolist() == [0, 3, 5, 8]
    assert batch.cu_seq_lens.tolist() == [0, 3, 5, 8]  # the collator's rule is the resolver's
    assert positions_within_sequences(bounds.numpy()).tolist() == [0, 1, 2, 0, 1, 0, 1, 2]


def test_eod_inputs_end_their_document():
    """GPTDataset layout: the EOD is an input and belongs to the document it ends; labels are the next tokens."""
    tokens = torch.tensor([[5, 9, 7, 8], [9, 1, 2, 9]])
    labels = torch.tensor([[9, 7, 8, 2], [1, 2, 9, 4]])
    batch = Batch(input_ids=tokens, labels=labels, cu_seq_lens=torch.tensor([0, 4, 8], dtype=torch.int32))
    assert IndexedBoundaryResolver(9)(batch).tolist() == [0, 2, 4, 5, 8]


def test_adjacent_eods_are_one_token_sequences_and_the_row_goes_on():
    """An empty document gives two adjacent EODs; the documents after them stay apart (upstream stopped reading the
    row at the first adjacent pair, which would merge [4, 5, 9] and [7, 8] into one sequence)."""
    tokens = torch.tensor([[1, 9, 9, 4, 5, 9, 7, 8]])
    labels = torch.tensor([[9, 9, 4, 5, 9, 7, 8, 3]])
    batch = Batch(input_ids=tokens, labels=labels, cu_seq_lens=torch.tensor([0, 8], dtype=torch.int32))
    assert IndexedBoundaryResolver(9)(batch).tolist() == [0, 2, 3, 6, 8]


def test_an_eod_label_followed_by_an_eod_input_ends_after_the_input():
    """Both clauses at once: the label at column 0 predicts the EOD input at column 1, which ends the document."""
    tokens = torch.tensor([[4, 9, 6, 7, 1, 2]])
    labels = torch.tensor([[9, 6, 7, 9, 2, 3]])  # column 3 predicts an EOD never fed: ends after column 3
    batch = Batch(input_ids=tokens, labels=labels, cu_seq_lens=torch.tensor([0, 6], dtype=torch.int32))
    assert IndexedBoundaryResolver(9)(batch).tolist() == [0, 2, 4, 6]


def test_row_boundaries_worked_example():
    starts, ends = row_boundaries(torch.tensor([0, 3, 5, 8, 12, 16], dtype=torch.int32), rows=2, row_length=8)
    assert starts.tolist() == [[0, 0, 0, 3, 3, 5, 5, 5], [0, 0, 0, 0, 4, 4, 4, 4]]
    assert ends.tolist() == [[3, 3, 3, 5, 5, 8, 8, 8], [4, 4, 4, 4, 8, 8, 8, 8]]
    with pytest.raises(DataFileError, match="every row end must be a boundary .*8 is not"):
        row_boundaries([0, 3, 10, 16], rows=2, row_length=8)


# -- real GPTDataset batches: megatron-core's boundaries ------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_batches(tmp_path_factory, tokenizer):
    """Batches of a real GPTDataset over documents of 0 to 30 tokens plus EOD (empty documents included)."""
    directory = tmp_path_factory.mktemp("gpt")
    prefix = directory / "corpus_text_document"
    rng = np.random.default_rng(7)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for index in range(120):
        length = 0 if index % 9 == 4 else int(rng.integers(1, 30))
        document = [*rng.integers(2, 8000, size=length).tolist(), tokenizer.eod]
        builder.add_document(document, [len(document)])
    builder.finalize(f"{prefix}.idx")
    config = {
        "seq_length": 48,
        "split": "100, 0, 0",
        "data_cache_path": str(directory / "cache"),
        "eod_mask_loss": True,
    }
    train, _, _ = build_indexed_text_dataset(str(prefix), config, tokenizer=tokenizer)
    collate = build_indexed_collate_fn(tokenizer)
    return [collate(train.__getitems__(list(range(start, start + 4)))) for start in range(0, len(train) - 3, 4)]


def megatron_boundaries(batch: Batch, eod: int) -> list[int]:
    """Boundaries where megatron-core's reset position ids restart, row by row, plus the end."""
    rows, width = batch.input_ids.shape
    starts = []
    for row in range(rows):
        _, _, positions = _get_ltor_masks_and_position_ids(batch.input_ids[row], eod, True, True, False, False)
        starts += (row * width + torch.nonzero(positions == 0).flatten()).tolist()
    return [*starts, rows * width]


def test_gpt_dataset_batches_get_megatron_cores_boundaries(gpt_batches, tokenizer):
    resolve = IndexedBoundaryResolver(tokenizer.eod)
    adjacent = 0
    for batch in gpt_batches:
        bounds = resolve(batch)
        assert bounds.tolist() == megatron_boundaries(batch, tokenizer.eod)
        assert torch.equal(bounds, batch.cu_seq_lens)  # the collator and the resolver agree
        ids = batch.input_ids
        adjacent += int(((ids[:, 1:] == tokenizer.eod) & (ids[:, :-1] == tokenizer.eod)).sum())
    assert adjacent > 0  # empty documents were read


def test_gpt_dataset_masks_equal_megatron_cores_reset_attention_mask(gpt_batches, tokenizer):
    """The block-diagonal causal mask of the boundaries is megatron-core's reset attention mask."""
    batch = gpt_batches[0]
    rows, width = batch.input_ids.shape
    starts, _ = row_boundaries(IndexedBoundaryResolver(tokenizer.eod)(batch), rows, width)
    columns = np.arange(width)
    for row in range(rows):
        visible = (columns[None, :] >= starts[row][:, None]) & (columns[None, :] <= columns[:, None])
        masked, _, _ = _get_ltor_masks_and_position_ids(batch.input_ids[row], tokenizer.eod, True, True, False, True)
        assert np.array_equal(~visible, masked[0].numpy())


# -- the Online resolver ----------------------------------------------------------------------------------------------


def test_online_boundaries_are_the_collators():
    samples = [{"input_ids": np.arange(1, n + 1), "labels": np.arange(2, n + 2)} for n in (3, 2)]
    batch = TextPackingCollator(alignment=4)(samples)
    bounds = OnlineBoundaryResolver()(batch)
    assert bounds.tolist() == [0, 3, 5, 8] and bounds.dtype == torch.int32


@pytest.mark.parametrize(
    "cu_seq_lens, rule",
    [
        ([1, 3, 8], "the leading entry must be 0, but it is 1"),
        ([0, 3, 3, 8], "must strictly increase .*entry 2 is 3 after 3"),
        ([0, 5, 3, 8], "must strictly increase .*entry 2 is 3 after 5"),
        ([0, 3, 7], "the last entry must be the token count 8, but it is 7"),
        ([0, 3, 9], "the last entry must be the token count 8, but it is 9"),
        ([0], r"at least \[0, 8\]"),
    ],
)
def test_online_boundaries_that_break_a_rule_say_which(cu_seq_lens, rule):
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.int64), "cu_seq_lens": torch.tensor(cu_seq_lens)}
    with pytest.raises(
        DataFileError, match=f"the Online collator's cu_seq_lens .* are not sequence boundaries .*{rule}"
    ):
        OnlineBoundaryResolver()(batch)


def test_online_batches_without_boundaries_are_refused():
    with pytest.raises(DataFileError, match="no 'cu_seq_lens'.*build_online_text_collate_fn"):
        OnlineBoundaryResolver()({"input_ids": torch.zeros(1, 4, dtype=torch.int64)})
    with pytest.raises(DataFileError, match="'input_ids' is missing"):
        OnlineBoundaryResolver()({"cu_seq_lens": torch.tensor([0, 4])})


def test_validation_checks_row_ends_types_and_int32():
    assert check_cu_seq_lens(np.array([0, 4, 8]), 8, "x", row_length=4).tolist() == [0, 4, 8]
    same = torch.tensor([0, 8], dtype=torch.int32)
    assert check_cu_seq_lens(same, 8, "x") is same
    with pytest.raises(DataFileError, match=r"x \[0, 3, 8\] .*every row end must be a boundary .*4 is not"):
        check_cu_seq_lens([0, 3, 8], 8, "x", row_length=4)
    with pytest.raises(DataFileError, match="x: cu_seq_lens must be a 1-D sequence of integers, got Tensor"):
        check_cu_seq_lens(torch.tensor([0.0, 8.0]), 8, "x")
    with pytest.raises(DataFileError, match=r"shape \[1, 2\]"):
        check_cu_seq_lens(np.array([[0, 8]]), 8, "x")
    with pytest.raises(DataFileError, match="more than int32"):
        check_cu_seq_lens([0, 2**31], 2**31, "x")


# -- the Indexed resolver ---------------------------------------------------------------------------------------------


def test_indexed_resolver_reads_megatron_style_dicts_and_refuses_what_it_cannot_read():
    tokens = torch.tensor([[5, 9, 7, 8]])
    assert IndexedBoundaryResolver(9)({"tokens": tokens, "labels": torch.tensor([[9, 7, 8, 1]])}).tolist() == [0, 2, 4]
    with pytest.raises(DataFileError, match="'labels' is missing"):
        IndexedBoundaryResolver(9)({"tokens": tokens})
    with pytest.raises(DataFileError, match=r"labels have shape \[1, 3\] but its input_ids \[1, 4\]"):
        IndexedBoundaryResolver(9)({"input_ids": tokens, "labels": torch.tensor([[9, 7, 8]])})
    with pytest.raises(DataFileError, match="received a list, not a batch"):
        IndexedBoundaryResolver(9)([tokens])
    with pytest.raises(DataConfigError, match="eod_token_id must be an integer >= 0"):
        IndexedBoundaryResolver(None)


def test_a_collator_with_another_eod_id_is_an_error_but_one_without_is_not():
    stacked = {
        "tokens": torch.tensor([[5, 9, 7, 8, 3, 2]]),
        "labels": torch.tensor([[9, 7, 8, 3, 2, 1]]),
        "loss_mask": torch.ones(1, 6),
    }
    with pytest.raises(DataConfigError, match=r"cu_seq_lens \[0, 4, 6\] are not those of EOD id 9 \(\[0, 2, 6\]\)"):
        IndexedBoundaryResolver(9)(indexed_batch(stacked, eod_token_id=8))
    assert IndexedBoundaryResolver(9)(indexed_batch(stacked, eod_token_id=None)).tolist() == [0, 2, 6]
