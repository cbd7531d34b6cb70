"""Health metrics: the device health state set and the count of NVML health events.

The state machine is pure and the monitor already has three outputs to order; metrics are a
fourth that must never delay or fail them. So they are recorded at the two seams the wiring
owns: the hub that receives every device-status list (:class:`MeasuredHub`), and the event
pump's batches (:func:`count_events`, called by ``agent.health.wiring.CountingPump``).
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.hardware.health_events import EventKind, HealthEvent
from agent.health.records import DeviceStatus, Health
from agent.health.stream import HealthHub
from agent.telemetry.metrics import HEALTH_EVENTS, add, device_health

STATE_NAMES = {Health.HEALTHY: "Healthy", Health.UNHEALTHY: "Unhealthy", Health.UNKNOWN: "Unknown"}
#: The events a GPU's driver reports (the others are the agent's own bookkeeping).
COUNTED = frozenset(
    {
        EventKind.XID,
        EventKind.ECC_DOUBLE_BIT,
        EventKind.ECC_SINGLE_BIT,
        EventKind.GPU_LOST,
        EventKind.UNMONITORED,
    }
)


class MeasuredHub(HealthHub):
    """A :class:`HealthHub` that also sets ``gpu_dra_device_health`` for every device."""

    def __init__(
        self, driver: str, statuses: Sequence[DeviceStatus] = (), *, until_published: bool = False
    ) -> None:
        self.driver = driver
        super().__init__(statuses, until_published=until_published)
        self._measure(statuses)

    def publish(self, statuses: Sequence[DeviceStatus]) -> None:
        super().publish(statuses)
        self._measure(statuses)

    def _measure(self, statuses: Sequence[DeviceStatus]) -> None:
        device_health(self.driver, ((s.name, STATE_NAMES[s.health]) for s in statuses))


def count_events(events: Sequence[HealthEvent]) -> None:
    """``gpu_dra_health_events_total{kind,xid}`` for one batch (``xid`` empty unless XID)."""
    counts: dict[tuple[str, str], int] = {}
    for event in events:
        if event.kind in COUNTED:
            key = (str(event.kind), str(event.xid) if event.kind is EventKind.XID else "")
            counts[key] = counts.get(key, 0) + 1
    for (kind, xid), count in counts.items():
        add(HEALTH_EVENTS, count, kind=kind, xid=xid)
