"""Assemble the health parts for the supervisor: pump, state machine, monitor, stream service.

One function, so that the supervisor's wiring stays a few lines and the parts can be built the
same way by tests and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.dra.partitionable import DynamicMig
from agent.hardware.events import WatchedGpu
from agent.hardware.inventory import Inventory
from agent.hardware.nvml import Nvml
from agent.health.metrics import CountingPump, MeasuredHub
from agent.health.monitor import DevicePublisher, HealthMonitor
from agent.health.policy import HealthPolicy
from agent.health.state import HealthStateMachine, device_map
from agent.health.stream import HEALTH_VERSIONS, HealthStreamService
from agent.kube.interfaces import EventPoster
from agent.kubelet.registration import DRA_VERSIONS


@dataclass(frozen=True, slots=True)
class HealthService:
    """The health stream service of the DRA socket and the hub that feeds it."""

    hub: MeasuredHub
    service: HealthStreamService
    #: What GetInfo advertises: the DRAPlugin versions, then the health service versions.
    supported_versions: tuple[str, ...]

    def plugin_arguments(self) -> dict[str, Any]:
        """The KubeletPlugin keyword arguments that serve and advertise the health service."""
        return {"supported_versions": self.supported_versions, "extra_services": [self.service]}


@dataclass(frozen=True, slots=True)
class HealthParts:
    monitor: HealthMonitor
    service: HealthStreamService
    #: What GetInfo advertises: the DRAPlugin versions, then the health service versions.
    supported_versions: tuple[str, ...]

    def plugin_arguments(self) -> dict[str, Any]:
        """The KubeletPlugin keyword arguments that serve and advertise the health service."""
        return {"supported_versions": self.supported_versions, "extra_services": [self.service]}


def build_health(
    *,
    nvml: Nvml,
    inventory: Inventory,
    policy: HealthPolicy,
    node_name: str,
    publisher: DevicePublisher,
    events: EventPoster,
    driver_name: str = "gpu.nvidia.com",
    dynamic_mig: DynamicMig | None = None,
) -> HealthParts:
    """The health monitor (run it in the task group) and the service for the DRA socket.
    ``dynamic_mig``: the settings the published devices were built with (``--dynamic-mig``)."""
    served = build_health_service(
        inventory=inventory,
        policy=policy,
        node_name=node_name,
        driver_name=driver_name,
        dynamic_mig=dynamic_mig,
    )
    monitor = build_health_monitor(
        served,
        nvml=nvml,
        inventory=inventory,
        policy=policy,
        publisher=publisher,
        events=events,
        dynamic_mig=dynamic_mig,
    )
    return HealthParts(monitor, served.service, served.supported_versions)


def build_health_service(
    *,
    inventory: Inventory,
    policy: HealthPolicy,
    node_name: str,
    driver_name: str = "gpu.nvidia.com",
    dynamic_mig: DynamicMig | None = None,
) -> HealthService:
    """The first half of :func:`build_health`, which needs no API server: the service the
    kubelet may watch from its registration on. Its hub starts with every device's status
    as the monitor's state machine starts (no condition yet, whatever the policy's taint
    effects), so a stream opened before the monitor exists sees the monitor's first list."""
    statuses = HealthStateMachine(policy, device_map(inventory, dynamic_mig)).statuses()
    hub = MeasuredHub(driver_name, statuses)
    service = HealthStreamService(
        hub,
        pool_name=node_name,
        health_check_timeout_seconds=policy.health_check_timeout_seconds,
    )
    return HealthService(hub, service, (*DRA_VERSIONS, *HEALTH_VERSIONS))


def build_health_monitor(
    served: HealthService,
    *,
    nvml: Nvml,
    inventory: Inventory,
    policy: HealthPolicy,
    publisher: DevicePublisher,
    events: EventPoster,
    dynamic_mig: DynamicMig | None = None,
) -> HealthMonitor:
    """The second half of :func:`build_health`: the monitor that feeds ``served``'s hub
    (``policy`` with the taint effect the API server accepts; run it in the task group)."""
    pump = CountingPump([WatchedGpu(g.index, g.uuid) for g in inventory.gpus])
    return HealthMonitor(
        nvml=nvml,
        inventory=inventory,
        policy=policy,
        publisher=publisher,
        hub=served.hub,
        events=events,
        pump=pump,
        dynamic_mig=dynamic_mig,
    )
