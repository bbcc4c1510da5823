"""Changing a mixture mid-run: a state saved over other weights or sources continues with the opt-in, every source
from its own position (no sample of it repeats or is skipped), the new weights from the resume point, an added
source from its beginning, a removed one kept for when it is added back; refused without the opt-in."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from batching.conftest import write_jsonl
from batching.resume_check import plain, roundtrip

from hyper_parallel.data.batching import DynamicBatchDataLoader, FixedBatchDataLoader
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import ResumeStateError
from hyper_parallel.data.mixture import build_mixture_dataset
from hyper_parallel.data.text.build_dataset import build_online_text_dataset

SIZES = {"first": 40, "second": 60, "third": 60}


@pytest.fixture(scope="module")
def sources(online_paths, novel_paragraphs, tokenizer, tmp_path_factory) -> dict:
    """Three Online mapping datasets of 40, 60 and 60 short paragraphs, every record one window."""
    cache = tmp_path_factory.mktemp("hf_cache")
    third = write_jsonl(
        tmp_path_factory.mktemp("third") / "third.jsonl", [{"text": text[:300]} for text in novel_paragraphs[100:160]]
    )

    def online(path):
        transform = {"data_type": "plaintext", "text_keys": "text", "max_seq_len": 256}
        return build_online_text_dataset(path, transform, {"cache_dir": str(cache)}, tokenizer=tokenizer)

    return {"first": online(online_paths[0]), "second": online(online_paths[1]), "third": online(third)}


@pytest.fixture(scope="module")
def records_by_tokens(sources) -> dict[tuple, tuple[str, int]]:
    """Each record's tokens -> (source, record): what tells a delivered sequence's source and record."""
    found = {}
    for name, dataset in sources.items():
        for record in range(len(dataset)):
            (sample,) = dataset[record]
            found[tuple(np.asarray(sample["input_ids"]).tolist())] = (name, record)
    assert len(found) == sum(SIZES.values())  # every record tells itself apart
    return found


def mixture(sources, weights: dict, **settings):
    """A mixture reading every source in record order, so a source's own order is records 0, 1, 2, ..."""
    entries = [{"name": name, "weight": weight, "dataset": sources[name]} for name, weight in weights.items()]
    settings = {"on_exhausted": "reweight", "shuffle": False, "seed": 7, **settings}
    return build_mixture_dataset(entries, **settings)


def delivered(batch, records_by_tokens, into: dict) -> None:
    """Append each sequence's record to its source's list; the collator's padding sequence is no record."""
    for ids, labels in batch.sequences():
        key = tuple(ids.tolist())
        if key in records_by_tokens:
            name, record = records_by_tokens[key]
            into.setdefault(name, []).append(record)
        else:
            assert (labels == IGNORE_INDEX).all(), "a delivered sequence is no record of any source"


def read(loader, records_by_tokens, into: dict, batches: int | None = None) -> int:
    """Read ``batches`` batches (None: to the end of the epoch); returns how many were read."""
    count = 0
    for batch in loader:
        delivered(batch, records_by_tokens, into)
        count += 1
        if count == batches:
            break
    return count


def make(loader_class, dataset, workers: int = 0):
    """A loader of micro-batches of 4; the dynamic one packs from a buffer of 16, a tenth of the mixture."""
    extra = {"min_buffered_samples": 16} if loader_class is DynamicBatchDataLoader else {}
    return loader_class(dataset, micro_batch_size=4, num_workers=workers, **extra)


def assert_own_order_prefix(records: list[int], loader_class) -> None:
    """A source's records as its own order gives them: 0, 1, 2, ... with no repeat and no gap (packed batches
    reorder samples, so the dynamic loader's are compared as a set)."""
    if loader_class is FixedBatchDataLoader:
        assert records == list(range(len(records)))
    else:
        assert sorted(records) == list(range(len(records)))


CHANGES = {
    "weights": ({"first": 0.5, "second": 0.5}, {"first": 0.2, "second": 0.8}),
    "add": ({"first": 0.5, "second": 0.5}, {"first": 0.4, "second": 0.3, "third": 0.3}),
    "remove": ({"first": 0.3, "second": 0.3, "third": 0.4}, {"first": 0.5, "third": 0.5}),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("loader_class", [FixedBatchDataLoader, DynamicBatchDataLoader])
def test_a_changed_mixture_continues_every_source_from_its_own_position(
    sources, records_by_tokens, loader_class, workers, change, caplog
):
    before, after = CHANGES[change]
    got: dict[str, list[int]] = {}
    first_loader = make(loader_class, mixture(sources, before), workers)
    # about a third of the mixture: a dynamic micro-batch packs some 18 of these short records
    read(first_loader, records_by_tokens, got, batches=12 if loader_class is FixedBatchDataLoader else 2)
    at_change = {name: len(records) for name, records in got.items()}
    state = roundtrip(first_loader.state_dict())

    changed = mixture(sources, after)
    loader = make(loader_class, changed, workers)
    with caplog.at_level(logging.WARNING, logger="hyper_parallel.data"):
        loader.load_state_dict(state, allow_mixture_change=True)
    after_change = read(loader, records_by_tokens, got)
    assert after_change

    for name in after:  # the sources mixed now: every record once, in the source's own order
        assert_own_order_prefix(got[name], loader_class)
    assert "third" not in at_change or change != "add"  # an added source starts at its beginning
    tally = loader.state_dict()["mixture"]["sources"]
    for name, records in got.items():
        assert tally[name]["samples"] == len(records)
    removed = set(before) - set(after)
    for name in removed:  # nothing of it after the change; what it gave before is its order's prefix (the dynamic
        # loader's samples of it still buffered at the change are dropped, and counted)
        assert len(got[name]) == at_change[name]
        assert set(got[name]) <= set(range(len(got[name]) + _dropped(caplog)))
        if loader_class is FixedBatchDataLoader:
            assert got[name] == list(range(at_change[name]))
    if loader_class is FixedBatchDataLoader or not removed:
        assert _dropped(caplog) == 0


def _dropped(caplog) -> int:
    """The samples the dynamic loader said it dropped (of sources no longer mixed)."""
    counts = [
        int(r.getMessage().split(": ")[1].split(" ")[0]) for r in caplog.records if "are dropped" in r.getMessage()
    ]
    return sum(counts)


def test_a_removed_source_s_buffered_samples_are_dropped_with_their_count(sources, records_by_tokens, caplog):
    before, after = CHANGES["remove"]
    got: dict[str, list[int]] = {}
    saved = DynamicBatchDataLoader(mixture(sources, before), micro_batch_size=4, min_buffered_samples=40)
    read(saved, records_by_tokens, got, batches=1)
    state = roundtrip(saved.state_dict())
    second = saved.dataset.names.index("second")
    buffered = saved.dataset.sources_of([key for key, _ in state["packing"]["buffer"]])
    unread = saved.dataset.sources_of([key for keys in state["source"]["replay"] for key in keys])
    assert (buffered == second).any() and (unread == second).any()  # the case under test: some of each
    of_second = int((buffered == second).sum() + (unread == second).sum())
    loader = DynamicBatchDataLoader(mixture(sources, after), micro_batch_size=4, min_buffered_samples=40)
    with caplog.at_level(logging.WARNING, logger="hyper_parallel.data"):
        loader.load_state_dict(state, allow_mixture_change=True)
    assert _dropped(caplog) == of_second
    assert loader.state_dict()["buffered_samples"] == int((buffered != second).sum())
    read(loader, records_by_tokens, got)
    for name in after:
        assert_own_order_prefix(got[name], DynamicBatchDataLoader)


def test_the_new_weights_hold_from_the_resume_point(sources):
    before, after = {"first": 0.5, "second": 0.5}, {"first": 0.2, "second": 0.3, "third": 0.5}
    settings = {"on_exhausted": "restart", "num_samples": 30_000}
    saved = FixedBatchDataLoader(mixture(sources, before, **settings), micro_batch_size=4)
    for _ in zip(range(250), saved, strict=False):
        pass
    state = roundtrip(saved.state_dict())
    resume_at = 250 * 4
    changed = mixture(sources, after, mixture_change="allow", **settings)
    loader = FixedBatchDataLoader(changed, micro_batch_size=4)
    loader.load_state_dict(state)
    assert len(changed) == 30_000
    # What the loader delivers after the change: 2,000 samples in the new proportions.
    for _ in zip(range(500), loader, strict=False):
        pass
    counts = loader.state_dict()["mixture"]["sources"]
    at_change = state["mixture"]["sources"]
    for name, weight in after.items():
        since = counts[name]["samples"] - at_change.get(name, {"samples": 0})["samples"]
        assert abs(since / 2_000 - weight) < 0.03
    # Before the resume point the samples are those the first mixture planned; after it, the new weights.
    assert changed.sources_of(np.arange(resume_at)).tolist() == saved.dataset.sources_of(np.arange(resume_at)).tolist()
    names = [changed.known_names[source] for source in changed.sources_of(np.arange(resume_at, resume_at + 20_000))]
    for name, weight in after.items():
        assert abs(names.count(name) / 20_000 - weight) < 0.01


def test_a_source_added_then_removed_then_added_back_continues_where_it_was(sources, records_by_tokens):
    phases = [
        {"first": 1, "second": 1},
        {"first": 1, "second": 1, "third": 1},
        {"first": 1, "third": 1},
        {"first": 1, "second": 2, "third": 1},
    ]
    got: dict[str, list[int]] = {}
    state = None
    for number, weights in enumerate(phases):
        loader = FixedBatchDataLoader(mixture(sources, weights, mixture_change="allow"), micro_batch_size=2)
        if state is not None:
            loader.load_state_dict(state)
        read(loader, records_by_tokens, got, batches=None if number == len(phases) - 1 else 8)
        state = roundtrip(loader.state_dict())
        if number == 2:
            second_when_removed = len(got["second"])
    assert len(got["second"]) > second_when_removed  # it was read again once added back...
    for name in SIZES:
        assert got[name] == list(range(len(got[name])))  # ...from where it was, as every source
    assert len(got["second"]) == SIZES["second"]  # reweight: each source gives its whole epoch by the end


def test_a_state_saved_after_a_change_resumes_exactly_without_the_opt_in(sources):
    before, after = CHANGES["add"]
    first = FixedBatchDataLoader(mixture(sources, before), micro_batch_size=4)
    for _ in zip(range(5), first, strict=False):
        pass
    changed = FixedBatchDataLoader(mixture(sources, after), micro_batch_size=4)
    changed.load_state_dict(roundtrip(first.state_dict()), allow_mixture_change=True)
    for _ in zip(range(3), changed, strict=False):
        pass
    state = roundtrip(changed.state_dict())
    rest = [plain(batch) for batch in changed]
    resumed = FixedBatchDataLoader(mixture(sources, after), micro_batch_size=4)  # built anew from the config
    resumed.load_state_dict(state)
    assert [plain(batch) for batch in resumed] == rest


def test_without_the_opt_in_a_changed_mixture_is_refused_naming_sources_and_weights(sources):
    saved = FixedBatchDataLoader(mixture(sources, {"first": 0.5, "second": 0.5}), micro_batch_size=2)
    for _ in zip(range(2), saved, strict=False):
        pass
    other = mixture(sources, {"first": 0.6, "third": 0.4})
    loader = FixedBatchDataLoader(other, micro_batch_size=2)
    length = len(other)
    with pytest.raises(
        ResumeStateError, match=r"third is new.*second is no longer mixed.*first had weight 0.5, has 0.6"
    ):
        loader.load_state_dict(saved.state_dict())
    assert len(other) == length and len(loader) == len(other) // 2  # a refused state changes nothing


def test_a_changed_source_or_an_unordered_sampler_is_refused_even_with_the_opt_in(sources):
    saved = FixedBatchDataLoader(mixture(sources, {"first": 0.5, "second": 0.5}), micro_batch_size=2)
    for _ in zip(range(2), saved, strict=False):
        pass
    state = saved.state_dict()
    swapped = build_mixture_dataset(
        [
            {"name": "first", "weight": 0.5, "dataset": sources["third"]},
            {"name": "second", "weight": 0.2, "dataset": sources["second"]},
        ],
        on_exhausted="reweight",
        shuffle=False,
        seed=7,
    )
    with pytest.raises(ResumeStateError, match="the data of first changed"):
        FixedBatchDataLoader(swapped, micro_batch_size=2).load_state_dict(state, allow_mixture_change=True)
    cyclic = FixedBatchDataLoader(
        mixture(sources, {"first": 0.5, "second": 0.5}), micro_batch_size=2, sampler_type="cyclic"
    )
    for _ in zip(range(2), cyclic, strict=False):
        pass
    other = FixedBatchDataLoader(
        mixture(sources, {"first": 0.2, "second": 0.8}), micro_batch_size=2, sampler_type="cyclic"
    )
    with pytest.raises(ResumeStateError, match="only where the loader reads it in order.*sampler_type single"):
        other.load_state_dict(cyclic.state_dict(), allow_mixture_change=True)


def test_a_damaged_plan_is_refused_naming_the_field(sources):
    saved = FixedBatchDataLoader(mixture(sources, {"first": 0.5, "second": 0.5}), micro_batch_size=2)
    for _ in zip(range(2), saved, strict=False):
        pass
    state = roundtrip(saved.state_dict())
    state["mixture"]["plan"]["segments"][0]["offsets"]["first"] = "3"
    loader = FixedBatchDataLoader(mixture(sources, {"first": 0.5, "second": 0.5}), micro_batch_size=2)
    with pytest.raises(ResumeStateError, match=r"\['segments'\]\[0\]\['offsets'\]\['first'\] must be an? int"):
        loader.load_state_dict(state)


def test_every_dp_rank_continues_the_changed_mixture_and_together_they_give_each_record_once(
    sources, records_by_tokens
):
    before, after = CHANGES["add"]

    def make_rank(dataset, rank):
        return FixedBatchDataLoader(dataset, micro_batch_size=2, global_batch_size=4, dp_rank=rank, dp_world_size=2)

    got: dict[str, list[int]] = {}
    states = []
    for rank in range(2):
        loader = make_rank(mixture(sources, before), rank)
        read(loader, records_by_tokens, got, batches=8)
        states.append(roundtrip(loader.state_dict()))
    for rank in range(2):  # each rank builds its own mixture, as every process does
        loader = make_rank(mixture(sources, after, mixture_change="allow"), rank)
        loader.load_state_dict(states[rank])
        read(loader, records_by_tokens, got)
    for name in after:  # the ranks' shares together: every record of each source once
        assert sorted(got[name]) == list(range(len(got[name])))


def test_a_dynamic_loader_over_several_dp_ranks_without_a_process_group_changes_only_at_an_epoch_start(sources):
    before, after = CHANGES["add"]

    def make_rank(dataset):
        return DynamicBatchDataLoader(dataset, micro_batch_size=2, dp_rank=0, dp_world_size=2, min_buffered_samples=8)

    saved = make_rank(mixture(sources, before))
    for _ in zip(range(2), saved, strict=False):
        pass
    with pytest.raises(ResumeStateError, match="mid-epoch .*torch.distributed is not initialised"):
        make_rank(mixture(sources, after, mixture_change="allow")).load_state_dict(saved.state_dict())
    for _ in saved:  # to the epoch's end: the state is at the next epoch's start
        pass
    restored = make_rank(mixture(sources, after, mixture_change="allow"))
    restored.load_state_dict(saved.state_dict())
    assert len(restored.dataset.plan.segments) == 1 and restored.dataset.plan.segments[0].weights == after


@pytest.mark.parametrize("loader_class", [FixedBatchDataLoader, DynamicBatchDataLoader])
def test_the_epoch_after_a_removal_reads_the_same_mixture_without_the_removed_source_and_counts_it(
    sources, records_by_tokens, loader_class, caplog
):
    before, after = CHANGES["remove"]
    first: dict[str, list[int]] = {}
    saved = make(loader_class, mixture(sources, before))
    read(saved, records_by_tokens, first, batches=12 if loader_class is FixedBatchDataLoader else 2)
    state = roundtrip(saved.state_dict())
    resume_at = state["source"]["position"]["consumed_samples"]
    loader = make(loader_class, mixture(sources, after))
    loader.load_state_dict(state, allow_mixture_change=True)
    read(loader, records_by_tokens, first)  # the rest of the epoch
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hyper_parallel.data"):
        second: dict[str, list[int]] = {}
        read(loader, records_by_tokens, second)  # the next epoch: the samples before the change as first planned
    removed_before = int((saved.dataset.sources_of(np.arange(resume_at)) == saved.dataset.names.index("second")).sum())
    assert _dropped(caplog) == removed_before > 0
    assert "second" not in second
    for name in after:  # every epoch reads the same samples of the sources still mixed
        assert sorted(second[name]) == sorted(first[name])
