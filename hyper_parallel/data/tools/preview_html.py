"""The batches of ``hp-data preview --html``: one self-contained HTML page (inline CSS and JS, nothing fetched).

Owns: what the page shows of a ``Batch`` (each position's class: loss taken or not, padding, and the first
token of every sequence; each CP rank's columns in every layout, as ``batching.delivery_plan.delivery_metadata``
computes them), of one scheduled step (a bar per rank per micro-batch, with its sequences, CP group size, padding and
cost, from ``parallel.scheduling``), and the page itself. Not responsible for: building the loaders or reading the
batches (``tools.preview_batches``), the CP or scheduling arithmetic (the library's own functions are called).

A position is *supervised* (class ``sup``) where a loss is taken (``loss_mask`` 1): there the model is trained to
predict its label, the next token, which hovering shows. So the answer ``Paris.<|im_end|>\n`` of a conversation is
the labels of the positions from the newline closing its ``<|im_start|>assistant`` header to its ``<|im_end|>``.
Padding is what a sequence holds past its real tokens (``cu_seq_lens_real``) and a last sequence of padding only
(the Online tail).
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hyper_parallel.data.batching.batch import Batch
from hyper_parallel.data.batching.delivery_plan import DeliveryPlan, delivery_metadata
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.parallel.delivery_layout import CP_LAYOUTS, DeliveryLayout
from hyper_parallel.data.parallel.scheduling import (
    FlopsStats,
    PackingSchedulerConfig,
    build_schedule,
    schedule_stats,
    sequence_cost,
)

__all__ = [
    "BatchView",
    "ScheduleView",
    "batch_view",
    "render_page",
    "schedule_view",
    "visible_piece",
]

UNSUPERVISED, SUPERVISED, PADDING = 0, 1, 2
_KIND_CLASSES = ("unsup", "sup", "pad")
SOURCE_EXTRAS = ("dataset_id",)  # per-row extras naming a sample's source (a blend's index)
_VISIBLE_WHITESPACE = str.maketrans({" ": "\u00b7", "\n": "\u21b5", "\t": "\u2192", "\r": "\u240d"})


def visible_piece(text: str) -> str:
    """``text`` with its whitespace drawn: a space as a middle dot, a newline as a return arrow, a tab as an arrow."""
    return text.translate(_VISIBLE_WHITESPACE)


@dataclass(frozen=True)
class BatchView:
    """What the page shows of one micro-batch, every array ``[R, T]``.

    Attributes:
        input_ids, labels: the batch's.
        kinds: ``UNSUPERVISED``, ``SUPERVISED`` (loss taken) or ``PADDING`` per position.
        starts: the first position of each sequence.
        sources: each row's source name, or None when the samples carry none.
        owners: per layout of ``CP_LAYOUTS``, the CP rank holding each position, or why the layout cannot cut the
            batch; empty with one CP rank.
        sequences: the batch's sequence count.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    kinds: np.ndarray
    starts: np.ndarray
    sources: list[str] | None
    owners: dict[str, np.ndarray | str]
    sequences: int

    def summary(self) -> dict:
        """Tokens, real and trained tokens, their fractions, and with sources each source's shares."""
        tokens = self.kinds.size
        real = int((self.kinds != PADDING).sum())
        trained = int((self.kinds == SUPERVISED).sum())
        result = {
            "sequences": self.sequences,
            "tokens": tokens,
            "real_tokens": real,
            "trained_tokens": trained,
            "packing_efficiency": real / tokens,
            "supervised_fraction": trained / tokens,
        }
        if self.sources is not None:
            shares = {}
            for name in dict.fromkeys(self.sources):
                rows = np.array([source == name for source in self.sources])
                shares[name] = {
                    "tokens": int((self.kinds[rows] != PADDING).sum()) / max(real, 1),
                    "trained": int((self.kinds[rows] == SUPERVISED).sum()) / max(trained, 1),
                }
            result["sources"] = shares
        return result


def batch_view(
    batch: Batch,
    *,
    pad_token_id: int | None = None,
    cp_plan: DeliveryPlan | None = None,
) -> BatchView:
    """The page's view of ``batch``.

    Args:
        batch: a collated micro-batch.
        pad_token_id: the collator's padding id: a last sequence holding only it, without labels, is padding.
        cp_plan: the delivery plan whose ``cp_size`` ranks are outlined (every layout is tried); None or one CP
            rank outlines none.
    """
    ids, labels = batch.input_ids.numpy(), batch.labels.numpy()
    rows, width = ids.shape
    bounds = batch.cu_seq_lens.numpy().astype(np.int64)
    starts = np.zeros(rows * width, dtype=bool)
    starts[bounds[:-1]] = True
    padding = _padding(batch, bounds, pad_token_id)
    supervised = batch.loss_mask.numpy().reshape(-1) > 0
    kinds = np.where(padding, PADDING, np.where(supervised, SUPERVISED, UNSUPERVISED)).reshape(rows, width)
    return BatchView(
        input_ids=ids,
        labels=labels,
        kinds=kinds,
        starts=starts.reshape(rows, width),
        sources=_row_sources(batch),
        owners={} if cp_plan is None or cp_plan.cp_size == 1 else _cp_owners(batch, cp_plan),
        sequences=batch.num_sequences,
    )


def _padding(batch: Batch, bounds: np.ndarray, pad_token_id: int | None) -> np.ndarray:
    """Each sequence's positions past its real tokens, and a last sequence of padding only."""
    total, lengths = int(bounds[-1]), np.diff(bounds)
    padding = np.zeros(total, dtype=bool)
    if batch.cu_seq_lens_real is not None:
        real = np.diff(batch.cu_seq_lens_real.numpy().astype(np.int64))
        within = np.arange(total) - np.repeat(bounds[:-1], lengths)
        padding = within >= np.repeat(real, lengths)
    last = slice(int(bounds[-2]), total)
    if pad_token_id is not None and len(bounds) > 2:
        ids, labels = batch.input_ids.reshape(-1)[last].numpy(), batch.labels.reshape(-1)[last].numpy()
        if (ids == pad_token_id).all() and (labels == IGNORE_INDEX).all():
            padding[last] = True
    return padding


def _row_sources(batch: Batch) -> list[str] | None:
    """Each row's source (``dataset N`` for a blend's ``dataset_id``), or None when the samples carry none."""
    for name in SOURCE_EXTRAS:
        value = batch.extras.get(name)
        if value is not None:
            return [f"dataset {int(index)}" for index in value.reshape(value.shape[0], -1)[:, 0].tolist()]
    return None


def _cp_owners(batch: Batch, plan: DeliveryPlan) -> dict[str, np.ndarray | str]:
    """Per layout, the CP rank of every position from each rank's ``DeliveryMetadata.columns``."""
    rows, width = batch.input_ids.shape
    owners: dict[str, np.ndarray | str] = {}
    for layout in CP_LAYOUTS:
        owner = np.full((rows, width), -1, dtype=np.int64)
        try:
            for rank in range(plan.cp_size):
                rank_plan = replace(plan, cp_layout=layout, cp_rank=rank, attention_mode="none")
                metadata = delivery_metadata(rank_plan, batch.cu_seq_lens, batch.cu_seq_lens_real, rows, width)
                np.put_along_axis(owner, metadata.columns.numpy(), rank, axis=1)
        except (DataConfigError, DataFileError) as error:
            owners[layout] = str(error)
            continue
        owners[layout] = owner
    return owners


# -- one scheduled step ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankBar:
    """One rank's share of one micro-batch: its group's sequences and what it holds of them."""

    micro_batch: int
    position: int
    cp_size: int
    sequences: tuple[int, ...]
    real: tuple[float, ...]  # per sequence, the real tokens this rank holds (its CP share)
    padded: tuple[float, ...]  # per sequence, its padded tokens this rank holds
    local_tokens: int
    cost: float


@dataclass(frozen=True)
class ScheduleView:
    """One planned step: a bar per rank per micro-batch, each rank's cost over the step and the step's stats."""

    scheduler: str
    dp_size: int
    cp_size: int
    capacity: int
    bars: tuple[RankBar, ...]
    rank_costs: tuple[float, ...]
    stats: Mapping[str, str]  # the FlopsStats figures, formatted
    flops: FlopsStats
    sequence_names: tuple[str, ...]


def schedule_view(
    config: PackingSchedulerConfig,
    lengths: np.ndarray,
    *,
    layout: DeliveryLayout,
    dp_size: int,
    sequence_names: Sequence[str],
) -> ScheduleView:
    """Plan a step of ``lengths`` (DP-rank-major, as the scheduler gathers them) and lay out what each rank holds.

    With ``dynamic_cp`` the runtime CP sizes are the powers of two dividing ``dp_size * layout.cp_size``.
    """
    positions = dp_size * layout.cp_size
    dynamic = [size for size in (2**i for i in range(positions.bit_length())) if positions % size == 0]
    lengths = np.asarray(lengths, dtype=np.int64)
    schedule = build_schedule(
        config,
        lengths,
        layout=layout,
        dp_size=dp_size,
        dynamic_cp_sizes=dynamic if config.scheduler == "dynamic_cp" else (),
    )
    stats = schedule_stats(schedule, lengths, config, layout=layout)
    bars = []
    for index, groups in enumerate(schedule.micro_batches):
        for group in groups:
            real = lengths[list(group.sequence_ids)]
            padded = layout.padded_lengths(real, group.cp_size)
            local = layout.local_length(int(padded.sum()), group.cp_size)
            cost = float(sequence_cost(padded, config).sum()) / group.cp_size
            for position in range(group.first_position, group.first_position + group.cp_size):
                bars.append(
                    RankBar(
                        micro_batch=index,
                        position=position,
                        cp_size=group.cp_size,
                        sequences=group.sequence_ids,
                        real=tuple(real / group.cp_size),
                        padded=tuple(padded / group.cp_size),
                        local_tokens=local,
                        cost=cost,
                    )
                )
    rank_costs = [0.0] * positions
    for bar in bars:
        rank_costs[bar.position] += bar.cost
    figures = {
        "micro-batches": f"{stats.num_micro_batches}",
        "valid tokens": f"{stats.valid_tokens:,}",
        "scheduled tokens": f"{stats.scheduled_tokens:,}",
        "packing efficiency": f"{stats.packing_efficiency:.1%}",
        "max rank cost": f"{stats.max_rank_cost:,.0f}",
        "mean rank cost": f"{stats.mean_rank_cost:,.0f}",
        "imbalance (max / mean)": f"{stats.imbalance:.3f}",
        "seqlen sum": f"{stats.seqlen_sum:,.0f}",
        "seqlen squared sum": f"{stats.seqlen_squared_sum:,.0f}",
    }
    return ScheduleView(
        scheduler=config.scheduler,
        dp_size=dp_size,
        cp_size=layout.cp_size,
        capacity=max(config.max_seqlen_per_dp_cp_rank, max(bar.local_tokens for bar in bars)),
        bars=tuple(bars),
        rank_costs=tuple(rank_costs),
        stats=figures,
        flops=stats,
        sequence_names=tuple(sequence_names),
    )


# -- the page --------------------------------------------------------------------------------------------------------


def _attribute(value: object) -> str:
    return html.escape(str(value), quote=True)


def _batch_section(number: int, view: BatchView, piece: Callable[[int], str], shown_layout: str) -> str:
    summary = view.summary()
    lines = [f'<section class="batch" data-batch="{number}"><h2>micro-batch {number}</h2>']
    lines.append(
        f'<p class="figures">{summary["sequences"]} sequences, {summary["tokens"]:,} tokens '
        f"({view.kinds.shape[0]} row(s) of {view.kinds.shape[1]:,}), {summary['real_tokens']:,} real, "
        f"{summary['trained_tokens']:,} with a loss; packing efficiency {summary['packing_efficiency']:.1%}, "
        f"supervised fraction {summary['supervised_fraction']:.1%}</p>"
    )
    for layout, owner in view.owners.items():
        if isinstance(owner, str):
            lines.append(f'<p class="cp-note" data-layout="{_attribute(layout)}">{layout}: {html.escape(owner)}</p>')
    cuts = {layout: owner for layout, owner in view.owners.items() if not isinstance(owner, str)}
    for row in range(view.kinds.shape[0]):
        source = None if view.sources is None else view.sources[row]
        lines.append(f'<div class="row" data-row="{row}">')
        spans = []
        for column in range(view.kinds.shape[1]):
            token, label = int(view.input_ids[row, column]), int(view.labels[row, column])
            classes = ["tok", _KIND_CLASSES[view.kinds[row, column]]]
            if view.starts[row, column]:
                classes.append("boundary")
            attributes = [f'data-id="{token}"', f'data-pos="{column}"', f'data-label="{label}"']
            if source is not None:
                attributes.append(f'data-source="{_attribute(source)}"')
            for layout, owner in cuts.items():
                rank = int(owner[row, column])
                attributes.append(f'data-cp-{layout}="{rank}"')
                if layout == shown_layout:
                    classes.append(f"cp{rank % 8}")
                    if column == 0 or owner[row, column - 1] != rank:
                        classes.append("cp-start")
            spans.append(f'<span class="{" ".join(classes)}" {" ".join(attributes)}>{html.escape(piece(token))}</span>')
        lines.append("".join(spans))
        lines.append("</div>")
    lines.append("</section>")
    return "\n".join(lines)


def _schedule_section(view: ScheduleView) -> str:
    positions = view.dp_size * view.cp_size
    lines = [
        '<section class="schedule"><h2>one scheduled step</h2>',
        f'<p class="figures">scheduler {html.escape(view.scheduler)}, DP {view.dp_size} x CP {view.cp_size} = '
        f"{positions} rank(s), at most {view.capacity:,} tokens per rank; bar length: the tokens a rank holds "
        "(dark: real, light: its sequences' CP padding, hatched: the row's tail padding)</p>",
        '<table class="stats">'
        + "".join(f"<tr><th>{html.escape(k)}</th><td>{v}</td></tr>" for k, v in view.stats.items())
        + "</table>",
    ]
    top = max(view.rank_costs) or 1.0
    for micro_batch in sorted({bar.micro_batch for bar in view.bars}):
        lines.append(f'<div class="micro-batch" data-micro-batch="{micro_batch}"><h3>micro-batch {micro_batch}</h3>')
        for bar in (b for b in view.bars if b.micro_batch == micro_batch):
            names = ", ".join(view.sequence_names[i] for i in bar.sequences) or "padding only"
            segments = []
            for sequence, real, padded in zip(bar.sequences, bar.real, bar.padded, strict=True):
                title = _attribute(f"{view.sequence_names[sequence]}: {real * bar.cp_size:,.0f} tokens")
                segments.append(
                    f'<div class="seg real" style="width:{100 * real / view.capacity:.3f}%" title="{title}"></div>'
                    f'<div class="seg cp-pad" style="width:{100 * (padded - real) / view.capacity:.3f}%"></div>'
                )
            tail = bar.local_tokens - sum(bar.padded)
            segments.append(f'<div class="seg tail" style="width:{100 * tail / view.capacity:.3f}%"></div>')
            label = (
                f"rank {bar.position} (DP {bar.position // view.cp_size}, CP {bar.position % view.cp_size}): "
                f"CP group of {bar.cp_size}, {bar.local_tokens:,} tokens, cost {bar.cost:,.0f}; {names}"
            )
            lines.append(
                f'<div class="rank-line"><span class="rank-label">{html.escape(label)}</span>'
                f'<div class="rank-bar" data-rank="{bar.position}" data-micro-batch="{micro_batch}" '
                f'data-cp-size="{bar.cp_size}" data-cost="{bar.cost:.6g}" title="{_attribute(label)}">'
                f"{''.join(segments)}</div></div>"
            )
        lines.append("</div>")
    lines.append('<h3>cost per rank over the step</h3><div class="costs">')
    for position, cost in enumerate(view.rank_costs):
        lines.append(
            f'<div class="rank-line"><span class="rank-label">rank {position}: {cost:,.0f}</span>'
            f'<div class="cost-track"><div class="cost-bar" data-rank="{position}" '
            f'style="width:{100 * cost / top:.3f}%"></div></div></div>'
        )
    lines.append("</div></section>")
    return "\n".join(lines)


def _summary_section(views: Sequence[BatchView]) -> str:
    summaries = [view.summary() for view in views]
    rows = [
        f"<tr><td>{number}</td><td>{summary['sequences']}</td><td>{summary['tokens']:,}</td>"
        f"<td>{summary['real_tokens']:,}</td><td>{summary['trained_tokens']:,}</td>"
        f"<td>{summary['packing_efficiency']:.1%}</td><td>{summary['supervised_fraction']:.1%}</td></tr>"
        for number, summary in enumerate(summaries)
    ]
    table = (
        '<table class="summary"><tr><th>micro-batch</th><th>sequences</th><th>tokens</th><th>real</th>'
        "<th>with a loss</th><th>packing efficiency</th><th>supervised fraction</th></tr>" + "".join(rows) + "</table>"
    )
    names = list(dict.fromkeys(name for summary in summaries for name in summary.get("sources", {})))
    if names:
        header = "".join(f"<th>{number}</th>" for number in range(len(summaries)))
        table += f'<table class="sources"><tr><th>share of real tokens, per micro-batch</th>{header}</tr>'
        for name in names:
            shares = (summary.get("sources", {}).get(name, {"tokens": 0.0})["tokens"] for summary in summaries)
            table += f"<tr><td>{html.escape(name)}</td>{''.join(f'<td>{share:.1%}</td>' for share in shares)}</tr>"
        table += "</table>"
    return f'<section class="overview"><h2>summary</h2>{table}</section>'


_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px; color: #222; background: #fff; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 24px; } h3 { font-size: 14px; margin: 8px 0 4px; }
table { border-collapse: collapse; margin: 6px 0; } td, th { border: 1px solid #ccc; padding: 2px 8px; }
.legend span { margin-right: 12px; }
.row { font: 12px/1.9 ui-monospace, monospace; margin: 6px 0; padding: 4px; border: 1px solid #ddd;
       word-break: break-all; }
.tok { padding: 1px 0; white-space: pre; }
.tok.sup { background: #9be59b; } .tok.unsup { background: #eeeeee; color: #555; }
.tok.pad { background: repeating-linear-gradient(45deg, #c8c8c8 0 3px, #f4f4f4 3px 6px); color: #888; }
.tok.boundary { border-left: 3px solid #d22; margin-left: 2px; }
.tok.cp-start { margin-left: 4px; }
.cp0 { box-shadow: inset 0 -3px 0 #1f77b4; } .cp1 { box-shadow: inset 0 -3px 0 #ff7f0e; }
.cp2 { box-shadow: inset 0 -3px 0 #9467bd; } .cp3 { box-shadow: inset 0 -3px 0 #8c564b; }
.cp4 { box-shadow: inset 0 -3px 0 #e377c2; } .cp5 { box-shadow: inset 0 -3px 0 #17becf; }
.cp6 { box-shadow: inset 0 -3px 0 #bcbd22; } .cp7 { box-shadow: inset 0 -3px 0 #7f7f7f; }
.cp-note { color: #a33; display: none; } .cp-note.shown { display: block; }
.rank-line { display: flex; align-items: center; margin: 2px 0; }
.rank-label { width: 46%; font-size: 12px; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.rank-bar { display: flex; width: 52%; height: 16px; border: 1px solid #888; background: #fafafa; }
.seg { height: 100%; } .seg.real { background: #3b7dd8; border-right: 1px solid #fff; }
.seg.cp-pad { background: #a9c6ee; }
.seg.tail { background: repeating-linear-gradient(45deg, #bbb 0 3px, #eee 3px 6px); }
.cost-track { width: 52%; } .cost-bar { height: 12px; background: #d8643b; }
#tip { position: fixed; display: none; background: #222; color: #fff; padding: 4px 8px; font: 12px monospace;
       border-radius: 4px; pointer-events: none; white-space: pre; z-index: 9; }
"""

_SCRIPT = """
const tip = document.getElementById('tip');
function piece(id) { const p = PIECES[id]; return p === undefined ? '' : p; }
document.addEventListener('mouseover', (event) => {
  const tok = event.target.closest('.tok');
  if (!tok) { tip.style.display = 'none'; return; }
  const d = tok.dataset, label = Number(d.label);
  let text = 'id ' + d.id + ' ' + JSON.stringify(piece(d.id)) + '\\nposition ' + d.pos +
      '\\nlabel ' + (label < 0 ? 'none (' + label + ')' : label + ' ' + JSON.stringify(piece(label)));
  if (d.source !== undefined) text += '\\nsource ' + d.source;
  for (const key of Object.keys(d)) if (key.startsWith('cp')) text += '\\n' + key + ' rank ' + d[key];
  tip.textContent = text;
  tip.style.display = 'block';
  tip.style.left = (event.clientX + 12) + 'px';
  tip.style.top = (event.clientY + 12) + 'px';
});
function showLayout(layout) {
  const key = 'cp' + layout[0].toUpperCase() + layout.slice(1);  // data-cp-zigzag_thd is dataset.cpZigzag_thd
  for (const row of document.querySelectorAll('.row')) {
    let previous = null;
    for (const tok of row.children) {
      for (const name of Array.from(tok.classList)) if (/^cp(\\d|-start)$/.test(name)) tok.classList.remove(name);
      const rank = tok.dataset[key];
      if (rank === undefined) continue;
      tok.classList.add('cp' + (Number(rank) % 8));
      if (rank !== previous) tok.classList.add('cp-start');
      previous = rank;
    }
  }
  for (const note of document.querySelectorAll('.cp-note')) {
    note.classList.toggle('shown', note.dataset.layout === layout);
  }
}
const chooser = document.getElementById('cp-layout');
if (chooser) {
  const asked = decodeURIComponent(location.hash.slice(1));  // page.html#zigzag opens on that layout
  if (Array.from(chooser.options).some((option) => option.value === asked)) chooser.value = asked;
  chooser.addEventListener('change', () => showLayout(chooser.value));
  showLayout(chooser.value);
}
"""


def render_page(
    views: Sequence[BatchView],
    *,
    piece: Callable[[int], str],
    title: str,
    cp_layout: str = "contiguous",
    schedule: ScheduleView | None = None,
) -> str:
    """The whole page: legend, summary, each micro-batch's rows of tokens, and the schedule when there is one.

    Args:
        views: the micro-batches.
        piece: a token id's text as shown (``visible_piece`` of its decoding); HTML-escaped here.
        title: the page's heading (the config's path).
        cp_layout: the layout outlined first (the ``get_batch`` node's); a selector shows the others.
        schedule: one scheduled step, or None.
    """
    ids = {int(i) for view in views for array in (view.input_ids, view.labels) for i in np.unique(array) if i >= 0}
    pieces = json.dumps({i: piece(i) for i in sorted(ids)}, ensure_ascii=False).replace("<", "\\u003c")
    layouts = [layout for layout in CP_LAYOUTS if any(layout in view.owners for view in views)]
    chooser = ""
    if layouts:
        cp_size = max(int(o.max()) + 1 for v in views for o in v.owners.values() if not isinstance(o, str))
        options = "".join(
            f'<option value="{layout}"{" selected" if layout == cp_layout else ""}>{layout}</option>'
            for layout in layouts
        )
        chooser = (
            f"<p>CP ranks ({cp_size}), underlined by colour, each rank's first column spaced off: "
            f'<select id="cp-layout">{options}</select></p>'
        )
    legend = (
        '<p class="legend"><span class="tok sup">loss taken (predicts its label)</span>'
        '<span class="tok unsup">no loss</span><span class="tok pad">padding</span>'
        '<span class="tok unsup boundary">first token of a sequence</span>'
        "(hover a token for its id, position, label and source; whitespace: \u00b7 space, \u21b5 newline, "
        "\u2192 tab)</p>"
    )
    body = [
        f"<h1>hp-data preview: {html.escape(title)}</h1>",
        legend,
        chooser,
        _summary_section(views),
        *(_batch_section(number, view, piece, cp_layout) for number, view in enumerate(views)),
    ]
    if schedule is not None:
        body.append(_schedule_section(schedule))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>hp-data preview: {html.escape(title)}</title><style>{_STYLE}</style></head><body>\n"
        + "\n".join(body)
        + f'\n<div id="tip"></div>\n<script>\nconst PIECES = {pieces};\n{_SCRIPT}</script>\n</body></html>\n'
    )
