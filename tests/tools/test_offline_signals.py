"""Specification of offline preparation under signals and process limits, with real processes.

``hp-data prepare`` runs in a child process on a corpus large enough to keep two workers busy; the tests send it
real signals (to the process group for Ctrl-C, as a terminal does) and look at its worker processes in /proc.
Every wait has a deadline, after which the process group is killed and the test fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hyper_parallel.data.indexed.pair_metadata import partition_prefixes
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH

from .test_offline_preparation import (
    GOOD_LINE,
    encode_documents,
    leftover_files,
    make_records,
    prepare,
    read_documents,
    write_jsonl,
)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads worker processes from /proc")

DEADLINE = 60.0  # seconds: only turns a hang into a failure
BUSY_LINES = 200_000  # ~13 MB of JSONL: seconds of work for two workers, interrupted well before the end


@pytest.fixture(scope="module")
def busy_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("busy") / "busy.jsonl"
    path.write_bytes(GOOD_LINE * BUSY_LINES)
    return path


def prepare_argv(data: Path, output_prefix: Path, *extra: str) -> list[str]:
    return [
        *("--dataset-name-or-path", str(data), "--output-prefix", str(output_prefix)),
        *("--tokenizer-name-or-path", str(BUNDLED_TOKENIZER_PATH), "--workers", "2"),
        *("--chunk-size", "256", "--log-interval", "1000", *extra),
    ]


class Run:
    """``python -m ...offline_preparation`` in its own process group (so a group signal reaches only it)."""

    def __init__(self, argv: list[str], directory: Path, preamble: str = "") -> None:
        self.stderr_path = directory / f"stderr-{time.monotonic_ns()}.txt"
        code = "\n".join(
            [
                preamble,
                "from hyper_parallel.data.tools.offline_preparation import main",
                f"raise SystemExit(main({argv!r}))",
            ]
        )
        with open(self.stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_until_busy(self) -> list[int]:
        """Wait for the first progress line (the workers are tokenizing); returns the child process ids."""
        deadline = time.monotonic() + DEADLINE
        while "processed 1" not in self.stderr:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill_group()
                pytest.fail(f"the run never got busy (rc {self.process.returncode}):\n{self.stderr}")
            time.sleep(0.02)
        return children_of(self.process.pid)

    def finish(self) -> int:
        try:
            return self.process.wait(DEADLINE)
        except subprocess.TimeoutExpired:
            self.kill_group()
            pytest.fail(f"the run did not exit within {DEADLINE} s:\n{self.stderr}")

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def open_file_limit(soft: int) -> str:
    """Code that lowers the child's open-file limit (``ulimit -n``), inherited by its workers."""
    return (
        "import resource\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))"
    )


def _stat(pid: int) -> list[str] | None:
    """Fields after the command name in /proc/<pid>/stat: state, ppid, ...; None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None and fields[1] == str(pid):
            found.append(int(entry.name))
    return found


def wait_until_gone(pids: list[int]) -> list[int]:
    """Wait until every process has exited (a zombie has exited: nobody may be left to reap it); returns those
    still running at the deadline."""
    deadline = time.monotonic() + DEADLINE
    while True:
        running = [pid for pid in pids if (fields := _stat(pid)) is not None and fields[0] not in "ZX"]
        if not running or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in running:
        os.kill(pid, signal.SIGKILL)
    return running


def test_sigkill_of_the_main_process_ends_its_workers_and_the_next_run_sweeps(tmp_path, busy_corpus, caplog):
    """After SIGKILL of the main process its workers exit by themselves. The temporary files it could not remove
    are removed by the next run of the same prefix, which logs it."""
    run = Run(prepare_argv(busy_corpus, tmp_path / "out"), tmp_path)
    children = run.wait_until_busy()
    assert len(children) >= 2, children  # the two workers (and multiprocessing's resource tracker)
    run.process.kill()
    run.process.wait(DEADLINE)
    assert wait_until_gone(children) == []
    assert leftover_files(tmp_path) != []

    caplog.set_level("WARNING", logger="hyper_parallel.data")
    prepare(write_jsonl(tmp_path / "small.jsonl", make_records(3, seed=1)), tmp_path / "out")
    assert leftover_files(tmp_path) == []
    assert any("left in" in r.getMessage() and "interrupted run" in r.getMessage() for r in caplog.records)


def test_sigterm_stops_the_workers_and_removes_the_temporary_files(tmp_path, busy_corpus):
    """SIGTERM of the main process is a clean stop: rc 143, the usual message, workers gone, no file left."""
    run = Run(prepare_argv(busy_corpus, tmp_path / "out"), tmp_path)
    children = run.wait_until_busy()
    run.process.send_signal(signal.SIGTERM)
    assert run.finish() == 128 + signal.SIGTERM
    assert "interrupted: no output was published" in run.stderr and "Traceback" not in run.stderr
    assert wait_until_gone(children) == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out")] == []


@pytest.mark.parametrize("presses", [[1, 1, 1], [2, 2]], ids=["once-x3", "twice-x2"])
def test_ctrl_c_exits_130_promptly_every_time(tmp_path, busy_corpus, presses):
    """Ctrl-C reaches the whole process group (workers too). Five runs in all, each interrupted while busy: each
    exits with 130 within the deadline, without a traceback, its workers gone; a first Ctrl-C removes the temporary
    files, and a second one right after it exits at once."""
    for number, count in enumerate(presses):
        run = Run(prepare_argv(busy_corpus, tmp_path / f"out{number}"), tmp_path)
        children = run.wait_until_busy()
        for _ in range(count):
            os.killpg(run.process.pid, signal.SIGINT)
        # A second Ctrl-C that lands while the interpreter shuts down (its handlers are gone by then) ends the
        # process by the signal itself: a shell reports that as 130 too.
        assert run.finish() in (130, -signal.SIGINT), run.stderr
        assert "Traceback" not in run.stderr and "InvalidStateError" not in run.stderr
        assert "interrupted" in run.stderr
        assert wait_until_gone(children) == []
        if count == 1:
            assert [p.name for p in tmp_path.iterdir() if p.name.startswith(f"out{number}_")] == []


def test_partitions_beyond_the_open_file_limit(tmp_path, tokenizer):
    """300 kept partitions under an open-file limit of 256 (which each used to hold open at once) succeed: the
    merged pair holds the records round-robin, the manifest lists the 300 pairs, and no temporary file is left."""
    records = make_records(700, seed=2)
    data = write_jsonl(tmp_path / "in.jsonl", records)
    argv = prepare_argv(data, tmp_path / "out", "--partitions", "300", "--keep-partition-files", "--chunk-size", "64")
    run = Run(argv, tmp_path, preamble=open_file_limit(256))
    assert run.finish() == 0, run.stderr
    documents = encode_documents(tokenizer, [r["text"] for r in records])
    merged = tmp_path / "out_text_document"
    assert read_documents(merged) == [documents[i] for p in range(300) for i in range(p, len(records), 300)]
    assert len(partition_prefixes(merged)) == 300
    assert leftover_files(tmp_path) == []


def test_an_open_file_limit_too_low_for_the_workers_is_refused_up_front(tmp_path):
    """An open-file limit that cannot hold the workers' pipes and one output file is refused before any worker
    starts, with rc 2 and how much to raise it; nothing is written."""
    data = write_jsonl(tmp_path / "in.jsonl", make_records(3, seed=3))
    argv = prepare_argv(data, tmp_path / "out", "--workers", "8")
    run = Run(argv, tmp_path, preamble=open_file_limit(24))
    assert run.finish() == 2, run.stderr
    assert "error: the open-file limit is 24, too low for 8 workers" in run.stderr and "ulimit -n" in run.stderr
    assert "Traceback" not in run.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out")] == []
