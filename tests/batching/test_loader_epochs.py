"""What a loader says of its epochs and refuses in them: records drop_last leaves out, the micro-batches a dynamic
loader really delivers, Indexed micro-batches without a loss token, and resuming with another rearrange map."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from hyper_parallel.data.batching import DynamicBatchDataLoader, FixedBatchDataLoader
from hyper_parallel.data.errors import DataFileError, ResumeStateError
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset
from hyper_parallel.data.tokenizer_protocol import read_tokenizer

from .test_build_dataloader import plaintext_dataset

RECORDS = 60  # the plaintext_path fixture's


def messages(caplog, level: int, contains: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and contains in r.getMessage()]


# -- records drop_last leaves out -----------------------------------------------------------------------------------


@pytest.mark.parametrize("loader_class", [FixedBatchDataLoader, DynamicBatchDataLoader])
@pytest.mark.parametrize(
    ("options", "dropped"),
    [
        ({"micro_batch_size": 8}, 4),
        ({"micro_batch_size": 7}, 4),
        ({"micro_batch_size": 2, "global_batch_size": 16}, 12),
        ({"micro_batch_size": 4, "dp_world_size": 2, "dp_rank": 1}, 4),
        ({"micro_batch_size": 8, "sampler_type": "cyclic"}, 4),
    ],
)
def test_an_online_mapping_loader_warns_once_of_the_records_drop_last_leaves_out(
    plaintext_path, tokenizer, hf_cache_dir, logs, loader_class, options, dropped
):
    dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="mapping", max_seq_len=4096)
    logs.clear()
    loader = loader_class(dataset, **options)
    [warning] = messages(logs, logging.WARNING, "records every epoch")
    assert f"leaves out {dropped} of its {RECORDS} records every epoch" in warning
    assert "Set drop_last: false on the dataloader to read every record" in warning
    assert str(plaintext_path) in warning
    for _ in range(2):  # one sequence per record: the records read are all but the dropped ones, every epoch
        read = sum(len(batch["cu_seq_lens"]) - 1 for batch in loader)
        assert read * options.get("dp_world_size", 1) == RECORDS - dropped
    assert len(messages(logs, logging.WARNING, "records every epoch")) == 1  # iterating says nothing more
    logs.clear()  # nothing is said when every record is read: drop_last false, or a global batch dividing them
    everything = loader_class(dataset, micro_batch_size=8, drop_last=False)
    loader_class(dataset, micro_batch_size=6)
    assert messages(logs, logging.WARNING, "drop_last") == []
    assert sum(len(batch["cu_seq_lens"]) - 1 for batch in everything) == RECORDS


@pytest.mark.parametrize(("micro_batch_size", "dropped"), [(8, 4), (7, 4), (11, 5)])
def test_a_stream_warns_once_of_the_last_records_drop_last_leaves_out(
    plaintext_path, tokenizer, hf_cache_dir, logs, micro_batch_size, dropped
):
    dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="iterable", max_seq_len=4096)
    loader = FixedBatchDataLoader(dataset, micro_batch_size=micro_batch_size)
    logs.clear()
    for _ in range(2):  # two epochs: said once
        assert sum(len(batch["cu_seq_lens"]) - 1 for batch in loader) == RECORDS - dropped
    [warning] = messages(logs, logging.WARNING, "drop_last")
    assert f"left out the last {dropped} records of " in warning and "in epoch 0" in warning
    assert "Set drop_last: false on the dataloader to read every record" in warning


# -- the micro-batches a dynamic loader delivers --------------------------------------------------------------------


@pytest.mark.parametrize("dataset_type", ["mapping", "iterable"])
@pytest.mark.parametrize(("micro_batch_size", "max_seq_len"), [(3, 48), (2, 128), (5, 32)])
def test_a_dynamic_loader_logs_the_micro_batches_an_epoch_really_delivered(
    plaintext_path, tokenizer, hf_cache_dir, logs, dataset_type, micro_batch_size, max_seq_len
):
    dataset = plaintext_dataset(
        plaintext_path, tokenizer, hf_cache_dir, dataset_type=dataset_type, max_seq_len=max_seq_len
    )
    logs.clear()
    loader = DynamicBatchDataLoader(dataset, micro_batch_size=micro_batch_size, min_buffered_samples=4)
    construction = [r.getMessage() for r in logs.records if r.levelno == logging.INFO]
    assert not any("micro-batches of" in message for message in construction)  # no count is claimed before reading
    if dataset_type == "mapping":
        [sampler] = [message for message in construction if message.startswith("sampler:")]
        assert "packed into micro-batches under the token budget (how many is known once the epoch is read)" in sampler
    for epoch in range(2):
        delivered = sum(1 for _ in loader)
        assert messages(logs, logging.DEBUG, f"of 1: epoch {epoch} ended")[0].endswith(
            f"epoch {epoch} ended, {delivered:,} micro-batches from {RECORDS} records in the whole epoch"
        )
        assert delivered < RECORDS * 4  # packing: several records per micro-batch


def test_a_resumed_epoch_logs_the_micro_batches_delivered_since(plaintext_path, tokenizer, hf_cache_dir, logs):
    def make():
        dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="mapping", max_seq_len=48)
        return DynamicBatchDataLoader(dataset, micro_batch_size=3, min_buffered_samples=4)

    whole = sum(1 for _ in make())
    first = make()
    iterator = iter(first)
    for _ in range(5):
        next(iterator)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    logs.clear()
    assert sum(1 for _ in resumed) == whole - 5
    [message] = messages(logs, logging.DEBUG, "of 1: epoch 0 ended")
    assert f"epoch 0 ended, {whole - 5:,} micro-batches from " in message and message.endswith("since it was resumed")


def test_a_fixed_loader_logs_the_micro_batches_of_an_epoch_before_and_after_reading_it(
    plaintext_path, tokenizer, hf_cache_dir, logs
):
    dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="mapping", max_seq_len=4096)
    logs.clear()
    loader = FixedBatchDataLoader(dataset, micro_batch_size=4)
    [sampler] = [r.getMessage() for r in logs.records if r.getMessage().startswith("sampler:")]
    assert sampler.endswith("15 micro-batches of 4 on this rank per epoch")
    assert sum(1 for _ in loader) == 15
    [message] = messages(logs, logging.DEBUG, "of 1: epoch 0 ended")
    assert message.endswith("epoch 0 ended, 15 micro-batches from 60 records in the whole epoch")


# -- Indexed micro-batches without a loss token ---------------------------------------------------------------------

SEQ_LENGTH = 8


def write_documents(prefix, eod: int, empty_documents: int) -> str:
    """Five documents of text tokens, then ``empty_documents`` that hold only EOD tokens (each ended by one)."""
    rng = np.random.default_rng(0)
    documents = [np.append(rng.integers(eod + 1, eod + 500, size=20), eod) for _ in range(5)]
    documents += [np.full(SEQ_LENGTH + 1, eod) for _ in range(empty_documents)]
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32) as builder:
        builder.add_documents(np.concatenate(documents), [len(d) for d in documents])
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def indexed_train(tmp_path, tokenizer, **settings):
    eod = read_tokenizer(tokenizer).eod
    tmp_path.mkdir(parents=True, exist_ok=True)
    prefix = write_documents(tmp_path / "docs_text_document", eod, empty_documents=40)
    config = {"seq_length": SEQ_LENGTH, "split": "100,0,0", "data_cache_path": str(tmp_path / "cache"), **settings}
    train, _, _ = build_indexed_text_dataset(prefix, config, None, tokenizer)
    return train, prefix


def first_batch_without_loss(dataset, micro_batch_size: int) -> list[int]:
    """The indices of the first micro-batch (in the single order) none of whose samples carries a loss token."""
    trained = np.array([bool(dataset[i]["loss_mask"].any()) for i in range(len(dataset))])
    for start in range(0, len(dataset) - micro_batch_size + 1, micro_batch_size):
        if not trained[start : start + micro_batch_size].any():
            return list(range(start, start + micro_batch_size))
    raise AssertionError("the data has no micro-batch without a loss token")


@pytest.mark.parametrize("micro_batch_size", [1, 2, 3])
def test_an_indexed_micro_batch_without_a_loss_token_is_an_error_naming_the_dataset_and_samples(
    tmp_path, tokenizer, micro_batch_size
):
    train, prefix = indexed_train(tmp_path, tokenizer, eod_mask_loss=True)
    expected = first_batch_without_loss(train, micro_batch_size)
    loader = FixedBatchDataLoader(train, micro_batch_size=micro_batch_size)
    delivered = []
    with pytest.raises(DataFileError) as raised:
        for batch in loader:
            assert batch.loss_mask.any()  # every batch delivered before the error has a loss token
            delivered.append(batch)
    message = str(raised.value)
    assert message.startswith(f"GPTDataset of {prefix} (train split): the micro-batch of samples {expected} has no ")
    assert "its loss would be NaN" in message and "eod_mask_loss to false" in message
    assert len(delivered) == expected[0] // micro_batch_size


def test_only_a_micro_batch_without_any_loss_token_is_refused(tmp_path, tokenizer):
    train, _ = indexed_train(tmp_path, tokenizer, eod_mask_loss=True)
    trained = [bool(train[i]["loss_mask"].any()) for i in range(len(train))]
    mixed = next(i for i in range(0, len(train) - 1, 2) if trained[i] != trained[i + 1])
    empty = first_batch_without_loss(train, 2)
    order = np.r_[mixed, mixed + 1, empty, np.delete(np.arange(len(train)), [mixed, mixed + 1, *empty])]
    batches = iter(FixedBatchDataLoader(train, micro_batch_size=2, data_rearrange_map=order))
    batch = next(batches)  # an all-EOD sample beside one with loss tokens: delivered, trained on as it is
    assert batch.loss_mask.any() and not batch.loss_mask.any(dim=1).all()
    with pytest.raises(DataFileError, match=rf"the micro-batch of samples \[{empty[0]}, {empty[1]}\] has no token"):
        next(batches)
    for settings in ({}, {"eod_mask_loss": False, "reset_position_ids": True}):  # EOD inputs then carry a loss
        train, _ = indexed_train(tmp_path / str(len(settings)), tokenizer, **settings)
        assert sum(1 for _ in FixedBatchDataLoader(train, micro_batch_size=2)) == len(train) // 2


# -- resuming with another rearrange map ----------------------------------------------------------------------------


@pytest.mark.parametrize("loader_class", [FixedBatchDataLoader, DynamicBatchDataLoader])
def test_a_loader_state_saved_with_another_rearrange_map_is_refused(
    tmp_path, plaintext_path, tokenizer, hf_cache_dir, loader_class
):
    def make(mapping):
        dataset = plaintext_dataset(plaintext_path, tokenizer, hf_cache_dir, dataset_type="mapping", max_seq_len=4096)
        return loader_class(dataset, micro_batch_size=4, data_rearrange_map=mapping)

    reverse = np.arange(RECORDS)[::-1].copy()
    np.save(tmp_path / "map.npy", reverse)
    saved = make(tmp_path / "map.npy")
    next(iter(saved))
    state = saved.state_dict()
    make(reverse.tolist()).load_state_dict(state)  # the same map, given another way
    np.save(tmp_path / "map.npy", np.roll(reverse, 1))  # the same file, rewritten
    for other in (None, np.arange(RECORDS), tmp_path / "map.npy"):
        with pytest.raises(ResumeStateError, match="saved with data_rearrange_map 60 entries, xxh3_64 "):
            make(other).load_state_dict(state)
    plain = make(None)
    next(iter(plain))
    with pytest.raises(ResumeStateError, match="saved with data_rearrange_map none but this run has 60 entries"):
        make(reverse).load_state_dict(plain.state_dict())
