"""A dynamic loader over two DP ranks (real gloo processes) changes its mixture mid-epoch: the ranks, saved at
different sample numbers, agree on the furthest one, S; the new weights apply from S on every rank, each rank reads
its share before S as the saved mixture planned, and together they deliver every sample of the epoch once (those of
a removed source before S are counted as dropped)."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest
from batching.conftest import paragraphs, write_jsonl
from batching.resume_check import roundtrip
from parallel.launch import launch

from hyper_parallel.data.batching import DynamicBatchDataLoader
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.mixture import build_mixture_dataset
from hyper_parallel.data.text.build_dataset import build_online_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer

RECORDS = 80  # per source
TRANSFORM = {"data_type": "plaintext", "text_keys": "text", "max_seq_len": 256}
# Where each rank is saved: rank 0 after its first batch (at sample 64: a rank reads 64 sample numbers, 32 records
# of its share, at a time), rank 1 once it has read to sample 128.
SAVED_AT = (64, 128)
CHANGES = {
    "weights": ({"a": 1, "b": 1, "c": 1}, {"a": 1, "b": 2, "c": 3}),
    "add": ({"a": 1, "b": 1}, {"a": 1, "b": 1, "c": 2}),
    "remove": ({"a": 1, "b": 1, "c": 1}, {"a": 1, "c": 2}),
}


@pytest.fixture(scope="module")
def source_files(tmp_path_factory) -> tuple[dict[str, str], str]:
    """Three JSON-lines files of 80 distinct short paragraphs each, and a dataset cache already built for them."""
    directory = tmp_path_factory.mktemp("dp_change")
    distinct = list(dict.fromkeys(text[:300] for text in paragraphs(600)))[: 3 * RECORDS]
    paths = {
        name: str(write_jsonl(directory / f"{name}.jsonl", [{"text": text} for text in chunk]))
        for name, chunk in zip("abc", (distinct[i * RECORDS : (i + 1) * RECORDS] for i in range(3)), strict=True)
    }
    return paths, str(directory / "cache")


@pytest.fixture(scope="module")
def records_by_tokens(source_files, tokenizer) -> dict[tuple, tuple[str, int]]:
    """Each record's tokens -> (source, record), read from the sources themselves (building the shared cache)."""
    paths, cache = source_files
    found = {}
    for name, path in paths.items():
        dataset = build_online_text_dataset(path, TRANSFORM, {"cache_dir": cache}, tokenizer=tokenizer)
        for record in range(len(dataset)):
            (sample,) = dataset[record]
            found[tuple(np.asarray(sample["input_ids"]).tolist())] = (name, record)
    assert len(found) == 3 * RECORDS  # every record tells itself apart
    return found


def _mixture(paths: dict, cache: str, tokenizer, weights: dict):
    """Every source read in record order (its own order is records 0, 1, 2, ...), interleaved by weight."""
    entries = [
        {
            "name": name,
            "weight": weight,
            "dataset": build_online_text_dataset(paths[name], TRANSFORM, {"cache_dir": cache}, tokenizer=tokenizer),
        }
        for name, weight in weights.items()
    ]
    return build_mixture_dataset(entries, strategy="interleave", on_exhausted="reweight", shuffle=False, seed=5)


def _tokens_of(batch) -> list[list[int]]:
    """Each delivered sequence's tokens; the collator's padding sequence (labels all ignored) is none."""
    return [ids.tolist() for ids, labels in batch.sequences() if not (labels == IGNORE_INDEX).all()]


def change_mid_epoch(rank: int, world_size: int, *, paths, cache, before, after, workers, again=False) -> dict:
    """Read a few batches over ``before``, save, restart over ``after`` with the change allowed, read to the end.
    With ``again``: also save after the first batch since the change, and resume that over ``after`` too."""
    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)

    def loader(weights):
        return DynamicBatchDataLoader(
            _mixture(paths, cache, tokenizer, weights),
            micro_batch_size=2,
            dp_rank=rank,
            dp_world_size=world_size,
            min_buffered_samples=8,
            num_workers=workers,
            drop_last=False,  # every sample of the epoch, to check each is delivered
            # a rank is a forkserver's child, so its workers would start by forkserver too: seconds each
            multiprocessing_context="fork" if workers else None,
        )

    saved, delivered = loader(before), []
    for batch in saved:
        delivered += _tokens_of(batch)
        state = roundtrip(saved.state_dict())
        if state["source"]["position"]["consumed_samples"] >= SAVED_AT[rank]:
            break
    changed = loader(after)
    changed.load_state_dict(state, allow_mixture_change=True)
    report = {"consumed": state["source"]["position"]["consumed_samples"], "plan": changed.dataset.plan_state()}
    batches = iter(changed)
    if again:
        delivered += _tokens_of(next(batches))
        later = roundtrip(changed.state_dict())
        report["consumed_again"] = later["source"]["position"]["consumed_samples"]
        resumed = loader(after)  # the same config: the state's plan continues without the opt-in
        resumed.load_state_dict(later)
        report["resumed"] = [_tokens_of(batch) for batch in resumed]
    report["uninterrupted"] = [_tokens_of(batch) for batch in batches]
    report["delivered"] = delivered + [ids for tokens in report["uninterrupted"] for ids in tokens]
    return report


def _dropped(report: dict) -> int:
    """The samples a rank said it dropped, of sources no longer mixed."""
    return sum(int(message.split(": ")[1].split(" ")[0]) for _, message in report["logs"] if "are dropped" in message)


@pytest.mark.parametrize(("change", "workers"), [("weights", 0), ("add", 2), ("remove", 0), ("remove", 2)])
def test_two_dp_ranks_saved_at_different_samples_change_the_mixture_at_the_furthest(
    source_files, records_by_tokens, tokenizer, tmp_path, change, workers
):
    paths, cache = source_files
    before, after = CHANGES[change]
    worker = functools.partial(change_mid_epoch, paths=paths, cache=cache, before=before, after=after, workers=workers)
    reports = launch(worker, tmp_path, world_size=2, deadline_s=120)
    assert [report.get("error") for report in reports] == [None, None]
    values = [report["value"] for report in reports]
    consumed = [value["consumed"] for value in values]
    assert consumed == list(SAVED_AT)  # the case under test: the ranks were saved at different sample numbers
    resume_at = max(consumed)
    plans = [value["plan"] for value in values]
    assert plans[0] == plans[1]  # every rank reads the same mixture
    last = plans[0]["segments"][-1]
    assert last["start"] == resume_at and last["weights"] == {name: float(w) for name, w in after.items()}

    # Before S: the samples the first mixture planned, read by whichever rank's share holds them.
    old = _mixture(paths, cache, tokenizer, before)
    sources, records = old.locate(np.arange(resume_at))
    planned_before = Counter((old.names[s], int(r)) for s, r in zip(sources.tolist(), records.tolist(), strict=True))
    delivered = Counter(records_by_tokens[tuple(ids)] for value in values for ids in value["delivered"])
    assert max(delivered.values()) == 1  # no sample twice, across the ranks and the change
    removed = set(before) - set(after)
    not_delivered = planned_before - delivered
    assert all(name in removed for name, _ in not_delivered)  # only a removed source's samples are left out...
    assert sum(not_delivered.values()) == sum(map(_dropped, reports))  # ...and each is counted as dropped
    if removed:
        assert not_delivered  # the case under test: some were still to read when the source was removed

    # From S: every source continues its own order (no repeat, no gap) to its end, in the new weights.
    for name in after:
        assert sorted(record for source, record in delivered if source == name) == list(range(RECORDS))
    for name in removed:  # nothing of it from S on
        assert {pair for pair in delivered if pair[0] == name} <= set(planned_before)
    changed = _mixture(paths, cache, tokenizer, after)
    changed.adopt(changed.resumed_plan(plans[0], lambda: resume_at, allow_change=False))
    total = sum(after.values())
    first_rounds = [changed.known_names[s] for s in changed.sources_of(np.arange(resume_at, resume_at + 4 * total))]
    assert Counter(first_rounds) == {name: 4 * weight for name, weight in after.items()}


def change_across_epochs(rank: int, world_size: int, *, paths, cache) -> None:
    """Rank 0 saved in epoch 0, rank 1 in epoch 1; both restart over other weights with the change allowed."""
    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    before, after = CHANGES["weights"]

    def loader(weights):
        mixture = _mixture(paths, cache, tokenizer, weights)
        return DynamicBatchDataLoader(
            mixture, micro_batch_size=2, dp_rank=rank, dp_world_size=world_size, min_buffered_samples=8
        )

    saved = loader(before)
    if rank == 1:
        for _ in saved:  # the whole of epoch 0
            pass
    next(iter(saved))
    loader(after).load_state_dict(roundtrip(saved.state_dict()), allow_mixture_change=True)


def test_dp_ranks_saved_in_different_epochs_all_refuse_the_change_naming_each_epoch(source_files, tmp_path):
    paths, cache = source_files
    reports = launch(functools.partial(change_across_epochs, paths=paths, cache=cache), tmp_path, world_size=2)
    errors = [report.get("error") for report in reports]
    assert [error["type"] for error in errors] == ["ResumeStateError"] * 2
    assert errors[0]["message"] == errors[1]["message"]  # every rank raises the same error
    assert "DP rank 0 in epoch 0, DP rank 1 in epoch 1" in errors[0]["message"]


def test_a_rank_saved_again_before_the_change_point_resumes_exactly_over_the_changed_mixture(source_files, tmp_path):
    paths, cache = source_files
    before, after = CHANGES["remove"]
    worker = functools.partial(
        change_mid_epoch, paths=paths, cache=cache, before=before, after=after, workers=0, again=True
    )
    reports = launch(worker, tmp_path, world_size=2)
    assert [report.get("error") for report in reports] == [None, None]
    rank0 = reports[0]["value"]
    assert rank0["consumed_again"] < SAVED_AT[1]  # the case under test: still reading before the change point
    assert rank0["resumed"] == rank0["uninterrupted"]


def change_on_two_of_four(rank: int, world_size: int, *, paths, cache) -> None:
    """Four processes, two DP ranks (as with tensor parallelism, where not every process reads): a mid-epoch change."""
    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    before, after = CHANGES["weights"]

    def loader(weights):
        mixture = _mixture(paths, cache, tokenizer, weights)
        return DynamicBatchDataLoader(
            mixture, micro_batch_size=2, dp_rank=rank % 2, dp_world_size=2, min_buffered_samples=8
        )

    saved = loader(before)
    next(iter(saved))
    loader(after).load_state_dict(roundtrip(saved.state_dict()), allow_mixture_change=True)


def test_a_process_group_of_more_processes_than_dp_ranks_refuses_a_mid_epoch_change(source_files, tmp_path):
    paths, cache = source_files
    reports = launch(functools.partial(change_on_two_of_four, paths=paths, cache=cache), tmp_path, world_size=4)
    for report in reports:
        assert report["error"]["type"] == "ResumeStateError"
        assert "the default process group holds 4 processes, not one per DP rank" in report["error"]["message"]
        assert "change it at an epoch's start" in report["error"]["message"]
