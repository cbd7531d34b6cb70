"""The health state machine: rules, recovery and coalescing, with plain values (no I/O)."""

from __future__ import annotations

import pytest

from agent.dra.model import DeviceTaint
from agent.hardware.health_events import EventKind, HealthEvent
from agent.health.policy import HealthPolicy, XidAction, policy_with
from agent.health.records import GpuDevices, Health, device_map
from agent.health.state import MAX_MESSAGE_LENGTH, HealthStateMachine
from tests.support.inventories import h100_mixed_mig_node

A, B, M = "GPU-a", "GPU-b", "GPU-m"
MIG_1 = "gpu-2-mig-1g10gb-19-0"
MIG_2 = "gpu-2-mig-1g10gb-19-1"
GPUS = {
    A: GpuDevices(A, 0, ("gpu-0",), {}),
    B: GpuDevices(B, 1, ("gpu-1",), {}),
    M: GpuDevices(M, 2, (MIG_1, MIG_2), {(1, 0): MIG_1, (2, 0): MIG_2}),
}
T0 = 1_800_000_000.0


def machine(policy: HealthPolicy | None = None) -> HealthStateMachine:
    return HealthStateMachine(policy or HealthPolicy(), GPUS)


def xid(uuid: str, number: int, gi: int | None = None) -> HealthEvent:
    return HealthEvent(uuid, EventKind.XID, number, gi, 0 if gi is not None else None)


def keys(sm: HealthStateMachine) -> dict[str, list[tuple[str, str, str]]]:
    return {d: [(t.key, t.value, t.effect) for t in ts] for d, ts in sm.taints().items()}


def health(sm: HealthStateMachine) -> dict[str, Health]:
    return {s.name: s.health for s in sm.statuses()}


def test_all_healthy_at_start() -> None:
    sm = machine()
    assert sm.taints() == {}
    assert set(health(sm).values()) == {Health.HEALTHY}
    assert [s.name for s in sm.statuses()] == ["gpu-0", "gpu-1", MIG_1, MIG_2]


def test_reset_xid_taints_no_execute_on_one_gpu_only() -> None:
    sm = machine()
    [t] = sm.observe([xid(A, 79)], T0)
    assert (t.change, t.devices, t.taint) == (
        "added",
        ("gpu-0",),
        "gpu.nvidia.com/xid=79:NoExecute",
    )
    assert "fallen off the bus" in t.reason
    assert keys(sm) == {"gpu-0": [("gpu.nvidia.com/xid", "79", "NoExecute")]}
    assert health(sm) == {
        "gpu-0": Health.UNHEALTHY,
        "gpu-1": Health.HEALTHY,
        MIG_1: Health.HEALTHY,
        MIG_2: Health.HEALTHY,
    }
    [taint] = sm.taints()["gpu-0"]
    assert isinstance(taint, DeviceTaint) and taint.time_added is not None


def test_ignored_xids_and_single_bit_ecc_change_nothing() -> None:
    sm = machine()
    events = [xid(A, n) for n in (13, 31, 43, 45, 68, 109)]
    events.append(HealthEvent(A, EventKind.ECC_SINGLE_BIT))
    assert sm.observe(events, T0) == []
    assert sm.taints() == {}


def test_other_xids_no_schedule_and_quarantine_restarts_on_recurrence() -> None:
    sm = machine(policy_with(quarantine_seconds=300))
    assert len(sm.observe([xid(B, 62)], T0)) == 1
    assert sm.observe([xid(B, 62)], T0 + 200) == []  # a repeat refreshes, no transition
    assert sm.tick(T0 + 300) == []  # 100 s since the repeat
    [cleared] = sm.tick(T0 + 500)
    assert cleared.change == "removed" and "quarantine over" in cleared.reason
    assert sm.taints() == {}


def test_storm_of_identical_events_is_one_transition() -> None:
    sm = machine()
    transitions = sm.observe([xid(A, 62)] * 5000, T0)
    assert len(transitions) == 1
    [cond] = sm.conditions
    assert cond.count == 5000
    assert "seen 5000 times" in sm.statuses()[0].message


def test_new_xid_value_changes_the_taint_and_keeps_one_per_effect() -> None:
    sm = machine()
    sm.observe([xid(A, 62), xid(A, 79)], T0)
    [changed] = sm.observe([xid(A, 63)], T0 + 1)
    assert changed.change == "changed"
    assert keys(sm)["gpu-0"] == [
        ("gpu.nvidia.com/xid", "79", "NoExecute"),
        ("gpu.nvidia.com/xid", "63", "NoSchedule"),
    ]


def test_reset_xid_clears_only_when_no_recovery_action_is_pending_after_the_hold() -> None:
    sm = machine()
    sm.observe([xid(A, 48)], T0)
    assert sm.due_polls(T0 + 1) == (set(), set())  # inside the hold: do not poll yet
    assert sm.due_polls(T0 + 2) == (set(), {A})
    pending = HealthEvent(A, EventKind.RECOVERY_ACTION, recovery_action=1)
    assert sm.observe([pending], T0 + 2) == []
    assert "recovery action pending: 1" in sm.statuses()[0].message
    assert sm.tick(T0 + 10_000) == []  # time alone never clears a reset XID
    done = HealthEvent(A, EventKind.RECOVERY_ACTION, recovery_action=0)
    [cleared] = sm.observe([done], T0 + 3)
    assert cleared.change == "removed" and "no pending recovery action" in cleared.reason
    assert health(sm)["gpu-0"] is Health.HEALTHY


def test_no_recovery_action_field_falls_back_to_quarantine() -> None:
    sm = machine(policy_with(quarantine_seconds=60))
    sm.observe([HealthEvent(A, EventKind.ECC_DOUBLE_BIT)], T0)
    assert keys(sm) == {"gpu-0": [("gpu.nvidia.com/ecc", "double-bit", "NoExecute")]}
    sm.observe([HealthEvent(A, EventKind.RECOVERY_ACTION, recovery_action=None)], T0 + 5)
    assert sm.due_polls(T0 + 10) == (set(), set())
    assert sm.tick(T0 + 59) == []
    assert len(sm.tick(T0 + 60)) == 1


def test_gpu_lost_is_no_execute_until_the_gpu_answers() -> None:
    sm = machine()
    sm.observe([HealthEvent(M, EventKind.GPU_LOST, detail="probe")], T0)
    assert keys(sm) == {
        MIG_1: [("gpu.nvidia.com/gpu-lost", "", "NoExecute")],
        MIG_2: [("gpu.nvidia.com/gpu-lost", "", "NoExecute")],
    }
    assert sm.due_polls(T0 + 1) == ({M}, set())
    assert sm.tick(T0 + 10_000) == []
    [cleared] = sm.observe([HealthEvent(M, EventKind.GPU_ANSWERED)], T0 + 2)
    assert cleared.devices == (MIG_1, MIG_2) and sm.taints() == {}


def test_mig_devices_follow_their_parent_but_a_mig_xid_stays_on_its_device() -> None:
    sm = machine()
    sm.observe([xid(M, 62, gi=2)], T0)
    assert keys(sm) == {MIG_2: [("gpu.nvidia.com/xid", "62", "NoSchedule")]}
    sm.observe([xid(M, 79, gi=1)], T0)  # needs a reset: the whole GPU
    assert set(keys(sm)) == {MIG_1, MIG_2}
    assert health(sm)[MIG_1] is Health.UNHEALTHY


@pytest.mark.parametrize("effect", ["NoSchedule", "None"])
def test_unmonitored_gpu_is_unknown_with_the_policys_effect_until_registered(effect: str) -> None:
    sm = machine(HealthPolicy(unmonitored_effect=effect))
    [t] = sm.observe([HealthEvent(B, EventKind.UNMONITORED, detail="NVML: Not Supported")], T0)
    assert t.taint == f"gpu.nvidia.com/unmonitored:{effect}"
    assert [(d.key, d.effect) for d in sm.taints()["gpu-1"]] == [
        ("gpu.nvidia.com/unmonitored", effect)
    ]
    status = {s.name: s for s in sm.statuses()}["gpu-1"]
    assert status.health is Health.UNKNOWN and "Not Supported" in status.message
    assert sm.observe([HealthEvent(B, EventKind.MONITORED)], T0 + 1)[0].change == "removed"


def test_the_unmonitored_effect_follows_the_server_version_learnt_later() -> None:
    """The monitor starts with NoSchedule (valid on every server) before the version is read;
    a held unmonitored taint takes the effect chosen then, and so do the ones that follow."""
    sm = machine(HealthPolicy())
    sm.observe([HealthEvent(B, EventKind.UNMONITORED, detail="NVML: Not Supported")], T0)
    sm.observe([xid(A, 79)], T0)
    assert sm.set_unmonitored_effect("None") is True
    assert [(d.key, d.effect) for d in sm.taints()["gpu-1"]] == [
        ("gpu.nvidia.com/unmonitored", "None")
    ]
    assert [(d.key, d.effect) for d in sm.taints()["gpu-0"]] == [
        ("gpu.nvidia.com/xid", "NoExecute")
    ]
    assert sm.set_unmonitored_effect("None") is False  # nothing left to change
    [t] = sm.observe([HealthEvent(A, EventKind.UNMONITORED)], T0 + 1)
    assert t.taint == "gpu.nvidia.com/unmonitored:None"
    assert len(sm.conditions) == 3
    assert sm.observe([HealthEvent(B, EventKind.MONITORED)], T0 + 2)[0].change == "removed"
    with pytest.raises(ValueError, match="not a taint effect"):
        sm.set_unmonitored_effect("PreferNoSchedule")


def test_configured_actions_and_unknown_gpus() -> None:
    sm = machine(policy_with({62: XidAction.IGNORE, 13: XidAction.NO_EXECUTE}))
    assert sm.observe([xid(A, 62), xid("GPU-unknown", 79)], T0) == []
    [t] = sm.observe([xid(A, 13)], T0)
    assert t.effect == "NoExecute"


def test_messages_fit_the_kubelets_limit() -> None:
    sm = machine()
    long = "x" * 5000
    sm.observe([HealthEvent(A, EventKind.GPU_LOST, detail=long)], T0)
    message = sm.statuses()[0].message
    assert len(message) == MAX_MESSAGE_LENGTH and message.endswith("...")


def test_device_map_names_devices_as_the_dra_model_does() -> None:
    from agent.dra import build_devices

    inventory = h100_mixed_mig_node()
    gpus = device_map(inventory)
    published = {d.name for d in build_devices(inventory)}
    assert {n for g in gpus.values() for n in g.names} == published


def test_a_milder_xid_with_the_same_taint_does_not_quarantine_out_a_pending_reset() -> None:
    # an operator override gives XID 62 the reset XID 79's effect: one taint for both
    sm = machine(policy_with({62: XidAction.NO_EXECUTE}))
    sm.observe([xid(A, 79)], T0)
    pending = HealthEvent(A, EventKind.RECOVERY_ACTION, recovery_action=2)
    sm.observe([pending], T0 + 2)
    sm.observe([xid(A, 62)], T0 + 3)
    assert keys(sm)["gpu-0"] == [("gpu.nvidia.com/xid", "62", "NoExecute")]
    assert sm.tick(T0 + 10_000) == []  # still waiting for the reset, not for a quarantine
    assert health(sm)["gpu-0"] is Health.UNHEALTHY
    done = HealthEvent(A, EventKind.RECOVERY_ACTION, recovery_action=0)
    assert [t.change for t in sm.observe([done], T0 + 10_001)] == ["removed"]
