"""Specification: for the same ``.idx``/``.bin`` files, config and seed, ``build_indexed_text_dataset`` returns the
datasets megatron-core's ``BlendedMegatronDatasetBuilder`` returns: the same dataset kinds and lengths, the same
document/sample/shuffle and blending indices (values and dtypes), and the same samples in the same order.

megatron-core 0.16.1 is the test-only reference. Each side builds into its own cache directory, so neither reads
the other's cache. Where megatron-core misbehaves, the tests state our behaviour instead of copying it:

* its cache key omits ``add_extra_token_to_sequence``, so it reuses stale indices; ours rebuilds;
* it loops forever when samples are requested from a split without tokens; ours raises ``DataConfigError``;
* without the reset/EOD options it caches the first sample's loss mask after zeroing that sample's pad labels, so
  its samples depend on the reading order; ours do not (the comparisons read megatron-core's samples as if each
  were the first).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path

import numpy as np
import pytest
import torch

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset

from .megatron_reference import (
    SPLITS,
    BuildSpec,
    Document,
    ParityTokenizer,
    assert_array_equal,
    assert_builds_equal,
    assert_gpt_indices_equal,
    assert_sample_equal,
    build_megatron,
    build_ours,
    epoch_regime,
    forget_cached_masks,
    is_megatron_refusal,
    megatron_sample,
    sequence_lengths,
    split_ranges,
    write_prefix,
)

BASE_SEED = 20_240_611
NUM_CASES = 80
KINDS = ("single", "weighted", "unweighted", "per_split", "single_weighted")
SPLIT_STRINGS = ("98,1,1", "70,20,10", "1,0,0", "969,30,1", "80, 10, 10", "50,50,0", "8/1/1")
REGIMES = ("one_epoch", "multi_epoch", "separate_final_epoch")
# Randomised cases that megatron-core refuses on purpose (a final partial validation sample ending in an empty
# sequence); the test then checks that ours refuses them too. Listed so that the suite cannot drift into refusals.
MEGATRON_REFUSES = {57}


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """megatron-core needs a process group to build blends with a cache directory: a one-rank gloo group, set up
    once for this file (all its tests run in one process, also under ``--dist loadfile``) and torn down after it."""
    if torch.distributed.is_initialized():
        yield
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    yield
    torch.distributed.destroy_process_group()


def build_both(spec: BuildSpec, tokenizer: ParityTokenizer, directory: Path) -> tuple[tuple, list]:
    """Our splits and megatron-core's, each from its own fresh cache directory."""
    return build_ours(spec, tokenizer, directory / "cache_ours"), build_megatron(
        spec, tokenizer, directory / "cache_megatron"
    )


# -- randomised configurations ------------------------------------------------------------------------------------


@dataclass
class Case:
    """One randomised configuration: the files to write, the build settings and the tokenizer."""

    kind: str
    spec: BuildSpec
    tokenizer: ParityTokenizer
    prefixes: list[str]
    documents: list[list[Document]]  # per prefix
    dtypes: list  # per prefix
    regime: str | None  # the train split's regime, for the single-prefix cases
    train_tokens: int | None  # tokens of the train split, for the single-prefix cases

    def write(self) -> None:
        for prefix, documents, dtype in zip(self.prefixes, self.documents, self.dtypes, strict=True):
            write_prefix(Path(prefix), documents, dtype)


def random_documents(rng: np.random.Generator, count: int, dtype, eod: int, pad: int, multi: float) -> list[Document]:
    """``count`` documents: mostly one sequence of 1-80 tokens; some empty documents, zero-length sequences, long
    sequences and multi-sequence (sentence-split) documents. Sequences usually end with EOD; EOD and pad ids also
    occur inside them."""
    high = 65_500 if dtype == np.uint16 else 100_000
    documents: list[Document] = []
    for _ in range(count):
        draw = rng.random()
        if draw < 0.03:
            documents.append([])
            continue
        if draw < 0.08:
            lengths = [0]
        elif draw < 0.13:
            lengths = [int(rng.integers(300, 3000))]
        elif draw < 0.13 + multi:
            lengths = [int(n) for n in rng.integers(1, 30, size=int(rng.integers(2, 4)))]
        else:
            lengths = [int(rng.integers(1, 81))]
        sequences = []
        for length in lengths:
            tokens = rng.integers(10, high, size=length)
            tokens[rng.random(length) < 0.05] = eod
            tokens[rng.random(length) < 0.02] = pad
            if length and rng.random() < 0.8:
                tokens[-1] = eod
            sequences.append(tokens)
        documents.append(sequences)
    return documents


def split_tokens(documents: list[Document], split: str) -> list[int | None]:
    """Tokens of each split of one prefix (None for an absent split)."""
    lengths = sequence_lengths(documents)
    return [None if r is None else int(lengths[r[0] : r[1]].sum()) for r in split_ranges(split, len(lengths))]


def pick_num_samples(rng: np.random.Generator, tokens: int, seq_length: int, extra: int, regime: str) -> int:
    """A train sample count that puts a dataset of ``tokens`` tokens per epoch in ``regime``."""
    per_epoch = (tokens - extra) // seq_length
    if regime == "one_epoch":
        return int(rng.integers(1, per_epoch + 1))
    want_separate = regime == "separate_final_epoch"
    epochs = int(rng.integers(2, 5))
    for _ in range(1000):
        num_samples = int(rng.integers((epochs - 1) * per_epoch + 1, epochs * per_epoch + 2))
        found_epochs, separate = epoch_regime(tokens, seq_length, num_samples, extra)
        if found_epochs > 1 and separate == want_separate:
            return num_samples
    raise AssertionError(f"no sample count gives {regime} for T={tokens}, S={seq_length}")


def blend_list(rng: np.random.Generator, prefixes: list[str], weighted: bool) -> str | list[str]:
    """A Megatron blend list (weights before prefixes) or a plain prefix list; sometimes one whitespace string."""
    if weighted:
        entries = []
        for prefix in prefixes:
            entries += [f"{rng.uniform(0.1, 10.0):.3g}", prefix]
    else:
        entries = list(prefixes)
    return " ".join(entries) if rng.random() < 0.3 else entries


def some_of(rng: np.random.Generator, prefixes: list[str], most: int) -> list[str]:
    """One to ``most`` distinct prefixes, in random order."""
    count = int(rng.integers(1, min(most, len(prefixes)) + 1))
    return [str(p) for p in rng.choice(prefixes, size=count, replace=False)]


def make_case(index: int, directory: Path) -> Case:
    """Randomised configuration ``index`` (deterministic), with prefixes under ``directory`` (not written)."""
    rng = np.random.default_rng([BASE_SEED, index])
    kind = KINDS[index % len(KINDS)]
    seq_length = int(rng.choice([1, 2, 3, int(rng.integers(4, 17)), int(rng.integers(17, 65))]))
    extra = int(rng.random() < 0.6)
    eod = int(rng.integers(0, 10))
    pad = eod if rng.random() < 0.2 else int(rng.integers(0, 10))
    tokenizer = ParityTokenizer(eod=eod, pad=pad)
    split = str(rng.choice(SPLIT_STRINGS))
    per_split = kind == "per_split"
    num_prefixes = 1 if kind in ("single", "single_weighted") else int(rng.integers(2, 6))
    prefixes = [str(directory / f"source{k}_text_document") for k in range(num_prefixes)]

    # Documents: every present split of every prefix must hold a few samples' worth of tokens, or megatron-core
    # hangs (no tokens) or rejects the blend (a source without samples).
    documents, dtypes = [], []
    for _ in range(num_prefixes):
        dtype = np.uint16 if rng.random() < 0.5 else np.int32
        for _attempt in range(200):
            wide = split == "969,30,1" and not per_split
            count = int(rng.integers(300 if wide else 20, 401))
            docs = random_documents(rng, count, dtype, eod, pad, multi=0.6 if wide else float(rng.uniform(0, 0.3)))
            tokens = split_tokens(docs, "1,0,0" if per_split else split)
            if all(t is None or t >= 2 * (seq_length + 1) for t in tokens):
                break
        else:
            raise AssertionError(f"case {index}: no documents fit split {split} with S={seq_length}")
        documents.append(docs)
        dtypes.append(dtype)

    train_tokens = split_tokens(documents[0], split)[0] if kind == "single" else None
    regime = REGIMES[(index // len(KINDS)) % len(REGIMES)] if kind == "single" else None
    total_train = sum(split_tokens(d, "1,0,0" if per_split else split)[0] for d in documents)
    per_epoch = max(1, (total_train - extra) // seq_length)

    def size(may_be_none: bool) -> int | None:
        """A valid/test sample count; None (one epoch) only where megatron-core allows it (no weights)."""
        if may_be_none and rng.random() < 0.4:
            return None
        return int(rng.integers(1, max(2, per_epoch // 4)))

    data_path = per_split_paths = None
    if kind == "single":
        data_path = prefixes[0] if rng.random() < 0.5 else [prefixes[0]]
        train = pick_num_samples(rng, train_tokens, seq_length, extra, regime)
        if regime == "one_epoch" and rng.random() < 0.3:
            train = None
        sizes = (train, size(True), size(True))
    elif kind == "unweighted":
        data_path = blend_list(rng, prefixes, weighted=False)
        train = None if rng.random() < 0.4 else int(rng.integers(1, 2 * per_epoch))
        sizes = (train, size(True), size(True))
    elif kind in ("weighted", "single_weighted"):
        data_path = blend_list(rng, prefixes, weighted=True)
        sizes = (int(per_epoch * rng.uniform(0.2, 3.0)) + 1, size(False), size(False))
    else:
        # train: one prefix, or a weighted blend of one to three; valid and test: absent, one prefix, or a
        # weighted or unweighted blend
        chosen = some_of(rng, prefixes, most=3)
        paths: list = [prefixes[0] if rng.random() < 0.3 else blend_list(rng, chosen, weighted=True)]
        may_be_none = [False]
        for _ in range(2):
            choice = rng.random()
            if choice < 0.25:
                paths.append(None)
                may_be_none.append(True)
            elif choice < 0.5:
                paths.append(str(rng.choice(prefixes)))
                may_be_none.append(True)
            else:
                chosen = some_of(rng, prefixes, most=num_prefixes)
                weighted = bool(rng.random() < 0.5)
                paths.append(blend_list(rng, chosen, weighted))
                may_be_none.append(not weighted)
        per_split_paths = tuple(paths)
        sizes = (int(per_epoch * rng.uniform(0.2, 3.0)) + 1, size(may_be_none[1]), size(may_be_none[2]))

    spec = BuildSpec(
        seq_length=seq_length,
        sizes=sizes,
        data_path=data_path,
        per_split_paths=per_split_paths,
        split=split,
        random_seed=int(rng.integers(0, 2**32)),
        add_extra_token_to_sequence=bool(extra),
        drop_last_partial_validation_sequence=bool(rng.random() < 0.5),
        mid_level_dataset_surplus=float(rng.choice([0.005, 0.005, 0.05, 0.5])),
        reset_position_ids=bool(rng.random() < 0.3),
        reset_attention_mask=bool(rng.random() < 0.3),
        eod_mask_loss=bool(rng.random() < 0.3),
        create_attention_mask=False,
    )
    return Case(kind, spec, tokenizer, prefixes, documents, dtypes, regime, train_tokens)


def train_regime(case: Case) -> str:
    """The epoch regime of a single-prefix case's train split, by the reference's arithmetic."""
    extra = int(case.spec.add_extra_token_to_sequence)
    epochs, separate = epoch_regime(case.train_tokens, case.spec.seq_length, case.spec.sizes[0], extra)
    return "one_epoch" if epochs == 1 else "separate_final_epoch" if separate else "multi_epoch"


def case_id(index: int) -> str:
    return f"case{index:02d}-{KINDS[index % len(KINDS)]}"


def test_randomised_cases_cover_the_hard_paths():
    """The randomised configurations include every regime of the epoch arithmetic (one epoch, several epochs
    shuffled together, a separate final epoch), both token dtypes, both extra-token settings, both validation drop
    settings, zero-length and long sequences, empty documents, pad == eod, one-epoch (None) sizes, and blend lists of
    odd and even length."""
    cases = [make_case(i, Path("/unused")) for i in range(NUM_CASES)]
    regimes = {r: 0 for r in REGIMES}
    for case in cases:
        if case.regime is not None:
            regimes[train_regime(case)] += 1
    assert min(regimes.values()) >= 4, regimes
    assert {np.dtype(d) for c in cases for d in c.dtypes} == {np.dtype(np.uint16), np.dtype(np.int32)}
    assert {c.spec.add_extra_token_to_sequence for c in cases} == {True, False}
    assert {c.spec.drop_last_partial_validation_sequence for c in cases} == {True, False}
    assert {c.spec.split for c in cases} == set(SPLIT_STRINGS)
    assert sum(c.tokenizer.pad == c.tokenizer.eod for c in cases) >= 5
    assert sum(None in c.spec.sizes for c in cases) >= 10
    all_lengths = np.concatenate([np.array([len(s) for d in docs for s in d]) for c in cases for docs in c.documents])
    assert (all_lengths == 0).sum() > 100 and (all_lengths >= 300).sum() > 100
    assert sum(len(d) == 0 for c in cases for docs in c.documents for d in docs) > 50
    list_lengths = {
        len(c.spec.data_path) for c in cases if c.kind == "unweighted" and isinstance(c.spec.data_path, list)
    }
    assert {n % 2 for n in list_lengths} == {0, 1}
    assert {s for c in cases for s in (c.spec.seq_length,)} >= {1, 2, 3}


@pytest.mark.parametrize(
    "index",
    list(range(NUM_CASES)),
    ids=case_id,
)
def test_randomised_configuration_matches_megatron(index, tmp_path):
    """For a randomised configuration, every split has the same kind (plain or blended) and length as megatron-core's,
    every GPT dataset the same document/sample/shuffle indices and every blend the same dataset/sample indices
    (values and dtypes), and every sample (a seeded subset of 200 for large splits) the same tokens, labels, loss
    mask and dataset id."""
    case = make_case(index, tmp_path)
    case.write()
    try:
        theirs = build_megatron(case.spec, case.tokenizer, tmp_path / "cache_megatron")
    except (AssertionError, IndexError) as error:
        if not is_megatron_refusal(error):
            raise
        assert index in MEGATRON_REFUSES, f"megatron-core refuses case {index}: {error!r}"
        # a configuration megatron-core refuses on purpose is refused by ours too
        with pytest.raises(DataConfigError):
            build_ours(case.spec, case.tokenizer, tmp_path / "cache_ours")
        return
    assert index not in MEGATRON_REFUSES, f"megatron-core builds case {index}, listed as refused"
    warned: list[str] = []
    ours = build_ours(case.spec, case.tokenizer, tmp_path / "cache_ours", warned)
    if case.regime is not None:
        # the configuration reaches the regime it was drawn for, and megatron-core builds that many epochs
        assert train_regime(case) == case.regime
        epochs = len(theirs[0].document_index) // len(theirs[0].indices)
        assert (epochs > 1) == (case.regime != "one_epoch")
        if case.regime == "separate_final_epoch":  # the final epoch's documents are shuffled on their own
            final_epoch = theirs[0].document_index[-len(theirs[0].indices) :]
            assert np.array_equal(np.sort(final_epoch), theirs[0].indices)
    assert_builds_equal(ours, theirs, np.random.default_rng([BASE_SEED, index, 1]))
    pad_warnings = [w for w in warned if "pad id" in w]
    assert bool(pad_warnings) == (case.tokenizer.pad == case.tokenizer.eod), pad_warnings


# -- LTR fields ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ltor_prefix(tmp_path_factory) -> tuple[str, ParityTokenizer]:
    """A prefix with frequent EODs (several per sample), and pad ids inside the data."""
    rng = np.random.default_rng([BASE_SEED, 2])
    tokenizer = ParityTokenizer(eod=0, pad=1)
    documents = random_documents(rng, 60, np.uint16, tokenizer.eod, tokenizer.pad, multi=0.2)
    documents = [[s[:12] for s in d] for d in documents]  # short sequences: several documents per sample
    return write_prefix(tmp_path_factory.mktemp("ltor") / "ltor_text_document", documents, np.uint16), tokenizer


@pytest.mark.parametrize(
    ("reset_position_ids", "reset_attention_mask", "eod_mask_loss", "create_attention_mask"),
    list(product([False, True], repeat=4)),
)
def test_ltor_fields_match_megatron(
    ltor_prefix, tmp_path, reset_position_ids, reset_attention_mask, eod_mask_loss, create_attention_mask
):
    """With ``create_ltor_fields_in_dataloader``, samples also carry ``position_ids`` and (with
    ``create_attention_mask``) ``attention_mask``, equal to megatron-core's for every combination of the reset and
    mask options, including the padded final validation sample."""
    prefix, tokenizer = ltor_prefix
    spec = BuildSpec(
        seq_length=16,
        sizes=(40, None, 7),
        data_path=prefix,
        split="60,30,10",
        add_extra_token_to_sequence=reset_position_ids != eod_mask_loss,  # each setting in half of the cases
        drop_last_partial_validation_sequence=False,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        create_ltor_fields_in_dataloader=True,
    )
    ours, theirs = build_both(spec, tokenizer, tmp_path)
    valid = ours[1]
    # a padded final sample is compared too: the samples need more tokens than the one-epoch split holds
    assert len(valid) * spec.seq_length + spec.add_extra_token_to_sequence > valid.tokens_per_epoch
    assert_builds_equal(ours, theirs, np.random.default_rng(0), ltor=True)
    sample = ours[0][0]
    assert ("attention_mask" in sample) == create_attention_mask
    assert "position_ids" in sample


# -- the batch-padding sample -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("add_extra_token", "pad_is_eod"),
    [
        (True, False),
        (False, False),
        (True, True),
        (False, True),
    ],
)
def test_padding_sample_matches_megatron(ltor_prefix, tmp_path, add_extra_token, pad_is_eod):
    """``dataset[None]`` is the batch-padding sample: sample 0 with an all-zero loss mask, equal to megatron-core's
    ``dataset[None]`` in every split."""
    prefix, tokenizer = ltor_prefix
    if pad_is_eod:
        tokenizer = ParityTokenizer(eod=tokenizer.eod, pad=tokenizer.eod)
    spec = BuildSpec(
        seq_length=8,
        sizes=(30, 5, None),
        data_path=prefix,
        split="70,20,10",
        add_extra_token_to_sequence=add_extra_token,
        drop_last_partial_validation_sequence=False,
        eod_mask_loss=True,
    )
    ours, theirs = build_both(spec, tokenizer, tmp_path)
    for name, mine, reference in zip(SPLITS, ours, theirs, strict=True):
        padding = mine[None]
        assert_sample_equal(padding, megatron_sample(reference, None), f"{name}[None]", ltor=False)
        assert not padding["loss_mask"].any()
        assert torch.equal(padding["tokens"], mine[0]["tokens"])
        padding_in_batch, first = mine.__getitems__([None, 0])
        assert_sample_equal(padding_in_batch, megatron_sample(reference, None), f"{name}.__getitems__[None]", False)
        assert_sample_equal(first, megatron_sample(reference, 0), f"{name}.__getitems__[0]", ltor=False)


# -- golden values, generated with megatron-core's implementation -------------------------------------------------

# Generated there with the upstream implementation: five sequences of lengths [5, 3, 7, 2, 4], token j of
# sequence i is 100 * (i + 1) + j, uint16, S = 4, seed 1234, split "1,0,0", train split.
GOLDEN_LENGTHS = [5, 3, 7, 2, 4]


def rows(table: str) -> list[list[int]]:
    """Sample-index rows written as in the reference, e.g. ``"[0,0],[1,0]"``."""
    return json.loads(f"[{table}]")


GOLDEN = {
    "N=7, x=1": dict(
        num_samples=7,
        extra=True,
        epochs=2,
        document_index=[4, 0, 1, 2, 3, 3, 2, 1, 0, 4],
        sample_index=rows("[0,0],[1,0],[1,4],[3,0],[3,4],[4,1],[6,1],[6,5],[7,2],[8,3],[9,2]"),
        shuffle_index=[2, 0, 4, 3, 1, 6, 9, 5, 7, 8],
        first_tokens=[104, 200, 201, 202],
        first_labels=[200, 201, 202, 300],
    ),
    "N=7, x=0": dict(
        num_samples=7,
        extra=False,
        epochs=2,
        document_index=[4, 0, 1, 2, 3, 3, 2, 1, 0, 4],
        sample_index=rows("[0,0],[0,4],[1,4],[2,3],[3,4],[4,1],[6,1],[6,5],[7,2],[8,3],[9,2]"),
        shuffle_index=[2, 0, 4, 3, 1, 6, 9, 5, 7, 8],
        first_labels=[200, 201, 202, 0],
    ),
    "N=12, x=1": dict(
        num_samples=12,
        extra=True,
        epochs=3,
        document_index=[2, 2, 4, 1, 0, 3, 4, 0, 1, 3, 0, 4, 3, 2, 1],
        sample_index=rows(
            "[0,0],[0,4],[1,1],[1,5],[2,2],[3,2],[4,3],[6,0],[7,0],[7,4],[9,0],[10,2],[11,1],[12,1],[13,3],[14,0]"
        ),
        shuffle_index=[3, 9, 2, 1, 7, 5, 4, 0, 8, 6, 14, 11, 13, 10, 12],
    ),
    "N=None, x=1": dict(
        num_samples=None,
        extra=True,
        epochs=1,
        document_index=[4, 0, 1, 2, 3],
        sample_index=rows("[0,0],[1,0],[1,4],[3,0],[3,4],[4,1]"),
        shuffle_index=[3, 2, 1, 0, 4],
    ),
}


def golden_prefix(directory: Path, lengths: list[int], name: str = "golden_text_document") -> str:
    """One sequence per document; token j of sequence i is ``100 * (i + 1) + j``."""
    documents = [[np.arange(n) + 100 * (i + 1)] for i, n in enumerate(lengths)]
    return write_prefix(directory / name, documents, np.uint16)


GOLDEN_TOKENIZER = ParityTokenizer(eod=0, pad=1)


@pytest.mark.parametrize("name", list(GOLDEN))
def test_golden_indices_of_the_reference(name, tmp_path):
    """The public entry point reproduces the golden document, sample and shuffle indices, lengths and first
    samples generated with megatron-core."""
    golden = GOLDEN[name]
    prefix = golden_prefix(tmp_path, GOLDEN_LENGTHS)
    config = {
        "seq_length": 4,
        "random_seed": 1234,
        "split": "1,0,0",
        "add_extra_token_to_sequence": golden["extra"],
        "data_cache_path": str(tmp_path / "cache"),
    }
    train, valid, test = build_indexed_text_dataset(
        prefix, config, [golden["num_samples"], None, None], GOLDEN_TOKENIZER
    )
    assert valid is None and test is None
    assert len(train.document_index) == golden["epochs"] * len(GOLDEN_LENGTHS)
    assert_array_equal(train.document_index, np.array(golden["document_index"], np.int32), "document_index")
    assert_array_equal(train.sample_index, np.array(golden["sample_index"], np.int32), "sample_index")
    assert_array_equal(train.shuffle_index, np.array(golden["shuffle_index"], np.uint32), "shuffle_index")
    assert len(train) == len(golden["shuffle_index"])
    first = train[0]
    if "first_tokens" in golden:
        assert first["tokens"].tolist() == golden["first_tokens"]
    if "first_labels" in golden:
        assert first["labels"].tolist() == golden["first_labels"]
    if not golden["extra"]:
        assert first["loss_mask"].tolist() == [1.0, 1.0, 1.0, 0.0]  # the last label is padding


# build_sample_idx(sizes=[5, 3, 7, 2], doc=[0, 1, 2, 3], S=4, E=1, T=17) generated with megatron-core. Through the
# public entry point the documents are shuffled; seed 5 shuffles four documents into the identity (checked below).
SAMPLE_INDEX_GOLDEN = {
    (True, True): [[0, 0], [0, 4], [2, 0], [2, 4], [3, 1]],
    (True, False): [[0, 0], [0, 4], [2, 0], [2, 4], [3, 1]],
    (False, True): [[0, 0], [0, 4], [1, 3], [2, 4], [3, 1]],
    (False, False): [[0, 0], [0, 4], [1, 3], [2, 4], [3, 1], [3, 2]],
}


@pytest.mark.parametrize(("extra", "drop_last"), list(SAMPLE_INDEX_GOLDEN))
def test_golden_sample_index_of_the_reference(extra, drop_last, tmp_path):
    """The validation split's sample index reproduces the reference's ``build_sample_idx`` golden values for both
    extra-token settings and both validation drop settings, including the final partial sample padded with pad
    ids (loss mask 0) when it is kept."""
    prefix = golden_prefix(tmp_path, [5, 3, 7, 2])
    config = {
        "seq_length": 4,
        "random_seed": 5,
        "valid_data_path": prefix,
        "add_extra_token_to_sequence": extra,
        "drop_last_partial_validation_sequence": drop_last,
        "data_cache_path": str(tmp_path / "cache"),
    }
    _, valid, _ = build_indexed_text_dataset(None, config, [None, None, None], GOLDEN_TOKENIZER)
    assert_array_equal(valid.document_index, np.arange(4, dtype=np.int32), "document_index")
    assert_array_equal(valid.sample_index, np.array(SAMPLE_INDEX_GOLDEN[(extra, drop_last)], np.int32), "sample_index")
    if not extra and not drop_last:
        last = next(valid[i] for i in range(len(valid)) if int(valid.shuffle_index[i]) == len(valid) - 1)
        assert last["tokens"].tolist() == [401, 0, 0, 0]
        assert last["loss_mask"].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_golden_blending_indices_of_the_reference(tmp_path):
    """Weighted blending reproduces the reference's golden values: weights [.5, .25, .25] and 8 samples give dataset
    index [0,1,2,0,0,1,2,0] and sample index [0,0,0,1,2,1,1,3]; weights [.3, .7] give sources of 16 and 36 samples
    and a blend of 50 for N = 50, and a blend of 6 for N = 5."""
    prefixes = [golden_prefix(tmp_path, [50] * 20, f"blend{k}_text_document") for k in range(3)]
    config = {"seq_length": 4, "split": "1,0,0", "data_cache_path": str(tmp_path / "cache")}
    data_path = ["0.5", prefixes[0], "0.25", prefixes[1], "0.25", prefixes[2]]
    train, _, _ = build_indexed_text_dataset(data_path, config, [8, 0, 0], GOLDEN_TOKENIZER)
    assert_array_equal(train.dataset_index, np.array([0, 1, 2, 0, 0, 1, 2, 0], np.int16), "dataset_index")
    assert_array_equal(train.dataset_sample_index, np.array([0, 0, 0, 1, 2, 1, 1, 3]), "dataset_sample_index")
    for size, children, length in ((50, [16, 36], 50), (5, None, 6)):
        train, _, _ = build_indexed_text_dataset(
            ["0.3", prefixes[0], "0.7", prefixes[1]], config, [size, 0, 0], GOLDEN_TOKENIZER
        )
        assert len(train) == length
        if children is not None:
            assert [d.num_samples for d in train.datasets] == children


def test_golden_exhaustive_blending_of_the_reference(tmp_path):
    """An unweighted blend of sources of 1, 2 and 3 samples with no size uses every sample once, in the reference's
    golden order: dataset index [2,1,0,2,1,2], sample index [0,0,0,1,1,2]."""
    # S = 4 with the extra token: 5, 9 and 13 tokens make 1, 2 and 3 samples
    prefixes = [golden_prefix(tmp_path, [n], f"exhaustive{n}_text_document") for n in (5, 9, 13)]
    config = {"seq_length": 4, "split": "1,0,0", "data_cache_path": str(tmp_path / "cache")}
    train, _, _ = build_indexed_text_dataset(prefixes, config, [None, None, None], GOLDEN_TOKENIZER)
    assert [len(d) for d in train.datasets] == [1, 2, 3]
    assert_array_equal(train.dataset_index, np.array([2, 1, 0, 2, 1, 2], np.int16), "dataset_index")
    assert_array_equal(train.dataset_sample_index, np.array([0, 0, 0, 1, 1, 2]), "dataset_sample_index")


# -- known megatron-core divergences ------------------------------------------------------------------------------


def test_changing_add_extra_token_rebuilds_instead_of_reusing_a_stale_cache(ltor_prefix, tmp_path):
    """megatron-core's cache key omits ``add_extra_token_to_sequence``, so a rebuild with only that setting changed
    reuses the stale indices of the first build. Ours keys the cache on it: the second build differs from
    megatron-core's stale result and equals a fresh build (ours and megatron-core's) with the new setting."""
    prefix, tokenizer = ltor_prefix
    with_extra = BuildSpec(seq_length=8, sizes=(50, 5, 5), data_path=prefix, split="80,10,10")
    without_extra = replace(with_extra, add_extra_token_to_sequence=False)

    megatron_first = build_megatron(with_extra, tokenizer, tmp_path / "megatron_shared")[0]
    megatron_stale = build_megatron(without_extra, tokenizer, tmp_path / "megatron_shared")[0]
    megatron_fresh = build_megatron(without_extra, tokenizer, tmp_path / "megatron_fresh")[0]
    # the megatron-core behaviour documented by this test: the second build kept the first one's sample index
    assert np.array_equal(megatron_stale.sample_index, megatron_first.sample_index)
    assert not np.array_equal(megatron_fresh.sample_index, megatron_first.sample_index)

    build_ours(with_extra, tokenizer, tmp_path / "ours_shared")
    ours_second = build_ours(without_extra, tokenizer, tmp_path / "ours_shared")[0]
    ours_fresh = build_ours(without_extra, tokenizer, tmp_path / "ours_fresh")[0]
    assert not np.array_equal(ours_second.sample_index, megatron_stale.sample_index)
    assert_gpt_indices_equal(ours_second, megatron_fresh, "train")
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert_array_equal(getattr(ours_second, name), getattr(ours_fresh, name), name)
    for idx in range(len(ours_second)):
        assert_sample_equal(ours_second[idx], megatron_sample(megatron_fresh, idx), f"train[{idx}]", ltor=False)


@pytest.mark.parametrize(
    ("lengths", "split", "sizes", "empty_split"),
    [
        ([6] * 10, "969,30,1", [20, 5, 5], "valid"),  # the valid range rounds to no sequences
        ([6] * 9 + [0], "90,10,0", [20, 5, 0], "valid"),  # one sequence, of zero tokens
        ([6] * 10, "98,1,1", [20, None, 3], "test"),
    ],
)
def test_a_split_without_tokens_is_an_error_not_a_hang(tmp_path, lengths, split, sizes, empty_split):
    """Samples requested from a split that holds no tokens make megatron-core loop forever (it is not run here);
    ours raises ``DataConfigError`` naming the split."""
    prefix = golden_prefix(tmp_path, lengths)
    config = {"seq_length": 4, "split": split, "data_cache_path": str(tmp_path / "cache")}
    with pytest.raises(DataConfigError, match=rf"\({empty_split} split"):
        build_indexed_text_dataset(prefix, config, sizes, GOLDEN_TOKENIZER)


def test_a_final_sample_ending_in_an_empty_sequence_is_refused_by_both(tmp_path):
    """A kept final partial validation sample that ends in an empty sequence, with the extra token, would get the
    offset -1 in the sample index: megatron-core refuses it (an assertion) and ours raises ``DataConfigError``."""
    # sequences of 7 and 0 tokens; seed 5 keeps their order, so the empty one is read last
    prefix = golden_prefix(tmp_path, [7, 0])
    spec = BuildSpec(
        seq_length=4,
        sizes=(None, None, None),
        per_split_paths=(None, prefix, None),
        random_seed=5,
        drop_last_partial_validation_sequence=False,
    )
    with pytest.raises(AssertionError) as refused:
        build_megatron(spec, GOLDEN_TOKENIZER, tmp_path / "cache_megatron")
    assert is_megatron_refusal(refused.value)
    with pytest.raises(DataConfigError, match="empty sequence"):
        build_ours(spec, GOLDEN_TOKENIZER, tmp_path / "cache_ours")


def test_samples_do_not_depend_on_the_reading_order(ltor_prefix, tmp_path):
    """Without the reset and EOD options megatron-core caches the LTR fields of the first sample it serves,
    including the zeros its pad labels put in the loss mask, so later samples inherit them and its samples depend
    on the reading order. Ours do not: a sample read after another equals megatron-core's sample read first."""
    prefix, tokenizer = ltor_prefix
    spec = BuildSpec(seq_length=8, sizes=(80, None, None), data_path=prefix, split="1,0,0")
    ours, theirs = build_both(spec, tokenizer, tmp_path)
    ours, theirs = ours[0], theirs[0]
    fresh = [megatron_sample(theirs, i) for i in range(len(theirs))]
    # a: a sample with pad labels; b: a sample whose loss mask is 1 where a's is 0
    a = next(i for i, sample in enumerate(fresh) if not sample["loss_mask"].all())
    masked = fresh[a]["loss_mask"] == 0
    b = next(i for i, sample in enumerate(fresh) if i != a and sample["loss_mask"][masked].all())

    forget_cached_masks(theirs)
    megatron_sample(theirs, a, fresh=False)
    after_a = megatron_sample(theirs, b, fresh=False)
    assert not torch.equal(after_a["loss_mask"], fresh[b]["loss_mask"])  # megatron-core's order dependence

    ours[a]
    assert_sample_equal(ours[b], fresh[b], f"train[{b}] after train[{a}]", ltor=False)
    assert_sample_equal(ours.__getitems__([a, b])[1], fresh[b], f"train.__getitems__[{a}, {b}]", ltor=False)


def test_batched_samples_with_the_pad_sentinel_and_no_extra_token(tmp_path):
    """Read in a batch (``__getitems__``) from uint16 data, with pad == eod (the -1 sentinel) and no extra token,
    each sample's last label, which has no target, is 0 with loss mask 0, as in megatron-core's sample."""
    prefix = golden_prefix(tmp_path, GOLDEN_LENGTHS)
    tokenizer = ParityTokenizer(eod=0, pad=0)
    spec = BuildSpec(
        seq_length=4, sizes=(None, None, None), data_path=prefix, split="1,0,0", add_extra_token_to_sequence=False
    )
    ours, theirs = build_both(spec, tokenizer, tmp_path)
    assert_sample_equal(ours[0].__getitems__([0])[0], megatron_sample(theirs[0], 0), "train.__getitems__[0]", False)
