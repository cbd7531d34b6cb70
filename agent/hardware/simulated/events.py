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
#: NVML_GPU_RECOVERY_ACTION_* values the simulated driver schedules after a fault.
RECOVERY_ACTION_NONE = 0
RECOVERY_ACTION_GPU_RESET = 1
RECOVERY_ACTION_NODE_REBOOT = 2
#: XIDs after which the driver asks for a reset (or, for a GPU off the bus, a reboot).
XID_RECOVERY_ACTIONS = {
    48: RECOVERY_ACTION_GPU_RESET,
    64: RECOVERY_ACTION_GPU_RESET,
    74: RECOVERY_ACTION_GPU_RESET,
    79: RECOVERY_ACTION_NODE_REBOOT,
    95: RECOVERY_ACTION_GPU_RESET,
    119: RECOVERY_ACTION_GPU_RESET,
    120: RECOVERY_ACTION_GPU_RESET,
    140: RECOVERY_ACTION_GPU_RESET,
}
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
