"""The kubelet's side of health, made before the GPUs are discovered.

The supervisor opens the kubelet's sockets first thing (:mod:`agent.kubelet.deferred`); the
health stream service is served on the DRA socket from then on, fed by a hub that sends no
list until the health monitor has looked at the GPUs (its first publish), so the kubelet never
reads "all healthy" from an agent that has not looked yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.health.metrics import MeasuredHub
from agent.health.policy import HealthPolicy
from agent.health.stream import HEALTH_VERSIONS, HealthStreamService
from agent.kubelet.registration import DRA_VERSIONS


@dataclass(frozen=True, slots=True)
class HealthFront:
    """The kubelet's side of health, made before the GPUs are discovered: the stream service
    on the DRA socket, fed by a hub that sends nothing until the monitor's first look."""

    hub: MeasuredHub
    service: HealthStreamService
    #: What GetInfo advertises: the DRAPlugin versions, then the health service versions.
    supported_versions: tuple[str, ...]

    def plugin_arguments(self) -> dict[str, Any]:
        """The KubeletPlugin keyword arguments that serve and advertise the health service."""
        return {"supported_versions": self.supported_versions, "extra_services": [self.service]}


def build_health_front(
    *, policy: HealthPolicy, node_name: str, driver_name: str = "gpu.nvidia.com"
) -> HealthFront:
    hub = MeasuredHub(driver_name, until_published=True)
    service = HealthStreamService(
        hub,
        pool_name=node_name,
        health_check_timeout_seconds=policy.health_check_timeout_seconds,
    )
    return HealthFront(hub, service, (*DRA_VERSIONS, *HEALTH_VERSIONS))
