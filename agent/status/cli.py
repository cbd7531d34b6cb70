"""Show what the agent believes about this node and whether the hardware agrees:
``gpu-dra-agent status`` (exit 0 consistent, 1 drift, 2 cannot read).

Read-only and lock-free, so it is safe while the agent runs and answers while it is down
(docs/OPERATIONS.md, "Status and drift"). Per GPU: model, UUID, health taints, prepared
claims, MIG instances (the agent's or static), sharing and the MPS daemon; the ComputeDomains
and their IMEX daemon; then one DRIFT line per disagreement, each with what to do.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from agent.config import (
    DEFAULT_API_TIMEOUT_S,
    DEFAULT_CDI_ROOT,
    DEFAULT_DRIVER_NAME,
    DEFAULT_PLUGINS_DIR,
    SIMULATED_HOST_DIR,
)
from agent.errors import AgentError
from agent.hardware.hostfiles import HostFiles
from agent.imex.config import DRIVER as CHANNEL_DRIVER
from agent.status import collect
from agent.status.collect_live import read_api, read_hardware, read_health
from agent.status.drift import find_drift
from agent.status.model import (
    AgentView,
    CannotRead,
    CdiView,
    CheckpointView,
    ImexView,
    MpsDaemonView,
    Snapshot,
)
from agent.status.render import render, report
from agent.switches import add_switch

CONSISTENT, DRIFT, CANNOT_READ = 0, 1, 2
#: ``--watch`` redraws this often.
WATCH_INTERVAL_S = 2.0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    kubeconfig = env("KUBECONFIG")
    add = parser.add_argument
    add(
        "--plugins-dir",
        type=Path,
        default=Path(env("KUBELET_PLUGINS_DIRECTORY_PATH") or DEFAULT_PLUGINS_DIR),
        help="the agent's kubelet plugins directory [KUBELET_PLUGINS_DIRECTORY_PATH] "
        f"(default: {DEFAULT_PLUGINS_DIR})",
    )
    add(
        "--cdi-root",
        type=Path,
        default=Path(env("CDI_ROOT") or DEFAULT_CDI_ROOT),
        help=f"the CDI spec directory [CDI_ROOT] (default: {DEFAULT_CDI_ROOT})",
    )
    add("--driver-name", default=DEFAULT_DRIVER_NAME, help=f"default: {DEFAULT_DRIVER_NAME}")
    add(
        "--simulate",
        metavar="PROFILE",
        default=env("GPU_DRA_SIMULATE") or None,
        help="the agent runs on a simulated host of this profile: read its saved state "
        "[GPU_DRA_SIMULATE]; default: the real NVIDIA driver through NVML",
    )
    add(
        "--host-root",
        type=Path,
        help="where the host's /proc and /sys are (default: /, or the simulated host's root)",
    )
    add(
        "--kubeconfig",
        type=Path,
        default=Path(kubeconfig) if kubeconfig else None,
        help="read the published slices, claims and ComputeDomains with this kubeconfig "
        "[KUBECONFIG]; in a pod the service account is used; else the API is not read",
    )
    add(
        "--node-name",
        default=env("NODE_NAME") or socket.gethostname().lower(),
        help="this node's name, the slices' pool [NODE_NAME] (default: host name)",
    )
    add(
        "--namespace",
        default=env("POD_NAMESPACE") or "gpu-dra-agent",
        help="the agent's namespace, where its ComputeDomainCliques (domain membership) live "
        "[POD_NAMESPACE] (default: gpu-dra-agent)",
    )
    add(
        "--api-timeout-seconds",
        type=float,
        default=DEFAULT_API_TIMEOUT_S,
        metavar="SECONDS",
        help=f"bound of each API call (default: {DEFAULT_API_TIMEOUT_S:g})",
    )
    add("-o", "--output", choices=["table", "json", "yaml"], default="table")
    add_switch(
        parser,
        "watch",
        default=False,
        help=f"redraw every {WATCH_INTERVAL_S:g} s until interrupted",
    )


def _uses_api(args: argparse.Namespace) -> bool:
    return args.kubeconfig is not None or bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


@dataclass(frozen=True)
class _Local:
    """What the node's own files say (read in a worker thread)."""

    host_root: Path
    agent: AgentView
    checkpoint: CheckpointView
    cdi: CdiView
    mps: tuple[MpsDaemonView, ...]
    imex: ImexView | None


def _read_local(args: argparse.Namespace) -> _Local:
    from agent.telemetry.tracing import agent_version

    plugins = Path(args.plugins_dir).absolute()
    cdi_root = Path(args.cdi_root).absolute()
    plugin_dir = plugins / args.driver_name
    host_root = args.host_root or (
        plugin_dir / SIMULATED_HOST_DIR if args.simulate is not None else Path("/")
    )
    loaded = collect.read_checkpoint(plugin_dir, HostFiles(host_root).boot_id())
    return _Local(
        host_root,
        collect.agent_state(plugin_dir, agent_version()),
        loaded,
        collect.read_cdi(cdi_root, args.driver_name, loaded.checkpoint),
        collect.read_mps(plugin_dir, loaded.checkpoint),
        collect.read_imex(plugins, cdi_root),
    )


async def snapshot(args: argparse.Namespace) -> Snapshot:
    """Read every source once; raises ``CannotRead``."""
    local = await anyio.to_thread.run_sync(_read_local, args)
    hardware = await read_hardware(args.simulate, local.host_root)
    api = None
    if _uses_api(args):
        checkpoint = local.checkpoint.checkpoint
        claims = checkpoint.claims.values() if checkpoint is not None else ()
        api = await read_api(
            args.kubeconfig,
            args.node_name,
            args.driver_name,
            CHANNEL_DRIVER,
            [(c.uid, c.namespace, c.name) for c in claims],
            args.api_timeout_seconds,
            namespace=args.namespace,
        )
    health = await read_health(Path(local.agent.socket)) if local.agent.socket else None
    return Snapshot(
        args.node_name,
        args.driver_name,
        local.agent,
        local.checkpoint,
        local.cdi,
        hardware,
        local.mps,
        local.imex,
        api,
        health,
    )


async def once(args: argparse.Namespace) -> tuple[int, str]:
    """(exit status, what to print)."""
    try:
        taken = await snapshot(args)
    except (CannotRead, AgentError) as error:
        return CANNOT_READ, f"status: cannot read: {error}"
    findings = find_drift(taken)
    text = render(report(taken, findings), args.output)
    return (DRIFT if findings else CONSISTENT), text


async def run(args: argparse.Namespace) -> int:
    while True:
        status, text = await once(args)
        if args.watch:
            stamp = time.strftime("%H:%M:%S")
            sys.stdout.write(f"\x1b[H\x1b[2J{stamp}  every {WATCH_INTERVAL_S:g} s\n")
        stream = sys.stderr if status == CANNOT_READ else sys.stdout
        print(text, file=stream, flush=True)
        if not args.watch:
            return status
        await anyio.sleep(WATCH_INTERVAL_S)
