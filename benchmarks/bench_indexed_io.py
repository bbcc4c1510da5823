"""Writing and reading Megatron ``.idx``/``.bin`` pairs: ``hyper_parallel.data.indexed`` vs megatron-core.

For each token dtype (uint16, int32) one synthetic corpus is generated (seeded, lognormal document lengths with
median ~600 and mean ~1000 tokens) and fed to both writers; the outputs must be byte-identical. Both readers then
read the file megatron-core wrote, so every comparison uses the same bytes.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import BenchContext, Row, Timing, log, measure, remove_prefix

NAME = "indexed_io"
TITLE = ".idx/.bin writer and reader vs megatron-core"

DOCUMENTS_FULL = 200_000
DOCUMENTS_QUICK = 20_000
LENGTH_MEDIAN = 600
LENGTH_MEAN = 1000
RANDOM_READS = 20_000
WINDOW = 4096
SLICE = 1024
SEED = 20240601
# Token ids are drawn below a realistic vocabulary size for the dtype: GPT-2's for uint16, Llama-3's for int32.
VOCAB_SIZE = {np.dtype(np.uint16): 50_257, np.dtype(np.int32): 128_256}
COMPARE_CHUNK = 64 << 20
RAW_READ_CHUNK = 16 << 20


@dataclass(frozen=True)
class Corpus:
    """Documents as one flat token array plus their lengths; ``documents`` are views into ``tokens``."""

    tokens: np.ndarray
    lengths: np.ndarray

    @property
    def dtype(self) -> np.dtype:
        return self.tokens.dtype

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes

    def documents(self) -> list[np.ndarray]:
        return np.split(self.tokens, np.cumsum(self.lengths[:-1]))


def make_corpus(documents: int, dtype: np.dtype, seed: int = SEED) -> Corpus:
    """Lognormal lengths with the configured median and mean (at least 1 token), uniform random token ids."""
    rng = np.random.default_rng(seed)
    sigma = math.sqrt(2 * math.log(LENGTH_MEAN / LENGTH_MEDIAN))  # mean / median = exp(sigma^2 / 2)
    lengths = np.maximum(1, rng.lognormal(math.log(LENGTH_MEDIAN), sigma, documents)).astype(np.int64)
    tokens = rng.integers(0, VOCAB_SIZE[np.dtype(dtype)], int(lengths.sum()), dtype=dtype)
    return Corpus(tokens, lengths)


def _megatron_indexed() -> Any:
    """megatron-core's indexed_dataset module, imported without its optional-dependency warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def same_bytes(first: Path, second: Path) -> bool:
    """Whether two files have identical contents (chunked, so large files do not need to fit in memory)."""
    if first.stat().st_size != second.stat().st_size:
        return False
    with first.open("rb") as a, second.open("rb") as b:
        while True:
            chunk = a.read(COMPARE_CHUNK)
            if chunk != b.read(COMPARE_CHUNK):
                return False
            if not chunk:
                return True


def raw_read(path: Path) -> int:
    """Read a file start to end into one reused buffer; the physical bound for a page-cached sequential read."""
    buffer = bytearray(RAW_READ_CHUNK)
    view = memoryview(buffer)
    total = 0
    with path.open("rb", buffering=0) as f:
        while count := f.readinto(view):
            total += count
    return total


# -- writing --------------------------------------------------------------------------------------------------


def _bench_writers(context: BenchContext, corpus: Corpus, label: str) -> tuple[list[Row], str]:
    """Time the three writers side by side; return the rows and the prefix of megatron-core's output (kept)."""
    import torch

    from hyper_parallel.data.indexed.io import IndexedDatasetBuilder

    megatron_builder = _megatron_indexed().IndexedDatasetBuilder
    dtype = corpus.dtype
    documents = corpus.documents()
    tensors = [torch.from_numpy(document) for document in documents]
    sizes = corpus.lengths.tolist()
    prefixes = {name: str(context.workdir / f"{name}_{label}") for name in ("megatron", "ours", "ours_bulk")}

    def write_megatron() -> None:
        builder = megatron_builder(prefixes["megatron"] + ".bin", dtype=dtype.type)
        for tensor, size in zip(tensors, sizes, strict=True):
            builder.add_document(tensor, [size])
        builder.finalize(prefixes["megatron"] + ".idx")

    def write_ours() -> None:
        builder = IndexedDatasetBuilder(prefixes["ours"] + ".bin", dtype=dtype)
        for document, size in zip(documents, sizes, strict=True):
            builder.add_document(document, [size])
        builder.finalize(prefixes["ours"] + ".idx")

    def write_ours_bulk() -> None:
        builder = IndexedDatasetBuilder(prefixes["ours_bulk"] + ".bin", dtype=dtype)
        builder.add_documents(corpus.tokens, corpus.lengths)
        builder.finalize(prefixes["ours_bulk"] + ".idx")

    checked: set[str] = set()

    def check_and_remove(name: str, _: object) -> None:
        # megatron-core runs first in the first round, the one whose outputs are compared.
        if name == "megatron":
            return
        if name not in checked:
            for suffix in (".bin", ".idx"):
                ours, reference = Path(prefixes[name] + suffix), Path(prefixes["megatron"] + suffix)
                assert same_bytes(ours, reference), f"{ours} differs from megatron-core's {reference}"
            checked.add(name)
        remove_prefix(prefixes[name])  # keep at most two corpora on disk

    log(f"writing {len(sizes):,} {label} documents ({corpus.nbytes / 1e6:,.0f} MB) x {context.repeats} rounds")
    writers = {"megatron": write_megatron, "ours": write_ours, "ours_bulk": write_ours_bulk}
    names = list(writers)
    samples: dict[str, tuple[float, ...]] = dict.fromkeys(names, ())
    for round_index in range(context.repeats):
        # Each round starts one writer later: the kernel makes a writer wait for the dirty pages of those before
        # it, so a writer always run last would be measured only at its worst.
        turn = round_index % len(names)
        order = names[turn:] + names[:turn]
        timings = measure(
            {name: writers[name] for name in order},
            1,
            before=lambda name: remove_prefix(prefixes[name]),
            after=check_and_remove,
        )
        for name, timing in timings.items():
            samples[name] += timing.samples
    timings = {name: Timing(values) for name, values in samples.items()}
    megabytes = corpus.nbytes / 1e6
    reference = megabytes / timings["megatron"].best
    common = f"{len(sizes):,} docs; constructor to finalize; output byte-identical (asserted)"
    rows = [
        Row.compare(
            f"write {label}: add_document per doc",
            megabytes / timings["ours"].best,
            reference,
            "MB/s",
            goal=1.0,
            note=f"ref: megatron IndexedDatasetBuilder.add_document(torch tensor, [len]) per doc; {common}",
        ),
        Row.compare(
            f"write {label}: add_documents (bulk API)",
            megabytes / timings["ours_bulk"].best,
            reference,
            "MB/s",
            goal=1.0,
            note=f"ours: one add_documents(flat_tokens, lengths) call; ref: megatron per-doc add_document; {common}",
        ),
    ]
    return rows, prefixes["megatron"]


# -- reading --------------------------------------------------------------------------------------------------


def _side_by_side(ours: Any, megatron: Any, read, repeats: int) -> dict[str, Timing]:
    """Time ``read(dataset)`` on both readers, interleaved."""
    return measure({"ours": lambda: read(ours), "megatron": lambda: read(megatron)}, repeats)


def _bench_readers(context: BenchContext, corpus: Corpus, label: str, prefix: str) -> list[Row]:
    """Random and sequential reads of the same file through both readers, plus the raw sequential bound."""
    from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader

    ours = IndexedDataReader(prefix)
    megatron = _megatron_indexed().IndexedDataset(prefix)
    lengths = corpus.lengths
    bin_path = Path(prefix + ".bin")
    raw_read(bin_path)  # the file is page-cached from writing; make sure of it before anything is timed
    rng = np.random.default_rng(SEED + 1)
    random_repeats = max(context.repeats, 5)
    rows: list[Row] = []

    # Random whole documents.
    indices = rng.integers(0, len(lengths), RANDOM_READS).tolist()

    def read_documents(dataset: Any) -> None:
        for i in indices:
            dataset.get(i).copy()

    log(f"random reads {label}: {RANDOM_READS:,} documents x {random_repeats} rounds")
    timings = _side_by_side(ours, megatron, read_documents, random_repeats)
    rows.append(
        Row.compare(
            f"random read {label}: get(i)",
            RANDOM_READS / timings["ours"].best,
            RANDOM_READS / timings["megatron"].best,
            "samples/s",
            goal=1.0,
            note=f"ref: megatron IndexedDataset.get(i); {RANDOM_READS:,} seeded random docs "
            f"(mean {lengths[indices].mean():,.0f} tokens), each copied out of the mmap",
        )
    )

    # Random 4096-token windows of documents long enough to hold one.
    long_documents = np.flatnonzero(lengths >= WINDOW)
    if long_documents.size:
        chosen = rng.choice(long_documents, RANDOM_READS)
        offsets = rng.integers(0, lengths[chosen] - WINDOW + 1)
        windows = list(zip(chosen.tolist(), offsets.tolist(), strict=True))

        def read_windows(dataset: Any) -> None:
            for i, offset in windows:
                dataset.get(i, offset, WINDOW).copy()

        log(f"random windows {label}: {RANDOM_READS:,} x {WINDOW} tokens x {random_repeats} rounds")
        timings = _side_by_side(ours, megatron, read_windows, random_repeats)
        rows.append(
            Row.compare(
                f"random read {label}: get(i, off, {WINDOW})",
                RANDOM_READS / timings["ours"].best,
                RANDOM_READS / timings["megatron"].best,
                "samples/s",
                goal=1.0,
                note=f"ref: megatron IndexedDataset.get(i, off, {WINDOW}); {RANDOM_READS:,} seeded draws among the "
                f"{long_documents.size:,} docs of >= {WINDOW} tokens, random offset, each window copied",
            )
        )

    # Sequential: every document in order, one at a time, then in contiguous slices; then every document once in
    # seeded random batches through gather. The raw read runs in the same rounds, so the bound drifts with them.
    gigabytes = corpus.nbytes / 1e9
    count = len(lengths)
    batches = np.array_split(rng.permutation(count), max(1, count // SLICE))

    def read_items(dataset: Any) -> None:
        for i in range(count):
            dataset[i].copy()

    def read_slices(dataset: Any) -> None:
        for start in range(0, count, SLICE):
            np.concatenate(dataset[start : start + SLICE])

    # A loader reuses one output buffer (gather's out=), as it would a pinned batch buffer.
    totals = [int(lengths[batch].sum()) for batch in batches]
    buffer = np.empty(max(totals), corpus.dtype)

    def read_batches() -> None:
        for batch, total in zip(batches, totals, strict=True):
            ours.gather(batch, out=buffer[:total])

    assert all(
        np.array_equal(ours.gather(batch, out=buffer[:total]), np.concatenate([megatron[int(i)] for i in batch]))
        for batch, total in zip(batches[:4], totals, strict=False)
    )
    log(f"sequential reads {label}: {count:,} documents ({gigabytes:.2f} GB) x {context.repeats} rounds")
    timings = measure(
        {
            "raw": lambda: raw_read(bin_path),
            "ours_items": lambda: read_items(ours),
            "megatron_items": lambda: read_items(megatron),
            "ours_slices": lambda: read_slices(ours),
            "megatron_slices": lambda: read_slices(megatron),
            "ours_gather": read_batches,
        },
        context.repeats,
    )
    rate = {name: gigabytes / timing.best for name, timing in timings.items()}
    bound = (
        f"ref: the physical bound, f.readinto of the whole .bin in {RAW_READ_CHUNK >> 20} MiB chunks from the page "
        "cache, timed in the same rounds; ratio = fraction of it"
    )
    rows += [
        Row.compare(
            f"sequential {label}: reader[i]",
            rate["ours_items"],
            rate["megatron_items"],
            "GB/s",
            goal=1.0,
            note=f"ref: megatron ds[i]; all {count:,} docs in order, each copied",
        ),
        Row.compare(
            f"sequential {label}: reader[a:a+{SLICE}]",
            rate["ours_slices"],
            rate["megatron_slices"],
            "GB/s",
            goal=1.0,
            note=f"ref: megatron ds[a:a+{SLICE}]; all docs in slices of {SLICE}, each slice concatenated (copied)",
        ),
        Row.compare(
            f"bound {label}: reader[a:a+{SLICE}] / raw read",
            rate["ours_slices"],
            rate["raw"],
            "GB/s",
            goal=0.5,
            note=bound,
        ),
        Row.compare(
            f"bound {label}: reader[i] / raw read",
            rate["ours_items"],
            rate["raw"],
            "GB/s",
            goal=0.5,
            note="same bound; one Python call and one copy per document, so this is per-call overhead more than "
            "bandwidth",
        ),
        Row.compare(
            f"bound {label}: gather({SLICE} random docs) / raw read",
            rate["ours_gather"],
            rate["raw"],
            "GB/s",
            goal=0.6,
            note=f"same bound; every doc once, in {len(batches):,} seeded random batches of ~{SLICE}, each "
            "gather(ids, out=) one copy into one reused buffer (C helper), output equal to megatron's ds[i] "
            "concatenated (asserted)",
        ),
    ]
    return rows


# -- group ----------------------------------------------------------------------------------------------------


def run(context: BenchContext) -> list[Row]:
    """Writer and reader rows for uint16, then int32; at most two corpora are on disk at any time."""
    documents = DOCUMENTS_QUICK if context.quick else DOCUMENTS_FULL
    rows: list[Row] = []
    for dtype in (np.uint16, np.int32):
        label = np.dtype(dtype).name
        log(f"generating {documents:,} {label} documents")
        corpus = make_corpus(documents, dtype)
        write_rows, prefix = _bench_writers(context, corpus, label)
        read_rows = _bench_readers(context, corpus, label, prefix)
        rows += write_rows + read_rows
        remove_prefix(prefix)
        del corpus
    return _ordered(rows)


def _ordered(rows: list[Row]) -> list[Row]:
    """Group the rows by kind (write, random, sequential, bound), keeping the dtype order within a kind."""
    kinds = ("write", "random", "sequential", "bound")
    return sorted(rows, key=lambda row: kinds.index(row.name.split(" ", 1)[0]))
