"""The health stream as kubelets 1.36 and 1.37 consume it: the agent advertises both
DRAResourceHealth versions, a 1.36 kubelet (v1alpha1 only) and a 1.37 kubelet (v1 first) each
open their own over real gRPC, and every device's entry carries ``message`` (an XID and what it
means) and ``health_check_timeout_seconds``."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.kubelet import api
from agent.sim.control import control_socket_path
from agent.sim.control.client import send_request
from agent.sim.kubelet import EventKind
from agent.sim.kubelet.health import DeviceHealthRecord, DeviceHealthState
from agent.sim.kubelet.registration import (
    KUBELET_1_36_HEALTH_SERVICES,
    SUPPORTED_HEALTH_SERVICES,
)
from tests.integration.conftest import DRIVER, NODE, AgentHarness, cluster

pytestmark = pytest.mark.anyio

HEALTHY, UNHEALTHY = DeviceHealthState.HEALTHY, DeviceHealthState.UNHEALTHY
KUBELETS = {
    "1.36": (KUBELET_1_36_HEALTH_SERVICES, api.HEALTH_V1ALPHA1_SERVICE),
    "1.37": (SUPPORTED_HEALTH_SERVICES, api.HEALTH_V1_SERVICE),
}


@pytest.fixture(scope="module", params=sorted(KUBELETS))
async def kubelet_version(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[str, AgentHarness]]:
    """A fresh cluster whose kubelet emulator consumes what kubelet ``request.param`` does,
    with the agent running and every GPU reported healthy."""
    services, _ = KUBELETS[request.param]
    workdir = Path(tempfile.mkdtemp(prefix="gh-", dir="/tmp"))
    try:
        async with cluster(workdir, health_services=services) as harness:
            await harness.start_agent()
            for i in range(8):
                await harness.kubelet.wait_health(DRIVER, NODE, f"gpu-{i}", HEALTHY, timeout=10)
            yield request.param, harness
            assert await harness.stop_agent() == 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def latest(harness: AgentHarness, device: str) -> DeviceHealthRecord:
    [record] = [r for r in harness.kubelet.health_reports(DRIVER)[-1].devices if r.device == device]
    return record


async def test_the_kubelets_health_service_is_chosen_and_streamed(
    kubelet_version: tuple[str, AgentHarness],
) -> None:
    version, harness = kubelet_version
    _, service = KUBELETS[version]
    [registration] = harness.kubelet.registrations(DRIVER)
    assert registration.supported_versions[-2:] == (
        api.HEALTH_V1ALPHA1_SERVICE,
        api.HEALTH_V1_SERVICE,
    )
    assert registration.health_service == service
    opened = harness.kubelet.events(EventKind.HEALTH_STREAM_OPENED, DRIVER)
    assert opened and all(f"service={service}" in e.message for e in opened)
    report = harness.kubelet.health_reports(DRIVER)[-1]
    assert len(report.devices) == 8
    for record in report.devices:
        assert record.timeout == 30
        assert record.message.endswith("no active fault"), record.message


@pytest.mark.parametrize(
    ("gpu", "xid", "meaning"),
    [
        (2, 62, "XID 62: internal micro-controller halt"),
        (4, 79, "XID 79: GPU has fallen off the bus"),
        (6, 4242, "XID 4242: not in the agent's table"),
    ],
)
async def test_an_xid_reaches_the_kubelet_with_its_meaning(
    kubelet_version: tuple[str, AgentHarness], gpu: int, xid: int, meaning: str
) -> None:
    _, harness = kubelet_version
    request = {"op": "xid", "gpu": str(gpu), "xid": xid}
    reply = await send_request(control_socket_path(harness.plugin_dir), request)
    assert reply["delivered"] == 1
    device = f"gpu-{gpu}"
    await harness.kubelet.wait_health(DRIVER, NODE, device, UNHEALTHY, timeout=5)
    record = latest(harness, device)
    assert record.message.startswith(meaning), record.message
    assert len(record.message) <= 1024
    assert record.timeout == 30
    assert latest(harness, "gpu-0").health is HEALTHY
