"""Assemble the health parts for the supervisor: pump, state machine, monitor, stream service.

One function, so that the supervisor's wiring stays a few lines and the parts can be built the
same way by tests and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.dra.partitionable import DynamicMig
from agent.dra.shares import SharesMode
from agent.hardware.events import WatchedGpu
from agent.hardware.inventory import Inventory
from agent.hardware.nvml import Nvml
from agent.health.metrics import CountingPump, MeasuredHub
from agent.health.monitor import HealthMonitor
from agent.health.policy import HealthPolicy
from agent.health.stream import HEALTH_VERSIONS, HealthStreamService
from agent.kube.interfaces import DevicePublisher, EventPoster
from agent.kubelet.registration import DRA_VERSIONS


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
    shares: SharesMode | None = None,
) -> HealthParts:
    """The health monitor (run it in the task group) and the service for the DRA socket.
    ``dynamic_mig``, ``shares``: the settings the published devices were built with
    (``--dynamic-mig``, ``--consumable-shares``)."""
    hub = MeasuredHub(driver_name)
    pump = CountingPump([WatchedGpu(g.index, g.uuid) for g in inventory.gpus])
    monitor = HealthMonitor(
        nvml=nvml,
        inventory=inventory,
        policy=policy,
        publisher=publisher,
        hub=hub,
        events=events,
        pump=pump,
        dynamic_mig=dynamic_mig,
        shares=shares,
    )
    service = HealthStreamService(
        hub,
        pool_name=node_name,
        health_check_timeout_seconds=policy.health_check_timeout_seconds,
    )
    return HealthParts(monitor, service, (*DRA_VERSIONS, *HEALTH_VERSIONS))
