"""DeliveryLayout: the CP/TP layout of every delivered batch, and the one boundary rule.

Expected multiples are worked out by hand from the rules (Megatron-Core's ``--pad-packed-seq-alignment`` counts
CP-local tokens before sequence parallelism; MXFP8 needs 32 tokens after it; the zigzag layouts cut a rank's
part into two chunks), not read back from the code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout, check_cu_seq_lens


@pytest.mark.parametrize(
    ("settings", "local", "row", "per_sequence"),
    [
        ({}, 1, 1, 1),
        ({"cp_size": 2}, 1, 2, 1),
        ({"cp_size": 2, "cp_layout": "zigzag"}, 2, 4, 1),
        ({"cp_size": 2, "cp_layout": "zigzag_thd"}, 2, 4, 4),
        ({"cp_size": 4, "cp_layout": "zigzag_thd"}, 2, 8, 8),
        ({"cp_size": 2, "tp_size": 4, "sequence_parallel": True}, 4, 8, 1),
        ({"cp_size": 2, "tp_size": 4}, 1, 2, 1),  # TP without SP does not split the sequence
        (
            {"cp_size": 2, "cp_layout": "zigzag_thd", "tp_size": 4, "sequence_parallel": True, "mxfp8": True},
            128,
            256,
            4,
        ),
        ({"mxfp8": True}, 32, 32, 1),
        ({"cp_size": 3, "alignment": 8}, 8, 24, 1),
        ({"cp_size": 2, "cp_layout": "contiguous", "pad_sequences": True}, 1, 4, 4),  # tail is a sequence too
    ],
)
def test_multiples_follow_the_rules(settings, local, row, per_sequence):
    layout = DeliveryLayout(**settings)
    assert (layout.local_multiple(), layout.row_multiple(), layout.sequence_multiple()) == (local, row, per_sequence)


def test_row_multiple_combines_a_kernel_multiple():
    layout = DeliveryLayout(cp_size=2, tp_size=4, sequence_parallel=True)
    assert layout.row_multiple(extra=32) == 32
    assert layout.row_multiple(extra=12) == 24


def test_other_cp_sizes_of_the_same_layout():
    """Dynamic CP asks the same layout about every runtime CP size."""
    layout = DeliveryLayout(cp_size=4, cp_layout="zigzag_thd")
    assert [layout.sequence_multiple(c) for c in (1, 2, 4)] == [1, 4, 8]
    assert [layout.local_multiple(c) for c in (1, 2, 4)] == [1, 2, 2]
    assert layout.padded_lengths(np.array([5, 8, 1]), 2).tolist() == [8, 8, 4]
    assert layout.padded_lengths(np.array([5, 8, 1]), 1).tolist() == [5, 8, 1]


def test_local_length_and_capacity():
    layout = DeliveryLayout(cp_size=2, cp_layout="zigzag_thd", alignment=8, max_seqlen_per_rank=100)
    assert layout.local_length(0) == 8  # a group of padding only holds one aligned multiple
    assert layout.local_length(17) == 16  # ceil(17 / 2) = 9, rounded up to 8s
    assert layout.local_capacity() == 96
    fixed = DeliveryLayout(alignment="max", max_seqlen_per_rank=64)
    assert fixed.local_length(3) == fixed.local_length(60) == 64


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"cp_layout": "zigzg"}, "did you mean 'zigzag'"),
        ({"cp_size": 0}, "cp_size"),
        ({"alignment": "big"}, "integer N"),
        ({"alignment": "max"}, "max_seqlen_per_rank"),
        ({"alignment": 16, "max_seqlen_per_rank": 8}, "above max_seqlen_per_rank"),
        ({"cp_layout": "zigzag_thd", "pad_sequences": False}, "needs pad_sequences true"),
        ({"cp_layout": "zigzag", "pad_sequences": True}, "cuts whole rows"),
        ({"sequence_parallel": 1}, "true or false"),
        (
            {"alignment": "max", "max_seqlen_per_rank": 48, "mxfp8": True, "tp_size": 2, "sequence_parallel": True},
            "not a multiple of the CP-local multiple 64",
        ),
    ],
)
def test_bad_layouts_are_refused(settings, words):
    with pytest.raises(DataConfigError, match=words):
        DeliveryLayout(**settings)


def test_capacity_below_the_multiple_is_refused():
    layout = DeliveryLayout(mxfp8=True, max_seqlen_per_rank=16)
    with pytest.raises(DataConfigError, match="below the CP-local multiple 32"):
        layout.local_capacity()


def test_the_layout_is_frozen():
    layout = DeliveryLayout(cp_size=2)
    with pytest.raises(AttributeError):
        layout.cp_size = 4


# -- the one boundary rule ----------------------------------------------------------------------------------------


def test_valid_boundaries_come_back_as_int32():
    same = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert check_cu_seq_lens(same, 8, "x") is same
    assert check_cu_seq_lens(np.array([0, 4, 8]), 8, "x", row_length=4).dtype == torch.int32


@pytest.mark.parametrize(
    ("bounds", "words"),
    [
        ([0, 3, 3, 8], "no empty sequence"),  # a zero-length span, refused everywhere
        ([1, 8], "leading entry must be 0"),
        ([0, 5], "last entry must be the token count 8"),
        ([0, 6, 8], "every row end must be a boundary"),
        ([0], "at least"),
    ],
)
def test_broken_boundaries_name_the_rule(bounds, words):
    with pytest.raises(DataFileError, match=words):
        check_cu_seq_lens(bounds, 8, "the batch's cu_seq_lens", row_length=4)


def test_non_integer_boundaries_are_refused():
    with pytest.raises(DataFileError, match="1-D sequence of integers"):
        check_cu_seq_lens(torch.tensor([0.0, 8.0]), 8, "x")


def test_fixed_rows_the_layout_cannot_cut_are_refused_with_lengths_that_work():
    layout = DeliveryLayout(cp_size=2, cp_layout="zigzag")
    layout.check_row_length(4096)
    with pytest.raises(DataConfigError, match="seq_length.*multiple of 4, such as 4096 or 4100"):
        layout.check_row_length(4098)


def test_fixed_rows_are_refused_by_a_layout_that_pads_every_sequence():
    with pytest.raises(DataConfigError, match="never padded per sequence; use cp_layout contiguous or zigzag"):
        DeliveryLayout(cp_size=2, cp_layout="zigzag_thd").check_row_length(4096)
    DeliveryLayout(cp_size=1, cp_layout="zigzag_thd").check_row_length(4095)  # one CP rank cuts nothing
