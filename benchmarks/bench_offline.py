"""Offline preparation (JSONL on disk to ``.bin``/``.idx``) vs the bare ``tokenizers`` batch-encode throughput.

The corpus is the bundled Jane Austen chapters split into paragraphs (about 10,000 realistic documents), repeated
until it holds the target number of tokens. The reference encodes the texts, already in memory, with one
``Tokenizer.encode_batch_fast`` call per batch on the default Rust thread pool; ours runs the offline tool end to
end on the JSONL file with one worker per core. Both are measured in this process, in interleaved rounds, the
reference first in each round.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import BenchContext, Row, log, measure, remove_prefix

NAME = "offline"
TITLE = "offline preparation vs bare tokenizers batch encoding"

TOKENS_FULL = 12_000_000  # large enough that the fixed start-up (about 0.3 s) stays a small share
TOKENS_QUICK = 1_000_000
BATCH = 1024
JSON_KEY = "text"


def corpus_path() -> Path:
    """The bundled chapters: one JSON record per chapter with a ``text`` field."""
    from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH

    return BUNDLED_TOKENIZER_PATH.parent / "corpus" / "austen_chapters.jsonl.gz"


def load_paragraphs(path: Path) -> list[str]:
    """Every non-blank paragraph (chapters split on blank lines), in corpus order."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        chapters = [json.loads(line)[JSON_KEY] for line in f if line.strip()]
    return [paragraph.strip() for chapter in chapters for paragraph in chapter.split("\n\n") if paragraph.strip()]


def repeat_to_tokens(paragraphs: list[str], token_counts: list[int], target: int) -> list[str]:
    """Repeat the paragraphs in order, stopping at the first one that brings the total to ``target`` tokens."""
    texts: list[str] = []
    total = 0
    while total < target:
        for text, count in zip(paragraphs, token_counts, strict=True):
            texts.append(text)
            total += count
            if total >= target:
                break
    return texts


def write_jsonl(texts: list[str], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({JSON_KEY: text}, ensure_ascii=False) + "\n")


@contextmanager
def _quiet_project_logging() -> Iterator[None]:
    """Keep the tool's progress logging out of the benchmark output."""
    logger = logging.getLogger("hyper_parallel")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def offline_tool(
    context: BenchContext, texts: list[str], tokenizer_path: Path, name: str = "offline_corpus"
) -> tuple[Callable[[], Any], str]:
    """Write the corpus as JSONL and return (a call running the offline tool on it, its output prefix).

    Raises ImportError while the offline tool is not available.
    """
    from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
    from hyper_parallel.data.tools.offline_preparation import run_offline_preparation

    jsonl = context.workdir / f"{name}.jsonl"
    write_jsonl(texts, jsonl)
    config = OfflinePreparationConfig(
        dataset_name_or_path=str(jsonl),
        output_prefix=str(context.workdir / f"{name}_out"),
        tokenizer_name_or_path=str(tokenizer_path),
        json_keys=(JSON_KEY,),
        append_eod=True,
        add_special_tokens=False,
        workers=os.cpu_count() or 1,
        overwrite=True,  # every timed round writes the same prefix
    )

    def prepare() -> Any:
        with _quiet_project_logging():
            return run_offline_preparation(config)

    return prepare, config.output_prefix_for(JSON_KEY)


def check_output(prefix: str, summary: Any, expected: np.ndarray, documents: int) -> None:
    """Assert the tool wrote exactly the reference ids plus EOD, one sequence per document, and said so."""
    from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader

    reader = IndexedDataReader(prefix)
    assert summary.tokens == expected.size, f"offline preparation reports {summary.tokens} tokens, not {expected.size}"
    assert reader.num_documents == documents, (
        f"offline preparation wrote {reader.num_documents} documents, not {documents}"
    )
    written = np.fromfile(prefix + ".bin", dtype=reader.dtype)
    assert np.array_equal(written, expected), "offline preparation output differs from the bare encoding + EOD"


LARGE_RECORD_MB_FULL = 50
LARGE_RECORD_MB_QUICK = 5

# Prepares a one-line input (so that the baselines hold every import and a started worker), then the large
# record, and prints how much the peak RSS of the main process and of the worker grew.
_PEAK_MEMORY_SCRIPT = """
import json, resource, sys
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
from hyper_parallel.data.tools.offline_preparation import run_offline_preparation

def peaks():
    return [resource.getrusage(who).ru_maxrss * 1024 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]

if __name__ == "__main__":
    work, tokenizer = sys.argv[1], sys.argv[2]
    for name in ("small", "large"):
        before = peaks()
        data, prefix = f"{work}/{name}.jsonl", f"{work}/{name}"
        run_offline_preparation(
            OfflinePreparationConfig(dataset_name_or_path=data, output_prefix=prefix, tokenizer_name_or_path=tokenizer)
        )
    print(json.dumps([after - start for after, start in zip(peaks(), before)]))
"""


def large_record_row(context: BenchContext, tokenizer_path: Path) -> Row:
    """Peak memory growth while preparing one JSONL record of random words, as a multiple of its size."""
    megabytes = LARGE_RECORD_MB_QUICK if context.quick else LARGE_RECORD_MB_FULL
    rng = np.random.default_rng(8)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocabulary = np.array(["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(5000)], dtype=object)
    text = " ".join(rng.choice(vocabulary, megabytes * 1_000_000 // 5))[: megabytes * 1_000_000]
    work = context.workdir / "large_record"
    work.mkdir()
    (work / "large.jsonl").write_text(json.dumps({JSON_KEY: text}) + "\n", encoding="utf-8")
    (work / "small.jsonl").write_text(json.dumps({JSON_KEY: "a small record"}) + "\n", encoding="utf-8")
    script = work / "peak_memory.py"
    script.write_text(_PEAK_MEMORY_SCRIPT, encoding="utf-8")
    log(f"one record of {megabytes} MB: peak memory in a subprocess")
    result = subprocess.run(
        [sys.executable, str(script), str(work), str(tokenizer_path)], capture_output=True, text=True, check=True
    )
    main_growth, worker_growth = json.loads(result.stdout.strip().splitlines()[-1])
    size = (work / "large.jsonl").stat().st_size
    for path in work.iterdir():
        path.unlink()
    return Row.compare(
        "offline prep: one large record, peak memory",
        worker_growth / 1e6,
        size / 1e6,
        "MB",
        higher_is_better=False,
        note=(
            f"ours: peak RSS growth of the worker preparing a single {size / 1e6:.0f} MB JSONL record (main process: "
            f"{main_growth / 1e6:.0f} MB); ref: the record's size, so the ratio is the multiple (about 170 when the "
            "tokenizer encoded the record whole)"
        ),
    )


DISTRIBUTED_PROCESSES = (1, 2, 4)


def distributed_rows(context: BenchContext, texts: list[str], tokens: int, bare_seconds: float) -> list[Row]:
    """``--distributed`` under torchrun with 1, 2 and 4 ranks on the texts as JSONL in 4 files (so that ranks cut
    files and lines), each rank with its share of the cores; each output is checked byte for byte against one
    process's."""
    from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
    from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
    from hyper_parallel.data.tools.offline_preparation import run_offline_preparation

    work, outputs = context.workdir / "distributed", context.workdir / "distributed_out"
    work.mkdir()
    outputs.mkdir()
    quarter = -(-len(texts) // 4)
    for part in range(4):
        write_jsonl(texts[part * quarter : (part + 1) * quarter], work / f"part{part}.jsonl")
    cores = os.cpu_count() or 1
    single = outputs / "single"
    with _quiet_project_logging():
        config = OfflinePreparationConfig(
            dataset_name_or_path=str(work),
            output_prefix=str(single),
            tokenizer_name_or_path=str(BUNDLED_TOKENIZER_PATH),
            json_keys=(JSON_KEY,),
            add_special_tokens=False,
            workers=cores,
        )
        run_offline_preparation(config)
    single_prefix = config.output_prefix_for(JSON_KEY)
    rows = []
    for processes in DISTRIBUTED_PROCESSES:
        prefix = outputs / f"ranks{processes}"
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"),
            *("-m", "hyper_parallel.data.tools.offline_preparation", "--distributed"),
            *("--dataset-name-or-path", str(work), "--output-prefix", str(prefix), "--json-keys", JSON_KEY),
            *("--tokenizer-name-or-path", str(BUNDLED_TOKENIZER_PATH), "--add-special-tokens", "false"),
            *("--workers", str(max(1, cores // processes))),
        ]
        log(f"--distributed on {processes} rank(s)")
        started = time.perf_counter()
        subprocess.run(command, capture_output=True, text=True, check=True, env={**os.environ, "TQDM_DISABLE": "1"})
        seconds = time.perf_counter() - started
        merged = f"{prefix}_{JSON_KEY}_document"
        for extension in (".bin", ".idx"):
            assert Path(merged + extension).read_bytes() == Path(single_prefix + extension).read_bytes(), (
                f"--distributed on {processes} ranks wrote another {extension} than one process"
            )
        rows.append(
            Row.compare(
                f"offline prep --distributed, {processes} rank(s): tokens/s",
                tokens / seconds,
                tokens / bare_seconds,
                "tokens/s",
                note=(
                    f"ours: torchrun --standalone --nproc-per-node {processes} wall time {seconds:.2f} s (launcher, "
                    f"process group and {max(1, cores // processes)} worker(s) per rank included; output checked "
                    "byte-identical to one process); ref: the bare tokenizer bound above"
                ),
            )
        )
    for path in (*work.iterdir(), *outputs.iterdir()):
        path.unlink()
    return rows


def run(context: BenchContext) -> list[Row]:
    """Reference and ours in interleaved rounds on identical texts; ours is checked token for token."""
    from tokenizers import Tokenizer

    from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer

    tokenizer = Tokenizer.from_file(str(BUNDLED_TOKENIZER_PATH / "tokenizer.json"))
    paragraphs = load_paragraphs(corpus_path())
    # Untimed first pass: warms the tokenizer up and gives each paragraph's token count.
    counts = [len(e.ids) for e in tokenizer.encode_batch_fast(paragraphs, add_special_tokens=False)]
    texts = repeat_to_tokens(paragraphs, counts, TOKENS_QUICK if context.quick else TOKENS_FULL)
    documents = len(texts)
    megabytes = sum(len(text.encode("utf-8")) for text in texts) / 1e6
    eod = build_tokenizer(BUNDLED_TOKENIZER_PATH).eod

    def encode_bare() -> list:
        return [
            tokenizer.encode_batch_fast(texts[start : start + BATCH], add_special_tokens=False)
            for start in range(0, documents, BATCH)
        ]

    cases: dict[str, Callable[[], Any]] = {"bare": encode_bare}
    missing: ImportError | None = None
    try:
        cases["ours"], output = offline_tool(context, texts, BUNDLED_TOKENIZER_PATH)
    except ImportError as error:
        missing = error

    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    expected: list[np.ndarray] = []  # the reference ids + EOD, from its first round
    reported_seconds: list[float] = []

    def after(name: str, result: Any) -> None:
        if name == "bare":
            if not expected:
                ids = (e.ids + [eod] for batch in result for e in batch)
                expected.append(np.fromiter(chain.from_iterable(ids), dtype=np.int64))
            return
        assert os.environ.get("TOKENIZERS_PARALLELISM") == parallelism, (
            "offline preparation changed TOKENIZERS_PARALLELISM in the parent; that skews the next reference round"
        )
        if not reported_seconds:  # the reference ran first in this round, so `expected` is there
            check_output(output, result, expected[0], documents)
        reported_seconds.append(result.seconds)
        remove_prefix(output)

    log(f"{' and '.join(cases)}: {documents:,} docs, {megabytes:.1f} MB, {context.repeats} interleaved rounds")
    timings = measure(cases, context.repeats, after=after)
    (context.workdir / "offline_corpus.jsonl").unlink(missing_ok=True)

    bare = timings["bare"].best
    tokens = expected[0].size - documents  # text tokens, without the appended EOD
    reference_note = (
        f"ref: tokenizers encode_batch_fast(add_special_tokens=False) on in-memory texts, batches of {BATCH}, "
        f"default Rust thread pool; {documents:,} docs, {tokens:,} tokens, {megabytes:.1f} MB"
    )
    if missing is not None:
        return [Row.skipped("offline prep: tokens/s", f"{missing}; {reference_note}", "tokens/s", tokens / bare)]

    ours = timings["ours"].best
    # The fixed cost of a run (worker start-up, tokenizer loading, file set-up), from a one-document input.
    startup_run, startup_output = offline_tool(context, texts[:1], BUNDLED_TOKENIZER_PATH, name="offline_startup")
    startup = measure({"startup": startup_run}, context.repeats, after=lambda *_: remove_prefix(startup_output))
    ours_note = (
        f"ours: run_offline_preparation end to end (reads the JSONL from disk, {os.cpu_count()} workers, appends EOD, "
        f"writes .bin/.idx; output checked equal to ref ids + EOD), wall time {ours:.2f} s (summary.seconds "
        f"{min(reported_seconds):.2f} s); tokens exclude the appended EOD"
    )
    return [
        Row.compare("offline prep: tokens/s", tokens / ours, tokens / bare, "tokens/s", goal=0.9, note=ours_note),
        Row.compare("offline prep: docs/s", documents / ours, documents / bare, "docs/s", note=reference_note),
        Row.compare(
            "offline prep: input MB/s",
            megabytes / ours,
            megabytes / bare,
            "MB/s",
            note="MB of UTF-8 text (not the JSONL file size), the same work for both",
        ),
        Row.compare(
            "offline prep: fixed start-up share",
            startup["startup"].best,
            ours,
            "s",
            higher_is_better=False,
            note="ours: a run on a one-document input (process pool start, tokenizer load); ref: the full run above",
        ),
        large_record_row(context, BUNDLED_TOKENIZER_PATH),
        *distributed_rows(context, texts, tokens, bare),
    ]
