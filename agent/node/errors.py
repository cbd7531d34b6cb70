"""Errors of the node layer: files on the node, the node lock, the checkpoint.

Each message names the file involved and what an operator can do, because these errors
surface as a failed prepare in a pod's events, far from the node where they happened.
"""

from __future__ import annotations

from pathlib import Path

from agent.errors import AgentError


class NodeError(AgentError):
    """Base class of errors raised while reading or writing the node's state."""


class LockTimeout(NodeError):
    """The node lock is held by another process (usually a second agent instance)."""

    def __init__(self, path: Path, timeout: float, holder_pid: int | None) -> None:
        self.path = path
        self.holder_pid = holder_pid
        holder = f"process {holder_pid}" if holder_pid is not None else "an unknown process"
        super().__init__(
            f"could not take the node lock {path} within {timeout:g} s: it is held by {holder}. "
            "Another gpu-dra-agent instance on this node (a rolling upgrade) is preparing or "
            "unpreparing claims; if that process is gone or hung, stop it and retry"
        )


class CheckpointFormatError(NodeError):
    """A checkpoint document is not valid; the message gives the JSON path of the problem."""


class CdiFileError(NodeError):
    """A CDI spec file could not be written, read or removed."""
