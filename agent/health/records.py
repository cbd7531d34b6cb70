"""The health state machine's records: device health, the conditions it holds, the
transitions it reports, the statuses the health stream sends, and the GPUs' published devices
(:func:`device_map`). Pure values, no rules (those are :mod:`agent.health.state`)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from agent.dra.names import gpu_device_name, mig_device_name

if TYPE_CHECKING:  # the health stream loads this module before the kubelet's sockets open
    from agent.dra.model import TaintEffect
    from agent.dra.partitionable import DynamicMig
    from agent.hardware.inventory import Inventory

#: Longest message the kubelet keeps.
MAX_MESSAGE_LENGTH = 1024
RECOVERY_ACTION_NONE = 0


class Health(enum.IntEnum):
    """Device health, numbered as the DRAResourceHealth wire enum."""

    UNKNOWN = 0
    HEALTHY = 1
    UNHEALTHY = 2


class Clearing(enum.StrEnum):
    ANSWER = "answer"
    RESET = "reset"
    QUARANTINE = "quarantine"
    MONITORED = "monitored"


#: How hard a condition is to clear; a held condition never moves to a weaker rule.
CLEARING_STRENGTH = {
    Clearing.MONITORED: 0,
    Clearing.QUARANTINE: 0,
    Clearing.RESET: 1,
    Clearing.ANSWER: 2,
}


@dataclass(frozen=True, slots=True)
class GpuDevices:
    """The published devices of one GPU: all of them, and the MIG ones by (GI id, CI id)."""

    uuid: str
    index: int
    names: tuple[str, ...]
    mig: Mapping[tuple[int, int], str]
    #: ``--dynamic-mig``: the GPU's MIG devices are placements whose instances come and go, so
    #: (GI id, CI id) is looked up in the live layout (:meth:`HealthStateMachine.learn_instances`).
    partitionable: bool = False
    minor: int = -1


def device_map(
    inventory: Inventory, dynamic_mig: DynamicMig | None = None
) -> dict[str, GpuDevices]:
    """GPU UUID -> its devices, named exactly as :func:`agent.dra.build_devices` names them
    (with the same ``dynamic_mig`` settings)."""
    from agent.dra.partitionable import instance_name, partition  # after the sockets opened

    gpus: dict[str, GpuDevices] = {}
    for gpu in inventory.gpus:
        split = (
            None
            if dynamic_mig is None
            else partition(gpu, owned=dynamic_mig.owned, adopt=dynamic_mig.adopt)
        )
        if split is not None:
            static = {
                (m.gpu_instance_id, m.compute_instance_id): instance_name(gpu, m)
                for m in split.static.values()
            }
            gpus[gpu.uuid] = GpuDevices(
                gpu.uuid, gpu.index, split.device_names, static, True, gpu.minor
            )
            continue
        mig = {
            (m.gpu_instance_id, m.compute_instance_id): mig_device_name(
                gpu.minor, m.profile.name, m.profile.profile_id, m.placement.start
            )
            for m in gpu.mig_devices
        }
        names = tuple(mig.values()) if gpu.mig_enabled else (gpu_device_name(gpu.minor),)
        gpus[gpu.uuid] = GpuDevices(gpu.uuid, gpu.index, names, mig)
    return gpus


@dataclass(frozen=True, slots=True)
class Condition:
    """One active fault. ``since`` is when it appeared, ``last_seen`` its latest occurrence."""

    gpu_uuid: str
    device: str | None  # None: every device of the GPU
    key: str
    value: str
    effect: TaintEffect
    clearing: Clearing
    reason: str
    since: float
    last_seen: float
    count: int = 1

    @property
    def ident(self) -> tuple[str, str | None, str, str]:
        return (self.gpu_uuid, self.device, self.key, self.effect)


@dataclass(frozen=True, slots=True)
class Transition:
    """A condition added, changed (new value) or removed, with the devices it concerns."""

    gpu_uuid: str
    devices: tuple[str, ...]
    key: str
    value: str
    effect: TaintEffect
    change: Literal["added", "changed", "removed"]
    reason: str
    at: float

    @property
    def taint(self) -> str:
        return (
            f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"
        )

    def describe(self) -> str:
        return f"{', '.join(self.devices)}: taint {self.taint} {self.change} ({self.reason})"


@dataclass(frozen=True, slots=True)
class DeviceStatus:
    """What the health stream says about one device."""

    name: str
    health: Health
    message: str
