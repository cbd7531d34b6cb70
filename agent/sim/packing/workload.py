"""The pod stream of the packing simulator: a seeded synthetic mix, or a replayed trace.

A packing result means little without saying what was packed, so both sources are fixed
and documented here, in a leaf module that the simulator, its tests and the docs share.

**The seed's mix** (``seed_workload``). Fractional requests are what MIG placement is
about, large multi-GPU requests are what fragments a node, so the mix has both:

=====  ======================  ====  ==========================================  ==========
share  request                 gpus  gpu_milli (of the 45 %)                     constraint
=====  ======================  ====  ==========================================  ==========
45 %   MIG-sized inference     0     100 (20 %), 140 (20 %) -> 1g; 250 (15 %),   none
                                     280 (10 %) -> 2g; 400 (20 %) -> 3g;
                                     550 (15 %) -> 4g  (H100 profiles)
25 %   1-GPU training          1     1000                                        none
15 %   2-GPU training          2     1000                                        numa
10 %   4-GPU training          4     1000                                        numa
5 %    8-GPU training          8     1000                                        nvlink
=====  ======================  ====  ==========================================  ==========

An ``n``-GPU request asks for one NUMA node when half a node holds it (``gpus_per_node
// 2 >= n``), else for one NVLink domain; one larger than a node becomes the largest power
of two that fits one (8-GPU requests exist only on nodes of 8 or more). Arrivals are a
Poisson process (exponential gaps, mean ``mean_interarrival_s``, the first pod at 0 s as
in a replay), lifetimes exponential (mean ``mean_lifetime_s``). CPU and memory follow the
compute: 24 CPUs and 240 GiB per GPU, so eight fit a DGX H100 (224 CPUs, 2 TiB); a
fractional request takes its fraction, at least 1 CPU and 1 GiB. Pods are drawn until
their summed compute reaches ``load * capacity_gpus``, the pod crossing the line kept.

**A trace** (``read_openb``): ``openb_pod_list_*.csv`` of Alibaba's cluster-trace-gpu-v2023.
Its licence allows research use only, so the project never ships it: the user supplies
their own copy (``write_openb`` makes small ones for tests). CPU-only rows are skipped, as
the simulated cluster models GPU nodes only; ``gpu_spec`` is ignored, as the simulated
cluster has one GPU model; ``qos`` and ``pod_phase`` are ignored, as where a pod lands is
what the simulation decides. The trace has no topology: no constraints. A single-GPU row
asking 1..999 milli is fractional, mapped to a MIG profile (``mig_profile_for``); any other
GPU row asks for whole GPUs (MIG cannot split one request over several GPUs).
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from itertools import groupby
from pathlib import Path
from random import Random
from typing import Literal, get_args

Constraint = Literal["none", "numa", "nvlink"]

#: CPU (milli) and memory (MiB) asked per whole GPU; eight fit a DGX H100 (224 CPUs, 2 TiB).
CPU_MILLI_PER_GPU = 24_000
MEMORY_MIB_PER_GPU = 240 * 1024
#: The least a fractional request asks: 1 CPU, 1 GiB.
MIN_CPU_MILLI = 1000
MIN_MEMORY_MIB = 1024

#: The columns of ``openb_pod_list_*.csv``, in order.
OPENB_COLUMNS = [
    *("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos"),
    *("pod_phase", "creation_time", "deletion_time", "scheduled_time"),
]


class WorkloadError(ValueError):
    """A workload that cannot be built or read: bad parameters, a malformed trace."""


@dataclass(frozen=True, slots=True)
class PodRequest:
    """One pod of the stream: when it arrives, how long it runs, what it asks for."""

    name: str
    arrival: float
    lifetime: float | None
    cpu_milli: int
    memory_mib: int
    gpus: int
    gpu_milli: int
    mig_profile: str | None
    constraint: Constraint

    def __post_init__(self) -> None:
        problem = _pod_problem(self)
        if problem:
            raise WorkloadError(f"pod {self.name!r}: {problem}")

    @property
    def compute(self) -> float:
        """GPU compute asked, in GPUs."""
        return float(self.gpus) if self.gpus else self.gpu_milli / 1000

    @property
    def compute_milli(self) -> int:
        """GPU compute asked, in thousandths of a GPU: exact, for summing."""
        return self.gpus * 1000 if self.gpus else self.gpu_milli


def _pod_problem(pod: PodRequest) -> str | None:
    if not pod.name:
        return "empty name"
    if not (math.isfinite(pod.arrival) and pod.arrival >= 0):
        return f"arrival {pod.arrival} is not a time >= 0"
    if pod.lifetime is not None and not (math.isfinite(pod.lifetime) and pod.lifetime >= 0):
        return f"lifetime {pod.lifetime} is not a duration >= 0"
    if pod.cpu_milli < 0 or pod.memory_mib < 0 or pod.gpus < 0:
        return "negative cpu_milli, memory_mib or gpus"
    if pod.gpus == 0 and not 1 <= pod.gpu_milli <= 999:
        return f"a fractional request needs gpu_milli 1..999, not {pod.gpu_milli}"
    if pod.gpus > 0 and (pod.gpu_milli != 1000 or pod.mig_profile is not None):
        return "a whole-GPU request has gpu_milli 1000 and no MIG profile"
    if pod.constraint not in get_args(Constraint):
        return f"unknown constraint {pod.constraint!r}"
    return None


@dataclass(frozen=True, slots=True)
class MigSize:
    """A MIG profile's share of its GPU, in compute and memory slices."""

    profile: str
    compute_slices: int
    memory_slices: int
    total_compute: int

    def __post_init__(self) -> None:
        if not (self.profile and 1 <= self.compute_slices <= self.total_compute):
            raise WorkloadError(f"MIG size {self.profile!r}: compute slices out of range")


H100_SIZES: tuple[MigSize, ...] = (
    MigSize("1g.10gb", 1, 1, 7),
    MigSize("1g.20gb", 1, 2, 7),
    MigSize("2g.20gb", 2, 2, 7),
    MigSize("3g.40gb", 3, 4, 7),
    MigSize("4g.40gb", 4, 4, 7),
    MigSize("7g.80gb", 7, 8, 7),
)


def mig_profile_for(gpu_milli: int, sizes: Sequence[MigSize]) -> MigSize:
    """The smallest profile whose compute share covers ``gpu_milli`` thousandths of a GPU.

    Smallest by compute share, then fewer memory slices, then name. Integers only:
    ``compute_slices * 1000 >= gpu_milli * total_compute``.
    """
    if not 1 <= gpu_milli <= 999:
        raise WorkloadError(f"gpu_milli {gpu_milli} is not a fractional request (1..999)")
    fitting = [s for s in sizes if s.compute_slices * 1000 >= gpu_milli * s.total_compute]
    if not fitting:
        names = ", ".join(s.profile for s in sizes) or "none given"
        raise WorkloadError(f"gpu_milli {gpu_milli} is above every MIG profile ({names})")
    return min(
        fitting,
        key=lambda s: (Fraction(s.compute_slices, s.total_compute), s.memory_slices, s.profile),
    )


def mapping_table(sizes: Sequence[MigSize]) -> str:
    """A markdown table of the ``gpu_milli`` ranges each profile of ``sizes`` takes."""
    mapped: list[tuple[int, MigSize]] = []
    for milli in range(1, 1000):
        try:
            mapped.append((milli, mig_profile_for(milli, sizes)))
        except WorkloadError:
            break  # above every profile, and so is every larger request
    lines = ["| gpu_milli | MIG profile | compute share | memory slices |", "|---|---|---|---|"]
    for s, group in groupby(mapped, key=lambda pair: pair[1]):
        millis = [milli for milli, _ in group]
        share = f"{s.compute_slices}/{s.total_compute}"
        lines.append(f"| {millis[0]}..{millis[-1]} | {s.profile} | {share} | {s.memory_slices} |")
    if never := [s.profile for s in sizes if s not in {size for _, size in mapped}]:
        lines += ["", f"Never chosen: {', '.join(never)} (as much compute, more memory)."]
    return "\n".join(lines) + "\n"


MAPPING_TABLE: str = mapping_table(H100_SIZES)


#: GPUs asked and their percent of the mix; 0 GPUs is a fractional request.
_MIX_GPUS, _MIX_PERCENT = (0, 1, 2, 4, 8), (45, 25, 15, 10, 5)
#: gpu_milli of the fractional requests and their percent of those.
_FRACTION_MILLI, _FRACTION_PERCENT = (100, 140, 250, 280, 400, 550), (20, 20, 15, 10, 20, 15)


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value > 0):
            raise WorkloadError(f"{name} must be a number > 0, not {value}")


def seed_workload(
    *,
    capacity_gpus: int,
    load: float,
    seed: int,
    sizes: Sequence[MigSize],
    mean_interarrival_s: float = 60.0,
    mean_lifetime_s: float = 3600.0,
    gpus_per_node: int = 8,
) -> list[PodRequest]:
    """The seed's mix (module docstring) until its compute reaches ``load * capacity_gpus``."""
    _positive(capacity_gpus=capacity_gpus, load=load, gpus_per_node=gpus_per_node)
    _positive(mean_interarrival_s=mean_interarrival_s, mean_lifetime_s=mean_lifetime_s)
    largest = 1 << (int(gpus_per_node).bit_length() - 1)
    rng = Random(seed)
    target_milli = load * capacity_gpus * 1000
    pods: list[PodRequest] = []
    total_milli = 0
    arrival = 0.0
    while total_milli < target_milli:
        if pods:
            arrival += rng.expovariate(1 / mean_interarrival_s)
        gpus = min(rng.choices(_MIX_GPUS, _MIX_PERCENT)[0], largest)
        milli = rng.choices(_FRACTION_MILLI, _FRACTION_PERCENT)[0] if gpus == 0 else 1000
        lifetime = rng.expovariate(1 / mean_lifetime_s)
        constraint: Constraint = "none"
        if gpus > 1:
            constraint = "numa" if gpus_per_node // 2 >= gpus else "nvlink"
        pod = PodRequest(
            name=f"seed-{len(pods):05d}",
            arrival=arrival,
            lifetime=lifetime,
            cpu_milli=max(MIN_CPU_MILLI, CPU_MILLI_PER_GPU * (gpus or 1) * milli // 1000),
            memory_mib=max(MIN_MEMORY_MIB, MEMORY_MIB_PER_GPU * (gpus or 1) * milli // 1000),
            gpus=gpus,
            gpu_milli=milli,
            # no MIG on the GPU model: a fraction stays a fraction, placed on a whole GPU
            mig_profile=mig_profile_for(milli, sizes).profile if gpus == 0 and sizes else None,
            constraint=constraint,
        )
        pods.append(pod)
        total_milli += pod.compute_milli
    return pods


def until_load(
    pods: Sequence[PodRequest], *, capacity_gpus: float, load: float
) -> list[PodRequest]:
    """``pods`` in arrival order until their compute reaches ``load * capacity_gpus``.

    When the pods run out first they repeat: the k-th repeat has names suffixed ``~k``
    and arrivals shifted by k periods, so that repeats follow each other without overlap.
    """
    if not pods:
        raise WorkloadError("no pods to replay")
    _positive(capacity_gpus=capacity_gpus, load=load)
    ordered = sorted(pods, key=lambda pod: pod.arrival)
    span = ordered[-1].arrival - ordered[0].arrival
    # the span plus the mean gap; 1 s when that is 0 (one pod, or all at once)
    period = (span * len(ordered) / (len(ordered) - 1) if len(ordered) > 1 else 0.0) or 1.0
    target_milli = load * capacity_gpus * 1000
    out: list[PodRequest] = []
    total_milli = repeat = 0
    while True:
        for pod in ordered:
            if total_milli >= target_milli:
                return out
            if repeat:
                shifted = pod.arrival + repeat * period
                pod = replace(pod, name=f"{pod.name}~{repeat}", arrival=shifted)
            out.append(pod)
            total_milli += pod.compute_milli
        repeat += 1


_INTEGER = re.compile(r"-?[0-9]+")
#: A parsed GPU row, sortable as is: (creation_time, name, line, pod with arrival 0).
_Row = tuple[int, str, int, PodRequest]


def _integer(where: str, column: str, text: str) -> int | None:
    text = text.strip()
    if text and not _INTEGER.fullmatch(text):
        raise WorkloadError(f"{where}{column} is not an integer: {text!r}")
    if text and int(text) < 0:
        raise WorkloadError(f"{where}{column} is negative: {text}")
    return int(text) if text else None


def _required(where: str, column: str, text: str) -> int:
    value = _integer(where, column, text)
    if value is None:
        raise WorkloadError(f"{where}{column} is empty")
    return value


def _check_header(path: Path, header: list[str]) -> None:
    if header == OPENB_COLUMNS:
        return
    missing = [c for c in OPENB_COLUMNS if c not in header]
    unexpected = [c for c in header if c not in OPENB_COLUMNS]
    problems = [f"missing columns: {', '.join(missing)}"] if missing else []
    problems += [f"unexpected columns: {', '.join(unexpected)}"] if unexpected else []
    problems = problems or [f"columns out of order, expected: {','.join(OPENB_COLUMNS)}"]
    raise WorkloadError(f"{path}:1: not an openb pod list header: {'; '.join(problems)}")


def _parse_row(path: Path, line: int, fields: list[str], sizes: Sequence[MigSize]) -> _Row | None:
    where, count = f"{path}:{line}: ", len(OPENB_COLUMNS)
    if len(fields) != count:
        lacking = ", ".join(OPENB_COLUMNS[len(fields) :])
        what = f"missing {lacking}" if lacking else f"extra fields after {OPENB_COLUMNS[-1]}"
        raise WorkloadError(f"{where}{len(fields)} fields, expected {count} ({what})")
    row = dict(zip(OPENB_COLUMNS, fields, strict=True))
    if not (name := row["name"].strip()):
        raise WorkloadError(f"{where}name is empty")
    number = {c: _required(where, c, row[c]) for c in OPENB_COLUMNS[1:5]}
    creation = _required(where, "creation_time", row["creation_time"])
    deletion = _integer(where, "deletion_time", row["deletion_time"])
    scheduled = _integer(where, "scheduled_time", row["scheduled_time"])
    num_gpu, gpu_milli = number["num_gpu"], number["gpu_milli"]
    if gpu_milli > 1000:
        raise WorkloadError(f"{where}gpu_milli {gpu_milli} is above 1000 (one whole GPU)")
    if num_gpu == 0:
        return None  # a CPU-only pod: the simulated cluster models GPU nodes only
    lifetime: int | None = None
    if deletion is not None:
        start = creation if scheduled is None else scheduled
        column = "creation_time" if scheduled is None else "scheduled_time"
        if (lifetime := deletion - start) < 0:
            raise WorkloadError(f"{where}deletion_time {deletion} is before {column} {start}")
    fractional = num_gpu == 1 and 1 <= gpu_milli <= 999
    try:
        profile = mig_profile_for(gpu_milli, sizes).profile if fractional and sizes else None
    except WorkloadError as error:
        raise WorkloadError(f"{where}gpu_milli: {error}") from None
    pod = PodRequest(
        name=name,
        arrival=0.0,
        lifetime=None if lifetime is None else float(lifetime),
        cpu_milli=number["cpu_milli"],
        memory_mib=number["memory_mib"],
        gpus=0 if fractional else num_gpu,
        gpu_milli=gpu_milli if fractional else 1000,
        mig_profile=profile,
        constraint="none",
    )
    return (creation, name, line, pod)


def _read_rows(path: Path, sizes: Sequence[MigSize]) -> list[_Row]:
    rows: list[_Row] = []
    lines: dict[str, int] = {}
    with path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle)
        try:
            if (header := next(reader, None)) is None:
                raise WorkloadError(f"{path}: no GPU pods: the file is empty")
            _check_header(path, header)
            for fields in reader:  # csv yields [] for a blank line: skipped
                if fields and (row := _parse_row(path, reader.line_num, fields, sizes)):
                    if (seen := lines.setdefault(row[1], row[2])) != row[2]:
                        raise WorkloadError(f"{path}:{row[2]}: name {row[1]} repeats line {seen}")
                    rows.append(row)
        except csv.Error as error:
            raise WorkloadError(f"{path}:{reader.line_num}: {error}") from None
    return rows


def read_openb(path: Path, sizes: Sequence[MigSize]) -> list[PodRequest]:
    """The GPU pods of an ``openb_pod_list_*.csv``, by creation time then name.

    Arrivals count from the first GPU pod's creation. A lifetime runs from scheduling
    (from creation when the pod was never scheduled) to deletion; a pod never deleted
    runs forever (None).
    """
    try:
        rows = sorted(_read_rows(path, sizes))
    except (OSError, UnicodeDecodeError) as error:
        raise WorkloadError(f"{path}: cannot read: {error}") from error
    if not rows:
        raise WorkloadError(f"{path}: no GPU pods (only a header or CPU-only rows)")
    first = rows[0][0]
    return [replace(pod, arrival=float(creation - first)) for creation, _, _, pod in rows]


def write_openb(path: Path, pods: Sequence[PodRequest]) -> None:
    """Write ``pods`` as an ``openb_pod_list`` CSV (times rounded to whole seconds).

    Constraints are lost (the format has no topology), and so is any arrival offset:
    reading counts arrivals from the first pod.
    """
    try:
        with path.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle, lineterminator="\n")
            writer.writerow(OPENB_COLUMNS)
            for pod in pods:
                creation = round(pod.arrival)
                deletion = "" if pod.lifetime is None else creation + round(pod.lifetime)
                head = (pod.name, pod.cpu_milli, pod.memory_mib, pod.gpus or 1, pod.gpu_milli)
                writer.writerow((*head, "", "LS", "Running", creation, deletion, creation))
    except OSError as error:
        raise WorkloadError(f"{path}: cannot write: {error}") from error
