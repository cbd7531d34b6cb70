"""``gpu-dra-agent sim state``: the simulated host's GPUs, MIG mode, compute mode and MIG
instances.

It reads the state file the simulated NVML library keeps under the agent's plugin directory
(``agent.hardware.simulated.persist``), not the running agent, so it also answers while the
agent is down, for example right after a ``kill -9``: what it prints is what a restarted agent
will find, as ``nvidia-smi mig -lgi -lci`` would on a real host. The compute mode column uses
``nvidia-smi``'s names (``Default``, ``E. Process`` while an MPS daemon has the GPU,
``Prohibited``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from agent.config import SIMULATED_HOST_DIR
from agent.hardware.simulated.persist import state_path
from agent.sim.control.commands import DEFAULT_DRIVER_NAME, DEFAULT_PLUGINS_DIR


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugins-dir",
        help="the agent's kubelet plugins directory [KUBELET_PLUGINS_DIRECTORY_PATH] "
        f"(default: {DEFAULT_PLUGINS_DIR})",
    )
    parser.add_argument(
        "--driver-name", default=DEFAULT_DRIVER_NAME, help=f"default: {DEFAULT_DRIVER_NAME}"
    )
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table")


def read_state(plugins_dir: Path, driver: str) -> dict[str, Any]:
    """The saved state document; raises ``FileNotFoundError`` when no simulated host ran."""
    path = state_path(plugins_dir / driver / SIMULATED_HOST_DIR)
    document: dict[str, Any] = json.loads(path.read_text())
    return document


#: ``NVML_COMPUTEMODE_*`` values as ``nvidia-smi`` prints them.
COMPUTE_MODES = {0: "Default", 1: "E. Thread", 2: "Prohibited", 3: "E. Process"}


def compute_mode_name(value: object) -> str:
    if isinstance(value, int) and value in COMPUTE_MODES:
        return COMPUTE_MODES[value]
    return f"mode {value}"


def format_table(document: dict[str, Any]) -> str:
    lines = ["GPU  MINOR  UUID                                      MIG   COMPUTE     INSTANCES"]
    for gpu in document.get("gpus", []):
        mode = "on" if gpu.get("migMode") else "off"
        if not gpu.get("migCapable"):
            mode = "n/a"
        compute = compute_mode_name(gpu.get("computeMode", 0))
        instances = gpu.get("gpuInstances", [])
        lines.append(
            f"{gpu['index']:<4} {gpu['minor']:<6} {gpu['uuid']:<41} {mode:<5} {compute:<11} "
            f"{len(instances)}"
        )
        for gi in instances:
            cis = gi.get("computeInstances", [])
            ci_text = ", ".join(f"CI {ci['id']} {ci['uuid']}" for ci in cis) or "no CI"
            busy = " busy" if gi.get("busy") else ""
            lines.append(
                f"       GI {gi['id']:<3} {gi['profile']:<12} placement {gi['start']}+{gi['size']}"
                f"{busy}: {ci_text}"
            )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> int:
    return show(args)


def show(args: argparse.Namespace) -> int:
    plugins = args.plugins_dir or os.environ.get("KUBELET_PLUGINS_DIRECTORY_PATH")
    directory = Path(plugins or DEFAULT_PLUGINS_DIR).absolute()
    try:
        document = read_state(directory, args.driver_name)
    except FileNotFoundError:
        print(
            f"no simulated host under {directory / args.driver_name / SIMULATED_HOST_DIR}; "
            "start the agent with --simulate first",
            file=sys.stderr,
        )
        return 1
    if args.output == "json":
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        print(format_table(document))
    return 0
