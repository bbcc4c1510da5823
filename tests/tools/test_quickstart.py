"""Specification of ``hp-data quickstart``: every step on the bundled corpus, and the checks it relies on."""

from __future__ import annotations

import contextlib
import io
import json
import re

import datasets
import pytest
import torch

from hyper_parallel.data.batching import Batch
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.tools.cli import main
from hyper_parallel.data.tools.quickstart import (
    StageStats,
    closing_hints,
    cp_slices_rebuild_batch,
    deliver_on_mesh,
    stage_table,
    supervision_marks,
)

BATCHES = 4


class _Terminal(io.StringIO):
    """A captured stream that says it is a terminal, as a user's stderr is."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """One quickstart run (a DP1 x CP2 mesh, 4 batches a stage), its stdout and its terminal-like stderr."""
    output = tmp_path_factory.mktemp("quickstart")
    stdout, stderr = io.StringIO(), _Terminal()
    bars_before = datasets.is_progress_bar_enabled()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main(
            ["quickstart", "--output-dir", str(output), "--workers", "2", "--batches", str(BATCHES)]
            + ["--dp", "1", "--cp", "2"]
        )
    return {
        "status": status,
        "out": stdout.getvalue(),
        "err": stderr.getvalue(),
        "output": output,
        "bars_restored": datasets.is_progress_bar_enabled() == bars_before,
    }


def _step(out: str, number: int) -> str:
    """The text of step ``number`` (up to the next step, or to the end)."""
    return re.split(r"^\d/8 ", out, flags=re.MULTILINE)[number]


def test_runs_every_step_in_order_with_no_progress_bar_on_a_terminal(run):
    assert run["status"] == 0
    starts = [int(line[0]) for line in run["out"].splitlines() if re.match(r"^\d/8 ", line)]
    assert starts == list(range(1, 9))
    # Hugging Face "Generating train split" bars and the tokenizing bar would both go to this terminal.
    assert "Generating" not in run["err"] and "tokenizing" not in run["err"] and "it/s" not in run["err"]
    assert run["bars_restored"]


def test_prepares_and_verifies_the_example_data(run, tokenizer):
    prepared = _step(run["out"], 1)
    for name in (
        "train.jsonl",
        "conversations.jsonl",
        "instructions.jsonl",
        "corpus_text_document",
        "train_text_document",
    ):
        assert name in prepared
    assert "books/pride_and_prejudice_text_document" in prepared and "books/emma_text_document" in prepared
    assert "verify: OK" in _step(run["out"], 2)
    assert _step(run["out"], 3).split("characters):\n\n", 1)[1].startswith("The family of Dashwood")

    reader = IndexedDataReader(run["output"] / "corpus_text_document")
    passages = sum(1 for _ in (run["output"] / "train.jsonl").open(encoding="utf-8"))
    assert f"{passages} passages as JSON lines" in prepared
    assert reader.num_documents == passages > 269 and int(reader[0][-1]) == tokenizer.eod
    assert tokenizer.decode(reader[0]).startswith("The family of Dashwood had long been settled in Sussex.")


def test_cuts_indexed_samples_and_caches_their_indices(run):
    indexed = _step(run["out"], 4)
    train_line = next(line for line in indexed.splitlines() if line.startswith("  train: "))
    assert train_line.startswith("  train: GPTDataset of ") and int(
        train_line.split(" of ")[1].split()[0].replace(",", "")
    )
    assert list((run["output"] / "index_cache").glob("*-GPTDataset-train-description.txt"))


def test_blends_the_two_books_in_the_weights_proportions(run):
    blend = _step(run["out"], 5)
    assert "BlendedDataset" in blend
    # 1,000 samples at weights 70/30: the largest-deficit schedule draws exactly 700 and 300.
    assert re.search(r"Pride & Prejudice\s+weight 0\.70:\s+700 of 1,000 samples \(70\.0%\)", blend)
    assert re.search(r"Emma\s+weight 0\.30:\s+300 of 1,000 samples \(30\.0%\)", blend)
    read = [(int(taken), int(total)) for taken, total in re.findall(r"(\d+) of the first (\d+) read", blend)]
    (pride, total), (emma, total_again) = read
    assert total == total_again == BATCHES * 4 and pride + emma == total  # every sample read is counted once
    assert abs(pride - 0.7 * total) <= 1  # the schedule keeps each book within one sample of its share


def test_reads_online_and_resumes_exactly(run):
    online = _step(run["out"], 6)
    batch_lines = [line for line in online.splitlines() if line.startswith("  batch ")]
    assert len(batch_lines) == 3 and all("input_ids (1, " in line for line in batch_lines)
    assert "a new loader restored from it gives batch 3: identical" in online


def test_marks_exactly_the_answers_of_the_conversation_it_shows(run):
    header, shown = _step(run["out"], 7).split("\n", 1)
    assert "supervised (between [[ and ]])" in header
    conversations = [json.loads(line) for line in (run["output"] / "conversations.jsonl").open(encoding="utf-8")]
    question = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", shown).group(1)
    conversation = next(c for c in conversations if c["messages"][1]["content"] == question)
    answers = [m["content"] for m in conversation["messages"] if m["role"] == "assistant"]
    assert re.findall(r"\[\[(.*?)\]\]", shown, flags=re.DOTALL) == [f"{a}<|im_end|>\n" for a in answers]
    assert "\033[" not in shown  # stdout is not a terminal: brackets, no colour


def test_the_mesh_step_checks_every_cp_slice_against_the_readers_batch(run):
    mesh = _step(run["out"], 8)
    assert "DP1 x CP2 (2 processes)" in mesh
    assert "DP rank 0: the 2 CP slices, put back at their position_ids, equal the reader's batch" in mesh


def test_ends_with_the_stage_table_and_what_to_run_next(run):
    table = run["out"].split("what each stage delivered", 1)[1].split("\n\ndone in ", 1)[0]
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in table.splitlines()[3:])}
    names = ["Indexed GPTDataset", "Indexed blend 70/30", "Online dynamic packing", "DP1 x CP2 get_batch, per rank"]
    assert list(rows) == names
    full = BATCHES * 4 * 512  # 4 x 512 tokens a batch, every one with a loss
    for name in names[:2]:
        assert rows[name][:4] == [str(BATCHES), "4 x 512", f"{full:,} / {full:,}", "100.0%"]
    assert rows[names[2]][0] == str(BATCHES)
    assert rows[names[3]][0] == str(2 * BATCHES)  # two ranks, BATCHES each
    for cells in rows.values():
        valid, delivered = (int(n.replace(",", "")) for n in cells[2].split(" / "))
        assert cells[3] == f"{valid / delivered:.1%}" and int(cells[4].replace(",", "")) > 0
    after = run["out"].split("\nnext:\n", 1)[1]
    assert "hp-data preview examples/online_mapping_dynamic.yaml --tokenizer " in after
    assert "hp-data inspect " in after and "examples/train_tiny_gpt.py" in after
    # tests/test_docs_commands.py checks that every command of the hints runs as printed
    assert run["out"].endswith("\n" + closing_hints(run["output"] / "corpus_text_document") + "\n")


def test_deliver_on_mesh_dp2_cp2_gives_each_dp_rank_its_own_batches_cut_exactly(tmp_path):
    train = tmp_path / "train.jsonl"
    texts = [f"Chapter {n}. " + " ".join(f"word{n}-{i}" for i in range(40 + 7 * n)) for n in range(16)]
    train.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    delivery = deliver_on_mesh(train, dp=2, cp=2, steps=3, cache_dir=tmp_path / "cache")

    assert delivery.slices_match == (True, True) and delivery.dp_ranks_differ
    assert len(delivery.reader_shapes) == 2 * 3 and len(delivery.local_shapes) == 4 * 3
    # Each CP rank holds half of its reader's row; the two CP ranks of a DP rank hold the same shape.
    reader_widths = [shape[1] for shape in delivery.reader_shapes]
    local_widths = [shape[1] for shape in delivery.local_shapes]  # sorted by (dp, cp), then step
    assert local_widths == [w // 2 for w in reader_widths[:3]] * 2 + [w // 2 for w in reader_widths[3:]] * 2
    assert delivery.delivered_tokens == sum(reader_widths)
    # Padding (each sequence to a multiple of 2 * cp) carries no loss, so fewer tokens than delivered have one.
    assert 0 < delivery.valid_tokens <= delivery.delivered_tokens


def _batch(ids: list[int]) -> Batch:
    row = torch.tensor([ids])
    return Batch(input_ids=row, labels=row + 100, cu_seq_lens=torch.tensor([0, len(ids)], dtype=torch.int32))


def test_cp_slices_rebuild_batch_needs_every_column_once_with_its_tokens():
    batch = _batch([10, 11, 12, 13, 14, 15, 16, 17])
    # zigzag over 2 CP ranks: rank 0 holds columns 0, 1, 6, 7 and rank 1 columns 2..5.
    columns = [torch.tensor([[0, 1, 6, 7]]), torch.tensor([[2, 3, 4, 5]])]
    good = [(batch.input_ids.gather(1, c), batch.labels.gather(1, c), c) for c in columns]
    assert cp_slices_rebuild_batch(batch, good)

    swapped = [(good[0][0].flip(1), good[0][1], good[0][2]), good[1]]
    assert not cp_slices_rebuild_batch(batch, swapped)
    wrong_labels = [(good[0][0], good[0][1] + 1, good[0][2]), good[1]]
    assert not cp_slices_rebuild_batch(batch, wrong_labels)
    twice = torch.tensor([[0, 1, 6, 6]])  # column 7 never filled, column 6 twice
    assert not cp_slices_rebuild_batch(
        batch, [(batch.input_ids.gather(1, twice), batch.labels.gather(1, twice), twice), good[1]]
    )


def test_supervision_marks_colour_only_a_terminal_without_no_color(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert supervision_marks(io.StringIO()) == ("[[", "]]")
    colour = supervision_marks(_Terminal())
    assert colour[0].startswith("\033[") and colour[1] == "\033[0m"
    monkeypatch.setenv("NO_COLOR", "1")
    assert supervision_marks(_Terminal()) == ("[[", "]]")


def test_stage_table_reports_shapes_efficiency_and_throughput():
    stage = StageStats("packed", [(1, 2000), (1, 2048)], valid_tokens=3600, delivered_tokens=4048, seconds=2.0)
    lines = stage_table([stage]).splitlines()
    assert lines[0].split() == ["stage", "batches", "input_ids", "shape", "loss", "/", "delivered", "tokens"] + [
        "efficiency",
        "tokens/s",
    ]
    assert lines[2].split() == ["packed", "2", "1", "x", "2,000-2,048", "3,600", "/", "4,048", "88.9%", "2,024"]
