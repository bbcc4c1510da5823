"""The pipeline with its get_batch node, in one process: the configs of the design (Online mapping with a dynamic
loader, Indexed variable-length documents) built and iterated to the end with ``ParallelBatch``, for every CP rank
of a grid read from a ``DataLoaderParallelContext`` made from integers; the collator's alignment derived from the
context and the get_batch node's layout; layouts the collator or the rows cannot serve refused while the pipeline
is built. ``tests/parallel/test_get_batch.py`` runs the same configs under real gloo ranks.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from hyper_parallel.data.batching import ParallelBatch
from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.instantiate import load_config_text
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext

# The design's configs, as written there; only the data paths (and, below, the test's cache directories) differ.
ONLINE_MAPPING_DYNAMIC = """
dataset:
  _target_: hyper_parallel.data.text.build_dataset.build_online_text_dataset
  data_path: {data_path}
  data_transform:
    _target_: hyper_parallel.data.text.build_data_transform.build_llm_data_transform
    data_type: plaintext
    text_keys: text
    max_seq_len: 4096
  data_config:
    dataset_type: mapping
dataloader:
  _target_: hyper_parallel.data.batching.DynamicBatchDataLoader
  min_buffered_samples: 200
collate_fn:
  _target_: hyper_parallel.data.batching.build_online_text_collate_fn
get_batch:
  _target_: hyper_parallel.data.batching.ParallelBatch
  source_type: online
"""

INDEXED_DOCUMENTS = """
dataset:
  _target_: hyper_parallel.data.text.build_dataset.build_indexed_text_dataset
  data_path: {data_path}
  data_config:
    seq_length: 4096
    split: "98, 1, 1"
    mock_data: false
    is_dataset_from_mr: false
    simple_blend: "no"
    data_lazy_load: true
    create_ltor_fields_in_dataloader: false
dataloader:
  _target_: hyper_parallel.data.batching.FixedBatchDataLoader
collate_fn:
  _target_: hyper_parallel.data.batching.build_indexed_collate_fn
get_batch:
  _target_: hyper_parallel.data.batching.ParallelBatch
  source_type: indexed
"""


def design_config(name: str, data_path, cache_dir) -> dict:
    """One of the design's configs for ``data_path``, with its caches under ``cache_dir``."""
    config = load_config_text({"online": ONLINE_MAPPING_DYNAMIC, "indexed": INDEXED_DOCUMENTS}[name].format(
        data_path=data_path
    ))  # fmt: skip
    key = "cache_dir" if name == "online" else "data_cache_path"
    config["dataset"]["data_config"][key] = str(cache_dir)
    return config


def write_documents(prefix, count: int = 4200, seed: int = 0, eod: int = 0) -> str:
    """An Indexed corpus of ``count`` documents of 20 to 180 tokens, each ending with the EOD: about 420k tokens, so
    that the 1 % splits of "98, 1, 1" hold a sample of 4096 tokens each."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(count):
        ids = np.append(rng.integers(3, 8000, size=int(rng.integers(19, 180))), eod)
        builder.add_document(ids, [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer) -> str:
    return write_documents(tmp_path_factory.mktemp("documents") / "corpus_text_document", eod=tokenizer.eos_token_id)


class Recording(Iterator):
    """The loader's iterator, keeping the batch last pulled (the reader's batch)."""

    def __init__(self, iterator: Iterator) -> None:
        self.iterator, self.last = iterator, None

    def __next__(self):
        self.last = next(self.iterator)
        return self.last


def deliver_all(
    config: dict, tokenizer, context: DataLoaderParallelContext, steps: int | None = None, **runtime
) -> list[tuple]:
    """Every ``(reader's batch, model_inputs, loss_inputs)`` of the train split on this rank, to the end (or the
    first ``steps``)."""
    loaders = build_dataloaders(config, tokenizer=tokenizer, parallel_context=context, **runtime)
    assert isinstance(loaders.get_batch, ParallelBatch) and loaders.get_batch.context is context
    recording, delivered = Recording(iter(loaders.train)), []
    while steps is None or len(delivered) < steps:
        try:
            model_inputs, loss_inputs = loaders.get_batch(recording)
        except StopIteration:
            return delivered
        delivered.append((recording.last, model_inputs, loss_inputs))
    return delivered


def check_slices_make_the_batches(per_rank: list[list[tuple]]) -> None:
    """The CP ranks read the same batches, and their slices put together by position are those batches."""
    counts = {len(delivered) for delivered in per_rank}
    assert len(counts) == 1 and counts.pop() > 0
    for steps in zip(*per_rank, strict=True):
        batch = steps[0][0]
        together = torch.full_like(batch.input_ids, -1)
        rows = torch.arange(batch.input_ids.shape[0])[:, None]
        for reader, model_inputs, loss_inputs in steps:
            assert torch.equal(reader.input_ids, batch.input_ids)
            together[rows, model_inputs["position_ids"]] = model_inputs["input_ids"]
            local = batch.labels[rows, model_inputs["position_ids"]]
            assert torch.equal(loss_inputs["labels"], local)
            assert torch.equal(loss_inputs["loss_mask"], (local >= 0).float())
            width = batch.input_ids.shape[1]
            assert model_inputs["attention_mask"].shape == (rows.shape[0], 1, width // len(steps), width)
        assert torch.equal(together, batch.input_ids)


@pytest.mark.parametrize("cp", [1, 2])
def test_the_online_mapping_dynamic_config_delivers_with_its_get_batch(
    cp, tmp_path, plaintext_path, hf_cache_dir, tokenizer
):
    config = design_config("online", plaintext_path, hf_cache_dir)
    per_rank = [
        deliver_all(config, tokenizer, DataLoaderParallelContext(cp_rank=rank, cp_size=cp)) for rank in range(cp)
    ]
    check_slices_make_the_batches(per_rank)
    assert all(reader.input_ids.shape[1] % cp == 0 for reader, _, _ in per_rank[0])


@pytest.mark.parametrize("cp", [1, 2])
def test_the_indexed_documents_config_delivers_with_its_get_batch(cp, tmp_path, corpus, tokenizer):
    config = design_config("indexed", corpus, tmp_path / "cache")
    per_rank = [
        deliver_all(config, tokenizer, DataLoaderParallelContext(cp_rank=rank, cp_size=cp), 3) for rank in range(cp)
    ]
    check_slices_make_the_batches(per_rank)
    reader, model_inputs, _ = per_rank[0][0]
    assert reader.input_ids.shape == (1, 4096)
    # the EOD ends a document: no query of a later document sees a key before that EOD
    eod = tokenizer.eos_token_id
    column = int(torch.nonzero(reader.input_ids[0] == eod)[0])
    if column + 1 < 4096 // cp:
        assert not model_inputs["attention_mask"][0, 0, column + 1, : column + 1].any()
        assert model_inputs["attention_mask"][0, 0, column, : column + 1].all()


def test_the_pipeline_derives_the_collators_alignment_from_the_context_and_the_layout(
    plaintext_path, hf_cache_dir, tokenizer
):
    """cp 2, TP 2 with sequence parallelism, zigzag_thd: rows a multiple of lcm(2 * 2, 2 * 2), every sequence a
    multiple of 4 (its padding inside its own boundaries); the DP rank and size come from the context."""
    config = design_config("online", plaintext_path, hf_cache_dir)
    config["get_batch"].update(cp_layout="zigzag_thd", attention_mode="packed")
    context = DataLoaderParallelContext(dp_rank=1, dp_size=2, cp_rank=1, cp_size=2)
    loaders = build_dataloaders(config, tokenizer=tokenizer, parallel_context=context, sequence_parallel=True)
    assert (loaders.train.dp_rank, loaders.train.dp_world_size) == (1, 2)
    collate_fn = loaders.train.collate_fn
    assert (collate_fn.alignment, collate_fn.pad_each_sequence_to) == (4, 4)
    iterator = iter(loaders.train)
    model_inputs, _ = loaders.get_batch(iterator)
    params = model_inputs["packed_seq_params"]
    padded, real = torch.diff(params.cu_seqlens_q_padded), torch.diff(params.cu_seqlens_q)
    assert (padded % 4 == 0).all() and (real <= padded).all() and (padded - real < 4).all()


@pytest.mark.parametrize("name", ["online", "indexed"])
def test_the_collator_computes_the_data_ranks_delivery_metadata_in_the_loader(
    name, tmp_path, corpus, plaintext_path, hf_cache_dir, tokenizer
):
    """The collate_fn node is given the get_batch node's plan for this CP rank, so every batch arrives with that
    rank's metadata, which the stage delivers as it would compute it itself."""
    config = design_config(name, plaintext_path if name == "online" else corpus, hf_cache_dir / name)
    context = DataLoaderParallelContext(cp_rank=1, cp_size=2)
    loaders = build_dataloaders(config, tokenizer=tokenizer, parallel_context=context)
    plan = loaders.get_batch.delivery_plan
    assert (plan.cp_size, plan.cp_rank) == (2, 1) and loaders.train.collate_fn.delivery_plan == plan
    batch = next(iter(loaders.train))
    assert batch.delivery is not None and batch.delivery.plan == plan
    without_plan = dict(config, collate_fn=dict(config["collate_fn"], delivery_plan=None))
    plain = build_dataloaders(without_plan, tokenizer=tokenizer, parallel_context=context)
    assert plain.train.collate_fn.delivery_plan is None
    reference = next(iter(plain.train))
    assert reference.delivery is None and torch.equal(reference.input_ids, batch.input_ids)
    ours, theirs = loaders.get_batch(iter([batch])), plain.get_batch(iter([reference]))
    for got, expected in zip(ours, theirs, strict=True):
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[key], value), key


def test_a_packing_scheduler_gives_the_collator_no_delivery_plan(plaintext_path, hf_cache_dir, tokenizer):
    """The scheduler re-packs every micro-batch into its own groups, so metadata of the loader's rows would be
    wasted work: the collator is built without a plan."""
    config = design_config("online", plaintext_path, hf_cache_dir)
    config["get_batch"]["cp_layout"] = "zigzag_thd"
    config["get_batch"]["attention_mode"] = "packed"
    config["packing_scheduler"] = {
        "_target_": "hyper_parallel.data.parallel.data_schedule_utils.PackingSchedulerConfig",
        "max_seqlen_per_dp_cp_rank": 4096,
    }
    loaders = build_dataloaders(config, tokenizer=tokenizer, parallel_context=DataLoaderParallelContext())
    assert loaders.train.collate_fn.delivery_plan is None


def test_ranks_that_read_nothing_get_no_loaders_but_a_get_batch(plaintext_path, hf_cache_dir, tokenizer):
    config = design_config("online", plaintext_path, hf_cache_dir)
    loaders = build_dataloaders(
        config, tokenizer=tokenizer, parallel_context=DataLoaderParallelContext(tp_rank=1, tp_size=2)
    )
    assert list(loaders) == [None, None, None] and isinstance(loaders.get_batch, ParallelBatch)


# -- refused while the pipeline is built ----------------------------------------------------------------------------


def test_indexed_rows_the_layout_cannot_cut_are_refused_when_built(tmp_path, corpus, tokenizer):
    config = design_config("indexed", corpus, tmp_path / "cache")
    config["dataset"]["data_config"]["seq_length"] = 30
    config["get_batch"]["cp_layout"] = "zigzag"
    with pytest.raises(
        DataConfigError,
        match=r"^dataset\.data_config: the Indexed rows hold 30 tokens \(seq_length\), but the delivery layout \(cp 2 "
        r"\(zigzag.*multiple of 4, such as 28 or 32",
    ):
        build_dataloaders(config, tokenizer=tokenizer, parallel_context=DataLoaderParallelContext(cp_size=2))
    config["get_batch"]["cp_layout"] = "zigzag_thd"
    config["dataset"]["data_config"]["seq_length"] = 32
    with pytest.raises(DataConfigError, match=r"^dataset\.data_config: the zigzag_thd layout cuts every sequence"):
        build_dataloaders(config, tokenizer=tokenizer, parallel_context=DataLoaderParallelContext(cp_size=2))


def test_a_rank_layout_given_twice_must_agree(plaintext_path, hf_cache_dir, tokenizer):
    config = design_config("online", plaintext_path, hf_cache_dir)
    context = DataLoaderParallelContext(dp_rank=1, dp_size=2)
    with pytest.raises(
        DataConfigError, match=r"dp_world_size is 4, but the parallel_context gives 2; .*drop dp_world_"
    ):
        build_dataloaders(config, tokenizer=tokenizer, parallel_context=context, dp_world_size=4)
    with pytest.raises(DataConfigError, match=r"parallel_context must be a DataLoaderParallelContext"):
        build_dataloaders(config, tokenizer=tokenizer, parallel_context={"dp_rank": 0})
    loaders = build_dataloaders(config, tokenizer=tokenizer, parallel_context=context, dp_rank=1, dp_world_size=2)
    assert loaders.train.dp_rank == 1
