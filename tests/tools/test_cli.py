"""Specification of the ``hp-data`` command and the quickstart."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
    commands += ("config-reference",)
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
