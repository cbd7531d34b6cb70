"""Benchmarks of the agent's hot paths, run with ``python -m benchmarks`` (or ``make bench``).

Each benchmark module is listed in :data:`MODULES` and provides ``run(repeat: int) ->
list[Result]``; the runner calls every module and prints one table. To add a benchmark,
write a module with that function and add its name here: nothing else needs to change.
Numbers go into docs/PERFORMANCE.md together with the command that produced them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: Benchmark modules, run in this order.
MODULES: tuple[str, ...] = (
    "benchmarks.slice_publisher",
    "benchmarks.bench_prepare",
    "benchmarks.bench_prepare_tracing",
    "benchmarks.bench_health",
    "benchmarks.bench_mig",
    "benchmarks.bench_agent",
    "benchmarks.bench_memory",
    "benchmarks.bench_imex",
)


@dataclass(frozen=True)
class Result:
    """The samples of one measurement (``unit`` says what a sample is)."""

    name: str
    samples: tuple[float, ...]
    unit: str = "ms"

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def p50(self) -> float:
        return percentile(self.samples, 50)

    @property
    def p99(self) -> float:
        return percentile(self.samples, 99)


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: a value that was measured, never an interpolation."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def table(results: Sequence[Result]) -> str:
    """The results as an aligned text table: name, n, p50, p99, unit."""
    rows = [("name", "n", "p50", "p99", "unit")]
    rows += [(r.name, str(r.n), f"{r.p50:.1f}", f"{r.p99:.1f}", r.unit) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for index, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:4], widths[1:4], strict=True)
        ]
        lines.append("  ".join([*cells, row[4]]))
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
