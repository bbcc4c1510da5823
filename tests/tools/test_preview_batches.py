"""``hp-data preview``: a pipeline config's batches as text, with the loss targets marked."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hyper_parallel.data.batching.build_collate_fn import build_indexed_collate_fn
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset
from hyper_parallel.data.tools.cli import main as hp_data
from hyper_parallel.data.tools.preview_batches import describe_batch, marked_text

CONFIG = """
dataset:
  _target_: hyper_parallel.data.text.build_dataset.build_online_text_dataset
  data_path: {data}
  data_transform:
    _target_: hyper_parallel.data.text.build_data_transform.build_llm_data_transform
    data_type: conversation
  data_config:
    cache_dir: {cache}
dataloader:
  _target_: hyper_parallel.data.batching.FixedBatchDataLoader
"""

CONVERSATIONS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "human", "content": "Who is Elinor?"},
        {"role": "gpt", "content": "The elder Dashwood sister."},
    ],
    [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "observation", "content": "{}"},
        {"role": "assistant", "content": "Done."},
    ],
]


def test_marked_text_marks_the_targets_of_shifted_labels():
    def decode(ids):
        return "".join(chr(ord("a") + i) for i in ids)

    ids = np.array([0, 1, 2, 3, 4])  # text "abcdef" with targets "c", "d" and "f"
    labels = np.array([IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5])
    assert marked_text(ids, labels, decode) == "ab[[cd]]e[[f]]"
    assert marked_text(ids, np.full(5, IGNORE_INDEX), decode) == "abcde"


@pytest.fixture
def config(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"conversation": c}) + "\n" for c in CONVERSATIONS))
    path = tmp_path / "pipeline.yaml"
    path.write_text(CONFIG.format(data=data, cache=tmp_path / "cache"))
    return path


def test_preview_shows_each_conversation_with_only_the_answers_marked(config, tokenizer_path, capsys):
    assert hp_data(["preview", str(config), "--tokenizer", str(tokenizer_path), "--micro-batch-size", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("batch 0: 2 sequences")
    first, second = lines[1], lines[2]
    assert "[[The elder Dashwood sister.<|im_end|>\\n]]" in first and first.count("[[") == 1
    assert "Who is Elinor?" in first and "[[Paris.<|im_end|>\\n]]" in second and "[[Done." in second
    assert second.count("[[") == 2


def test_preview_json_and_missing_split(config, tokenizer_path, capsys):
    hp_data(["preview", str(config), "--tokenizer", str(tokenizer_path), "--json", "--batches", "5"])
    batches = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [b["batch"] for b in batches] == [0, 1] and all(b["sequences"] == 1 for b in batches)
    assert batches[0]["trained_tokens"] > 0 and batches[0]["shapes"]["input_ids"][0] == 1
    assert hp_data(["preview", str(config), "--tokenizer", str(tokenizer_path), "--split", "valid"]) == 2
    assert "error: the config builds no valid split" in capsys.readouterr().err
    config.write_text(config.read_text().replace("data_type: conversation", "data_type: conversations"))
    assert hp_data(["preview", str(config), "--tokenizer", str(tokenizer_path)]) == 2
    assert "conversations" in capsys.readouterr().err


def test_preview_takes_the_tokenizer_of_the_model_assets_node(config, tokenizer_path, capsys):
    assert hp_data(["preview", str(config), "--batches", "1"]) == 2
    assert "pass --tokenizer, or set model_assets.tokenizer" in capsys.readouterr().err
    config.write_text(f"model_assets:\n  tokenizer: {tokenizer_path}\n" + config.read_text())
    assert hp_data(["preview", str(config), "--batches", "1"]) == 0
    assert "[[The elder Dashwood sister.<|im_end|>\\n]]" in capsys.readouterr().out


def test_indexed_batches_are_described_by_the_batch_contract():
    """Sequences as ``cu_seq_lens`` cuts them (after each EOD, here 0, and at each row end); trained tokens as the
    loss mask counts them, whatever the dataset's labels hold where the mask is 0."""

    def decode(ids):
        return " ".join(map(str, ids))

    samples = [
        {"tokens": np.array([5, 6, 7]), "labels": np.array([6, 7, 11]), "loss_mask": np.ones(3, np.float32)},
        {"tokens": np.array([8, 0, 10]), "labels": np.array([0, 10, 12]), "loss_mask": np.array([1, 0, 0], np.float32)},
    ]
    summary = describe_batch(build_indexed_collate_fn(eod_token_id=0)(samples), decode)
    assert summary["sequences"] == 3 and summary["tokens"] == 6 and summary["trained_tokens"] == 4
    assert summary["texts"] == ["5[[6 7 11]]", "8[[0]]", "10"]  # each run decoded on its own
    assert summary["shapes"]["input_ids"] == [2, 3] and summary["shapes"]["loss_mask"] == [2, 3]
    with pytest.raises(DataConfigError, match="returned a dict, not a Batch; preview reads the batch contract"):
        describe_batch({"tokens": np.zeros((1, 3))}, decode)


INDEXED_CONFIG = """
dataset:
  _target_: hyper_parallel.data.text.build_dataset.build_indexed_text_dataset
  data_path: {prefix}
  data_config: {data_config}
dataloader:
  _target_: hyper_parallel.data.batching.FixedBatchDataLoader
collate_fn:
  _target_: hyper_parallel.data.batching.build_indexed_collate_fn
"""


def test_preview_of_an_indexed_pipeline_counts_what_the_loss_mask_trains(tmp_path, tokenizer, tokenizer_path, capsys):
    """With ``eod_mask_loss`` the EOD inputs carry no loss: the preview's trained tokens are the loss mask's, and
    its sequences are the documents cut at each EOD, over one whole epoch."""
    prefix = tmp_path / "corpus_text_document"
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(30):
        document = [*rng.integers(2, 8000, size=int(rng.integers(3, 30))).tolist(), tokenizer.eod]
        builder.add_document(document, [len(document)])
    builder.finalize(f"{prefix}.idx")
    data_config = {"seq_length": 32, "split": "100, 0, 0", "eod_mask_loss": True, "data_cache_path": str(tmp_path)}
    config = tmp_path / "pipeline.yaml"
    config.write_text(INDEXED_CONFIG.format(prefix=prefix, data_config=json.dumps(data_config)))
    assert hp_data(["preview", str(config), "--tokenizer", str(tokenizer_path), "--json", "--batches", "1000"]) == 0
    batches = [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    train, _, _ = build_indexed_text_dataset(str(prefix), data_config, tokenizer=tokenizer)
    samples = [train[index] for index in range(len(train))]
    loss_mask = torch.stack([sample["loss_mask"] for sample in samples])
    tokens = torch.stack([sample["tokens"] for sample in samples])
    assert len(batches) == len(samples) > 10
    assert sum(batch["tokens"] for batch in batches) == tokens.numel()
    assert sum(batch["trained_tokens"] for batch in batches) == int(loss_mask.sum()) < tokens.numel()
    assert sum(batch["sequences"] for batch in batches) == len(samples) + int((tokens[:, :-1] == tokenizer.eod).sum())


def test_preview_builds_only_the_split_it_shows(tmp_path, tokenizer, tokenizer_path, capsys):
    """A 1% test split of one sample cannot fill a micro-batch of 4: a trainer's loaders refuse the config, but
    the preview of the train or valid split does not build the test loader."""
    prefix = tmp_path / "corpus_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for index in range(400):
        document = [2 + index % 100] * 20 + [tokenizer.eod]
        builder.add_document(document, [len(document)])
    builder.finalize(f"{prefix}.idx")
    data_config = {"seq_length": 32, "split": "90, 9, 1", "data_cache_path": str(tmp_path)}
    config = tmp_path / "pipeline.yaml"
    config.write_text(INDEXED_CONFIG.format(prefix=prefix, data_config=json.dumps(data_config)))
    command = ["preview", str(config), "--tokenizer", str(tokenizer_path), "--json", "--micro-batch-size", "4"]
    for split in ("train", "valid"):
        assert hp_data([*command, "--split", split, "--batches", "2"]) == 0
        batches = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [batch["shapes"]["input_ids"] for batch in batches] == [[4, 32], [4, 32]]
    assert hp_data([*command, "--split", "test"]) == 2
    assert "smaller than global_batch_size 4" in capsys.readouterr().err
