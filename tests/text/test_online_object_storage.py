"""Specification of data files at fsspec URLs, against a real S3 endpoint (moto's server on loopback): listing in
URL order, records and Online samples equal to those of the same files on a local disk, the Arrow cache kept
locally and named by the objects' identity, an offline preparation from a bucket, and clear errors."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from object_storage_server import BUCKET, s3_server  # noqa: F401 - the fixture

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.indexed.object_storage import ObjectFile
from hyper_parallel.data.text.build_dataset import build_online_text_dataset
from hyper_parallel.data.text.records import iter_record_chunks, resolve_data_files
from hyper_parallel.data.tools.offline_preparation import main as prepare_main

RECORDS = [{"id": index, "text": f"record number {index} " + "word " * (index % 7)} for index in range(30)]
TRANSFORM = {"data_type": "plaintext", "max_seq_len": 16}


def jsonl(records) -> bytes:
    return "".join(json.dumps(record) + "\n" for record in records).encode()


def write_files(directory) -> None:
    """The same records as a JSONL, a gzipped JSONL, a CSV, a Parquet and an Arrow file under ``directory``."""
    directory.mkdir(parents=True)
    (directory / "b.jsonl").write_bytes(jsonl(RECORDS[:12]))
    (directory / "a.jsonl").write_bytes(b"\n" + jsonl(RECORDS[12:]))  # a blank line: numbers still count it
    (directory / "c.jsonl.gz").write_bytes(gzip.compress(jsonl(RECORDS)))
    (directory / "d.csv").write_text("id,text\n" + "".join(f'{r["id"]},"{r["text"]}"\n' for r in RECORDS))
    table = pa.Table.from_pylist(RECORDS)
    pq.write_table(table, directory / "e.parquet", row_group_size=8)
    with pa.OSFile(str(directory / "f.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


@pytest.fixture(scope="module")
def data(s3_server, tmp_path_factory):  # noqa: F811
    """``(local directory, its URL)``: the files of ``write_files`` on disk and in the bucket."""
    local = tmp_path_factory.mktemp("data") / "files"
    write_files(local)
    s3_server.put(str(local), f"{BUCKET}/files", recursive=True)
    return local, f"s3://{BUCKET}/files"


def samples(dataset) -> list[list[int]]:
    """The token ids of every sample: a mapping dataset gives a list of samples per record, a stream samples."""
    if hasattr(dataset, "__len__"):
        items = [sample for index in range(len(dataset)) for sample in dataset[index]]
    else:
        items = list(dataset)
    return [np.asarray(sample["input_ids"]).tolist() for sample in items]


def test_globs_and_directories_list_objects_in_path_order(data):
    local, url = data
    files, fmt = resolve_data_files(f"{url}/*.jsonl")
    assert fmt == "json" and [str(f) for f in files] == [f"{url}/a.jsonl", f"{url}/b.jsonl"]
    assert all(isinstance(f, ObjectFile) and f.size == (local / f.name).stat().st_size for f in files)
    assert all(f.identity for f in files)
    listed, _ = resolve_data_files([f"{url}/f.arrow"])
    assert listed[0].url == f"{url}/f.arrow"
    with pytest.raises(DataFileError, match="mixes formats"):
        resolve_data_files(url)


def test_a_directory_url_lists_its_data_files_and_refuses_a_saved_dataset(s3_server):  # noqa: F811
    for key in ("plain/b.jsonl", "plain/a.jsonl", "plain/.hidden.jsonl", "plain/README.md", "plain/sub/c.jsonl"):
        s3_server.pipe(f"{BUCKET}/{key}", jsonl(RECORDS[:1]))
    files, _ = resolve_data_files(f"s3://{BUCKET}/plain/")
    assert [f.url for f in files] == [f"s3://{BUCKET}/plain/a.jsonl", f"s3://{BUCKET}/plain/b.jsonl"]
    for key in ("saved/state.json", "saved/dataset_info.json", "saved/data-00000-of-00001.arrow"):
        s3_server.pipe(f"{BUCKET}/{key}", b"{}")
    with pytest.raises(DataFileError, match=rf"s3://{BUCKET}/saved is a Hugging Face dataset saved with save_to_disk"):
        resolve_data_files(f"s3://{BUCKET}/saved")


def test_a_recursive_glob_lists_objects_in_the_order_of_local_paths(s3_server, tmp_path):  # noqa: F811
    for key in ("d-x/b.jsonl", "d/a.jsonl", "d/c/e.jsonl"):
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(jsonl(RECORDS[:1]))
        s3_server.pipe(f"{BUCKET}/nested/{key}", jsonl(RECORDS[:1]))
    local, _ = resolve_data_files(str(tmp_path / "**" / "*.jsonl"))
    remote, _ = resolve_data_files(f"s3://{BUCKET}/nested/**/*.jsonl")
    assert [str(f.relative_to(tmp_path)) for f in local] == ["d/a.jsonl", "d/c/e.jsonl", "d-x/b.jsonl"]
    assert [f.url.removeprefix(f"s3://{BUCKET}/nested/") for f in remote] == ["d/a.jsonl", "d/c/e.jsonl", "d-x/b.jsonl"]


@pytest.mark.parametrize("name", ["a.jsonl", "c.jsonl.gz", "d.csv", "e.parquet", "f.arrow"])
def test_records_equal_those_of_the_local_file(data, name):
    local, url = data
    (local_file,), fmt = resolve_data_files(local / name)
    (remote_file,), _ = resolve_data_files(f"{url}/{name}")
    local_chunks = list(iter_record_chunks([local_file], fmt, chunk_size=7, columns=["id", "text"]))
    remote_chunks = list(iter_record_chunks([remote_file], fmt, chunk_size=7, columns=["id", "text"]))
    assert [c.items for c in remote_chunks] == [c.items for c in local_chunks]
    assert [c.locations for c in remote_chunks] == [c.locations for c in local_chunks]
    assert remote_chunks[0].where(0) == f"{url}/{name}:{local_chunks[0].where(0).rsplit(':', 1)[1]}"


@pytest.mark.parametrize("spec", ["{}/*.jsonl", "{}/c.jsonl.gz", "{}/e.parquet"])
def test_mapping_samples_equal_the_local_ones(data, spec, tokenizer, tmp_path):
    local, url = data
    config = {"cache_dir": str(tmp_path / "cache")}
    remote = build_online_text_dataset(spec.format(url), TRANSFORM, config, tokenizer=tokenizer)
    expected = build_online_text_dataset(spec.format(local), TRANSFORM, config, tokenizer=tokenizer)
    assert len(remote) == len(RECORDS) and samples(remote) == samples(expected)
    assert all(
        f.startswith(str(tmp_path / "cache")) for f in (e["filename"] for e in remote.source.hf_dataset.cache_files)
    )


@pytest.mark.parametrize("spec", ["{}/*.jsonl", "{}/e.parquet", "{}/c.jsonl.gz"])
def test_iterable_samples_equal_the_local_ones(data, spec, tokenizer, tmp_path):
    local, url = data
    config = {"dataset_type": "iterable", "shuffle_buffer_size": 8, "cache_dir": str(tmp_path / "cache")}
    remote = build_online_text_dataset(spec.format(url), TRANSFORM, config, tokenizer=tokenizer, seed=5)
    expected = build_online_text_dataset(spec.format(local), TRANSFORM, config, tokenizer=tokenizer, seed=5)
    assert samples(remote) == samples(expected) and len(samples(expected)) == len(RECORDS)
    copies = tmp_path / "cache" / "hp_data_objects"
    # Only a compressed object is streamed from a local copy (datasets cannot decompress it from the bucket).
    assert sorted(path.name for path in copies.glob("*/*")) == (["c.jsonl.gz"] if spec.endswith(".gz") else [])


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_each_dp_rank_streams_the_share_of_the_local_files(data, tokenizer, dp_rank):
    local, url = data
    shares = [
        build_online_text_dataset(
            f"{root}/*.jsonl",
            TRANSFORM,
            {"dataset_type": "iterable"},
            tokenizer=tokenizer,
            dp_rank=dp_rank,
            dp_world_size=2,
        )
        for root in (url, local)
    ]
    assert samples(shares[0]) == samples(shares[1]) and 0 < len(samples(shares[1])) < len(RECORDS)


def test_a_link_where_objects_are_copied_is_refused(data, tokenizer, tmp_path):
    _, url = data
    copies = tmp_path / "cache" / "hp_data_objects"
    copies.mkdir(parents=True)
    (copies / "planted").symlink_to(tmp_path)
    with pytest.raises(DataFileError, match="planted is a symbolic link"):
        build_online_text_dataset(
            f"{url}/b.jsonl", TRANSFORM, {"cache_dir": str(tmp_path / "cache")}, tokenizer=tokenizer
        )


def test_missing_objects_name_the_url(data, tokenizer):
    _, url = data
    with pytest.raises(DataFileError, match=rf"no such object or directory: {url}/absent\.jsonl"):
        build_online_text_dataset(f"{url}/absent.jsonl", TRANSFORM, tokenizer=tokenizer)
    with pytest.raises(DataFileError, match=rf"the pattern '{url}/\*\.txt' matches no objects"):
        resolve_data_files(f"{url}/*.txt")


def test_an_object_uploaded_again_builds_a_new_cache(s3_server, tokenizer, tmp_path):  # noqa: F811
    url = f"s3://{BUCKET}/replaced/data.jsonl"
    config = {"cache_dir": str(tmp_path / "cache")}
    s3_server.pipe(url, jsonl(RECORDS[:5]))
    first = build_online_text_dataset(url, TRANSFORM, config, tokenizer=tokenizer)
    s3_server.pipe(url, jsonl(RECORDS[5:15]))  # a new version; the first one's cache is still there
    second = build_online_text_dataset(url, TRANSFORM, config, tokenizer=tokenizer)
    assert len(first) == 5 and len(second) == 10
    assert tokenizer.decode(second[0][0]["input_ids"]) == RECORDS[5]["text"]
    assert len(list((tmp_path / "cache" / "hp_data_objects").iterdir())) == 2  # one copy per version
    assert first.source.data_identity()["fingerprint"] != second.source.data_identity()["fingerprint"]
    assert second.source.data_identity()["entries"] == {
        url: f"{len(jsonl(RECORDS[5:15]))} bytes, identity {s3_server.info(url)['ETag']}"
    }


def test_an_object_replaced_after_the_listing_is_refused(s3_server):  # noqa: F811
    url = f"s3://{BUCKET}/moving/data.jsonl"
    s3_server.pipe(url, jsonl(RECORDS))
    files, fmt = resolve_data_files(url)
    s3_server.pipe(url, jsonl(RECORDS[:3]))
    with pytest.raises(DataFileError, match=rf"{url} changed after it was listed"):
        list(iter_record_chunks(files, fmt))


@pytest.mark.usefixtures("restore_package_logger")
def test_prepare_from_a_bucket_writes_the_local_input_output(data, tokenizer_path, tmp_path):
    local, url = data
    outputs = {}
    for name, source in (("local", local / "c.jsonl.gz"), ("remote", f"{url}/c.jsonl.gz")):
        prefix = tmp_path / name / "out"
        argv = ["--dataset-name-or-path", str(source), "--output-prefix", str(prefix), "--workers", "1"]
        assert prepare_main([*argv, "--tokenizer-name-or-path", str(tokenizer_path)]) == 0
        outputs[name] = [(prefix.parent / f"out_text_document{ext}").read_bytes() for ext in (".idx", ".bin")]
    assert outputs["remote"] == outputs["local"] and len(outputs["local"][1]) > 0


@pytest.mark.usefixtures("restore_package_logger")
def test_a_malformed_object_record_is_named_by_url_and_line(s3_server, tokenizer_path, tmp_path, capsys):  # noqa: F811
    url = f"s3://{BUCKET}/bad/data.jsonl"
    s3_server.pipe(url, jsonl(RECORDS[:1]) + b'{"text": "unterminated\n' + jsonl(RECORDS[1:3]))
    argv = ["--dataset-name-or-path", url, "--output-prefix", str(tmp_path / "out"), "--workers", "1"]
    assert prepare_main([*argv, "--tokenizer-name-or-path", str(tokenizer_path)]) == 2
    assert f"{url}:line 2" in capsys.readouterr().err
