"""Show what the agent finds on this host and the ResourceSlices it would publish.

``gpu-dra-agent discover`` runs the agent's own discovery (real NVML, or a simulated host
beneath the real pynvml bindings) and the pure DRA model, and prints the result; it changes
nothing and needs no cluster. With ``--dynamic-mig`` it shows what ``run --dynamic-mig``
publishes: every MIG placement of a partitionable GPU as a device, with the counter sets they
share (table), and the slices in the layout ``--slice-layout`` names (yaml, json).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from agent.dra import build_device_set, build_slices
from agent.dra.devices import DeviceSet
from agent.dra.model import DraDevice
from agent.dra.names import parse_mig_device_name
from agent.dra.order import DEVICE_ORDERS
from agent.dra.partitionable import MEMORY_COUNTER, DynamicMig
from agent.dra.quantity import format_quantity
from agent.dra.slices import SLICE_LAYOUTS
from agent.dra.slices import name_for_preview as name_for_preview  # re-exported
from agent.hardware.inventory import Gpu, Inventory
from agent.switches import TRUE_WORDS, add_switch

DEFAULT_DRIVER_NAME = "gpu.nvidia.com"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Discover this host's GPUs and print them with the ResourceSlices the agent would "
        "publish. Read-only: changes nothing on the GPUs and needs no Kubernetes cluster."
    )
    parser.add_argument(
        "--simulate",
        metavar="PROFILE|FILE",
        default=os.environ.get("GPU_DRA_SIMULATE") or None,
        help="use a simulated host: a shipped profile (dgx-h100, dgx-a100, gb200-nvl72-tray, "
        "l40s-pcie, h200-nvl-bridged, big-mig-host) or a profile YAML file "
        "[env GPU_DRA_SIMULATE]; default: the real NVIDIA driver",
    )
    parser.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME") or socket.gethostname().lower(),
        help="Kubernetes node name, also the pool name [env NODE_NAME]; default: host name",
    )
    parser.add_argument(
        "--driver-name",
        default=DEFAULT_DRIVER_NAME,
        help=f"DRA driver name (default: {DEFAULT_DRIVER_NAME})",
    )
    parser.add_argument(
        "--host-root",
        type=Path,
        default=Path("/"),
        help="where the host's /sys and /proc are mounted (default: /)",
    )
    add_switch(
        parser,
        "dynamic-mig",
        default=_env_flag("GPU_DRA_DYNAMIC_MIG"),
        help="show what `run --dynamic-mig` publishes: every MIG placement of a "
        "partitionable GPU as a device sharing the GPU's counters [env GPU_DRA_DYNAMIC_MIG]",
    )
    add_switch(
        parser,
        "adopt-mig-instances",
        default=_env_flag("GPU_DRA_ADOPT_MIG_INSTANCES"),
        help="with --dynamic-mig: treat existing MIG instances as the agent's (their slices "
        "are offered) [env GPU_DRA_ADOPT_MIG_INSTANCES]",
    )
    parser.add_argument(
        "--slice-layout",
        choices=SLICE_LAYOUTS,
        default="split",
        help="with --dynamic-mig: combined (Kubernetes 1.34: counters and devices in one slice "
        "per GPU) or split (1.35+: counters-only slices, then device slices; default)",
    )
    parser.add_argument(
        "--device-order",
        choices=DEVICE_ORDERS,
        default="names",
        help="the order devices are listed in, which first fit follows: names (default, the "
        "incumbent's) or packing",
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=["table", "yaml", "json"],
        default="table",
        help="table: for people; yaml: the ResourceSlices (multi-document); "
        "json: inventory and ResourceSlices (default: table)",
    )


async def run(args: argparse.Namespace) -> int:
    from agent.hardware.discovery import discover_host

    if args.simulate is not None:
        with tempfile.TemporaryDirectory(prefix="gpu-dra-sim-") as root:
            inventory = await discover_host(args.simulate, Path(root))
    else:
        inventory = await discover_host(None, args.host_root)
    dynamic = None
    if args.dynamic_mig:
        dynamic = DynamicMig(adopt=args.adopt_mig_instances)
    device_set = build_device_set(inventory, dynamic_mig=dynamic)
    slices = name_for_preview(
        build_slices(
            device_set.devices,
            node_name=args.node_name,
            driver_name=args.driver_name,
            counter_sets=device_set.counter_sets,
            slice_layout=args.slice_layout,
            device_order=args.device_order,
        )
    )
    out = sys.stdout
    if args.output == "yaml":
        out.write(render_yaml(inventory, slices))
    elif args.output == "json":
        out.write(json.dumps(render_json(inventory, slices), indent=2) + "\n")
    else:
        out.write(render_table(inventory, device_set, slices, args.node_name))
    return 0


def _env_flag(name: str) -> bool:
    return (os.environ.get(name) or "").strip().lower() in TRUE_WORDS


def render_yaml(inventory: Inventory, slices: list[dict[str, Any]]) -> str:
    header = (
        f"# gpu-dra-agent discover: {len(inventory.gpus)} GPU(s), driver "
        f"{inventory.driver_version}, CUDA {inventory.cuda_driver_version}\n"
    )
    return header + yaml.safe_dump_all(slices, sort_keys=False, explicit_start=True)


def render_json(inventory: Inventory, slices: list[dict[str, Any]]) -> dict[str, Any]:
    from dataclasses import asdict

    return {"inventory": asdict(inventory), "resourceSlices": slices}


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f}Gi"


def _mig_state(gpu: Gpu) -> str:
    if not gpu.mig_capable:
        return "not supported"
    if not gpu.mig_enabled:
        return "capable, disabled"
    return f"enabled, {len(gpu.mig_devices)} device(s)"


def _row(device: DraDevice, gpu: Gpu | None) -> list[str]:
    attrs = device.to_dict().get("attributes", {})

    def attr(name: str) -> str:
        value = attrs.get(name)
        if not value:
            return "-"
        return str(next(iter(value.values())))

    memory = device.to_dict().get("capacity", {}).get("memory", {}).get("value", "-")
    kind = attr("type")
    if kind == "mig":
        mig = attr("profile")
        parsed = parse_mig_device_name(device.name)
        if device.consumes_counters and parsed is not None:
            used = sorted(
                int(name.rsplit("-", 1)[1])
                for entry in device.consumes_counters
                for name in entry.counters
                if name.startswith("memory-slice-")
            )
            where = f"s {used[0]}-{used[-1]}" if len(used) > 1 else f" {used[0]}"
            mig += f" @{parsed[3]}, slice{where}, made on prepare"
    elif gpu is not None:
        mig = _mig_state(gpu)
        if device.consumes_counters:
            mig += ", partitionable"
    else:
        mig = "-"
    peers = attr("nvlinkPeerCount")
    return [
        device.name,
        kind,
        attr("productName"),
        str(memory),
        attr("resource.kubernetes.io/numaNode"),
        attr("resource.kubernetes.io/pcieRoot"),
        attr("nvlinkDomain") + ("" if peers == "-" else f" ({peers} peers)"),
        mig,
    ]


def _format_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n"
        for row in rows
    )


def render_table(
    inventory: Inventory, device_set: DeviceSet, slices: list[dict[str, Any]], node_name: str
) -> str:
    by_uuid = {gpu.uuid: gpu for gpu in inventory.gpus}
    rows = [["DEVICE", "TYPE", "MODEL", "MEMORY", "NUMA", "PCIE ROOT", "NVLINK DOMAIN", "MIG"]]
    for device in device_set.devices:
        uuid_attr = device.to_dict().get("attributes", {}).get("uuid", {}).get("string")
        rows.append(_row(device, by_uuid.get(uuid_attr or "")))
    numa = sorted({g.numa_node for g in inventory.gpus if g.numa_node is not None})
    domains = sorted({g.nvlink_domain for g in inventory.gpus if g.nvlink_domain})
    lines = [
        f"Node {node_name}: {len(inventory.gpus)} GPU(s), driver {inventory.driver_version}, "
        f"CUDA {inventory.cuda_driver_version}, {len(numa)} NUMA node(s), "
        f"{len(domains)} NVLink domain(s)\n\n",
        _format_table(rows),
        "\n",
    ]
    for reason in inventory.unreadable_gpus:
        lines.append(f"warning: {reason}; it is not published\n")
    for reason in device_set.unpublished_mig:
        lines.append(f"warning: {reason}\n")
    for uuid in device_set.stranded_gpus:
        gpu = by_uuid.get(uuid)
        name = f"gpu-{gpu.minor}" if gpu else uuid
        lines.append(
            f"warning: {name} has MIG enabled but no MIG devices: its capacity is not offered\n"
        )
    for counter_set in device_set.counter_sets:
        counters = dict(counter_set.counters)
        memory_slices = [name for name in counters if name.startswith("memory-slice-")]
        free = sum(1 for name in memory_slices if counters[name])
        engines = ", ".join(
            f"{name} {counters[name]}"
            for name in counters
            if name != MEMORY_COUNTER and not name.startswith("memory-slice-")
        )
        memory = format_quantity(int(counters.get(MEMORY_COUNTER, 0)))
        lines.append(
            f"counter set {counter_set.name}: {engines}, memory {memory}, "
            f"{free} of {len(memory_slices)} memory slices free\n"
        )
    if device_set.held_back:
        per_gpu: dict[str, list[str]] = {}
        for reason in device_set.held_back:
            per_gpu.setdefault(reason.split("-mig-")[0], []).append(reason)
        for gpu_name, reasons in per_gpu.items():
            lines.append(
                f"note: {gpu_name}: {len(reasons)} MIG placement(s) not offered, static MIG "
                f"instances hold their slices (e.g. {reasons[0]}); --adopt-mig-instances "
                "lets the agent reuse them\n"
            )
    for dropped in device_set.dropped:
        lines.append(
            f"warning: {dropped.device}: attribute {dropped.attribute} not published: {dropped.reason}\n"
        )
    for s in slices:
        spec = s["spec"]
        sets = spec.get("sharedCounters") or []
        shared = f", {len(sets)} counter set(s)" if sets else ""
        lines.append(
            f"ResourceSlice {s['metadata']['generateName']}*: driver {spec['driver']}, pool "
            f"{spec['pool']['name']} (generation {spec['pool']['generation']}, "
            f"{spec['pool']['resourceSliceCount']} slice(s)), "
            f"{len(spec.get('devices') or [])} device(s){shared}\n"
        )
    return "".join(lines)
