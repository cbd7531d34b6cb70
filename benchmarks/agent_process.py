"""Starting the real agent process the way the benchmarks measure it: ``gpu-dra-agent run``
on a simulated profile, against an embedded API server and a kubelet emulator's directories
under one base folder, its output in a log file there."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
from anyio.abc import Process


def agent_command(base: Path, kubeconfig: Path, node: str, profile: str, *extra: str) -> list[str]:
    """``gpu-dra-agent run --simulate PROFILE`` with its directories under ``base``."""
    return [
        sys.executable, "-m", "agent", "run", "--simulate", profile,
        "--node-name", node, "--kubeconfig", str(kubeconfig),
        "--registrar-dir", str(base / "registry"), "--plugins-dir", str(base / "plugins"),
        "--cdi-root", str(base / "cdi"), "--log-level", "warning", *extra,
    ]  # fmt: skip


async def start_agent(command: list[str], log_path: Path) -> Process:
    """Start ``command`` with its output in ``log_path``; the settings come from its flags
    alone (a ``NODE_NAME`` or ``KUBECONFIG`` of the caller's environment would override)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "KUBECONFIG")}
    with log_path.open("wb") as log_file:
        return await anyio.open_process(command, stdout=log_file, stderr=log_file, env=environ)
