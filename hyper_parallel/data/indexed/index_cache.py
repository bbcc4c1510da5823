"""On-disk caches of index arrays (document, sample, shuffle and blending indices).

Owns: the cache key, the file names, atomic publication and loading. The key is the MD5 of a JSON description
(saved beside the arrays, indented) that lists every setting that changes the arrays, unlike megatron-core's,
whose key omits ``add_extra_token_to_sequence`` and others, so that it silently reuses stale indices. Arrays are
written under temporary names and renamed; the description is written last and marks the entry complete. One
process builds while the others wait (``parallel.build_barrier``); everyone then memory-maps the files.
Not responsible for: computing the arrays (``indexed_helpers``) or deciding what they mean (the datasets).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path

import numpy as np

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.parallel.build_barrier import build_once, process_group_ready

__all__ = ["IndexCache", "LazyArrays", "writable_directory"]

logger = get_logger("hyper_parallel.data.indexed.index_cache")

# The hashed form of a description: compact, by json's C encoder; one instance, since making one per key costs
# microseconds at start-up with thousands of prefixes. Same output as ``json.dumps(d, separators=(",", ":"))``.
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))


class LazyArrays(Mapping):
    """Index arrays memory-mapped on first access (``defer_npy_index_mmap``).

    Args:
        names: the arrays of the entry.
        path_of: gives an array's file; called on its first access.
    """

    def __init__(self, names: tuple[str, ...], path_of: Callable[[str], str]) -> None:
        self._names = names
        self._path_of = path_of
        self._arrays: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            if name not in self._names:
                raise KeyError(name)
            # A plain ndarray view: indexing a np.memmap subclass costs microseconds per call.
            self._arrays[name] = np.load(self._path_of(name), mmap_mode="r", allow_pickle=False).view(np.ndarray)
        return self._arrays[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def writable_directory(directory: Path) -> bool:
    """Whether ``directory`` exists (or can be created) and accepts new files."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            return True
    except OSError:
        return False


class IndexCache:
    """One cache entry: ``<dir>/<md5>-<kind>-<split>-{description.txt,<name>.npy}``.

    Args:
        directory: the cache directory, or None to keep arrays in memory only.
        kind: the dataset class name, e.g. ``"GPTDataset"``.
        split: ``"train"``, ``"valid"`` or ``"test"``.
        description: every setting that determines the arrays; serialised with ``json.dumps(indent=4)``.
    """

    def __init__(self, directory: str | os.PathLike | None, kind: str, split: str, description: dict) -> None:
        self.description = description
        self._directory_text = None if directory is None else os.fspath(directory)
        self._kind_split = f"{kind}-{split}"

    @cached_property
    def key(self) -> str:
        """The MD5 of the compact description, computed when first needed: a deferred load needs it only when an
        array is first read, which keeps start-up with thousands of sources cheap."""
        compact = _COMPACT_JSON.encode(self.description)  # the indented, readable form is written at build time
        return hashlib.md5(compact.encode("utf-8"), usedforsecurity=False).hexdigest()

    @cached_property
    def _stem(self) -> str:
        return f"{self.key}-{self._kind_split}"

    @property
    def directory(self) -> Path | None:
        return None if self._directory_text is None else Path(self._directory_text)

    def path(self, name: str) -> Path:
        assert self.directory is not None
        return Path(self._file(name))

    def _file(self, name: str) -> str:
        suffix = "txt" if name == "description" else "npy"
        return f"{self._directory_text}/{self._stem}-{name}.{suffix}"

    def is_complete(self, names: tuple[str, ...]) -> bool:
        return all(os.path.isfile(self._file(name)) for name in (*names, "description"))

    def _publish(self, arrays: dict[str, np.ndarray]) -> None:
        for name, array in arrays.items():
            with self._temporary(name) as temporary, open(temporary, "wb") as f:
                np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        with self._temporary("description") as temporary:
            # last: marks the entry complete
            temporary.write_text(json.dumps(self.description, indent=4), encoding="utf-8")

    @contextmanager
    def _temporary(self, name: str) -> Iterator[Path]:
        """A temporary name for ``name``'s file, renamed into place on success and removed on failure."""
        final = self.path(name)
        temporary = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        try:
            yield temporary
            os.replace(temporary, final)
        finally:
            temporary.unlink(missing_ok=True)

    def load(self, names: tuple[str, ...], defer: bool = False) -> Mapping[str, np.ndarray]:
        """Memory-map the arrays now, or on first access with ``defer``."""
        arrays = LazyArrays(names, self._file)
        if not defer:
            for name in names:
                arrays[name]  # noqa: B018 - map now
        return arrays

    def get_or_build(
        self,
        names: tuple[str, ...],
        build: Callable[[], dict[str, np.ndarray]],
        *,
        assume_complete: bool = False,
        defer: bool = False,
        synchronize: bool = True,
    ) -> Mapping[str, np.ndarray]:
        """Load the entry, building it first if needed (once, whoever else asks at the same time).

        Args:
            names: the arrays of the entry.
            build: computes them.
            assume_complete: skip existence checks and waiting (``fast_cache_load``).
            defer: map the files on first access (``defer_npy_index_mmap``).
            synchronize: hold other ranks while rank 0 builds (every rank must then call this).
        """
        if self._directory_text is None:
            return build()
        if assume_complete or (not (synchronize and process_group_ready()) and self.is_complete(names)):
            # A complete entry never changes (it is published by renames), so reading it needs no lock.
            return self.load(names, defer)
        if not writable_directory(self.directory):
            if self.is_complete(names):
                return self.load(names, defer)
            logger.warning(
                "cache directory %s is not writable; building the %s indices in memory (set data_cache_path to a "
                "writable directory to build them once and share them)",
                self.directory,
                self._stem,
            )
            return build()

        def build_and_publish() -> None:
            logger.info("building the %s indices in %s", self._stem, self.directory)
            self._publish(build())

        build_once(
            lambda: self.is_complete(names),
            build_and_publish,
            self.directory / f"{self._stem}.lock",
            synchronize=synchronize,
        )
        return self.load(names, defer)
