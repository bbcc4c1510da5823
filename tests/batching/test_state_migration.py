"""Loader states saved by earlier releases still resume exactly, after migration to the current layout.

``loader_states_v2.json`` holds version 2 states saved by the release before the key sources and the packing policy
kept their own parts of a state (flat ``source_type``, ``token_budget``, ``min_buffered_samples``, ``buffer`` and
``buffer_tokens``). Each entry names the loader, its source and settings, and how many batches were delivered
before the state was taken, over the first 40 paragraphs of the bundled corpus (``{"id", "text"}`` JSONL),
``max_seq_len`` 4096 (fixed) or 48 (dynamic), ``micro_batch_size`` 3, ``min_buffered_samples`` 6 and a shuffle
buffer of 4 records. A state names the data file it was saved over, whose path was a temporary one: the tests give
the state the identity of the same data at its new path, as resuming where the data was would.

Version 1 is version 2 without ``data`` and ``transform``.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest

from hyper_parallel.data.batching import DynamicBatchDataLoader, FixedBatchDataLoader
from hyper_parallel.data.errors import ResumeStateError
from hyper_parallel.data.text.build_dataset import build_online_text_dataset

from .conftest import paragraphs, write_jsonl
from .resume_check import plain

SAVED = json.loads((Path(__file__).parent / "loader_states_v2.json").read_text())
LOADERS = {"fixed": FixedBatchDataLoader, "dynamic": DynamicBatchDataLoader}


@pytest.fixture(scope="module")
def data_path(tmp_path_factory) -> Path:
    records = [{"id": index, "text": text} for index, text in enumerate(paragraphs(40))]
    return write_jsonl(tmp_path_factory.mktemp("saved_states") / "train.jsonl", records)


def make_loader(case: dict, data_path, tokenizer, cache_dir):
    dataset = build_online_text_dataset(
        data_path,
        {"data_type": "plaintext", "max_seq_len": 4096 if case["loader"] == "fixed" else 48},
        {"dataset_type": case["dataset_type"], "cache_dir": str(cache_dir), "shuffle_buffer_size": 4},
        tokenizer=tokenizer,
    )
    extra = {"min_buffered_samples": 6} if case["loader"] == "dynamic" else {}
    return LOADERS[case["loader"]](
        dataset, micro_batch_size=3, num_workers=case["num_workers"], **extra, **case["options"]
    )


def saved_state(case: dict, loader, version: int) -> dict:
    """The saved state, over this data's identity; version 1 without the identities it did not record."""
    state = copy.deepcopy(case["state"])
    state["data"] = loader.dataset.data_identity()
    if version == 1:
        del state["data"], state["transform"]
        state["version"] = 1
    return state


CASE_IDS = [f"{c['loader']}-{c['dataset_type']}-after-{c['stop']}-of-{c['batches']}" for c in SAVED]


@pytest.mark.parametrize("version", [2, 1])
@pytest.mark.parametrize("case", SAVED, ids=CASE_IDS)
def test_a_state_of_an_earlier_release_resumes_exactly(case, version, data_path, tokenizer, hf_cache_dir, caplog):
    reference = [plain(batch) for batch in make_loader(case, data_path, tokenizer, hf_cache_dir)]
    assert len(reference) == case["batches"]
    restored = make_loader(case, data_path, tokenizer, hf_cache_dir)
    with caplog.at_level(logging.WARNING, logger="hyper_parallel.data"):
        restored.load_state_dict(saved_state(case, restored, version))
    assert ("saved by an older release (version 1)" in caplog.text) == (version == 1)
    assert [plain(batch) for batch in restored] == reference[case["stop"] :]


def test_a_migrated_state_is_checked_like_a_new_one(data_path, tokenizer, hf_cache_dir):
    (case,) = [c for c in SAVED if c["loader"] == "dynamic" and c["dataset_type"] == "mapping" and c["stop"] == 5]
    restored = make_loader(case, data_path, tokenizer, hf_cache_dir)
    damaged = saved_state(case, restored, 2)
    damaged["min_buffered_samples"] = 7
    with pytest.raises(ResumeStateError, match="min_buffered_samples=7 but this loader has 6"):
        restored.load_state_dict(damaged)
    damaged = saved_state(case, restored, 2)
    damaged["buffer"] = [[0, 99]]
    with pytest.raises(ResumeStateError, match=r"\['buffer'\]\[0\] is window 99 of record 0"):
        restored.load_state_dict(damaged)
