"""Shared options and the run step of ``gpu-dra-agent sim xid|ecc|gpu-lost|recover``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from agent.sim.control.protocol import control_socket_path

DEFAULT_PLUGINS_DIR = "/var/lib/kubelet/plugins"
DEFAULT_DRIVER_NAME = "gpu.nvidia.com"
#: Seconds to wait for an agent that is still starting (its engine runs a few seconds in).
DEFAULT_WAIT = 30.0


def add_target(parser: argparse.ArgumentParser) -> None:
    """The options that find the agent and the GPU (cheap: nothing heavy imported)."""
    parser.add_argument(
        "--plugins-dir",
        help="the agent's kubelet plugins directory [KUBELET_PLUGINS_DIRECTORY_PATH] "
        f"(default: {DEFAULT_PLUGINS_DIR})",
    )
    parser.add_argument(
        "--driver-name", default=DEFAULT_DRIVER_NAME, help=f"default: {DEFAULT_DRIVER_NAME}"
    )
    parser.add_argument("--gpu", required=True, metavar="INDEX|UUID", help="the GPU to act on")
    parser.add_argument(
        "--wait",
        type=_seconds,
        default=DEFAULT_WAIT,
        metavar="SECONDS",
        help="how long to wait for the agent's control socket while the agent is still "
        "starting (it opens once the prepare engine runs); 0: try once "
        f"(default: {DEFAULT_WAIT:g})",
    )


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return seconds


def socket_path(args: argparse.Namespace) -> Path:
    plugins = args.plugins_dir or os.environ.get("KUBELET_PLUGINS_DIRECTORY_PATH")
    return control_socket_path(Path(plugins or DEFAULT_PLUGINS_DIR).absolute() / args.driver_name)


async def run_request(args: argparse.Namespace, request: dict[str, Any]) -> int:
    """Send the request to the agent and print what it did; the exit status."""
    from agent.sim.control.client import send_request

    reply = await send_request(socket_path(args), {"gpu": args.gpu, **request}, wait=args.wait)
    delivered = (
        f", {reply['delivered']} event(s) delivered" if request["op"] in ("xid", "ecc") else ""
    )
    print(f"{reply['op']} on GPU {reply['gpu']} ({reply['uuid']}){delivered}", file=sys.stdout)
    return 0
