"""KEP-5075 shares through the engine: several claims on one device, each its own CDI device
and share_id; whole-device claims and shares exclude each other; restarts keep the shares."""

from __future__ import annotations

import uuid

import pytest

from agent.node.engine import PrepareEngine
from agent.node.types import ClaimRef
from agent.sim.claims import AllocatedDevice
from tests.unit.node.engine_support import DRIVER, NODE, Node

pytestmark = pytest.mark.anyio


def share(device: str, memory: str, request: str = "gpu") -> AllocatedDevice:
    return AllocatedDevice(
        request, device, NODE, share_id=str(uuid.uuid4()), consumed={"memory": memory}
    )


async def test_three_shares_of_one_gpu_at_once(node: Node, engine: PrepareEngine) -> None:
    shares = [share("gpu-0", m) for m in ("20Gi", "20Gi", "40Gi")]
    refs = [await node.claim(f"s{i}", [s]) for i, s in enumerate(shares)]
    results = await engine.prepare(refs)
    for ref, allocated in zip(refs, shares, strict=True):
        result = results[ref.uid]
        assert result.error is None, result.error
        (device,) = result.devices
        assert device.device_name == "gpu-0"
        assert device.share_id == allocated.share_id
        cdi_name = f"{ref.uid}-gpu-0-{allocated.share_id}"
        assert device.cdi_device_ids[1] == f"k8s.{DRIVER}/claim={cdi_name}"
        (entry,) = node.spec(ref.uid)["devices"]
        assert entry["name"] == cdi_name
        assert entry["containerEdits"]["deviceNodes"] == [
            {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}
        ]
        recorded = node.checkpoint_claims()[ref.uid]["devices"][0]
        assert recorded["shareID"] == allocated.share_id
        assert recorded["consumedCapacity"] == allocated.consumed
    node.assert_consistent()
    await engine.unprepare(refs[:2])
    assert set(node.checkpoint_claims()) == {refs[2].uid}
    node.assert_consistent()


async def test_two_shares_of_one_device_in_one_claim(node: Node, engine: PrepareEngine) -> None:
    a, b = share("gpu-1", "1Gi", "a"), share("gpu-1", "2Gi", "b")
    ref = await node.claim("both", [a, b])
    result = (await engine.prepare([ref]))[ref.uid]
    assert result.error is None, result.error
    assert [d.share_id for d in result.devices] == [a.share_id, b.share_id]
    assert len(node.spec(ref.uid)["devices"]) == 2


async def test_whole_device_and_shares_exclude_each_other(
    node: Node, engine: PrepareEngine
) -> None:
    whole = await node.claim("whole", ["gpu-2"])  # prepared before the switch to shares
    first = await node.claim("first", [share("gpu-2", "1Gi")])
    assert (await engine.prepare([whole]))[whole.uid].error is None
    refused = (await engine.prepare([first]))[first.uid].error or ""
    assert "as a whole device" in refused and "default/whole" in refused
    await engine.unprepare([whole])
    assert (await engine.prepare([first]))[first.uid].error is None
    again = await node.claim("again", ["gpu-2"])
    refused = (await engine.prepare([again]))[again.uid].error or ""
    assert "is shared by claim default/first" in refused
    await engine.unprepare([first])
    assert (await engine.prepare([again]))[again.uid].error is None


async def test_shares_survive_a_restart(node: Node, engine: PrepareEngine) -> None:
    refs: list[ClaimRef] = []
    for i in range(2):
        refs.append(await node.claim(f"r{i}", [share("gpu-4", "8Gi")]))
    first = await engine.prepare(refs)
    await engine.close()
    restarted = node.engine()
    await restarted.start()
    try:
        node.spec_path(refs[0].uid).unlink()  # CDI specs live in a tmpfs: rebuilt from the record
        again = await restarted.prepare(refs)
        for ref in refs:
            assert again[ref.uid] == first[ref.uid]
        assert node.spec(refs[0].uid)["devices"][0]["name"].endswith(
            first[refs[0].uid].devices[0].share_id or "?"
        )
    finally:
        await restarted.close()


async def test_a_bad_share_id_is_refused(node: Node, engine: PrepareEngine) -> None:
    bad = AllocatedDevice("gpu", "gpu-5", NODE, share_id="../x", consumed={"memory": "1Gi"})
    ref = await node.claim("bad", [bad])
    error = (await engine.prepare([ref]))[ref.uid].error or ""
    assert "shareID: '../x' is not a UID" in error
