"""Elastic resume of a mixture with a streaming source: the states of every DP rank merged and restored at another
DP size give the rest of every source's pass, each record once (``mixture_handover``), in an order fixed by the
states and the two DP sizes, whatever the workers."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from batching.resume_check import plain, roundtrip

from hyper_parallel.data.batching import DynamicBatchDataLoader, FixedBatchDataLoader, merge_rank_states
from hyper_parallel.data.errors import ResumeStateError
from hyper_parallel.data.mixture import build_mixture_dataset
from hyper_parallel.data.mixture.build_mixture import stream_of
from hyper_parallel.data.mixture.mixture_handover import merged_cursors, rank_cursor
from hyper_parallel.data.text.build_dataset import build_online_text_dataset
from hyper_parallel.data.text.online.online_iterable_dataset import epoch_start_cursor

from .conftest import indexed_train_split, take_pairs
from .test_mixture_stream import stream

TRANSFORM = {"data_type": "plaintext", "text_keys": "text", "max_seq_len": 256}
WEIGHTS = {"stream": 0.4, "mapping": 0.6}


@pytest.fixture(scope="module")
def built(online_paths, indexed_prefix, tokenizer, tmp_path_factory) -> dict:
    """A mapping source of the 60 records of the second file and the Indexed train split of 140 rows; the
    streaming source of the first file's 40 records is built per rank (``stream``)."""
    cache = tmp_path_factory.mktemp("hf_cache")
    mapping = build_online_text_dataset(online_paths[1], TRANSFORM, {"cache_dir": str(cache)}, tokenizer=tokenizer)
    indexed = indexed_train_split(indexed_prefix, tokenizer, tmp_path_factory.mktemp("cache"))
    return {"paths": online_paths, "tokenizer": tokenizer, "mapping": mapping, "indexed": indexed}


def mixture(built, dp_rank: int, dp_world_size: int, weights: dict = WEIGHTS, **settings):
    datasets = {"mapping": built["mapping"], "indexed": built["indexed"]}
    entries = [
        {"name": name, "weight": weight, "dataset": datasets.get(name) or stream(built, dp_rank, dp_world_size)}
        for name, weight in weights.items()
    ]
    for entry in entries:
        entry.update(settings.pop(entry["name"], {}))
    return build_mixture_dataset(entries, seed=11, **{"on_exhausted": "reweight", **settings})


@pytest.fixture(scope="module")
def records_by_tokens(built) -> dict[tuple, tuple[str, int]]:
    """Each record's tokens -> (source, record), read from the sources themselves, not through the mixture."""
    found = {}
    for position, sample in enumerate(stream(built, 0, 1)):
        found[tuple(np.asarray(sample["input_ids"]).tolist())] = ("stream", position)
    mapping = built["mapping"]
    for record in range(len(mapping)):
        found[tuple(mapping[record][0]["input_ids"].tolist())] = ("mapping", record)
    assert len(found) == 100  # every record tells itself apart
    return found


def make_loaders(built, loader: str, dp_world_size: int, *, workers: int = 0, **settings) -> list:
    options = {"micro_batch_size": 2, "dp_world_size": dp_world_size, "drop_last": False, "num_workers": workers}
    if loader == "dynamic":
        return [
            DynamicBatchDataLoader(
                mixture(built, r, dp_world_size, **settings), min_buffered_samples=6, dp_rank=r, **options
            )
            for r in range(dp_world_size)
        ]
    return [
        FixedBatchDataLoader(mixture(built, r, dp_world_size, **settings), dp_rank=r, **options)
        for r in range(dp_world_size)
    ]


def resized(built, loader: str, old, new_size: int, **options) -> list:
    merged = roundtrip(merge_rank_states([roundtrip(rank.state_dict()) for rank in old]))
    new = make_loaders(built, loader, new_size, **options)
    for rank in new:
        rank.load_state_dict(merged)
    return new


EVERY_RECORD_ONCE = Counter({("stream", r): 1 for r in range(40)}) + Counter({("mapping", r): 1 for r in range(60)})


@pytest.mark.parametrize(("new_size", "workers"), [(1, 0), (3, 0), (4, 0), (3, 2)])
@pytest.mark.parametrize("loader", ["fixed", "dynamic"])
def test_a_dp_change_and_back_gives_every_record_of_the_epoch_once(built, records_by_tokens, loader, new_size, workers):
    # reweight: an epoch is one pass of every source, each record once.
    counts = {"fixed": ([3, 5], [2] * new_size), "dynamic": ([2, 3], [1] * new_size)}[loader]
    old = make_loaders(built, loader, 2, workers=workers)
    before = take_pairs(old, counts[0], records_by_tokens)
    middle_ranks = resized(built, loader, old, new_size, workers=workers)
    middle = take_pairs(middle_ranks, counts[1], records_by_tokens)
    back = resized(built, loader, middle_ranks, 2, workers=workers)
    after = take_pairs(back, [None, None], records_by_tokens)
    assert before and middle and after
    assert before + middle + after == EVERY_RECORD_ONCE
    # The next epoch: every source's next pass, read by each rank from its own share again.
    assert take_pairs(back, [None, None], records_by_tokens) == EVERY_RECORD_ONCE


def test_workers_before_and_after_a_change_give_every_record_once_and_one_order(built, records_by_tokens):
    old = make_loaders(built, "fixed", 2, workers=2)
    before = take_pairs(old, [3, 4], records_by_tokens)  # the workers have read ahead of these: the state replays them
    merged = roundtrip(merge_rank_states([roundtrip(rank.state_dict()) for rank in old]))
    runs = []
    for workers in (0, 2):
        new = make_loaders(built, "fixed", 3, workers=workers)
        for rank in new:
            rank.load_state_dict(merged)
        runs.append([[plain(batch) for batch in rank] for rank in new])
    assert runs[0] == runs[1]  # the order after the change is the state's, whatever the new loaders' workers
    delivered = sum((pairs_of_plain(batches, records_by_tokens) for batches in runs[0]), Counter())
    assert before + delivered == EVERY_RECORD_ONCE


def pairs_of_plain(batches: list[dict], records_by_tokens) -> Counter:
    """The pairs of batches given as plain lists (a row's sequences cut at its ``cu_seq_lens``)."""
    found = Counter()
    for batch in batches:
        ids, bounds = batch["input_ids"][0], batch["cu_seq_lens"]
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            found[records_by_tokens[tuple(ids[start:end])]] += 1
    return found


def identity(payload: dict) -> tuple:
    """What record a key gives: a stream record's text, a mapping or Indexed source's record index."""
    if "record" in payload:
        return payload["source"], payload["record"]["text"]
    return payload["source"], payload["index"]


def first_pass(cursors, names) -> Counter:
    """The records each cursor gives of every source's current pass, read one key at a time (across the mixture's
    epochs) until that pass has ended for each source of ``names``."""
    given = Counter()
    for cursor in cursors:
        passes = {name: entry["passes"] for name, entry in cursor.state_dict()["sources"].items()}
        while True:
            keys = cursor.read(1)
            now = cursor.state_dict()["sources"]
            # A key read after its source's pass ended (in the same read) is of the next pass.
            for _, payload in keys:
                if now[payload["source"]]["passes"] == passes[payload["source"]]:
                    given[identity(payload)] += 1
            if all(now[name]["passes"] > passes[name] for name in names):
                break
    return given


@pytest.mark.parametrize("on_exhausted", ["reweight", "stop", "restart"])
def test_every_source_kind_gives_its_pass_once_across_a_change(built, on_exhausted):
    # The cursors alone: a stream, a mapping source and an Indexed one, read ahead by the draws.
    settings = {"weights": {"stream": 0.3, "mapping": 0.3, "indexed": 0.4}, "on_exhausted": on_exhausted}
    if on_exhausted == "restart":
        settings["num_samples"] = 1000
    old = [mixture(built, rank, 2, **settings).stream for rank in range(2)]
    given = Counter()
    for cursor, taken in zip(old, (17, 29), strict=True):
        given += Counter(identity(payload) for _, payload in cursor.read(taken))
    cursors = [roundtrip(cursor.state_dict()) for cursor in old]
    merged = roundtrip(merged_cursors(cursors, mixture(built, 0, 2, **settings).plan_state(), epoch=0))
    assert merged["sample"] == 29  # the draws go on from the furthest rank
    new = []
    for rank in range(3):
        cursor = mixture(built, rank, 3, **settings).stream
        cursor.load_state_dict(rank_cursor(merged, rank, 3))
        assert cursor.handing_over
        new.append(cursor)
    given += first_pass(new, settings["weights"])
    stream_records = [("stream", record["text"]) for _, record in stream_of(stream(built, 0, 1)).read(1000)]
    expected = Counter(stream_records) + Counter({("mapping", r): 1 for r in range(60)})
    assert given == expected + Counter({("indexed", r): 1 for r in range(len(built["indexed"]))})
    # Past the handed-over pass each new rank reads its own share, as a run of three ranks does.
    assert not any(cursor.handing_over for cursor in new)


def test_a_new_rank_with_nothing_left_of_a_pass_goes_on_to_its_next(built):
    # Three records of the mapping pass are left for four new ranks: rank 3 gets none of them.
    settings = {"weights": {"stream": 0.5, "mapping": 0.5}, "on_exhausted": "restart", "num_samples": 500}
    old = [mixture(built, rank, 2, **settings).stream for rank in range(2)]
    for cursor, wanted in zip(old, (29, 28), strict=True):
        mapped = 0
        while mapped < wanted:
            mapped += sum(payload["source"] == "mapping" for _, payload in cursor.read(1))
    merged = merged_cursors([c.state_dict() for c in old], mixture(built, 0, 2, **settings).plan_state(), 0)
    left = merged["sources"]["mapping"]["left"]
    assert int(np.unpackbits(np.frombuffer(left, dtype=np.uint8)).sum()) == 3
    new = mixture(built, 3, 4, **settings).stream
    new.load_state_dict(rank_cursor(merged, 3, 4))
    mapped = [payload["index"] for _, payload in new.read(60) if payload["source"] == "mapping"]
    # Its pass 1 share: the mapping source's records 3, 7, 11, ... of that pass's order, as a run of four ranks.
    fresh = mixture(built, 3, 4, **settings)
    expected = fresh.records_of(1, 60 + np.arange(3, 60, 4)).tolist()
    assert mapped[:15] == expected and len(expected) == 15


def test_states_that_cannot_be_merged_are_refused_naming_why(built, records_by_tokens):
    old = make_loaders(built, "fixed", 2)
    take_pairs(old, [2, 2], records_by_tokens)
    plain_stream = FixedBatchDataLoader(stream(built, 0, 3), micro_batch_size=2, dp_world_size=3, drop_last=False)
    merged = merge_rank_states([roundtrip(rank.state_dict()) for rank in old])
    with pytest.raises(ResumeStateError, match="data"):
        plain_stream.load_state_dict(merged)


def test_a_new_rank_s_stream_cursor_at_a_pass_start_is_the_one_a_fresh_stream_saves(built):
    # A stream whose share ended on every old rank continues, on each new rank, from this cursor.
    fresh = stream_of(stream(built, 1, 3))
    fresh.set_epoch(2)
    assert fresh.state_dict() == epoch_start_cursor(epoch=2, dp_rank=1, dp_world_size=3, seed=5, shuffle_buffer_size=8)


def test_a_stream_whose_shares_ended_with_records_waiting_hands_over_those_records(built):
    # stop: the mapping source's end (20 samples per rank and pass) ends an epoch within a read that had taken the
    # stream's last records of its share for later samples: they wait, and the stream's share has ended.
    settings = {"weights": {"stream": 0.5, "mapping": 0.5}, "on_exhausted": "stop", "mapping": {"max_samples": 40}}
    old = [mixture(built, rank, 2, **dict(settings)).stream for rank in range(2)]
    given = Counter()
    for cursor in old:
        while not (entry := cursor.state_dict()["sources"]["stream"])["ended"]:
            given += Counter(identity(payload) for _, payload in cursor.read(64))
        assert entry["pending"]
    cursors = [roundtrip(cursor.state_dict()) for cursor in old]
    plan = mixture(built, 0, 2, **dict(settings)).plan_state()
    merged = roundtrip(merged_cursors(cursors, plan, epoch=min(cursor["epoch"] for cursor in cursors)))
    handed = merged["sources"]["stream"]
    assert handed["stream"]["ended"] and len(handed["records"]) == sum(
        len(c["sources"]["stream"]["pending"]) for c in cursors
    )
    new = []
    for rank in range(3):
        cursor = mixture(built, rank, 3, **dict(settings)).stream
        cursor.load_state_dict(rank_cursor(merged, rank, 3))
        new.append(cursor)
    given += first_pass(new, ["stream", "mapping"])
    streamed = Counter({pair: count for pair, count in given.items() if pair[0] == "stream"})
    # Every pass of the stream up to the handed-over one gave each of its 40 records once.
    assert len(streamed) == 40 and set(streamed.values()) == {handed["passes"] + 1}


def test_a_stream_with_max_samples_hands_over_the_count_left_of_its_pass(built):
    # Each old rank gives 12 samples of its share per pass; whatever the new ranks' shares, the pass still gives
    # 2 x 12 samples, none twice.
    settings = {"weights": {"stream": 0.5, "mapping": 0.5}, "on_exhausted": "restart", "num_samples": 1000}
    old = [mixture(built, rank, 2, stream={"max_samples": 12}, **dict(settings)).stream for rank in range(2)]
    given = Counter()
    for cursor, taken in zip(old, (9, 14), strict=True):
        given += Counter(identity(payload) for _, payload in cursor.read(taken))
    cursors = [roundtrip(cursor.state_dict()) for cursor in old]
    plan = mixture(built, 0, 2, stream={"max_samples": 12}, **dict(settings)).plan_state()
    merged = roundtrip(merged_cursors(cursors, plan, epoch=0))
    taken = sum(cursor["sources"]["stream"]["taken"] for cursor in cursors)
    assert merged["sources"]["stream"]["samples_left"] == 24 - taken
    new = []
    for rank in range(3):
        cursor = mixture(built, rank, 3, stream={"max_samples": 12}, **dict(settings)).stream
        cursor.load_state_dict(rank_cursor(merged, rank, 3))
        new.append(cursor)
    given += first_pass(new, ["stream"])
    streamed = Counter({pair: count for pair, count in given.items() if pair[0] == "stream"})
    assert sum(streamed.values()) == 24 and set(streamed.values()) == {1}
    # The pass after it is each new rank's own: 12 samples of its share (the read that ended the handed-over pass
    # may have given the first of them).
    begun = sum(cursor.state_dict()["sources"]["stream"]["taken"] for cursor in new)
    again = first_pass(new, ["stream"])
    assert begun + sum(count for pair, count in again.items() if pair[0] == "stream") == 36


def test_ranks_in_different_passes_each_hand_over_the_rest_of_their_own(built):
    # 41 samples per pass: rank 0 of 2 gives 21, rank 1 20, so rank 1 begins its next pass one draw earlier.
    settings = {"weights": {"stream": 0.5, "mapping": 0.5}, "on_exhausted": "restart", "num_samples": 1000}
    capped = {"mapping": {"max_samples": 41}}
    old = [mixture(built, rank, 2, **dict(settings), **capped).stream for rank in range(2)]
    while old[1].state_dict()["sources"]["mapping"]["passes"] == 0:
        for cursor in old:
            cursor.read(1)
    entries = [cursor.state_dict()["sources"]["mapping"] for cursor in old]
    assert [(entry["passes"], entry["taken"]) for entry in entries] == [(0, 21), (1, 1)]
    plan = mixture(built, 0, 2, **dict(settings), **capped).plan_state()
    merged = roundtrip(merged_cursors([cursor.state_dict() for cursor in old], plan, epoch=0))
    new = []
    for rank in range(3):
        cursor = mixture(built, rank, 3, **dict(settings), **capped).stream
        cursor.load_state_dict(rank_cursor(merged, rank, 3))
        new.append(cursor)
    given = first_pass(new, ["mapping"])
    reference = mixture(built, 0, 2, **dict(settings), **capped)
    expected = Counter()
    for rank, entry in enumerate(entries):  # each old rank's rest of its own pass p: its samples r, r + 2, ...
        counts = entry["passes"] * 41 + np.arange(rank, 41, 2)[entry["taken"] :]
        expected += Counter(("mapping", int(record)) for record in reference.records_of(1, counts))
    assert sum(expected.values()) == 19  # rank 0 had given its whole pass 0, rank 1 one sample of its pass 1
    assert Counter({pair: n for pair, n in given.items() if pair[0] == "mapping"}) == expected


def test_a_damaged_handed_over_entry_is_refused_naming_the_field(built):
    settings = {"weights": {"stream": 0.5, "mapping": 0.5}, "on_exhausted": "reweight"}
    old = [mixture(built, rank, 2, **dict(settings)).stream for rank in range(2)]
    for cursor in old:
        cursor.read(5)
    plan = mixture(built, 0, 2, **dict(settings)).plan_state()
    merged = merged_cursors([cursor.state_dict() for cursor in old], plan, 0)
    restored = mixture(built, 1, 3, **dict(settings)).stream
    cursor = rank_cursor(merged, 1, 3)
    del cursor["sources"]["mapping"]["handed_over"]
    with pytest.raises(ResumeStateError, match=r"\['mapping'\]\['left'\] belongs to a handed-over mapping source"):
        restored.load_state_dict(cursor)
    new = [mixture(built, rank, 3, **dict(settings)).stream for rank in range(3)]
    for rank, fresh in enumerate(new):
        fresh.load_state_dict(rank_cursor(merged, rank, 3))
    cursors = [fresh.state_dict() for fresh in new]
    del cursors[2]["sources"]["mapping"]["left_from"]
    with pytest.raises(
        ResumeStateError, match=r"DP rank 2's mixture stream cursor\['sources'\]\['mapping'\].*left_from"
    ):
        merged_cursors(cursors, plan, 0)
