"""``gpu-dra-agent sim packing``: how much GPU capacity a cluster strands, per placement model.

A cluster of ``--nodes`` simulated ``--profile`` hosts is offered a pod stream (the seed's
mix, or an openb-format trace the user supplies) until the arrived demand reaches ``--load``
times its GPU capacity. Each model places the same pods with the same seed, under each node
scoring asked for, side by side: device plugins (whole GPUs; a static MIG layout) against
DRA with dynamic MIG in the incumbent's device order and in this agent's packing order. The
DRA models publish exactly what ``gpu-dra-agent run --dynamic-mig`` publishes and allocate
with the embedded allocator, first fit by the 1.36 rules. Metrics, models and the JSON
schema: docs/PERFORMANCE.md, "Packing".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from agent.errors import AgentError
from agent.sim.packing.cluster import NodeTemplate, load_template, node_names
from agent.sim.packing.models import ALL_BALANCED_H100, MODEL_NAMES, build_models
from agent.sim.packing.replay import SCORINGS, Capacity, Result, Scoring, replay, stderr_progress
from agent.sim.packing.workload import (
    PodRequest,
    WorkloadError,
    read_openb,
    seed_workload,
    until_load,
)

SCHEMA_VERSION = 1
SCHEMA_FILE = "result.schema.json"
#: The seed generator's mean gap between arrivals (its default).
MEAN_INTERARRIVAL_S = 60.0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  gpu-dra-agent sim packing                      # 32 x dgx-h100, the seed's mix\n"
        "  gpu-dra-agent sim packing --workload openb:openb_pod_list_default.csv\n"
        "  gpu-dra-agent sim packing --node-scoring most-allocated --departures on -o json\n"
    )
    add = parser.add_argument
    add("--profile", default="dgx-h100", help="node hardware: a shipped profile or a profile "
        "file (default: dgx-h100)")  # fmt: skip
    add("--nodes", type=int, default=32, help="nodes in the cluster (default: 32)")
    add(
        "--workload",
        default="seed",
        metavar="seed|openb:FILE",
        help="seed: the built-in seeded mix (training jobs of 1-8 GPUs with NUMA/NVLink "
        "constraints, MIG-sized inference); openb:FILE: a CSV in the format of Alibaba's "
        "cluster-trace-gpu-v2023 openb_pod_list files (not shipped: research use only; bring "
        "your own copy) (default: seed)",
    )
    add("--load", type=float, default=1.3, help="stop arrivals once the arrived GPU demand "
        "reaches this many times the capacity (default: 1.3)")  # fmt: skip
    add(
        "--seed",
        type=int,
        default=1,
        help="seed of the workload and of node tie-breaks (default: 1)",
    )
    add(
        "--models",
        default=",".join(MODEL_NAMES),
        help=f"comma-separated, of {', '.join(MODEL_NAMES)} (default: all)",
    )
    add(
        "--node-scoring",
        choices=[*SCORINGS, "both"],
        default="both",
        help="NodeResourcesFit scoring of the scheduler profile: least-allocated (the "
        "default profile's), most-allocated (bin packing, an administrator's choice), or both "
        "(default: both)",
    )
    add("--departures", choices=["off", "on"], default="off",
        help="on: placed pods leave after their lifetime (the seed's lifetimes are scaled so "
        "that the offered load in steady state is --load); off: arrivals only (default: off)")  # fmt: skip
    add("--consumable-shares", default="disabled", metavar="MODE",
        help="the DRA models publish as run --consumable-shares MODE (default: disabled)")  # fmt: skip
    add("--static-layout", default=",".join(ALL_BALANCED_H100),
        help="device-plugin-static-mig: the MIG instances of every GPU (default: the GPU "
        f"operator's all-balanced for H100 80GB, {','.join(ALL_BALANCED_H100)})")  # fmt: skip
    add("--node-cpus", type=int, default=224, help="allocatable CPUs of a node (default: 224)")
    add("--node-memory-gib", type=int, default=2048, help="allocatable memory (default: 2048)")
    add("--latency-samples", type=int, default=48,
        help="pods whose allocation is timed over every node afresh (default: 48)")  # fmt: skip
    add("-o", "--output", choices=["table", "json"], default="table")


async def run(args: argparse.Namespace) -> int:
    from agent.dra.share_mode import parse_mode

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODEL_NAMES]
    if unknown or not models:
        raise AgentError(f"--models: unknown {unknown}; choose from {', '.join(MODEL_NAMES)}")
    if args.nodes < 1 or args.load <= 0:
        raise AgentError("--nodes must be at least 1 and --load above 0")
    shares = parse_mode(args.consumable_shares)  # an AgentError names what is wrong
    template = await load_template(args.profile, dynamic_mig=True, shares=shares)
    if not template.sizes and "device-plugin-static-mig" in models:
        models.remove("device-plugin-static-mig")
        print(
            f"sim packing: {args.profile} has no MIG-capable GPU: no static MIG model, and "
            "fractional requests take whole GPUs",
            file=sys.stderr,
        )
        if not models:
            raise AgentError("--models: nothing left to compare")
    pods = _workload(args, template)
    scorings: list[Scoring] = list(SCORINGS) if args.node_scoring == "both" else [args.node_scoring]
    names = node_names(args.nodes)
    capacity = Capacity(args.node_cpus * 1000, args.node_memory_gib * 1024)
    layout = [p.strip() for p in args.static_layout.split(",") if p.strip()]
    started = time.perf_counter()
    results: list[Result] = []
    progress = stderr_progress()
    for scoring in scorings:
        try:
            built = build_models(models, template, names, layout)
        except ValueError as error:
            raise AgentError(str(error)) from None
        for model in built:
            results.append(
                replay(
                    model,
                    pods,
                    template=template,
                    nodes=args.nodes,
                    node=capacity,
                    scoring=scoring,
                    seed=args.seed,
                    departures=args.departures == "on",
                    latency_samples=args.latency_samples,
                    progress=progress,
                )
            )
    document = _document(args, template, pods, results, time.perf_counter() - started)
    if args.output == "json":
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        sys.stdout.write(format_table(document))
    return 0


def _workload(args: argparse.Namespace, template: NodeTemplate) -> list[PodRequest]:
    capacity = args.nodes * template.gpu_count
    try:
        if args.workload == "seed":
            return _seed(args, template, capacity)
        if args.workload.startswith("openb:"):
            trace = read_openb(Path(args.workload.removeprefix("openb:")), template.sizes)
            return until_load(trace, capacity_gpus=capacity, load=args.load)
    except WorkloadError as error:
        raise AgentError(f"--workload: {error}") from None
    raise AgentError(f"--workload {args.workload!r}: use seed or openb:FILE")


def _seed(args: argparse.Namespace, template: NodeTemplate, capacity: int) -> list[PodRequest]:
    def generate(mean_lifetime_s: float) -> list[PodRequest]:
        return seed_workload(
            capacity_gpus=capacity,
            load=args.load,
            seed=args.seed,
            sizes=template.sizes,
            mean_interarrival_s=MEAN_INTERARRIVAL_S,
            mean_lifetime_s=mean_lifetime_s,
            gpus_per_node=template.gpu_count,
        )

    pods = generate(3600.0)
    if args.departures == "off":
        return pods
    # Little's law: the demand in the cluster is arrival rate x lifetime x compute per pod;
    # lifetimes are scaled so that it is --load times the capacity
    mean_compute = sum(p.compute for p in pods) / len(pods)
    scale = args.load * capacity * MEAN_INTERARRIVAL_S / mean_compute / 3600.0
    return [replace(p, lifetime=None if p.lifetime is None else p.lifetime * scale) for p in pods]


def _document(
    args: argparse.Namespace,
    template: NodeTemplate,
    pods: list[PodRequest],
    results: list[Result],
    seconds: float,
) -> dict[str, Any]:
    return {
        "schemaVersion": SCHEMA_VERSION,
        "cluster": {
            "profile": template.profile,
            "nodes": args.nodes,
            "gpusPerNode": template.gpu_count,
            "gpus": args.nodes * template.gpu_count,
            "nodeCpus": args.node_cpus,
            "nodeMemoryGiB": args.node_memory_gib,
        },
        "workload": {
            "source": args.workload,
            "seed": args.seed,
            "load": args.load,
            "pods": len(pods),
            "demandGpus": round(sum(p.compute for p in pods), 3),
            "departures": args.departures == "on",
        },
        "results": [_result_json(r) for r in results],
        "seconds": round(seconds, 2),
    }


def _result_json(result: Result) -> dict[str, Any]:
    def ratio(value: float | None) -> float | None:
        return None if value is None else round(value, 4)

    return {
        "model": result.model,
        "nodeScoring": result.scoring,
        "arrived": result.arrived,
        "placed": result.placed,
        "allocationRate": ratio(result.allocation_rate),
        "internalWaste": ratio(result.internal_waste),
        "unusable": ratio(result.unusable),
        "strandedAtFirstRejection": ratio(result.stranded_at_first_rejection),
        "firstRejection": result.first_rejection,
        "acceptance": ratio(result.acceptance),
        "multiGpuPlaced": result.multi_gpu_placed,
        "withinNumaNode": ratio(result.within_numa),
        "withinNvlinkDomain": ratio(result.within_nvlink),
        "allocationLatencyMs": {
            "p50": None if result.latency_ms_p50 is None else round(result.latency_ms_p50, 3),
            "p99": None if result.latency_ms_p99 is None else round(result.latency_ms_p99, 3),
            "samples": result.latency_samples,
        },
        "seconds": round(result.seconds, 2),
    }


def schema() -> dict[str, Any]:
    """The JSON schema of ``-o json`` (shipped beside this module)."""
    text = resources.files("agent.sim.packing").joinpath(SCHEMA_FILE).read_text()
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def format_table(document: dict[str, Any]) -> str:
    cluster, workload = document["cluster"], document["workload"]
    lines = [
        f"{cluster['nodes']} x {cluster['profile']} ({cluster['gpus']} GPUs); workload "
        f"{workload['source']} (seed {workload['seed']}): {workload['pods']} pods asking "
        f"{workload['demandGpus']:.1f} GPUs ({workload['load']:.2f} x capacity), departures "
        f"{'on' if workload['departures'] else 'off'}",
        "",
        f"{'model':<25} {'node scoring':<16} {'alloc':>6} {'waste':>6} {'unusable':>8} "
        f"{'stranded@1st':>12} {'accepted':>8} {'NUMA':>6} {'NVLink':>6}  alloc ms p50/p99",
    ]
    for r in document["results"]:
        latency = r["allocationLatencyMs"]
        timing = "-" if latency["p50"] is None else f"{latency['p50']:.1f} / {latency['p99']:.1f}"
        lines.append(
            f"{r['model']:<25} {r['nodeScoring']:<16} {_pct(r['allocationRate']):>6} "
            f"{_pct(r['internalWaste']):>6} {_pct(r['unusable']):>8} "
            f"{_pct(r['strandedAtFirstRejection']):>12} {_pct(r['acceptance']):>8} "
            f"{_pct(r['withinNumaNode']):>6} {_pct(r['withinNvlinkDomain']):>6}  {timing}"
        )
    lines += [
        "",
        "alloc: GPU compute allocated; waste: allocated beyond what was asked; unusable: "
        "1 - asked / capacity;",
        "stranded@1st: compute free when the first pod was refused; NUMA / NVLink: multi-GPU "
        "pods within one (see docs/PERFORMANCE.md, Packing)",
        f"({document['seconds']:.1f} s)",
    ]
    return "\n".join(lines) + "\n"
