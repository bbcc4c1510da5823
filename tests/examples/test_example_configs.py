"""Specification of the pipeline configs under ``examples/``: the design's three (Online mapping + dynamic batch,
Indexed variable-length documents, Indexed records packed offline) as written there, paths aside, plus a weighted
blend, a conversation (SFT) and an instruction (SFT) config, conversations prepared offline (Indexed SFT) and
instruction records packed offline with their loss mask (packed Indexed SFT).
Each is built by ``build_dataloaders`` from the data ``hp-data quickstart`` prepares (``prepare_example_data``, in
a temporary working directory) and delivers batches through its ``get_batch`` node, on one rank and cut over two
CP ranks; the Online ones also with ``dataset_type`` and the loader target switched both ways, over a whole epoch.
"""

from __future__ import annotations

import json
import shlex
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from batching.test_pipeline_get_batch import (
    INDEXED_DOCUMENTS,
    ONLINE_MAPPING_DYNAMIC,
    Recording,
    check_slices_make_the_batches,
)

from hyper_parallel.data.batching import DynamicBatchDataLoader, FixedBatchDataLoader, ParallelBatch
from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.instantiate import load_config, load_config_text
from hyper_parallel.data.parallel.dataloader_parallel import DataLoaderParallelContext
from hyper_parallel.data.text.build_data_transform import InstructionTransform, TextConversationTransform
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.tools import offline_preparation
from hyper_parallel.data.tools.example_data import prepare_example_data

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIGS = sorted(path.name for path in EXAMPLES.glob("*.yaml"))
ONLINE = ("conversation_sft.yaml", "instruction_sft.yaml", "online_mapping_dynamic.yaml")
INDEXED = (
    "indexed_blend.yaml",
    "indexed_documents.yaml",
    "indexed_offline_records.yaml",
    "indexed_packed_sft.yaml",
    "indexed_sft.yaml",
)
MIXTURE = ("mixture.yaml", "mixture_stream.yaml")
# Section 11.3 of the design shows the dataset node only; the example takes the other nodes of section 11.2.
INDEXED_OFFLINE_RECORDS_DATASET = """
dataset:
  _target_: hyper_parallel.data.text.build_dataset.build_indexed_text_dataset
  data_path: {data_path}
  data_config:
    seq_length: 4096
    split: "98, 1, 1"
    mock_data: false
    is_dataset_from_mr: true
    simple_blend: "no"
    skip_data_check: false
"""
# The design's "98, 1, 1" split of the example data (about 0.9M tokens) leaves its valid and test splits about two
# samples of 4096 tokens, one micro-batch of one; the blend sets its splits' sizes (train_valid_test_num_samples).
MICRO_BATCH_SIZES = {"indexed_documents.yaml": 1, "indexed_offline_records.yaml": 1}
DYNAMIC = "hyper_parallel.data.batching.DynamicBatchDataLoader"
FIXED = "hyper_parallel.data.batching.FixedBatchDataLoader"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A working directory holding ``quickstart_output/`` as ``hp-data quickstart`` writes it."""
    root = tmp_path_factory.mktemp("examples")
    prepare_example_data(root / "quickstart_output")
    return root


@pytest.fixture
def in_workdir(workdir, monkeypatch) -> Path:
    """Run from ``workdir``, as the configs' relative paths expect (the repository root in the README)."""
    monkeypatch.chdir(workdir)
    return workdir


@pytest.fixture(scope="module")
def records(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "quickstart_output" / "train.jsonl").open(encoding="utf-8")]


@pytest.fixture(scope="module")
def passage_tokens(records, tokenizer) -> list[list[int]]:
    """Every passage's tokens, in train.jsonl order, without the EOD."""
    return [tokenizer.encode(record["text"]) for record in records]


@pytest.fixture(scope="module")
def conversations(workdir) -> list[dict]:
    path = workdir / "quickstart_output" / "conversations.jsonl"
    return [json.loads(line) for line in path.open(encoding="utf-8")]


@pytest.fixture(scope="module")
def instructions(workdir) -> list[dict]:
    path = workdir / "quickstart_output" / "instructions.jsonl"
    return [json.loads(line) for line in path.open(encoding="utf-8")]


def example(name: str, cache_dir: Path | None = None) -> dict:
    """The example config; an Online one with its Hugging Face cache in ``cache_dir`` (not the user's)."""
    config = load_config(EXAMPLES / name)
    if cache_dir is not None and name in ONLINE:
        config["dataset"]["data_config"]["cache_dir"] = str(cache_dir)
    if cache_dir is not None and name in MIXTURE:
        config["dataset"]["sources"][0]["dataset"]["data_config"]["cache_dir"] = str(cache_dir)
    return config


def switched(config: dict, dataset_type: str, loader: str) -> dict:
    """``config`` with its Online source type and loader target set; a loader's own settings go with it."""
    config["dataset"]["data_config"]["dataset_type"] = dataset_type
    if config["dataloader"]["_target_"] != loader:
        config["dataloader"] = {"_target_": loader}
    return config


def sequences(batch) -> list[list[int]]:
    """Every sequence of a batch as the document it was cut from: its inputs, then its last label."""
    return [ids.tolist() + [int(labels[-1])] for ids, labels in batch.sequences()]


# -- shipped as the design writes them ----------------------------------------------------------------------------


def test_every_example_config_is_covered_here():
    assert set(CONFIGS) == set(ONLINE) | set(INDEXED) | set(MIXTURE)


@pytest.mark.parametrize(
    ("name", "design", "data_path"),
    [
        ("online_mapping_dynamic.yaml", ONLINE_MAPPING_DYNAMIC, "quickstart_output/train.jsonl"),
        ("indexed_documents.yaml", INDEXED_DOCUMENTS, "quickstart_output/corpus_text_document"),
    ],
)
def test_the_designs_configs_are_shipped_as_written_there_paths_aside(name, design, data_path):
    assert example(name) == load_config_text(design.format(data_path=data_path))


def test_the_offline_records_config_is_the_designs_dataset_node_with_the_documents_configs_other_nodes():
    shipped = example("indexed_offline_records.yaml")
    design = load_config_text(INDEXED_OFFLINE_RECORDS_DATASET.format(data_path="quickstart_output/train_text_document"))
    assert shipped["dataset"] == design["dataset"]
    assert {key: value for key, value in shipped.items() if key != "dataset"} == {
        key: value for key, value in example("indexed_documents.yaml").items() if key != "dataset"
    }


def test_the_offline_records_pair_is_what_the_command_in_its_comment_writes(
    in_workdir, tmp_path, restore_package_logger
):
    comment = [line[1:].strip() for line in (EXAMPLES / "indexed_offline_records.yaml").read_text().splitlines()]
    start = next(i for i, line in enumerate(comment) if line.startswith(".venv/bin/python -m "))
    command = " ".join(line.rstrip("\\").strip() for line in comment[start : start + 3])
    argv = shlex.split(command)
    assert argv[:3] == [".venv/bin/python", "-m", offline_preparation.__name__]
    argv = argv[3:]
    argv[argv.index("--output-prefix") + 1] = str(tmp_path / "train")
    argv[argv.index("--tokenizer-name-or-path") + 1] = str(BUNDLED_TOKENIZER_PATH)  # the repository's, from here
    assert offline_preparation.main(argv + ["--workers", "1"]) in (0, None)
    for suffix in (".bin", ".idx"):
        written = (tmp_path / f"train_text_document{suffix}").read_bytes()
        assert written == (in_workdir / "quickstart_output" / f"train_text_document{suffix}").read_bytes()


def test_the_packed_sft_pairs_are_what_the_command_in_its_comment_writes(in_workdir, tmp_path, restore_package_logger):
    comment = [line[1:].strip() for line in (EXAMPLES / "indexed_packed_sft.yaml").read_text().splitlines()]
    argv = shlex.split(next(line for line in comment if line.startswith(".venv/bin/hp-data prepare ")))[2:]
    argv[argv.index("--output-prefix") + 1] = str(tmp_path / "instructions")
    argv[argv.index("--tokenizer-name-or-path") + 1] = str(BUNDLED_TOKENIZER_PATH)  # the repository's, from here
    assert offline_preparation.main(argv + ["--workers", "1"]) == 0
    for pair in ("instructions_text_document", "instructions_text_document_loss_mask"):
        for suffix in (".bin", ".idx"):
            written = (tmp_path / f"{pair}{suffix}").read_bytes()
            assert written == (in_workdir / "quickstart_output" / f"{pair}{suffix}").read_bytes()


# -- built and delivering batches ---------------------------------------------------------------------------------


def _deliver(config: dict, context: DataLoaderParallelContext, steps: int, **runtime) -> list[tuple]:
    loaders = build_dataloaders(config, tokenizer=BUNDLED_TOKENIZER_PATH, parallel_context=context, **runtime)
    assert isinstance(loaders.get_batch, ParallelBatch)
    recording = Recording(iter(loaders.train))
    delivered = []
    for _ in range(steps):
        model_inputs, loss_inputs = loaders.get_batch(recording)
        delivered.append((recording.last, model_inputs, loss_inputs))
    return delivered


@pytest.mark.parametrize("name", CONFIGS)
def test_each_example_delivers_the_readers_batches_whole_on_one_rank_and_cut_over_two_cp_ranks(
    name, in_workdir, tmp_path
):
    config = example(name, tmp_path / "hf")
    micro_batch_size = MICRO_BATCH_SIZES.get(name, 2)
    whole = _deliver(config, DataLoaderParallelContext(), 2, micro_batch_size=micro_batch_size)
    for batch, model_inputs, loss_inputs in whole:
        assert torch.equal(model_inputs["input_ids"], batch.input_ids)
        assert torch.equal(loss_inputs["labels"], batch.labels)
        assert torch.equal(loss_inputs["loss_mask"], (batch.labels != IGNORE_INDEX).float())
        assert batch.trained_tokens > 0
    per_rank = [
        _deliver(config, DataLoaderParallelContext(cp_rank=rank, cp_size=2), 2, micro_batch_size=micro_batch_size)
        for rank in (0, 1)
    ]
    check_slices_make_the_batches(per_rank)


def assert_row_is_cut_from(ids: list[int], labels: list[int], documents: list[list[int]], eod: int) -> None:
    """The row (its inputs, then its last label) is a stretch of one document, or, split at its EODs, the end of a
    document, whole documents, then the start of one: Indexed samples run on across document boundaries."""
    row = ids + [labels[-1]]
    if eod not in row:
        assert any(_holds(document, row) for document in documents)
        return
    pieces = [[]]
    for token in row:
        if token == eod:
            pieces.append([])
        else:
            pieces[-1].append(token)
    first, *inner, last = pieces
    whole = {tuple(document) for document in documents}
    assert all(tuple(piece) in whole for piece in inner)
    assert any(document[len(document) - len(first) :] == first for document in documents)
    assert any(document[: len(last)] == last for document in documents)


def _holds(document: list[int], stretch: list[int]) -> bool:
    starts = np.flatnonzero(np.asarray(document[: len(document) - len(stretch) + 1]) == stretch[0])
    return any(document[start : start + len(stretch)] == stretch for start in starts.tolist())


def _rows(batch) -> list[tuple[list[int], list[int]]]:
    return list(zip(batch.input_ids.tolist(), batch.labels.tolist(), strict=True))


@pytest.mark.parametrize("name", ["indexed_documents.yaml", "indexed_offline_records.yaml"])
def test_the_documents_and_records_configs_give_rows_of_the_passages_tokens(
    name, in_workdir, passage_tokens, tokenizer
):
    for batch, _, _ in _deliver(example(name), DataLoaderParallelContext(), 3, micro_batch_size=1):
        assert batch.input_ids.shape == (1, 4096)
        for ids, labels in _rows(batch):
            assert_row_is_cut_from(ids, labels, passage_tokens, tokenizer.eod)


def test_the_blend_config_draws_each_book_by_its_weight(in_workdir, records, passage_tokens, tokenizer):
    loaders = build_dataloaders(example("indexed_blend.yaml"), tokenizer=BUNDLED_TOKENIZER_PATH, micro_batch_size=4)
    batches = list(loaders.train)
    ids = torch.cat([batch.extras["dataset_id"] for batch in batches])
    assert len(ids) == 200 and abs(int((ids == 0).sum()) - 140) <= 1  # 70% Pride & Prejudice, 30% Emma
    books = [
        [tokens for tokens, record in zip(passage_tokens, records, strict=True) if record["book"] == book]
        for book in ("Pride & Prejudice", "Emma")
    ]
    for batch in batches[:4]:
        for (ids, labels), book in zip(_rows(batch), batch.extras["dataset_id"].tolist(), strict=True):
            assert_row_is_cut_from(ids, labels, books[book], tokenizer.eod)


def test_the_mixture_config_mixes_the_passages_and_emma_s_rows_by_weight_and_reads_each_once(
    in_workdir, tmp_path, passage_tokens, tokenizer
):
    loaders = build_dataloaders(example("mixture.yaml", tmp_path / "hf"), tokenizer=BUNDLED_TOKENIZER_PATH)
    mixture = loaders.datasets[0]
    names = [mixture.names[source] for source in mixture.sources_of(np.arange(200))]
    assert abs(names.count("passages") / 200 - 0.6) < 0.1  # 60 : 40 while both last
    tally = None
    for batch in loaders.train:
        for ids, _ in batch.sequences():
            # A window of a passage, or a piece of an Emma row: a stretch of one passage; an EOD input only ends it.
            inputs = ids.tolist()
            assert tokenizer.eod not in inputs[:-1] and _holds_piece(passage_tokens, inputs, tokenizer.eod)
        tally = loaders.train.state_dict()["mixture"]
    # on_exhausted: reweight reads every record of both sources once.
    assert tally["sources"]["passages"]["samples"] == len(passage_tokens)
    assert tally["sources"]["emma"]["samples"] == len(mixture.sources[1].dataset)
    assert tally["sources"]["emma"]["tokens"] == 1024 * len(mixture.sources[1].dataset)


def test_the_stream_mixture_config_mixes_the_stream_and_emma_s_rows_whatever_the_workers(in_workdir, tmp_path):
    read = []
    for workers in (0, 2):
        config = example("mixture_stream.yaml", tmp_path / "hf")
        loaders = build_dataloaders(config, tokenizer=BUNDLED_TOKENIZER_PATH, num_workers=workers)
        batches = [batch.input_ids.tolist() for batch, _ in zip(loaders.train, range(12), strict=False)]
        read.append((batches, loaders.train.state_dict()["mixture"]["sources"]))
    assert read[0] == read[1] and len(read[0][0]) == 12
    tally = read[0][1]
    assert tally["passages"]["samples"] > 0 and tally["emma"]["samples"] > 0


def _holds_piece(documents: list[list[int]], inputs: list[int], eod: int) -> bool:
    """The inputs are a stretch of one document, ended by its EOD or not."""
    stretch = inputs[:-1] if inputs[-1] == eod else inputs
    return not stretch or any(_holds(document, stretch) for document in documents)


def test_the_sft_config_trains_on_exactly_the_answers_of_each_conversation(in_workdir, tmp_path, conversations):
    expected = Counter(
        "".join(f"{m['content']}<|im_end|>\n" for m in conversation["messages"] if m["role"] == "assistant")
        for conversation in conversations
    )
    loaders = build_dataloaders(
        example("conversation_sft.yaml", tmp_path / "hf"), tokenizer=BUNDLED_TOKENIZER_PATH, micro_batch_size=2
    )
    seen = Counter()
    tokenizer = loaders.tokenizer
    for batch in loaders.train:
        assert batch.input_ids.shape[1] <= 4096  # the token budget
        for _, labels in batch.sequences():
            seen[tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())] += 1
    assert seen == expected  # every conversation once, its answers and end of turn, nothing else


def test_the_instruction_config_trains_on_exactly_the_output_of_each_record(in_workdir, tmp_path, instructions):
    expected = Counter(f"{record['output']}<|im_end|>\n" for record in instructions)
    config = example("instruction_sft.yaml", tmp_path / "hf")
    config["dataloader"]["drop_last"] = False  # an odd number of records: read the last one too
    loaders = build_dataloaders(config, tokenizer=BUNDLED_TOKENIZER_PATH, micro_batch_size=2)
    seen, prompts = Counter(), Counter()
    tokenizer = loaders.tokenizer
    for batch in loaders.train:
        assert batch.input_ids.shape[1] <= 4096  # the token budget
        for ids, labels in batch.sequences():
            seen[tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())] += 1
            prompts[tokenizer.decode(ids.tolist()).split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]] += 1
    assert seen == expected  # every record once, its answer and end of turn, nothing else
    # The user turn is the instruction, then a blank line and the input when the record has one.
    assert prompts == Counter(
        f"{r['instruction']}\n\n{r['input']}" if r["input"] else r["instruction"] for r in instructions
    )


def _runs(labels: list[int]) -> list[tuple[int, ...]]:
    """The runs of consecutive trained labels."""
    runs, current = [], []
    for label in [*labels, IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            runs.append(tuple(current))
            current = []
    return runs


def test_the_indexed_sft_config_trains_only_on_the_answers_the_online_transform_trains_on(
    in_workdir, conversations, tokenizer
):
    """Samples cut across conversations prepared offline: every run of trained labels lies within one answer run
    of the Online transform's samples, and the epoch trains on every supervised token of the train split but the
    dropped tail."""
    transform = TextConversationTransform(tokenizer, text_keys="messages")  # the bundled template, as prepared
    answers = [run for conversation in conversations for run in _runs(transform(conversation)[0]["labels"].tolist())]
    train_documents = round(0.95 * len(conversations))
    supervised = sum(int((transform(c)[0]["labels"] != IGNORE_INDEX).sum()) for c in conversations[:train_documents])
    loaders = build_dataloaders(example("indexed_sft.yaml"), tokenizer=BUNDLED_TOKENIZER_PATH, micro_batch_size=2)
    trained = 0
    for batch in loaders.train:
        for _, labels in _rows(batch):
            for run in _runs(labels):
                trained += len(run)
                assert any(_holds(list(answer), list(run)) for answer in answers), tokenizer.decode(list(run))
    assert supervised - 2 * 1024 <= trained <= supervised  # the last partial sample (and batch) are dropped


def test_the_packed_sft_config_trains_only_on_the_outputs_the_online_instruction_transform_trains_on(
    in_workdir, instructions, tokenizer
):
    """Records of 1025 tokens packed across instruction records: every run of trained labels lies within one answer
    run of the Online transform's samples, and the train split's records are read whole, each once, in order."""
    transform = InstructionTransform(tokenizer)  # the bundled template, as prepared
    answers = [run for record in instructions for run in _runs(transform(record)[0]["labels"].tolist())]
    loaders = build_dataloaders(
        example("indexed_packed_sft.yaml"), tokenizer=BUNDLED_TOKENIZER_PATH, micro_batch_size=2
    )
    records = IndexedDataReader(in_workdir / "quickstart_output" / "instructions_text_document")
    rows, trained = [], 0
    for batch in loaders.train:
        for ids, labels in _rows(batch):
            rows.append(ids)
            for run in _runs(labels):
                trained += len(run)
                assert any(_holds(list(answer), list(run)) for answer in answers), tokenizer.decode(list(run))
    assert rows == [records[r].tolist()[:-1] for r in range(len(rows))] and len(rows) >= 0.9 * len(records)
    assert trained > 0.5 * len(rows) * 1024  # the answers quote whole openings: most targets are trained


# -- dataset_type and the loader target switched both ways --------------------------------------------------------


@pytest.mark.parametrize("dataset_type", ["mapping", "iterable"])
@pytest.mark.parametrize("loader", [DYNAMIC, FIXED])
def test_the_online_plaintext_config_reads_every_passage_once_whatever_the_switches(
    dataset_type, loader, in_workdir, tmp_path, passage_tokens, tokenizer
):
    config = switched(example("online_mapping_dynamic.yaml", tmp_path / "hf"), dataset_type, loader)
    loaders = build_dataloaders(config, tokenizer=BUNDLED_TOKENIZER_PATH, micro_batch_size=2)
    assert isinstance(loaders.train, DynamicBatchDataLoader if loader == DYNAMIC else FixedBatchDataLoader)
    expected = Counter(tuple(tokens + [tokenizer.eod]) for tokens in passage_tokens)
    delivered = Counter()
    for batch in loaders.train:
        delivered.update(tuple(sequence) for sequence in sequences(batch))
        if loader == FIXED:
            assert batch.num_sequences == 2  # micro_batch_size records, one window each
    assert not delivered - expected  # only whole passages, each at most once
    # All of them: the token-budget loader drains its buffer; the fixed one drops only an incomplete last batch.
    assert sum((expected - delivered).values()) <= (1 if loader == FIXED else 0)


@pytest.mark.parametrize("dataset_type", ["mapping", "iterable"])
@pytest.mark.parametrize("loader", [DYNAMIC, FIXED])
def test_the_sft_config_reads_every_conversation_once_whatever_the_switches(
    dataset_type, loader, in_workdir, tmp_path, conversations
):
    config = switched(example("conversation_sft.yaml", tmp_path / "hf"), dataset_type, loader)
    loaders = build_dataloaders(config, tokenizer=BUNDLED_TOKENIZER_PATH, micro_batch_size=4)
    questions = Counter()
    for batch in loaders.train:
        for ids, _ in batch.sequences():
            text = loaders.tokenizer.decode(ids.tolist())
            questions[text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]] += 1
        if loader == FIXED:
            assert batch.num_sequences == 4
    expected = Counter(
        next(m["content"] for m in conversation["messages"] if m["role"] == "user") for conversation in conversations
    )
    assert not questions - expected and sum((expected - questions).values()) < (4 if loader == FIXED else 1)


@pytest.mark.parametrize("name", INDEXED)
def test_an_indexed_config_switched_to_the_token_budget_loader_is_refused_naming_the_fixed_one(name, in_workdir):
    config = example(name)
    config["dataloader"] = {"_target_": DYNAMIC}
    with pytest.raises(
        DataConfigError, match="DynamicBatchDataLoader reads Online datasets .* use FixedBatchDataLoader"
    ):
        build_dataloaders(config, tokenizer=BUNDLED_TOKENIZER_PATH)
