"""``hp-data preview``: a pipeline config's batches as text, with the loss targets marked."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hyper_parallel.data.constants import IGNORE_INDEX
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


def test_indexed_batches_are_described_row_by_row():
    def decode(ids):
        return " ".join(map(str, ids))

    batch = {
        "tokens": np.array([[5, 6, 7], [8, 9, 10]]),
        "labels": np.array([[6, 7, 11], [9, IGNORE_INDEX, IGNORE_INDEX]]),
        "loss_mask": np.array([[1, 1, 1], [1, 0, 0]]),
    }
    summary = describe_batch(batch, decode)
    assert summary["sequences"] == 2 and summary["tokens"] == 6 and summary["trained_tokens"] == 4
    assert summary["texts"] == ["5[[6 7 11]]", "8[[9]]10"]  # each run decoded on its own
    assert summary["shapes"]["tokens"] == [2, 3]
