"""A mixture with a streaming source: its order with any worker count, exact resume with both loaders and any
worker count, the realised shares, each source's records once per pass, the tally, what a source's end does, and
a changed mixture (new weights, a source added, removed and added back, each source continuing its own order, the
new weights from the resume point), and what is refused (a changed source or setting, a change without the opt-in,
epochs of a stream, merging for another DP size)."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest
from batching.resume_check import plain, roundtrip, take

from hyper_parallel.data.batching import DynamicBatchDataLoader, FixedBatchDataLoader
from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, ResumeStateError
from hyper_parallel.data.mixture import build_mixture_dataset
from hyper_parallel.data.text.build_dataset import build_online_text_dataset

from .conftest import indexed_train_split

TRANSFORM = {"data_type": "plaintext", "text_keys": "text", "max_seq_len": 256}


@pytest.fixture(scope="module")
def built(online_paths, indexed_prefix, tokenizer, tmp_path_factory) -> dict:
    """What the sources are built from: a streaming source of 40 records (buffer-shuffled), a mapping source of
    60 and the Indexed train split of 140 rows."""
    cache = tmp_path_factory.mktemp("hf_cache")
    indexed = indexed_train_split(indexed_prefix, tokenizer, tmp_path_factory.mktemp("cache"))
    mapping = build_online_text_dataset(online_paths[1], TRANSFORM, {"cache_dir": str(cache)}, tokenizer=tokenizer)
    return {"paths": online_paths, "tokenizer": tokenizer, "indexed": indexed, "mapping": mapping}


def stream(built, dp_rank: int = 0, dp_world_size: int = 1, path: int = 0):
    """A fresh streaming source (a stream's cursor belongs to one loader) of the 40 records, or of the mapping
    source's 60 (``path`` 1)."""
    return build_online_text_dataset(
        built["paths"][path],
        TRANSFORM,
        {"dataset_type": "iterable", "shuffle_buffer_size": 8},
        tokenizer=built["tokenizer"],
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=5,
    )


def mixture(built, weights: dict, dp_rank: int = 0, dp_world_size: int = 1, **settings):
    datasets = {
        "stream": stream(built, dp_rank, dp_world_size),
        "stream2": stream(built, dp_rank, dp_world_size, path=1),
        "mapping": built["mapping"],
        "indexed": built["indexed"],
    }
    entries = [{"name": name, "weight": weight, "dataset": datasets[name]} for name, weight in weights.items()]
    for entry in entries:
        entry.update(settings.pop(entry["name"], {}))
    return build_mixture_dataset(entries, seed=11, **settings)


WEIGHTS = {"stream": 0.4, "mapping": 0.3, "indexed": 0.3}


def sequences(batch) -> list[tuple]:
    """The token ids of every sequence of a packed batch, the collator's padding left out."""
    found = []
    for ids, labels in batch.sequences():
        if (labels != IGNORE_INDEX).any():
            found.append(tuple(ids.tolist()))
    return found


def source_tokens(built) -> dict[str, Counter]:
    """Each source's samples as token tuples, read from the sources themselves (not through the mixture)."""
    mapping = Counter(tuple(built["mapping"][i][0]["input_ids"].tolist()) for i in range(len(built["mapping"])))
    streamed = Counter(tuple(sample["input_ids"].tolist()) for sample in stream(built))
    return {"stream": streamed, "mapping": mapping}


# -- the order ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loader_class", [FixedBatchDataLoader, DynamicBatchDataLoader])
def test_the_batches_do_not_depend_on_the_worker_count(built, loader_class):
    made = [
        [
            plain(batch)
            for batch in loader_class(
                mixture(built, WEIGHTS, on_exhausted="reweight"), micro_batch_size=4, num_workers=workers
            )
        ]
        for workers in (0, 2)
    ]
    assert made[0] == made[1] and len(made[0]) > 5


def test_the_realised_shares_over_ten_thousand_samples_are_within_one_percent(built):
    weights = {"stream": 0.5, "mapping": 0.3, "indexed": 0.2}
    dataset = mixture(built, weights, on_exhausted="restart", num_samples=10_000)
    keys = dataset.stream.read(10_000)
    assert dataset.stream.read(1) == []  # the epoch is num_samples long
    names = Counter(payload["source"] for _, payload in keys)
    assert [number for number, _ in keys] == list(range(10_000))
    for name, weight in weights.items():
        assert abs(names[name] / 10_000 - weight) < 0.01


def test_reweight_gives_every_record_of_every_source_once_and_tallies_them(built):
    loader = FixedBatchDataLoader(
        mixture(built, {"stream": 1, "mapping": 1}, on_exhausted="reweight"), micro_batch_size=4
    )
    delivered = Counter(sequence for batch in loader for sequence in sequences(batch))
    expected = source_tokens(built)
    assert delivered == expected["stream"] + expected["mapping"]
    tally = loader.state_dict()["mixture"]["sources"]
    for name, samples in expected.items():
        assert tally[name]["samples"] == sum(samples.values()) == (40 if name == "stream" else 60)
        assert tally[name]["tokens"] == sum(len(tokens) * count for tokens, count in samples.items())


def test_stop_ends_the_epoch_where_a_source_ends_and_the_next_epoch_continues_every_source(built):
    dataset = mixture(built, {"stream": 1, "mapping": 3}, mapping={"max_samples": 30})
    epochs = []
    for epoch in range(5):
        epochs.append([payload for _, payload in dataset.stream.read(1000)])
        assert dataset.stream.read(10) == [] and dataset.stream.epoch == epoch + 1
    # Either source's end ends an epoch; the first is the mapping source's, after its 30 samples.
    assert sum(payload["source"] == "mapping" for payload in epochs[0]) == 30
    mapped = [payload["index"] for payloads in epochs for payload in payloads if payload["source"] == "mapping"]
    assert all(len(set(mapped[start : start + 30])) == 30 for start in range(0, len(mapped) - 29, 30))
    streamed = [
        payload["record"]["text"] for payloads in epochs for payload in payloads if payload["source"] == "stream"
    ]
    assert len(streamed) > 40
    assert len(set(streamed[:40])) == 40  # the stream went on with its own pass across the epochs
    assert streamed[40:] != streamed[: len(streamed) - 40]  # then began its next pass, in a new order


def test_restart_begins_a_stream_s_next_pass_in_a_new_order(built):
    dataset = mixture(built, {"stream": 1, "mapping": 1}, on_exhausted="restart", num_samples=300)
    texts = [payload["record"]["text"] for _, payload in dataset.stream.read(300) if payload["source"] == "stream"]
    assert len(texts) > 80
    assert sorted(texts[:40]) == sorted(texts[40:80]) and texts[:40] != texts[40:80]


def test_two_dp_ranks_read_disjoint_shares_of_every_source(built):
    per_rank = [
        mixture(built, {"stream": 1, "mapping": 1}, dp_rank, 2, on_exhausted="reweight").stream.read(1000)
        for dp_rank in range(2)
    ]
    for name, key in (("stream", "record"), ("mapping", "index")):
        shares = [[str(payload[key]) for _, payload in keys if payload["source"] == name] for keys in per_rank]
        assert not set(shares[0]) & set(shares[1])
        assert len(shares[0]) + len(shares[1]) == (40 if name == "stream" else 60)


# -- resume -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loader_class", [FixedBatchDataLoader, DynamicBatchDataLoader])
@pytest.mark.parametrize(("saved_with", "restored_with"), [(0, 2), (2, 0)])
def test_a_restored_loader_continues_with_exactly_the_uninterrupted_batches_and_tally(
    built, loader_class, saved_with, restored_with
):
    def make(workers: int):
        return loader_class(mixture(built, WEIGHTS, on_exhausted="reweight"), micro_batch_size=4, num_workers=workers)

    whole = make(0)
    reference = [plain(batch) for batch in whole]
    stop = len(reference) // 2
    stopped = make(saved_with)
    head = take(stopped, stop)
    restored = make(restored_with)
    restored.load_state_dict(roundtrip(stopped.state_dict()))
    tail = [plain(batch) for batch in restored]
    assert head + tail == reference
    assert restored.state_dict()["mixture"]["sources"] == whole.state_dict()["mixture"]["sources"]


def read_epochs(cursor, epochs: int, size: int) -> list[list]:
    """The keys of the next ``epochs`` epochs of a mixture stream, read ``size`` at a time (JSON-safe lists)."""
    read = []
    while epochs:
        keys = cursor.read(size)
        read.append(json.loads(json.dumps(keys)))
        epochs -= not keys
    return read


def check_cursor_resume(built, weights: dict, settings: dict, size: int) -> list[dict]:
    """Save the cursor after every read of ``size`` samples, restore it into a new mixture, and compare what it
    reads to the uninterrupted run's keys; returns the saved cursors."""
    whole = read_epochs(mixture(built, weights, **settings).stream, 3, size)
    cursors = []
    for stop in range(1, len(whole)):
        stopped = mixture(built, weights, **settings).stream
        for _ in range(stop):
            stopped.read(size)
        cursors.append(json.loads(json.dumps(stopped.state_dict())))
        restored = mixture(built, weights, **settings).stream
        restored.load_state_dict(cursors[-1])
        rest = read_epochs(restored, 3 - sum(not keys for keys in whole[:stop]), size)
        assert whole[:stop] + rest == whole, f"resume after read {stop} differs"
    return cursors


@pytest.mark.parametrize("on_exhausted", ["stop", "reweight", "restart"])
@pytest.mark.parametrize("strategy", ["weighted", "interleave"])
def test_a_cursor_saved_after_any_read_continues_with_exactly_the_uninterrupted_samples(built, on_exhausted, strategy):
    settings = {"on_exhausted": on_exhausted, "strategy": strategy, "mapping": {"max_samples": 25}}
    if on_exhausted == "restart":
        settings["num_samples"] = 120
    cursors = check_cursor_resume(built, {"stream": 2, "mapping": 1, "indexed": 1}, settings, 7)
    if on_exhausted == "stop":  # an epoch ended by another source leaves the stream's records read ahead waiting
        assert any(cursor["sources"]["stream"]["pending"] for cursor in cursors)


def test_a_cursor_saved_after_a_stream_ended_behind_records_read_ahead_continues_exactly(built):
    """The mapping source's end cuts a read in which the stream's share ended: its last records wait, and its end
    comes after them."""
    cursors = check_cursor_resume(built, {"stream": 3, "mapping": 1}, {"mapping": {"max_samples": 6}}, 32)
    assert any(cursor["sources"]["stream"]["ended"] and cursor["sources"]["stream"]["pending"] for cursor in cursors)


def test_interleave_takes_the_sources_in_the_weights_round_robin(built):
    dataset = mixture(built, {"stream": 2, "mapping": 1}, strategy="interleave", on_exhausted="reweight")
    names = [payload["source"] for _, payload in dataset.stream.read(30)]
    assert names == ["stream", "mapping", "stream"] * 10


def test_a_state_saved_mid_epoch_continues_across_the_next_epoch(built):
    def make():
        return DynamicBatchDataLoader(
            mixture(built, {"stream": 1, "mapping": 1}, mapping={"max_samples": 20}), micro_batch_size=4
        )

    whole = make()
    reference = [plain(batch) for _ in range(2) for batch in whole]
    stopped = make()
    head = take(stopped, 1)
    restored = make()
    restored.load_state_dict(roundtrip(stopped.state_dict()))
    tail = [plain(batch) for batch in restored] + [plain(batch) for batch in restored]
    assert head + tail == reference


# -- a changed mixture --------------------------------------------------------------------------------------------


def record_numbers(built) -> dict[str, dict[tuple, int]]:
    """Each stream or mapping sample's tokens -> its record's number in its source's own order (the stream's read
    order alone; the mapping source's record index)."""
    plain_order = [tuple(sample["input_ids"].tolist()) for sample in stream(built)]
    mapping = built["mapping"]
    return {
        "stream": {tokens: number for number, tokens in enumerate(plain_order)},
        "mapping": {tuple(mapping[i][0]["input_ids"].tolist()): i for i in range(len(mapping))},
    }


def read_records(loader, numbers: dict, into: dict[str, list], batches: int | None = None) -> None:
    """Read ``batches`` batches (all: None) and add each stream or mapping sequence to ``into`` as its record's
    number (``record_numbers``); Indexed rows are left out (the tally counts them)."""
    for count, batch in enumerate(loader, 1):
        for sequence in sequences(batch):
            for name, known in numbers.items():
                if sequence in known:
                    into.setdefault(name, []).append(known[sequence])
        if count == batches:
            break


def loader_over(built, loader_class, weights: dict, workers: int = 0, **settings):
    """A loader over ``weights`` (reweight); a dynamic one buffers and prefetches few samples, so that a change
    comes mid-epoch."""
    settings.setdefault("on_exhausted", "reweight")
    options = {"min_buffered_samples": 8} if loader_class is DynamicBatchDataLoader else {}
    if workers and loader_class is DynamicBatchDataLoader:
        options["prefetch_factor"] = 1
    return loader_class(
        mixture(built, weights, **settings), micro_batch_size=4, num_workers=workers, drop_last=False, **options
    )


def dropped(caplog) -> int:
    """The samples the loaders said they dropped (of sources no longer mixed)."""
    messages = [record.getMessage() for record in caplog.records]
    return sum(int(message.split(": ")[1].split(" ")[0]) for message in messages if "are dropped" in message)


@pytest.mark.parametrize("loader_class", [FixedBatchDataLoader, DynamicBatchDataLoader])
@pytest.mark.parametrize("workers", [0, 2])
def test_new_weights_and_an_added_source_continue_every_source_once_to_its_end(built, loader_class, workers):
    numbers, got = record_numbers(built), {}
    saved = loader_over(built, loader_class, {"stream": 1, "mapping": 1}, workers)
    read_records(saved, numbers, got, 1)
    assert len(got["stream"]) + len(got["mapping"]) < 100  # the change comes mid-epoch
    restored = loader_over(built, loader_class, {"stream": 3, "mapping": 1, "indexed": 1}, workers)
    restored.load_state_dict(roundtrip(saved.state_dict()), allow_mixture_change=True)
    read_records(restored, numbers, got)
    assert sorted(got["stream"]) == list(range(40)) and sorted(got["mapping"]) == list(range(60))
    tally = restored.state_dict()["mixture"]["sources"]
    assert {name: counts["samples"] for name, counts in tally.items()} == {
        "stream": 40,
        "mapping": 60,
        "indexed": len(built["indexed"]),
    }


@pytest.mark.parametrize("loader_class", [FixedBatchDataLoader, DynamicBatchDataLoader])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_removed_source_added_back_continues_where_it_was(built, loader_class, workers, caplog):
    """``stream2`` streams the mapping source's records, so ``record_numbers`` names them as the mapping's."""
    numbers, got = record_numbers(built), {}
    first = loader_over(built, loader_class, {"stream": 1, "stream2": 5}, workers)  # the stream's pass goes on
    read_records(first, numbers, got, 1)
    streamed_before = len(got["stream"])
    second = loader_over(built, loader_class, {"stream2": 1, "indexed": 1}, workers)
    with caplog.at_level(logging.WARNING, logger="hyper_parallel.data"):
        second.load_state_dict(roundtrip(first.state_dict()), allow_mixture_change=True)
    read_records(second, numbers, got, 1)
    assert len(got["stream"]) == streamed_before  # the stream is not mixed meanwhile
    third = loader_over(built, loader_class, {"stream": 1, "stream2": 1, "indexed": 1}, workers)
    third.load_state_dict(roundtrip(second.state_dict()), allow_mixture_change=True)
    read_records(third, numbers, got)
    # Every stream record once: those read before the removal, those dropped with it (said with their count),
    # then the rest, the stream continuing where it was.
    assert len(got["stream"]) == len(set(got["stream"])) == 40 - dropped(caplog) > streamed_before
    assert sorted(got["mapping"]) == list(range(60))
    if loader_class is FixedBatchDataLoader and workers == 0:  # nothing read ahead: the stream's own order, whole
        assert dropped(caplog) == 0 and got["stream"] == list(range(40))


def test_after_a_change_each_source_continues_as_it_would_alone(built):
    """The stream's next records are those the stream alone reads after the records the mixture took of it, and
    the mapping source's are its own order's next ones."""
    saved = FixedBatchDataLoader(
        mixture(built, {"stream": 1, "mapping": 1}, on_exhausted="reweight"), micro_batch_size=4
    )
    numbers, got = record_numbers(built), {}
    read_records(saved, numbers, got, 3)
    restored = FixedBatchDataLoader(
        mixture(built, {"stream": 1, "mapping": 3}, on_exhausted="reweight", mixture_change="allow"), micro_batch_size=4
    )
    restored.load_state_dict(roundtrip(saved.state_dict()))
    keys = json.loads(json.dumps(restored.dataset.stream.read(30)))
    streamed = [[payload["position"], payload["record"]] for _, payload in keys if payload["source"] == "stream"]
    taken = len(got["stream"])
    assert streamed and streamed == plain_stream_records(built)[taken : taken + len(streamed)]
    alone = build_mixture_dataset([{"name": "mapping", "weight": 1, "dataset": built["mapping"]}], seed=11)
    mapped = [payload["index"] for _, payload in keys if payload["source"] == "mapping"]
    expected = alone.locate(range(len(got["mapping"]), len(got["mapping"]) + len(mapped)))[1].tolist()
    assert mapped == expected


def plain_stream_records(built) -> list:
    """The stream's ``[position, record]`` pairs as the stream alone reads them, in order."""
    return json.loads(json.dumps(stream(built).record_reading().stream.read(1000)))


def test_the_new_weights_hold_from_the_resume_point(built):
    settings = {"on_exhausted": "restart", "num_samples": 6000}
    saved = FixedBatchDataLoader(mixture(built, {"stream": 1, "mapping": 1}, **settings), micro_batch_size=4)
    take(saved, 2)
    new_weights = {"stream": 1, "mapping": 3, "indexed": 4}
    restored = FixedBatchDataLoader(mixture(built, new_weights, **settings), micro_batch_size=4)
    restored.load_state_dict(roundtrip(saved.state_dict()), allow_mixture_change=True)
    keys = restored.dataset.stream.read(6000)
    resume_at = keys[0][0]
    assert resume_at >= 8 and [number for number, _ in keys] == list(range(resume_at, 6000))
    names = Counter(payload["source"] for _, payload in keys)
    for name, weight in new_weights.items():
        assert abs(names[name] / len(keys) - weight / 8) < 0.02
    # The draws from the resume point are those of the new mixture from its start (weighted: by sample number).
    fresh = [payload["source"] for _, payload in mixture(built, new_weights, **settings).stream.read(6000)]
    assert [payload["source"] for _, payload in keys] == fresh[resume_at:]


def test_two_dp_ranks_change_a_mixture_mid_epoch_and_together_give_each_record_once(built):
    numbers, got = record_numbers(built), {}

    def rank_loader(weights: dict, dp_rank: int):
        dataset = mixture(built, weights, dp_rank, 2, on_exhausted="reweight", mixture_change="allow")
        return DynamicBatchDataLoader(
            dataset, micro_batch_size=4, dp_rank=dp_rank, dp_world_size=2, drop_last=False, min_buffered_samples=8
        )

    for dp_rank in range(2):
        saved = rank_loader({"stream": 1, "mapping": 1}, dp_rank)
        read_records(saved, numbers, got, 1)  # each rank stops where its own packing has read
        restored = rank_loader({"stream": 2, "mapping": 1, "indexed": 1}, dp_rank)
        restored.load_state_dict(roundtrip(saved.state_dict()))
        read_records(restored, numbers, got)
        assert restored.state_dict()["mixture"]["sources"]["indexed"]["samples"] > 0  # the change came mid-epoch
    assert sorted(got["stream"]) == list(range(40)) and sorted(got["mapping"]) == list(range(60))


def test_interleave_s_new_round_robin_starts_at_the_resume_point(built):
    settings = {"strategy": "interleave", "on_exhausted": "restart", "num_samples": 200}
    saved = FixedBatchDataLoader(mixture(built, {"stream": 1, "mapping": 1}, **settings), micro_batch_size=4)
    take(saved, 1)
    restored = FixedBatchDataLoader(mixture(built, {"stream": 2, "mapping": 1}, **settings), micro_batch_size=4)
    restored.load_state_dict(roundtrip(saved.state_dict()), allow_mixture_change=True)
    names = [payload["source"] for _, payload in restored.dataset.stream.read(30)]
    assert names == ["stream", "mapping", "stream"] * 10


def test_a_state_saved_after_a_change_resumes_exactly_without_the_opt_in(built):
    first = loader_over(built, DynamicBatchDataLoader, {"stream": 1, "stream2": 1})
    take(first, 1)
    state = roundtrip(first.state_dict())

    def make():
        loader = loader_over(built, DynamicBatchDataLoader, {"stream2": 1, "indexed": 1})
        loader.load_state_dict(state, allow_mixture_change=True)
        return loader

    whole = make()
    reference = [plain(batch) for batch in whole]
    stopped = make()
    head = take(stopped, len(reference) // 2)
    restored = loader_over(built, DynamicBatchDataLoader, {"stream2": 1, "indexed": 1})
    restored.load_state_dict(roundtrip(stopped.state_dict()))  # no opt-in: the state is of this mixture
    assert head + [plain(batch) for batch in restored] == reference
    assert "stream" in stopped.state_dict()["mixture"]["plan"]["known"]


# -- refusals -----------------------------------------------------------------------------------------------------


def test_without_the_opt_in_a_changed_mixture_is_refused_naming_each_difference(built):
    saved = loader_over(built, FixedBatchDataLoader, {"stream": 1, "mapping": 1})
    take(saved, 2)
    other = loader_over(built, FixedBatchDataLoader, {"stream": 2, "indexed": 1})
    with pytest.raises(
        ResumeStateError, match=r"indexed is new \(weight 1\); mapping is no longer mixed.*stream had weight 1, has 2"
    ):
        other.load_state_dict(saved.state_dict())


def test_a_changed_source_or_setting_is_refused_even_with_the_opt_in(built, online_paths, tokenizer):
    saved = loader_over(built, FixedBatchDataLoader, {"stream": 1, "mapping": 1})
    take(saved, 2)
    state = saved.state_dict()
    other_data = build_online_text_dataset(
        online_paths[1], TRANSFORM, {"dataset_type": "iterable"}, tokenizer=tokenizer, seed=5
    )
    renamed = build_mixture_dataset(
        [
            {"name": "stream", "weight": 1, "dataset": other_data},
            {"name": "mapping", "weight": 1, "dataset": built["mapping"]},
        ],
        seed=11,
        on_exhausted="reweight",
    )
    with pytest.raises(ResumeStateError, match="the data of stream changed.*give the changed data a new name"):
        FixedBatchDataLoader(renamed, micro_batch_size=4).load_state_dict(state, allow_mixture_change=True)
    for key, value in (("strategy", "interleave"), ("on_exhausted", "stop"), ("seed", 12)):
        settings = {"on_exhausted": "reweight", key: value}
        entries = [{"name": "stream", "weight": 1, "dataset": stream(built)}]
        entries.append({"name": "mapping", "weight": 1, "dataset": built["mapping"]})
        dataset = build_mixture_dataset(entries, **{"seed": 11, **settings})
        with pytest.raises(ResumeStateError, match=f"saved over a mixture with {key} .*resume with {key}"):
            FixedBatchDataLoader(dataset, micro_batch_size=4).load_state_dict(state, allow_mixture_change=True)


def test_a_source_added_back_with_other_data_is_refused(built):
    first = loader_over(built, FixedBatchDataLoader, {"stream": 1, "stream2": 1})
    take(first, 1)
    second = loader_over(built, FixedBatchDataLoader, {"stream2": 1, "indexed": 1})
    second.load_state_dict(roundtrip(first.state_dict()), allow_mixture_change=True)
    take(second, 1)
    entries = [{"name": "stream", "weight": 1, "dataset": stream(built, path=1)}]  # another file, the same name
    entries += [{"name": "stream2", "weight": 1, "dataset": stream(built, path=1)}]
    readded = FixedBatchDataLoader(build_mixture_dataset(entries, seed=11, on_exhausted="reweight"), micro_batch_size=4)
    with pytest.raises(ResumeStateError, match="the data of stream changed"):
        readded.load_state_dict(second.state_dict(), allow_mixture_change=True)


def test_a_change_between_a_mixture_read_in_order_and_a_planned_one_is_refused(built):
    saved = loader_over(built, FixedBatchDataLoader, {"stream": 1, "mapping": 1})
    take(saved, 1)
    planned = loader_over(built, FixedBatchDataLoader, {"mapping": 1, "indexed": 1})
    with pytest.raises(ResumeStateError, match="saved over a mixture read in order .* this one is planned"):
        planned.load_state_dict(saved.state_dict(), allow_mixture_change=True)
    take(planned, 1)
    with pytest.raises(ResumeStateError, match="saved over a mixture planned .* this one is read in order"):
        saved.load_state_dict(planned.state_dict(), allow_mixture_change=True)


def test_a_changed_mixture_s_damaged_cursor_is_refused_and_changes_nothing(built):
    saved = loader_over(built, FixedBatchDataLoader, {"stream": 1, "mapping": 1})
    take(saved, 1)
    state = roundtrip(saved.state_dict())
    state["source"]["position"]["sources"]["stream"]["taken"] = -1
    refusing = loader_over(built, FixedBatchDataLoader, {"stream": 2, "indexed": 1})
    with pytest.raises(ResumeStateError, match=r"\['sources'\]\['stream'\]\['taken'\] .* out of range"):
        refusing.load_state_dict(state, allow_mixture_change=True)
    fresh = loader_over(built, FixedBatchDataLoader, {"stream": 2, "indexed": 1})
    assert [plain(batch) for batch in refusing] == [plain(batch) for batch in fresh]
    assert refusing.state_dict() == fresh.state_dict()


def test_a_cursor_of_other_sources_is_refused_naming_them(built):
    saved = FixedBatchDataLoader(mixture(built, {"stream": 1, "mapping": 1}), micro_batch_size=2)
    take(saved, 1)
    cursor = roundtrip(saved.state_dict())["source"]["position"]
    cursor["sources"]["other"] = cursor["sources"].pop("mapping")
    with pytest.raises(ResumeStateError, match=r"holds the sources \['other', 'stream'\]"):
        saved._source.check_position(cursor)


def test_epochs_of_a_stream_are_refused_with_the_fix(built):
    with pytest.raises(DataConfigError, match="streaming .* sets epochs 2.*max_samples"):
        mixture(built, {"stream": 1, "mapping": 1}, stream={"epochs": 2})


def test_restart_without_num_samples_is_refused(built):
    with pytest.raises(DataConfigError, match="no end.*num_samples"):
        mixture(built, {"stream": 1, "mapping": 1}, on_exhausted="restart")


def pipeline_config(online_paths, cache) -> dict:
    """A pipeline whose dataset node mixes a streaming and a mapping source, each with its own transform."""
    return {
        "dataset": {
            "_target_": "hyper_parallel.data.mixture.build_mixture.build_mixture_dataset",
            "sources": [
                {
                    "name": name,
                    "weight": 1,
                    "dataset": {
                        "_target_": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
                        "data_path": str(path),
                        "data_transform": TRANSFORM,
                        "data_config": {"dataset_type": kind, "cache_dir": str(cache)},
                    },
                }
                for name, path, kind in (
                    ("stream", online_paths[0], "iterable"),
                    ("mapping", online_paths[1], "mapping"),
                )
            ],
        },
        "dataloader": {"_target_": "hyper_parallel.data.batching.FixedBatchDataLoader"},
    }


def test_the_pipeline_builds_a_stream_mixture_under_the_packing_scheduler(built, online_paths, tmp_path):
    config = pipeline_config(online_paths, tmp_path)
    config["dataset"]["on_exhausted"] = "reweight"
    config["dataloader"] = {"_target_": "hyper_parallel.data.batching.DynamicBatchDataLoader"}
    config["packing_scheduler"] = {
        "_target_": "hyper_parallel.data.parallel.data_schedule_utils.PackingSchedulerConfig",
        "max_seqlen_per_dp_cp_rank": 256,
        "scheduler": "dynamic_cp",
    }
    loaders = build_dataloaders(config, tokenizer=built["tokenizer"], micro_batch_size=2, seed=3)
    assert loaders.packing_scheduler is not None
    delivered = Counter(sequence for batch in loaders.train for sequence in sequences(batch))
    expected = source_tokens(built)
    assert delivered == expected["stream"] + expected["mapping"]
