"""GPTDataset and BlendedDataset: index builds, cache loads, sample reads and many-prefix start-up vs megatron-core.

Both sides build from the same ``.bin``/``.idx`` files with the same settings (seq 4096, seed 1234, the same
tokenizer object), each into its own cache folder, through their public entry points: our
``build_indexed_text_dataset`` and megatron-core's ``BlendedMegatronDatasetBuilder(GPTDataset, ...).build()``.
Every speed row is backed by an assertion that the two give identical results (index arrays in values and dtypes,
lengths, sample contents), so a fast row never hides a wrong one.

The corpus is the one of ``indexed_io``: seeded lognormal document lengths (median ~600, mean ~1000 tokens),
uint16 tokens. megatron-core needs a process group for a weighted blend with a cache folder; a one-rank gloo group
is started for the duration of the group (with one rank our builder does no collective at all).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_indexed_io import DOCUMENTS_FULL, DOCUMENTS_QUICK, Corpus, make_corpus
from benchmarks.bench_indexed_io import SEED as CORPUS_SEED
from benchmarks.common import BenchContext, Row, Timing, log, measure, remove_prefix

NAME = "indexed_dataset"
TITLE = "GPTDataset/BlendedDataset index builds, cache loads, reads and start-up vs megatron-core"

SEQ_LENGTH = 4096
RANDOM_SEED = 1234
GPT_SPLIT = "98,1,1"
RANDOM_READS = 20_000
BATCH = 32
SAMPLE_CHECKS = 256
COLLATE_BATCHES = 100  # batches of BATCH samples collated per round
BLEND_WEIGHTS = (0.3, 0.25, 0.2, 0.15, 0.1)
BLEND_SAMPLES = {False: 10_000_000, True: 500_000}
STARTUP_PREFIXES = {False: 1_000, True: 200}
STARTUP_DOCUMENTS = 200  # per prefix, fewer in quick mode when the corpus is too small
GPT_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
BLEND_INDEX_NAMES = ("dataset_index", "dataset_sample_index")
SPLITS = ("train", "valid", "test")
LOWER = {"higher_is_better": False}


class BenchTokenizer:
    """The smallest tokenizer both implementations accept; one instance is given to both."""

    vocab_size = 50_257  # the corpus ids are drawn below it (bench_indexed_io.VOCAB_SIZE); datasets refuse larger ids
    eod = 0
    pad = 1

    @property
    def unique_identifiers(self) -> dict:
        return {"class": type(self).__name__, "vocab_size": self.vocab_size, "eod": self.eod, "pad": self.pad}


# -- the two implementations ----------------------------------------------------------------------------------


def _megatron() -> tuple[Any, Any, Any]:
    """megatron-core's builder, GPTDataset and GPTDatasetConfig, imported without warnings; its logs silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    logging.getLogger("megatron").setLevel(logging.ERROR)
    return BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig


def build_megatron(tokenizer: BenchTokenizer, sizes: Sequence[int | None], cache: Path, **config: Any) -> list[Any]:
    """``[train, valid, test]`` from megatron-core; ``config`` holds blend/blend_per_split/split and the flags."""
    builder, dataset_class, config_class = _megatron()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        megatron_config = config_class(
            random_seed=RANDOM_SEED,
            sequence_length=SEQ_LENGTH,
            path_to_cache=str(cache),
            tokenizer=tokenizer,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            **config,
        )
        return builder(dataset_class, list(sizes), lambda: True, megatron_config).build()


def build_ours(
    tokenizer: BenchTokenizer, data_path: Any, sizes: Sequence[int | None], cache: Path, **config: Any
) -> tuple[Any, ...]:
    """``(train, valid, test)`` from ``build_indexed_text_dataset``; ``config`` holds the other data_config keys."""
    from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset

    data_config = {
        "seq_length": SEQ_LENGTH,
        "random_seed": RANDOM_SEED,
        "data_cache_path": str(cache),
        "create_ltor_fields_in_dataloader": False,
        **config,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_indexed_text_dataset(data_path, data_config, list(sizes), tokenizer)


@contextlib.contextmanager
def one_rank_process_group() -> Iterator[None]:
    """A one-rank gloo process group for the duration of the block (kept if one already exists)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- checks ---------------------------------------------------------------------------------------------------


def _same_array(ours: np.ndarray, reference: np.ndarray, where: str) -> None:
    assert ours.dtype == reference.dtype, f"{where}: dtype {ours.dtype} differs from megatron-core's {reference.dtype}"
    assert ours.shape == reference.shape, f"{where}: shape {ours.shape} differs from megatron-core's {reference.shape}"
    assert np.array_equal(ours, reference), f"{where}: values differ from megatron-core's"


def assert_same_dataset(ours: Any, reference: Any, where: str) -> None:
    """Same kind, length and index arrays (values and dtypes); a blend's sources are compared too."""
    assert (ours is None) == (reference is None), f"{where}: one side built no dataset"
    if ours is None:
        return
    assert len(ours) == len(reference), f"{where}: {len(ours)} samples, megatron-core {len(reference)}"
    if hasattr(reference, "datasets"):
        for name in BLEND_INDEX_NAMES:
            _same_array(np.asarray(getattr(ours, name)), np.asarray(getattr(reference, name)), f"{where} {name}")
        assert len(ours.datasets) == len(reference.datasets), f"{where}: source counts differ"
        for k, (a, b) in enumerate(zip(ours.datasets, reference.datasets, strict=True)):
            assert_same_dataset(a, b, f"{where} source {k}")
        return
    for name in GPT_INDEX_NAMES:
        _same_array(np.asarray(getattr(ours, name)), np.asarray(getattr(reference, name)), f"{where} {name}")


def assert_same_splits(ours: Sequence[Any], reference: Sequence[Any], where: str) -> None:
    for split, a, b in zip(SPLITS, ours, reference, strict=True):
        assert_same_dataset(a, b, f"{where} {split}")


def megatron_fresh_sample(dataset: Any, idx: int) -> dict:
    """megatron-core's sample as the first read: it caches the loss mask it then zeroes at pad labels in place,
    so without this a later sample could inherit another's zeros."""
    for source in getattr(dataset, "datasets", [dataset]):
        source.masks_and_position_ids_are_cached = False
    return dataset[idx]


def assert_same_samples(ours: Any, reference: Any, indices: Sequence[int], where: str) -> None:
    """``ours[i]`` and ``ours.__getitems__`` against megatron-core's ``ds[i]``: tokens, labels, loss mask."""
    batched = ours.__getitems__(list(indices))
    for i, batch_sample in zip(indices, batched, strict=True):
        expected = megatron_fresh_sample(reference, i)
        for sample, how in ((ours[i], "ds[i]"), (batch_sample, "__getitems__")):
            for key in ("tokens", "labels", "loss_mask"):
                assert np.array_equal(sample[key].numpy(), expected[key].numpy()), f"{where} {how} {i}: {key} differs"
            if "dataset_id" in expected:
                assert int(sample["dataset_id"]) == int(expected["dataset_id"]), f"{where} {how} {i}: dataset_id"


def assert_collated_as_stacked(collate: Callable[[Any], Any], sample_batches: Sequence[list]) -> None:
    """The collator's batch holds the stacked samples: tokens as input_ids, the dataset's loss mask, and labels
    that are the samples' where the loss mask is 1 and IGNORE_INDEX elsewhere."""
    import torch
    from torch.utils.data import default_collate

    from hyper_parallel.data.constants import IGNORE_INDEX

    for samples in sample_batches:
        batch, stacked = collate(samples), default_collate(samples)
        expected = torch.where(stacked["loss_mask"] == 1, stacked["labels"], IGNORE_INDEX)
        assert torch.equal(batch.input_ids, stacked["tokens"]), "collator: input_ids differ from the tokens"
        assert torch.equal(batch.loss_mask, stacked["loss_mask"]), "collator: loss_mask differs"
        assert torch.equal(batch.labels, expected), "collator: labels differ from the masked samples' labels"


# -- files and folders ----------------------------------------------------------------------------------------


def write_prefix(prefix: Path, tokens: np.ndarray, lengths: np.ndarray) -> str:
    from hyper_parallel.data.indexed.io import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=tokens.dtype)
    builder.add_documents(tokens, lengths)
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def write_parts(corpus: Corpus, folder: Path, parts: int, documents: int | None = None) -> list[str]:
    """Write ``parts`` prefixes of consecutive corpus documents (``documents`` each, or an even share of all)."""
    folder.mkdir(parents=True, exist_ok=True)
    ends = np.cumsum(corpus.lengths)
    starts = ends - corpus.lengths
    if documents is None:
        bounds = np.linspace(0, len(corpus.lengths), parts + 1).astype(np.int64)
    else:
        bounds = np.arange(parts + 1, dtype=np.int64) * documents
    prefixes = []
    for k in range(parts):
        first, last = int(bounds[k]), int(bounds[k + 1])
        tokens = corpus.tokens[starts[first] : ends[last - 1]]
        prefixes.append(write_prefix(folder / f"part_{k:04d}", tokens, corpus.lengths[first:last]))
    return prefixes


class FreshFolders:
    """A new cache folder per call for each case, the previous one deleted; the last ones stay for warm loads."""

    def __init__(self, root: Path, label: str) -> None:
        self.root = root
        self.label = label
        self.current: dict[str, Path] = {}
        self._count = 0

    def renew(self, name: str) -> None:
        if name in self.current:
            shutil.rmtree(self.current[name], ignore_errors=True)
        self._count += 1
        self.current[name] = self.root / f"cache-{self.label}-{name}-{self._count}"

    def __getitem__(self, name: str) -> Path:
        return self.current[name]

    def remove(self) -> None:
        for folder in self.current.values():
            shutil.rmtree(folder, ignore_errors=True)
        self.current.clear()


class FirstRoundCheck:
    """``after`` hook of ``measure``: keeps each case's first result until its partner's arrives, then checks."""

    def __init__(self, pairs: dict[str, str], check: Callable[[Any, Any], None]) -> None:
        self.pairs = pairs  # our case -> its megatron-core case (each case in one pair)
        self.check = check
        self.results: dict[str, Any] = {}
        self.seen: set[str] = set()
        self.checked = 0

    def __call__(self, name: str, result: Any) -> None:
        if name in self.seen:
            return
        self.seen.add(name)
        self.results[name] = result
        for ours, reference in self.pairs.items():
            if ours in self.results and reference in self.results:
                self.check(self.results.pop(ours), self.results.pop(reference))
                self.checked += 1

    def assert_complete(self) -> None:
        assert self.checked == len(self.pairs), "a comparison with megatron-core was never made"


def _ms(timing: Timing) -> float:
    return timing.best * 1e3


# -- 1. GPTDataset: cold build and warm load ------------------------------------------------------------------


def _bench_gpt_builds(context: BenchContext, prefix: str, lengths: np.ndarray) -> tuple[list[Row], Any, Any]:
    """Cold and warm builds of one prefix; returns the rows and the warm-loaded train splits (ours, megatron)."""
    tokenizer = BenchTokenizer()
    from hyper_parallel.data.indexed.indexed_data_config import split_matrix, split_range

    _, train_end = split_range(split_matrix(GPT_SPLIT)[0], len(lengths))
    train_tokens = int(lengths[:train_end].sum())
    train_samples = 2 * ((train_tokens - 1) // SEQ_LENGTH)  # two epochs' worth
    sizes = [train_samples, None, None]
    folders = FreshFolders(context.workdir, "gpt")

    def ours() -> tuple[Any, ...]:
        return build_ours(tokenizer, prefix, sizes, folders["ours"], split=GPT_SPLIT)

    def megatron() -> list[Any]:
        return build_megatron(tokenizer, sizes, folders["megatron"], blend=([prefix], None), split=GPT_SPLIT)

    cases = {"megatron": megatron, "ours": ours}
    rounds = max(context.repeats, 9)
    log(f"GPTDataset cold builds: {len(lengths):,} docs, {train_samples:,} train samples x {rounds} rounds")
    cold_check = FirstRoundCheck({"ours": "megatron"}, lambda a, b: assert_same_splits(a, b, "GPTDataset cold"))
    cold = measure(cases, rounds, before=folders.renew, after=cold_check)
    cold_check.assert_complete()

    # The last cold round's folders hold complete caches: warm loads read them.
    warm_rounds = max(context.repeats, 25)
    log(f"GPTDataset warm loads x {warm_rounds} rounds")
    warm_check = FirstRoundCheck({"ours": "megatron"}, lambda a, b: assert_same_splits(a, b, "GPTDataset warm"))
    warm = measure(cases, warm_rounds, after=warm_check)
    warm_check.assert_complete()
    ours_splits, megatron_splits = ours(), megatron()
    assert_same_splits(ours_splits, megatron_splits, "GPTDataset warm")

    note = (
        f"1 prefix, {len(lengths):,} docs ({int(lengths.sum()) / 1e6:,.0f}M uint16 tokens), seq {SEQ_LENGTH}, "
        f"split {GPT_SPLIT}, train {train_samples:,} samples (2 epochs), valid/test 1 epoch; ours "
        "build_indexed_text_dataset, ref megatron BlendedMegatronDatasetBuilder(GPTDataset).build(); cold: a "
        f"fresh cache folder every round (best of {rounds}); warm: caches present, arrays memory-mapped (best of "
        f"{warm_rounds}); document/sample/shuffle indices of all 3 splits asserted identical (values, dtypes)"
    )
    rows = [
        Row.compare(
            "GPTDataset cold build, 3 splits",
            _ms(cold["ours"]),
            _ms(cold["megatron"]),
            "ms",
            goal=1.0,
            note=note,
            **LOWER,
        ),
        Row.compare(
            "GPTDataset warm load, 3 splits",
            _ms(warm["ours"]),
            _ms(warm["megatron"]),
            "ms",
            goal=1.0,
            note=note,
            **LOWER,
        ),
    ]
    train = ours_splits[0], megatron_splits[0]
    folders.remove()
    return rows, *train


# -- 2. GPTDataset: random reads ------------------------------------------------------------------------------


def _bench_gpt_reads(context: BenchContext, ours: Any, megatron: Any) -> list[Row]:
    """Random ``ds[i]`` on both sides and our batched ``__getitems__``, over the same seeded indices."""
    assert len(ours) == len(megatron)
    count = RANDOM_READS
    indices = np.random.default_rng(CORPUS_SEED + 2).integers(0, len(ours), count).tolist()
    batches = [indices[b : b + BATCH] for b in range(0, count, BATCH)]
    assert_same_samples(ours, megatron, indices[:SAMPLE_CHECKS], "GPTDataset train")
    ours_keys, megatron_keys = sorted(ours[0]), sorted(megatron[0])

    def read_megatron() -> None:
        for i in indices:
            megatron[i]

    def read_ours() -> None:
        for i in indices:
            ours[i]

    def read_ours_batched() -> None:
        for batch in batches:
            ours.__getitems__(batch)

    from torch.utils.data import default_collate

    from hyper_parallel.data.batching.build_collate_fn import build_indexed_collate_fn

    collate = build_indexed_collate_fn(eod_token_id=BenchTokenizer.eod)
    sample_batches = [ours.__getitems__(batch) for batch in batches[:COLLATE_BATCHES]]
    assert_collated_as_stacked(collate, sample_batches[:4])

    def collate_ours() -> None:
        for samples in sample_batches:
            collate(samples)

    def collate_default() -> None:
        for samples in sample_batches:
            default_collate(samples)

    rounds = max(context.repeats, 3)
    log(f"GPTDataset random reads: {count:,} samples x {rounds} rounds")
    timings = measure(
        {
            "megatron": read_megatron,
            "ours": read_ours,
            "ours_batched": read_ours_batched,
            "collate_default": collate_default,
            "collate_ours": collate_ours,
        },
        rounds,
    )
    collated = len(sample_batches) * BATCH
    reference = count / timings["megatron"].best
    note = (
        f"{count:,} seeded random train samples ({SEQ_LENGTH + 1} tokens each, copied out of the .bin map into new "
        f"int64 tensors); ours ds[i], or ds.__getitems__(batches of {BATCH}) as torch's DataLoader calls it; ref "
        f"megatron ds[i] (it has no __getitems__); ours returns {', '.join(ours_keys)}, megatron "
        f"{', '.join(megatron_keys)} (ours create_ltor_fields_in_dataloader False, megatron create_attention_mask "
        "False); the first "
        f"{SAMPLE_CHECKS} samples asserted identical (tokens, labels, loss_mask) through both of our calls"
    )
    return [
        Row.compare(
            "GPTDataset random ds[i]",
            count / timings["ours"].best,
            reference,
            "samples/s",
            goal=1.5,
            note=note,
        ),
        Row.compare(
            f"GPTDataset batched __getitems__({BATCH})",
            count / timings["ours_batched"].best,
            reference,
            "samples/s",
            goal=8.0,
            note=note,
        ),
        Row.compare(
            f"Indexed collator({BATCH}) vs default_collate",
            collated / timings["collate_ours"].best,
            collated / timings["collate_default"].best,
            "samples/s",
            note=(
                f"information; {len(sample_batches)} batches of {BATCH} GPTDataset samples from __getitems__ "
                f"(seq {SEQ_LENGTH}); ours IndexedStackingCollator (stack, labels IGNORE_INDEX where the loss mask "
                "is 0, cu_seq_lens after each EOD, the Batch contract's checks); ref torch default_collate of the "
                "same samples (megatron-style stacking only); the first 4 batches asserted equal to the stacked samples"
            ),
        ),
    ]


# -- 3. BlendedDataset: cold build and warm load --------------------------------------------------------------


def _shuffle_calls(dataset: Any) -> list[tuple[str, int, np.dtype]]:
    """The ``RandomState.shuffle`` calls parity forces on one of our GPTDatasets: (which index, length, dtype)."""
    from hyper_parallel.data.indexed.indexed_helpers import (
        num_epochs,
        num_samples_sans_final_epoch,
        separate_final_epoch,
    )

    extra = dataset.config.add_extra_token_to_sequence
    tokens, documents = dataset.tokens_per_epoch, len(dataset.indices)
    epochs = num_epochs(tokens, SEQ_LENGTH, dataset.num_samples, extra)
    separate = separate_final_epoch(epochs, tokens, SEQ_LENGTH, dataset.num_samples, extra)
    total = len(dataset.shuffle_index)
    int32, shuffle_dtype = np.dtype(np.int32), dataset.shuffle_index.dtype
    if not separate or epochs == 1:
        return [("document", epochs * documents, int32), ("shuffle", total, shuffle_dtype)]
    first = num_samples_sans_final_epoch(epochs, tokens, SEQ_LENGTH, extra)
    return [
        ("document", (epochs - 1) * documents, int32),
        ("document", documents, int32),
        ("shuffle", first, shuffle_dtype),
        ("shuffle", total - first, shuffle_dtype),
    ]


def time_forced_shuffles(datasets: Sequence[Any], repeats: int) -> dict[str, float]:
    """Best seconds of the legacy shuffles on arrays of the sizes the sources shuffle: numpy's and ours.

    Both start from ``RandomState(seed)``; the permutations and the generator states afterwards are asserted equal.
    """
    from hyper_parallel.data.indexed.indexed_helpers import _legacy_shuffle

    calls = [call for dataset in datasets for call in _shuffle_calls(dataset)]
    best = {"numpy": float("inf"), "ours": float("inf")}
    for _ in range(repeats):
        spent = dict.fromkeys(best, 0.0)
        for _which, length, dtype in calls:
            arrays, states = {}, {}
            for name, shuffle in (("numpy", np.random.RandomState.shuffle), ("ours", _legacy_shuffle)):
                array = np.arange(length, dtype=dtype)
                rng = np.random.RandomState(RANDOM_SEED)
                start = time.perf_counter()
                shuffle(rng, array)
                spent[name] += time.perf_counter() - start
                arrays[name], states[name] = array, rng.get_state()[1:3]
            assert np.array_equal(arrays["numpy"], arrays["ours"]), "the shuffles differ"
            assert np.array_equal(states["numpy"][0], states["ours"][0]) and states["numpy"][1] == states["ours"][1]
            del arrays
        best = {name: min(best[name], spent[name]) for name in best}
    return best


def _bench_blend(context: BenchContext, prefixes: list[str], tokens: int) -> list[Row]:
    tokenizer = BenchTokenizer()
    samples = BLEND_SAMPLES[context.quick]
    sizes = [samples, 0, 0]
    data_path = [str(v) for pair in zip(BLEND_WEIGHTS, prefixes, strict=True) for v in pair]
    folders = FreshFolders(context.workdir, "blend")

    def ours() -> tuple[Any, ...]:
        return build_ours(tokenizer, data_path, sizes, folders["ours"], split="100,0,0")

    def megatron() -> list[Any]:
        return build_megatron(
            tokenizer, sizes, folders["megatron"], blend=(prefixes, list(BLEND_WEIGHTS)), split="100,0,0"
        )

    cases = {"megatron": megatron, "ours": ours}
    rounds = context.repeats
    log(f"BlendedDataset cold builds: {len(prefixes)} prefixes, {samples:,} train samples x {rounds} rounds")
    kept: dict[str, Any] = {}

    def check_cold(a: Any, b: Any) -> None:
        assert_same_splits(a, b, "BlendedDataset cold")
        kept["ours"] = a[0]

    cold_check = FirstRoundCheck({"ours": "megatron"}, check_cold)
    cold = measure(cases, rounds, before=folders.renew, after=cold_check)
    cold_check.assert_complete()
    sources = kept.pop("ours").datasets
    epochs = [round(d.num_samples * SEQ_LENGTH / d.tokens_per_epoch) for d in sources]

    warm_rounds = max(context.repeats, 10)
    log(f"BlendedDataset warm loads x {warm_rounds} rounds")
    warm_check = FirstRoundCheck({"ours": "megatron"}, lambda a, b: assert_same_splits(a, b, "BlendedDataset warm"))
    warm = measure(cases, warm_rounds, after=warm_check)
    warm_check.assert_complete()
    ours_splits, megatron_splits = ours(), megatron()
    checked = np.random.default_rng(CORPUS_SEED + 3).integers(0, samples, 64).tolist()
    assert_same_samples(ours_splits[0], megatron_splits[0], checked, "BlendedDataset train")
    cache_mb = sum(f.stat().st_size for f in folders["ours"].iterdir()) / 1e6
    del ours_splits, megatron_splits

    log("timing the legacy shuffles of the blend's sources")
    shuffles = time_forced_shuffles(sources, max(2, context.repeats - 1))
    del sources
    folders.remove()

    note = (
        f"{len(prefixes)} prefixes of ~{tokens / len(prefixes) / 1e6:,.0f}M tokens, weights "
        f"{'/'.join(map(str, BLEND_WEIGHTS))}, {samples:,} train samples, seq {SEQ_LENGTH}, split 100,0,0 (sources "
        f"take {min(epochs)}-{max(epochs)} epochs, ~{cache_mb:,.0f} MB of cache per side); ref megatron "
        f"BlendedMegatronDatasetBuilder; cold: a fresh cache folder every round (best of {rounds}); warm: caches "
        f"present (best of {warm_rounds}); blending indices and every source's indices asserted identical, and 64 "
        "random samples"
    )
    ours_cold = cold["ours"].best
    return [
        Row.compare(
            "blend cold build",
            ours_cold,
            cold["megatron"].best,
            "s",
            goal=0.5,
            note=note,
            **LOWER,
        ),
        Row.compare(
            "blend warm load",
            _ms(warm["ours"]),
            _ms(warm["megatron"]),
            "ms",
            goal=1.0,
            note=note,
            **LOWER,
        ),
        Row.compare(
            "blend shuffles: ours vs RandomState.shuffle",
            shuffles["ours"],
            shuffles["numpy"],
            "s",
            note=f"information; the document- and shuffle-index shuffles of the blend's sources, on arrays of their "
            f"sizes from RandomState({RANDOM_SEED}): ours (C, bit-identical, GIL released) vs numpy's legacy "
            "shuffle, which megatron-core calls; permutations and generator states asserted equal",
            **LOWER,
        ),
    ]


# -- 4. start-up with many prefixes ---------------------------------------------------------------------------


def write_sequences_file(prefixes: list[str], path: Path) -> dict[str, list[int]]:
    """``{prefix: [sequence_count, document_count]}``, written by the library's tool (or from the headers)."""
    try:
        from hyper_parallel.data.tools.build_sequences_per_dataset import write_sequences_per_dataset
    except ImportError:
        import json

        from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader

        counts = {}
        for prefix in prefixes:
            reader = IndexedDataReader(prefix)
            counts[prefix] = [len(reader.sequence_lengths), len(reader.document_indices)]
        path.write_text(json.dumps(counts))
        return counts
    return write_sequences_per_dataset(prefixes, path, progress=False)


def _bench_startup(context: BenchContext, corpus: Corpus) -> list[Row]:
    tokenizer = BenchTokenizer()
    count = STARTUP_PREFIXES[context.quick]
    documents = min(STARTUP_DOCUMENTS, len(corpus.lengths) // count)
    folder = context.workdir / "startup"
    log(f"start-up: writing {count:,} prefixes of {documents} docs")
    prefixes = write_parts(corpus, folder, count, documents)
    sequences_path = folder / "sequences_per_dataset.json"
    counts = write_sequences_file(prefixes, sequences_path)
    sequences = {prefix: tuple(value) for prefix, value in counts.items()}
    caches = {"ours": context.workdir / "cache-startup-ours", "megatron": context.workdir / "cache-startup-megatron"}
    sizes = [None, 0, 0]  # one epoch of every source, blended by their sizes (exhaustive)

    def ours(fast: bool, with_sequences: bool) -> Any:
        flags = {"fast_cache_load": fast, "defer_npy_index_mmap": fast}
        if with_sequences:
            flags["per_dataset_sequences_path"] = str(sequences_path)
        return build_ours(tokenizer, None, sizes, caches["ours"], split=None, train_data_path=prefixes, **flags)[0]

    def megatron(fast: bool, with_sequences: bool) -> Any:
        flags = {"fast_cache_load": fast, "defer_npy_index_mmap": fast}
        if with_sequences:
            flags["sequences_per_dataset"] = sequences
        return build_megatron(
            tokenizer, sizes, caches["megatron"], blend_per_split=[(prefixes, None), None, None], **flags
        )[0]

    log("start-up: preparing both caches with one ordinary build each")
    start = time.perf_counter()
    reference = megatron(False, False)
    middle = time.perf_counter()
    prepared = ours(False, False)
    ours_seconds = time.perf_counter() - middle
    log(f"start-up: cold builds took {middle - start:.1f} s (megatron-core), {ours_seconds:.1f} s (ours)")
    assert_same_dataset(prepared, reference, f"start-up blend of {count} prefixes")
    expected = len(reference)
    del prepared, reference

    cases = {
        "megatron": lambda: megatron(True, False),
        "ours": lambda: ours(True, False),
        "megatron_sequences": lambda: megatron(True, True),
        "ours_sequences": lambda: ours(True, True),
    }
    probe = np.random.default_rng(CORPUS_SEED + 4).integers(0, expected, 16).tolist()

    def check(a: Any, b: Any) -> None:
        assert len(a) == len(b) == expected, f"start-up: lengths {len(a)} and {len(b)}, expected {expected}"
        assert_same_samples(a, b, probe, "start-up blend")

    rounds = max(context.repeats, 3)
    log(f"start-up: warm builds of {count:,} prefixes x {rounds} rounds")
    startup_check = FirstRoundCheck({"ours": "megatron", "ours_sequences": "megatron_sequences"}, check)
    timings = measure(cases, rounds, after=startup_check)
    startup_check.assert_complete()
    shutil.rmtree(folder, ignore_errors=True)
    for cache in caches.values():
        shutil.rmtree(cache, ignore_errors=True)

    note = (
        f"{count:,} prefixes of {documents} docs as one unweighted train blend (ours train_data_path, megatron "
        "blend_per_split: its fast_cache_load forbids blend), one epoch each; caches prepared by one ordinary build; "
        "time to the returned datasets with fast_cache_load + defer_npy_index_mmap on both sides, plus per_dataset_"
        "sequences_path (ours, written by tools.build_sequences_per_dataset) and sequences_per_dataset (megatron, "
        f"same counts) in the second row (best of {rounds}); lengths asserted = {expected:,}, 16 random samples "
        "identical"
    )
    return [
        Row.compare(
            f"start-up {count:,} prefixes, warm",
            _ms(timings["ours"]),
            _ms(timings["megatron"]),
            "ms",
            goal=0.25,
            note=note,
            **LOWER,
        ),
        Row.compare(
            f"start-up {count:,} prefixes, warm + sequences file",
            _ms(timings["ours_sequences"]),
            _ms(timings["megatron_sequences"]),
            "ms",
            goal=0.25,
            note=note,
            **LOWER,
        ),
    ]


# -- group ----------------------------------------------------------------------------------------------------


def run(context: BenchContext) -> list[Row]:
    """GPTDataset builds and reads on one prefix, then a 5-prefix blend, then start-up with many prefixes."""
    documents = DOCUMENTS_QUICK if context.quick else DOCUMENTS_FULL
    log(f"generating {documents:,} uint16 documents")
    corpus = make_corpus(documents, np.uint16, CORPUS_SEED)
    rows: list[Row] = []
    with one_rank_process_group():
        prefix = write_prefix(context.workdir / "corpus", corpus.tokens, corpus.lengths)
        build_rows, ours_train, megatron_train = _bench_gpt_builds(context, prefix, corpus.lengths)
        rows += build_rows
        rows += _bench_gpt_reads(context, ours_train, megatron_train)
        del ours_train, megatron_train
        remove_prefix(prefix)

        log("writing the corpus as 5 blend prefixes")
        blend_prefixes = write_parts(corpus, context.workdir / "blend", len(BLEND_WEIGHTS))
        rows += _bench_blend(context, blend_prefixes, corpus.tokens.size)
        shutil.rmtree(context.workdir / "blend", ignore_errors=True)

        rows += _bench_startup(context, corpus)
    return rows
