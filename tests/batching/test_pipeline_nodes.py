"""The node table and the runtime context: each node receives the values its row names, and no others."""

from __future__ import annotations

import pytest

from hyper_parallel.data.batching import dataloader
from hyper_parallel.data.batching.pipeline_nodes import NODES, PipelineContext, built_nodes, node, required_nodes
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.tools import config_reference


def test_the_table_lists_the_design_nodes_once_in_the_pipelines_order():
    assert NODES == (
        "model_assets",
        "dataset",
        "collate_fn",
        "dataloader",
        "get_batch",
        "packing_scheduler",
        "debug",
        "variables",
    )
    assert required_nodes() == ("dataset", "dataloader")
    assert list(built_nodes()) == ["dataset", "collate_fn", "dataloader", "get_batch", "packing_scheduler"]
    assert dataloader.NODES is NODES and config_reference.NODES is NODES  # read, not listed again


def test_each_node_receives_only_the_values_its_row_names():
    """The values are those the design gives each node: the batch sizes reach the loader only, the layout the
    collator, the dataset and the loader, the parallel context, process groups, EOD id, sequence parallelism and
    scheduler the get_batch node."""
    layout = DeliveryLayout(cp_size=2)
    context = PipelineContext(
        tokenizer="tok", chat_template="tpl", micro_batch_size=3, global_batch_size=12, dp_rank=1, dp_world_size=2,
        cp_size=2, sequence_parallel=True, seed=5, train_valid_test_num_samples=(10, 2, 2), layout=layout,
        eod_token_id=2,
    )  # fmt: skip
    assert context.for_node("dataset") == {
        "tokenizer": "tok",
        "chat_template": "tpl",
        "dp_rank": 1,
        "dp_world_size": 2,
        "seed": 5,
        "train_valid_test_num_samples": (10, 2, 2),
        "layout": layout,
    }
    assert context.for_node("collate_fn") == {"tokenizer": "tok", "layout": layout}
    assert context.for_node("dataloader", dataset="d", collate_fn="c") == {
        "dataset": "d",
        "collate_fn": "c",
        "micro_batch_size": 3,
        "global_batch_size": 12,
        "dp_rank": 1,
        "dp_world_size": 2,
        "seed": 5,
        "layout": layout,
    }
    assert context.for_node("get_batch", scheduler=None) == {
        "parallel_context": None,
        "pg_collection": None,
        "eod_token_id": 2,
        "sequence_parallel": True,
        "scheduler": None,
    }
    assert context.for_node("packing_scheduler") == {"sequence_parallel": True}
    assert context.for_node("debug") == {} and context.for_node("variables") == {}


def test_a_seed_or_chat_template_not_given_is_not_offered():
    """Offering None would replace a target's own default (the loaders' seed 1234)."""
    values = PipelineContext().for_node("dataset")
    assert "seed" not in values and "chat_template" not in values
    assert "seed" not in PipelineContext().for_node("dataloader", dataset=None, collate_fn=None)


def test_a_value_the_row_does_not_receive_is_a_bug_of_the_caller():
    with pytest.raises(ValueError, match="the collate_fn node receives no dataset"):
        PipelineContext().for_node("collate_fn", dataset=None)


def test_the_values_ranks_must_share_leave_out_the_dp_rank():
    a = PipelineContext(dp_rank=0, dp_world_size=2, seed=3, train_valid_test_num_samples=(8, 0, 0))
    b = PipelineContext(dp_rank=1, dp_world_size=2, seed=3, train_valid_test_num_samples=[8, 0, 0])
    assert a.agreed_values() == b.agreed_values()
    assert "dp_rank" not in a.agreed_values()
    assert node("dataset").required and not node("get_batch").required
