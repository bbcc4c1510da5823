"""``hp-data provenance``: the tokens each traced sequence points to are the tokens the loader delivered there.

Every test reads the tokens back independently of the tracer (from the ``.bin`` with ``IndexedDataReader``, or by
tokenizing the JSON line again with the dataset's transform) and compares them, token for token, with the span of
the batch the loader actually delivered.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.errors import DataConfigError, ResumeStateError
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.mixture.mixture_stream import StreamMixture
from hyper_parallel.data.tools.cli import main as hp_data
from hyper_parallel.data.tools.provenance import batch_provenance, step_provenance

WORDS = ["the", "sister", "said", "that", "Elinor", "walked", "home", "through", "the", "park", "while", "Marianne"]


def _indexed_prefix(directory, name: str, eod: int, seed: int, documents: int = 60):
    prefix = directory / name
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(documents):
        document = [*rng.integers(2, 8000, size=int(rng.integers(3, 50))).tolist(), eod]
        builder.add_document(document, [len(document)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _indexed_config(data_path, tmp_path) -> dict:
    return {
        "dataset": {
            "_target_": "hyper_parallel.data.text.build_dataset.build_indexed_text_dataset",
            "data_path": data_path,
            "data_config": {"seq_length": 32, "split": "100, 0, 0", "data_cache_path": str(tmp_path / "cache")},
        },
        "dataloader": {"_target_": "hyper_parallel.data.batching.FixedBatchDataLoader"},
        "collate_fn": {"_target_": "hyper_parallel.data.batching.build_indexed_collate_fn"},
    }


def _jsonl(tmp_path, records: int = 40, seed: int = 3):
    rng = np.random.default_rng(seed)
    lines = [{"text": " ".join(rng.choice(WORDS, size=int(rng.integers(5, 150))))} for _ in range(records)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path, lines


def _online_config(path, tmp_path, *, dataset_type="mapping", loader="DynamicBatchDataLoader", max_seq_len=64):
    dataloader = {"_target_": f"hyper_parallel.data.batching.{loader}"}
    if loader == "DynamicBatchDataLoader":
        dataloader["min_buffered_samples"] = 6
    data_config = {"dataset_type": dataset_type, "cache_dir": str(tmp_path / "arrow")}
    if dataset_type == "iterable":
        data_config["shuffle_buffer_size"] = 0  # file order: a single rank's stream position is the line
    return {
        "dataset": {
            "_target_": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
            "data_path": str(path),
            "data_transform": {
                "_target_": "hyper_parallel.data.text.build_data_transform.build_llm_data_transform",
                "data_type": "plaintext",
                "text_keys": "text",
                "max_seq_len": max_seq_len,
            },
            "data_config": data_config,
        },
        "dataloader": dataloader,
        "collate_fn": {"_target_": "hyper_parallel.data.batching.build_online_text_collate_fn"},
    }


def _delivered(config, tokenizer, *, micro_batch_size=1, dp_rank=0, dp_size=1):
    loaders = build_dataloaders(
        config,
        tokenizer=tokenizer,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_size,
        train_valid_test_num_samples=[None, 0, 0],
    )
    return loaders, list(loaders.train)


def _check_indexed(sequences, batch) -> None:
    flat = batch.input_ids.flatten()
    for sequence in sequences:
        start, end = sequence.tokens
        expected = IndexedDataReader(sequence.path).get(sequence.record, offset=start, length=end - start)
        assert flat[sequence.span[0] : sequence.span[1]].tolist() == expected.tolist()
    # the spans are the batch's sequences, as cu_seq_lens cuts them at each document's EOD
    assert [0] + [sequence.span[1] for sequence in sequences] == batch.cu_seq_lens.tolist()


def _check_online(sequences, batch, transform, lines) -> None:
    row = batch.input_ids[0]
    for sequence in sequences:
        if sequence.record is None:  # a stream sample a saved state buffered: the state keeps tokens, not records
            continue
        windows = transform(lines[sequence.record])
        tokens = np.concatenate([window["input_ids"] for window in windows])
        start, end = sequence.tokens
        assert row[sequence.span[0] : sequence.span[1]].tolist() == tokens[start:end].tolist()
    assert [sequence.span[0] for sequence in sequences] == batch.cu_seq_lens[: len(sequences)].tolist()


def test_indexed_gpt_dataset_on_a_dp_rank(tmp_path, tokenizer):
    prefix = _indexed_prefix(tmp_path, "corpus_text_document", tokenizer.eod, seed=0)
    config = _indexed_config(prefix, tmp_path)
    _, batches = _delivered(config, tokenizer, micro_batch_size=2, dp_rank=1, dp_size=2)
    assert len(batches) > 4
    pieces = 0
    for number in (0, 3, len(batches) - 1):
        sequences = batch_provenance(
            config, batch=number, dp_rank=1, dp_size=2, micro_batch_size=2, tokenizer=tokenizer
        )
        assert {sequence.batch for sequence in sequences} == {number}
        assert {sequence.path for sequence in sequences} == {prefix}
        _check_indexed(sequences, batches[number])
        pieces += len(sequences)
    assert pieces > 6  # samples span several documents


def test_indexed_blend_names_each_sequences_prefix(tmp_path, tokenizer):
    first = _indexed_prefix(tmp_path, "first_text_document", tokenizer.eod, seed=1)
    second = _indexed_prefix(tmp_path, "second_text_document", tokenizer.eod, seed=2)
    config = _indexed_config(["70", first, "30", second], tmp_path)
    config["dataset"]["train_valid_test_num_samples"] = [40, 0, 0]
    _, batches = _delivered(config, tokenizer, micro_batch_size=2)
    paths = set()
    for number in range(len(batches)):
        sequences = batch_provenance(config, batch=number, micro_batch_size=2, tokenizer=tokenizer)
        _check_indexed(sequences, batches[number])
        paths |= {sequence.path for sequence in sequences}
    assert paths == {first, second}


def test_indexed_offline_packed_records(tmp_path, tokenizer):
    prefix = tmp_path / "packed_text_document"
    rng = np.random.default_rng(4)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(20):  # records of seq_length + 1 tokens, as --pack-to-seq-len 32 writes them (no EOD: one row each)
        builder.add_document(rng.integers(2, 8000, size=33).tolist(), [33])
    builder.finalize(f"{prefix}.idx")
    config = _indexed_config(str(prefix), tmp_path)
    config["dataset"]["data_config"]["is_dataset_from_mr"] = True
    _, batches = _delivered(config, tokenizer, micro_batch_size=2)
    for number in (0, len(batches) - 1):
        sequences = batch_provenance(config, batch=number, micro_batch_size=2, tokenizer=tokenizer)
        assert [sequence.tokens for sequence in sequences] == [(0, 32), (0, 32)]
        _check_indexed(sequences, batches[number])


def test_online_mapping_with_the_dynamic_loader_and_its_length_cache(tmp_path, tokenizer):
    path, lines = _jsonl(tmp_path)
    config = _online_config(path, tmp_path)
    loaders, batches = _delivered(config, tokenizer, dp_rank=1, dp_size=2)
    transform = loaders.datasets[0].transform
    assert len(batches) > 3
    ranks = {"dp_rank": 1, "dp_size": 2, "tokenizer": tokenizer}
    for number in (0, 2, len(batches) - 1):
        sequences = batch_provenance(config, batch=number, **ranks)
        _check_online(sequences, batches[number], transform, lines)
    (cache,) = (tmp_path / "arrow").rglob("provenance_lengths-*.npz")
    written = cache.stat().st_mtime_ns
    again = batch_provenance(config, batch=len(batches) - 1, **ranks)
    assert again == sequences
    assert cache.stat().st_mtime_ns == written  # every length came from the cache: nothing new to write
    with pytest.raises(DataConfigError, match=f"micro-batch {len(batches)} is past the end of the epoch"):
        batch_provenance(config, batch=len(batches), **ranks)
    cache.write_bytes(b"damaged")
    assert batch_provenance(config, batch=len(batches) - 1, **ranks) == sequences
    assert cache.stat().st_size > len(b"damaged")  # an unreadable cache is ignored and written again


def test_online_stream(tmp_path, tokenizer):
    path, lines = _jsonl(tmp_path)
    config = _online_config(path, tmp_path, dataset_type="iterable")
    loaders, batches = _delivered(config, tokenizer)
    transform = loaders.datasets[0].transform
    for number in (0, 1, len(batches) - 1):
        _check_online(batch_provenance(config, batch=number, tokenizer=tokenizer), batches[number], transform, lines)


def test_online_fixed_loader(tmp_path, tokenizer):
    path, lines = _jsonl(tmp_path)
    config = _online_config(path, tmp_path, loader="FixedBatchDataLoader", max_seq_len=4096)
    loaders, batches = _delivered(config, tokenizer, micro_batch_size=3, dp_rank=0, dp_size=2)
    transform = loaders.datasets[0].transform
    for number in range(len(batches)):
        sequences = batch_provenance(config, batch=number, micro_batch_size=3, dp_size=2, tokenizer=tokenizer)
        assert len(sequences) == 3
        _check_online(sequences, batches[number], transform, lines)


def _resumed(config, tokenizer, tmp_path, consumed: int, **options):
    """The loaders, their state saved as JSON after ``consumed`` micro-batches, and the micro-batches after it."""
    loaders = build_dataloaders(config, tokenizer=tokenizer, train_valid_test_num_samples=[None, 0, 0], **options)
    iterator = iter(loaders.train)
    for _ in range(consumed):
        next(iterator)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(loaders.state_dict()))
    return loaders, state, list(iterator)


def test_resumed_dynamic_loader_counts_from_the_saved_position(tmp_path, tokenizer):
    path, lines = _jsonl(tmp_path)
    config = _online_config(path, tmp_path)
    loaders, state, after = _resumed(config, tokenizer, tmp_path, 3)
    assert json.loads(state.read_text())["splits"]["train"]["buffered_samples"] > 0
    transform = loaders.datasets[0].transform
    for number in (0, 1, len(after) - 1):
        sequences = batch_provenance(config, batch=number, state=state, tokenizer=tokenizer)
        _check_online(sequences, after[number], transform, lines)


def test_resumed_stream_names_the_records_it_reads_again(tmp_path, tokenizer):
    path, lines = _jsonl(tmp_path)
    config = _online_config(path, tmp_path, dataset_type="iterable")
    loaders, state, after = _resumed(config, tokenizer, tmp_path, 2)
    transform = loaders.datasets[0].transform
    numbers = (0, 1, len(after) - 1)
    traced = [batch_provenance(config, batch=number, state=state, tokenizer=tokenizer) for number in numbers]
    for sequences, number in zip(traced, numbers, strict=True):
        _check_online(sequences, after[number], transform, lines)
    records = [sequence.record for sequences in traced for sequence in sequences]
    assert None in records and records[-1] is not None  # buffered first, then the records read again or anew


def test_resumed_indexed_loader_from_a_torch_saved_state(tmp_path, tokenizer):
    prefix = _indexed_prefix(tmp_path, "corpus_text_document", tokenizer.eod, seed=0)
    config = _indexed_config(prefix, tmp_path)
    loaders = build_dataloaders(config, tokenizer=tokenizer, micro_batch_size=2)
    iterator = iter(loaders.train)
    next(iterator), next(iterator)
    state = tmp_path / "state.pt"
    torch.save(loaders.train.state_dict(), state)
    after = list(iterator)
    sequences = batch_provenance(config, batch=1, state=state, micro_batch_size=2, tokenizer=tokenizer)
    _check_indexed(sequences, after[1])


def test_a_step_is_its_micro_batches(tmp_path, tokenizer):
    prefix = _indexed_prefix(tmp_path, "corpus_text_document", tokenizer.eod, seed=0)
    config = _indexed_config(prefix, tmp_path)
    step = step_provenance(config, step=1, num_micro_batches=2, tokenizer=tokenizer)
    assert step == [batch_provenance(config, batch=number, tokenizer=tokenizer) for number in (2, 3)]


def test_clear_errors(tmp_path, tokenizer):
    prefix = _indexed_prefix(tmp_path, "corpus_text_document", tokenizer.eod, seed=0)
    config = _indexed_config(prefix, tmp_path)
    with pytest.raises(DataConfigError, match="micro-batch 10000 is past the end of the epoch: DP rank 0 of 1 "):
        batch_provenance(config, batch=10_000, tokenizer=tokenizer)
    with pytest.raises(DataConfigError, match="dp_rank is 2, but the DP ranks of dp_size 2 are 0 to 1"):
        batch_provenance(config, batch=0, dp_rank=2, dp_size=2, tokenizer=tokenizer)
    with pytest.raises(ResumeStateError, match="missing.json does not exist"):
        batch_provenance(config, batch=0, state=tmp_path / "missing.json", tokenizer=tokenizer)


def test_command_prints_one_json_object_per_sequence(tmp_path, tokenizer, tokenizer_path, capsys):
    prefix = _indexed_prefix(tmp_path, "corpus_text_document", tokenizer.eod, seed=0)
    config = tmp_path / "pipeline.yaml"
    config.write_text(json.dumps(_indexed_config(prefix, tmp_path)))  # JSON is YAML
    command = ["provenance", str(config), "--tokenizer", str(tokenizer_path)]
    assert hp_data([*command, "--batch", "3", "--json"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = batch_provenance(str(config), batch=3, tokenizer=tokenizer)
    assert printed == [json.loads(json.dumps(sequence.as_dict())) for sequence in expected]
    assert hp_data([*command, "--batch", "3"]) == 0
    assert capsys.readouterr().out.startswith(f"batch 3 span [0, {expected[0].span[1]}): {prefix} record ")
    assert hp_data([*command, "--batch", "0", "--state", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert hp_data([*command, "--step", "1", "--num-micro-batches", "2", "--json"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted({sequence["batch"] for sequence in printed}) == [2, 3]
    assert hp_data([*command, "--step", "1"]) == 2
    assert "--step needs --num-micro-batches" in capsys.readouterr().err


def test_a_packing_scheduler_is_named_as_outside_the_trace(tmp_path, tokenizer, logs):
    path, lines = _jsonl(tmp_path)
    config = _online_config(path, tmp_path)
    config["packing_scheduler"] = {
        "_target_": "hyper_parallel.data.parallel.data_schedule_utils.PackingSchedulerConfig",
        "max_seqlen_per_dp_cp_rank": 256,
    }
    loaders, batches = _delivered(config, tokenizer)
    _check_online(
        batch_provenance(config, batch=1, tokenizer=tokenizer), batches[1], loaders.datasets[0].transform, lines
    )
    assert any("the micro-batches traced are the loader's" in record.getMessage() for record in logs.records)


# -- mixtures ----------------------------------------------------------------------------------------------------


def _mixture_config(tmp_path, tokenizer, *, strategy="weighted", loader="DynamicBatchDataLoader", weights=(3, 2)):
    """An Online mapping source and an Indexed one, as examples/mixture.yaml mixes them."""
    path, lines = _jsonl(tmp_path)
    prefix = _indexed_prefix(tmp_path, "corpus_text_document", tokenizer.eod, seed=0)
    max_seq_len = 4096 if loader == "FixedBatchDataLoader" else 64  # the fixed loader takes one window per record
    online = _online_config(path, tmp_path, loader=loader, max_seq_len=max_seq_len)["dataset"]
    indexed = _indexed_config(prefix, tmp_path)["dataset"]
    config = _online_config(path, tmp_path, loader=loader)
    config["dataset"] = {
        "_target_": "hyper_parallel.data.mixture.build_mixture.build_mixture_dataset",
        "strategy": strategy,
        "on_exhausted": "reweight",
        "sources": [
            {"name": "passages", "weight": weights[0], "dataset": online},
            {"name": "corpus", "weight": weights[1], "dataset": indexed},
        ],
    }
    return config, lines, prefix, str(path)


def _check_mixture(sequences, batch, loaders, lines, prefix, path) -> None:
    """Every sequence's tokens, read from the ``.bin`` or by tokenizing its JSON line again, are the delivered ones
    at its span, and the spans start where ``cu_seq_lens`` starts the batch's sequences."""
    transform = loaders.datasets[0].sources[0].dataset.transform
    _check_sources(sequences, batch, transform, {"passages": (path, lines.__getitem__)}, prefix)


def _check_sources(sequences, batch, transform, online: dict, prefix: str) -> None:
    """``_check_mixture`` for Online sources named in ``online`` (name: its file, and the JSON line of a record) and
    the Indexed source ``corpus``; a sample a saved state buffered (record None) is named by its source and file."""
    row = batch.input_ids[0]
    for sequence in sequences:
        path = prefix if sequence.source == "corpus" else online[sequence.source][0]
        assert sequence.path == path
        if sequence.record is None:  # the state keeps its tokens, not its record
            assert sequence.tokens is None
            continue
        start, end = sequence.tokens
        if sequence.source == "corpus":
            expected = IndexedDataReader(prefix).get(sequence.record, offset=start, length=end - start).tolist()
        else:
            windows = transform(online[sequence.source][1](sequence.record))
            expected = np.concatenate([window["input_ids"] for window in windows])[start:end].tolist()
        assert row[sequence.span[0] : sequence.span[1]].tolist() == expected
    assert [sequence.span[0] for sequence in sequences] == batch.cu_seq_lens[: len(sequences)].tolist()


@pytest.mark.parametrize(
    ("strategy", "loader", "dp_size"),
    [
        ("weighted", "DynamicBatchDataLoader", 1),
        ("interleave", "DynamicBatchDataLoader", 2),
        ("weighted", "FixedBatchDataLoader", 2),
        ("interleave", "FixedBatchDataLoader", 1),
    ],
)
def test_a_mixture_names_each_sequences_source_and_its_record(tmp_path, tokenizer, strategy, loader, dp_size):
    config, lines, prefix, path = _mixture_config(tmp_path, tokenizer, strategy=strategy, loader=loader)
    ranks = {"micro_batch_size": 2, "dp_rank": dp_size - 1, "dp_size": dp_size}
    loaders, batches = _delivered(config, tokenizer, **ranks)
    assert len(batches) > 4
    traced = [batch_provenance(config, batch=n, tokenizer=tokenizer, **ranks) for n in range(len(batches))]
    for sequences, batch in zip(traced, batches, strict=True):
        _check_mixture(sequences, batch, loaders, lines, prefix, path)
    corpus_rows = {}
    for sequence in (s for sequences in traced for s in sequences if s.source == "corpus"):
        corpus_rows.setdefault((sequence.batch, sequence.span[0] // 32), []).append(sequence)
    assert {sequence.source for sequences in traced for sequence in sequences} == {"passages", "corpus"}
    assert max(map(len, corpus_rows.values())) > 1  # an Indexed row is cut into its documents


def test_an_indexed_mixture_with_the_fixed_loader(tmp_path, tokenizer):
    first = _indexed_prefix(tmp_path, "first_text_document", tokenizer.eod, seed=1)
    second = _indexed_prefix(tmp_path, "second_text_document", tokenizer.eod, seed=2)
    config = _indexed_config(first, tmp_path)
    sources = [
        {"name": name, "weight": weight, "dataset": _indexed_config(prefix, tmp_path)["dataset"]}
        for name, weight, prefix in (("first", 1, first), ("second", 2, second))
    ]
    config["dataset"] = {
        "_target_": "hyper_parallel.data.mixture.build_mixture.build_mixture_dataset",
        "strategy": "interleave",
        "sources": sources,
    }
    _, batches = _delivered(config, tokenizer, micro_batch_size=2)
    names = set()
    for number in (0, 1, len(batches) - 1):
        sequences = batch_provenance(config, batch=number, micro_batch_size=2, tokenizer=tokenizer)
        _check_indexed(sequences, batches[number])
        assert {(s.source, s.path) for s in sequences} <= {("first", first), ("second", second)}
        names |= {sequence.source for sequence in sequences}
    assert names == {"first", "second"}
    loaders = build_dataloaders(config, tokenizer=tokenizer, micro_batch_size=2)
    iterator = iter(loaders.train)
    next(iterator), next(iterator)
    state = loaders.train.state_dict()
    after = list(iterator)
    for number in (0, len(after) - 1):
        sequences = batch_provenance(config, batch=number, state=state, micro_batch_size=2, tokenizer=tokenizer)
        _check_indexed(sequences, after[number])


@pytest.mark.parametrize("loader", ["DynamicBatchDataLoader", "FixedBatchDataLoader"])
def test_a_resumed_mixture_and_one_resumed_after_a_change_follow_the_plan(tmp_path, tokenizer, loader):
    config, lines, prefix, path = _mixture_config(tmp_path, tokenizer, loader=loader)
    loaders, saved, after = _resumed(config, tokenizer, tmp_path, 3)
    for number in (0, 1, len(after) - 1):
        sequences = batch_provenance(config, batch=number, state=saved, tokenizer=tokenizer)
        _check_mixture(sequences, after[number], loaders, lines, prefix, path)

    changed = json.loads(json.dumps(config))
    changed["dataset"]["mixture_change"] = "allow"
    changed["dataset"]["sources"][1]["weight"] = 8  # from the resume point on, mostly the corpus
    loaders = build_dataloaders(changed, tokenizer=tokenizer, train_valid_test_num_samples=[None, 0, 0])
    loaders.load_state_dict(json.loads(saved.read_text()))
    iterator = iter(loaders.train)
    continued = [next(iterator) for _ in range(2)]
    sequences = batch_provenance(changed, batch=1, state=saved, tokenizer=tokenizer)
    _check_mixture(sequences, continued[1], loaders, lines, prefix, path)
    again = tmp_path / "changed_state.json"
    again.write_text(json.dumps(loaders.state_dict()))
    assert len(json.loads(again.read_text())["splits"]["train"]["mixture"]["plan"]["segments"]) == 2
    after = list(iterator)
    assert after
    for number in (0, len(after) - 1):
        sequences = batch_provenance(changed, batch=number, state=again, tokenizer=tokenizer)
        _check_mixture(sequences, after[number], loaders, lines, prefix, path)


def test_command_names_a_mixture_source_before_its_file(tmp_path, tokenizer, tokenizer_path, capsys):
    config, *_ = _mixture_config(tmp_path, tokenizer)
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(json.dumps(config))
    expected = batch_provenance(str(pipeline), batch=0, tokenizer=tokenizer)
    assert hp_data(["provenance", str(pipeline), "--batch", "0", "--tokenizer", str(tokenizer_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(expected)
    for line, sequence in zip(lines, expected, strict=True):
        assert line.startswith(f"batch 0 span [{sequence.span[0]}, {sequence.span[1]}): {sequence.source} ")
        assert f" {sequence.path} record {sequence.record} " in line


def test_a_mixture_keeps_its_online_source_s_lengths_in_the_source_s_cache(tmp_path, tokenizer):
    config, *_ = _mixture_config(tmp_path, tokenizer)
    _, batches = _delivered(config, tokenizer)
    last = batch_provenance(config, batch=len(batches) - 1, tokenizer=tokenizer)
    (cache,) = (tmp_path / "arrow").rglob("provenance_lengths-*.npz")  # beside the Online source's Arrow cache
    written = cache.stat().st_mtime_ns
    assert batch_provenance(config, batch=len(batches) - 1, tokenizer=tokenizer) == last
    assert cache.stat().st_mtime_ns == written  # every Online length came from the cache: nothing new to write


@pytest.mark.parametrize("loader", ["DynamicBatchDataLoader", "FixedBatchDataLoader"])
def test_a_mixture_with_a_stream_names_each_sequences_source_and_its_record(tmp_path, tokenizer, loader):
    """A stream, an Online mapping source and an Indexed one, read in order (``StreamMixture``), on DP rank 1 of 2,
    from the start and from a saved state."""
    (tmp_path / "stream").mkdir()
    stream_path, stream_lines = _jsonl(tmp_path / "stream", seed=5)
    config, lines, prefix, path = _mixture_config(tmp_path, tokenizer, loader=loader, weights=(2, 1))
    max_seq_len = config["dataset"]["sources"][0]["dataset"]["data_transform"]["max_seq_len"]
    stream = _online_config(stream_path, tmp_path, dataset_type="iterable", max_seq_len=max_seq_len)["dataset"]
    config["dataset"]["sources"].insert(0, {"name": "stream", "weight": 3, "dataset": stream})
    # Hugging Face splits one file by every world-th record: position p of DP rank 1 of 2 is line 2 * p + 1
    online = {"stream": (str(stream_path), lambda p: stream_lines[2 * p + 1]), "passages": (path, lines.__getitem__)}
    ranks = {"micro_batch_size": 2, "dp_rank": 1, "dp_size": 2}
    loaders, batches = _delivered(config, tokenizer, **ranks)
    assert isinstance(loaders.datasets[0], StreamMixture)
    transform = loaders.datasets[0].sources[1].dataset.transform  # the Online sources transform alike
    traced = step_provenance(config, step=0, num_micro_batches=len(batches), tokenizer=tokenizer, **ranks)
    for sequences, batch in zip(traced, batches, strict=True):
        _check_sources(sequences, batch, transform, online, prefix)
    assert {sequence.source for sequences in traced for sequence in sequences} == {"stream", "passages", "corpus"}
    assert None not in {sequence.record for sequences in traced for sequence in sequences}

    placed = {"micro_batch_size": 2, "dp_rank": 1, "dp_world_size": 2}
    _, state, after = _resumed(config, tokenizer, tmp_path, 4, **placed)
    traced = step_provenance(config, step=0, num_micro_batches=len(after), state=state, tokenizer=tokenizer, **ranks)
    for sequences, batch in zip(traced, after, strict=True):
        _check_sources(sequences, batch, transform, online, prefix)
    unknown = {sequence.source for sequences in traced for sequence in sequences if sequence.record is None}
    if loader == "DynamicBatchDataLoader":  # the buffered samples (their tokens only; an Indexed row's documents)
        assert json.loads(state.read_text())["splits"]["train"]["buffered_samples"] > 0
        assert unknown == {"stream", "corpus"}
    else:  # the records read again
        assert not unknown
