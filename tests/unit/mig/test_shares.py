"""Shares (KEP-5075) of dynamic MIG placements through the real engine and MIG effector, on
the simulated NVML library: one instance for every share of a placement, destroyed with the
last share (also when every share goes in one call), the exclusivity rules with shares, and
startup recovery that keeps an instance a completed share uses while a claim that never
completed names the same placement."""

from __future__ import annotations

import pytest

from agent.hardware import mig_ops
from agent.node import checkpoint as cp
from agent.node.types import ClaimRef
from agent.sim.claims import AllocatedDevice
from tests.unit.mig.test_effector import (
    G0_2G_2,
    G0_3G_0,
    G0_3G_4,
    MigNode,
    mig,
    prepare,
    profile,
)
from tests.unit.node.engine_support import NODE

pytestmark = pytest.mark.anyio
__all__ = ["mig", "profile"]  # the fixtures


def share(device: str, share_id: str) -> AllocatedDevice:
    return AllocatedDevice("gpu", device, NODE, share_id=share_id, consumed={"memory": "20Gi"})


async def shares(mig: MigNode, device: str, *names: str) -> list[ClaimRef]:
    return [await mig.node.claim(name, [share(device, f"share-{name}")]) for name in names]


def instance_ids(mig: MigNode, gpu: int) -> list[tuple[int, int, int]]:
    """(GPU instance id, profile id, start) of every instance of GPU ``gpu``."""
    return [(gi.id, gi.profile_id, gi.start) for gi in mig.layout(gpu).instances]


async def test_two_claims_share_one_instance_until_the_last_goes(mig: MigNode) -> None:
    engine = await mig.engine()
    try:
        first, second = await shares(mig, G0_3G_4, "a", "b")
        results = await engine.prepare([first, second])  # one call: both in flight at once
        assert {uid: r.error for uid, r in results.items()} == {first.uid: None, second.uid: None}
        [(gi, profile, start)] = instance_ids(mig, 0)
        assert (profile, start) == (9, 4)
        claims = engine.checkpoint.claims
        [a], [b] = claims[first.uid].devices, claims[second.uid].devices
        assert a.uuid == b.uuid and a.uuid.startswith("MIG-") and a.mig == b.mig
        assert a.mig is not None and a.mig.gi_id == gi
        assert (a.share_id, b.share_id) == ("share-a", "share-b")
        specs = [mig.node.spec(r.uid)["devices"][0] for r in (first, second)]
        assert specs[0]["name"] != specs[1]["name"]
        assert (
            specs[0]["containerEdits"]["deviceNodes"] == specs[1]["containerEdits"]["deviceNodes"]
        )

        assert await engine.unprepare([first]) == {first.uid: None}
        assert instance_ids(mig, 0) == [(gi, 9, 4)]  # the second share still uses it
        assert await engine.unprepare([second]) == {second.uid: None}
        assert mig.layout(0) == mig_ops.MigLayout(mig.uuid(0), False)  # gone, MIG mode off
        mig.node.assert_consistent()
    finally:
        await engine.close()


async def test_every_share_unprepared_in_one_call_destroys_the_instance(mig: MigNode) -> None:
    engine = await mig.engine()
    try:
        refs = await shares(mig, G0_3G_0, "x", "y", "z")
        for ref in refs:  # one after the other: the later ones find the instance
            assert await prepare(engine, ref) is None
        assert len(instance_ids(mig, 0)) == 1
        assert await engine.unprepare(refs) == {r.uid: None for r in refs}
        assert mig.layout(0) == mig_ops.MigLayout(mig.uuid(0), False)
    finally:
        await engine.close()


async def test_one_claim_with_two_shares_of_a_placement(mig: MigNode) -> None:
    engine = await mig.engine()
    try:
        ref = await mig.node.claim("both", [share(G0_3G_4, "s1"), share(G0_3G_4, "s2")])
        assert await prepare(engine, ref) is None
        assert len(instance_ids(mig, 0)) == 1
        devices = engine.checkpoint.claims[ref.uid].devices
        assert [d.share_id for d in devices] == ["s1", "s2"]
        assert devices[0].uuid == devices[1].uuid and devices[0].mig == devices[1].mig
        assert len(engine.checkpoint.claims[ref.uid].intents) == 1
        assert await engine.unprepare([ref]) == {ref.uid: None}
        assert mig.layout(0).instances == ()
    finally:
        await engine.close()


async def test_shares_still_exclude_overlapping_placements_and_the_whole_gpu(
    mig: MigNode,
) -> None:
    engine = await mig.engine()
    try:
        [first] = await shares(mig, G0_3G_0, "first")
        assert await prepare(engine, first) is None
        overlap = await mig.node.claim("overlap", [share(G0_2G_2, "o")])
        error = (await engine.prepare([overlap]))[overlap.uid].error
        assert f"default/first ({first.uid})" in error and "placement overlaps" in error
        whole = await mig.node.claim("whole", ["gpu-0"])
        error = (await engine.prepare([whole]))[whole.uid].error
        assert "has MIG device" in error and first.uid in error
        dedicated = await mig.node.claim("dedicated", [G0_3G_0])  # the placement, not a share
        error = (await engine.prepare([dedicated]))[dedicated.uid].error
        assert "shared by claim" in error and first.uid in error
        assert len(instance_ids(mig, 0)) == 1  # nothing touched
        assert await engine.unprepare([first]) == {first.uid: None}
    finally:
        await engine.close()


async def test_startup_keeps_an_instance_a_completed_share_uses(mig: MigNode) -> None:
    """What kill -9 in the middle of a second share's prepare leaves: the first share
    completed, the second started with its intent naming the same placement."""
    engine = await mig.engine()
    first, second = await shares(mig, G0_3G_4, "kept", "crashed")
    assert await prepare(engine, first) is None and await prepare(engine, second) is None
    before = instance_ids(mig, 0)
    checkpoint = engine.checkpoint
    await engine.close()
    intents = checkpoint.claims[second.uid].intents
    started = cp.remove_claim(checkpoint, second.uid)
    started = cp.mark_started(started, second.uid, "default", "crashed")
    started = cp.record_intents(started, second.uid, intents)
    mig.node.spec_path(second.uid).unlink()
    mig.node.checkpoint_path.write_bytes(cp.encode(started))
    engine = await mig.engine()
    try:
        assert set(engine.checkpoint.claims) == {first.uid}  # the second rolled back
        assert instance_ids(mig, 0) == before  # the first share's instance stays
        mig.node.assert_consistent()
        assert await prepare(engine, second) is None  # the kubelet's retry finds it again
        assert instance_ids(mig, 0) == before
        claims = engine.checkpoint.claims
        assert claims[first.uid].devices[0].uuid == claims[second.uid].devices[0].uuid
        assert await engine.unprepare([second]) == {second.uid: None}
        assert instance_ids(mig, 0) == before
        assert await engine.unprepare([first]) == {first.uid: None}
        assert mig.layout(0).instances == ()
    finally:
        await engine.close()
