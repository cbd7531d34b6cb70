"""The real agent process driven by the kubelet emulator: registration, prepare, unprepare,
and every way a claim can be refused."""

from __future__ import annotations

import pytest

from agent.sim.claims import OpaqueConfig, PodReference
from agent.sim.kubelet import ClaimRef
from tests.integration.conftest import DRIVER, NAMESPACE, NODE, AgentHarness

pytestmark = pytest.mark.anyio


async def test_registration(harness: AgentHarness) -> None:
    [registration] = harness.kubelet.registrations(DRIVER)
    assert registration.endpoint == str(harness.dra_socket)
    assert registration.dra_service == "v1.DRAPlugin"
    assert registration.supported_versions == (
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1alpha1.DRAResourceHealth",
        "v1.DRAResourceHealth",
    )
    assert harness.registration_socket.is_socket()


async def test_slices_are_published(harness: AgentHarness) -> None:
    slices = await harness.wait_slices()
    names = {d["name"] for s in slices for d in s["spec"].get("devices", [])}
    assert {f"gpu-{i}" for i in range(8)} <= names
    assert {s["spec"]["nodeName"] for s in slices} == {NODE}


async def test_prepare_one_gpu(harness: AgentHarness) -> None:
    # one H100 with 80Gi, as a user asks for it; the allocator (as kube-scheduler) picks it
    memory = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0"
    request = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": "gpu.nvidia.com",
            "selectors": [{"cel": {"expression": memory}}],
        },
    }
    ref, claim = await harness.allocate(request)
    [chosen] = claim["status"]["allocation"]["devices"]["results"]
    results = await harness.prepare(ref)
    result = results[ref.uid]
    assert result.error == ""
    [device] = result.devices
    assert (device.pool_name, device.device_name) == (NODE, chosen["device"])
    assert device.request_names == ["gpu"]
    assert any(ref.uid in cdi_id for cdi_id in device.cdi_device_ids)
    assert harness.cdi_spec_path(ref.uid).exists()
    harness.assert_consistent()
    assert (await harness.unprepare(ref))[ref.uid].error == ""


async def test_prepare_eight_gpus_then_again_gives_the_same_answer(harness: AgentHarness) -> None:
    ref = await harness.claim([f"gpu-{i}" for i in range(8)], request="all")
    first = (await harness.prepare(ref))[ref.uid]
    assert first.error == ""
    assert sorted(d.device_name for d in first.devices) == [f"gpu-{i}" for i in range(8)]
    spec = harness.cdi_spec_path(ref.uid)
    spec.unlink()  # someone deleted the CDI file: a re-prepare must recreate it
    second = (await harness.prepare(ref))[ref.uid]
    assert second.error == ""
    assert [bytes(d) for d in second.devices] == [bytes(d) for d in first.devices]
    assert spec.exists()
    harness.assert_consistent()
    assert (await harness.unprepare(ref))[ref.uid].error == ""


async def test_unprepare_twice_and_unknown_claim(harness: AgentHarness) -> None:
    ref = await harness.claim(["gpu-1"])
    assert (await harness.prepare(ref))[ref.uid].error == ""
    assert (await harness.unprepare(ref))[ref.uid].error == ""
    assert (await harness.unprepare(ref))[ref.uid].error == ""
    assert ref.uid not in harness.checkpoint_claims()
    assert not harness.cdi_spec_path(ref.uid).exists()
    never = ClaimRef(
        namespace=NAMESPACE, name="never-prepared", uid="1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    )
    assert (await harness.unprepare(never))[never.uid].error == ""


async def test_unknown_claim_is_refused(harness: AgentHarness) -> None:
    ref = ClaimRef(
        namespace=NAMESPACE, name="does-not-exist", uid="6ba7b810-9dad-11d1-80b4-00c04fd430c8"
    )
    error = (await harness.prepare(ref))[ref.uid].error
    assert "does-not-exist" in error and "does not exist" in error


async def test_uid_mismatch_is_refused(harness: AgentHarness) -> None:
    ref = await harness.claim(["gpu-2"])
    stale = ClaimRef(
        namespace=ref.namespace, name=ref.name, uid="6ba7b811-9dad-11d1-80b4-00c04fd430c8"
    )
    error = (await harness.prepare(stale))[stale.uid].error
    assert "got replaced" in error


async def test_unallocated_claim_is_refused(harness: AgentHarness) -> None:
    ref = await harness.claim(["gpu-2"], name="unallocated")
    stored = harness.server.get_object("resourceclaims", "unallocated", NAMESPACE)
    assert stored is not None
    stored["status"] = {}
    harness.server.put_object(stored)
    error = (await harness.prepare(ref))[ref.uid].error
    assert "is not allocated" in error


async def test_claim_for_another_nodes_pool_is_refused(harness: AgentHarness) -> None:
    ref = await harness.claim(["gpu-3"], pool="node-b")
    error = (await harness.prepare(ref))[ref.uid].error
    assert "allocated for another node" in error


async def test_two_claims_on_one_exclusive_device(harness: AgentHarness) -> None:
    first = await harness.claim(["gpu-4"])
    second = await harness.claim(["gpu-4"], reserved_for=[PodReference("other-pod")])
    assert (await harness.prepare(first))[first.uid].error == ""
    error = (await harness.prepare(second))[second.uid].error
    assert "gpu-4" in error
    assert (await harness.unprepare(first))[first.uid].error == ""
    assert (await harness.prepare(second))[second.uid].error == ""  # free again
    assert (await harness.unprepare(second))[second.uid].error == ""


async def test_invalid_opaque_config_is_refused(harness: AgentHarness) -> None:
    config = OpaqueConfig(
        parameters={"apiVersion": "resource.nvidia.com/v1beta1", "kind": "NoSuchConfig"},
        driver=DRIVER,
    )
    ref = await harness.claim(["gpu-5"], configs=[config])
    error = (await harness.prepare(ref))[ref.uid].error
    assert error and "NoSuchConfig" in error
    assert not harness.cdi_spec_path(ref.uid).exists()


async def test_path_like_uid_is_refused_and_writes_nothing(harness: AgentHarness) -> None:
    before = sorted(p.name for p in harness.cdi_root.iterdir())
    ref = ClaimRef(namespace=NAMESPACE, name="evil", uid="../../etc")
    error = (await harness.prepare(ref))[ref.uid].error
    assert "not a Kubernetes UID" in error
    assert (await harness.unprepare(ref))[ref.uid].error != ""
    assert sorted(p.name for p in harness.cdi_root.iterdir()) == before
    assert not (harness.workdir / "etc").exists()


async def test_batch_with_good_and_bad_claims(harness: AgentHarness) -> None:
    good = await harness.claim(["gpu-6"])
    bad = ClaimRef(namespace=NAMESPACE, name="missing", uid="6ba7b812-9dad-11d1-80b4-00c04fd430c8")
    results = await harness.prepare(good, bad)
    assert results[good.uid].error == "" and results[bad.uid].error != ""
    assert (await harness.unprepare(good, bad))[good.uid].error == ""
    harness.assert_consistent()
