"""The issue's one table: P1-P8 and IMEX attach, each next to its floor, against a baseline.

:func:`summarize` turns the runner's measurements into :class:`Row` s. A row with a floor
measured in the same run has ``ratio = value / floor``: a ratio moves with the code, far less
with the machine, so it is what :func:`compare` holds against ``benchmarks/baseline.json``
(a row is flagged when its ratio is more than ``TOLERANCE`` worse than the baseline's). A row
with a bound is also held against it: on its ratio (``bound_on_ratio``) or on its value (the
issue's absolute goals: start time, resident memory, event latencies). docs/PERFORMANCE.md explains every row and how to renew the baseline.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import Result

TOLERANCE = 0.25
#: The physical floor's parts (rpc + GET + 2 writes), as bench_prepare names its rows.
FLOOR_PARTS = ("grpc empty prepare", "http GET claim", "durable write 4 KiB")
BASELINE = Path(__file__).with_name("baseline.json")


@dataclass(frozen=True)
class Row:
    key: str
    what: str
    value: float
    unit: str
    floor: float | None = None
    floor_what: str = ""
    bound: float | None = None  # the goal: value (or ratio, with ``bound_on_ratio``) <= bound

    bound_on_ratio: bool = False

    @property
    def ratio(self) -> float | None:
        if self.floor is None or not self.floor > 0 or math.isnan(self.value):
            return None
        return self.value / self.floor

    @property
    def within_bound(self) -> bool | None:
        if self.bound is None:
            return None
        measured = self.ratio if self.bound_on_ratio else self.value
        return measured is not None and measured <= self.bound


def _find(results: Sequence[Result], start: str) -> Result | None:
    return next((r for r in results if r.name.startswith(start)), None)


def summarize(results: Sequence[Result]) -> list[Row]:
    """The rows whose measurements are in ``results`` (``--only`` runs give fewer)."""
    rows: list[Row] = []

    def p50(start: str) -> float | None:
        found = _find(results, start)
        return found.p50 if found else None

    def p99(start: str) -> float | None:
        found = _find(results, start)
        return found.p99 if found else None

    def add(key: str, what: str, value: float | None, unit: str = "ms", **extra: Any) -> None:
        if value is not None:
            rows.append(Row(key, what, value, unit, **extra))

    parts = [p50(name) for name in FLOOR_PARTS]
    floor = None if None in parts else parts[0] + parts[1] + 2 * parts[2]  # type: ignore[operator]
    physical = "rpc + GET + 2 writes"
    add("P1", "prepare 1 GPU over gRPC, p50", p50("grpc prepare 1 GPU"), floor=floor,
        floor_what=physical, bound=1.5, bound_on_ratio=True)  # fmt: skip
    # P1 as the kubelet calls: after idle, tracing on and exporting, against the floor's parts
    # measured the same way in the same child (bench_prepare_tracing)
    cold = [p50(f"tracing on: {name}, one at a time") for name in FLOOR_PARTS]
    cold_floor = None if None in cold else cold[0] + cold[1] + 2 * cold[2]  # type: ignore[operator]
    add("P1", "prepare 1 GPU one at a time, traced, p50", p50("tracing on: grpc prepare 1 GPU, one at"),
        floor=cold_floor, floor_what="the same, one at a time", bound=1.3, bound_on_ratio=True)  # fmt: skip
    # P2's bound is on the batch against P1 (issue 30: P2 <= 5 x P1, it was 4 x while the claim
    # GET had an HTTP client of our own), so P1 is its floor
    p1 = p50("grpc prepare 1 GPU")
    add("P2", "prepare batch of 32 (MIG claims) against P1, p50", p50("engine prepare 32 MIG"),
        floor=p1, floor_what="P1", bound=5, bound_on_ratio=True)  # fmt: skip
    add("P3", "NVML event -> health stream, p99", p99("xid -> health stream"), bound=100)
    add("P4", "NVML event -> taint in API server, p99", p99("xid -> taint"), bound=100)
    add("P5", "wipe -> republished (dgx-h100), p50", p50("slices: wipe -> republished (dgx-h100"),
        floor=p50("slices: start -> published (dgx-h100"), floor_what="first publish")  # fmt: skip
    add("P6", "agent start -> registration, p50", p50("agent start -> registered (dgx-h100"),
        floor=p50("python start"), floor_what="python -c pass", bound=500)  # fmt: skip
    add("P6", "the same, gb200-nvl72-tray + compute domains, p50",
        p50("agent start -> registered (gb200-nvl72-tray"),
        floor=p50("python start"), floor_what="python -c pass", bound=500)  # fmt: skip
    add("P7", "soak: agent RSS max", p50("soak: agent RSS max"), "MB", bound=80)
    drift = p50("soak: RSS drift")
    add("P7", "soak: RSS drift 10 % -> 100 %", None if drift is None else abs(drift), "MB", bound=5)
    add("P7", "one 10 000-claim request: RSS peak", p50("huge request: RSS peak"), "MB",
        bound=120)  # fmt: skip
    add("P7", "the same: RSS within 60 s after it", p50("huge request: RSS after"), "MB",
        bound=90)  # fmt: skip
    add("P7", "the same: RSS 60 s after it", p50("huge request: RSS at +60"), "MB",
        bound=90)  # fmt: skip
    add("P8", "dynamic MIG overhead (p50 difference)", p50("dynamic MIG overhead"),
        floor=p50("engine prepare+unprepare 1 GPU (static)"),
        floor_what="static prepare+unprepare")  # fmt: skip
    add("P8", "MIG effector, the agent's own part, p99", p99("  of which the agent's own"),
        bound=5)  # fmt: skip
    add("IMEX", "attach (channel prepare, daemon start), p50", p50("IMEX attach"))
    return rows


def _number(value: float | None, fmt: Callable[[float], str]) -> str:
    return "-" if value is None else fmt(value)


def render(rows: Sequence[Row], baseline: Mapping[str, Any] | None) -> str:
    """The table; with a baseline, each ratio next to the baseline's."""
    old = {(r["key"], r["what"]): r for r in (baseline or {}).get("rows", [])}
    header = ("row", "what", "value", "floor", "ratio", "baseline", "bound")
    lines: list[tuple[str, ...]] = [header]
    for row in rows:
        before = old.get((row.key, row.what), {}).get("ratio")
        bound = (
            "" if row.bound is None else f"<= {row.bound:g}" + (" x" if row.bound_on_ratio else "")
        )
        floor = "-" if row.floor is None else f"{row.floor:.1f} ({row.floor_what})"
        lines.append((
            row.key, row.what, f"{row.value:.1f} {row.unit}", floor,
            _number(row.ratio, lambda v: f"{v:.2f}"), _number(before, lambda v: f"{v:.2f}"), bound,
        ))  # fmt: skip
    if not any(row.key == "IMEX" for row in rows):
        lines.append(("IMEX", "attach (channel prepare)", "not measured", "-", "-", "-", ""))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for index, line in enumerate(lines):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def compare(rows: Sequence[Row], baseline: Mapping[str, Any] | None) -> list[str]:
    """What is flagged: a ratio more than TOLERANCE worse than the baseline's, a bound missed."""
    flags = []
    old = {(r["key"], r["what"]): r for r in (baseline or {}).get("rows", [])}
    for row in rows:
        before = old.get((row.key, row.what), {}).get("ratio")
        if row.ratio is not None and before is not None and row.ratio > before * (1 + TOLERANCE):
            flags.append(
                f"{row.key} {row.what}: ratio {row.ratio:.2f} is "
                f"{100 * (row.ratio / before - 1):.0f} % worse than the baseline's {before:.2f}"
            )
        if row.within_bound is False:
            flags.append(f"{row.key} {row.what}: over its bound {row.bound:g}")
    return flags


def load_baseline(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def median_rows(runs: Sequence[Sequence[Row]]) -> list[Row]:
    """Per row (key and what), the row of the run in the middle by ratio (by value for a row
    without a floor): a whole row of one run, so its value and floor belong together."""
    by_row: dict[tuple[str, str], list[Row]] = {}
    for rows in runs:
        for row in rows:
            by_row.setdefault((row.key, row.what), []).append(row)

    def rank(row: Row) -> float:
        ratio = row.ratio
        return row.value if ratio is None else ratio

    return [sorted(found, key=rank)[(len(found) - 1) // 2] for found in by_row.values()]


def write_baseline(path: Path, rows: Sequence[Row], note: str) -> None:
    document = {
        "note": note,
        "tolerance": TOLERANCE,
        "rows": [{**asdict(row), "ratio": row.ratio} for row in rows],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
