"""Specification of what offline preparation writes, and when: existing outputs, output locations that cannot be
written, temporaries of dead runs, all-or-nothing publication of partitions, and the metadata beside each pair."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
from file_limits import file_size_limit

from hyper_parallel.data import __version__
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.file_writes import temporary_path
from hyper_parallel.data.indexed.pair_metadata import partition_prefixes
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.tools.offline_preparation import main

from .test_offline_preparation import (
    PAIR_FILES,
    encode_documents,
    leftover_files,
    make_records,
    pair_bytes,
    prepare,
    read_documents,
    write_jsonl,
)

# ``main`` gives the package logger its own handler on the current stderr: undo that after each test.
pytestmark = pytest.mark.usefixtures("restore_package_logger")


def cli(data: Path | str, output_prefix: Path | str, *extra: str) -> int:
    argv = ["--dataset-name-or-path", str(data), "--output-prefix", str(output_prefix)]
    argv += ["--tokenizer-name-or-path", str(BUNDLED_TOKENIZER_PATH), "--workers", "1", *extra]
    return main(argv)


def assert_one_line_error(err: str, *fragments: str) -> None:
    """The command's normal error: one ``error: ...`` line, no traceback."""
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def temporary_of(path: Path, pid: int) -> Path:
    """``path``'s temporary name as process ``pid`` of this host would write it."""
    own = temporary_path(path)
    return own.with_name(own.name.rsplit("-", 1)[0] + f"-{pid}")


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.fixture
def mount_tmpfs(tmp_path):
    """Mount a small tmpfs (needs root, or skips); unmounted after the test."""
    mounted = []

    def mount(name: str, options: str) -> Path:
        directory = tmp_path / name
        directory.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)], capture_output=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
        mounted.append(directory)
        return directory

    yield mount
    for directory in mounted:
        subprocess.run(["umount", "-l", str(directory)], check=False)


# -- existing outputs ----------------------------------------------------------------------------------------------


def test_existing_outputs_are_refused_before_anything_is_read(tmp_path, capsys):
    """A second run over the same prefix is refused, naming the existing files and the two ways out, before the
    tokenizer or the input is even opened (both are missing here); the first outputs are untouched."""
    first = prepare(write_jsonl(tmp_path / "in.jsonl", make_records(4, seed=1)), tmp_path / "out")
    before = pair_bytes(first.outputs["text"])

    with pytest.raises(DataConfigError) as error:
        prepare(tmp_path / "missing.jsonl", tmp_path / "out", tokenizer_name_or_path=str(tmp_path / "no_tokenizer"))
    message = str(error.value)
    for fragment in ("out_text_document.idx", "out_text_document.bin", "out_text_document.meta.json"):
        assert fragment in message
    assert "--overwrite" in message and "choose another --output-prefix" in message

    assert cli(tmp_path / "in.jsonl", tmp_path / "out") == 2
    assert_one_line_error(capsys.readouterr().err, "already has outputs", "--overwrite")
    assert pair_bytes(first.outputs["text"]) == before


def test_overwrite_replaces_the_outputs(tmp_path, tokenizer):
    """With ``overwrite`` the new outputs replace the old ones."""
    prepare(write_jsonl(tmp_path / "a.jsonl", make_records(4, seed=2)), tmp_path / "out")
    records = make_records(6, seed=3)
    summary = prepare(write_jsonl(tmp_path / "b.jsonl", records), tmp_path / "out", overwrite=True)
    assert read_documents(summary.outputs["text"]) == encode_documents(tokenizer, [r["text"] for r in records])
    assert leftover_files(tmp_path) == []


def test_overwrite_removes_a_manifest_that_no_longer_describes_the_outputs(tmp_path):
    """Replacing a run that kept its partitions with one that does not removes the old manifest, so the old
    partition pairs are no longer presented as the parts of the new merged pair."""
    data = write_jsonl(tmp_path / "in.jsonl", make_records(6, seed=4))
    prepare(data, tmp_path / "out", partitions=2, keep_partition_files=True)
    summary = prepare(data, tmp_path / "out", overwrite=True)
    with pytest.raises(DataFileError, match="no partition manifest"):
        partition_prefixes(summary.outputs["text"])


# -- where the outputs go ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["existing-directory", "trailing-slash"])
def test_a_directory_as_output_prefix_is_refused(tmp_path, capsys, form):
    """An existing directory, or a path ending with '/', is refused with a message asking for a file stem inside
    it; nothing is created."""
    data = write_jsonl(tmp_path / "in.jsonl", make_records(2, seed=5))
    if form == "existing-directory":
        (tmp_path / "outdir").mkdir()
        prefix = str(tmp_path / "outdir")
    else:
        prefix = str(tmp_path / "outdir") + "/"
    with pytest.raises(DataConfigError, match=r"is a directory; give a file stem inside it, such as .*outdir/corpus"):
        prepare(data, prefix)
    assert cli(data, prefix) == 2
    assert_one_line_error(capsys.readouterr().err, "is a directory", "outdir/corpus")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"] + (["outdir"] if form != "trailing-slash" else [])
    if form == "existing-directory":
        assert list((tmp_path / "outdir").iterdir()) == []


@pytest.fixture
def unwritable_directory(tmp_path, mount_tmpfs):
    """A directory this process cannot create files in: read-only for a normal user, a read-only mount for root."""
    if os.geteuid() == 0:
        return mount_tmpfs("readonly", "ro,size=64k")
    directory = tmp_path / "readonly"
    directory.mkdir()
    directory.chmod(0o555)
    return directory


@pytest.mark.parametrize("below", ["", "new/sub"], ids=["directory", "missing-subdirectory"])
def test_unwritable_output_directory_is_the_normal_error(tmp_path, capsys, unwritable_directory, below):
    """An output directory that cannot be written (or created) is rc 2 with one line naming it and the fix, before
    anything is tokenized; nothing is created."""
    data = write_jsonl(tmp_path / "in.jsonl", make_records(2, seed=6))
    prefix = unwritable_directory / below / "out" if below else unwritable_directory / "out"
    assert cli(data, prefix) == 2
    assert_one_line_error(capsys.readouterr().err, f"cannot write {unwritable_directory}", "write the output elsewhere")
    assert list(unwritable_directory.iterdir()) == []


def test_full_disk_is_the_normal_error_and_leaves_nothing(tmp_path, capsys, corpus_path, mount_tmpfs):
    """Preparing the bundled corpus (about 0.5 MB of tokens) onto a 64 KiB file system fails with rc 2, one line
    naming the file and the fix, and removes what it wrote."""
    full = mount_tmpfs("small", "size=64k")
    assert cli(corpus_path, full / "out") == 2
    assert_one_line_error(
        capsys.readouterr().err, f"cannot write {full / 'out_text_document.bin'}", "No space left on device"
    )
    assert list(full.iterdir()) == []


def test_a_write_that_fails_part_way_is_a_data_file_error(tmp_path, corpus_path):
    """The same without mounting: past the process's file size limit a write fails (EFBIG) as it does on a full
    disk. The error names the file and the fix, and nothing is left."""
    prefix = tmp_path / "out"
    with file_size_limit(64 << 10), pytest.raises(DataFileError, match=r"cannot write .*out_text_document\.bin: File"):
        prepare(corpus_path, prefix)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# -- temporaries of dead runs --------------------------------------------------------------------------------------


def test_temporaries_of_dead_runs_are_swept_at_the_start(tmp_path, caplog):
    """A run removes the temporaries of its own output names left by dead processes of this host, with a log line;
    those of live processes, of other hosts and of other prefixes stay."""
    caplog.set_level(logging.WARNING, logger="hyper_parallel.data")
    dead = dead_pid()
    stale = [
        temporary_of(tmp_path / "out_text_document.bin", dead),
        temporary_of(tmp_path / "out_1_text_document.idx", dead),
    ]
    kept = [
        temporary_of(tmp_path / "out_text_document.idx", os.getppid()),  # a live process: a concurrent run
        tmp_path / f"out_text_document.bin.tmp-otherhost-{dead}",
        temporary_of(tmp_path / "outer_text_document.bin", dead),
    ]
    for path in stale + kept:
        path.write_bytes(b"partial")

    prepare(write_jsonl(tmp_path / "in.jsonl", make_records(4, seed=7)), tmp_path / "out", partitions=2)

    assert not any(path.exists() for path in stale)
    assert all(path.exists() for path in kept)
    swept = [r.getMessage() for r in caplog.records if "left in" in r.getMessage()]
    assert len(swept) == 1 and swept[0].startswith("removed 2 temporary file(s)")
    assert stale[0].name in swept[0]


# -- partitions are published all at once --------------------------------------------------------------------------


def test_partitions_are_not_published_when_the_merge_fails(tmp_path):
    """Partition pairs appear at their final names only with the merged pair: a merge that fails (the merged .bin
    is the one file past the process's file size limit, as if the disk filled at that moment) leaves no partition
    pair, manifest or temporary."""
    data = write_jsonl(tmp_path / "in.jsonl", make_records(300, seed=8))
    options = {"partitions": 3, "keep_partition_files": True, "chunk_size": 20}
    reference = prepare(data, tmp_path / "reference" / "out", **options).outputs["text"]
    merged_bin = Path(f"{reference}.bin")
    others = [p.stat().st_size for p in (tmp_path / "reference").iterdir() if p != merged_bin]
    assert max(others) < merged_bin.stat().st_size  # the limit below fails the merge only

    with file_size_limit(max(others)), pytest.raises(DataFileError, match="out_text_document.bin: File too large"):
        prepare(data, tmp_path / "out", **options)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "reference"]


def test_kept_partitions_are_listed_by_a_manifest(tmp_path, tokenizer):
    """With ``keep_partition_files`` the manifest lists the partition pairs in merge order with their counts."""
    records = make_records(7, seed=9)
    summary = prepare(
        write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out", partitions=3, keep_partition_files=True
    )
    merged = summary.outputs["text"]
    prefixes = partition_prefixes(merged)
    assert prefixes == [str(tmp_path / f"out_{p}_text_document") for p in range(3)]
    documents = encode_documents(tokenizer, [r["text"] for r in records])
    assert (
        [doc for prefix in prefixes for doc in read_documents(prefix)]
        == read_documents(merged)
        == [documents[i] for p in range(3) for i in range(p, len(records), 3)]
    )
    manifest = json.loads(Path(f"{merged}.partitions.json").read_text())
    assert [entry["documents"] for entry in manifest["partitions"]] == [3, 2, 2]
    assert manifest["merged"] == "out_text_document"


# -- metadata beside each pair -------------------------------------------------------------------------------------


def test_each_published_pair_has_its_tokenizer_metadata(tmp_path, tokenizer):
    """Every published pair (merged and kept partitions) has ``<prefix>.meta.json`` with the tokenizer's vocabulary
    fingerprint, vocabulary size, EOD id, the token dtype and the library version."""
    summary = prepare(
        write_jsonl(tmp_path / "in.jsonl", make_records(5, seed=10)),
        tmp_path / "out",
        partitions=2,
        keep_partition_files=True,
        token_dtype="int32",
    )
    expected = {
        "format": 1,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "vocab_size": 8192,
        "eod_id": 0,
        "token_dtype": "int32",
        "tokenizer": str(BUNDLED_TOKENIZER_PATH),
        "library_version": __version__,
    }
    for prefix in [summary.outputs["text"], *partition_prefixes(summary.outputs["text"])]:
        assert json.loads(Path(f"{prefix}.meta.json").read_text()) == expected
    assert sorted(p.name for p in tmp_path.glob("out_text_document.*")) == sorted(
        [f"out_text_document.{ext}" for ext in PAIR_FILES] + ["out_text_document.partitions.json"]
    )
