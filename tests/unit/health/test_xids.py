"""XID meanings in the health stream's messages: reset XIDs say why, others their catalog
meaning, unknown ones say so; the state machine's message starts with it."""

from __future__ import annotations

from agent.hardware.health_events import EventKind, HealthEvent
from agent.health.policy import DEFAULT_IGNORED_XIDS, RESET_XIDS, HealthPolicy
from agent.health.state import GpuDevices, Health, HealthStateMachine
from agent.health.xids import XID_MEANINGS, describe_xid

UUID = "GPU-00000000-0000-0000-0000-000000000001"


def test_every_xid_the_policy_names_has_a_meaning() -> None:
    for xid in (*DEFAULT_IGNORED_XIDS, *RESET_XIDS):
        assert "not in the agent's table" not in describe_xid(xid), xid
    assert not set(XID_MEANINGS) & set(RESET_XIDS)  # one source per XID


def test_describe_xid() -> None:
    assert describe_xid(79) == "XID 79: GPU has fallen off the bus"
    assert describe_xid(62) == "XID 62: internal micro-controller halt"
    assert describe_xid(999) == "XID 999: not in the agent's table (see NVIDIA's XID catalog)"


def test_the_device_message_carries_the_meaning() -> None:
    gpus = {UUID: GpuDevices(UUID, 0, ("gpu-0",), {})}
    sm = HealthStateMachine(HealthPolicy(), gpus)
    sm.observe([HealthEvent(kind=EventKind.XID, gpu_uuid=UUID, xid=92)], now=1000.0)
    [status] = sm.statuses()
    assert status.health is Health.UNHEALTHY
    assert status.message.startswith("XID 92: high single-bit ECC error rate (last at ")
    assert "NoSchedule until 300 s without recurrence" in status.message
