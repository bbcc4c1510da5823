"""Specification of offline preparation from Hugging Face ``save_to_disk`` folders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.pair_metadata import read_pair_metadata
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.tools.huggingface_offline import load_hf_dataset, main, run_huggingface_offline
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig

from .test_offline_preparation import (
    encode_documents,
    make_records,
    pair_bytes,
    prepare,
    read_documents,
    write_jsonl,
)

RECORDS = make_records(11, seed=70)
OTHER_RECORDS = make_records(4, seed=71)


def run_hf(dataset_path: Path, output_prefix: Path, split: str = "train", **options):
    config = OfflinePreparationConfig(
        dataset_name_or_path=str(dataset_path),
        output_prefix=str(output_prefix),
        tokenizer_name_or_path=str(BUNDLED_TOKENIZER_PATH),
        workers=options.pop("workers", 1),
        chunk_size=options.pop("chunk_size", 4),
        **options,
    )
    return run_huggingface_offline(config, split=split)


@pytest.fixture(scope="module")
def jsonl_reference(tmp_path_factory) -> tuple[bytes, bytes]:
    """The output pair of ``RECORDS`` prepared from a JSONL file."""
    directory = tmp_path_factory.mktemp("hf_reference")
    summary = prepare(write_jsonl(directory / "in.jsonl", RECORDS), directory / "out")
    return pair_bytes(summary.outputs["text"])


@pytest.fixture(scope="module")
def saved_dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("saved") / "dataset"
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def saved_dataset_dict(tmp_path_factory) -> Path:
    """A DatasetDict whose ``test`` split holds ``RECORDS`` and whose ``train`` split holds other records."""
    path = tmp_path_factory.mktemp("saved") / "dataset_dict"
    splits = {"train": datasets.Dataset.from_list(OTHER_RECORDS), "test": datasets.Dataset.from_list(RECORDS)}
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return path


def test_saved_dataset_matches_the_jsonl_output(tmp_path, tokenizer, saved_dataset, jsonl_reference):
    """A ``Dataset.save_to_disk`` folder gives byte-identical outputs to the same records as JSONL."""
    summary = run_hf(saved_dataset, tmp_path / "out", workers=2)
    assert pair_bytes(summary.outputs["text"]) == jsonl_reference
    assert read_documents(summary.outputs["text"]) == encode_documents(tokenizer, [r["text"] for r in RECORDS])
    assert summary.records == len(RECORDS)


def test_metadata_and_existing_outputs_as_for_local_files(tmp_path, saved_dataset):
    """``prepare-hf`` writes the same ``.meta.json`` beside its pair as ``prepare`` does for the same tokenizer, and
    refuses to replace existing outputs without ``overwrite``."""
    summary = run_hf(saved_dataset, tmp_path / "hf")
    local = prepare(write_jsonl(tmp_path / "in.jsonl", RECORDS), tmp_path / "local")
    assert read_pair_metadata(summary.outputs["text"]) == read_pair_metadata(local.outputs["text"]) is not None
    with pytest.raises(DataConfigError, match=r"already has outputs .*hf_text_document\.idx.*--overwrite"):
        run_hf(saved_dataset, tmp_path / "hf")
    run_hf(saved_dataset, tmp_path / "hf", overwrite=True)


def test_dataset_dict_split_is_selected(tmp_path, saved_dataset_dict, jsonl_reference):
    """The requested split of a saved DatasetDict is the one prepared."""
    summary = run_hf(saved_dataset_dict, tmp_path / "out", split="test")
    assert pair_bytes(summary.outputs["text"]) == jsonl_reference


def test_text_template_reads_the_template_columns(tmp_path, tokenizer, saved_dataset):
    """A template renders the record from the dataset columns it names."""
    summary = run_hf(saved_dataset, tmp_path / "out", text_template="{title}: {text}")
    rendered = [f"{r['title']}: {r['text']}" for r in RECORDS]
    assert read_documents(summary.outputs["text"]) == encode_documents(tokenizer, rendered)


def test_instruction_records_give_the_pairs_of_the_same_jsonl_records(tmp_path):
    """The instruction fields are read as columns (a null input is none); an absent column is named."""
    records = [
        {"question": "Name a colour.", "context": None, "answer": "Blue.", "unused": 1},
        {"question": "Translate.", "context": "Good morning", "answer": "Bonjour.", "unused": 2},
    ]
    saved = tmp_path / "alpaca"
    datasets.Dataset.from_list(records).save_to_disk(str(saved))
    options = {"chat_template": "chatml", "instruction_key": "question", "input_key": "context", "output_key": "answer"}
    summary = run_hf(saved, tmp_path / "hf", **options)
    reference = prepare(write_jsonl(tmp_path / "alpaca.jsonl", records), tmp_path / "jsonl", **options)
    for key in ("text", "text_loss_mask"):
        assert pair_bytes(summary.outputs[key]) == pair_bytes(reference.outputs[key])
    with pytest.raises(DataFileError, match=r"missing key\(s\) \['input'\].*--input-key"):
        run_hf(saved, tmp_path / "other", **{**options, "input_key": "input"})


def test_unknown_split_is_a_config_error_listing_splits(tmp_path, saved_dataset_dict):
    """A split the DatasetDict lacks is a DataConfigError that lists the splits it has."""
    with pytest.raises(DataConfigError, match=r"has splits \['test', 'train'\], not 'validation'; pass --split"):
        run_hf(saved_dataset_dict, tmp_path / "out", split="validation")


def test_missing_column_is_a_data_file_error_listing_columns(tmp_path, saved_dataset):
    """A json key the dataset lacks is a DataFileError listing its columns; nothing is written."""
    with pytest.raises(
        DataFileError, match=r"missing key\(s\) \['body'\]; the dataset has columns \['text', 'title'\]"
    ):
        run_hf(saved_dataset, tmp_path / "out", json_keys=("body",))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("name", "message"),
    [("missing", r"no dataset at .*missing.*save_to_disk"), ("empty", r"could not load a Hugging Face dataset from")],
)
def test_path_without_a_dataset_is_a_data_file_error(tmp_path, name, message):
    """A missing path, or a directory holding no dataset, is a DataFileError explaining what to pass."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataFileError, match=message):
        load_hf_dataset(str(tmp_path / name))


def test_cli_reports_unknown_split_with_exit_code_2(tmp_path, capsys, saved_dataset_dict, restore_package_logger):
    """The command line reports a bad split as ``error: ...`` with exit code 2 and no traceback."""
    argv = ["--dataset-name-or-path", str(saved_dataset_dict), "--split", "dev", "--output-prefix", str(tmp_path / "o")]
    assert main(argv + ["--tokenizer-name-or-path", str(BUNDLED_TOKENIZER_PATH), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "not 'dev'" in err and "Traceback" not in err


def run_prepare_hf_command(dataset: Path, output_prefix: Path, hf_cache: Path) -> subprocess.CompletedProcess:
    """``hp-data prepare-hf`` in a fresh process with "y" on stdin, as a user answering a trust prompt would; the
    Hugging Face default cache is ``hf_cache``."""
    argv = [str(Path(sys.executable).with_name("hp-data")), "prepare-hf", "--dataset-name-or-path", str(dataset)]
    argv += ["--output-prefix", str(output_prefix), "--tokenizer-name-or-path", str(BUNDLED_TOKENIZER_PATH)]
    return subprocess.run(
        [*argv, "--workers", "1"],
        input="y\ny\n",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_DATASETS_CACHE": str(hf_cache)},
    )


@pytest.mark.parametrize("script", ["mydata/mydata.py", "mydata/loader.py", "mydata/train/helpers.py"])
def test_prepare_hf_refuses_a_dataset_directory_with_a_loading_script_and_never_runs_it(tmp_path, script):
    """A ``datasets`` loading script beside the data (the directory's own name, any other name, or in a
    subdirectory) is refused with exit code 2 naming it; the script never runs, even with "y" on stdin."""
    (tmp_path / "mydata" / "train").mkdir(parents=True)
    write_jsonl(tmp_path / "mydata" / "train" / "part.jsonl", RECORDS)
    marker = tmp_path / "marker"
    (tmp_path / script).write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    result = run_prepare_hf_command(tmp_path / "mydata", tmp_path / "out", tmp_path / "hf_cache")
    assert result.returncode == 2, result.stderr
    assert f"error: {tmp_path / script}" in result.stderr and "never run" in result.stderr
    assert "JSON lines, Parquet or Arrow" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists() and not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("planted", ["builder folder", "lock file"])
def test_prepare_hf_refuses_a_symlink_in_the_arrow_cache_of_a_dataset_directory(tmp_path, planted):
    """The Arrow cache of a dataset directory goes to the Hugging Face default cache, in a folder named after the
    directory (snake-cased); a link planted there is refused and the file it points at is left unchanged."""
    (tmp_path / "MyData").mkdir()
    write_jsonl(tmp_path / "MyData" / "train.jsonl", RECORDS)
    hf_cache = tmp_path / "hf_cache"
    assert run_prepare_hf_command(tmp_path / "MyData", tmp_path / "first", hf_cache).returncode == 0
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"outside the cache\n")
    link = hf_cache / "my_data" if planted == "builder folder" else next(hf_cache.glob("*.lock"))
    if link.is_dir():
        link.rename(tmp_path / "moved")
    else:
        link.unlink()
    link.symlink_to(victim)
    result = run_prepare_hf_command(tmp_path / "MyData", tmp_path / "second", hf_cache)
    assert result.returncode == 2, result.stderr
    assert f"error: {link} is a symbolic link" in result.stderr and "Remove the link" in result.stderr
    assert victim.read_bytes() == b"outside the cache\n"
