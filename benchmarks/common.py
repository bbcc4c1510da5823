"""Shared pieces of the benchmark groups: run context, timing, result rows, the table and environment facts.

Every group module exposes ``NAME`` (what ``--only`` selects), ``TITLE`` and ``run(context) -> list[Row]``.
Rows compare "ours" with a reference measured in the same process, on the same inputs, in the same run;
only the ratio between the two is meant to be read across machines.
"""

from __future__ import annotations

import gc
import importlib.metadata
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "BenchContext",
    "DEVICES",
    "Row",
    "Timing",
    "environment",
    "format_table",
    "log",
    "measure",
    "remove_prefix",
    "synchronize",
    "unavailable_device",
]

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class BenchContext:
    """What a group needs to know about the run.

    Attributes:
        quick: run the small, fast variant of every measurement.
        workdir: a private scratch folder; the runner deletes it afterwards.
        repeats: how many timed repetitions each measurement gets (the best one is reported).
        device: where the delivery rows build their masks and metadata (``"cpu"`` or ``"cuda"``); the other rows
            always run on the CPU.
    """

    quick: bool
    workdir: Path
    repeats: int
    device: str = "cpu"


def unavailable_device(device: str) -> str | None:
    """Why the delivery rows cannot run on ``device`` (the skip reason), or None when they can."""
    if device == "cuda" and not torch.cuda.is_available():
        return "--device cuda, but torch finds no CUDA device here (torch.cuda.is_available() is false)"
    return None


def synchronize(device: str) -> None:
    """Wait for the device's queued work, so that a timed call includes it (nothing to wait for on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def log(message: str) -> None:
    """Progress line on stderr, so stdout carries only the environment and the table."""
    print(f"  .. {message}", file=sys.stderr, flush=True)


# -- timing ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of the repetitions of one measurement."""

    samples: tuple[float, ...]

    @property
    def best(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def measure(
    cases: Mapping[str, Callable[[], Any]],
    repeats: int,
    before: Callable[[str], None] | None = None,
    after: Callable[[str, Any], None] | None = None,
) -> dict[str, Timing]:
    """Time every case ``repeats`` times, interleaving the cases so drift affects them alike.

    Round ``r`` runs each case once, in the given order. ``before(name)`` runs untimed before each call (e.g. to
    delete the previous output) and ``after(name, result)`` untimed after it (e.g. to check the output). A
    garbage collection precedes every timed call.
    """
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            if before is not None:
                before(name)
            gc.collect()
            start = time.perf_counter()
            result = case()
            samples[name].append(time.perf_counter() - start)
            if after is not None:
                after(name, result)
            del result
    return {name: Timing(tuple(values)) for name, values in samples.items()}


# -- files ----------------------------------------------------------------------------------------------------


def remove_prefix(prefix: str | os.PathLike) -> None:
    """Delete ``<prefix>.bin`` and ``<prefix>.idx`` if they exist."""
    for suffix in (".bin", ".idx"):
        Path(os.fspath(prefix) + suffix).unlink(missing_ok=True)


# -- results --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the table: ``ratio = ours / reference``.

    Attributes:
        name: what is measured, ours first.
        ours: our figure in ``unit``; None when skipped or failed.
        reference: the reference figure in ``unit``; None when it could not be measured.
        unit: unit of both figures.
        ratio: ``ours / reference``; None when either is missing.
        goal: the ratio to reach (at least, or at most when ``higher_is_better`` is false); None for information.
        note: what the reference is and how the figure was taken; also carries skip and failure reasons.
        higher_is_better: direction of the ratio.
        status: ``"ok"``, ``"skipped"`` or ``"failed"``.
    """

    name: str
    ours: float | None
    reference: float | None
    unit: str
    ratio: float | None
    goal: float | None
    note: str = ""
    higher_is_better: bool = True
    status: str = "ok"

    @classmethod
    def compare(
        cls,
        name: str,
        ours: float,
        reference: float,
        unit: str,
        goal: float | None = None,
        note: str = "",
        higher_is_better: bool = True,
    ) -> Row:
        """A measured row; the ratio is computed here."""
        ratio = ours / reference if reference else math.nan
        return cls(name, ours, reference, unit, ratio, goal, note, higher_is_better)

    @classmethod
    def skipped(cls, name: str, reason: str, unit: str = "", reference: float | None = None) -> Row:
        """A row that could not be measured for a known reason (e.g. a module not available yet)."""
        return cls(name, None, reference, unit, None, None, f"skipped: {reason}", status="skipped")

    @classmethod
    def failed(cls, name: str, reason: str) -> Row:
        """A row standing for a group that raised; the runner exits non-zero."""
        return cls(name, None, None, "", None, None, f"failed: {reason}", status="failed")

    @property
    def met(self) -> bool | None:
        """Whether the goal is reached; None when there is no goal or no ratio."""
        if self.goal is None or self.ratio is None or math.isnan(self.ratio):
            return None
        return self.ratio >= self.goal if self.higher_is_better else self.ratio <= self.goal

    @property
    def goal_text(self) -> str:
        direction = "higher is better" if self.higher_is_better else "lower is better"
        if self.goal is None:
            return f"- ({direction})" if self.status == "ok" else "-"
        return f"{'>=' if self.higher_is_better else '<='} {self.goal:.2f} ({direction})"

    @property
    def met_text(self) -> str:
        if self.status != "ok":
            return self.status
        return {True: "yes", False: "NO", None: "-"}[self.met]

    def to_json(self) -> dict[str, Any]:
        return {**{key: getattr(self, key) for key in self.__dataclass_fields__}, "met": self.met}


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


@dataclass
class _Table:
    header: tuple[str, ...]
    rows: list[tuple[str, ...]] = field(default_factory=list)
    right_aligned: frozenset[int] = frozenset()

    def render(self) -> list[str]:
        widths = [max(len(line[i]) for line in (self.header, *self.rows)) for i in range(len(self.header))]

        def line(cells: Sequence[str]) -> str:
            padded = [
                cell.rjust(width) if i in self.right_aligned else cell.ljust(width)
                for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
            ]
            return " | ".join(padded).rstrip()

        return [line(self.header), "-+-".join("-" * width for width in widths), *(line(row) for row in self.rows)]


def format_table(rows: Sequence[Row]) -> str:
    """The results table, then numbered notes for rows that have one."""
    table = _Table(
        header=("name", "ours", "reference", "unit", "ratio ours/ref", "goal", "met?"),
        right_aligned=frozenset({1, 2, 4}),
    )
    notes: list[str] = []  # identical notes share one number
    for row in rows:
        name = row.name
        if row.note:
            if row.note not in notes:
                notes.append(row.note)
            name = f"{name} [{notes.index(row.note) + 1}]"
        ratio = "-" if row.ratio is None else ("nan" if math.isnan(row.ratio) else f"{row.ratio:.2f}")
        table.rows.append(
            (name, _number(row.ours), _number(row.reference), row.unit, ratio, row.goal_text, row.met_text)
        )
    lines = table.render()
    if notes:
        lines.append("")
        lines.extend(f"[{i}] {note}" for i, note in enumerate(notes, start=1))
    return "\n".join(lines)


# -- environment ----------------------------------------------------------------------------------------------


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, str]:
    """Facts that figures depend on: cores, interpreter and library versions."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cores": f"{os.cpu_count()} (usable by this process: {usable})",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "megatron-core": _version("megatron-core"),
        "tokenizers": _version("tokenizers"),
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "(unset)"),
    }
