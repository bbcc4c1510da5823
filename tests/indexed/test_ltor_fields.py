"""Specification of ``cu_seq_lens_from_ends``: sequence boundaries of fixed-length rows from "ends here" marks.

``ltor_fields`` itself is compared with megatron-core in ``test_megatron_parity.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.data.indexed.ltor_fields import cu_seq_lens_from_ends, ltor_fields


@pytest.mark.parametrize(
    ("marks", "expected"),
    [
        ([0, 1, 0, 0], [0, 2, 4]),  # the docstring example of ltor_fields: tokens [5, 0, 7, 8], EOD 0
        ([0, 0, 0, 1], [0, 4]),  # a mark at the row end is the row end
        ([1, 1, 0], [0, 1, 2, 3]),  # adjacent marks: one-token sequences
        ([0, 0, 0], [0, 3]),
        ([[0, 1, 0, 0], [1, 0, 0, 1]], [0, 2, 4, 5, 8]),  # every row end is a boundary
        ([[0, 0], [0, 0], [0, 0]], [0, 2, 4, 6]),
        ([], [0]),
    ],
)
def test_boundaries_from_marks(marks, expected):
    bounds = cu_seq_lens_from_ends(np.array(marks, dtype=bool))
    assert bounds.tolist() == expected and bounds.dtype == np.int64


def test_marks_are_the_callers_rule():
    """Marking the positions whose *label* is the EOD cuts documents whose inputs hold no EOD: seq_length 8, EOD 9,
    documents ``[3, 4, 5, 9]`` and ``[1, 2, 9]``, then padding."""
    labels = np.array([[4, 5, 9, 2, 9, -100, -100, -100]])
    assert cu_seq_lens_from_ends(labels == 9).tolist() == [0, 3, 5, 8]


def test_the_marks_are_not_changed():
    marks = np.array([[False, True], [False, False]])
    cu_seq_lens_from_ends(marks)
    assert marks.tolist() == [[False, True], [False, False]]


@pytest.mark.parametrize("seed", range(5))
def test_reset_position_ids_restart_at_the_boundaries(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 4, size=64)  # EOD 0: about one token in four
    positions = ltor_fields(tokens, 0, True, False, False, False).position_ids
    assert np.flatnonzero(positions == 0).tolist() == cu_seq_lens_from_ends(tokens == 0)[:-1].tolist()
