"""Kill the agent at every step of a prepare and an unprepare; the restarted agent must finish
the kubelet's retry and leave the checkpoint and the CDI directory in agreement.

``GPU_DRA_AGENT_CRASH_AT=<point>`` makes the agent process send itself SIGKILL at that
step (no cleanup; a power cut for the agent's files). Each test starts the agent with the
variable, lets it die, restarts it without, and retries as the kubelet would.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from agent.crash import CRASH_POINTS, ENV_VAR, EXIT_STATUS
from agent.sim.kubelet import DraCallError
from tests.integration.conftest import (
    NAMESPACE,
    NODE,
    AgentHarness,
    allocated_devices,
    gpu_request,
)

pytestmark = pytest.mark.anyio

PREPARE_POINTS = [p for p in CRASH_POINTS if not p.startswith("unprepare-")]
UNPREPARE_POINTS = [p for p in CRASH_POINTS if p.startswith("unprepare-")]


@pytest.fixture(scope="module")
async def crash_harness(fresh_harness: AgentHarness) -> AgentHarness:
    return fresh_harness


async def _restart(harness: AgentHarness) -> None:
    assert harness.agent is not None
    assert await harness.agent.wait() == EXIT_STATUS, harness.agent.log()
    await harness.start_agent()


def test_every_crash_point_is_covered() -> None:
    assert set(PREPARE_POINTS) | set(UNPREPARE_POINTS) == set(CRASH_POINTS)
    assert len(PREPARE_POINTS) == 4 and len(UNPREPARE_POINTS) == 2


@pytest.mark.parametrize("point", PREPARE_POINTS)
async def test_crash_during_prepare(crash_harness: AgentHarness, point: str) -> None:
    harness = crash_harness
    await harness.start_agent({ENV_VAR: point})
    ref, claim = await harness.allocate(gpu_request(count=2), name=f"crash-{point}")
    with pytest.raises(DraCallError):
        await harness.prepare(ref)
    await _restart(harness)
    harness.assert_consistent()  # startup repaired whatever the crash left

    result = (await harness.prepare(ref))[ref.uid]  # the kubelet's retry
    assert result.error == ""
    assert sorted(d.device_name for d in result.devices) == sorted(allocated_devices(claim))
    assert harness.cdi_spec_path(ref.uid).exists()
    harness.assert_consistent()

    assert (await harness.unprepare(ref))[ref.uid].error == ""
    assert harness.checkpoint_claims() == {} and harness.cdi_claim_uids() == set()
    assert await harness.stop_agent() == 0


@pytest.mark.parametrize("point", UNPREPARE_POINTS)
async def test_crash_during_unprepare(crash_harness: AgentHarness, point: str) -> None:
    harness = crash_harness
    await harness.start_agent({ENV_VAR: point})
    ref, claim = await harness.allocate(gpu_request(), name=f"crash-{point}")
    [device] = allocated_devices(claim)
    assert (await harness.prepare(ref))[ref.uid].error == ""
    with pytest.raises(DraCallError):
        await harness.unprepare(ref)
    await _restart(harness)
    harness.assert_consistent()

    assert (await harness.unprepare(ref))[ref.uid].error == ""  # the kubelet's retry
    assert harness.checkpoint_claims() == {} and harness.cdi_claim_uids() == set()
    # the device is free again: once the claim is gone it can be allocated and prepared anew
    await harness.delete_claims()
    uuid = await harness.device_attribute(device, "uuid")
    pinned = gpu_request(selectors=[f"device.attributes['gpu.nvidia.com'].uuid == '{uuid}'"])
    again, claim = await harness.allocate(pinned, name=f"again-{point}")
    assert allocated_devices(claim) == [device]
    assert (await harness.prepare(again))[again.uid].error == ""
    assert (await harness.unprepare(again))[again.uid].error == ""
    assert await harness.stop_agent() == 0


async def test_corrupt_checkpoint_is_quarantined_with_a_warning_event(
    crash_harness: AgentHarness,
) -> None:
    harness = crash_harness
    harness.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
    harness.checkpoint_path.write_text('{"schemaVersion": 1, "claims": [trunc')
    await harness.start_agent()
    quarantined = list(harness.checkpoint_path.parent.glob("*.corrupt-*"))
    assert len(quarantined) == 1
    assert quarantined[0].read_text().startswith('{"schemaVersion": 1')

    def warnings() -> list[dict[str, Any]]:
        return [
            e
            for e in harness.server.list_objects("events", NAMESPACE)
            if e["involvedObject"].get("kind") == "Node"
            and e["involvedObject"]["name"] == NODE
            and e["type"] == "Warning"
        ]

    # posted once the API client exists, which may be just after the registration
    with anyio.move_on_after(5):
        while not warnings():  # noqa: ASYNC110
            await anyio.sleep(0.05)
    assert warnings(), json.dumps(harness.server.list_objects("events", NAMESPACE), indent=1)

    ref, _ = await harness.allocate(gpu_request(), name="after-corruption")  # still serving
    assert (await harness.prepare(ref))[ref.uid].error == ""
    assert (await harness.unprepare(ref))[ref.uid].error == ""
    assert await harness.stop_agent() == 0
