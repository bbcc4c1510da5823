"""Specification: no file is written through a symbolic link, whatever name it is planted at.

A link planted at a name the library writes (a cache lock, an index cache array or description, an offline
``.bin``/``.idx``/``.meta.json``/manifest, the sequences-per-dataset file, or the temporary name of any of them
for this host and process) and pointing at a file outside is refused with a ``DataFileError`` naming the link and
the fix; the file it points at is left byte for byte as it was, and the link itself stays where it was put.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.file_writes import atomic_output, remove_stale_temporaries, temporary_path, write_atomically
from hyper_parallel.data.indexed.index_cache import CacheOptions, IndexCache
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.parallel.build_barrier import exclusive_file_lock
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.tools.cli import main as hp_data
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
from hyper_parallel.data.tools.offline_preparation import run_offline_preparation

OUTSIDE_BYTES = b"a file outside every directory the library writes\n"
ARRAYS = ("document_index", "sample_index", "shuffle_index")


@pytest.fixture
def outside(tmp_path) -> Path:
    """The file every planted link points at; its bytes must never change."""
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_bytes(OUTSIDE_BYTES)
    return path


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def assert_refused(error: pytest.ExceptionInfo, link: Path, outside: Path) -> None:
    message = str(error.value)
    assert message.startswith(f"{link} is a symbolic link to {outside}: files are never written through a link")
    assert f"remove the link (rm '{link}')" in message
    assert outside.read_bytes() == OUTSIDE_BYTES
    assert link.is_symlink() and os.readlink(link) == str(outside)


# -- index caches ---------------------------------------------------------------------------------------------------


def _entry(directory: Path) -> IndexCache:
    return IndexCache(directory, "GPTDataset", "train", {"class": "GPTDataset", "case": "planted links"})


def _build(cache: IndexCache):
    return cache.get_or_build(ARRAYS, lambda: {name: np.arange(10 + i) for i, name in enumerate(ARRAYS)})


def _entry_file(cache: IndexCache, kind: str) -> Path:
    """The name of one file kind of the entry: its lock, an array, its description, or a temporary of this pid."""
    if kind == "lock":
        return cache.directory / f"{cache.key}-GPTDataset-train.lock"
    name, _, temporary = kind.partition(":")
    return temporary_path(cache.path(name)) if temporary else cache.path(name)


ENTRY_FILES = ["lock", *ARRAYS, "description", "shuffle_index:temporary", "description:temporary"]


@pytest.mark.parametrize("kind", ENTRY_FILES)
def test_a_link_at_a_name_of_a_new_cache_entry_is_refused(tmp_path, outside, kind):
    cache = _entry(tmp_path / "cache")
    link = plant(_entry_file(cache, kind), outside)

    with pytest.raises(DataFileError) as error:
        _build(cache)

    assert_refused(error, link, outside)
    description = cache.path("description")
    assert description == link or not description.exists()  # nothing was published


@pytest.mark.parametrize("kind", [*ARRAYS, "description"])
@pytest.mark.parametrize("defer", [False, True], ids=["eager", "deferred"])
def test_a_link_put_in_place_of_a_file_of_a_built_entry_is_refused(tmp_path, outside, kind, defer):
    """Even a link to a byte-identical copy of the file it replaces is refused, on load or first access."""
    cache = _entry(tmp_path / "cache")
    _build(cache)
    replaced = cache.path(kind)
    outside.write_bytes(replaced.read_bytes())
    original = outside.read_bytes()
    replaced.unlink()
    replaced.symlink_to(outside)

    with pytest.raises(DataFileError) as error:
        arrays = _entry(tmp_path / "cache").get_or_build(ARRAYS, lambda: {}, CacheOptions(defer=defer))
        arrays["shuffle_index"]

    assert str(error.value).startswith(f"{replaced} is a symbolic link to {outside}")
    assert outside.read_bytes() == original and replaced.is_symlink()


def test_a_link_at_a_lock_file_is_never_truncated_through(tmp_path, outside):
    """The lock records its holder by truncating and writing the file: through a link that would empty the target."""
    link = plant(tmp_path / "cache" / "entry.lock", outside)

    with pytest.raises(DataFileError) as error, exclusive_file_lock(link):
        pass

    assert_refused(error, link, outside)


@pytest.mark.parametrize(
    ("make", "expected"),
    [(os.mkfifo, "the lock file {} is not a regular file; remove it"), (os.mkdir, "cannot write {}: Is a directory")],
    ids=["fifo", "directory"],
)
def test_a_lock_name_that_is_not_a_regular_file_is_refused(tmp_path, make, expected):
    lock = tmp_path / "entry.lock"
    make(lock)
    with pytest.raises(DataFileError) as error, exclusive_file_lock(lock):
        pass
    assert str(error.value).startswith(expected.format(lock))


# -- offline outputs ------------------------------------------------------------------------------------------------


def _prepare(data: Path, prefix: Path, **options):
    config = OfflinePreparationConfig(
        dataset_name_or_path=str(data),
        output_prefix=str(prefix),
        tokenizer_name_or_path=str(BUNDLED_TOKENIZER_PATH),
        workers=1,
        **options,
    )
    return run_offline_preparation(config)


OFFLINE_FILES = [
    "out_text_document.bin",
    "out_text_document.idx",
    "out_text_document.meta.json",
    "out_text_document.partitions.json",
    "out_1_text_document.idx",
    "out_0_text_document.meta.json",
    "out_text_document.bin:temporary",
    "out_text_document.idx:temporary",
    "out_2_text_document.bin:temporary",
    "out_text_document.meta.json:temporary",
]


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("name", OFFLINE_FILES)
def test_a_link_at_an_offline_output_name_is_refused_before_tokenizing(tmp_path, outside, name, overwrite):
    data = tmp_path / "in.jsonl"
    data.write_text('{"text": "one record"}\n{"text": "and another one"}\n', encoding="utf-8")
    final, _, temporary = name.partition(":")
    link = tmp_path / final
    link = plant(temporary_path(link) if temporary else link, outside)

    with pytest.raises(DataFileError) as error:
        _prepare(data, tmp_path / "out", partitions=3, keep_partition_files=True, overwrite=overwrite)

    assert_refused(error, link, outside)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["elsewhere", "in.jsonl", link.name])


def test_the_builder_refuses_links_at_its_final_and_temporary_names(tmp_path, outside):
    """Directly: at the ``.bin`` when it is made, at the ``.idx`` and a companion when it is sealed; a refused
    seal leaves the link where it is when the builder is aborted."""
    prefix = tmp_path / "pair"
    bin_link = plant(Path(f"{prefix}.bin"), outside)
    with pytest.raises(DataFileError) as error:
        IndexedDatasetBuilder(bin_link)
    assert_refused(error, bin_link, outside)
    bin_link.unlink()

    for link in (Path(f"{prefix}.idx"), temporary_path(f"{prefix}.idx"), Path(f"{prefix}.meta.json")):
        plant(link, outside)
        with IndexedDatasetBuilder(f"{prefix}.bin") as builder, pytest.raises(DataFileError) as error:
            builder.add_document(np.arange(5), [5])
            builder.finalize(f"{prefix}.idx", {Path(f"{prefix}.meta.json"): b"{}"})
        assert_refused(error, link, outside)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", link.name]
        link.unlink()


def test_a_link_planted_at_a_final_name_after_sealing_publishes_nothing(tmp_path, outside):
    prefix = tmp_path / "pair"
    builder = IndexedDatasetBuilder(f"{prefix}.bin")
    builder.add_document(np.arange(5), [5])
    builder.seal(f"{prefix}.idx")
    link = plant(Path(f"{prefix}.bin"), outside)

    with pytest.raises(DataFileError) as error:
        builder.publish()

    assert_refused(error, link, outside)
    builder.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "pair.bin"]


# -- single files: the sequences-per-dataset file, reports, plots ---------------------------------------------------


@pytest.mark.parametrize("temporary", [False, True], ids=["final", "temporary"])
def test_a_link_at_a_single_output_file_is_refused(tmp_path, outside, temporary):
    target = tmp_path / "report.json"
    link = plant(temporary_path(target) if temporary else target, outside)

    with pytest.raises(DataFileError) as error:
        write_atomically(target, b"{}")
    assert_refused(error, link, outside)

    with pytest.raises(DataFileError) as error, atomic_output(target) as name:
        name.write_bytes(b"{}")
    assert_refused(error, link, outside)

    # Once the link is removed: a regular file at this process's temporary name is a dead process's leftover.
    link.unlink()
    temporary_path(target).write_bytes(b"left by a dead process that had this id")
    write_atomically(target, b"{}")
    assert target.read_bytes() == b"{}" and not temporary_path(target).exists()


COMMANDS = {
    "sequences-per-dataset": ("sequences.json", ["--data-path", "{prefix}", "--per-dataset-sequences-path", "{out}"]),
    "config-reference": ("reference.md", ["--output", "{out}"]),
    "inspect": ("lengths.png", ["{prefix}", "--histogram", "{out}"]),
}


@pytest.mark.usefixtures("restore_package_logger")  # a command's main gives the package logger its own handler
@pytest.mark.parametrize("temporary", [False, True], ids=["final", "temporary"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_link_at_a_command_output_file_is_the_normal_error(tmp_path, outside, capsys, command, temporary):
    """``hp-data`` commands that write one file: rc 2 and one ``error:`` line naming the link."""
    prefix = tmp_path / "a_text_document"
    with IndexedDatasetBuilder(f"{prefix}.bin") as builder:
        builder.add_document(np.arange(4), [4])
        builder.finalize(f"{prefix}.idx")
    name, arguments = COMMANDS[command]
    output = tmp_path / name
    link = plant(temporary_path(output) if temporary else output, outside)

    code = hp_data([command, *(a.format(prefix=prefix, out=output) for a in arguments)])

    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and "Traceback" not in err
    assert line.startswith(f"error: {link} is a symbolic link to {outside}")
    assert outside.read_bytes() == OUTSIDE_BYTES and link.is_symlink()


# -- temporaries of dead processes ------------------------------------------------------------------------------


def test_sweeping_stale_temporaries_leaves_links_alone(tmp_path, outside):
    """A link named like the temporary of a dead process of this host is not one of ours: it is not removed."""
    process = subprocess.Popen(["true"])
    process.wait()
    own = temporary_path(tmp_path / "out.bin")
    stale_link = own.with_name(own.name.rsplit("-", 1)[0] + f"-{process.pid}")
    plant(stale_link, outside)

    assert remove_stale_temporaries([tmp_path / "out.bin"]) == []
    assert stale_link.is_symlink() and outside.read_bytes() == OUTSIDE_BYTES
