"""FixedBatchDataLoader and DynamicBatchDataLoader over real Online sources: batches, workers and exact resume."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch

from hyper_parallel.data.batching import (
    DynamicBatchDataLoader,
    FixedBatchDataLoader,
    PackingPolicy,
    TextTokenBatcher,
    build_online_text_collate_fn,
    calculate_num_micro_batches,
)
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError, ResumeStateError
from hyper_parallel.data.parallel.delivery_layout import DeliveryLayout
from hyper_parallel.data.text.build_dataset import build_online_text_dataset

from .resume_check import check_exact_resume, plain, roundtrip, take

LOADERS = {"fixed": FixedBatchDataLoader, "dynamic": DynamicBatchDataLoader}


def plaintext_dataset(path, tokenizer, cache_dir, *, dataset_type, max_seq_len, dp_rank=0, dp_world_size=1, **config):
    return build_online_text_dataset(
        path,
        {"data_type": "plaintext", "max_seq_len": max_seq_len},
        {"dataset_type": dataset_type, "cache_dir": str(cache_dir), "shuffle_buffer_size": 16, **config},
        tokenizer=tokenizer,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
    )


def make_factory(loader, dataset_type, workers, plaintext_path, tokenizer, hf_cache_dir, **options):
    # Fixed batches need one sample per record: a max_seq_len longer than any paragraph. The dynamic loader gets
    # short windows so that long paragraphs give several samples.
    max_seq_len = 4096 if loader == "fixed" else 48

    def make():
        dataset = plaintext_dataset(
            plaintext_path, tokenizer, hf_cache_dir, dataset_type=dataset_type, max_seq_len=max_seq_len
        )
        extra = {"min_buffered_samples": 6} if loader == "dynamic" else {}
        return LOADERS[loader](dataset, micro_batch_size=3, num_workers=workers, **extra, **options)

    return make


def document_tokens(batch) -> list[tuple[int, ...]]:
    """The (input_ids) of each real sequence in a packed batch."""
    ids, bounds = batch["input_ids"][0].tolist(), batch["cu_seq_lens"].tolist()
    return [tuple(ids[start:end]) for start, end in zip(bounds[:-1], bounds[1:], strict=True)]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dataset_type", ["mapping", "iterable"])
@pytest.mark.parametrize("loader", ["fixed", "dynamic"])
def test_resume_is_exact_for_every_source_loader_and_worker_count(
    loader, dataset_type, workers, plaintext_path, tokenizer, hf_cache_dir
):
    make = make_factory(loader, dataset_type, workers, plaintext_path, tokenizer, hf_cache_dir)
    reference = check_exact_resume(make, stop_points=[1, 4, 9, -2, -1])
    assert len(reference) > 9


@pytest.mark.parametrize("dataset_type", ["mapping", "iterable"])
@pytest.mark.parametrize("loader", ["fixed", "dynamic"])
def test_batches_do_not_depend_on_the_worker_count(loader, dataset_type, plaintext_path, tokenizer, hf_cache_dir):
    runs = [
        [plain(b) for b in make_factory(loader, dataset_type, w, plaintext_path, tokenizer, hf_cache_dir)()]
        for w in (0, 1, 2)
    ]
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("dataset_type", ["mapping", "iterable"])
def test_dynamic_batches_hold_every_window_once_within_the_budget(
    dataset_type, plaintext_path, tokenizer, hf_cache_dir
):
    dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="mapping", max_seq_len=48)
    expected = Counter(
        tuple(sample["input_ids"].tolist()) for index in range(len(dataset)) for sample in dataset[index]
    )
    loader = make_factory("dynamic", dataset_type, 0, plaintext_path, tokenizer, hf_cache_dir, drop_last=False)()
    delivered = Counter()
    for batch in loader:
        sequences = document_tokens(batch)
        real = batch["cu_seq_lens"][-1].item()
        assert real == batch["input_ids"].shape[1]  # alignment 1: no padding sequence
        assert real <= loader.token_budget or len(sequences) == 1
        delivered.update(sequences)
    assert delivered == expected


def test_an_over_long_sample_is_alone_and_never_cut(tmp_path, tokenizer, hf_cache_dir):
    long_text = " ".join(["plenty of words"] * 200)
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["short one", long_text, "another short"]) + "\n")
    dataset = build_online_text_dataset(
        path,
        {"data_type": "plaintext", "max_seq_len": 1000},
        {"dataset_type": "mapping", "cache_dir": str(hf_cache_dir)},
        tokenizer=tokenizer,
    )
    lengths = [len(dataset[i][0]["input_ids"]) for i in range(3)]
    loader = DynamicBatchDataLoader(dataset, micro_batch_size=1, max_seq_len=32, min_buffered_samples=1)
    batches = [document_tokens(b) for b in loader]
    assert sorted(len(seq) for batch in batches for seq in batch) == sorted(lengths)
    (alone,) = [batch for batch in batches if any(len(seq) > 32 for seq in batch)]
    assert len(alone) == 1 and len(alone[0]) == max(lengths)


class KeysAsSaved:
    """A sample codec for driving a policy by hand: a sample is saved as its key and its length."""

    def encode_samples(self, entries):
        return [[key, len(sample["input_ids"])] for key, sample in entries]

    def decode_samples(self, saved, where):
        return [(key, {"input_ids": np.zeros(length)}) for key, length in saved]


def drive(policy: PackingPolicy, lengths: dict[int, int]) -> None:
    for key, length in lengths.items():
        policy.put(key, {"input_ids": np.zeros(length)})


def keys(entries) -> list:
    return [key for key, _ in entries]


def test_text_token_batcher_takes_what_fits_in_arrival_order():
    batcher = TextTokenBatcher(token_budget=10, min_buffered_samples=3)
    assert isinstance(batcher, PackingPolicy)
    drive(batcher, {0: 6, 1: 5, 2: 3, 3: 1, 4: 9})
    assert batcher.ready() and batcher.cost({"input_ids": np.zeros(6)}) == 6
    assert keys(batcher.pop()) == [0, 2, 3]  # 6 + 3 + 1 = 10; 5 waits
    assert len(batcher) == 2 and not batcher.ready()  # fewer than 3 samples
    saved = batcher.state_dict(KeysAsSaved())
    assert keys(batcher.pop()) == [1]
    batcher.put(5, {"input_ids": np.zeros(25)})
    assert keys(batcher.pop()) == [4]
    assert keys(batcher.pop()) == [5]  # longer than the budget: alone
    assert len(batcher) == 0
    restored = TextTokenBatcher(token_budget=10, min_buffered_samples=3)
    restored.load_state_dict(saved, KeysAsSaved())
    assert len(restored) == 2 and keys(restored.pop()) == [1] and keys(restored.pop()) == [4]
    with pytest.raises(DataFileError, match="no tokens"):
        batcher.put(6, {"input_ids": np.zeros(0)})
    with pytest.raises(DataConfigError, match="token_budget"):
        TextTokenBatcher(token_budget=0, min_buffered_samples=1)
    with pytest.raises(ResumeStateError, match="saved with min_buffered_samples=3 but this loader has 4"):
        TextTokenBatcher(token_budget=10, min_buffered_samples=4).load_state_dict(saved, KeysAsSaved())


class PaddedTokenBudget:
    """A second packing policy: each sequence is padded to a multiple of ``multiple`` tokens (as a kernel or a CP
    split may need), and the padded lengths are what the budget is charged. One pass in arrival order, as soon as
    a budget's worth is buffered; its state keeps the buffer as the key source encodes it."""

    def __init__(self, token_budget: int, multiple: int) -> None:
        self.token_budget, self.multiple = token_budget, multiple
        self.entries: list = []

    def cost(self, sample) -> int:
        return -(-len(sample["input_ids"]) // self.multiple) * self.multiple

    def put(self, key, sample) -> None:
        self.entries.append((key, sample))

    def ready(self) -> bool:
        return sum(self.cost(sample) for _, sample in self.entries) >= self.token_budget

    def pop(self) -> list:
        taken, used = [], 0
        while self.entries and (not taken or used + self.cost(self.entries[0][1]) <= self.token_budget):
            used += self.cost(self.entries[0][1])
            taken.append(self.entries.pop(0))
        return taken

    def __len__(self) -> int:
        return len(self.entries)

    def state_dict(self, codec) -> dict:
        return {"padded_to": self.multiple, "samples": codec.encode_samples(self.entries)}

    def load_state_dict(self, state, codec) -> None:
        self.entries = codec.decode_samples(state["samples"], "the padded policy's samples")


@pytest.mark.parametrize("dataset_type", ["mapping", "iterable"])
def test_another_packing_policy_plugs_into_the_dynamic_loader(dataset_type, plaintext_path, tokenizer, hf_cache_dir):
    def make():
        dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type=dataset_type, max_seq_len=48)
        policy = PaddedTokenBudget(token_budget=96, multiple=16)
        return DynamicBatchDataLoader(dataset, micro_batch_size=2, num_workers=2, packing_policy=policy)

    check_exact_resume(make, stop_points=[1, 6, -1])
    batches = [document_tokens(batch) for batch in make()]
    padded = [sum(-(-len(sequence) // 16) * 16 for sequence in batch) for batch in batches]
    assert max(padded) <= 96  # charged padded: the sequences are at most 48 tokens, so none is alone
    everything = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="mapping", max_seq_len=48)
    expected = Counter(tuple(s["input_ids"].tolist()) for i in range(len(everything)) for s in everything[i])
    assert Counter(sequence for batch in batches for sequence in batch) == expected
    with pytest.raises(DataConfigError, match="set the budget and the buffer on the policy"):
        DynamicBatchDataLoader(everything, min_buffered_samples=4, packing_policy=PaddedTokenBudget(96, 16))
    with pytest.raises(DataConfigError, match="is not a PackingPolicy: it has no token_budget, cost"):
        DynamicBatchDataLoader(everything, packing_policy=object())


@pytest.mark.parametrize("dataset_type", ["mapping", "iterable"])
def test_the_default_policy_charges_the_padding_of_every_sequence(
    dataset_type, plaintext_path, tokenizer, hf_cache_dir
):
    """With the zigzag_thd layout every sequence is padded to 2 * cp; the default policy, given the layout, charges
    the padded lengths, so a packed row stays within the budget, and the state records the multiple and resumes
    exactly."""
    layout = DeliveryLayout(cp_size=2, cp_layout="zigzag_thd")
    collate_fn = build_online_text_collate_fn(cp_size=2, cp_layout="zigzag_thd")

    def make():
        dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type=dataset_type, max_seq_len=46)
        return DynamicBatchDataLoader(dataset, collate_fn, micro_batch_size=2, min_buffered_samples=4, layout=layout)

    loader = make()
    assert loader.policy.sequence_multiple == 4 and loader.token_budget == 92
    rows = [batch.input_ids.shape[1] for batch in loader]
    assert max(rows) <= 92 and sum(rows) > 92  # 46-token windows padded to 48: two fit only if charged padded
    check_exact_resume(make, stop_points=[2, -1])
    other = DynamicBatchDataLoader(
        plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type=dataset_type, max_seq_len=46),
        micro_batch_size=2,
        min_buffered_samples=4,
    )
    state = loader.state_dict()
    with pytest.raises(ResumeStateError, match="saved with sequence_multiple=4 but this loader has 1"):
        other.load_state_dict(state)


def test_packing_masks_nothing_but_the_first_label_of_each_window(plaintext_path, tokenizer, hf_cache_dir):
    loader = make_factory("fixed", "mapping", 0, plaintext_path, tokenizer, hf_cache_dir)()
    batch = next(iter(loader))
    ids, labels, bounds = batch["input_ids"][0], batch["labels"][0], batch["cu_seq_lens"]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        # shifted in the transform: labels[i] == input_ids[i + 1] inside a document, EOS at its end
        assert torch.equal(labels[start : end - 1], ids[start + 1 : end])
        assert labels[end - 1].item() == tokenizer.eos_token_id
    assert (labels != IGNORE_INDEX).all()


def test_the_fixed_loader_refuses_records_that_give_several_samples(plaintext_path, tokenizer, hf_cache_dir):
    dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="mapping", max_seq_len=8)
    with pytest.raises(DataFileError, match=r"record \d+ of .*train.jsonl.*DynamicBatchDataLoader"):
        list(FixedBatchDataLoader(dataset, micro_batch_size=2))


@pytest.mark.parametrize("dp_world_size", [2, 3])
def test_iterable_dp_shards_are_disjoint_and_cover_the_data(dp_world_size, plaintext_path, tokenizer, hf_cache_dir):
    def records(rank):
        dataset = plaintext_dataset(
            plaintext_path,
            tokenizer,
            hf_cache_dir,
            dataset_type="iterable",
            max_seq_len=4096,
            dp_rank=rank,
            dp_world_size=dp_world_size,
        )
        return [tuple(sample["input_ids"].tolist()) for sample in dataset]

    shards = [records(rank) for rank in range(dp_world_size)]
    everything = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="mapping", max_seq_len=4096)
    expected = Counter(tuple(everything[i][0]["input_ids"].tolist()) for i in range(len(everything)))
    assert Counter(s for shard in shards for s in shard) == expected
    assert all(abs(len(shard) - len(shards[0])) <= 1 for shard in shards)


def test_the_shuffle_buffer_is_seeded_and_changes_with_the_epoch(plaintext_path, tokenizer, hf_cache_dir):
    def epochs(seed):
        dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="iterable", max_seq_len=4096)
        dataset.stream.seed = seed
        dataset.stream.set_epoch(1)
        dataset.stream.set_epoch(0)  # restart so the new seed takes effect
        return [[tuple(s["input_ids"][:4].tolist()) for s in dataset] for _ in range(2)]

    first, again, other = epochs(1), epochs(1), epochs(2)
    assert first == again
    assert first[0] != first[1] and sorted(first[0]) == sorted(first[1])
    assert first[0] != other[0]


def test_fixed_mapping_resume_with_another_dp_size_gives_the_same_global_batches(
    plaintext_path, tokenizer, hf_cache_dir
):
    global_batch_size = 8

    def loaders(dp_world_size, micro_batch_size):
        dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="mapping", max_seq_len=4096)
        return [
            FixedBatchDataLoader(
                dataset,
                micro_batch_size=micro_batch_size,
                global_batch_size=global_batch_size,
                dp_rank=rank,
                dp_world_size=dp_world_size,
                sampler_type="cyclic",
            )
            for rank in range(dp_world_size)
        ]

    def steps(ranks, count=None):
        """Each optimizer step as the multiset of its sequences over all ranks and micro-batches."""
        micro = global_batch_size // (ranks[0].micro_batch_size * len(ranks))
        iterators = [iter(loader) for loader in ranks]
        found = []
        while count is None or len(found) < count:
            step = Counter()
            try:
                for _ in range(micro):
                    for iterator in iterators:
                        step.update(document_tokens(next(iterator)))
            except StopIteration:
                return found
            found.append(step)
        return found

    reference = steps(loaders(2, 2))
    assert len(reference) == 60 // global_batch_size
    before = loaders(2, 2)
    head = steps(before, count=3)
    state = roundtrip(before[1].state_dict())
    for dp_world_size, micro_batch_size in [(4, 2), (1, 4), (8, 1)]:
        after = loaders(dp_world_size, micro_batch_size)
        for loader in after:
            loader.load_state_dict(state)
        assert head + steps(after) == reference


def test_mid_step_dp_change_is_refused_with_the_reason(plaintext_path, tokenizer, hf_cache_dir):
    dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="mapping", max_seq_len=4096)
    loader = FixedBatchDataLoader(dataset, micro_batch_size=2, global_batch_size=8, dp_world_size=2)
    take(loader, 1)  # half of an optimizer step
    state = loader.state_dict()
    other = FixedBatchDataLoader(dataset, micro_batch_size=2, global_batch_size=8, dp_world_size=4)
    with pytest.raises(ResumeStateError, match="global batch|step"):
        other.load_state_dict(state)


def dp_dynamic_loader(paths, dataset_type: str, dp_rank: int, dp_world_size: int) -> DynamicBatchDataLoader:
    """A dynamic loader of rank ``dp_rank`` of ``dp_world_size`` (global batch 4) over ``paths``' plaintext data."""
    dataset = plaintext_dataset(
        *paths, dataset_type=dataset_type, max_seq_len=48, dp_rank=dp_rank, dp_world_size=dp_world_size
    )
    layout = {"micro_batch_size": 2, "global_batch_size": 4, "dp_rank": dp_rank, "dp_world_size": dp_world_size}
    return DynamicBatchDataLoader(dataset, min_buffered_samples=4, **layout)


@pytest.mark.parametrize("dataset_type", ["mapping", "iterable"])
def test_dynamic_resume_with_another_dp_size_is_refused_mid_epoch(
    dataset_type, plaintext_path, tokenizer, hf_cache_dir
):
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    source = dp_dynamic_loader(paths, dataset_type, 0, 2)
    take(source, 3)
    with pytest.raises(ResumeStateError, match="DP|dp_world_size"):
        dp_dynamic_loader(paths, dataset_type, 0, 1).load_state_dict(source.state_dict())


def test_dynamic_resume_with_another_dp_size_at_an_epoch_boundary(plaintext_path, tokenizer, hf_cache_dir):
    """A state saved after the last batch of an epoch (nothing buffered) resumes with another DP size: the epoch
    ends, and the next one is read with the new layout. Mid-epoch, or on another rank of the same size, it is
    refused."""
    paths = (plaintext_path, tokenizer, hf_cache_dir)
    saved = dp_dynamic_loader(paths, "mapping", 1, 2)
    epoch = len(list(dp_dynamic_loader(paths, "mapping", 1, 2)))
    take(saved, epoch)  # stopped right after the last batch of epoch 0
    state = roundtrip(saved.state_dict())
    resumed = dp_dynamic_loader(paths, "mapping", 0, 1)
    resumed.load_state_dict(state)
    assert list(resumed) == []  # the rest of epoch 0
    fresh = dp_dynamic_loader(paths, "mapping", 0, 1)
    fresh.set_epoch(1)
    assert [plain(b) for b in resumed] == [plain(b) for b in fresh]

    take(saved, 2)
    with pytest.raises(ResumeStateError, match="state belongs to DP rank 1 but this loader is rank 0"):
        dp_dynamic_loader(paths, "mapping", 0, 2).load_state_dict(saved.state_dict())
    stream = dp_dynamic_loader(paths, "iterable", 1, 2)
    take(stream, 2)
    with pytest.raises(ResumeStateError, match="saved by DP rank 1 of 2, but this loader is rank 0 of 2"):
        dp_dynamic_loader(paths, "iterable", 0, 2).load_state_dict(stream.state_dict())


def test_an_abandoned_iteration_continues_where_the_caller_stopped(plaintext_path, tokenizer, hf_cache_dir):
    for dataset_type in ("mapping", "iterable"):
        make = make_factory("dynamic", dataset_type, 2, plaintext_path, tokenizer, hf_cache_dir)
        reference = [plain(b) for b in make()]
        loader = make()
        head = take(loader, 3)  # the workers have prefetched more than this
        assert head + [plain(b) for b in loader] == reference


def test_epochs_continue_and_cyclic_order_changes(plaintext_path, tokenizer, hf_cache_dir):
    dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="mapping", max_seq_len=4096)
    loader = FixedBatchDataLoader(dataset, micro_batch_size=4, sampler_type="cyclic", seed=7)
    first, second = [plain(b) for b in loader], [plain(b) for b in loader]
    assert len(first) == len(second) == 15 and first != second
    restored = FixedBatchDataLoader(dataset, micro_batch_size=4, sampler_type="cyclic", seed=7)
    restored.load_state_dict(roundtrip(loader.state_dict()))  # saved after two whole epochs: the third comes next
    third = FixedBatchDataLoader(dataset, micro_batch_size=4, sampler_type="cyclic", seed=7)
    third.set_epoch(2)
    expected = [plain(b) for b in third]
    assert [plain(b) for b in restored] == expected and expected not in (first, second)


def test_a_state_of_another_loader_or_source_is_refused(plaintext_path, tokenizer, hf_cache_dir):
    fixed = make_factory("fixed", "mapping", 0, plaintext_path, tokenizer, hf_cache_dir)()
    dynamic = make_factory("dynamic", "mapping", 0, plaintext_path, tokenizer, hf_cache_dir)()
    stream = make_factory("fixed", "iterable", 0, plaintext_path, tokenizer, hf_cache_dir)()
    with pytest.raises(ResumeStateError, match="FixedBatchDataLoader"):
        dynamic.load_state_dict(fixed.state_dict())
    with pytest.raises(ResumeStateError, match="source type|iterable|mapping"):
        fixed.load_state_dict(stream.state_dict())
    with pytest.raises(ResumeStateError, match="version"):
        fixed.load_state_dict({"version": 99})
    changed = DynamicBatchDataLoader(dynamic.dataset, micro_batch_size=3, min_buffered_samples=7)
    with pytest.raises(ResumeStateError, match="min_buffered_samples"):
        changed.load_state_dict(dynamic.state_dict())


_RESUME_SCRIPT = """
import json, sys, torch
from hyper_parallel.data.batching import DynamicBatchDataLoader
from hyper_parallel.data.text.build_dataset import build_online_text_dataset
path, tokenizer, cache, state_file, dataset_type = sys.argv[1:]
dataset = build_online_text_dataset(path, {"data_type": "plaintext", "max_seq_len": 48},
    {"dataset_type": dataset_type, "cache_dir": cache, "shuffle_buffer_size": 16}, tokenizer=tokenizer)
loader = DynamicBatchDataLoader(dataset, micro_batch_size=3, min_buffered_samples=6, num_workers=2)
loader.load_state_dict(torch.load(state_file, weights_only=True))
print(json.dumps([{k: v.tolist() for k, v in b.items()} for b in loader]))
"""


@pytest.mark.parametrize("dataset_type", ["mapping", "iterable"])
def test_a_new_process_continues_with_the_uninterrupted_batches(
    dataset_type, tmp_path, plaintext_path, tokenizer_path, tokenizer, hf_cache_dir
):
    make = make_factory("dynamic", dataset_type, 2, plaintext_path, tokenizer, hf_cache_dir)
    reference = [plain(b) for b in make()]
    loader = make()
    head = take(loader, 5)
    torch.save(loader.state_dict(), tmp_path / "state.pt")
    completed = subprocess.run(
        [sys.executable, "-c", _RESUME_SCRIPT, str(plaintext_path), str(tokenizer_path), str(hf_cache_dir)]
        + [str(tmp_path / "state.pt"), dataset_type],
        capture_output=True,
        text=True,
        check=True,
    )
    assert head + json.loads(completed.stdout) == reference


def supervised_spans(labels: list[int]) -> list[list[int]]:
    spans, current = [], []
    for label in labels:
        if label == IGNORE_INDEX:
            if current:
                spans.append(current)
            current = []
        else:
            current.append(label)
    return spans + ([current] if current else [])


@pytest.mark.parametrize("chat_template", ["tokenizer", "chatml"])
def test_packed_conversations_supervise_exactly_the_assistant_turns(
    chat_template, conversation_path, tokenizer, hf_cache_dir
):
    from .conftest import conversations

    records = conversations(40)
    dataset = build_online_text_dataset(
        conversation_path,
        {"data_type": "conversation", "chat_template": chat_template},
        {"dataset_type": "mapping", "cache_dir": str(hf_cache_dir)},
        tokenizer=tokenizer,
    )
    loader = FixedBatchDataLoader(dataset, micro_batch_size=4, num_workers=2)
    sequences = []
    for batch in loader:
        labels, bounds = batch["labels"][0].tolist(), batch["cu_seq_lens"].tolist()
        sequences += [labels[start:end] for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    assert len(sequences) == len(records)
    for record, labels in zip(records, sequences, strict=True):
        answers = [turn["content"] for turn in record["conversation"] if turn["role"] == "gpt"]
        spans = [tokenizer.decode(span) for span in supervised_spans(labels)]
        assert spans == [answer + "<|im_end|>\n" for answer in answers]


def test_conversation_loaders_resume_exactly(conversation_path, tokenizer, hf_cache_dir):
    def make():
        dataset = build_online_text_dataset(
            conversation_path,
            {"data_type": "conversation", "max_seq_len": 256},
            {"dataset_type": "iterable", "shuffle_buffer_size": 8},
            tokenizer=tokenizer,
        )
        return DynamicBatchDataLoader(dataset, micro_batch_size=2, min_buffered_samples=5, num_workers=2)

    check_exact_resume(make, stop_points=[2, 5])


@pytest.mark.parametrize("dataset_type", ["mapping", "iterable"])
def test_dynamic_resume_is_exact_after_every_batch(dataset_type, plaintext_path, tokenizer, hf_cache_dir):
    make = make_factory("dynamic", dataset_type, 0, plaintext_path, tokenizer, hf_cache_dir)
    count = len(list(make()))
    check_exact_resume(make, stop_points=range(count))


@pytest.mark.parametrize("loader", ["fixed", "dynamic"])
def test_persistent_workers_keep_epochs_and_resume_exact(loader, plaintext_path, tokenizer, hf_cache_dir):
    make = make_factory(loader, "iterable", 2, plaintext_path, tokenizer, hf_cache_dir, persistent_workers=True)
    check_exact_resume(make, stop_points=[3])
    reused = make()
    first, second = [plain(b) for b in reused], [plain(b) for b in reused]
    assert first and second and first != second  # the stream reshuffles its second epoch
    fresh = make()
    fresh.set_epoch(1)
    assert [plain(b) for b in fresh] == second


@pytest.mark.parametrize("drop_last", [True, False])
def test_stream_drop_last_drops_only_an_incomplete_batch_of_records(drop_last, plaintext_path, tokenizer, hf_cache_dir):
    def windows(loader_class, **options):
        dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="iterable", max_seq_len=48)
        loader = loader_class(dataset, micro_batch_size=8, drop_last=drop_last, **options)
        return Counter(sequence for batch in loader for sequence in document_tokens(batch))

    # 60 records in batches of 8, read 32 at a time: the last 4 records are an incomplete batch
    dynamic, everything = windows(DynamicBatchDataLoader, min_buffered_samples=3), windows(DynamicBatchDataLoader)
    dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="iterable", max_seq_len=48)
    records = [dataset.stream.read(1)[0][1] for _ in range(60)]
    last_four = Counter(tuple(s["input_ids"].tolist()) for record in records[56:] for s in dataset.transform(record))
    assert dynamic == everything
    if drop_last:
        assert sum((everything & last_four).values()) == 0
    else:
        assert last_four <= everything


def test_mapping_loaders_apply_the_sampler_options(tmp_path, plaintext_path, tokenizer, hf_cache_dir):
    dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="mapping", max_seq_len=4096)
    records = [tuple(dataset[i][0]["input_ids"].tolist()) for i in range(len(dataset))]
    reverse = np.arange(len(dataset))[::-1].copy()
    np.save(tmp_path / "reverse.npy", reverse)
    loader = FixedBatchDataLoader(dataset, micro_batch_size=4, data_rearrange_map=str(tmp_path / "reverse.npy"))
    delivered = [sequence for batch in loader for sequence in document_tokens(batch)]
    assert delivered == records[::-1]

    sharded = [
        FixedBatchDataLoader(
            dataset, micro_batch_size=2, dp_rank=rank, dp_world_size=2, sampler_type="cyclic", data_sharding=True
        )
        for rank in range(2)
    ]
    shares = [[s for batch in loader for s in document_tokens(batch)] for loader in sharded]
    assert set(shares[0]) == set(records[:30]) and set(shares[1]) == set(records[30:])  # one bucket per rank
    with pytest.raises(ResumeStateError, match="data_sharding|bucket"):
        FixedBatchDataLoader(
            dataset, micro_batch_size=2, global_batch_size=4, sampler_type="cyclic", data_sharding=True
        ).load_state_dict(sharded[0].state_dict())


def test_loader_settings_are_checked_with_the_fix(plaintext_path, tokenizer, hf_cache_dir):
    mapping = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="mapping", max_seq_len=64)
    stream = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="iterable", max_seq_len=64)
    with pytest.raises(DataConfigError, match="micro_batch_size must be an integer >= 1, got 0"):
        FixedBatchDataLoader(mapping, micro_batch_size=0)
    with pytest.raises(DataConfigError, match="built for DP rank 0 of 1.*rank 1 of 2"):
        FixedBatchDataLoader(stream, dp_rank=1, dp_world_size=2)
    with pytest.raises(DataConfigError, match="global_batch_size"):
        FixedBatchDataLoader(mapping, micro_batch_size=2, global_batch_size=5)
    with pytest.raises(DataConfigError, match="FixedBatchDataLoader for fixed-length Indexed samples"):
        DynamicBatchDataLoader(list(range(10)))
    windowless = build_online_text_dataset(
        plaintext_path, {"data_type": "identity"}, {"dataset_type": "mapping", "cache_dir": str(hf_cache_dir)}
    )
    assert windowless.max_seq_len is None  # an identity transform without max_seq_len
    with pytest.raises(DataConfigError, match="needs max_seq_len"):
        DynamicBatchDataLoader(windowless)
    with pytest.raises(TypeError, match="no length"):
        len(FixedBatchDataLoader(stream))


def test_micro_batches_per_step_must_divide_evenly():
    assert calculate_num_micro_batches(64, 2, 4) == 8
    assert calculate_num_micro_batches(8, 8, 1) == 1
    for sizes in [(60, 2, 4), (0, 1, 1), (8, 0, 1), (8, 1, 0)]:
        with pytest.raises(DataConfigError, match="must be a positive multiple"):
            calculate_num_micro_batches(*sizes)
