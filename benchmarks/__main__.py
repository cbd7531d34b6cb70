"""Run every registered benchmark and print one table (``python -m benchmarks --help``)."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from benchmarks import MODULES, Result, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--repeat", type=int, default=30, help="runs per measurement (30)")
    parser.add_argument(
        "--only", default="", help="run only the modules whose name contains this text"
    )
    args = parser.parse_args(argv)
    results: list[Result] = []
    started = time.perf_counter()
    for name in MODULES:
        if args.only and args.only not in name:
            continue
        module = importlib.import_module(name)
        print(f"running {name} ({args.repeat} runs per measurement) ...", file=sys.stderr)
        results.extend(module.run(args.repeat))
    print(table(results))
    print(
        f"\n{len(results)} measurements in {time.perf_counter() - started:.1f} s", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
