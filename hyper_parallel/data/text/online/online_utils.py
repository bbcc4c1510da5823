"""Opening data files with Hugging Face ``datasets`` for the Online sources, without running their code.

Owns: ``open_hf_dataset``: a file, glob, directory or ``save_to_disk`` folder as a random-access
``datasets.Dataset`` (Arrow cache under ``cache_dir``) or a streaming ``datasets.IterableDataset``, and a short
description of it for messages. Files may be objects at fsspec URLs (``s3://...``): a stream reads them where they
are; a random-access dataset reads local copies, in a folder of the cache named by each object's URL, size and
identity (ETag or version), so that an object uploaded again is copied and cached again, never served from the
cache of its old version. Also the two checks made before Hugging Face ``datasets`` reads or writes anything,
shared with the offline tools: ``refuse_loading_scripts`` (a ``datasets`` loading script beside the data is
never run) and ``refuse_cache_symlinks`` (the Arrow cache is never written through a symbolic link).
Not responsible for: finding the files or reading raw records (``text.records``, shared with the offline tools),
sampling, or DP sharding (the sources).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.indexed_data_reader import is_object_url
from hyper_parallel.data.indexed.object_storage import ObjectFile
from hyper_parallel.data.resume_checks import stable_hash
from hyper_parallel.data.text.records import (
    data_path_entries,
    is_saved_hf_dataset,
    resolve_data_files,
    select_hf_split,
)

__all__ = ["open_hf_dataset", "refuse_cache_symlinks", "refuse_loading_scripts"]

logger = get_logger(__name__)

# Our format name -> the Hugging Face ``datasets`` builder that reads it (the names happen to agree).
_HF_BUILDERS = {"json": "json", "parquet": "parquet", "csv": "csv", "arrow": "arrow", "text": "text"}

# The folder of the Hugging Face ``datasets`` cache where compressed local files are extracted.
_DOWNLOADS_DIR = "downloads"
# The folder of the cache that holds local copies of objects, one folder per object version.
_OBJECTS_DIR = "hp_data_objects"


def refuse_loading_scripts(path: Path, *, recursive: bool) -> None:
    """Refuse a Python file given as data, or a data directory that holds one: a ``datasets`` loading script is
    never run.

    Args:
        path: the file or directory the data is read from.
        recursive: also look in the directory's subdirectories (``load_dataset`` of a directory reads them too).

    Raises:
        DataConfigError: naming the first Python file found.
    """
    if path.is_dir():
        scripts = sorted(path.rglob("*.py") if recursive else path.glob("*.py"))
    else:
        scripts = [path] if path.suffix == ".py" else []
    if scripts:
        raise DataConfigError(
            f"{scripts[0]}: the data at {path} includes Python code (a Hugging Face datasets loading script); code "
            "from a data directory is never run. Convert the data to JSON lines, Parquet or Arrow files first (or "
            "write it with `Dataset.save_to_disk`) and point at those, without the script"
        )


def _symlinks_under(directory: str) -> Iterator[str]:
    """Every symbolic link below ``directory``, without following any."""
    pending = [directory]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                if entry.is_symlink():
                    yield entry.path
                elif entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)


def refuse_cache_symlinks(cache_dir: str | os.PathLike | None, builder_name: str) -> None:
    """Refuse a symbolic link where Hugging Face ``datasets`` is about to write the Arrow cache of a data set.

    The places checked are the cache's lock files, the builder's folder (``cache_dir/<builder_name>``, every
    config, version, Arrow file and lock below it) and the folder where compressed files are extracted. The
    configured directory itself may be a link (to a bigger disk, say); links inside it are refused, because
    ``datasets`` opens its files with ``O_TRUNC`` and would write through them into the file they point at.

    Args:
        cache_dir: the configured cache directory; None is the Hugging Face default (``HF_DATASETS_CACHE``,
            ``~/.cache/huggingface/datasets`` unless set).
        builder_name: the builder's folder name (``json``, ``parquet``..., or the snake-cased name of a dataset
            directory).

    Raises:
        DataFileError: naming the first link found.
    """
    if cache_dir is None:
        from datasets import config

        cache_dir = config.HF_DATASETS_CACHE
    root = Path(cache_dir).expanduser()
    if not root.is_dir():
        return  # nothing planted yet; datasets creates the directory
    watched = {builder_name, _DOWNLOADS_DIR}
    with os.scandir(root) as entries:
        top = [entry for entry in entries if entry.name in watched or entry.name.endswith(".lock")]
    links = [entry.path for entry in top if entry.is_symlink()]
    for entry in top:
        if not links and entry.name in watched and entry.is_dir(follow_symlinks=False):
            links.extend(_symlinks_under(entry.path))
    if links:
        raise DataFileError(
            f"{links[0]} is a symbolic link inside the Hugging Face datasets cache {root}, where the Arrow cache of "
            "this data set is written; the cache is never written through links. Remove the link (or set "
            "cache_dir to another directory)"
        )


def open_hf_dataset(
    data_path: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    streaming: bool,
    cache_dir: str | os.PathLike | None = None,
    split: str = "train",
):
    """Open data files with Hugging Face ``datasets``.

    Args:
        data_path: a JSON/JSONL/Parquet/CSV/Arrow/text file, a glob, a directory of such files, a list of those
            (read in the order given), or a local directory written by ``save_to_disk``; files and globs may be
            fsspec URLs.
        streaming: False gives a random-access ``datasets.Dataset`` (its Arrow cache is written under
            ``cache_dir``); True gives a ``datasets.IterableDataset`` read as it is iterated.
        cache_dir: where the Arrow cache goes; None is the Hugging Face default.
        split: the split of a saved ``DatasetDict``.

    Returns:
        The dataset and a short description of where it comes from, for messages.

    Raises:
        DataConfigError: a directory of the data holds a Python file (a loading script).
        DataFileError: the files cannot be read, or a symbolic link sits where the Arrow cache is written.
    """
    entries = data_path_entries(data_path)
    path = Path(entries[0]).expanduser()
    if len(entries) == 1 and path.is_dir() and is_saved_hf_dataset(path):
        from datasets import load_from_disk

        dataset = select_hf_split(load_from_disk(str(path)), split, path, "set split to one of them")
        if streaming:
            dataset = dataset.to_iterable_dataset(num_shards=max(1, len(dataset.cache_files)))
        return dataset, str(path)
    files, fmt = resolve_data_files(data_path)
    for entry in entries:
        if not is_object_url(entry):
            refuse_loading_scripts(Path(entry).expanduser(), recursive=False)
    refuse_cache_symlinks(cache_dir, _HF_BUILDERS[fmt])
    # A mapping source reads local copies of its objects; a stream reads them where they are, but for compressed
    # ones: datasets passes HTTP client options to the file system under its decompression, which s3fs refuses.
    copied = [
        file for file in files if isinstance(file, ObjectFile) and (not streaming or file.name.lower().endswith(".gz"))
    ]
    from datasets import load_dataset

    description = str(files[0]) if len(files) == 1 else f"{len(files)} {fmt} files matching {', '.join(entries)}"
    if copied:
        refuse_cache_symlinks(cache_dir, _OBJECTS_DIR)
        if streaming:
            logger.info(
                "%s: streaming %d compressed object(s) from local copies in the cache (%s bytes)",
                description,
                len(copied),
                f"{sum(file.size for file in copied):,}",
            )
        files = _local_copies(files, copied, cache_dir)
    try:
        dataset = load_dataset(
            _HF_BUILDERS[fmt],
            data_files=[str(f) for f in files],
            split="train",
            streaming=streaming,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            trust_remote_code=False,
        )
    except Exception as error:  # noqa: BLE001 - the builders raise many types; all get the file named
        raise DataFileError(f"{description}: Hugging Face datasets could not read it as {fmt} ({error})") from error
    return dataset, description


def _local_copies(files: Sequence, copied: Sequence[ObjectFile], cache_dir: str | os.PathLike | None) -> list:
    """``files`` with each object of ``copied`` replaced by its local copy, made unless there already; a copy lives
    in a folder of the cache named by the object's URL, size and identity, and is written under a temporary name,
    then renamed."""
    if cache_dir is None:
        from datasets import config

        cache_dir = config.HF_DATASETS_CACHE
    root = Path(cache_dir).expanduser() / _OBJECTS_DIR
    copies, missing = [], []
    for file in files:
        if file in copied:
            file_copy = root / stable_hash([file.url, file.size, file.identity])[:32] / file.name
            if not (file_copy.is_file() and file_copy.stat().st_size == file.size):
                missing.append((file, file_copy))
            file = file_copy
        copies.append(file)
    with tqdm(
        total=sum(file.size for file, _ in missing), unit="B", unit_scale=True, desc="copying objects", disable=None
    ) as progress:
        for file, file_copy in missing:
            file_copy.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=file_copy.parent, prefix=f".{file.name}.", suffix=".partial")
            try:
                with os.fdopen(handle, "wb") as out, file.open("rb") as stream:
                    while block := stream.read(4 << 20):
                        out.write(block)
                        progress.update(len(block))
                os.replace(temporary, file_copy)
            except BaseException:
                os.unlink(temporary)
                raise
    return copies
