"""Health metrics: the device health state set follows every published status list, and the
pump's event batches are counted by kind and XID."""

from __future__ import annotations

from agent.hardware.health_events import EventKind, HealthEvent
from agent.health.metrics import MeasuredHub, count_events
from agent.health.records import DeviceStatus, Health
from tests.support.metrics import reading

DRIVER = "test-health.example.com"


def test_device_health_is_a_state_set() -> None:
    metrics = reading()
    hub = MeasuredHub(DRIVER, [DeviceStatus("gpu-0", Health.HEALTHY, "")])
    states = ("Healthy", "Unhealthy", "Unknown")

    def of(device: str) -> dict[str, float]:
        return {
            s: metrics.value("gpu_dra_device_health", driver=DRIVER, device=device, state=s)
            for s in states
        }

    assert of("gpu-0") == {"Healthy": 1.0, "Unhealthy": 0.0, "Unknown": 0.0}
    hub.publish(
        [
            DeviceStatus("gpu-0", Health.UNHEALTHY, "xid 79"),
            DeviceStatus("gpu-1", Health.UNKNOWN, ""),
        ]
    )
    assert of("gpu-0") == {"Healthy": 0.0, "Unhealthy": 1.0, "Unknown": 0.0}
    assert of("gpu-1") == {"Healthy": 0.0, "Unhealthy": 0.0, "Unknown": 1.0}


def test_health_events_are_counted_by_kind_and_xid() -> None:
    metrics = reading()
    before = {
        "79": metrics.value("gpu_dra_health_events", kind="xid", xid="79"),
        "lost": metrics.value("gpu_dra_health_events", kind="gpu-lost", xid=""),
        "answered": metrics.value("gpu_dra_health_events", kind="gpu-answered", xid=""),
    }
    count_events(
        [
            HealthEvent("GPU-a", EventKind.XID, xid=79),
            HealthEvent("GPU-a", EventKind.XID, xid=79),
            HealthEvent("GPU-b", EventKind.GPU_LOST),
            HealthEvent("GPU-b", EventKind.GPU_ANSWERED),  # the agent's bookkeeping: not counted
        ]
    )
    assert metrics.value("gpu_dra_health_events", kind="xid", xid="79") - before["79"] == 2
    assert metrics.value("gpu_dra_health_events", kind="gpu-lost", xid="") - before["lost"] == 1
    answered = metrics.value("gpu_dra_health_events", kind="gpu-answered", xid="")
    assert answered == before["answered"] == 0
