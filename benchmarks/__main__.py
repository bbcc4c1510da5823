"""Run the benchmark groups and print one table of same-run ratios.

Usage::

    python -m benchmarks                 # full run (a few minutes)
    python -m benchmarks --quick         # small inputs, about a minute
    python -m benchmarks --only offline  # one group
    python -m benchmarks --json results.json --workdir /mnt/scratch
    python -m benchmarks --only parallel --device cuda  # the delivery rows on the GPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import ModuleType

from benchmarks import (
    bench_indexed_dataset,
    bench_indexed_io,
    bench_memory,
    bench_mixture,
    bench_object_storage,
    bench_offline,
    bench_online,
    bench_parallel,
    bench_provenance,
    bench_schedule,
)
from benchmarks.common import DEVICES, BenchContext, Row, environment, format_table

GROUPS: dict[str, ModuleType] = {
    module.NAME: module
    for module in (
        bench_indexed_io,
        bench_indexed_dataset,
        bench_offline,
        bench_online,
        bench_parallel,
        bench_schedule,
        bench_provenance,
        bench_mixture,
        bench_memory,
        bench_object_storage,
    )
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small inputs and fewer repeats (about a minute)")
    parser.add_argument("--only", choices=sorted(GROUPS), help="run one group")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where the scratch folder is created (default: the system temp)"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="also save the results as JSON")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions per measurement (best kept)")
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the delivery rows (parallel group) build masks and metadata; cuda rows are skipped without a GPU",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    facts = environment()
    facts["delivery device"] = args.device
    print("environment")
    for key, value in facts.items():
        print(f"  {key}: {value}")
    print(flush=True)

    repeats = args.repeats or (2 if args.quick else 3)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="hp-data-bench-", dir=args.workdir))
    context = BenchContext(quick=args.quick, workdir=workdir, repeats=repeats, device=args.device)
    groups = [GROUPS[args.only]] if args.only else list(GROUPS.values())
    rows: list[Row] = []
    started = time.perf_counter()
    try:
        for group in groups:
            print(f"[{group.NAME}] {group.TITLE}", file=sys.stderr, flush=True)
            group_start = time.perf_counter()
            try:
                rows += group.run(context)
            except Exception as error:  # noqa: BLE001 - one broken group must not hide the others' results
                traceback.print_exc()
                rows.append(Row.failed(f"{group.NAME} (group)", f"{type(error).__name__}: {error}"))
            print(f"[{group.NAME}] {time.perf_counter() - group_start:.1f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.perf_counter() - started

    mode = "quick" if args.quick else "full"
    print(f"results ({mode} run, best of {repeats} unless noted, {elapsed:.0f} s); ratio = ours / reference")
    print(format_table(rows))
    if args.json is not None:
        document = {
            "mode": mode,
            "repeats": repeats,
            "seconds": elapsed,
            "environment": facts,
            "rows": [row.to_json() for row in rows],
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        print(f"\nsaved {args.json}")
    return 1 if any(row.status == "failed" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
