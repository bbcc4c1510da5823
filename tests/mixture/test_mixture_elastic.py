"""Elastic resume over a mixture: the states of every DP rank merged and restored at another DP size deliver the
rest of the epoch's mixture samples, each once; the tally goes on from the old ranks' sum; the plan is carried."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from batching.resume_check import roundtrip

from hyper_parallel.data.batching import DynamicBatchDataLoader, FixedBatchDataLoader, merge_rank_states
from hyper_parallel.data.errors import ResumeStateError
from hyper_parallel.data.mixture import build_mixture_dataset
from hyper_parallel.data.text.build_dataset import build_online_text_dataset

from .conftest import take_pairs

WEIGHTS = {"first": 0.4, "second": 0.6}
# More samples than the sources' 100 records: each source restarts its order, so some records are mixed twice.
NUM_SAMPLES = 150


@pytest.fixture(scope="module")
def sources(online_paths, tokenizer, tmp_path_factory) -> dict:
    """Two Online mapping datasets of 40 and 60 short paragraphs, every record one window."""
    cache = tmp_path_factory.mktemp("hf_cache")

    def online(path):
        transform = {"data_type": "plaintext", "text_keys": "text", "max_seq_len": 256}
        return build_online_text_dataset(path, transform, {"cache_dir": str(cache)}, tokenizer=tokenizer)

    return {"first": online(online_paths[0]), "second": online(online_paths[1])}


@pytest.fixture(scope="module")
def records_by_tokens(sources) -> dict[tuple, tuple[str, int]]:
    """Each record's tokens -> (source, record), read from the sources themselves."""
    found = {}
    for name, dataset in sources.items():
        for record in range(len(dataset)):
            (sample,) = dataset[record]
            found[tuple(np.asarray(sample["input_ids"]).tolist())] = (name, record)
    assert len(found) == sum(len(dataset) for dataset in sources.values())  # every record tells itself apart
    return found


def mixture(sources, weights: dict = WEIGHTS, **settings):
    entries = [{"name": name, "weight": weight, "dataset": sources[name]} for name, weight in weights.items()]
    settings = {"on_exhausted": "restart", "num_samples": NUM_SAMPLES, "seed": 3, **settings}
    return build_mixture_dataset(entries, **settings)


def epoch_pairs(sources, records_by_tokens) -> Counter:
    """Every (source, record) pair of one epoch of the mixture, read sample number by sample number."""
    dataset = mixture(sources)
    return Counter(
        records_by_tokens[tuple(np.asarray(sample["input_ids"]).tolist())]
        for number in range(len(dataset))
        for sample in dataset[number]
    )


def make_loaders(
    sources, loader: str, dp_world_size: int, *, workers: int = 0, sampler_type: str = "cyclic", **mixture_settings
) -> list:
    """Every rank's loader of one DP size over its own mixture (as each process builds it), in a cyclic order."""
    options = {
        "micro_batch_size": 2,
        "global_batch_size": 2 * dp_world_size,
        "dp_world_size": dp_world_size,
        "sampler_type": sampler_type,
        "seed": 5,
        "drop_last": False,
        "num_workers": workers,
    }
    if loader == "dynamic":
        return [
            DynamicBatchDataLoader(mixture(sources, **mixture_settings), min_buffered_samples=6, dp_rank=r, **options)
            for r in range(dp_world_size)
        ]
    return [
        FixedBatchDataLoader(mixture(sources, **mixture_settings), dp_rank=r, **options) for r in range(dp_world_size)
    ]


def tallies(loaders) -> tuple[Counter, Counter]:
    """The samples and the tokens of each source the ranks' tallies hold, summed over the ranks."""
    samples, tokens = Counter(), Counter()
    for loader in loaders:
        for name, counts in loader.state_dict()["mixture"]["sources"].items():
            samples[name] += counts["samples"]
            tokens[name] += counts["tokens"]
    return samples, tokens


def resized(sources, loader: str, old, new_size: int, **options) -> tuple[list, dict]:
    """New loaders of ``new_size`` ranks restored from the merged states of ``old``'s ranks, and the merged state."""
    merged = roundtrip(merge_rank_states([roundtrip(rank.state_dict()) for rank in old]))
    new = make_loaders(sources, loader, new_size, **options)
    for rank in new:
        rank.load_state_dict(merged)
    return new, merged


def by_source(pairs: Counter, records_by_tokens) -> tuple[Counter, Counter]:
    """The samples and the tokens of each source of the delivered pairs."""
    tokens_of = {pair: len(key) for key, pair in records_by_tokens.items()}
    samples, tokens = Counter(), Counter()
    for (name, record), count in pairs.items():
        samples[name] += count
        tokens[name] += count * tokens_of[(name, record)]
    return samples, tokens


@pytest.mark.parametrize("new_size", [1, 3])
@pytest.mark.parametrize("loader", ["fixed", "dynamic"])
def test_a_dp_change_and_back_over_a_mixture_delivers_the_epoch_s_samples_once(
    sources, records_by_tokens, loader, new_size
):
    counts = {"fixed": ([3, 5], [4] * new_size), "dynamic": ([2, 3], [1] * new_size)}[loader]
    old = make_loaders(sources, loader, 2)
    before = take_pairs(old, counts[0], records_by_tokens)
    at_merge = tallies(old)
    new, merged = resized(sources, loader, old, new_size)
    assert {name: c["samples"] for name, c in merged["mixture"]["sources"].items()} == dict(at_merge[0])
    assert {name: c["tokens"] for name, c in merged["mixture"]["sources"].items()} == dict(at_merge[1])
    assert tallies(new) == at_merge  # restored, the new ranks' tallies sum to the old ones'
    middle = take_pairs(new, counts[1], records_by_tokens)
    back, _ = resized(sources, loader, new, 2)
    after = take_pairs(back, [None, None], records_by_tokens)

    assert before and middle and after
    delivered = before + middle + after
    assert delivered == epoch_pairs(sources, records_by_tokens)
    # The tally after the changes: what the old ranks counted and what the new ones delivered.
    assert tallies(back) == by_source(delivered, records_by_tokens)


def test_workers_deliver_the_same_after_a_dp_change_over_a_mixture(sources, records_by_tokens):
    runs = []
    for workers in (0, 2):
        old = make_loaders(sources, "fixed", 2, workers=workers)
        before = take_pairs(old, [3, 4], records_by_tokens)  # with workers, the loaders have read ahead of these
        new, _ = resized(sources, "fixed", old, 3, workers=workers)
        after = [take_pairs([rank], [None], records_by_tokens) for rank in new]
        assert before + sum(after, Counter()) == epoch_pairs(sources, records_by_tokens)
        runs.append(after)
    assert runs[0] == runs[1]


def test_the_plan_of_a_changed_mixture_is_carried_to_the_new_dp_size(sources, records_by_tokens):
    changed = {"first": 0.2, "second": 0.8}
    got = Counter()
    old = make_loaders(sources, "fixed", 2, sampler_type="single")
    got += take_pairs(old, [3, 3], records_by_tokens)
    states = [roundtrip(rank.state_dict()) for rank in old]
    two = make_loaders(sources, "fixed", 2, sampler_type="single", weights=changed, mixture_change="allow")
    for rank, state in zip(two, states, strict=True):
        rank.load_state_dict(state)
    got += take_pairs(two, [2, 4], records_by_tokens)
    plan = two[0].state_dict()["mixture"]["plan"]
    assert [segment["weights"] for segment in plan["segments"]] == [WEIGHTS, changed]

    three, merged = resized(
        sources, "fixed", two, 3, sampler_type="single", weights=changed
    )  # the plan is taken without the opt-in
    assert merged["mixture"]["plan"] == plan
    assert all(rank.state_dict()["mixture"]["plan"] == plan for rank in three)
    got += take_pairs(three, [None] * 3, records_by_tokens)
    # Every source continued its own order across the change of weights and of DP size: each of its samples once.
    dataset = three[0].dataset
    expected = Counter()
    for number in range(len(dataset)):
        (source,), (record,) = dataset.locate([number])
        expected[(dataset.names[source], int(record))] += 1
    assert got == expected


def test_an_elastic_state_over_a_mixture_is_refused_when_its_parts_do_not_fit(sources, records_by_tokens):
    old = make_loaders(sources, "fixed", 2)
    take_pairs(old, [2, 2], records_by_tokens)
    states = [roundtrip(rank.state_dict()) for rank in old]

    merged = merge_rank_states(states)
    del merged["mixture"]
    loader = make_loaders(sources, "fixed", 3)[0]
    with pytest.raises(ResumeStateError, match="reads a mixture, but the elastic state has no mixture part"):
        loader.load_state_dict(merged)

    other = [states[0], {**states[1], "mixture": {**states[1]["mixture"], "plan": {"segments": []}}}]
    with pytest.raises(ResumeStateError, match="mixture plan of DP rank 1 differs from DP rank 0's"):
        merge_rank_states(other)
    with pytest.raises(ResumeStateError, match="DP rank 0's loader state has no mixture part"):
        merge_rank_states([{key: value for key, value in states[0].items() if key != "mixture"}, states[1]])

    changed = make_loaders(sources, "fixed", 3, weights={"first": 0.5, "second": 0.5}, mixture_change="allow")[0]
    length = len(changed)
    with pytest.raises(ResumeStateError, match="only where the loader reads it in order.*elastic hand-over"):
        changed.load_state_dict(merge_rank_states(states))
    assert len(changed) == length and len(changed.dataset.plan.segments) == 1  # a refused state changes nothing
