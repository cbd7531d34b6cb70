"""GPU health end to end: faults injected into the running agent's simulated NVML reach the API
server as device taints and the kubelet emulator as health reports, and clear on recovery."""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from agent.sim.control import control_socket_path
from agent.sim.control.client import send_request
from agent.sim.kubelet import EventKind
from agent.sim.kubelet.health import DeviceHealthState
from tests.integration.conftest import DRIVER, NODE, AgentHarness, allocated_devices, gpu_request

pytestmark = pytest.mark.anyio

HEALTHY, UNHEALTHY = DeviceHealthState.HEALTHY, DeviceHealthState.UNHEALTHY
QUARANTINE = 2  # seconds; the default (5 minutes) would outlive the test module


@pytest.fixture(scope="module")
async def health(fresh_harness: AgentHarness) -> AsyncIterator[AgentHarness]:
    """The agent with a short quarantine (from its config file), all GPUs reported healthy."""
    config = fresh_harness.workdir / "agent.yaml"
    config.write_text(f"health-quarantine-seconds: {QUARANTINE}\n")
    await fresh_harness.start_agent(args=["--config", str(config)])
    for i in range(8):
        await fresh_harness.kubelet.wait_health(DRIVER, NODE, f"gpu-{i}", HEALTHY, timeout=10)
    await fresh_harness.wait_slices()  # published: the tests count slice writes from here
    yield fresh_harness
    agent = fresh_harness.agent
    assert agent is not None
    if agent.returncode is None:
        assert await fresh_harness.stop_agent() == 0, agent.log()


async def inject(harness: AgentHarness, op: str, gpu: int, **fields: Any) -> dict[str, Any]:
    request = {"op": op, "gpu": str(gpu), **fields}
    return await send_request(control_socket_path(harness.plugin_dir), request)


def taints(harness: AgentHarness) -> dict[str, list[tuple[str, str, str]]]:
    """Device name -> (key, value, effect) of each taint, as stored in the API server."""
    found: dict[str, list[tuple[str, str, str]]] = {}
    selector = f"spec.nodeName={NODE},spec.driver={DRIVER}"
    for s in harness.server.list_objects("resourceslices", field_selector=selector):
        for device in s["spec"].get("devices", []):
            found[device["name"]] = [
                (t["key"], t.get("value", ""), t["effect"]) for t in device.get("taints", [])
            ]
    return found


async def wait_taints(
    harness: AgentHarness,
    device: str,
    want: list[tuple[str, str, str]],
    timeout: float = 10.0,  # noqa: ASYNC109
) -> None:
    with anyio.fail_after(timeout):
        while taints(harness).get(device, []) != want:  # noqa: ASYNC110
            await anyio.sleep(0.02)


def slice_writes(harness: AgentHarness) -> int:
    return len(harness.server.requests.records("WRITE", "/apis/resource.k8s.io/v1/resourceslices*"))


async def test_health_service_is_advertised_and_reports_every_device(health: AgentHarness) -> None:
    [registration] = health.kubelet.registrations(DRIVER)
    assert registration.supported_versions == (
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1alpha1.DRAResourceHealth",
        "v1.DRAResourceHealth",
    )
    assert registration.health_service == "v1.DRAResourceHealth"
    report = health.kubelet.health_reports(DRIVER)[-1]
    assert sorted(r.device for r in report.devices) == sorted(f"gpu-{i}" for i in range(8))
    assert {r.pool for r in report.devices} == {NODE}
    assert all(r.timeout == 30 and r.message for r in report.devices)


async def test_xid_79_taints_one_gpu_then_recovery_untaints_it(health: AgentHarness) -> None:
    kubelet = health.kubelet
    await inject(health, "xid", 3, xid=79)
    await kubelet.wait_health(DRIVER, NODE, "gpu-3", UNHEALTHY, timeout=5)
    await wait_taints(health, "gpu-3", [("gpu.nvidia.com/xid", "79", "NoExecute")])
    [record] = [r for r in kubelet.health_reports(DRIVER)[-1].devices if r.device == "gpu-3"]
    assert "XID 79" in record.message and "NoExecute" in record.message
    others = [f"gpu-{i}" for i in range(8) if i != 3]
    assert all(kubelet.health(DRIVER, NODE, d) == HEALTHY for d in others)
    assert all(taints(health)[d] == [] for d in others)

    await inject(health, "recover", 3)  # a completed reset: no recovery action pending
    await wait_taints(health, "gpu-3", [], timeout=10)
    await kubelet.wait_health(DRIVER, NODE, "gpu-3", HEALTHY, timeout=5)


async def test_ignored_xids_change_nothing(health: AgentHarness) -> None:
    # let the previous test's writes settle (on a loaded machine they may come late)
    await wait_taints(health, "gpu-2", [])
    writes = -1
    while writes != slice_writes(health):  # no write for half a second
        writes = slice_writes(health)
        await anyio.sleep(0.5)
    reports = len(health.kubelet.health_reports(DRIVER))
    for xid in (13, 31, 43, 45, 68, 109):
        reply = await inject(health, "xid", 2, xid=xid)
        assert reply["delivered"] == 1
    await inject(health, "ecc", 2, single_bit=True)
    await anyio.sleep(1.0)
    assert slice_writes(health) == writes
    assert taints(health)["gpu-2"] == []
    new_reports = health.kubelet.health_reports(DRIVER)[reports:]
    assert all(r.health == HEALTHY for report in new_reports for r in report.devices)


async def test_gpu_lost_taints_no_execute_through_the_cli(health: AgentHarness) -> None:
    command = [sys.executable, "-m", "agent", "sim", "gpu-lost"]
    target = ["--plugins-dir", str(health.plugins_dir), "--gpu", "5"]
    result = await anyio.run_process([*command, *target], check=False)
    assert result.returncode == 0, result.stderr.decode()
    assert b"gpu-lost on GPU 5" in result.stdout
    await wait_taints(health, "gpu-5", [("gpu.nvidia.com/gpu-lost", "", "NoExecute")])
    await health.kubelet.wait_health(DRIVER, NODE, "gpu-5", UNHEALTHY, timeout=5)
    # the other GPUs are still watched: an XID on one of them is still seen
    await inject(health, "xid", 6, xid=62)
    await wait_taints(health, "gpu-6", [("gpu.nvidia.com/xid", "62", "NoSchedule")])
    assert taints(health)["gpu-4"] == []

    await inject(health, "recover", 5)
    await wait_taints(health, "gpu-5", [])
    await wait_taints(health, "gpu-6", [], timeout=QUARANTINE + 5)  # quarantine over
    # the GPU is watched again after it came back
    await inject(health, "xid", 5, xid=62)
    await wait_taints(health, "gpu-5", [("gpu.nvidia.com/xid", "62", "NoSchedule")])


async def _prepare_seconds(health: AgentHarness, device: str, runs: int) -> list[float]:
    """Prepare times of ``runs`` claims, each allocated by selector (the device's UUID, as a
    user pins a GPU), prepared, unprepared and deleted; only the prepare is timed."""
    uuid = await health.device_attribute(device, "uuid")
    pinned = gpu_request(selectors=[f"device.attributes['gpu.nvidia.com'].uuid == '{uuid}'"])
    durations = []
    for _ in range(runs):
        ref, claim = await health.allocate(pinned)
        assert allocated_devices(claim) == [device]
        start = time.perf_counter()
        assert (await health.prepare(ref))[ref.uid].error == ""
        durations.append(time.perf_counter() - start)
        assert (await health.unprepare(ref))[ref.uid].error == ""
        await health.delete_claims()  # the device is free for the next round
    return sorted(durations)


@pytest.mark.serial  # a latency ratio: other workers' agents (a fleet test's) disturb it
async def test_event_storm_is_coalesced_and_prepares_keep_their_latency(
    health: AgentHarness,
) -> None:
    baseline = await _prepare_seconds(health, "gpu-7", 10)
    await anyio.sleep(0.3)
    writes = slice_writes(health)
    during: list[float] = []

    async def storm() -> None:
        for xid in (62, 63, 64):  # 3 x 2000 events in under a second, three conditions
            await inject(health, "xid", 0, xid=xid, count=2000)
            await anyio.sleep(0.2)

    async with anyio.create_task_group() as group:
        group.start_soon(storm)
        during = await _prepare_seconds(health, "gpu-7", 10)
    await wait_taints(
        health,
        "gpu-0",
        [("gpu.nvidia.com/xid", "64", "NoExecute"), ("gpu.nvidia.com/xid", "63", "NoSchedule")],
    )
    await anyio.sleep(0.3)
    storm_writes = slice_writes(health) - writes
    assert 1 <= storm_writes <= 6, storm_writes  # one per change at most, not per event
    median_before, median_during = baseline[len(baseline) // 2], during[len(during) // 2]
    assert median_during <= max(3 * median_before, median_before + 0.05), (baseline, during)
    await inject(health, "recover", 0)


async def test_shutdown_ends_the_health_stream_with_status_ok(health: AgentHarness) -> None:
    ended = len(health.kubelet.events(EventKind.HEALTH_STREAM_ENDED, DRIVER))
    assert await health.stop_agent() == 0
    event = (await _ended(health, ended + 1))[-1]
    assert "ended by the plugin" in event.message
    assert not control_socket_path(health.plugin_dir).exists()


async def _ended(health: AgentHarness, count: int) -> list[Any]:
    await health.kubelet.wait_event(EventKind.HEALTH_STREAM_ENDED, DRIVER, count=count, timeout=5)
    return health.kubelet.events(EventKind.HEALTH_STREAM_ENDED, DRIVER)
