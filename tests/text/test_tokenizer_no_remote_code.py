"""A tokenizer directory that declares custom code is refused wherever a tokenizer is loaded, and its code never runs.

The directories are the bundled tokenizer with an edited ``tokenizer_config.json`` (or a ``config.json``) and a
Python file that leaves a marker file behind if anything imports it, so each test can prove that nothing did, even
when stdin answers "y" to the question ``transformers`` asks before running a directory's code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer

HP_DATA = Path(sys.executable).with_name("hp-data")
AUTO_MAP = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}

# How a directory declares custom code: (tokenizer_config.json changes, config.json or None, the named class).
DECLARATIONS = {
    "auto_map_pair": ({"auto_map": AUTO_MAP, "tokenizer_class": "EvilTokenizer"}, None, "EvilTokenizer"),
    "auto_map_string": (
        {"auto_map": {"AutoTokenizer": "tokenization_evil.EvilTokenizer"}},
        None,
        "tokenization_evil.EvilTokenizer",
    ),
    "auto_map_list": ({"auto_map": ["tokenization_evil.EvilTokenizer", None]}, None, "EvilTokenizer"),
    "auto_map_nested": (
        {"auto_map": {"AutoTokenizer": {"fast": ["tokenization_evil.EvilTokenizerFast"]}}},
        None,
        "EvilTokenizerFast",
    ),
    "auto_map_upstream_repo": (
        {"auto_map": {"AutoTokenizer": ["someone/evil--tokenization_evil.EvilTokenizer", None]}},
        None,
        "someone/evil--tokenization_evil.EvilTokenizer",
    ),
    "auto_map_in_config_json": (
        {},
        {"model_type": "llama", "auto_map": {"AutoConfig": "tokenization_evil.EvilConfig"}},
        "EvilConfig",
    ),
    "unknown_tokenizer_class": ({"tokenizer_class": "EvilTokenizer"}, None, "EvilTokenizer"),
    "unknown_fast_tokenizer_class": ({"tokenizer_class": "EvilTokenizerFast"}, None, "EvilTokenizerFast"),
    "unknown_class_in_config_json": ({}, {"model_type": "llama", "tokenizer_class": "QWenTokenizer"}, "QWenTokenizer"),
}


def evil_directory(directory: Path, marker: Path, config_changes: dict, config_json: dict | None = None) -> Path:
    """The bundled tokenizer with ``config_changes`` in its tokenizer_config.json (and ``config_json`` as its
    config.json), beside a ``tokenization_evil.py`` that writes ``marker`` when imported."""
    shutil.copytree(BUNDLED_TOKENIZER_PATH, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) | config_changes
    config_path.write_text(json.dumps(config), encoding="utf-8")
    if config_json is not None:
        (directory / "config.json").write_text(json.dumps(config_json), encoding="utf-8")
    (directory / "tokenization_evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('the directory code ran')\n"
        "from transformers import TokenizersBackend\n"
        "class EvilTokenizer(TokenizersBackend):\n    pass\n"
        "EvilTokenizerFast = EvilTokenizer\n",
        encoding="utf-8",
    )
    return directory


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "code-ran.txt"


@pytest.fixture
def evil(tmp_path, marker) -> Path:
    return evil_directory(tmp_path / "evil", marker, *DECLARATIONS["auto_map_pair"][:2])


def pipeline_config(path: Path, data: Path, tokenizer: Path) -> Path:
    """A conversation pipeline whose chat template is the tokenizer's own: what loads the ``transformers``
    tokenizer of the directory (where custom code would run)."""
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]})
        + "\n",
        encoding="utf-8",
    )
    path.write_text(
        f"""
model_assets:
  tokenizer: {tokenizer}
dataset:
  _target_: hyper_parallel.data.text.build_dataset.build_online_text_dataset
  data_path: {data}
  data_transform:
    _target_: hyper_parallel.data.text.build_data_transform.build_llm_data_transform
    data_type: conversation
    text_keys: messages
    chat_template: tokenizer
  data_config:
    cache_dir: {path.parent / "cache"}
dataloader:
  _target_: hyper_parallel.data.batching.FixedBatchDataLoader
""",
        encoding="utf-8",
    )
    return path


def hp_data(*args: str) -> subprocess.CompletedProcess:
    """``hp-data`` in a fresh process, stdin answering "y" to any question."""
    return subprocess.run(
        [str(HP_DATA), *args],
        input="y\ny\n",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.parametrize("declaration", list(DECLARATIONS))
def test_a_directory_declaring_custom_code_is_refused_naming_it_and_the_way_to_load_it(tmp_path, marker, declaration):
    config_changes, config_json, named_class = DECLARATIONS[declaration]
    directory = evil_directory(tmp_path / "evil", marker, config_changes, config_json)
    with pytest.raises(DataConfigError) as refused:
        build_tokenizer(directory)
    message = str(refused.value)
    assert str(directory) in message and named_class in message
    assert "declares custom code" in message and "never run" in message
    assert "trust_remote_code=True" in message and "build_tokenizer(tokenizer)" in message
    assert not marker.exists()


@pytest.mark.parametrize(
    "tokenizer_class", ["TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizerFast", "Qwen2Tokenizer"]
)
def test_a_builtin_tokenizer_class_loads_and_the_same_directory_with_an_auto_map_does_not(
    tmp_path, marker, tokenizer_class
):
    """A built-in class, with or without the pre-v5 "Fast" suffix, still loads with the bundled ids; adding an
    auto_map beside it is what makes the directory refused."""
    builtin = evil_directory(tmp_path / "builtin", marker, {"tokenizer_class": tokenizer_class})
    bundled = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    loaded = build_tokenizer(builtin)
    text = "The family of Dashwood had long been settled in Sussex."
    assert loaded.encode(text) == bundled.encode(text) and loaded.eod == bundled.eod

    declared = evil_directory(tmp_path / "declared", marker, {"tokenizer_class": tokenizer_class, "auto_map": AUTO_MAP})
    with pytest.raises(DataConfigError, match=r"auto_map in tokenizer_config\.json: .*tokenization_evil\.py"):
        build_tokenizer(declared)
    assert not marker.exists()


def test_the_transformers_tokenizer_of_a_directory_never_runs_its_code(evil, marker):
    """Even built around the directory by hand (past ``build_tokenizer``'s check), ``.hf`` loads it with
    ``trust_remote_code=False``: in a fresh process whose stdin answers "y", transformers refuses instead of asking,
    and the code does not run."""
    script = (
        "from tokenizers import Tokenizer\n"
        "from hyper_parallel.data.text.build_tokenizer import TextTokenizer\n"
        f"tokenizer = TextTokenizer(Tokenizer.from_file({str(evil / 'tokenizer.json')!r}), {str(evil)!r}, 0, 1, None)\n"
        "try:\n    tokenizer.hf\nexcept ValueError as error:\n    print('refused:', error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], input="y\ny\n", capture_output=True, text=True, timeout=300, check=True
    )
    assert "refused:" in result.stdout and "trust_remote_code" in result.stdout
    assert not marker.exists()


def test_the_model_assets_node_and_build_dataloaders_refuse_the_directory(tmp_path, evil, marker):
    config = pipeline_config(tmp_path / "pipeline.yaml", tmp_path / "chat.jsonl", evil)
    with pytest.raises(DataConfigError, match=rf"{evil}.*declares custom code.*EvilTokenizer"):
        build_dataloaders(str(config), micro_batch_size=1)
    # The same pipeline without model_assets, the directory passed as the tokenizer argument.
    lines = config.read_text(encoding="utf-8").splitlines()
    start = lines.index("model_assets:")
    without_assets = tmp_path / "without-assets.yaml"
    without_assets.write_text("\n".join(lines[:start] + lines[start + 2 :]) + "\n", encoding="utf-8")
    with pytest.raises(DataConfigError, match=r"declares custom code"):
        build_dataloaders(str(without_assets), tokenizer=str(evil), micro_batch_size=1)
    assert not marker.exists()


def test_hp_data_preview_refuses_the_directory_even_when_stdin_says_yes(tmp_path, evil, marker):
    config = pipeline_config(tmp_path / "pipeline.yaml", tmp_path / "chat.jsonl", evil)
    for extra in ([], ["--tokenizer", str(evil)]):
        result = hp_data("preview", str(config), "--micro-batch-size", "1", *extra)
        assert result.returncode == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and str(evil) in errors[0] and "trust_remote_code=True" in errors[0]
        assert "Traceback" not in result.stderr
        assert not marker.exists()


def test_hp_data_prepare_refuses_the_directory_even_when_stdin_says_yes(tmp_path, evil, marker):
    records = tmp_path / "in.jsonl"
    records.write_text(json.dumps({"text": "The family of Dashwood."}) + "\n", encoding="utf-8")
    result = hp_data(
        "prepare",
        "--dataset-name-or-path",
        str(records),
        "--output-prefix",
        str(tmp_path / "out"),
        "--tokenizer-name-or-path",
        str(evil),
        "--workers",
        "1",
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(evil) in errors[0] and "EvilTokenizer" in errors[0]
    assert not marker.exists() and not list(tmp_path.glob("out*"))
