"""Deliberate crash points, so tests can prove that every step of a prepare is recoverable.

The engine's durability argument ("a crash between any two writes is repaired at the next
start") is only worth something if it is exercised. Setting ``GPU_DRA_AGENT_CRASH_AT`` to
one of :data:`CRASH_POINTS` makes the process die with ``os._exit(137)`` (what SIGKILL
looks like to a parent) at that step: no ``finally`` blocks, no flushed buffers, exactly
like a power cut as far as the agent's own files are concerned. The variable is read once
at import; when it is unset :func:`crash_point` is a comparison against ``None``.
"""

from __future__ import annotations

import os
import sys
from typing import Final, Literal, get_args

ENV_VAR: Final = "GPU_DRA_AGENT_CRASH_AT"
#: The steps of every prepare and unprepare (the engine's).
EngineCrashPoint = Literal[
    "after-claim-read",
    "after-prepare-started",
    "after-cdi-write",
    "after-prepare-completed",
    "unprepare-after-cdi-remove",
    "unprepare-after-checkpoint",
]
#: The steps of making a dynamic MIG device (``agent.mig``): its intent is durable, its GPU
#: instance exists, its compute instance exists.
MigCrashPoint = Literal["after-mig-intent", "after-gpu-instance", "after-compute-instance"]
#: The steps of sharing a device (``agent.sharing``): the GPU's compute mode (and time-slice)
#: changed, an MPS control daemon started (its pid recorded).
SharingCrashPoint = Literal["after-compute-mode", "after-mps-daemon-start"]
CrashPoint = Literal[EngineCrashPoint, MigCrashPoint, SharingCrashPoint]
CRASH_POINTS: Final[tuple[EngineCrashPoint, ...]] = get_args(EngineCrashPoint)
MIG_CRASH_POINTS: Final[tuple[MigCrashPoint, ...]] = get_args(MigCrashPoint)
SHARING_CRASH_POINTS: Final[tuple[SharingCrashPoint, ...]] = get_args(SharingCrashPoint)
ALL_CRASH_POINTS: Final[tuple[CrashPoint, ...]] = (
    *CRASH_POINTS,
    *MIG_CRASH_POINTS,
    *SHARING_CRASH_POINTS,
)
EXIT_STATUS: Final = 137


def _armed(value: str | None) -> str | None:
    if not value:
        return None
    if value not in ALL_CRASH_POINTS:
        raise SystemExit(
            f"{ENV_VAR}={value!r} is not a crash point; use one of {', '.join(ALL_CRASH_POINTS)}"
        )
    return value


_ARMED: Final = _armed(os.environ.get(ENV_VAR))


def crash_point(point: CrashPoint) -> None:
    """Die here if ``GPU_DRA_AGENT_CRASH_AT`` names ``point``."""
    if _ARMED is not None and _ARMED == point:
        sys.stderr.write(f"gpu-dra-agent: crashing at {point} ({ENV_VAR})\n")
        sys.stderr.flush()
        os._exit(EXIT_STATUS)
