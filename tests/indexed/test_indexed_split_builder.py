"""Specification of the builder's one blend decision, ``blend_kind``: which dataset tops a split of a blend, as
megatron-core's builder decides (the datasets themselves are compared with megatron-core in
``test_megatron_parity``)."""

from __future__ import annotations

import pytest

from hyper_parallel.data.indexed.indexed_data_config import Blend
from hyper_parallel.data.indexed.indexed_split_builder import BlendKind, blend_kind

ONE = Blend(("a",))
ONE_WEIGHTED = Blend(("a",), (1.0,))
TWO = Blend(("a", "b"))
TWO_WEIGHTED = Blend(("a", "b"), (0.3, 0.7))


@pytest.mark.parametrize(
    ("blend", "per_split", "kind"),
    [
        (ONE, False, BlendKind.NONE),
        (ONE, True, BlendKind.NONE),
        (ONE_WEIGHTED, False, BlendKind.WEIGHTED),  # megatron-core blends a single weighted prefix of data_path
        (ONE_WEIGHTED, True, BlendKind.NONE),  # but not one of a per-split path, whatever its weight
        (TWO, False, BlendKind.BY_SIZE),
        (TWO, True, BlendKind.BY_SIZE),
        (TWO_WEIGHTED, False, BlendKind.WEIGHTED),
        (TWO_WEIGHTED, True, BlendKind.WEIGHTED),
    ],
)
def test_without_simple_blend_megatron_core_decides(blend, per_split, kind):
    assert blend_kind(blend, "no", per_split) is kind


@pytest.mark.parametrize("mode", ["inter", "intra"])
@pytest.mark.parametrize("blend", [ONE, ONE_WEIGHTED, TWO, TWO_WEIGHTED])
@pytest.mark.parametrize("per_split", [False, True])
def test_a_simple_blend_tops_every_split_whatever_the_weights_and_sources(mode, blend, per_split):
    assert blend_kind(blend, mode, per_split) is BlendKind(mode)
