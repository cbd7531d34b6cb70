"""Shares of a dynamic MIG placement with the real agent (``run --simulate dgx-h100
--dynamic-mig --consumable-shares memory``), the allocator and the kubelet emulator over real
gRPC, and ``gpu-dra-agent sim state`` reading the simulated host's MIG state.

Two claims of 16Gi each of a 3g.40gb placement (39.5Gi), allocated by the allocator (the counters are
consumed once, so both land on the same placement) and prepared in one NodePrepareResources
call: one GPU instance, two CDI devices with the same MIG UUID and ``share_id``s equal to the
allocations' ``shareID``s; unpreparing one keeps the instance, unpreparing the other destroys
it and MIG mode goes back off.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.conftest import AgentHarness, allocated_devices
from tests.integration.test_mig import instances, mig_mode, mig_request, placement, sim_state

pytestmark = pytest.mark.anyio
ARGS = ("--dynamic-mig", "true", "--consumable-shares", "memory")


def share_request(memory: str, gpu_uuid: str) -> dict[str, Any]:
    request = mig_request("3g.40gb", gpu_uuid=gpu_uuid)
    request["exactly"]["capacity"] = {"requests": {"memory": memory}}
    return request


async def test_two_claims_share_one_mig_instance(fresh_harness: AgentHarness) -> None:
    harness = fresh_harness
    await harness.start_agent(args=ARGS)
    slices = await harness.wait_slices()
    [slot] = [
        d
        for s in slices
        for d in s["spec"].get("devices", [])
        if d["name"] == "gpu-1-mig-3g40gb-9-0"
    ]
    assert slot["allowMultipleAllocations"] is True and slot["consumesCounters"]
    gpu1 = await harness.device_attribute("gpu-1", "uuid")
    refs, claims = [], []
    for name in ("left", "right"):
        ref, claim = await harness.allocate(share_request("16Gi", gpu1), name=name)
        refs.append(ref)
        claims.append(claim)
    [[first], [second]] = [c["status"]["allocation"]["devices"]["results"] for c in claims]
    assert first["device"] == second["device"]  # the counters are consumed once
    assert first["shareID"] != second["shareID"]
    [device] = allocated_devices(claims[0])
    minor, start = placement(device)

    answers = await harness.prepare(*refs)  # one call, both shares at once
    cdi: list[str] = []
    for ref, result in zip(refs, (first, second), strict=True):
        answer = answers[ref.uid]
        assert answer.error == ""
        [prepared] = answer.devices
        assert prepared.device_name == device and prepared.share_id == result["shareID"]
        cdi.append(prepared.cdi_device_ids[-1])
    assert len(set(cdi)) == 2
    [(profile, at, _, uuids)] = instances(await sim_state(harness), minor)
    assert (profile, at) == ("3g.40gb", start) and len(uuids) == 1
    specs = [json.loads(harness.cdi_spec_path(r.uid).read_text()) for r in refs]
    held = json.loads(harness.checkpoint_path.read_text())["claims"]
    assert {held[r.uid]["devices"][0]["uuid"] for r in refs} == set(uuids)
    nodes = [s["devices"][0]["containerEdits"]["deviceNodes"] for s in specs]
    assert nodes[0] == nodes[1] and len(nodes[0]) == 3
    assert specs[0]["devices"][0]["name"] != specs[1]["devices"][0]["name"]

    assert (await harness.unprepare(refs[0]))[refs[0].uid].error == ""
    state = await sim_state(harness)
    assert [i[3] for i in instances(state, minor)] == [uuids] and mig_mode(state, minor) == 1
    assert (await harness.unprepare(refs[1]))[refs[1].uid].error == ""
    state = await sim_state(harness)
    assert instances(state, minor) == [] and mig_mode(state, minor) == 0
    harness.assert_consistent()
    assert harness.checkpoint_claims() == {}
    assert await harness.stop_agent() == 0
