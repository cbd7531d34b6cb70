"""The benchmark table: rows from the runner's measurements, flags against a baseline."""

from __future__ import annotations

from pathlib import Path

from benchmarks import Result
from benchmarks.summary import (
    Row,
    compare,
    load_baseline,
    median_rows,
    render,
    summarize,
    write_baseline,
)


def _results(prepare_ms: float, drift_mb: float = 1.0) -> list[Result]:
    return [
        Result("grpc empty prepare", (1.0, 1.0, 1.0)),
        Result("http GET claim", (0.5, 0.5)),
        Result("durable write 4 KiB", (0.25, 0.25)),
        Result("grpc prepare 1 GPU, CDI on tmpfs", (prepare_ms,)),
        Result("soak: RSS drift 10 % -> 100 %", (drift_mb,), "MB"),
    ]


def test_p1_is_the_prepare_over_the_physical_floor_of_the_same_run() -> None:
    rows = summarize(_results(3.0))
    p1 = next(r for r in rows if r.key == "P1")
    assert p1.floor == 2.0  # rpc 1.0 + GET 0.5 + 2 x write 0.25
    assert p1.ratio == 1.5
    assert p1.within_bound is True
    assert {r.key for r in rows} == {"P1", "P7"}  # only rows that were measured


def test_p2_is_the_batch_over_p1_of_the_same_run_bound_at_five() -> None:
    batch = Result("engine prepare 32 MIG claims, CDI on tmpfs", (19.0,))
    p2 = next(r for r in summarize([*_results(4.0), batch]) if r.key == "P2")
    assert p2.floor == 4.0  # P1's value: issue 30 bounds P2 at 5 x P1
    assert p2.ratio == 4.75
    assert p2.within_bound is True
    batch = Result("engine prepare 32 MIG claims, CDI on tmpfs", (21.0,))
    p2 = next(r for r in summarize([*_results(4.0), batch]) if r.key == "P2")
    assert p2.within_bound is False


def test_a_ratio_more_than_25_percent_worse_than_the_baseline_is_flagged(tmp_path: Path) -> None:
    path = tmp_path / "baseline.json"
    write_baseline(path, summarize(_results(2.0)), "test")
    baseline = load_baseline(path)
    assert compare(summarize(_results(2.4)), baseline) == []  # 20 % worse: not flagged
    flags = compare(summarize(_results(2.6)), baseline)  # 30 % worse, within the 1.5 bound
    assert len(flags) == 1 and "P1" in flags[0] and "30 % worse" in flags[0]
    assert "1.00" in render(summarize(_results(2.6)), baseline)  # the baseline's ratio shown


def test_a_row_without_a_floor_is_held_against_its_bound() -> None:
    assert compare(summarize(_results(2.0, drift_mb=-4.0)), None) == []
    flags = compare(summarize(_results(2.0, drift_mb=-6.0)), None)
    assert flags == ["P7 soak: RSS drift 10 % -> 100 %: over its bound 5"]


def test_the_imex_row_says_not_measured_until_its_benchmark_ran() -> None:
    assert "not measured" in render(summarize(_results(2.0)), None)
    rows = summarize([*_results(2.0), Result("IMEX attach: channel prepare (tray)", (300.0,))])
    assert "not measured" not in render(rows, None)
    assert next(r for r in rows if r.key == "IMEX").value == 300.0


def test_the_median_run_of_each_row_is_kept_whole() -> None:
    def p1(value: float, floor: float) -> Row:
        return Row("P1", "prepare", value, "ms", floor=floor, bound=1.5, bound_on_ratio=True)

    def p3(value: float) -> Row:
        return Row("P3", "event", value, "ms", bound=100)

    runs = [[p1(4.0, 2.0), p3(9.0)], [p1(3.0, 2.5), p3(4.0)], [p1(5.0, 2.0), p3(5.0)]]
    median = {row.key: row for row in median_rows(runs)}
    assert median["P1"] == p1(4.0, 2.0)  # ratios 2.0, 1.2, 2.5: the middle one, value and floor
    assert median["P3"] == p3(5.0)  # no floor: by value
    assert median_rows(runs[:2])[0] == p1(3.0, 2.5)  # even count: the lower middle


def test_the_issue_goals_are_bounds_that_check_flags() -> None:
    """P2 against P1 of the same run (<= 5 x), start (<= 500 ms) and resident memory (<= 80
    MB) on their values although they have a floor or none, the taint's p99 <= 100 ms."""

    def results(batch: float, start: float, rss: float, taint: float) -> list[Result]:
        return [
            *_results(3.0),
            Result("engine prepare 32 MIG claims in one request", (batch,)),
            Result("agent start -> registered (dgx-h100)", (start,)),
            Result("python start (floor of P6)", (25.0,)),
            Result("soak: agent RSS max (200 cycles)", (rss,), "MB"),
            Result("xid -> taint in API server", (taint,)),
        ]

    rows = {(r.key, r.what): r for r in summarize(results(15.0, 450.0, 79.0, 60.0))}
    p2 = rows["P2", "prepare batch of 32 (MIG claims) against P1, p50"]
    assert p2.floor == 3.0 and p2.ratio == 5.0 and p2.within_bound is True
    assert compare(list(rows.values()), None) == []

    flags = compare(summarize(results(15.3, 510.0, 81.0, 101.0)), None)
    assert [flag.split(":")[0] for flag in flags] == [
        "P2 prepare batch of 32 (MIG claims) against P1, p50",
        "P4 NVML event -> taint in API server, p99",
        "P6 agent start -> registration, p50",
        "P7 soak",
    ]
