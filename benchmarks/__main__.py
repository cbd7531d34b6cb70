"""Run every registered benchmark, print every measurement and then the one P1-P8 table
against the committed baseline (``python -m benchmarks --help``; docs/PERFORMANCE.md)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

from agent.memory import pin_mmap_threshold
from benchmarks import MODULES, Result, table
from benchmarks.summary import (
    BASELINE,
    compare,
    load_baseline,
    median_rows,
    render,
    summarize,
    write_baseline,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--repeat", type=int, default=30, help="runs per measurement (30)")
    parser.add_argument(
        "--only", default="", help="run only the modules whose name contains this text"
    )
    parser.add_argument(
        "--baseline", type=Path, default=BASELINE, help="baseline to compare with (%(default)s)"
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when a row is flagged (ratio or bound)"
    )
    parser.add_argument(
        "--write-baseline",
        metavar="NOTE",
        default=None,
        help="write this run's table as the baseline, with NOTE (machine, load) in it",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="run everything this many times; the table (and a baseline written) has each "
        "row's median run (1)",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    # the rows measured in this process (bench_prepare's engine and gRPC server) get the
    # allocator set-up the agent's process makes at start (agent/memory.py)
    pin_mmap_threshold(os.environ)
    started = time.perf_counter()
    runs = []
    for run in range(1, args.runs + 1):
        results: list[Result] = []
        for name in MODULES:
            if args.only and args.only not in name:
                continue
            module = importlib.import_module(name)
            print(
                f"run {run}/{args.runs}: {name} ({args.repeat} runs per measurement) ...",
                file=sys.stderr,
            )
            results.extend(module.run(args.repeat))
        print(table(results))
        runs.append(summarize(results))
    rows = median_rows(runs)
    baseline = load_baseline(args.baseline)
    which = f"the median of {args.runs} runs, " if args.runs > 1 else ""
    against = args.baseline.name if baseline else "no baseline"
    print(f"\nThe table ({which}ratios against {against}):")
    print(render(rows, baseline))
    flags = compare(rows, baseline)
    for flag in flags:
        print(f"FLAGGED: {flag}")
    if not flags:
        print("nothing flagged")
    if args.write_baseline is not None:
        write_baseline(args.baseline, rows, args.write_baseline)
        print(f"baseline written to {args.baseline}", file=sys.stderr)
    print(
        f"\n{args.runs} run(s) of {len(results)} measurements in "
        f"{time.perf_counter() - started:.1f} s",
        file=sys.stderr,
    )
    return 1 if flags and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
