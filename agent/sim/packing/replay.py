"""Replay a pod stream on a simulated cluster under one model and one node scoring.

Each pod goes through what kube-scheduler's default profile does with it:

* **Filter**: the nodes with room for its CPU and memory requests (NodeResourcesFit) on
  which the model can place it (for DRA: the allocator finds an allocation on the node).
* **Score**: NodeResourcesFit's ``LeastAllocated`` (the default) or ``MostAllocated`` on the
  pod's CPU and memory, in the scheduler's integer arithmetic (0-100 per resource, then the
  weighted mean, weights 1); claims are invisible to node scoring (round4-anchors.md §1a).
* **Select**: the best score; ties broken at random from the replay's seed.

Without departures the replay places arrivals one by one until the stream ends (the stream
stops once the arrived demand reaches ``--load`` times the capacity); a pod no node can
take is refused for good (nothing will free up). With departures each placed pod leaves at
its arrival plus its lifetime, and a refused pod is counted as not accepted.

A node's answer for a pod shape cannot change until something is placed on it or leaves it,
so answers are remembered per node until then: the outcome is the same as asking every node
every time, at a fraction of the cost. The allocation latency is measured apart, as the
scheduler pays it: for a sample of the pods, every node asked afresh.
"""

from __future__ import annotations

import heapq
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal, TextIO

from agent.sim.packing.cluster import GpuInfo, NodeTemplate
from agent.sim.packing.models import Model, Placement
from agent.sim.packing.workload import PodRequest

Scoring = Literal["least-allocated", "most-allocated"]
SCORINGS: tuple[Scoring, ...] = ("least-allocated", "most-allocated")
MAX_NODE_SCORE = 100


@dataclass
class Capacity:
    cpu_milli: int
    memory_mib: int


@dataclass
class Result:
    """What one (model, scoring) replay measured; fractions of the cluster's GPU compute."""

    model: str
    scoring: Scoring
    arrived: int = 0
    placed: int = 0
    allocation_rate: float = 0.0
    internal_waste: float = 0.0
    unusable: float = 0.0
    stranded_at_first_rejection: float | None = None
    first_rejection: str | None = None  # the pod, its request
    acceptance: float = 0.0
    multi_gpu_placed: int = 0
    #: of the placed multi-GPU pods a NUMA node can hold (no more GPUs than it has)
    within_numa: float | None = None
    within_nvlink: float | None = None
    latency_ms_p50: float | None = None
    latency_ms_p99: float | None = None
    latency_samples: int = 0
    seconds: float = 0.0


@dataclass
class _Node:
    free_cpu: int
    free_memory: int
    version: int = 0
    #: pod shape -> (node version it was asked at, the answer)
    answers: dict[tuple[Any, ...], tuple[int, Placement | None]] = field(default_factory=dict)


def _score(requested: int, capacity: int, scoring: Scoring) -> int:
    if capacity <= 0 or requested > capacity:
        return 0
    if scoring == "least-allocated":
        return (capacity - requested) * MAX_NODE_SCORE // capacity
    return requested * MAX_NODE_SCORE // capacity


def replay(
    model: Model,
    pods: Sequence[PodRequest],
    *,
    template: NodeTemplate,
    nodes: int,
    node: Capacity,
    scoring: Scoring,
    seed: int,
    departures: bool = False,
    latency_samples: int = 48,
    progress: TextIO | None = None,
) -> Result:
    started = time.perf_counter()
    rng = random.Random(seed)
    state = [_Node(node.cpu_milli, node.memory_mib) for _ in range(nodes)]
    total = Fraction(nodes * len(template.gpus))
    result = Result(model.name, scoring)
    active: dict[str, tuple[PodRequest, Placement]] = {}
    leaving: list[tuple[float, int, str]] = []
    allocated = asked = Fraction(0)
    sample_every = max(1, len(pods) // latency_samples) if latency_samples > 0 else 0
    latencies: list[float] = []
    gpu_info = {gpu.minor: gpu for gpu in template.gpus}
    within_numa = within_nvlink = numa_eligible = 0
    numas = [gpu.numa for gpu in template.gpus]
    per_numa = max((numas.count(n) for n in set(numas) if n is not None), default=0)

    def release(name: str) -> None:
        nonlocal allocated, asked
        pod, placement = active.pop(name)
        model.release(placement)
        held = state[placement.node]
        held.free_cpu += pod.cpu_milli
        held.free_memory += pod.memory_mib
        held.version += 1
        allocated -= placement.allocated
        asked -= Fraction(pod.compute_milli, 1000)

    for number, pod in enumerate(pods):
        while departures and leaving and leaving[0][0] <= pod.arrival:
            release(heapq.heappop(leaving)[2])
        result.arrived += 1
        feasible = _filter(model, pod, state)
        if sample_every and number % sample_every == 0:  # after: the selectors' cache is warm
            latencies.append(_fresh_filter_ms(model, pod, state))
        if progress is not None and number % 25 == 0:
            progress.write(f"\r  {model.name} / {scoring}: {number}/{len(pods)} pods")
            progress.flush()
        if not feasible:
            if result.first_rejection is None:
                result.first_rejection = f"{pod.name} ({_request_text(pod)})"
                result.stranded_at_first_rejection = float((total - allocated) / total)
            continue
        best = _select(feasible, pod, state, node, scoring, rng)
        model.commit(best)
        held = state[best.node]
        held.free_cpu -= pod.cpu_milli
        held.free_memory -= pod.memory_mib
        held.version += 1
        active[pod.name] = (pod, best)
        allocated += best.allocated
        asked += Fraction(pod.compute_milli, 1000)
        result.placed += 1
        if len(best.gpus) > 1:
            result.multi_gpu_placed += 1
            infos = [gpu_info.get(minor) for minor in best.gpus]
            if len(best.gpus) <= per_numa:  # one that a NUMA node can hold at all
                numa_eligible += 1
                within_numa += _same(infos, "numa")
            within_nvlink += _same(infos, "nvlink_domain")
        if departures and pod.lifetime is not None:
            heapq.heappush(leaving, (pod.arrival + pod.lifetime, number, pod.name))
    if progress is not None:
        progress.write("\r" + " " * 60 + "\r")
        progress.flush()
    result.allocation_rate = float(allocated / total)
    result.internal_waste = float((allocated - asked) / total)
    result.unusable = float(1 - asked / total)
    result.acceptance = result.placed / result.arrived if result.arrived else 0.0
    if numa_eligible:
        result.within_numa = within_numa / numa_eligible
    if result.multi_gpu_placed:
        result.within_nvlink = within_nvlink / result.multi_gpu_placed
    if latencies:
        result.latency_samples = len(latencies)
        result.latency_ms_p50 = statistics.median(latencies)
        result.latency_ms_p99 = _percentile(latencies, 0.99)
    result.seconds = time.perf_counter() - started
    return result


def _fits_resources(pod: PodRequest, node: _Node) -> bool:
    return pod.cpu_milli <= node.free_cpu and pod.memory_mib <= node.free_memory


def _filter(model: Model, pod: PodRequest, state: list[_Node]) -> list[Placement]:
    shape = (pod.gpus, pod.gpu_milli, pod.mig_profile, pod.constraint)
    feasible = []
    for index, node in enumerate(state):
        if not _fits_resources(pod, node):
            continue
        known = node.answers.get(shape)
        if known is not None and known[0] == node.version:
            answer = known[1]
        else:
            answer = model.try_node(index, pod)
            node.answers[shape] = (node.version, answer)
        if answer is not None:
            feasible.append(answer)
    return feasible


def _fresh_filter_ms(model: Model, pod: PodRequest, state: list[_Node]) -> float:
    """The allocator's cost for this pod: every node with room asked afresh (which devices
    the pod shape's selectors select is remembered across pods: evaluating CEL in Python is
    this emulator's cost, not the scheduler's, which compiles and evaluates it in Go)."""
    started = time.perf_counter()
    for index, node in enumerate(state):
        if _fits_resources(pod, node):
            model.try_node(index, pod)
    return (time.perf_counter() - started) * 1000


def _select(
    feasible: list[Placement],
    pod: PodRequest,
    state: list[_Node],
    capacity: Capacity,
    scoring: Scoring,
    rng: random.Random,
) -> Placement:
    best: list[Placement] = []
    top = -1
    for placement in feasible:
        node = state[placement.node]
        cpu = _score(
            capacity.cpu_milli - node.free_cpu + pod.cpu_milli, capacity.cpu_milli, scoring
        )
        memory = _score(
            capacity.memory_mib - node.free_memory + pod.memory_mib, capacity.memory_mib, scoring
        )
        score = (cpu + memory) // 2
        if score > top:
            top, best = score, [placement]
        elif score == top:
            best.append(placement)
    return best[0] if len(best) == 1 else rng.choice(best)


def _same(infos: list[GpuInfo | None], attribute: str) -> int:
    values = {getattr(info, attribute, None) if info else None for info in infos}
    return int(len(values) == 1 and None not in values)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _request_text(pod: PodRequest) -> str:
    if pod.gpus:
        return (
            f"{pod.gpus} GPU"
            + ("s" if pod.gpus > 1 else "")
            + (f", {pod.constraint}" if pod.constraint != "none" else "")
        )
    return f"{pod.gpu_milli} milli -> {pod.mig_profile}"


def stderr_progress() -> TextIO | None:
    return sys.stderr if sys.stderr.isatty() else None
