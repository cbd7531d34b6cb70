"""The control socket's wire format: one JSON object per line each way, and its path.

Kept free of heavy imports: the CLI's ``configure_parser`` and the client use it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONTROL_SOCKET_NAME = "sim-control.sock"
MAX_LINE = 64 * 1024
OPERATIONS = ("xid", "ecc", "gpu-lost", "recover", "destroy-gpu-instance")


def control_socket_path(plugin_dir: Path) -> Path:
    """Where an agent whose data directory is ``plugin_dir`` listens in simulate mode."""
    return plugin_dir / CONTROL_SOCKET_NAME


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """One message; raises ValueError when it is not a JSON object."""
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("a control message must be a JSON object")
    return message
