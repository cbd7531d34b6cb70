"""The packing simulator's pod stream: MIG mapping, the seed's mix, openb traces, repeats.

The simulator's numbers are only as meaningful as the stream behind them, so the
documented mix and the trace rules are pinned here, each by a test that fails when the
rule is broken.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from agent.sim.packing.workload import (
    H100_SIZES,
    MAPPING_TABLE,
    MigSize,
    PodRequest,
    WorkloadError,
    mig_profile_for,
    read_openb,
    seed_workload,
    until_load,
    write_openb,
)

HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
    "creation_time,deletion_time,scheduled_time"
)
DGX_H100_CPU_MILLI = 224_000
DGX_H100_MEMORY_MIB = 2 * 1024 * 1024


def milli(pods: list[PodRequest]) -> int:
    """Summed compute in thousandths of a GPU: exact, unlike a float sum."""
    return sum(pod.gpus * 1000 if pod.gpus else pod.gpu_milli for pod in pods)


def trace(tmp_path: Path, *rows: str, header: str = HEADER) -> Path:
    path = tmp_path / "openb_pod_list_test.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def pod(name: str, arrival: float, gpus: int = 1, gpu_milli: int = 1000) -> PodRequest:
    profile = mig_profile_for(gpu_milli, H100_SIZES).profile if gpus == 0 else None
    return PodRequest(name, arrival, 60.0, 1000, 1024, gpus, gpu_milli, profile, "none")


# --- mig_profile_for and MAPPING_TABLE ---------------------------------------------------


@pytest.mark.parametrize(
    ("gpu_milli", "profile"),
    [
        (1, "1g.10gb"),
        (142, "1g.10gb"),
        (143, "2g.20gb"),
        (285, "2g.20gb"),
        (286, "3g.40gb"),
        (428, "3g.40gb"),
        (429, "4g.40gb"),
        (571, "4g.40gb"),
        (572, "7g.80gb"),
        (999, "7g.80gb"),
    ],
)
def test_mapping_boundaries(gpu_milli: int, profile: str) -> None:
    assert mig_profile_for(gpu_milli, H100_SIZES).profile == profile


@pytest.mark.parametrize("gpu_milli", [0, -1, 1000, 1500])
def test_mapping_refuses_non_fractional_requests(gpu_milli: int) -> None:
    with pytest.raises(WorkloadError, match=str(gpu_milli)):
        mig_profile_for(gpu_milli, H100_SIZES)


def test_mapping_refuses_a_request_above_every_profile() -> None:
    small = [size for size in H100_SIZES if size.compute_slices <= 4]
    assert mig_profile_for(571, small).profile == "4g.40gb"
    with pytest.raises(WorkloadError, match="above every MIG profile"):
        mig_profile_for(572, small)
    with pytest.raises(WorkloadError):
        mig_profile_for(100, [])


def test_mapping_ties_go_to_fewer_memory_slices_then_name() -> None:
    sizes = [MigSize("b", 1, 2, 4), MigSize("c", 1, 1, 4), MigSize("a", 1, 1, 4)]
    assert mig_profile_for(250, sizes).profile == "a"
    assert mig_profile_for(250, sizes[:2]).profile == "c"
    # 1/4 covers 250 exactly; 251 needs the larger share, whatever the slice counts
    assert mig_profile_for(251, [*sizes, MigSize("2g", 2, 2, 4)]).profile == "2g"


def test_mapping_table_states_the_computed_ranges() -> None:
    for size in H100_SIZES:
        assert size.profile in MAPPING_TABLE
    for cells in ("| 1..142 | 1g.10gb", "| 143..285 | 2g.20gb", "| 286..428 | 3g.40gb"):
        assert cells in MAPPING_TABLE
    assert "| 429..571 | 4g.40gb" in MAPPING_TABLE
    assert "| 572..999 | 7g.80gb" in MAPPING_TABLE
    assert "Never chosen: 1g.20gb" in MAPPING_TABLE


# --- seed_workload --------------------------------------------------------------------------


def seeded(seed: int = 7, capacity: int = 64, load: float = 1.0, **kw: int) -> list[PodRequest]:
    return seed_workload(capacity_gpus=capacity, load=load, seed=seed, sizes=H100_SIZES, **kw)


def test_seed_is_deterministic_and_differs_between_seeds() -> None:
    assert seeded(7) == seeded(7)
    assert seeded(7) != seeded(8)
    assert [p.name for p in seeded(7)[:3]] == ["seed-00000", "seed-00001", "seed-00002"]


@pytest.mark.parametrize(("capacity", "load"), [(64, 1.0), (100, 0.37), (8, 2.5), (1, 0.01)])
def test_seed_reaches_the_load_with_the_crossing_pod(capacity: int, load: float) -> None:
    pods = seeded(capacity=capacity, load=load)
    assert milli(pods) >= load * capacity * 1000
    assert milli(pods[:-1]) < load * capacity * 1000


def test_seed_arrivals_are_ordered_and_lifetimes_positive() -> None:
    pods = seed_workload(
        capacity_gpus=400, load=1.0, seed=3, sizes=H100_SIZES, mean_interarrival_s=10.0
    )
    arrivals = [p.arrival for p in pods]
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    mean_gap = arrivals[-1] / (len(arrivals) - 1)
    assert 8.0 < mean_gap < 12.0
    lifetimes = [p.lifetime for p in pods if p.lifetime is not None]
    assert len(lifetimes) == len(pods)
    assert min(lifetimes) > 0
    assert 3000 < sum(lifetimes) / len(lifetimes) < 4200


def test_seed_mix_matches_the_documented_fractions() -> None:
    pods = seeded(capacity=10_000)
    assert len(pods) > 5000
    shares = Counter(p.gpus for p in pods)
    for gpus, documented in {0: 0.45, 1: 0.25, 2: 0.15, 4: 0.10, 8: 0.05}.items():
        assert abs(shares[gpus] / len(pods) - documented) < 0.03, gpus
    fractional = [p for p in pods if p.gpus == 0]
    profiles = Counter(p.mig_profile for p in fractional)
    documented_profiles = {"1g.10gb": 0.40, "2g.20gb": 0.25, "3g.40gb": 0.20, "4g.40gb": 0.15}
    for profile, documented in documented_profiles.items():
        assert abs(profiles[profile] / len(fractional) - documented) < 0.03, profile
    assert set(profiles) == set(documented_profiles)
    assert {p.gpu_milli for p in fractional} == {100, 140, 250, 280, 400, 550}


def test_seed_pods_fit_one_dgx_h100() -> None:
    for p in seeded(capacity=2000):
        assert p.cpu_milli <= DGX_H100_CPU_MILLI and p.memory_mib <= DGX_H100_MEMORY_MIB
        if p.gpus:
            assert p.cpu_milli == 24_000 * p.gpus and p.memory_mib == 240 * 1024 * p.gpus
            assert p.gpu_milli == 1000 and p.mig_profile is None
        else:
            assert p.cpu_milli == max(1000, 24 * p.gpu_milli)
            assert p.memory_mib == max(1024, 240 * 1024 * p.gpu_milli // 1000)
            assert p.mig_profile == mig_profile_for(p.gpu_milli, H100_SIZES).profile


def test_seed_constraints_on_eight_gpu_nodes() -> None:
    constraints = {(p.gpus, p.constraint) for p in seeded(capacity=2000)}
    assert constraints == {(0, "none"), (1, "none"), (2, "numa"), (4, "numa"), (8, "nvlink")}


@pytest.mark.parametrize(
    ("per_node", "expected"),
    [
        (4, {(0, "none"), (1, "none"), (2, "numa"), (4, "nvlink")}),
        (6, {(0, "none"), (1, "none"), (2, "numa"), (4, "nvlink")}),
        (2, {(0, "none"), (1, "none"), (2, "nvlink")}),
        (16, {(0, "none"), (1, "none"), (2, "numa"), (4, "numa"), (8, "numa")}),
    ],
)
def test_seed_constraints_follow_the_node_size(
    per_node: int, expected: set[tuple[int, str]]
) -> None:
    pods = seeded(capacity=2000, gpus_per_node=per_node)
    assert {(p.gpus, p.constraint) for p in pods} == expected


@pytest.mark.parametrize(
    "bad",
    [
        {"load": 0.0},
        {"load": float("nan")},
        {"capacity_gpus": 0},
        {"gpus_per_node": 0},
        {"mean_lifetime_s": -1.0},
        {"mean_interarrival_s": 0.0},
    ],
)
def test_seed_refuses_bad_parameters(bad: dict[str, Any]) -> None:
    params: dict[str, Any] = {"capacity_gpus": 8, "load": 1.0, "seed": 1, "sizes": H100_SIZES}
    with pytest.raises(WorkloadError, match=next(iter(bad))):
        seed_workload(**(params | bad))


# --- read_openb and write_openb --------------------------------------------------------------


def test_written_trace_reads_back_equal(tmp_path: Path) -> None:
    pods = [
        PodRequest("a", 0.0, 3600.0, 24000, 245760, 1, 1000, None, "none"),
        PodRequest("b", 0.0, None, 2400, 24576, 0, 100, "1g.10gb", "none"),
        PodRequest("c", 15.0, 0.0, 192000, 1966080, 8, 1000, None, "none"),
        PodRequest("d", 40.0, 7.0, 13200, 135168, 0, 550, "4g.40gb", "none"),
    ]
    path = tmp_path / "trace.csv"
    write_openb(path, pods)
    lines = path.read_text().splitlines()
    assert lines[0] == HEADER
    assert lines[2] == "b,2400,24576,1,100,,LS,Running,0,,0"
    assert read_openb(path, H100_SIZES) == pods


def test_seeded_pods_round_trip_once_their_times_are_whole(tmp_path: Path) -> None:
    pods = [
        PodRequest(p.name, float(round(p.arrival)), float(round(p.lifetime or 0)),
                   p.cpu_milli, p.memory_mib, p.gpus, p.gpu_milli, p.mig_profile, "none")
        for p in seeded(capacity=32)
    ]  # fmt: skip
    pods.sort(key=lambda p: (p.arrival, p.name))
    write_openb(tmp_path / "t.csv", pods)
    assert read_openb(tmp_path / "t.csv", H100_SIZES) == pods


def test_cpu_only_rows_are_skipped(tmp_path: Path) -> None:
    path = trace(
        tmp_path,
        "cpu,4000,8192,0,0,,LS,Running,5,100,5",
        "gpu,12000,16384,1,1000,,LS,Running,10,110,12",
    )
    pods = read_openb(path, H100_SIZES)
    assert [p.name for p in pods] == ["gpu"]
    # arrivals count from the first GPU pod; the lifetime runs from scheduling to deletion
    assert (pods[0].arrival, pods[0].lifetime) == (0.0, 98.0)


def test_fractional_and_whole_rows(tmp_path: Path) -> None:
    path = trace(
        tmp_path,
        "f142,1000,1024,1,142,,LS,Running,0,,",
        "f143,1000,1024,1,143,,BE,Pending,1,,",
        "f460,6000,12288,1,460,V100M16|V100M32,LS,Running,2,50,",
        "whole0,1000,1024,1,0,,LS,Running,3,,",
        "whole1000,1000,1024,1,1000,,LS,Running,4,,",
        "multi,88000,327680,8,1000,,LS,Running,5,,",
    )
    got = {
        p.name: (p.gpus, p.gpu_milli, p.mig_profile, p.lifetime)
        for p in read_openb(path, H100_SIZES)
    }
    assert got == {
        "f142": (0, 142, "1g.10gb", None),
        "f143": (0, 143, "2g.20gb", None),
        "f460": (0, 460, "4g.40gb", 48.0),  # never scheduled: from creation to deletion
        "whole0": (1, 1000, None, None),
        "whole1000": (1, 1000, None, None),
        "multi": (8, 1000, None, None),
    }  # fmt: skip


def test_rows_out_of_order_are_sorted_by_creation_then_name(tmp_path: Path) -> None:
    path = trace(
        tmp_path,
        "late,1000,1024,1,1000,,LS,Running,500,,",
        "b,1000,1024,1,1000,,LS,Running,100,,",
        "a,1000,1024,1,1000,,LS,Running,100,,",
    )
    pods = read_openb(path, H100_SIZES)
    assert [(p.name, p.arrival) for p in pods] == [("a", 0.0), ("b", 0.0), ("late", 400.0)]


@pytest.mark.parametrize(
    ("row", "words"),
    [
        ("p,1000,1024,x,1000,,LS,Running,0,,", ["num_gpu", "not an integer"]),
        ("p,1000,1024,1,1000,,LS,Running,0,", ["missing scheduled_time"]),
        ("p,1000,1024,1,1000,,LS,Running,0,,,", ["extra fields"]),
        ("p,1000,-5,1,1000,,LS,Running,0,,", ["memory_mib", "negative"]),
        ("p,1.5,1024,1,1000,,LS,Running,0,,", ["cpu_milli", "not an integer"]),
        ("p,1000,1024,2,1500,,LS,Running,0,,", ["gpu_milli", "1500"]),
        ("p,1000,1024,1,1000,,LS,Running,,,", ["creation_time", "empty"]),
        ("p,1000,1024,1,1000,,LS,Running,0,50,60", ["deletion_time", "scheduled_time"]),
        ("p,1000,1024,1,1000,,LS,Running,70,50,", ["deletion_time", "creation_time"]),
        (",1000,1024,1,1000,,LS,Running,0,,", ["name"]),
        ("first,1000,1024,1,1000,,LS,Running,0,,", ["first", "repeats line 2"]),
    ],
)
def test_malformed_line_names_the_line_and_column(
    tmp_path: Path, row: str, words: list[str]
) -> None:
    path = trace(tmp_path, "first,1000,1024,1,1000,,LS,Running,0,,", row)
    with pytest.raises(WorkloadError) as caught:
        read_openb(path, H100_SIZES)
    message = str(caught.value)
    assert message.startswith(f"{path}:3: ")
    for word in words:
        assert word in message


def test_a_fractional_row_no_profile_covers_is_refused(tmp_path: Path) -> None:
    path = trace(tmp_path, "p,1000,1024,1,800,,LS,Running,0,,")
    small = [size for size in H100_SIZES if size.compute_slices <= 4]
    with pytest.raises(WorkloadError, match=r":2: gpu_milli: .*above every MIG profile"):
        read_openb(path, small)


def test_a_wrong_header_is_refused_naming_the_columns(tmp_path: Path) -> None:
    header = HEADER.replace(",gpu_milli", "").replace("qos", "priority")
    with pytest.raises(WorkloadError) as caught:
        read_openb(trace(tmp_path, header=header), H100_SIZES)
    message = str(caught.value)
    assert ":1: " in message
    assert "missing columns: gpu_milli, qos" in message
    assert "unexpected columns: priority" in message
    swapped = HEADER.replace("deletion_time,scheduled_time", "scheduled_time,deletion_time")
    with pytest.raises(WorkloadError, match="out of order"):
        read_openb(trace(tmp_path, header=swapped), H100_SIZES)


def test_files_without_gpu_pods_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    for path in (empty, trace(tmp_path), trace(tmp_path, "c,1000,1024,0,0,,LS,Running,0,,")):
        with pytest.raises(WorkloadError, match="no GPU pods"):
            read_openb(path, H100_SIZES)
    with pytest.raises(WorkloadError, match="cannot read"):
        read_openb(tmp_path / "absent.csv", H100_SIZES)


# --- until_load ----------------------------------------------------------------------------


def test_until_load_stops_at_the_crossing_pod() -> None:
    pods = [pod("a", 0.0), pod("b", 10.0, gpus=2), pod("c", 20.0)]
    assert [p.name for p in until_load(pods, capacity_gpus=4, load=0.5)] == ["a", "b"]
    assert [p.name for p in until_load(pods, capacity_gpus=4, load=0.25)] == ["a"]
    assert until_load(pods, capacity_gpus=4, load=1.0) == pods


def test_until_load_sorts_by_arrival() -> None:
    pods = [pod("late", 30.0), pod("early", 0.0)]
    assert [p.name for p in until_load(pods, capacity_gpus=2, load=1.0)] == ["early", "late"]


def test_until_load_repeats_with_suffixed_names_and_shifted_arrivals() -> None:
    pods = [pod("a", 0.0), pod("b", 10.0), pod("c", 40.0, gpus=0, gpu_milli=500)]
    # span 40 s, mean gap 20 s: each repeat starts 60 s after the one before
    got = until_load(pods, capacity_gpus=6, load=1.0)
    assert [(p.name, p.arrival) for p in got] == [
        ("a", 0.0), ("b", 10.0), ("c", 40.0),
        ("a~1", 60.0), ("b~1", 70.0), ("c~1", 100.0),
        ("a~2", 120.0),
    ]  # fmt: skip
    assert got[5].gpu_milli == 500 and got[5].mig_profile == "4g.40gb"
    assert milli(got) >= 6000 and milli(got[:-1]) < 6000


def test_until_load_repeats_a_single_pod_one_second_apart() -> None:
    got = until_load([pod("only", 5.0)], capacity_gpus=3, load=1.0)
    assert [(p.name, p.arrival) for p in got] == [("only", 5.0), ("only~1", 6.0), ("only~2", 7.0)]


def test_until_load_refuses_no_pods_and_bad_load() -> None:
    with pytest.raises(WorkloadError):
        until_load([], capacity_gpus=8, load=1.0)
    with pytest.raises(WorkloadError):
        until_load([pod("a", 0.0)], capacity_gpus=8, load=0.0)


def test_pod_request_refuses_inconsistent_requests() -> None:
    assert pod("frac", 0.0, gpus=0, gpu_milli=250).compute == 0.25
    assert pod("two", 0.0, gpus=2).compute == 2.0
    with pytest.raises(WorkloadError, match="gpu_milli"):
        PodRequest("x", 0.0, None, 1, 1, 0, 1000, None, "none")
    with pytest.raises(WorkloadError, match="whole-GPU"):
        PodRequest("x", 0.0, None, 1, 1, 2, 500, None, "none")
    with pytest.raises(WorkloadError, match="arrival"):
        PodRequest("x", -1.0, None, 1, 1, 1, 1000, None, "none")
