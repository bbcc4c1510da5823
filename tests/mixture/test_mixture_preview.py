"""``hp-data preview`` of a mixture ends with one line of what each source gave to the batches shown."""

from __future__ import annotations

import json
import re

from hyper_parallel.data.tools.cli import main as hp_data

CONFIG = """
dataset:
  _target_: hyper_parallel.data.mixture.build_mixture.build_mixture_dataset
  on_exhausted: reweight
  sources:
    - name: passages
      weight: 0.5
      dataset:
        _target_: hyper_parallel.data.text.build_dataset.build_online_text_dataset
        data_path: {online}
        data_transform: {{data_type: plaintext, text_keys: text, max_seq_len: 256}}
        data_config: {{cache_dir: {cache}}}
    - name: rows
      weight: 0.5
      dataset:
        _target_: hyper_parallel.data.text.build_dataset.build_indexed_text_dataset
        data_path: {indexed}
        data_config: {{seq_length: 64, split: "100, 0, 0", data_cache_path: {cache}}}
dataloader:
  _target_: hyper_parallel.data.batching.FixedBatchDataLoader
"""


def test_the_preview_of_a_mixture_ends_with_each_source_s_samples_and_tokens(
    online_paths, indexed_prefix, tokenizer_path, tmp_path, capsys
):
    config = tmp_path / "mixture.yaml"
    config.write_text(CONFIG.format(online=online_paths[0], indexed=indexed_prefix, cache=tmp_path))
    command = ["preview", str(config), "--tokenizer", str(tokenizer_path), "--micro-batch-size", "2"]
    assert hp_data([*command, "--batches", "3"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    found = re.fullmatch(
        r"mixture after 3 batches: passages (\d+) samples \(([\d.]+)%\), ([\d,]+) tokens; "
        r"rows (\d+) samples \(([\d.]+)%\), ([\d,]+) tokens",
        last,
    )
    assert found, last
    passages, rows = int(found[1]), int(found[4])
    assert passages + rows == 6 and int(found[6].replace(",", "")) == 64 * rows

    assert hp_data([*command, "--batches", "2", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line.get("batch") for line in lines] == [0, 1, None]
    sources = lines[-1]["mixture"]["sources"]
    assert sum(counts["samples"] for counts in sources.values()) == 4
