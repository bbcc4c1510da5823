"""The Online path runs no code from a data directory and never writes its Arrow cache through a symbolic link."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.text.build_dataset import build_online_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.text.online.online_utils import open_hf_dataset

RECORDS = [{"text": f"record number {index}"} for index in range(7)]
VICTIM_BYTES = b"a file outside the cache that no config names\n"


def write_records(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in RECORDS), encoding="utf-8")
    return path


def loading_script(path: Path, marker: Path) -> Path:
    """A loading script that would leave ``marker`` behind if anything ran it."""
    path.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n", encoding="utf-8")
    return path


def transform() -> dict:
    return {"data_type": "plaintext", "max_seq_len": 64}


@pytest.mark.parametrize("script_name", ["mydata.py", "loader.py", "__init__.py"])
def test_a_loading_script_beside_the_data_is_refused_and_never_run(tmp_path, script_name):
    data = tmp_path / "mydata"
    write_records(data / "train.jsonl")
    marker = tmp_path / "marker"
    script = loading_script(data / script_name, marker)
    with pytest.raises(DataConfigError) as raised:
        build_online_text_dataset(
            data_path=str(data),
            data_transform=transform(),
            tokenizer=str(BUNDLED_TOKENIZER_PATH),
            data_config={"cache_dir": str(tmp_path / "cache")},
        )
    message = str(raised.value)
    assert str(script) in message and "JSON lines, Parquet or Arrow" in message and "save_to_disk" in message
    assert not marker.exists()


@pytest.mark.parametrize("streaming", [False, True])
def test_a_directory_in_a_data_path_list_with_a_script_is_refused(tmp_path, streaming):
    clean = write_records(tmp_path / "clean" / "a.jsonl")
    data = tmp_path / "scripted"
    write_records(data / "b.jsonl")
    script = loading_script(data / "scripted.py", tmp_path / "marker")
    with pytest.raises(DataConfigError, match=str(script)):
        open_hf_dataset([clean, data], streaming=streaming, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "marker").exists()


def test_a_glob_of_data_files_beside_a_script_is_read(tmp_path):
    """Naming the data files themselves is how to read data kept beside a script."""
    data = tmp_path / "mydata"
    write_records(data / "train.jsonl")
    loading_script(data / "mydata.py", tmp_path / "marker")
    dataset, _ = open_hf_dataset(str(data / "*.jsonl"), streaming=False, cache_dir=tmp_path / "cache")
    assert [row["text"] for row in dataset] == [record["text"] for record in RECORDS]
    assert not (tmp_path / "marker").exists()


# -- the Arrow cache -----------------------------------------------------------------------------------------------


def populated_cache(tmp_path: Path) -> tuple[Path, Path]:
    """The data file and a cache directory that already holds its Arrow cache."""
    data = write_records(tmp_path / "data" / "train.jsonl")
    cache = tmp_path / "cache"
    open_hf_dataset(data, streaming=False, cache_dir=cache)
    return data, cache


def plant_link(at: Path, victim: Path) -> None:
    if at.is_dir():
        os.rename(at, at.with_name(at.name + ".moved"))
    elif at.exists():
        at.unlink()
    at.symlink_to(victim)


def cache_entry(cache: Path, kind: str) -> Path:
    """A path in the cache where datasets writes for this data set: its lock file, builder folder and so on."""
    if kind == "top-level lock":
        return next(cache.glob("*.lock"))
    if kind == "builder folder":
        return cache / "json"
    if kind == "config folder":
        return next((cache / "json").iterdir())
    if kind == "arrow file":
        return next(cache.rglob("*.arrow"))
    if kind == "builder lock":
        return next(cache.rglob("*_builder.lock"))
    if kind == "dataset_info.json":
        return next(cache.rglob("dataset_info.json"))
    raise AssertionError(kind)


KINDS = ["top-level lock", "builder folder", "config folder", "arrow file", "builder lock", "dataset_info.json"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("streaming", [False, True])
def test_a_symlink_planted_in_the_arrow_cache_is_refused_and_its_target_unchanged(tmp_path, kind, streaming):
    data, cache = populated_cache(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM_BYTES)
    link = cache_entry(cache, kind)
    plant_link(link, victim)
    with pytest.raises(DataFileError) as raised:
        open_hf_dataset(data, streaming=streaming, cache_dir=cache)
    message = str(raised.value)
    assert str(link) in message and "symbolic link" in message and "Remove the link" in message
    assert victim.read_bytes() == VICTIM_BYTES


def test_a_dangling_symlink_at_a_lock_name_of_an_empty_cache_is_refused(tmp_path):
    """A link planted before the first load, at the name the lock will have, points at a file yet to exist."""
    data, cache = populated_cache(tmp_path)
    lock = cache_entry(cache, "top-level lock")
    for entry in cache.iterdir():
        if entry != lock:
            subprocess.run(["rm", "-rf", str(entry)], check=True)
    victim = tmp_path / "created_outside"
    plant_link(lock, victim)
    with pytest.raises(DataFileError, match=f"{lock} is a symbolic link.*Remove the link"):
        build_online_text_dataset(
            data_path=str(data),
            data_transform=transform(),
            tokenizer=str(BUNDLED_TOKENIZER_PATH),
            data_config={"cache_dir": str(cache)},
        )
    assert not victim.exists()


def test_a_cache_dir_that_is_itself_a_symlink_is_used(tmp_path):
    """A whole cache directory moved to a bigger disk and linked back is a legitimate setup."""
    data = write_records(tmp_path / "data" / "train.jsonl")
    real = tmp_path / "big_disk" / "cache"
    real.mkdir(parents=True)
    (tmp_path / "cache").symlink_to(real, target_is_directory=True)
    for _ in range(2):  # writes the cache, then reads it back
        dataset, _ = open_hf_dataset(data, streaming=False, cache_dir=tmp_path / "cache")
        assert [row["text"] for row in dataset] == [record["text"] for record in RECORDS]
    assert list(real.rglob("*.arrow"))


def test_links_outside_the_data_sets_cache_folders_are_left_alone(tmp_path):
    """Another builder's folder is not where this data set writes."""
    data, cache = populated_cache(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (cache / "parquet").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    dataset, _ = open_hf_dataset(data, streaming=False, cache_dir=cache)
    assert len(dataset) == len(RECORDS)


def test_the_hugging_face_default_cache_is_checked_when_no_cache_dir_is_set(tmp_path):
    """Without cache_dir the Arrow cache goes to HF_DATASETS_CACHE, read when datasets is imported: a fresh process."""
    data = write_records(tmp_path / "data" / "train.jsonl")
    default_cache = tmp_path / "hf_default"
    (default_cache / "json").mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM_BYTES)
    link = default_cache / "json" / "default-0123456789abcdef"
    link.symlink_to(victim)
    code = (
        "from hyper_parallel.data.text.online.online_utils import open_hf_dataset\n"
        f"open_hf_dataset({str(data)!r}, streaming=False)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "HF_DATASETS_CACHE": str(default_cache)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "DataFileError" in result.stderr and str(link) in result.stderr
    assert victim.read_bytes() == VICTIM_BYTES
