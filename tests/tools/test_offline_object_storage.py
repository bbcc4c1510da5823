"""Specification of offline preparation to an output prefix in object storage, against a real S3 endpoint (moto's
server on loopback): the bucket holds the bytes of a local preparation, read back by GPTDataset; existing keys are
refused unless overwritten; a killed or failed run never leaves a final ``.idx``, and the next run starts clean.

Killed runs are forked processes that leave with ``os._exit`` after a chosen number of uploads and copies.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from dataclasses import replace
from pathlib import Path

import pytest
from indexed.test_indexed_pretrain_dataset import assert_samples_equal
from indexed.test_loss_mask_pairs import CONVERSATIONS, train_split, write_conversations
from object_storage_server import BUCKET, s3_server  # noqa: F401 - the fixture

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.object_storage import open_reader
from hyper_parallel.data.indexed.object_upload import EXIT_HOOK_VARIABLE, MIN_PART_BYTES, ObjectUpload
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
from hyper_parallel.data.tools.offline_preparation import run_offline_preparation

from .test_offline_preparation import PAIR_FILES, make_records, prepare, write_jsonl

DEADLINE = 120  # seconds: only turns a hang into a failure


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "records.jsonl", make_records(80, seed=4))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("reference") / "corpus"
    prepare(corpus, prefix)
    return f"{prefix}_text_document"


def keys(fs, directory: str) -> list[str]:
    """The names under ``s3://BUCKET/directory``, as a fresh listing shows them."""
    fs.invalidate_cache()
    return sorted(path.rsplit("/", 1)[-1] for path in fs.ls(f"{BUCKET}/{directory}", detail=False))


def assert_pair_uploaded(fs, url_prefix: str, local_prefix: str) -> None:
    for extension in PAIR_FILES:
        assert fs.cat_file(f"{url_prefix}.{extension}") == Path(f"{local_prefix}.{extension}").read_bytes(), extension


def _prepare_and_exit(data: Path, output_prefix: str, steps: int) -> None:
    os.environ[EXIT_HOOK_VARIABLE] = str(steps)
    prepare(data, output_prefix)
    os._exit(0)  # not reached when the hook stops the upload


def killed_run(data: Path, output_prefix: str, steps: int) -> int:
    """The exit code of a preparation in a forked process that leaves with ``os._exit`` after ``steps`` uploads
    and copies, as a killed process would: no clean-up, no message."""
    process = multiprocessing.get_context("fork").Process(target=_prepare_and_exit, args=(data, output_prefix, steps))
    process.start()
    process.join(DEADLINE)
    return process.exitcode


def test_a_prefix_in_the_bucket_holds_the_bytes_and_samples_of_a_local_preparation(s3_server, tmp_path):  # noqa: F811
    """A chat-template run writes two pairs (tokens and loss mask): both arrive whole, and GPTDataset reads the
    same samples, loss mask included, from the bucket as from the local pair."""
    data = write_conversations(tmp_path / "chats.jsonl", CONVERSATIONS)
    local = OfflinePreparationConfig(
        dataset_name_or_path=data,
        output_prefix=str(tmp_path / "sft"),
        tokenizer_name_or_path=str(BUNDLED_TOKENIZER_PATH),
        json_keys=("messages",),
        chat_template="chatml",
        append_eod=False,
        workers=1,
    )
    run_offline_preparation(local)
    url = f"s3://{BUCKET}/sft/run"
    summary = run_offline_preparation(replace(local, output_prefix=url))
    assert summary.outputs == {
        "messages": f"{url}_messages_document",
        "messages_loss_mask": f"{url}_messages_document_loss_mask",
    }
    for suffix in ("", "_loss_mask"):
        assert_pair_uploaded(s3_server, f"{url}_messages_document{suffix}", f"{tmp_path}/sft_messages_document{suffix}")
    assert not [name for name in keys(s3_server, "sft") if ".tmp-" in name]
    remote = train_split(f"{url}_messages_document", BUNDLED_TOKENIZER_PATH, 32)
    expected = train_split(f"{tmp_path}/sft_messages_document", BUNDLED_TOKENIZER_PATH, 32)
    assert_samples_equal([remote[i] for i in range(len(remote))], [expected[i] for i in range(len(expected))])


def test_existing_keys_are_refused_unless_overwrite_replaces_them(s3_server, corpus, reference, tmp_path):  # noqa: F811
    url = f"s3://{BUCKET}/again/corpus"
    other = write_jsonl(tmp_path / "other.jsonl", make_records(30, seed=9))
    prepare(other, url)
    with pytest.raises(DataConfigError, match=r"corpus_text_document\.bin.*pass --overwrite"):
        prepare(corpus, url)
    assert open_reader(f"{url}_text_document").num_tokens < open_reader(reference).num_tokens  # still the first run
    prepare(corpus, url, overwrite=True)
    assert_pair_uploaded(s3_server, f"{url}_text_document", reference)
    assert keys(s3_server, "again") == [f"corpus_text_document.{extension}" for extension in sorted(PAIR_FILES)]


def test_a_run_killed_during_the_uploads_leaves_only_temporary_keys_and_the_rerun_starts_clean(
    s3_server,  # noqa: F811
    corpus,
    reference,
    caplog,
):
    url = f"s3://{BUCKET}/killed/corpus"
    assert killed_run(corpus, url, steps=2) == 1  # after two of the three uploads
    left = keys(s3_server, "killed")
    assert len(left) == 2 and all(".tmp-" in name for name in left)
    with caplog.at_level(logging.WARNING, logger="hyper_parallel.data"):
        prepare(corpus, url)
    assert "removed 2 temporary object(s)" in caplog.text
    assert keys(s3_server, "killed") == [f"corpus_text_document.{extension}" for extension in sorted(PAIR_FILES)]
    assert_pair_uploaded(s3_server, f"{url}_text_document", reference)


def test_a_run_killed_between_the_copies_into_place_never_leaves_a_final_idx(s3_server, corpus, reference):  # noqa: F811
    """Three uploads, then the metadata and the .bin are copied into place: the .idx comes last."""
    url = f"s3://{BUCKET}/copying/corpus"
    assert killed_run(corpus, url, steps=5) == 1
    finals = [name for name in keys(s3_server, "copying") if ".tmp-" not in name]
    assert finals == ["corpus_text_document.bin", "corpus_text_document.meta.json"]
    with pytest.raises(DataFileError, match=r"corpus_text_document\.idx does not exist"):
        open_reader(f"{url}_text_document")
    prepare(corpus, url, overwrite=True)
    assert keys(s3_server, "copying") == [f"corpus_text_document.{extension}" for extension in sorted(PAIR_FILES)]
    assert_pair_uploaded(s3_server, f"{url}_text_document", reference)


def test_a_failed_upload_removes_the_temporary_keys_it_uploaded(s3_server, reference, tmp_path):  # noqa: F811
    """The store refuses the second file (its bucket is gone): the first one's temporary key is deleted."""
    url = f"s3://{BUCKET}/failed/corpus_text_document"
    files = [(Path(f"{reference}.bin"), f"{url}.bin"), (Path(f"{reference}.idx"), "s3://gone-bucket/corpus.idx")]
    with pytest.raises(DataFileError, match=r"cannot write s3://gone-bucket/corpus\.idx\.tmp-"), ObjectUpload() as up:
        up.upload(files)
    s3_server.invalidate_cache()
    assert not s3_server.exists(f"{BUCKET}/failed")


def test_a_large_file_is_uploaded_in_parts_of_the_part_size(s3_server, tmp_path):  # noqa: F811
    large = tmp_path / "large.bin"
    large.write_bytes(os.urandom(2 * MIN_PART_BYTES + 1000))
    url = f"s3://{BUCKET}/parts/large.bin"
    with ObjectUpload(part_bytes=MIN_PART_BYTES) as upload:
        upload.upload([(large, url)])
        uploaded = s3_server.info(upload.temporary(url), refresh=True)
        upload.publish([url])
    assert uploaded["ETag"].strip('"').endswith("-3")  # S3 names a multipart object by its number of parts
    assert s3_server.cat_file(url) == large.read_bytes()
    assert keys(s3_server, "parts") == ["large.bin"]


def test_a_missing_bucket_and_a_part_size_below_the_s3_minimum_are_refused_before_tokenizing(
    s3_server,  # noqa: F811
    corpus,
):
    with pytest.raises(DataFileError, match="bucket 'no-such-bucket' does not exist"):
        prepare(corpus, "s3://no-such-bucket/corpus")
    with pytest.raises(DataConfigError, match="at least 5242880 bytes"):
        prepare(corpus, f"s3://{BUCKET}/corpus", upload_part_bytes=MIN_PART_BYTES - 1)
