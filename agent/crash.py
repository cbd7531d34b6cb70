"""Deliberate crash points, so tests can prove that every step of the agent is recoverable.

The engine's durability argument ("a crash between any two writes is repaired at the next
start") is only worth something if it is exercised. Setting ``GPU_DRA_AGENT_CRASH_AT`` to
one of :data:`ALL_CRASH_POINTS` makes the process send itself SIGKILL at that step: no
``finally`` blocks, no flushed buffers, no socket cleanup, exactly like a power cut as far
as the agent's own files are concerned (the page cache aside), and to a parent exactly what
``kill -9`` leaves (:data:`EXIT_STATUS`). Every point is listed here
once; ``tests/integration/test_crash_matrix.py`` enumerates :data:`ALL_CRASH_POINTS` and
fails for a point it has no scenario for (docs/RELIABILITY.md has the table).

Points reached for many things take a subject (the file name of a durable write, the verb
of a slice write), and the variable may narrow them: ``POINT[:GLOB][@N]`` dies at the
``N``-th time (default 1) ``POINT`` is reached with a subject matching the shell pattern
``GLOB`` (default: any), e.g. ``write-after-temp:gpu-dra-agent-checkpoint.json@2``. The
variable is read once at import; when it is unset :func:`crash_point` is a comparison
against ``None``.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from fnmatch import fnmatchcase
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
#: The steps of a MIG placement shared by several claims (``--consumable-shares``): a further
#: share found the instance its first share made (nothing made, its intent durable); a
#: share's unprepare let go of an instance another share still uses (kept, spec not removed).
MigShareCrashPoint = Literal["after-mig-share-attach", "after-mig-share-release"]
#: The steps of sharing a device (``agent.sharing``): the GPU's compute mode (and time-slice)
#: changed, an MPS control daemon started (its pid recorded), a KEP-5075 share's daemon
#: ready with its memory limit (``--consumable-shares``).
SharingCrashPoint = Literal[
    "after-compute-mode", "after-mps-daemon-start", "after-mps-share-limits"
]
#: The steps of a durable write (``agent.node.durable.write_atomic``: checkpoint, CDI specs):
#: the temporary is written and fsynced but not renamed; renamed, its directory not fsynced.
#: Subject: the target's file name.
DurableCrashPoint = Literal["write-after-temp", "write-after-rename"]
#: After one write of a ResourceSlice publish pass (``agent.kube.publisher``), before the
#: rest of the pass. Subject: the verb (``create``, ``update``, ``delete``).
PublishCrashPoint = Literal["slice-publish-after-write"]
#: The steps of attaching a ComputeDomain's IMEX channel (``agent.imex``, the second driver):
#: the ``PrepareStarted`` record; the node's entry in the domain's ``status.nodes``; the
#: daemon's rendered config; the daemon's process spawned (its pid not yet recorded) and
#: recorded (``imex.pid``); the node reported Ready in the domain; the channel's CDI spec; the
#: ``PrepareCompleted`` record. Unprepare of the node's last claim of a domain: the daemon
#: stopped (its directory removed); the node's entry removed; the claim's spec removed.
ImexCrashPoint = Literal[
    "after-channel-prepare-started",
    "after-domain-join",
    "after-imex-config",
    "after-imex-daemon-spawn",
    "after-imex-daemon-start",
    "after-domain-ready",
    "after-channel-cdi-write",
    "after-channel-prepare-completed",
    "channel-unprepare-after-daemon-stop",
    "channel-unprepare-after-domain-leave",
    "channel-unprepare-after-cdi-remove",
]
CrashPoint = Literal[
    EngineCrashPoint,
    MigCrashPoint,
    MigShareCrashPoint,
    SharingCrashPoint,
    DurableCrashPoint,
    PublishCrashPoint,
    ImexCrashPoint,
]
CRASH_POINTS: Final[tuple[EngineCrashPoint, ...]] = get_args(EngineCrashPoint)
MIG_CRASH_POINTS: Final[tuple[MigCrashPoint, ...]] = get_args(MigCrashPoint)
MIG_SHARE_CRASH_POINTS: Final[tuple[MigShareCrashPoint, ...]] = get_args(MigShareCrashPoint)
SHARING_CRASH_POINTS: Final[tuple[SharingCrashPoint, ...]] = get_args(SharingCrashPoint)
DURABLE_CRASH_POINTS: Final[tuple[DurableCrashPoint, ...]] = get_args(DurableCrashPoint)
PUBLISH_CRASH_POINTS: Final[tuple[PublishCrashPoint, ...]] = get_args(PublishCrashPoint)
IMEX_CRASH_POINTS: Final[tuple[ImexCrashPoint, ...]] = get_args(ImexCrashPoint)
ALL_CRASH_POINTS: Final[tuple[CrashPoint, ...]] = (
    *CRASH_POINTS,
    *MIG_CRASH_POINTS,
    *MIG_SHARE_CRASH_POINTS,
    *SHARING_CRASH_POINTS,
    *DURABLE_CRASH_POINTS,
    *PUBLISH_CRASH_POINTS,
    *IMEX_CRASH_POINTS,
)
#: What a parent's ``wait`` gives for the killed process (a shell shows 137).
EXIT_STATUS: Final = -signal.SIGKILL


@dataclass
class Trigger:
    """A parsed ``GPU_DRA_AGENT_CRASH_AT``: die at the ``hit``-th time ``point`` is reached
    with a subject matching ``pattern`` (None: any subject)."""

    point: str
    pattern: str | None = None
    hit: int = 1
    seen: int = 0


def parse(value: str | None) -> Trigger | None:
    """``POINT[:GLOB][@N]`` as a :class:`Trigger`; None when unset. Raises SystemExit with
    the valid points for anything else (a typo must not silently disarm a test)."""
    if not value:
        return None
    rest, hit = value, 1
    if "@" in rest:
        rest, count = rest.rsplit("@", 1)
        if not count.isdecimal() or int(count) < 1:
            raise SystemExit(f"{ENV_VAR}={value!r}: the count after '@' must be 1 or more")
        hit = int(count)
    point, _, pattern = rest.partition(":")
    if point not in ALL_CRASH_POINTS:
        raise SystemExit(
            f"{ENV_VAR}={value!r} is not a crash point; use one of {', '.join(ALL_CRASH_POINTS)}"
            " (optionally :GLOB for the subject and @N for the N-th time)"
        )
    return Trigger(point, pattern or None, hit)


_ARMED: Final = parse(os.environ.get(ENV_VAR))


def crash_point(point: CrashPoint, subject: str = "") -> None:
    """Die here if ``GPU_DRA_AGENT_CRASH_AT`` names ``point`` (and ``subject``, and this is
    the time it counts)."""
    if _ARMED is None or _ARMED.point != point:
        return
    if _ARMED.pattern is not None and not fnmatchcase(subject, _ARMED.pattern):
        return
    _ARMED.seen += 1
    if _ARMED.seen < _ARMED.hit:
        return
    where = f"{point} ({subject})" if subject else point
    sys.stderr.write(f"gpu-dra-agent: crashing at {where} ({ENV_VAR})\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(137)  # not reached: SIGKILL cannot be caught
