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


def socket_path(args: argparse.Namespace) -> Path:
    plugins = args.plugins_dir or os.environ.get("KUBELET_PLUGINS_DIRECTORY_PATH")
    return control_socket_path(Path(plugins or DEFAULT_PLUGINS_DIR).absolute() / args.driver_name)


async def run_request(args: argparse.Namespace, request: dict[str, Any]) -> int:
    """Send the request to the agent and print what it did; the exit status."""
    from agent.sim.control.client import send_request

    reply = await send_request(socket_path(args), {"gpu": args.gpu, **request})
    delivered = (
        f", {reply['delivered']} event(s) delivered" if request["op"] in ("xid", "ecc") else ""
    )
    print(f"{reply['op']} on GPU {reply['gpu']} ({reply['uuid']}){delivered}", file=sys.stdout)
    return 0
