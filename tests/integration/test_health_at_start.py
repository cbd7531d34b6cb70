"""Health from the first moment: the agent opens the kubelet's sockets before its API client
exists (the HTTP stack loads while the kubelet registers the plugin), and an XID in that window
must not be lost. The NVML event monitor starts before the sockets; what it decides reaches
the kubelet's health stream at once and the ResourceSlices and Events once the API server
answers.

The API server is made slow for the agent's start-up reads (``/version`` and the Node GET,
which ``agent.api_side`` waits for, at most 5 s each), so the XID below is injected after the
registration and before the agent has an API client.
"""

from __future__ import annotations

import anyio
import pytest

from agent.sim.kubelet.health import DeviceHealthState
from tests.integration.conftest import DRIVER, NAMESPACE, NODE, AgentHarness
from tests.integration.test_health import inject, wait_taints

pytestmark = pytest.mark.anyio

SLOW = 4.0  # seconds of latency on each start-up read (agent.api_side waits at most 5 s)


async def test_an_xid_before_the_api_client_exists_reaches_kubelet_slices_and_events(
    fresh_harness: AgentHarness,
) -> None:
    harness = fresh_harness
    faults = harness.server.faults
    faults.add_latency("GET", "/version", SLOW, count=1)
    faults.add_latency("GET", f"/api/v1/nodes/{NODE}", SLOW, count=1)
    await harness.start_agent()  # returns at the registration

    await inject(harness, "xid", 5, xid=79)
    await harness.kubelet.wait_health(DRIVER, NODE, "gpu-5", DeviceHealthState.UNHEALTHY, timeout=3)
    # nothing is published yet: the API side still waits for its start-up reads
    assert not harness.server.list_objects("resourceslices"), "the XID came too late to test"

    # the taint reaches the slice once the API client exists, and the Event is posted once
    await wait_taints(harness, "gpu-5", [("gpu.nvidia.com/xid", "79", "NoExecute")], timeout=15)

    def xid_events() -> list[str]:
        return [
            e["message"]
            for e in harness.server.list_objects("events", NAMESPACE)
            if e.get("reason") == "GpuUnhealthy" and "gpu-5" in e.get("message", "")
        ]

    with anyio.fail_after(5):
        while not xid_events():  # noqa: ASYNC110
            await anyio.sleep(0.05)
    await anyio.sleep(0.5)
    assert len(xid_events()) == 1, xid_events()
    assert await harness.stop_agent() == 0, harness.agent.log() if harness.agent else ""
