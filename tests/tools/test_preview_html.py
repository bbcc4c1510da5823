"""``hp-data preview --html``: the page a headless Chromium renders, checked in its DOM and its screenshot."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.delivery_plan import DeliveryPlan
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.parallel.scheduling import PackingSchedulerConfig
from hyper_parallel.data.tools.cli import main as hp_data
from hyper_parallel.data.tools.preview_html import (
    PADDING,
    SUPERVISED,
    UNSUPERVISED,
    batch_view,
    render_page,
    schedule_view,
    visible_piece,
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed (apt-get install -y chromium)"
)
CONVERSATIONS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "human", "content": 'Who is <Elinor> & "Marianne"?'},
        {"role": "gpt", "content": "The elder Dashwood sister."},
    ],
    [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}],
]
PIPELINE = """
dataset:
  _target_: hyper_parallel.data.text.build_dataset.build_online_text_dataset
  data_path: {data}
  data_transform:
    _target_: hyper_parallel.data.text.build_data_transform.build_llm_data_transform
    data_type: {data_type}
    text_keys: {text_keys}
    max_seq_len: 128
  data_config:
    cache_dir: {cache}
dataloader:
  _target_: hyper_parallel.data.batching.FixedBatchDataLoader
  drop_last: false
collate_fn:
  _target_: hyper_parallel.data.batching.build_online_text_collate_fn
"""


class _Tokens(HTMLParser):
    """The page's token spans (attributes and text) and its rank bars, from Chromium's DOM after the script ran."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[dict] = []
        self.rank_bars: list[dict] = []
        self._open: dict | None = None

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        classes = set((attributes.get("class") or "").split())
        if tag == "span" and "tok" in classes and "data-id" in attributes:
            self._open = {**attributes, "classes": classes, "text": ""}
            self.tokens.append(self._open)
        elif "rank-bar" in classes:
            self.rank_bars.append(attributes)

    def handle_data(self, data):
        if self._open is not None:
            self._open["text"] += data

    def handle_endtag(self, tag):
        if tag == "span":
            self._open = None


def _dom(page: Path, tmp_path: Path, fragment: str = "") -> str:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    url = page.resolve().as_uri() + fragment
    return subprocess.run([*command, "--dump-dom", url], capture_output=True, text=True, check=True, timeout=120).stdout


def _render(page: Path, tmp_path: Path) -> tuple[_Tokens, Image.Image, str]:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = _dom(page, tmp_path)
    shot = tmp_path / "shot.png"
    subprocess.run(
        [*command, f"--screenshot={shot}", "--window-size=1200,900", page.resolve().as_uri()],
        capture_output=True,
        check=True,
        timeout=120,
    )
    parsed = _Tokens()
    parsed.feed(dom)
    return parsed, Image.open(shot).convert("RGB"), dom


def _assert_not_blank(image: Image.Image) -> None:
    assert image.size == (1200, 900)
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 10, "the screenshot is blank"


# -- a known packed batch -----------------------------------------------------------------------------------------

# Two sequences of 4 and 8 tokens, each ending in one padding token (id 0), as per-sequence CP padding leaves them.
# Loss on positions 1, 2 and 5 to 9.
IDS = [5, 6, 7, 0, 8, 9, 10, 11, 12, 13, 14, 0]
LABELS = [IGNORE_INDEX, 7, 1, IGNORE_INDEX, IGNORE_INDEX, 10, 11, 12, 13, 14, IGNORE_INDEX, IGNORE_INDEX]
# Which CP rank of 2 holds each column, worked by hand from each layout's rule (batch_parallel.cp_local_columns).
OWNERS = {
    "contiguous": [0] * 6 + [1] * 6,  # halves of the row
    "zigzag": [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0],  # chunks of 3: rank 0 the first and last
    "zigzag_thd": [0, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0],  # per sequence: chunks of 1, then of 2
}


def _known_batch() -> Batch:
    return Batch(
        input_ids=torch.tensor([IDS]),
        labels=torch.tensor([LABELS]),
        cu_seq_lens=torch.tensor([0, 4, 12], dtype=torch.int32),
        cu_seq_lens_real=torch.tensor([0, 3, 10], dtype=torch.int32),
        extras={"dataset_id": torch.tensor([1])},
    )


def test_a_known_batch_classes_each_position_and_finds_every_layout_s_cp_ranks():
    view = batch_view(_known_batch(), pad_token_id=0, cp_plan=DeliveryPlan(cp_size=2))
    expected = (
        [UNSUPERVISED, SUPERVISED, SUPERVISED, PADDING, UNSUPERVISED] + [SUPERVISED] * 5 + [UNSUPERVISED, PADDING]
    )
    assert view.kinds[0].tolist() == expected
    assert np.flatnonzero(view.starts[0]).tolist() == [0, 4]
    assert {layout: owner[0].tolist() for layout, owner in view.owners.items()} == OWNERS
    summary = view.summary()
    assert (summary["tokens"], summary["real_tokens"], summary["trained_tokens"]) == (12, 10, 7)
    assert summary["packing_efficiency"] == 10 / 12 and summary["supervised_fraction"] == 7 / 12
    assert summary["sources"] == {"dataset 1": {"tokens": 1.0, "trained": 1.0}}


def _uncut_batch() -> Batch:
    """10 columns, sequences of 3 and 7: contiguous halves cut it, the zigzag layouts (chunks of 2 * cp) cannot."""
    return Batch(
        input_ids=torch.arange(10).reshape(1, 10),
        labels=torch.arange(10).reshape(1, 10),
        cu_seq_lens=torch.tensor([0, 3, 10], dtype=torch.int32),
    )


def test_a_layout_that_cannot_cut_the_batch_says_why():
    owners = batch_view(_uncut_batch(), cp_plan=DeliveryPlan(cp_size=2)).owners
    assert owners["contiguous"][0].tolist() == [0] * 5 + [1] * 5
    assert "zigzag" in owners["zigzag"] and "zigzag_thd" in owners["zigzag_thd"]
    assert isinstance(owners["zigzag"], str) and isinstance(owners["zigzag_thd"], str)


@needs_chromium
def test_the_page_says_why_the_layout_shown_cannot_cut_a_batch(tmp_path):
    page = tmp_path / "page.html"
    view = batch_view(_uncut_batch(), cp_plan=DeliveryPlan(cp_size=2))
    page.write_text(render_page([view], piece=str, title="uncut"))
    notes = re.findall(r'<p class="cp-note( shown)?" data-layout="(\w+)">', _dom(page, tmp_path, "#zigzag_thd"))
    assert notes == [("", "zigzag"), (" shown", "zigzag_thd")]


def test_the_schedule_view_gives_each_rank_its_groups_and_cost():
    """The scheduling package's own example: DP rank 0 gets sequences [0, 1] then [4], DP rank 1 [2] then [3]; the
    costs are ``24576 * L + L**2`` summed per group."""
    config = PackingSchedulerConfig(max_seqlen_per_dp_cp_rank=10)
    lengths = np.array([6, 3, 5, 4, 2])
    view = schedule_view(
        config, lengths, layout=config.layout(cp_size=1, tp_size=1), dp_size=2, sequence_names=list("abcde")
    )
    assert [(bar.micro_batch, bar.position, bar.sequences) for bar in view.bars] == [
        (0, 0, (0, 1)),
        (0, 1, (2,)),
        (1, 0, (4,)),
        (1, 1, (3,)),
    ]
    assert [bar.local_tokens for bar in view.bars] == [9, 5, 2, 4]
    rank0 = 24576 * 9 + 36 + 9 + 24576 * 2 + 4
    rank1 = 24576 * 9 + 25 + 16
    assert view.rank_costs == (rank0, rank1)
    assert view.flops.max_rank_cost == rank0 and view.flops.mean_rank_cost == (rank0 + rank1) / 2


@needs_chromium
def test_the_page_of_a_known_batch_in_a_browser(tmp_path):
    """Every position is one span with its classes and data, the text of each token escaped (a piece holding
    ``<b>``, ``&`` and ``"`` is text, not markup), the CP ranks of the layout shown first outlined."""
    view = batch_view(_known_batch(), pad_token_id=0, cp_plan=DeliveryPlan(cp_size=2))

    def piece(token: int) -> str:
        return '<b>&"' if token == 9 else visible_piece(f"t{token} ")

    page = tmp_path / "page.html"
    page.write_text(render_page([view], piece=piece, title="known <batch>", cp_layout="zigzag_thd"))
    assert "<b>&" not in page.read_text() and "<script src" not in page.read_text()
    parsed, image, dom = _render(page, tmp_path)
    tokens = parsed.tokens
    assert "<td>dataset 1</td><td>100.0%</td>" in dom  # the source's share of the real tokens
    assert [int(t["data-id"]) for t in tokens] == IDS and [int(t["data-pos"]) for t in tokens] == list(range(12))
    assert [int(t["data-label"]) for t in tokens] == LABELS
    kinds = [({"sup", "unsup", "pad"} & t["classes"]).pop() for t in tokens]
    assert kinds == ["unsup", "sup", "sup", "pad", "unsup"] + ["sup"] * 5 + ["unsup", "pad"]
    assert [i for i, t in enumerate(tokens) if "boundary" in t["classes"]] == [0, 4]
    assert tokens[5]["text"] == '<b>&"' and tokens[0]["text"] == "t5\u00b7"
    assert {t["data-source"] for t in tokens} == {"dataset 1"}
    for layout, owners in OWNERS.items():
        assert [int(t[f"data-cp-{layout}"]) for t in tokens] == owners
    assert [int(next(c for c in t["classes"] if c in {"cp0", "cp1"})[2]) for t in tokens] == OWNERS["zigzag_thd"]
    assert [i for i, t in enumerate(tokens) if "cp-start" in t["classes"]] == [0, 1, 3, 6, 10]
    _assert_not_blank(image)

    switched = _Tokens()  # the script outlines the layout the address names
    switched.feed(_dom(page, tmp_path, "#zigzag"))
    assert [int(next(c for c in t["classes"] if c in {"cp0", "cp1"})[2]) for t in switched.tokens] == OWNERS["zigzag"]
    assert [i for i, t in enumerate(switched.tokens) if "cp-start" in t["classes"]] == [0, 3, 9]


# -- the command on real pipelines ----------------------------------------------------------------------------------


@pytest.fixture
def conversations(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"conversation": c}) + "\n" for c in CONVERSATIONS))
    config = tmp_path / "pipeline.yaml"
    pipeline = PIPELINE.format(data=data, data_type="conversation", text_keys="conversation", cache=tmp_path / "c")
    config.write_text(pipeline + "get_batch:\n  _target_: hyper_parallel.data.batching.ParallelBatch\n"
                      "  cp_layout: zigzag_thd\n")  # fmt: skip
    return config


@needs_chromium
def test_a_conversation_shows_its_supervised_answer_and_cp_slices(conversations, tokenizer, tokenizer_path, tmp_path):
    """The bundled tokenizer's ChatML template: the loss is taken from the newline that closes the assistant's
    header to its ``<|im_end|>``, so those positions' labels are the answer, its ``<|im_end|>`` and newline."""
    page = tmp_path / "preview.html"
    command = ["preview", str(conversations), "--tokenizer", str(tokenizer_path), "--micro-batch-size", "2"]
    assert hp_data([*command, "--cp-size", "2", "--html", str(page)]) == 0
    parsed, image, _ = _render(page, tmp_path)
    tokens = parsed.tokens
    starts = [i for i, t in enumerate(tokens) if "boundary" in t["classes"]]
    assert len(starts) == 2 and starts[0] == 0  # the two conversations, each padded to a multiple of 2 * cp
    answers = []
    for begin, end in zip(starts, [*starts[1:], len(tokens)], strict=True):
        supervised = [t for t in tokens[begin:end] if "sup" in t["classes"]]
        answers.append(tokenizer.decode([int(t["data-label"]) for t in supervised]))
        if supervised:
            assert "".join(t["text"] for t in supervised).startswith("\u21b5")  # the header's newline
    assert answers == ["The elder Dashwood sister.<|im_end|>\n", "Paris.<|im_end|>\n"]
    question = "".join(t["text"] for t in tokens[: starts[1]] if "unsup" in t["classes"])
    assert 'Who\u00b7is\u00b7<Elinor>\u00b7&\u00b7"Marianne"?' in question
    assert "pad" in tokens[-1]["classes"] and "pad" not in tokens[starts[1] - 1 - 3]["classes"]
    # zigzag_thd over 2 ranks: each sequence (padded to a multiple of 4) in 4 chunks, rank 0 the first and last
    for begin, end in zip(starts, [*starts[1:], len(tokens)], strict=True):
        quarter = (end - begin) // 4
        owners = [int(t["data-cp-zigzag_thd"]) for t in tokens[begin:end]]
        assert owners == [0] * quarter + [1] * (2 * quarter) + [0] * quarter
    _assert_not_blank(image)


@needs_chromium
def test_a_packing_scheduler_draws_one_bar_per_rank_per_micro_batch(tokenizer_path, tmp_path):
    data = tmp_path / "text.jsonl"
    texts = [
        f"Passage {index}: " + "Emma Woodhouse, handsome, clever and rich. " * (1 + index % 4) for index in range(8)
    ]
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    config = tmp_path / "pipeline.yaml"
    scheduler = (
        "packing_scheduler:\n  _target_: hyper_parallel.data.parallel.data_schedule_utils.PackingSchedulerConfig\n"
        "  max_seqlen_per_dp_cp_rank: 64\n"
    )
    config.write_text(
        PIPELINE.format(data=data, data_type="plaintext", text_keys="text", cache=tmp_path / "c") + scheduler
    )
    page = tmp_path / "schedule.html"
    command = ["preview", str(config), "--tokenizer", str(tokenizer_path), "--html", str(page), "--batches", "2"]
    assert hp_data([*command, "--cp-size", "2", "--dp-size", "2", "--micro-batch-size", "2"]) == 0
    parsed, image, _ = _render(page, tmp_path)
    bars = [(int(b["data-micro-batch"]), int(b["data-rank"])) for b in parsed.rank_bars]
    micro_batches = max(m for m, _ in bars) + 1
    assert sorted(bars) == [(m, rank) for m in range(micro_batches) for rank in range(4)]
    assert all(int(b["data-cp-size"]) == 2 for b in parsed.rank_bars)  # dp_balanced: the static CP group
    assert all(float(b["data-cost"]) > 0 for b in parsed.rank_bars)
    _assert_not_blank(image)


def test_bad_html_arguments_are_refused(conversations, tokenizer_path, tmp_path, capsys):
    command = ["preview", str(conversations), "--tokenizer", str(tokenizer_path)]
    with pytest.raises(SystemExit):
        hp_data([*command, "--cp-size", "0", "--html", str(tmp_path / "p.html")])
    assert "'0' is not a whole number of ranks >= 1" in capsys.readouterr().err
    assert hp_data([*command, "--html", str(tmp_path / "missing" / "p.html")]) == 2
    assert f"cannot write {tmp_path / 'missing' / 'p.html'}" in capsys.readouterr().err


def test_the_page_is_never_written_through_a_link(conversations, tokenizer_path, tmp_path, capsys):
    target = tmp_path / "elsewhere.html"
    target.write_text("kept")
    (tmp_path / "p.html").symlink_to(target)
    command = ["preview", str(conversations), "--tokenizer", str(tokenizer_path), "--html", str(tmp_path / "p.html")]
    assert hp_data(command) == 2
    assert "link" in capsys.readouterr().err
    assert target.read_text() == "kept"
