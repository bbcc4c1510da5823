"""Specification of offline preparation across processes: real ranks, a real gloo process group, real files.

Every run is a subprocess with a deadline that only turns a hang into a failure. The output of every world size is
compared byte for byte with a single-process run of the same input and settings.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from object_storage_server import BUCKET, s3_server  # noqa: F401 - the fixture

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.pair_metadata import partition_prefixes
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.tools.distributed_preparation import EXIT_HOOK_VARIABLE, check_distributed_config
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
from hyper_parallel.data.tools.offline_preparation import default_workers, main

from .test_offline_preparation import PAIR_FILES, make_records, prepare, read_documents, write_jsonl

DEADLINE = 180  # seconds: only turns a hang into a failure
REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Three JSONL files of unequal size, with a blank line, so that ranks cut files and lines fall across cuts."""
    directory = tmp_path_factory.mktemp("corpus")
    for number, count in enumerate((120, 40, 200)):
        write_jsonl(directory / f"part{number}.jsonl", make_records(count, seed=number))
    with open(directory / "part1.jsonl", "a", encoding="utf-8") as file:
        file.write("\n")
    return directory


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("reference") / "corpus"
    prepare(corpus, prefix, chunk_size=16)
    return Path(f"{prefix}_text_document")


def prepare_argv(data: Path, output_prefix: Path, *extra: str) -> list[str]:
    return [
        *("-m", "hyper_parallel.data.tools.offline_preparation", "--distributed", "--workers", "1"),
        *("--dataset-name-or-path", str(data), "--output-prefix", str(output_prefix)),
        *("--tokenizer-name-or-path", str(BUNDLED_TOKENIZER_PATH), "--chunk-size", "16", *extra),
    ]


def environment(**variables: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPOSITORY), **variables}


def torchrun(processes: int, argv: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", *argv]
    return subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=DEADLINE)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def finish(processes: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    """Wait for every process within the deadline; on a hang, kill them all so that none outlives the test."""
    finished = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=DEADLINE)
            finished.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return finished


def ranks_by_hand(processes: int, argv: list[str], **variables: str) -> list[subprocess.CompletedProcess]:
    """Start the ranks as torchrun would, without its agent: the agent stops every rank with SIGTERM as soon as one
    exits non-zero, which would hide whether the ranks stop by themselves."""
    shared = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(processes), **variables}
    ranks = [
        subprocess.Popen(
            [sys.executable, *argv],
            env=environment(**shared, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(processes)
    ]
    return finish(ranks)


def published(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def two_nodes(argv: list[str]) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents of two ranks each on this host, as two nodes meeting at a static rendezvous."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    nodes = [
        subprocess.Popen(
            [*launcher, "--node-rank", str(node), *rendezvous, *argv],
            env=environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in range(2)
    ]
    return finish(nodes)


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_output_is_byte_identical_to_one_process_for_any_number_of_ranks(corpus, reference, tmp_path, processes):
    prefix = tmp_path / "corpus"
    result = torchrun(processes, prepare_argv(corpus, prefix))
    assert result.returncode == 0, result.stderr
    for extension in PAIR_FILES:
        assert Path(f"{prefix}_text_document.{extension}").read_bytes() == Path(f"{reference}.{extension}").read_bytes()
    assert published(tmp_path) == [f"corpus_text_document.{extension}" for extension in sorted(PAIR_FILES)]
    assert re.search(r"documents written\s+360\b", result.stdout)  # the run's total, not one rank's


def test_two_nodes_of_two_ranks_write_the_bytes_of_one_process(corpus, reference, tmp_path):
    prefix = tmp_path / "corpus"
    results = two_nodes(prepare_argv(corpus, prefix, "--distributed-timeout", "30"))
    assert [result.returncode for result in results] == [0, 0], [result.stderr for result in results]
    for extension in PAIR_FILES:
        assert Path(f"{prefix}_text_document.{extension}").read_bytes() == Path(f"{reference}.{extension}").read_bytes()
    assert published(tmp_path) == [f"corpus_text_document.{extension}" for extension in sorted(PAIR_FILES)]
    assert re.search(r"documents written\s+360\b", results[0].stdout)
    assert "rank 2 finished its part" in results[1].stdout and "rank 3 finished its part" in results[1].stdout


def test_ranks_share_one_arrow_file_and_write_the_bytes_of_one_process(corpus, tmp_path):
    records = [json.loads(line) for path in sorted(corpus.iterdir()) for line in path.open() if line.strip()]
    table = pa.Table.from_pylist(records)
    arrow = tmp_path / "data" / "records.arrow"
    arrow.parent.mkdir()
    with pa.ipc.new_stream(arrow, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=70):
            writer.write_batch(batch)
    single = tmp_path / "single"
    prepare(arrow, single, chunk_size=16)
    prefix = tmp_path / "out" / "corpus"
    result = torchrun(3, prepare_argv(arrow, prefix, "--keep-partition-files"))
    assert result.returncode == 0, result.stderr
    for extension in PAIR_FILES:
        merged = Path(f"{prefix}_text_document.{extension}").read_bytes()
        assert merged == Path(f"{single}_text_document.{extension}").read_bytes()
    assert all(read_documents(part) for part in partition_prefixes(f"{prefix}_text_document"))  # every rank read rows


def test_ranks_publish_to_a_bucket_through_the_object_store_alone(s3_server, corpus, reference, tmp_path):  # noqa: F811
    """Every rank stages its part in a directory of its own: the parts reach rank 0 through the bucket."""
    url = f"s3://{BUCKET}/ranks/corpus"
    result = torchrun(2, prepare_argv(corpus, url, "--keep-partition-files"))
    assert result.returncode == 0, result.stderr
    for extension in PAIR_FILES:
        assert s3_server.cat_file(f"{url}_text_document.{extension}") == Path(f"{reference}.{extension}").read_bytes()
    s3_server.invalidate_cache()
    names = sorted(path.rsplit("/", 1)[-1] for path in s3_server.ls(f"{BUCKET}/ranks", detail=False))
    parts = [f"corpus_{rank}_text_document.{extension}" for rank in range(2) for extension in sorted(PAIR_FILES)]
    assert names == sorted(
        [*parts, "corpus_text_document.partitions.json", *(f"corpus_text_document.{e}" for e in PAIR_FILES)]
    )
    manifest = json.loads(s3_server.cat_file(f"{url}_text_document.partitions.json"))
    assert [part["prefix"] for part in manifest["partitions"]] == ["corpus_0_text_document", "corpus_1_text_document"]
    assert "documents written" in result.stdout and f"{url}_text_document" in result.stdout


def test_ranks_read_input_files_in_a_bucket_and_write_the_bytes_of_one_process(
    s3_server,  # noqa: F811
    corpus,
    reference,
    tmp_path,
):
    """Ranks cut objects at byte ranges as they cut local files: ranged reads of the object, lines never split."""
    for path in sorted(corpus.iterdir()):
        s3_server.put(str(path), f"{BUCKET}/inputs/{path.name}")
    prefix = tmp_path / "corpus"
    result = torchrun(2, prepare_argv(f"s3://{BUCKET}/inputs/*.jsonl", prefix))
    assert result.returncode == 0, result.stderr
    for extension in PAIR_FILES:
        written = Path(f"{prefix}_text_document.{extension}").read_bytes()
        assert written == Path(f"{reference}.{extension}").read_bytes()


def test_kept_partitions_of_every_key_are_the_ranks_parts_listed_by_their_manifest(corpus, tmp_path):
    prefix = tmp_path / "corpus"
    result = torchrun(2, prepare_argv(corpus, prefix, "--json-keys", "text", "title", "--keep-partition-files"))
    assert result.returncode == 0, result.stderr
    single = tmp_path / "single"
    prepare(corpus, single, json_keys=("text", "title"), chunk_size=16)
    for key in ("text", "title"):
        merged = f"{prefix}_{key}_document"
        for extension in PAIR_FILES:
            assert (
                Path(f"{merged}.{extension}").read_bytes() == Path(f"{single}_{key}_document.{extension}").read_bytes()
            )
        parts = partition_prefixes(merged)
        assert parts == [str(tmp_path / f"corpus_{rank}_{key}_document") for rank in range(2)]
        assert [d for part in parts for d in read_documents(part)] == read_documents(merged)
        assert all(read_documents(part) for part in parts)  # the input was split, not given to one rank


def test_a_bad_record_on_one_rank_stops_every_rank_with_its_location(corpus, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for path in corpus.iterdir():
        (data / path.name).write_bytes(path.read_bytes())
    last = data / "part2.jsonl"  # its end is read by the last rank
    with open(last, "a", encoding="utf-8") as file:
        file.write('{"text": unquoted}\n')
    out = tmp_path / "out"
    results = ranks_by_hand(3, prepare_argv(data, out / "corpus"))
    location = f"{last}:line 201"
    assert [result.returncode for result in results] == [1, 1, 2]
    assert location in results[2].stderr and "invalid JSON" in results[2].stderr
    for result in results[:2]:
        assert f"rank 2 failed: {location}" in result.stderr
    assert published(out) == []


def test_a_killed_rank_fails_the_others_and_the_rerun_starts_clean(corpus, reference, tmp_path):
    """Rank 1 leaves with os._exit after its first records, as a killed process does: no cleanup, no message."""
    prefix = tmp_path / "corpus"
    argv = prepare_argv(corpus, prefix, "--distributed-timeout", "20")
    results = ranks_by_hand(2, argv, **{EXIT_HOOK_VARIABLE: "1:48"})
    assert results[1].returncode == 1 and results[0].returncode == 1
    assert "stopped answering" in results[0].stderr
    left = published(tmp_path)
    assert left and all(".tmp-" in name for name in left)  # only the dead rank's temporaries
    rerun = torchrun(2, prepare_argv(corpus, prefix))
    assert rerun.returncode == 0, rerun.stderr
    assert "removed" in rerun.stderr
    assert published(tmp_path) == [f"corpus_text_document.{extension}" for extension in sorted(PAIR_FILES)]
    for extension in PAIR_FILES:
        assert Path(f"{prefix}_text_document.{extension}").read_bytes() == Path(f"{reference}.{extension}").read_bytes()


def test_instruction_records_with_their_loss_mask_are_byte_identical_to_one_process(tmp_path):
    records = [
        {"instruction": f"Quote line {number}.", "input": "" if number % 3 else "of Emma", "output": f"Line {number}."}
        for number in range(40)
    ]
    data = write_jsonl(tmp_path / "alpaca.jsonl", records)
    options = ("--chat-template", "chatml", "--instruction-key", "instruction")
    result = torchrun(2, prepare_argv(data, tmp_path / "ranks", *options))
    assert result.returncode == 0, result.stderr
    prepare(data, tmp_path / "single", chat_template="chatml", instruction_key="instruction", chunk_size=16)
    for pair in ("text_document", "text_document_loss_mask"):
        for extension in PAIR_FILES:
            ranks, single = tmp_path / f"ranks_{pair}.{extension}", tmp_path / f"single_{pair}.{extension}"
            assert ranks.read_bytes() == single.read_bytes()


@pytest.mark.parametrize(
    "option", [{"pack_to_seq_len": 64}, {"pack_to_seq_len": 64, "chat_template": "chatml"}, {"partitions": 2}]
)
def test_options_whose_output_depends_on_the_ranks_are_refused(option):
    config = OfflinePreparationConfig(
        dataset_name_or_path="in.jsonl", output_prefix="out", tokenizer_name_or_path="tok", **option
    )
    with pytest.raises(DataConfigError, match="cannot be combined with --distributed"):
        check_distributed_config(config)


def test_distributed_outside_torchrun_says_how_to_start(corpus, tmp_path, monkeypatch, capsys, restore_package_logger):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(prepare_argv(corpus, tmp_path / "corpus")[2:]) == 2
    assert "torchrun --nproc-per-node" in capsys.readouterr().err


def test_the_default_workers_share_the_cpus_among_the_ranks_of_the_host(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_workers(distributed=True) == 4
    assert default_workers(distributed=False) == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert default_workers(distributed=True) == 1
