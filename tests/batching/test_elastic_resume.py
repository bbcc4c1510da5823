"""Elastic resume: the states of every DP rank merged and restored at another DP size deliver each record once."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hyper_parallel.data.batching import DynamicBatchDataLoader, FixedBatchDataLoader, merge_rank_states
from hyper_parallel.data.errors import ResumeStateError

from .conftest import paragraphs, write_jsonl
from .resume_check import plain, roundtrip
from .test_build_dataloader import document_tokens, plaintext_dataset

# Fixed batches need one sample per record (a max_seq_len longer than any paragraph); the dynamic loader gets short
# windows, so that long paragraphs give several samples and a record can be half delivered when the state is saved.
MAX_SEQ_LEN = {"fixed": 4096, "dynamic": 48}


def make_loaders(paths, loader: str, dp_world_size: int, *, workers: int = 0, seed: int = 5, dataset=None):
    """Every rank's loader of one DP size, over the 60 plaintext records in a cyclic order, reading every record."""
    dataset = dataset or plaintext_dataset(*paths, dataset_type="mapping", max_seq_len=MAX_SEQ_LEN[loader])
    options = {
        "micro_batch_size": 2,
        "global_batch_size": 2 * dp_world_size,
        "dp_world_size": dp_world_size,
        "sampler_type": "cyclic",
        "seed": seed,
        "drop_last": False,
        "num_workers": workers,
    }
    if loader == "dynamic":
        return [
            DynamicBatchDataLoader(dataset, min_buffered_samples=4, dp_rank=r, **options) for r in range(dp_world_size)
        ]
    return [FixedBatchDataLoader(dataset, dp_rank=r, **options) for r in range(dp_world_size)]


def epoch_sequences(paths, loader: str) -> Counter:
    """Every sample of every record, read straight from the dataset: what one epoch must deliver, each once."""
    dataset = plaintext_dataset(*paths, dataset_type="mapping", max_seq_len=MAX_SEQ_LEN[loader])
    return Counter(tuple(sample["input_ids"].tolist()) for index in range(len(dataset)) for sample in dataset[index])


def take_sequences(loaders, counts) -> Counter:
    """The sequences of the first ``counts[r]`` batches of each rank's loader (fewer where its epoch ends)."""
    found = Counter()
    for loader, count in zip(loaders, counts, strict=True):
        if not count:
            continue
        for taken, batch in enumerate(loader, start=1):
            found.update(document_tokens(batch))
            if taken == count:
                break
    return found


def rest_of_epoch(loaders) -> Counter:
    found = Counter()
    for loader in loaders:
        for batch in loader:
            found.update(document_tokens(batch))
    return found


def restored(old, new):
    """``new``'s loaders, each restored from the merged states of ``old``'s ranks."""
    merged = merge_rank_states([roundtrip(rank.state_dict()) for rank in old])
    merged = roundtrip(merged)  # a merged state is saved and loaded like any other
    for rank in new:
        rank.load_state_dict(merged)
    return new


def resized(paths, loader: str, old, new_size: int, **options):
    """New loaders of ``new_size`` ranks restored from the merged states of ``old``'s ranks."""
    return restored(old, make_loaders(paths, loader, new_size, **options))


def check_dp_change_mid_epoch(build, paths, loader: str, old_size: int, new_size: int, counts) -> None:
    """Loaders from ``build`` stopped after ``counts`` batches and resized deliver the rest of the epoch, then the
    next one exactly as fresh loaders of the new size do."""
    old = build(paths, loader, old_size)
    before = take_sequences(old, counts)
    new = restored(old, build(paths, loader, new_size))
    after = rest_of_epoch(new)
    assert before + after == epoch_sequences(paths, loader)
    assert before and after

    fresh = build(paths, loader, new_size)
    for rank in fresh:
        rank.set_epoch(1)
    assert [[plain(b) for b in rank] for rank in new] == [[plain(b) for b in rank] for rank in fresh]


@pytest.mark.parametrize("new_size", [1, 3, 4])
@pytest.mark.parametrize("loader", ["dynamic", "fixed"])
def test_a_dp_change_mid_epoch_delivers_every_record_once(loader, new_size, plaintext_path, tokenizer, hf_cache_dir):
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    # The ranks stopped at different points, mid-step, with samples buffered.
    check_dp_change_mid_epoch(make_loaders, paths, loader, 2, new_size, [3, 5])


def test_changes_back_and_forth_within_an_epoch_deliver_every_record_once(plaintext_path, tokenizer, hf_cache_dir):
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    two = make_loaders(paths, "dynamic", 2)
    delivered = take_sequences(two, [4, 2])
    three = resized(paths, "dynamic", two, 3)
    delivered += take_sequences(three, [2, 3, 1])
    back = resized(paths, "dynamic", three, 2)
    delivered += rest_of_epoch(back)
    assert delivered == epoch_sequences(paths, "dynamic")


@pytest.mark.parametrize("loader", ["dynamic", "fixed"])
def test_workers_change_nothing_of_an_elastic_resume(loader, plaintext_path, tokenizer, hf_cache_dir):
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    runs = []
    for workers in (0, 2):
        old = make_loaders(paths, loader, 2, workers=workers)
        before = take_sequences(old, [3, 4])  # with workers, the loaders have read ahead of these
        new = resized(paths, loader, old, 3, workers=workers)
        batches = [list(rank) for rank in new]
        after = Counter(seq for rank in batches for batch in rank for seq in document_tokens(batch))
        assert before + after == epoch_sequences(paths, loader)
        runs.append([[plain(batch) for batch in rank] for rank in batches])
    assert runs[0] == runs[1]


def test_the_order_after_a_change_depends_only_on_the_states(plaintext_path, tokenizer, hf_cache_dir):
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    old = make_loaders(paths, "dynamic", 2)
    take_sequences(old, [3, 3])
    states = [roundtrip(rank.state_dict()) for rank in old]
    first, second = make_loaders(paths, "dynamic", 3), make_loaders(paths, "dynamic", 3)
    for rank in first:
        rank.load_state_dict(merge_rank_states(states))
    for rank in second:
        rank.load_state_dict(merge_rank_states(list(reversed(states))))  # the ranks' order in the list is free
    assert [[plain(b) for b in rank] for rank in first] == [[plain(b) for b in rank] for rank in second]


def test_a_restored_rank_resumes_its_own_state_exactly(plaintext_path, tokenizer, hf_cache_dir):
    """After a change, a rank's state is an ordinary state of the new size: it resumes exactly."""
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    old = make_loaders(paths, "dynamic", 2)
    take_sequences(old, [3, 3])
    merged = merge_rank_states([rank.state_dict() for rank in old])
    reference, stopped = make_loaders(paths, "dynamic", 3), make_loaders(paths, "dynamic", 3)
    for rank in (*reference, *stopped):
        rank.load_state_dict(merged)
    expected = [plain(b) for b in reference[1]]
    head = [plain(b) for _, b in zip(range(2), stopped[1], strict=False)]
    again = make_loaders(paths, "dynamic", 3)[1]
    again.load_state_dict(roundtrip(stopped[1].state_dict()))
    assert head + [plain(b) for b in again] == expected


def test_one_ranks_state_on_another_dp_size_names_the_elastic_api(plaintext_path, tokenizer, hf_cache_dir):
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    old = make_loaders(paths, "dynamic", 2)
    take_sequences(old, [3, 3])
    with pytest.raises(ResumeStateError, match="merge_rank_states"):
        make_loaders(paths, "dynamic", 3)[0].load_state_dict(old[0].state_dict())


def test_merging_refuses_states_that_are_not_of_one_run_at_one_step(plaintext_path, tokenizer, hf_cache_dir):
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    old = make_loaders(paths, "dynamic", 2)
    take_sequences(old, [3, 3])
    states = [rank.state_dict() for rank in old]
    with pytest.raises(ResumeStateError, match=r"DP ranks \[1\] are missing"):
        merge_rank_states(states[:1])
    with pytest.raises(ResumeStateError, match="two states of DP rank 0"):
        merge_rank_states([states[0], states[0]])
    reseeded = make_loaders(paths, "dynamic", 2, seed=6)
    take_sequences(reseeded, [3, 3])
    with pytest.raises(ResumeStateError, match="settings of DP rank 0 and DP rank 1 differ .seed 5 and 6"):
        merge_rank_states([states[0], reseeded[1].state_dict()])
    with pytest.raises(ResumeStateError, match="seed"):
        make_loaders(paths, "dynamic", 3, seed=6)[0].load_state_dict(merge_rank_states(states))
    fixed = make_loaders(paths, "fixed", 2)
    with pytest.raises(ResumeStateError, match="differ in 'loader'"):
        merge_rank_states([states[0], fixed[1].state_dict()])

    ahead = make_loaders(paths, "dynamic", 2)
    rest_of_epoch(ahead[1:])
    take_sequences(ahead[1:], [2])  # rank 1 is mid-way through epoch 1
    with pytest.raises(ResumeStateError, match="DP rank 1's state is in epoch 1, past epoch 0"):
        merge_rank_states([states[0], ahead[1].state_dict()])

    other_data = plaintext_dataset(*paths, dataset_type="mapping", max_seq_len=40)
    with pytest.raises(ResumeStateError, match="differ in 'transform'"):
        merge_rank_states([states[0], make_loaders(paths, "dynamic", 2, dataset=other_data)[1].state_dict()])


def test_a_damaged_remaining_bitmap_is_refused(plaintext_path, tokenizer, hf_cache_dir):
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    old = make_loaders(paths, "fixed", 2)
    take_sequences(old, [1, 1])
    merged = merge_rank_states([rank.state_dict() for rank in old])
    merged["sampler"]["remaining"] = merged["sampler"]["remaining"][:-1]
    with pytest.raises(ResumeStateError, match="remaining must be a bitmap of 8 bytes"):
        make_loaders(paths, "fixed", 3)[0].load_state_dict(merged)


# Streams ---------------------------------------------------------------------------------------------------------


def stream_loaders(paths, loader: str, dp_world_size: int, *, workers: int = 0, shuffle_buffer_size: int = 16):
    """Every rank's loader of one DP size over the plaintext records streamed, each rank its share of the stream."""
    ranks = []
    for rank in range(dp_world_size):
        stream = plaintext_dataset(
            *paths,
            dataset_type="iterable",
            max_seq_len=MAX_SEQ_LEN[loader],
            dp_rank=rank,
            dp_world_size=dp_world_size,
            shuffle_buffer_size=shuffle_buffer_size,
        )
        options = {"micro_batch_size": 2, "dp_rank": rank, "dp_world_size": dp_world_size, "drop_last": False}
        if loader == "dynamic":
            ranks.append(DynamicBatchDataLoader(stream, min_buffered_samples=4, num_workers=workers, **options))
        else:
            ranks.append(FixedBatchDataLoader(stream, num_workers=workers, **options))
    return ranks


def stream_resized(paths, loader: str, old, new_size: int, **options):
    return restored(old, stream_loaders(paths, loader, new_size, **options))


@pytest.mark.parametrize(("old_size", "new_size"), [(2, 1), (2, 3), (2, 4), (3, 2)])
@pytest.mark.parametrize("loader", ["dynamic", "fixed"])
def test_a_stream_dp_change_mid_epoch_delivers_every_record_once(
    loader, old_size, new_size, plaintext_path, tokenizer, hf_cache_dir
):
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    # With records in the shuffle buffers and packing buffers.
    check_dp_change_mid_epoch(stream_loaders, paths, loader, old_size, new_size, [3, 5, 1][:old_size])


def test_a_stream_change_with_workers_gives_the_batches_of_one_without(plaintext_path, tokenizer, hf_cache_dir):
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    runs = []
    for workers in (0, 2):
        old = stream_loaders(paths, "dynamic", 2, workers=workers)
        before = take_sequences(old, [2, 4])  # the workers have read ahead of these
        new = stream_resized(paths, "dynamic", old, 3, workers=workers)
        batches = [list(rank) for rank in new]
        after = Counter(seq for rank in batches for batch in rank for seq in document_tokens(batch))
        assert before + after == epoch_sequences(paths, "dynamic")
        runs.append([[plain(batch) for batch in rank] for rank in batches])
    assert runs[0] == runs[1]


def test_a_restored_stream_rank_resumes_its_own_state_exactly(plaintext_path, tokenizer, hf_cache_dir):
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    old = stream_loaders(paths, "dynamic", 2)
    take_sequences(old, [3, 3])
    merged = merge_rank_states([rank.state_dict() for rank in old])
    reference, stopped = stream_loaders(paths, "dynamic", 3), stream_loaders(paths, "dynamic", 3)
    for rank in (*reference, *stopped):
        rank.load_state_dict(merged)
    expected = [plain(b) for b in reference[2]]
    head = [plain(b) for _, b in zip(range(2), stopped[2], strict=False)]
    again = stream_loaders(paths, "dynamic", 3)[2]
    again.load_state_dict(roundtrip(stopped[2].state_dict()))
    assert head + [plain(b) for b in again] == expected


@pytest.mark.parametrize("loader", ["dynamic", "fixed"])
def test_stream_changes_back_and_forth_within_an_epoch_deliver_every_record_once(
    loader, plaintext_path, tokenizer, hf_cache_dir
):
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    two = stream_loaders(paths, loader, 2)
    delivered = take_sequences(two, [4, 2])
    three = stream_resized(paths, loader, two, 3)
    delivered += take_sequences(three, [2, 3, 0]) + rest_of_epoch(three[2:])  # rank 2 read all its part
    four = stream_resized(paths, loader, three, 4)
    delivered += take_sequences(four, [1, 0, 2, 1])
    one = stream_resized(paths, loader, four, 1)
    delivered += rest_of_epoch(one)
    assert delivered == epoch_sequences(paths, loader)


def test_stream_states_are_checked_against_each_other(plaintext_path, tokenizer, hf_cache_dir):
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    old = stream_loaders(paths, "fixed", 2)
    take_sequences(old, [2, 2])
    states = [rank.state_dict() for rank in old]
    with pytest.raises(ResumeStateError, match="merge_rank_states"):
        stream_loaders(paths, "fixed", 3)[0].load_state_dict(states[0])
    with pytest.raises(ResumeStateError, match=r"DP ranks \[1\] are missing"):
        merge_rank_states(states[:1])
    reshuffled = stream_loaders(paths, "fixed", 2, shuffle_buffer_size=8)
    with pytest.raises(ResumeStateError, match="seed or shuffle_buffer_size of DP rank 1"):
        merge_rank_states([states[0], reshuffled[1].state_dict()])
    with pytest.raises(ResumeStateError, match="shuffle_buffer_size=16 but this run has 8"):
        stream_loaders(paths, "fixed", 3, shuffle_buffer_size=8)[0].load_state_dict(merge_rank_states(states))
    with pytest.raises(ResumeStateError, match="source of kind 'iterable'"):
        make_loaders(paths, "fixed", 3)[0].load_state_dict(merge_rank_states(states))


def test_a_stream_split_by_whole_files_changes_dp_size_too(tmp_path, tokenizer, hf_cache_dir):
    """Two files over two ranks: each old rank streams a whole file; the new ranks read the rest of both."""
    texts = paragraphs(50)
    files = [write_jsonl(tmp_path / f"part{i}.jsonl", [{"text": t} for t in texts[i::2]]) for i in range(2)]
    paths = ([str(f) for f in files], tokenizer, hf_cache_dir)
    old = stream_loaders(paths, "fixed", 2)
    before = take_sequences(old, [4, 2])
    new = stream_resized(paths, "fixed", old, 3)
    after = rest_of_epoch(new)
    whole = plaintext_dataset(*paths, dataset_type="mapping", max_seq_len=4096)
    assert before + after == Counter(tuple(whole[i][0]["input_ids"].tolist()) for i in range(len(whole)))


def test_drop_last_keeps_the_saved_epoch_when_the_global_batch_size_changes(plaintext_path, tokenizer, hf_cache_dir):
    """With drop_last the epoch is the whole global batches of the saved run (56 of the 60 records for 8): the new
    ranks (global batch 6) deliver the rest of those, and the next epoch is cut by the new global batch size."""
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    dataset = plaintext_dataset(*paths, dataset_type="mapping", max_seq_len=4096)

    def loaders(size: int, global_batch_size: int):
        options = {"micro_batch_size": 2, "global_batch_size": global_batch_size, "sampler_type": "cyclic", "seed": 5}
        return [FixedBatchDataLoader(dataset, dp_rank=r, dp_world_size=size, **options) for r in range(size)]

    old = loaders(2, 8)
    before = take_sequences(old, [3, 5])
    merged = merge_rank_states([rank.state_dict() for rank in old])
    new = loaders(3, 6)
    for rank in new:
        rank.load_state_dict(merged)
    after = rest_of_epoch(new)
    epoch = np.random.default_rng([5, 0]).permutation(60)[:56]  # the cyclic order of epoch 0, whole steps of 8
    assert before + after == Counter(tuple(dataset[int(i)][0]["input_ids"].tolist()) for i in epoch)
    assert sum(len(rank) for rank in new) == 60 // 2  # epoch 1: every record (10 whole steps of 6), by twos


@pytest.mark.parametrize("loader", ["dynamic", "fixed"])
def test_new_ranks_left_without_records_end_the_epoch_quietly(loader, plaintext_path, tokenizer, hf_cache_dir):
    """Near the end of an epoch some new ranks get nothing of it: they deliver nothing, and no error is raised."""
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    old = make_loaders(paths, loader, 2)
    epoch = [len(list(rank)) for rank in make_loaders(paths, loader, 2)]
    before = take_sequences(old, [epoch[0], epoch[1] - 1])  # one batch of rank 1 left
    new = resized(paths, loader, old, 4)
    after = [[document_tokens(batch) for batch in rank] for rank in new]
    assert before + Counter(s for rank in after for batch in rank for s in batch) == epoch_sequences(paths, loader)
    assert any(not rank for rank in after)
