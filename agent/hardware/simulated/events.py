"""Event records of the simulated NVML library (what ``nvmlEventSetWait_v2`` hands out)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from agent.hardware.simulated.state import SimGpu

EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_PSTATE = 0x4
EVENT_XID_CRITICAL = 0x8
EVENT_CLOCK = 0x10
SUPPORTED_EVENTS = (
    EVENT_SINGLE_BIT_ECC | EVENT_DOUBLE_BIT_ECC | EVENT_PSTATE | EVENT_XID_CRITICAL | EVENT_CLOCK
)
NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId of an event not tied to a MIG device


@dataclass
class SimEvent:
    gpu: SimGpu
    event_type: int
    data: int
    gpu_instance_id: int = NO_INSTANCE
    compute_instance_id: int = NO_INSTANCE


@dataclass(eq=False)
class SimEventSet:
    handle: int = 0
    registrations: dict[int, int] = field(default_factory=dict)  # GPU handle -> event mask
    pending: deque[SimEvent] = field(default_factory=deque)
    freed: bool = False
