"""The health events the NVML event pump reports, as plain records (the pump's output type).

They live in the hardware layer, next to the pump that produces them, so that the hardware layer
depends on nothing above it: :mod:`agent.health` (the state machine that consumes them) imports
them from here. Kept apart from the pump so the pure state machine and its tests need neither
NVML nor threads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EventKind(enum.StrEnum):
    XID = "xid"
    ECC_DOUBLE_BIT = "ecc-double-bit"
    ECC_SINGLE_BIT = "ecc-single-bit"
    #: NVML answered GPU_IS_LOST for the GPU, or its event could not be read.
    GPU_LOST = "gpu-lost"
    #: Registering for events failed or is unsupported on this GPU.
    UNMONITORED = "unmonitored"
    #: Events of the GPU are watched (at start, and again after it came back).
    MONITORED = "monitored"
    #: The lost GPU answers NVML again.
    GPU_ANSWERED = "gpu-answered"
    #: A poll of the GPU's pending recovery action (``recovery_action`` None: not supported).
    RECOVERY_ACTION = "recovery-action"


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """Something observed about one GPU (identified by UUID, as NVML events are)."""

    gpu_uuid: str
    kind: EventKind
    xid: int = 0
    #: MIG identity from the event; None for events about the whole GPU (NVML's 0xFFFFFFFF).
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    detail: str = ""
    recovery_action: int | None = None
