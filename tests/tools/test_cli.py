"""Specification of the ``hp-data`` command and the quickstart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from indexed.test_index_cache import write_corpus

from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.tools.cli import COMMANDS, main

from .test_offline_preparation import (
    make_records,
    read_documents,
    write_jsonl,
)


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["help"], []])
def test_help_lists_every_command(capsys, argv):
    """``hp-data --help`` (or no command) prints the usage with every command and exits 0."""
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hp-data COMMAND")
    commands = ("quickstart", "prepare", "prepare-hf", "inspect", "preview", "prepare-cache", "sequences-per-dataset")
    commands += ("config-reference", "provenance")
    for command in commands:
        assert f"  {command} " in out
    assert set(COMMANDS) == set(commands)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_help_names_it_as_hp_data_command(capsys, command):
    """``hp-data <command> --help`` shows the command as the user typed it, whatever module runs it."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: hp-data {command} ")


def test_unknown_command_exits_2(capsys):
    """An unknown command prints an error and the usage on stderr and exits 2."""
    assert main(["tokenise"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: unknown command 'tokenise'")
    assert "commands:" in captured.err and captured.out == ""


def test_prepare_dispatches_to_offline_preparation(tmp_path, tokenizer, capsys, restore_package_logger):
    """``hp-data prepare`` runs offline preparation with the same flags."""
    records = make_records(3, seed=90)
    argv = ["prepare", "--dataset-name-or-path", str(write_jsonl(tmp_path / "in.jsonl", records))]
    argv += ["--output-prefix", str(tmp_path / "out"), "--tokenizer-name-or-path", str(BUNDLED_TOKENIZER_PATH)]
    argv += ["--workers", "1", "--json-keys", "title"]
    assert main(argv) == 0
    assert "offline preparation finished:" in capsys.readouterr().out
    expected = [tokenizer.encode(r["title"]) + [tokenizer.eod] for r in records]
    assert read_documents(tmp_path / "out_title_document") == expected


def test_module_help_runs_as_a_script():
    """``python -m hyper_parallel.data.tools.offline_preparation --help`` works in a fresh process."""
    result = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.data.tools.offline_preparation", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "--pack-to-seq-len" in result.stdout and "--dataset-name-or-path" in result.stdout


# -- bad configs through hp-data preview: one error line, exit status 2 ----------------------------------------------

INDEXED_PIPELINE = """\
dataset:
  _target_: hyper_parallel.data.text.build_dataset.build_indexed_text_dataset
  data_path: {prefix}
  data_config:
    seq_length: 32
    split: "90, 8, 2"
    data_cache_path: {cache}
    per_dataset_sequences_path: {counts}
dataloader:
  _target_: hyper_parallel.data.batching.FixedBatchDataLoader
collate_fn:
  _target_: hyper_parallel.data.batching.build_indexed_collate_fn
"""


def _replace(old: str, new: str):
    return lambda text: text.replace(old, new, 1)


def _without_dataset(new: str):
    """The pipeline with its dataset node replaced by ``new``."""
    return lambda text: new + "\n" + text[text.index("dataloader:") :]


_DATALOADER = "dataloader:\n  _target_: hyper_parallel.data.batching.FixedBatchDataLoader"
BAD_PIPELINES = {
    # name: (how the valid pipeline text is changed, the counts file's text, what the error line says)
    "counts-a-list": (None, '[["{prefix}", [50, 51]]]', "holds the JSON array"),
    "counts-null": (None, '{{"{prefix}": null}}', "'{prefix}' maps to null, but each prefix must map to"),
    "counts-float": (None, '{{"{prefix}": [50.5, 51]}}', "'{prefix}': sequence_count is the JSON number 50.5"),
    "counts-past-int64": (None, '{{"{prefix}": [50, 18446744073709551616]}}', "'{prefix}': document_count is"),
    "counts-missing-prefix": (
        None,
        '{{"/data/other": [50, 51]}}',
        "which lists 1 other prefixes",
    ),
    "counts-invalid-json": (None, "{{", "holds invalid JSON"),
    "yaml-set": (_replace("seq_length: 32", "seq_length: !!set {32}"), None, "is tagged !!set"),
    "yaml-binary": (_replace("seq_length: 32", "seq_length: !!binary MzI="), None, "is tagged !!binary"),
    "yaml-omap": (_replace("seq_length: 32", "seq_length: !!omap [a: 1]"), None, "is tagged !!omap"),
    "yaml-timestamp": (_replace('split: "90, 8, 2"', "split: !!timestamp 2024-01-01"), None, "tagged !!timestamp"),
    "yaml-python": (_replace("data_path: ", "data_path: !!python/name:os.system "), None, "tagged !!python/name:os"),
    "dataloader-int": (_replace(_DATALOADER, "dataloader: 5"), None, "dataloader: the node holds the int 5, but it"),
    "dataset-list": (_without_dataset("dataset: [1, 2]"), None, "dataset: the node holds the list [1, 2], but it"),
    "get_batch-string": (lambda text: text + 'get_batch: "x"\n', None, "get_batch: the node holds the str 'x', but"),
    "collate_fn-no-target": (
        _replace("_target_: hyper_parallel.data.batching.build_indexed_collate_fn", "pad_token_id: 1"),
        None,
        "collate_fn: the node holds a mapping without _target_ (keys pad_token_id)",
    ),
    "top-level-list": (
        lambda text: "- " + text.replace("\n", "\n  "),
        None,
        "must hold a mapping at the top level (keys such as dataset: and dataloader:), got a list",
    ),
    "top-level-scalar": (lambda text: "pipeline\n", None, "got the scalar 'pipeline'"),
    "empty-file": (lambda text: "# nothing yet\n", None, "is empty; a pipeline config is a mapping of nodes"),
}


def _bad_pipeline(tmp_path, name) -> tuple[str, str]:
    """The pipeline file of ``BAD_PIPELINES[name]`` over a real pair, and what its error line must say."""
    change, counts, said = BAD_PIPELINES[name]
    prefix = write_corpus(tmp_path / "a_text_document", num_documents=50, seed=1)
    counts_path = tmp_path / "sequences.json"
    counts_path.write_text((counts or '{{"{prefix}": [50, 51]}}').format(prefix=prefix), encoding="utf-8")
    text = INDEXED_PIPELINE.format(prefix=prefix, cache=tmp_path / "cache", counts=counts_path)
    config = tmp_path / "pipeline.yaml"
    config.write_text(text if change is None else change(text), encoding="utf-8")
    return str(config), said.format(prefix=prefix)


@pytest.mark.parametrize("name", list(BAD_PIPELINES))
def test_a_bad_pipeline_config_is_one_error_line_and_exit_status_2(tmp_path, capsys, restore_package_logger, name):
    """A malformed counts file, a YAML value a config cannot hold, or a node of the wrong shape: ``hp-data preview``
    prints one ``error:`` line naming it and exits 2, nothing raised."""
    config, said = _bad_pipeline(tmp_path, name)

    code = main(["preview", config, "--tokenizer", str(BUNDLED_TOKENIZER_PATH)])

    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert said in lines[0], lines[0]


@pytest.mark.parametrize("name", ["counts-float", "yaml-set", "dataloader-int", "empty-file"])
def test_the_installed_command_prints_no_traceback(tmp_path, name):
    """The same through the installed ``hp-data`` in a fresh process: exit status 2, stderr without a traceback."""
    config, said = _bad_pipeline(tmp_path, name)
    command = Path(sys.executable).with_name("hp-data")

    result = subprocess.run(
        [str(command), "preview", config, "--tokenizer", str(BUNDLED_TOKENIZER_PATH)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )

    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and said in errors[0], result.stderr
