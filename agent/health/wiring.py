"""Assemble the health parts for the supervisor: pump, state machine, monitor, stream service.

One function, so that the supervisor's wiring stays a few lines and the parts can be built the
same way by tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent.dra.partitionable import DynamicMig
from agent.dra.share_mode import SharesMode
from agent.hardware.events import EventPump, EventSink, WatchedGpu
from agent.hardware.health_events import EventKind, HealthEvent
from agent.hardware.inventory import Inventory
from agent.hardware.nvml import Nvml
from agent.health.front import HealthFront, build_health_front
from agent.health.metrics import COUNTED, count_events
from agent.health.monitor import HealthMonitor
from agent.health.policy import HealthPolicy
from agent.kube.interfaces import DevicePublisher, EventPoster
from agent.telemetry.metrics import HEALTH_EVENTS, at_zero


class CountingPump(EventPump):
    """An :class:`EventPump` whose batches are counted before the monitor gets them; the
    counts of the kinds without an XID are exported at 0 from the start."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        kinds = sorted(str(kind) for kind in COUNTED if kind is not EventKind.XID)
        at_zero(HEALTH_EVENTS, *({"kind": kind, "xid": ""} for kind in kinds))

    async def run(self, sink: EventSink) -> None:
        def counted(events: Sequence[HealthEvent]) -> None:
            count_events(events)
            sink(events)

        await super().run(counted)


@dataclass(frozen=True, slots=True)
class HealthParts:
    monitor: HealthMonitor  # run it in the task group
    front: HealthFront  # its stream service on the DRA socket, fed by the monitor


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
    front: HealthFront | None = None,
) -> HealthParts:
    """The health monitor and its front (the stream service for the DRA socket).
    ``dynamic_mig``, ``shares``: the settings the published devices were built with
    (``--dynamic-mig``, ``--consumable-shares``); ``front``: the service already serving (the
    monitor feeds its hub), else a new one."""
    if front is None:
        front = build_health_front(policy=policy, node_name=node_name, driver_name=driver_name)
    pump = CountingPump([WatchedGpu(g.index, g.uuid) for g in inventory.gpus])
    monitor = HealthMonitor(
        nvml=nvml,
        inventory=inventory,
        policy=policy,
        publisher=publisher,
        hub=front.hub,
        events=events,
        pump=pump,
        dynamic_mig=dynamic_mig,
        shares=shares,
    )
    return HealthParts(monitor, front)
