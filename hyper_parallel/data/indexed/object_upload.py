"""Publishing files built locally to object storage (an fsspec URL such as ``s3://bucket/dir/name``).

An object store has no rename and no partial object a reader could mistake for a complete one, so a file is
published in two steps: uploaded whole under a temporary key ``<key>.tmp-<token>`` (multipart in parts of
``part_bytes`` when large), then, once every file of the run is uploaded, copied to its final key in the order
given (per pair: companions, the ``.bin``, the ``.idx`` last) and its temporary key deleted. Every final ``.idx``
that is about to be replaced is deleted before the first copy, so at no moment does an old ``.idx`` describe a new
``.bin``. A run that fails removes its temporary keys; one that is killed leaves only temporary keys (or, killed
between copies, final files without their ``.idx``), and the next run of the same names removes them.

Owns: the checks of a destination before a run (bucket, writing, existing final keys, leftovers of interrupted
runs), temporary keys, uploads, the copies into place, and the local staging directory outputs are built in.
Not responsible for: which files a run writes or their order (``tools.offline_outputs``), reading pairs back
(``indexed.object_storage``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from hyper_parallel.data.dataset_logging import get_logger
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.object_storage import _url_to_fs

__all__ = [
    "DEFAULT_PART_BYTES",
    "EXIT_HOOK_VARIABLE",
    "MIN_PART_BYTES",
    "ObjectUpload",
    "check_destination",
    "check_part_bytes",
    "new_upload_token",
    "staging_directory",
]

logger = get_logger("hyper_parallel.data.indexed.object_upload")

MIN_PART_BYTES = 5 << 20  # S3's smallest part of a multipart upload but the last
DEFAULT_PART_BYTES = 64 << 20
_TEMPORARY_MARK = ".tmp-"
_LISTED = 4
# Test hook "N": the process exits at once (os._exit, as a killed process would) after N uploads and copies.
EXIT_HOOK_VARIABLE = "HP_DATA_TEST_EXIT_AFTER_OBJECT_STEPS"


def check_part_bytes(part_bytes: int) -> None:
    """Refuse a part size that S3 would refuse in the middle of an upload."""
    if isinstance(part_bytes, bool) or not isinstance(part_bytes, int) or part_bytes < MIN_PART_BYTES:
        raise DataConfigError(
            f"upload part size must be an integer of at least {MIN_PART_BYTES} bytes (5 MiB, the smallest part S3 "
            f"accepts), got {part_bytes!r}; pass --upload-part-bytes {DEFAULT_PART_BYTES} or more"
        )


def new_upload_token() -> str:
    """A fresh suffix of temporary keys, so that two runs never share one."""
    return secrets.token_hex(8)


@contextlib.contextmanager
def staging_directory() -> Iterator[Path]:
    """A fresh local directory to build outputs in before their upload, removed afterwards; under the system
    temporary directory (``TMPDIR``), which must have room for the outputs."""
    with tempfile.TemporaryDirectory(prefix="hp-data-staging-") as directory:
        yield Path(directory)


def _listing(keys: Sequence[str]) -> str:
    """``a, b, c, d and 3 more`` (names only: they share the prefix's directory)."""
    names = [key.rsplit("/", 1)[-1] for key in keys]
    return ", ".join(names[:_LISTED]) + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def _write_error(url: str, error: BaseException) -> DataFileError:
    return DataFileError(
        f"cannot write {url}: {type(error).__name__}: {error}; check the bucket, the credentials (AWS_* for S3) and "
        "that they allow writing and deleting objects there"
    )


def check_destination(prefix: str, urls: Sequence[str], overwrite: bool) -> None:
    """Check, before anything is built, that the final keys ``urls`` of the output prefix ``prefix`` can be
    written: the bucket exists and takes a write, temporary keys that interrupted runs left at these names are
    removed, and existing final keys are refused unless ``overwrite``.

    Raises:
        DataConfigError: a URL ending in ``/``, or existing final keys without ``overwrite``.
        DataFileError: the bucket is missing or cannot be written.
    """
    if prefix.endswith("/"):
        raise DataConfigError(
            f"output prefix URL '{prefix}' ends with '/'; give a name inside it, such as {prefix}corpus (outputs are "
            "<name>_<key>_document.{bin,idx})"
        )
    fs, names = _paths(urls)
    first, path = urls[0], names[0]
    bucket = path.split("/", 1)[0]
    try:
        fs.invalidate_cache()
        if not fs.exists(bucket):
            raise DataFileError(f"cannot write {first}: bucket '{bucket}' does not exist; create it or fix the URL")
        probe = f"{path}{_TEMPORARY_MARK}probe-{secrets.token_hex(6)}"
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except DataFileError:
        raise
    except Exception as error:  # noqa: BLE001 - each file system raises its own types
        raise _write_error(first, error) from None
    names = set(names)
    present: set[str] = set()
    for directory in sorted({name.rsplit("/", 1)[0] for name in names}):
        with contextlib.suppress(FileNotFoundError):  # nothing written there yet
            present.update(fs.ls(directory, detail=False))
    stale = sorted(key for key in present if key.partition(_TEMPORARY_MARK)[0] in names and _TEMPORARY_MARK in key)
    if stale:
        try:
            fs.rm(stale)
        except Exception as error:  # noqa: BLE001 - each file system raises its own types
            raise _write_error(stale[0], error) from None
        logger.warning("removed %d temporary object(s) left by an interrupted run: %s", len(stale), _listing(stale))
    existing = sorted(names & present)
    if existing and not overwrite:
        raise DataConfigError(
            f"output prefix {prefix} already has outputs: {_listing(existing)}; pass --overwrite "
            "to replace them (they stay intact until the new outputs are uploaded), or choose another --output-prefix"
        )


def _bar_callback(bar):
    """An fsspec callback that adds the bytes of every file uploaded to one progress bar (fsspec's own callbacks
    count one file)."""
    from fsspec.callbacks import Callback  # imported only for object storage, as in ``object_storage``

    class AddingCallback(Callback):
        def relative_update(self, inc: int = 1) -> None:
            bar.update(inc)

    return AddingCallback()


def _paths(urls: Sequence[str]):
    """The file system of ``urls`` (one scheme and store) and their paths in it."""
    fs, _ = _url_to_fs(urls[0])
    return fs, [fs._strip_protocol(url) for url in urls]


class ObjectUpload:
    """The temporary keys of one run, from upload to publication; used as a context manager, a failure inside
    removes every temporary key it uploaded.

    Args:
        part_bytes: the part size of multipart uploads (files of at least twice this size are multipart).
        token: the suffix of the temporary keys; ranks of one run share it, so that one can publish what another
            uploaded. Default: a fresh random one.
    """

    def __init__(self, part_bytes: int = DEFAULT_PART_BYTES, token: str | None = None) -> None:
        check_part_bytes(part_bytes)
        self.part_bytes = part_bytes
        self.token = token or new_upload_token()
        self._temporaries: list[str] = []
        self._exit_after = int(os.environ.get(EXIT_HOOK_VARIABLE) or 0)
        self._steps = 0

    def temporary(self, url: str) -> str:
        """The key ``url`` is uploaded under until it is published."""
        return f"{url}{_TEMPORARY_MARK}{self.token}"

    def _step(self) -> None:
        self._steps += 1
        if self._exit_after and self._steps >= self._exit_after:
            os._exit(1)

    def upload(self, files: Sequence[tuple[Path, str]], description: str = "uploading") -> None:
        """Upload each local file to the temporary key of its final URL, with one progress bar for all."""
        from tqdm.auto import tqdm

        total = sum(os.path.getsize(local) for local, _ in files)
        with tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=description, disable=None, file=sys.stderr
        ) as bar:
            callback = _bar_callback(bar)
            for local, url in files:
                temporary = self.temporary(url)
                fs, path = _url_to_fs(temporary)
                self._temporaries.append(temporary)
                try:
                    fs.put_file(os.fspath(local), path, callback=callback, chunksize=self.part_bytes)
                except Exception as error:  # noqa: BLE001 - each file system raises its own types
                    raise _write_error(temporary, error) from None
                self._step()

    def fetch(self, url: str, local: Path) -> None:
        """Download the uploaded temporary key of ``url`` (another rank's, with the shared token) to ``local``."""
        temporary = self.temporary(url)
        fs, path = _url_to_fs(temporary)
        self._temporaries.append(temporary)  # removed with the rest: whoever fetches it is the publisher
        try:
            fs.get_file(path, os.fspath(local))
        except Exception as error:  # noqa: BLE001 - each file system raises its own types
            raise DataFileError(f"cannot read {temporary}, uploaded by another rank: {error}") from None

    def publish(self, urls: Sequence[str]) -> None:
        """Copy the uploaded temporary keys of ``urls`` to their final keys in this order, after deleting the
        final ``.idx`` keys about to be replaced; then delete every temporary key of this upload."""
        fs, finals = _paths(urls)
        _, temporaries = _paths([self.temporary(url) for url in urls])
        current = urls[0]  # named by the error
        try:
            fs.invalidate_cache()
            replaced = [path for path in finals if path.endswith(".idx") and fs.exists(path)]
            if replaced:
                fs.rm(replaced)
            for url, temporary, final in zip(urls, temporaries, finals, strict=True):
                current = url
                fs.copy(temporary, final)
                self._step()
        except Exception as error:  # noqa: BLE001 - each file system raises its own types
            raise _write_error(current, error) from None
        self.discard()

    def discard(self) -> None:
        """Delete every temporary key of this upload (those already gone are skipped)."""
        if not self._temporaries:
            return
        fs, paths = _paths(self._temporaries)
        self._temporaries = []
        try:
            fs.invalidate_cache()
            left = [path for path in paths if fs.exists(path)]
            if left:
                fs.rm(left)
        except Exception as error:  # noqa: BLE001 - a failed clean-up must not hide the run's own error
            logger.warning("could not delete temporary objects %s: %s; the next run removes them", paths, error)

    def __enter__(self) -> ObjectUpload:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()
