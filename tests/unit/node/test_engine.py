"""Prepare and unprepare through the engine: answers, files on disk, refusals."""

from __future__ import annotations

import json

import pytest

from agent.node.checkpoint import Checkpoint
from agent.node.checkpoint_store import CheckpointStore
from agent.node.engine import PrepareEngine
from agent.node.types import ClaimRef
from agent.sim.claims import AllocatedDevice, OpaqueConfig, claim_manifest
from tests.unit.node.engine_support import DRIVER, NODE, Node, files_under

pytestmark = pytest.mark.anyio
COMMON_ID = f"k8s.{DRIVER}/claim=common"


async def test_prepare_one_gpu(node: Node, engine: PrepareEngine) -> None:
    ref = await node.claim("one", ["gpu-3"])
    results = await engine.prepare([ref])
    result = results[ref.uid]
    assert result.error is None
    (device,) = result.devices
    assert device.request_names == ("gpu",)
    assert (device.pool_name, device.device_name) == (NODE, "gpu-3")
    assert device.cdi_device_ids == (COMMON_ID, f"k8s.{DRIVER}/claim={ref.uid}-gpu-3")
    spec = node.spec(ref.uid)
    assert spec["kind"] == f"k8s.{DRIVER}/claim"
    (cdi_device,) = spec["devices"]
    assert cdi_device["name"] == f"{ref.uid}-gpu-3"
    assert cdi_device["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia3", "type": "c", "major": 195, "minor": 3}
    ]
    on_disk = node.checkpoint_claims()[ref.uid]
    assert on_disk["state"] == "PrepareCompleted"
    assert [d["device"] for d in on_disk["devices"]] == ["gpu-3"]
    common = json.loads((node.cdi_root / f"k8s.{DRIVER}-common.json").read_text())
    paths = [n["path"] for n in common["devices"][0]["containerEdits"]["deviceNodes"]]
    assert "/dev/nvidiactl" in paths


async def test_prepare_eight_gpus_in_one_claim(node: Node, engine: PrepareEngine) -> None:
    names = [f"gpu-{i}" for i in range(8)]
    ref = await node.claim("eight", names)
    result = (await engine.prepare([ref]))[ref.uid]
    assert result.error is None
    assert [d.device_name for d in result.devices] == names
    assert len(node.spec(ref.uid)["devices"]) == 8
    node.assert_consistent()


async def test_eight_claims_in_one_request_cost_two_checkpoint_writes(
    node: Node, engine: PrepareEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    refs = [await node.claim(f"c{i}", [f"gpu-{i}"]) for i in range(8)]
    saves: list[int] = []
    original = CheckpointStore.save

    def counting_save(self: CheckpointStore, checkpoint: Checkpoint) -> None:
        saves.append(len(checkpoint.claims))
        original(self, checkpoint)

    monkeypatch.setattr(CheckpointStore, "save", counting_save)
    results = await engine.prepare(refs)
    assert all(r.error is None for r in results.values())
    assert [r.devices[0].device_name for r in results.values()] == [f"gpu-{i}" for i in range(8)]
    assert saves == [8, 8]
    node.assert_consistent()
    assert set(node.checkpoint_claims()) == {ref.uid for ref in refs}


async def test_empty_request(engine: PrepareEngine) -> None:
    assert await engine.prepare([]) == {}
    assert await engine.unprepare([]) == {}


async def test_prepare_again_returns_the_same_answer_and_recreates_the_spec(
    node: Node, engine: PrepareEngine
) -> None:
    ref = await node.claim("again", ["gpu-1", "gpu-2"])
    first = await engine.prepare([ref])
    node.api.delete_object("resourceclaims", "again", "default")  # not read again
    node.spec_path(ref.uid).unlink()
    second = await engine.prepare([ref])
    assert second == first
    assert len(node.spec(ref.uid)["devices"]) == 2
    node.spec_path(ref.uid).write_text("{damaged")
    assert await engine.prepare([ref]) == first
    assert len(node.spec(ref.uid)["devices"]) == 2


async def test_unprepare_twice_and_unknown_claims(node: Node, engine: PrepareEngine) -> None:
    ref = await node.claim("gone", ["gpu-0"])
    assert (await engine.prepare([ref]))[ref.uid].error is None
    node.api.delete_object("resourceclaims", "gone", "default")  # unprepare needs no claim
    unknown = ClaimRef("default", "4f0c9d1e-0000-4000-8000-000000000001", "never-seen")
    weird = ClaimRef("default", "../../etc", "weird")
    assert await engine.unprepare([ref, unknown, weird]) == {
        ref.uid: None,
        unknown.uid: None,
        weird.uid: None,
    }
    assert not node.spec_path(ref.uid).exists()
    assert node.checkpoint_claims() == {}
    assert await engine.unprepare([ref]) == {ref.uid: None}
    node.assert_consistent()


async def test_refusals_name_the_problem_and_spare_the_other_claims(
    node: Node, engine: PrepareEngine
) -> None:
    good = await node.claim("good", ["gpu-0"])
    replaced = await node.claim("replaced", ["gpu-1"])
    stale = ClaimRef("default", "0d9e8f7a-1111-4222-8333-444455556666", "replaced")
    other_pool = await node.claim("elsewhere", [AllocatedDevice("gpu", "gpu-2", "node-2")])
    missing = await node.claim("missing", ["gpu-42"])
    node.api.put_object(claim_manifest("unallocated", [AllocatedDevice("gpu", "gpu-3", NODE)]))
    unallocated_uid = node.api.get_object("resourceclaims", "unallocated", "default")
    assert unallocated_uid is not None
    unallocated = ClaimRef("default", unallocated_uid["metadata"]["uid"], "unallocated")
    absent = ClaimRef("default", "0d9e8f7a-2222-4222-8333-444455556666", "absent")
    results = await engine.prepare([good, stale, other_pool, missing, unallocated, absent])
    assert results[good.uid].error is None
    assert "got replaced" in (results[stale.uid].error or "")
    assert replaced.uid in (results[stale.uid].error or "")
    assert "pool node-1" in (results[other_pool.uid].error or "")
    assert "node-2" in (results[other_pool.uid].error or "")
    assert "gpu-42" in (results[missing.uid].error or "")
    assert "not allocated" in (results[unallocated.uid].error or "")
    assert "does not exist" in (results[absent.uid].error or "")
    node.assert_consistent()
    assert set(node.checkpoint_claims()) == {good.uid}


async def test_a_device_is_held_by_one_claim_unless_admin_access(
    node: Node, engine: PrepareEngine
) -> None:
    first = await node.claim("first", ["gpu-5"])
    second = await node.claim("second", ["gpu-5"])
    monitor = await node.claim(
        "monitor", [AllocatedDevice("watch", "gpu-5", NODE, admin_access=True)]
    )
    assert (await engine.prepare([first]))[first.uid].error is None
    refused = (await engine.prepare([second]))[second.uid].error or ""
    assert "gpu-5" in refused and "default/first" in refused and first.uid in refused
    assert (await engine.prepare([monitor]))[monitor.uid].error is None
    await engine.unprepare([first])
    assert (await engine.prepare([second]))[second.uid].error is None


async def test_two_claims_of_one_request_on_one_device(node: Node, engine: PrepareEngine) -> None:
    a = await node.claim("a", ["gpu-6"])
    b = await node.claim("b", ["gpu-6"])
    results = await engine.prepare([a, b])
    assert [r.error is None for r in results.values()].count(True) == 1
    node.assert_consistent()


async def test_invalid_opaque_config_names_the_field(node: Node, engine: PrepareEngine) -> None:
    bad = OpaqueConfig(
        {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharingg": {}}
    )
    ref = await node.claim("typo", ["gpu-0"], configs=[bad])
    error = (await engine.prepare([ref]))[ref.uid].error or ""
    assert "devices.config[0].opaque.parameters.sharingg: unknown field" in error
    assert node.spec_uids() == set()


async def test_request_names_are_base_names(node: Node, engine: PrepareEngine) -> None:
    ref = await node.claim(
        "subrequests",
        [AllocatedDevice("big/h100", "gpu-0", NODE), AllocatedDevice("small", "gpu-1", NODE)],
    )
    result = (await engine.prepare([ref]))[ref.uid]
    assert [d.request_names for d in result.devices] == [("big",), ("small",)]


async def test_a_claim_uid_never_becomes_a_path(node: Node, engine: PrepareEngine) -> None:
    ref = ClaimRef("default", "../../etc", "evil")
    before = set(files_under(node.base))
    error = (await engine.prepare([ref]))[ref.uid].error or ""
    assert "not a canonical lowercase UUID" in error
    assert set(files_under(node.base)) == before
    assert not (node.base / "etc").exists()


async def test_static_mig_device_nodes_come_from_the_host_files(a100_node: Node) -> None:
    engine = a100_node.engine()
    await engine.start()
    try:
        name = "gpu-4-mig-2g20gb-14-4"  # dgx-a100 GPU 4: 3g.40gb@0, 2g.20gb@4, 1g.10gb@6
        ref = await a100_node.claim("mig", [name])
        result = (await engine.prepare([ref]))[ref.uid]
        assert result.error is None
        nodes = a100_node.spec(ref.uid)["devices"][0]["containerEdits"]["deviceNodes"]
        caps = a100_node.host.root / "proc/driver/nvidia/capabilities/gpu4/mig"
        gi_dir = next(
            path.parent
            for path in caps.glob("gi*/access")
            if (path.parent / "ci0/access").exists() and _gi_of(engine, name) == path.parent.name
        )
        gi_minor = _minor(gi_dir / "access")
        ci_minor = _minor(gi_dir / "ci0/access")
        assert nodes == [
            {"path": "/dev/nvidia4", "type": "c", "major": 195, "minor": 4},
            {"path": f"/dev/nvidia-caps/nvidia-cap{gi_minor}", "type": "c", "major": 510,
             "minor": gi_minor},
            {"path": f"/dev/nvidia-caps/nvidia-cap{ci_minor}", "type": "c", "major": 510,
             "minor": ci_minor},
        ]  # fmt: skip
    finally:
        await engine.close()


def _gi_of(engine: PrepareEngine, device: str) -> str:
    facts = engine._facts
    assert facts is not None
    mig = facts.devices[device].mig
    assert mig is not None
    return f"gi{mig.gpu_instance_id}"


def _minor(path: object) -> int:
    text = path.read_text()  # type: ignore[attr-defined]
    return int(text.split("DeviceFileMinor:")[1].split()[0])
