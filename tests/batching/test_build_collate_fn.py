"""Specification of the collate functions: packing Online samples, the alignment rule, stacking Indexed samples.

Packed batches are compared with a reference built the plain way (Python lists, one sample at a time).
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from hyper_parallel.data.batching.build_collate_fn import (
    TextPackingCollator,
    build_indexed_collate_fn,
    build_online_text_collate_fn,
    collate_indexed_samples,
    sequence_alignment,
)
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError


def make_samples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for length in lengths:
        ids = rng.integers(1, 1000, size=length, dtype=np.int64)
        labels = np.concatenate([ids[1:], [IGNORE_INDEX]])
        labels[rng.random(length) < 0.3] = IGNORE_INDEX
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def reference_pack(samples, alignment, pad_id):
    ids, labels, cu = [], [], [0]
    for sample in samples:
        ids += [int(x) for x in sample["input_ids"]]
        labels += [int(x) for x in sample["labels"]]
        cu.append(len(ids))
    while len(ids) % alignment:
        ids.append(pad_id)
        labels.append(IGNORE_INDEX)
    if len(ids) != cu[-1]:
        cu.append(len(ids))
    return ids, labels, cu


# -- sequence_alignment -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, 1),
        ({"cp_size": 2}, 2),
        ({"cp_size": 2, "tp_size": 4}, 2),  # tp counts only with sequence parallelism
        ({"cp_size": 2, "tp_size": 4, "sequence_parallel": True}, 8),
        ({"tp_size": 4, "sequence_parallel": True}, 4),
        ({"cp_size": 2, "tp_size": 4, "sequence_parallel": True, "sequence_multiple": 32}, 32),
        ({"cp_size": 2, "tp_size": 4, "sequence_parallel": True, "sequence_multiple": 12}, 24),
        ({"cp_size": 3, "sequence_multiple": 32}, 96),
        ({"sequence_multiple": 7}, 7),
    ],
)
def test_sequence_alignment(kwargs, expected):
    assert sequence_alignment(**kwargs) == expected


def test_sequence_alignment_is_the_lcm():
    for cp in (1, 2, 3, 4):
        for tp in (1, 2, 6):
            for multiple in (1, 8, 12, 32):
                got = sequence_alignment(cp_size=cp, tp_size=tp, sequence_parallel=True, sequence_multiple=multiple)
                assert got == math.lcm(cp * tp, multiple)
                assert got % (cp * tp) == 0 and got % multiple == 0


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"cp_size": 0}, ["cp_size must be an integer >= 1, got 0", "set cp_size to the context-parallel size"]),
        ({"tp_size": -1}, ["tp_size must be an integer >= 1, got -1", "set tp_size to the tensor-parallel size"]),
        ({"sequence_multiple": 0}, ["sequence_multiple must be", "got 0", "kernels need", "(1 for none)"]),
        ({"cp_size": 1.5}, ["cp_size", "1.5", "(1 without context parallelism)"]),
        ({"cp_size": True}, ["cp_size", "bool True", "context-parallel size"]),
        ({"sequence_parallel": "yes"}, ["sequence_parallel must be true or false, got 'yes'", "tensor-parallel"]),
    ],
)
def test_sequence_alignment_rejects_bad_sizes(kwargs, named):
    """A bad alignment setting is a ``DataConfigError`` naming the setting, the value, what the setting is and its
    valid values."""
    with pytest.raises(DataConfigError) as error:
        sequence_alignment(**kwargs)
    for text in named:
        assert text in str(error.value)


# -- TextPackingCollator ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alignment", [1, 2, 4, 8, 32, 96])
@pytest.mark.parametrize("lengths", [[1], [5], [3, 2], [7, 1, 13, 4], [16, 16], list(range(1, 20))])
def test_packing_matches_the_reference(lengths, alignment):
    samples = make_samples(lengths, seed=len(lengths) * 100 + alignment)
    batch = TextPackingCollator(alignment=alignment, pad_token_id=3)(samples)
    assert set(batch) == {"input_ids", "labels", "cu_seq_lens"}
    ids, labels, cu = reference_pack(samples, alignment, 3)
    assert batch["input_ids"].dtype == torch.int64 and batch["labels"].dtype == torch.int64
    assert batch["cu_seq_lens"].dtype == torch.int32
    assert batch["input_ids"].shape == (1, len(ids)) and batch["labels"].shape == (1, len(ids))
    assert batch["cu_seq_lens"].ndim == 1
    assert batch["input_ids"][0].tolist() == ids
    assert batch["labels"][0].tolist() == labels
    assert batch["cu_seq_lens"].tolist() == cu
    assert batch["input_ids"].shape[1] % alignment == 0


def test_padding_is_a_synthetic_sequence():
    samples = make_samples([3, 2])
    batch = TextPackingCollator(alignment=4, pad_token_id=9)(samples)
    assert batch["cu_seq_lens"].tolist() == [0, 3, 5, 8]
    assert batch["input_ids"][0, 5:].tolist() == [9, 9, 9]
    assert batch["labels"][0, 5:].tolist() == [IGNORE_INDEX] * 3
    assert batch["input_ids"][0, :5].tolist() == samples[0]["input_ids"].tolist() + samples[1]["input_ids"].tolist()


def test_no_padding_when_aligned():
    samples = make_samples([3, 1])
    batch = TextPackingCollator(alignment=4, pad_token_id=9)(samples)
    assert batch["cu_seq_lens"].tolist() == [0, 3, 4]
    assert batch["input_ids"].shape == (1, 4)
    assert batch["labels"][0, 3].item() == samples[1]["labels"][0]
    batch = TextPackingCollator()(make_samples([5, 6, 7]))
    assert batch["cu_seq_lens"].tolist() == [0, 5, 11, 18]


def test_inputs_of_other_types_and_dtypes():
    samples = [
        {"input_ids": [1, 2, 3], "labels": [2, 3, IGNORE_INDEX]},
        {"input_ids": torch.tensor([4, 5], dtype=torch.int32), "labels": torch.tensor([5, IGNORE_INDEX])},
        {"input_ids": np.array([6], dtype=np.uint16), "labels": np.array([IGNORE_INDEX], dtype=np.int32)},
        {"input_ids": (7, 8), "labels": (8, IGNORE_INDEX), "extra": "ignored"},
    ]
    batch = TextPackingCollator(alignment=3, pad_token_id=0)(samples)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 0]]
    assert batch["labels"].tolist() == [[2, 3, IGNORE_INDEX, 5, IGNORE_INDEX, IGNORE_INDEX, 8, IGNORE_INDEX, -100]]
    assert batch["cu_seq_lens"].tolist() == [0, 3, 5, 6, 8, 9]


def test_outputs_do_not_alias_the_samples():
    samples = make_samples([4])
    before = samples[0]["input_ids"].copy()
    batch = TextPackingCollator()(samples)
    batch["input_ids"][0, 0] = -1
    assert (samples[0]["input_ids"] == before).all()


@pytest.mark.parametrize(
    ("samples", "match"),
    [
        ([], "no samples"),
        ([{"input_ids": [1, 2], "labels": [2, 3]}, {"input_ids": [], "labels": []}], "sample 1 .*empty"),
        ([{"input_ids": [1, 2, 3], "labels": [2, 3]}], "sample 0 of the batch has 3 input_ids but 2 labels"),
        ([{"input_ids": [[1, 2]], "labels": [[2, 3]]}], "sample 0 .*1-D"),
        ([{"input_ids": 5, "labels": 6}], "1-D"),
        ([{"input_ids": [1, 2]}], "sample 0 .*no 'labels'"),
        ([{"input_ids": [1.0, 2.0], "labels": [2, 3]}], "integer"),
        ([{"input_ids": [1], "labels": [2]}, None], "sample 1 .*NoneType"),
    ],
)
def test_packing_rejects_bad_batches(samples, match):
    with pytest.raises(DataFileError, match=match):
        TextPackingCollator(alignment=4)(samples)


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"alignment": 0}, "set alignment to the multiple of the packed length, as sequence_alignment("),
        ({"alignment": 2.0}, "build_online_text_collate_fn"),
        ({"pad_token_id": -1}, "set pad_token_id to a token id of the vocabulary"),
        ({"pad_token_id": "0"}, "so 0 works"),
    ],
)
def test_collator_rejects_bad_settings(kwargs, fix):
    """Each bad setting is a ``DataConfigError`` naming it, its value and the fix."""
    ((name, value),) = kwargs.items()
    with pytest.raises(DataConfigError) as error:
        TextPackingCollator(**kwargs)
    assert f"{name} must be an integer" in str(error.value) and repr(value) in str(error.value)
    assert fix in str(error.value)


def test_text_collator_pickles():
    collator = TextPackingCollator(alignment=8, pad_token_id=5)
    clone = pickle.loads(pickle.dumps(collator))
    samples = make_samples([3, 9])
    for key, value in collator(samples).items():
        assert torch.equal(value, clone(samples)[key])


# -- build_online_text_collate_fn ---------------------------------------------------------------------------------


class _Tokenizer:
    def __init__(self, pad_token_id):
        self.pad_token_id = pad_token_id


def test_online_builder_alignment_and_pad_ids(tokenizer):
    collator = build_online_text_collate_fn(cp_size=2, tp_size=4, sequence_parallel=True, sequence_multiple=32)
    assert (collator.alignment, collator.pad_token_id) == (32, 0)
    assert build_online_text_collate_fn(_Tokenizer(7)).pad_token_id == 7
    assert build_online_text_collate_fn(_Tokenizer(None)).pad_token_id == 0
    assert build_online_text_collate_fn(object()).pad_token_id == 0
    assert build_online_text_collate_fn(_Tokenizer(7), pad_token_id=2).pad_token_id == 2
    assert build_online_text_collate_fn(_Tokenizer(7), pad_token_id=0).pad_token_id == 0  # 0 is not "unset"
    assert build_online_text_collate_fn(tokenizer).pad_token_id == tokenizer.pad_token_id
    assert build_online_text_collate_fn(cp_size=4).alignment == 4
    batch = build_online_text_collate_fn(_Tokenizer(7), cp_size=4)(make_samples([2, 3]))
    assert batch["input_ids"][0, 5:].tolist() == [7, 7, 7]
    with pytest.raises(DataConfigError):
        build_online_text_collate_fn(cp_size=0)


def test_online_builder_with_real_tokenizer(tokenizer):
    texts = ["It is a truth universally acknowledged.", "Emma Woodhouse, handsome, clever, and rich."]
    samples = []
    for text in texts:
        ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
        samples.append({"input_ids": ids, "labels": np.append(ids[1:], IGNORE_INDEX)})
    batch = build_online_text_collate_fn(tokenizer, sequence_multiple=16)(samples)
    ids, labels, cu = reference_pack(samples, 16, build_online_text_collate_fn(tokenizer).pad_token_id)
    assert batch["input_ids"][0].tolist() == ids and batch["labels"][0].tolist() == labels
    assert batch["cu_seq_lens"].tolist() == cu


# -- Indexed stacking ---------------------------------------------------------------------------------------------


def make_indexed_sample(seq_length, seed, attention=False, dataset_id=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 500, size=seq_length + 1, dtype=np.int64)
    sample = {
        "tokens": tokens[:-1],
        "labels": tokens[1:],
        "loss_mask": np.ones(seq_length, dtype=np.float32),
        "position_ids": np.arange(seq_length, dtype=np.int64),
        "dataset_id": np.int64(dataset_id),
    }
    if attention:
        sample["attention_mask"] = ~np.tril(np.ones((seq_length, seq_length), dtype=bool))[None]
    return sample


@pytest.mark.parametrize("attention", [False, True])
def test_indexed_stacking(attention):
    samples = [make_indexed_sample(16, seed, attention, dataset_id=seed % 2) for seed in range(4)]
    batch = build_indexed_collate_fn()(samples)
    assert batch["tokens"].shape == (4, 16) and batch["tokens"].dtype == torch.int64
    assert batch["labels"].shape == (4, 16)
    assert batch["loss_mask"].shape == (4, 16) and batch["loss_mask"].dtype == torch.float32
    assert batch["position_ids"].shape == (4, 16)
    assert batch["dataset_id"].tolist() == [0, 1, 0, 1]
    for row, sample in enumerate(samples):
        assert batch["tokens"][row].tolist() == sample["tokens"].tolist()
        assert batch["labels"][row].tolist() == sample["labels"].tolist()
    if attention:
        assert batch["attention_mask"].shape == (4, 1, 16, 16) and batch["attention_mask"].dtype == torch.bool
    else:
        assert "attention_mask" not in batch


def test_indexed_stacking_of_torch_samples():
    samples = [{k: torch.as_tensor(v) for k, v in make_indexed_sample(8, seed).items()} for seed in range(3)]
    batch = collate_indexed_samples(samples)
    assert batch["tokens"].shape == (3, 8) and batch["dataset_id"].shape == (3,)


def test_indexed_errors():
    good = [make_indexed_sample(8, seed) for seed in range(3)]
    with pytest.raises(DataFileError, match="no samples"):
        collate_indexed_samples([])
    with pytest.raises(DataFileError, match="sample 1 of the batch is None"):
        collate_indexed_samples([good[0], None, good[2]])
    partial = dict(good[1])
    del partial["position_ids"]
    with pytest.raises(DataFileError, match=r"sample 1 .*missing \['position_ids'\]"):
        collate_indexed_samples([good[0], partial])
    with pytest.raises(DataFileError, match=r"sample 1 .*extra \['attention_mask'\]"):
        collate_indexed_samples([good[0], make_indexed_sample(8, 1, attention=True)])
    with pytest.raises(DataFileError, match="sample 1 .*'tokens' has shape"):
        collate_indexed_samples([good[0], make_indexed_sample(9, 1)])


def test_indexed_collate_pickles():
    collate = build_indexed_collate_fn()
    clone = pickle.loads(pickle.dumps(collate))
    samples = [make_indexed_sample(8, seed) for seed in range(2)]
    assert torch.equal(clone(samples)["tokens"], collate(samples)["tokens"])
