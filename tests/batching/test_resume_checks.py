"""Loader states are checked before anything is restored: the data they were saved over, and every field.

Also: a loader whose records all give no sample stops with an error instead of yielding nothing forever, and an
error raised in a DataLoader worker reaches the caller exactly as without workers.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import time

import numpy as np
import pytest

from hyper_parallel.data.batching import DynamicBatchDataLoader, FixedBatchDataLoader
from hyper_parallel.data.errors import DataConfigError, DataFileError, ResumeStateError
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset, build_online_text_dataset

from .conftest import paragraphs, write_jsonl
from .resume_check import plain, roundtrip, take

LOADERS = {"fixed": FixedBatchDataLoader, "dynamic": DynamicBatchDataLoader}
SOURCES = [("fixed", "mapping"), ("fixed", "iterable"), ("dynamic", "mapping"), ("dynamic", "iterable")]


def online_loader(path, tokenizer, cache_dir, loader, dataset_type, *, workers=0, transform=None, **options):
    """A loader over the JSONL at ``path``: fixed batches of 3 whole paragraphs, or dynamic batches of windows."""
    transform = transform or {"data_type": "plaintext", "max_seq_len": 4096 if loader == "fixed" else 48}
    dataset = build_online_text_dataset(
        path,
        transform,
        {"dataset_type": dataset_type, "cache_dir": str(cache_dir), "shuffle_buffer_size": 16},
        tokenizer=tokenizer,
    )
    extra = {"min_buffered_samples": 6} if loader == "dynamic" else {}
    return LOADERS[loader](dataset, micro_batch_size=3, num_workers=workers, **extra, **options)


# The data a state was saved over ---------------------------------------------------------------------------------


def rewrite_same_size(path) -> None:
    """New content for every record (each text reversed: same count, same byte size), written later."""
    before = os.stat(path)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    write_jsonl(path, [{**record, "text": record["text"][::-1]} for record in records])
    assert os.stat(path).st_size == before.st_size
    # as a later write would leave it, even on a file system with coarse timestamps
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))


@pytest.mark.parametrize(("loader", "dataset_type"), SOURCES)
def test_a_state_saved_over_data_that_was_rewritten_is_refused(loader, dataset_type, tmp_path, tokenizer, hf_cache_dir):
    path = write_jsonl(tmp_path / "train.jsonl", [{"id": i, "text": text} for i, text in enumerate(paragraphs(30))])
    running = online_loader(path, tokenizer, hf_cache_dir, loader, dataset_type)
    take(running, 2)
    state = roundtrip(running.state_dict())

    same = online_loader(path, tokenizer, hf_cache_dir, loader, dataset_type)
    same.load_state_dict(state)  # unchanged data resumes
    rewrite_same_size(path)
    changed = online_loader(path, tokenizer, hf_cache_dir, loader, dataset_type)
    with pytest.raises(ResumeStateError) as refused:
        changed.load_state_dict(state)
    message = str(refused.value)
    assert f"saved over {path} (fingerprint" in message
    assert f"{path} was {os.stat(path).st_size} bytes, modified" in message and "is now" in message
    assert "Resume with the same data, or start without the state" in message
    assert [plain(b) for b in changed] == [
        plain(b) for b in online_loader(path, tokenizer, hf_cache_dir, loader, dataset_type)
    ]


def indexed_prefix(folder, seed: int, *, value_offset: int = 0):
    """A .bin/.idx pair of 120 documents (lengths and tokens from ``seed``, tokens shifted by ``value_offset``)."""
    folder.mkdir(parents=True, exist_ok=True)
    prefix = folder / "corpus_text_document"
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(120):
        length = int(rng.integers(5, 60))
        builder.add_document(rng.integers(2, 4000, size=length) + value_offset, [length])
    builder.finalize(f"{prefix}.idx")
    return prefix


def indexed_loader(prefix, tokenizer, cache, *, random_seed=1234):
    config = {"seq_length": 16, "split": "100, 0, 0", "random_seed": random_seed, "data_cache_path": str(cache)}
    train, _, _ = build_indexed_text_dataset(str(prefix), config, [None, None, None], tokenizer)
    return FixedBatchDataLoader(train, micro_batch_size=4)


def test_indexed_states_name_a_changed_seed_and_changed_data_files(tmp_path, tokenizer):
    prefix = indexed_prefix(tmp_path / "data", seed=0)
    running = indexed_loader(prefix, tokenizer, tmp_path / "cache")
    take(running, 3)
    state = roundtrip(running.state_dict())
    indexed_loader(prefix, tokenizer, tmp_path / "cache").load_state_dict(state)

    with pytest.raises(
        ResumeStateError, match=r"saved over GPTDataset of .*corpus_text_document.*random_seed was 1234, is now 99"
    ):
        indexed_loader(prefix, tokenizer, tmp_path / "cache", random_seed=99).load_state_dict(state)

    indexed_prefix(tmp_path / "data", seed=1)  # other documents under the same prefix
    with pytest.raises(ResumeStateError, match=r"saved over GPTDataset of .*corpus_text_document.* was .*is now"):
        indexed_loader(prefix, tokenizer, tmp_path / "cache").load_state_dict(state)


def test_indexed_data_files_rewritten_with_the_same_counts_are_noticed(tmp_path, tokenizer):
    prefix = indexed_prefix(tmp_path / "data", seed=0)
    running = indexed_loader(prefix, tokenizer, tmp_path / "cache")
    take(running, 3)
    state = roundtrip(running.state_dict())
    indexed_prefix(tmp_path / "data", seed=0, value_offset=7)  # the same documents' lengths, other tokens
    for path in (f"{prefix}.bin", f"{prefix}.idx"):  # as a later write would leave them
        status = os.stat(path)
        os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 10**9))
    with pytest.raises(ResumeStateError, match=r"saved over GPTDataset of .*corpus_text_document"):
        indexed_loader(prefix, tokenizer, tmp_path / "cache").load_state_dict(state)


def test_blend_states_carry_the_blends_identity(tmp_path, tokenizer):
    first, second = indexed_prefix(tmp_path / "a", seed=0), indexed_prefix(tmp_path / "b", seed=1)
    config = {"seq_length": 16, "split": "100, 0, 0", "data_cache_path": str(tmp_path / "cache")}

    def blend(weights, **settings):
        blend_path = [str(weights[0]), str(first), str(weights[1]), str(second)]
        train, _, _ = build_indexed_text_dataset(blend_path, {**config, **settings}, [200, None, None], tokenizer)
        return FixedBatchDataLoader(train, micro_batch_size=4)

    running = blend((30, 70))
    take(running, 2)
    state = roundtrip(running.state_dict())
    blend((30, 70)).load_state_dict(state)
    with pytest.raises(ResumeStateError, match=r"saved over BlendedDataset of 2 datasets .*weights was"):
        blend((50, 50)).load_state_dict(state)
    with pytest.raises(
        ResumeStateError, match=r"saved over BlendedDataset .*datasets\[0\]\.random_seed was 1234, is now 5"
    ):
        blend((30, 70), random_seed=5).load_state_dict(state)


@pytest.mark.parametrize("version", [0, 4, "3", True, None])
def test_a_state_of_an_unknown_version_is_refused(version, plaintext_path, tokenizer, hf_cache_dir):
    """Versions 1 and 2 are migrated (test_state_migration.py); any other is refused, naming the readable ones."""
    running = online_loader(plaintext_path, tokenizer, hf_cache_dir, "dynamic", "mapping")
    take(running, 2)
    restored = online_loader(plaintext_path, tokenizer, hf_cache_dir, "dynamic", "mapping")
    with pytest.raises(
        ResumeStateError, match=rf"version {re.escape(repr(version))} is not supported \(expected 3, or"
    ):
        restored.load_state_dict({**running.state_dict(), "version": version})


def test_a_changed_transform_is_logged_not_refused(plaintext_path, tokenizer, hf_cache_dir, caplog):
    running = online_loader(plaintext_path, tokenizer, hf_cache_dir, "fixed", "mapping")
    take(running, 2)
    skipping = {"data_type": "plaintext", "max_seq_len": 4096, "on_invalid_record": "skip"}
    restored = online_loader(plaintext_path, tokenizer, hf_cache_dir, "fixed", "mapping", transform=skipping)
    with caplog.at_level(logging.WARNING, logger="hyper_parallel.data"):
        restored.load_state_dict(roundtrip(running.state_dict()))
    assert "data transform changed since the state was saved" in caplog.text
    assert "on_invalid_record='error'" in caplog.text and "on_invalid_record='skip'" in caplog.text


# Malformed states ------------------------------------------------------------------------------------------------


def _set(path: tuple, value):
    def change(state):
        *parents, last = path
        for key in parents:
            state = state[key]
        state[last] = value

    return change


def _delete(path: tuple):
    def change(state):
        *parents, last = path
        for key in parents:
            state = state[key]
        del state[last]

    return change


ANY = ("fixed", "dynamic")
DYN = ("dynamic",)
BUFFER = ("packing", "buffer")
# (loaders, source types, change, the message it gets): each change is one way a checkpoint can be damaged.
CORRUPTIONS = [
    (ANY, "mapping iterable", _delete(("source",)), r"the loader state has no 'source'"),
    (ANY, "mapping iterable", _delete(("data",)), r"the loader state has no 'data'"),
    (ANY, "mapping iterable", _set(("loader",), 3), r"state\['loader'\] must be a string, got int 3"),
    (ANY, "mapping iterable", _set(("dp_rank",), "0"), r"state\['dp_rank'\] must be an integer, got str '0'"),
    (ANY, "mapping iterable", _set(("micro_batch_size",), True), r"state\['micro_batch_size'\] must be an integer"),
    (ANY, "mapping iterable", _set(("source",), []), r"state\['source'\] must be a dict, got list"),
    (ANY, "mapping iterable", _set(("data",), "abc"), r"state\['data'\] must be a dict or None"),
    (ANY, "mapping iterable", _set(("data",), {"source": "x"}), r"state\['data'\] has no 'fingerprint'"),
    (ANY, "mapping iterable", _delete(("source", "position")), r"state\['source'\] has no 'position'"),
    (ANY, "mapping iterable", _set(("source", "position"), 3), r"\['position'\] must be a dict, got int"),
    (ANY, "mapping iterable", _set(("source", "replay"), "x"), r"\['replay'\] must be a list, got str"),
    (ANY, "mapping iterable", _set(("source", "replay"), [5]), r"\['replay'\]\[0\] must be a list, got int"),
    (ANY, "mapping iterable", _set(("source", "replay_epoch"), "0"), r"\['replay_epoch'\] must be an integer or None"),
    (ANY, "mapping iterable", _set(("source", "replay_epoch"), 7), r"\['replay_epoch'\] is 7, but the replayed keys"),
    (ANY, "mapping iterable", _set(("source", "replay_epoch"), None), r"\['replay_epoch'\] is None, but the replay"),
    (ANY, "mapping", _set(("source", "replay"), [["a"]]), r"\['replay'\]\[0\]\[0\] must be an integer, got str"),
    (ANY, "mapping", _set(("source", "replay"), [[10**6]]), r"is record 1000000, but the dataset has 60 records"),
    (ANY, "mapping", _set(("source", "position", "epoch"), "1"), r"saved epoch must be an integer >= 0, got '1'"),
    (ANY, "mapping", _set(("source", "position", "consumed_samples"), 1.5), r"consumed_samples must be an integer"),
    (ANY, "mapping", _delete(("source", "position", "consumed_samples")), r"lacks \['consumed_samples'\]"),
    (ANY, "iterable", _set(("source", "replay"), [[1]]), r"\['replay'\]\[0\]\[0\] must be a list or tuple"),
    (ANY, "iterable", _set(("source", "replay"), [[(1, "x")]]), r"\['replay'\]\[0\]\[0\]\[1\] must be a dict"),
    (ANY, "iterable", _set(("source", "position", "position"), "3"), r"cursor.*\['position'\] must be an integer"),
    (ANY, "iterable", _set(("source", "position", "epoch"), -1), r"cursor.*\['epoch'\] is -1; it counts from 0"),
    (ANY, "iterable", _set(("source", "position", "buffer"), "x"), r"cursor.*\['buffer'\] must be a list"),
    (ANY, "iterable", _set(("source", "position", "buffer"), [1]), r"\['buffer'\]\[0\] must be a dict, got int"),
    (ANY, "iterable", _set(("source", "position", "rng"), {}), r"\['rng'\] is not a numpy PCG64 generator state"),
    (ANY, "iterable", _set(("source", "position", "source_exhausted"), "no"), r"\['source_exhausted'\] must be a bool"),
    (ANY, "iterable", _set(("source", "position", "source_state"), "x"), r"\['source_state'\] must be a dict or None"),
    (("fixed",), "iterable", _set(("source", "position", "source_state"), {}), r"source_state'\] has no 'examples_it"),
    (
        ("fixed",),
        "iterable",
        _set(("source", "position", "source_state", "examples_iterable", "batch_idx"), "2"),
        r"\['source_state'\]\['examples_iterable'\]\['batch_idx'\] must be an integer, got str",
    ),
    (ANY, "mapping iterable", _delete(("source", "kind")), r"state\['source'\] has no 'kind'"),
    (ANY, "mapping iterable", _set(("source", "kind"), 3), r"state\['source'\]\['kind'\] must be a string"),
    (DYN, "mapping iterable", _set(("flushing",), "yes"), r"state\['flushing'\] must be a bool, got str"),
    (DYN, "mapping iterable", _set(("buffered_samples",), None), r"\['buffered_samples'\] must be an int"),
    (DYN, "mapping iterable", _set(("packing",), []), r"state\['packing'\] must be a dict, got list"),
    (DYN, "mapping iterable", _set(("packing", "policy"), "Other"), r"saved by the packing policy Other"),
    (DYN, "mapping iterable", _set(BUFFER, "x"), r"\['packing'\]\['buffer'\] must be a list"),
    (DYN, "mapping iterable", _delete(("packing", "buffer_tokens")), r"\['packing'\] has no 'buffer_tokens'"),
    (
        ("dynamic",),
        "mapping iterable",
        _set(("packing", "buffer_tokens"), 1),
        r"holds \d+ tokens but the state recorded 1",
    ),
    (
        ("dynamic",),
        "mapping iterable",
        _set(("packing", "token_budget"), "1"),
        r"\['token_budget'\] must be an integer",
    ),
    (
        ("dynamic",),
        "mapping",
        _set(BUFFER, [[1]]),
        r"\['buffer'\]\[0\] must be a \[record index, window\]",
    ),
    (DYN, "mapping", _set(BUFFER, [[0, 99]]), r"\['buffer'\]\[0\] is window 99 of record 0"),
    (
        ("dynamic",),
        "iterable",
        _set(BUFFER, [{"input_ids": "ab"}]),
        r"\['buffer'\]\[0\]\['input_ids'\] must",
    ),
    (
        ("dynamic",),
        "iterable",
        _set(BUFFER, [{"input_ids": [], "labels": []}]),
        r"non-empty list of token",
    ),
]


@pytest.mark.parametrize(("loader", "dataset_type"), SOURCES)
def test_a_damaged_state_is_refused_naming_the_key_and_changes_nothing(
    loader, dataset_type, plaintext_path, tokenizer, hf_cache_dir
):
    def make():
        return online_loader(plaintext_path, tokenizer, hf_cache_dir, loader, dataset_type)

    reference = [plain(b) for b in make()]
    saved = make()
    take(saved, 3)
    state = roundtrip(saved.state_dict())
    target = make()
    head = take(target, 1)
    before = target.state_dict()
    cases = [case for case in CORRUPTIONS if loader in case[0] and dataset_type in case[1].split()]
    for _, _, change, message in cases:
        damaged = copy.deepcopy(state)
        if not damaged["source"]["replay"]:  # give the replay checks something to check
            keys = [0, 1, 2] if dataset_type == "mapping" else [(0, {"text": "a"})]
            damaged["source"]["replay"], damaged["source"]["replay_epoch"] = [keys], 0
        change(damaged)
        with pytest.raises(ResumeStateError, match=message):
            target.load_state_dict(damaged)
        assert target.state_dict() == before, f"a refused state ({message}) changed the loader"
    assert head + [plain(b) for b in target] == reference


def test_the_stream_checks_its_own_cursor(plaintext_path, hf_cache_dir, tokenizer):
    def stream():
        dataset = build_online_text_dataset(
            plaintext_path,
            {"data_type": "plaintext", "max_seq_len": 64},
            {"dataset_type": "iterable", "shuffle_buffer_size": 4},
            tokenizer=tokenizer,
        )
        return dataset.stream

    source = stream()
    source.read(5)
    state = json.loads(json.dumps(source.state_dict()))
    fresh = stream()
    for change, message in [
        ({"buffer": [{"text": "x"}] * 5}, r"holds 5 records, more than the shuffle buffer's 4"),
        ({"seed": "1234"}, r"\['seed'\] must be an integer"),
        ({"rng": {**state["rng"], "bit_generator": "MT19937"}}, r"not a numpy PCG64 generator state"),
        ({"position": -2}, r"\['position'\] is -2"),
    ]:
        with pytest.raises(ResumeStateError, match=message):
            fresh.load_state_dict({**state, **change})
        assert fresh.position == 0 and fresh.epoch == 0
    with pytest.raises(ResumeStateError, match="must be a dict, got list"):
        fresh.load_state_dict([])


# Loaders whose records give no sample ------------------------------------------------------------------------------


class NoSamples:
    """A transform that rejects every record (as a filter that matches nothing would)."""

    max_seq_len = 64

    def __call__(self, record, where="record"):
        return []


def train_until_a_batch(loader, deadline_s: float = 15.0):
    """What a training loop does: iterate epoch after epoch until a batch comes (fails after the deadline)."""
    deadline = time.monotonic() + deadline_s
    epochs = 0
    while time.monotonic() < deadline:
        for batch in loader:
            return batch
        epochs += 1
    pytest.fail(
        f"the loader yielded nothing in {epochs} epochs over {deadline_s} s: a training loop would spin forever"
    )


@pytest.mark.parametrize("rejected_by", ["skip", "transform"])
@pytest.mark.parametrize(("loader", "dataset_type"), SOURCES)
def test_a_loader_whose_every_record_gives_no_sample_stops_after_one_epoch(
    loader, dataset_type, rejected_by, tmp_path, tokenizer, hf_cache_dir
):
    path = write_jsonl(tmp_path / "untitled.jsonl", [{"id": i, "body": f"text {i}"} for i in range(20)])
    transform = (
        {"data_type": "plaintext", "max_seq_len": 64, "on_invalid_record": "skip"}
        if rejected_by == "skip"
        else NoSamples()
    )
    options = {"sampler_type": "cyclic"} if dataset_type == "mapping" else {}
    made = online_loader(path, tokenizer, hf_cache_dir, loader, dataset_type, transform=transform, **options)
    with pytest.raises(DataFileError) as stopped:
        train_until_a_batch(made)
    message = str(stopped.value)
    assert f"every one of the 18 records of {path}" in message or f"every one of the 20 records of {path}" in message
    assert "in epoch 0 was skipped as invalid or gave no sample" in message


def test_a_rank_without_a_batch_stops_with_the_fix(tmp_path, tokenizer, hf_cache_dir):
    path = write_jsonl(tmp_path / "tiny.jsonl", [{"text": "one"}, {"text": "two"}])
    dataset = build_online_text_dataset(
        path,
        {"data_type": "plaintext", "max_seq_len": 64},
        {"dataset_type": "iterable", "shuffle_buffer_size": 0},
        tokenizer=tokenizer,
        dp_rank=3,
        dp_world_size=4,
    )
    with pytest.raises(
        DataConfigError, match=r"DP rank 3 of 4 got no batch of .*tiny.jsonl in epoch 0.*fewer DP ranks"
    ):
        train_until_a_batch(FixedBatchDataLoader(dataset, dp_rank=3, dp_world_size=4))


def test_a_partly_invalid_source_keeps_delivering(tmp_path, tokenizer, hf_cache_dir):
    records = [{"id": i, "text": f"text {i}"} if i % 5 == 0 else {"id": i} for i in range(20)]
    path = write_jsonl(tmp_path / "sparse.jsonl", records)
    skip = {"data_type": "plaintext", "max_seq_len": 64, "on_invalid_record": "skip"}
    made = online_loader(path, tokenizer, hf_cache_dir, "fixed", "mapping", transform=skip)
    assert sum(len(b["cu_seq_lens"]) - 1 for epoch in range(2) for b in made) == 8


# Errors in DataLoader workers --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("loader", "dataset_type"), SOURCES)
def test_a_worker_error_reaches_the_caller_as_without_workers(loader, dataset_type, tmp_path, tokenizer, hf_cache_dir):
    records = [{"id": i, "text": text} for i, text in enumerate(paragraphs(12))]
    records[7] = {"id": 7, "body": "no text here"}
    path = write_jsonl(tmp_path / "one_bad.jsonl", records)
    errors = []
    for workers in (0, 2):
        made = online_loader(path, tokenizer, hf_cache_dir, loader, dataset_type, workers=workers)
        with pytest.raises(DataFileError) as raised:
            list(made)
        errors.append(raised.value)
    assert type(errors[0]) is type(errors[1])
    assert str(errors[0]) == str(errors[1])
    assert "DataLoader worker" not in str(errors[1]) and "Traceback" not in str(errors[1])
    assert "no text field" in str(errors[1]) and "one_bad.jsonl" in str(errors[1])
