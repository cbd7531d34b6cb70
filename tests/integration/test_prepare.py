"""The real agent process driven by the kubelet emulator: registration, prepare, unprepare,
and every way a claim can be refused. Claims are allocated by the allocator (as kube-scheduler
would); only the negative cases that need an allocation no scheduler writes name devices."""

from __future__ import annotations

import pytest

from agent.sim.allocation import claim_from_request
from agent.sim.claims import PodReference
from agent.sim.kubelet import ClaimRef
from tests.integration.conftest import (
    DRIVER,
    NAMESPACE,
    NODE,
    AgentHarness,
    allocated_devices,
    gpu_request,
)

MEMORY_80GI = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0"
SAME_NUMA = [{"matchAttribute": "resource.kubernetes.io/numaNode"}]

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
    ref, claim = await harness.allocate(gpu_request(selectors=[MEMORY_80GI]))
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
    # allocationMode All: every GPU of the node, so no earlier test may still hold one
    ref, claim = await harness.allocate(gpu_request("all", all_devices=True))
    assert sorted(allocated_devices(claim)) == [f"gpu-{i}" for i in range(8)]
    first = (await harness.prepare(ref))[ref.uid]
    assert first.error == ""
    assert sorted(d.device_name for d in first.devices) == [f"gpu-{i}" for i in range(8)]
    assert {tuple(d.request_names) for d in first.devices} == {("all",)}
    spec = harness.cdi_spec_path(ref.uid)
    spec.unlink()  # someone deleted the CDI file: a re-prepare must recreate it
    second = (await harness.prepare(ref))[ref.uid]
    assert second.error == ""
    assert [bytes(d) for d in second.devices] == [bytes(d) for d in first.devices]
    assert spec.exists()
    harness.assert_consistent()
    assert (await harness.unprepare(ref))[ref.uid].error == ""


async def test_unprepare_twice_and_unknown_claim(harness: AgentHarness) -> None:
    ref, _ = await harness.allocate(gpu_request())
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
    ref, _ = await harness.allocate(gpu_request())
    stale = ClaimRef(
        namespace=ref.namespace, name=ref.name, uid="6ba7b811-9dad-11d1-80b4-00c04fd430c8"
    )
    error = (await harness.prepare(stale))[stale.uid].error
    assert "got replaced" in error


async def test_unallocated_claim_is_refused(harness: AgentHarness) -> None:
    # created, but the scheduler has not allocated it
    ref = await harness.pending(gpu_request(), name="unallocated")
    error = (await harness.prepare(ref))[ref.uid].error
    assert "is not allocated" in error


async def test_claim_for_another_nodes_pool_is_refused(harness: AgentHarness) -> None:
    # names devices on purpose: the allocator would never give this node's kubelet a claim
    # allocated from another node's pool, which is what the agent must refuse
    ref = await harness.claim(["gpu-3"], pool="node-b")
    error = (await harness.prepare(ref))[ref.uid].error
    assert "allocated for another node" in error


async def test_two_claims_on_one_exclusive_device(harness: AgentHarness) -> None:
    first, claim = await harness.allocate(gpu_request())
    [device] = allocated_devices(claim)
    # names the device on purpose: the allocator never gives one exclusive device to two
    # claims; the agent must still refuse it when a broken scheduler or a stale copy does
    second = await harness.claim([device], reserved_for=[PodReference("other-pod")])
    assert (await harness.prepare(first))[first.uid].error == ""
    error = (await harness.prepare(second))[second.uid].error
    assert device in error
    assert (await harness.unprepare(first))[first.uid].error == ""
    assert (await harness.prepare(second))[second.uid].error == ""  # free again
    assert (await harness.unprepare(second))[second.uid].error == ""


async def test_invalid_opaque_config_is_refused(harness: AgentHarness) -> None:
    parameters = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "NoSuchConfig"}
    config = [{"opaque": {"driver": DRIVER, "parameters": parameters}}]
    ref, claim = await harness.allocate(gpu_request(), config=config)
    # the scheduler copies the claim's config into the allocation
    assert claim["status"]["allocation"]["devices"]["config"][0]["source"] == "FromClaim"
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
    good, _ = await harness.allocate(gpu_request())
    bad = ClaimRef(namespace=NAMESPACE, name="missing", uid="6ba7b812-9dad-11d1-80b4-00c04fd430c8")
    results = await harness.prepare(good, bad)
    assert results[good.uid].error == "" and results[bad.uid].error != ""
    assert (await harness.unprepare(good, bad))[good.uid].error == ""
    harness.assert_consistent()


async def test_kubelet_runs_a_pod_whose_claims_the_allocator_places(harness: AgentHarness) -> None:
    # a pod with two claims: four GPUs on one NUMA node (a new claim) and one more GPU (a
    # claim already stored, still unallocated); the emulator allocates, then prepares both
    await harness.pending(gpu_request(), name="pod-single")
    four = claim_from_request("pod-four", gpu_request(count=4), constraints=SAME_NUMA)
    pod = await harness.run_pod("trainer", [four, "pod-single"])
    assert pod.errors() == {}
    [four_claim, single_claim] = pod.claims
    numa = {
        await harness.device_attribute(d, "resource.kubernetes.io/numaNode")
        for d in allocated_devices(four_claim)
    }
    assert len(allocated_devices(four_claim)) == 4 and len(numa) == 1
    assert not set(allocated_devices(single_claim)) & set(allocated_devices(four_claim))
    for claim, ref in zip(pod.claims, pod.refs, strict=True):
        answer = pod.results[DRIVER][ref.uid]
        assert sorted(d.device_name for d in answer.devices) == sorted(allocated_devices(claim))
        assert harness.cdi_spec_path(ref.uid).exists()
        assert pod.cdi_device_ids()[ref.name]
    harness.assert_consistent()

    answers = await harness.kubelet.end_pod(pod)
    assert {uid: a.error for uid, a in answers[DRIVER].items()} == {r.uid: "" for r in pod.refs}
    assert harness.checkpoint_claims() == {}
    for ref in pod.refs:  # released: unreserved and deallocated, the devices free again
        stored = harness.server.get_object("resourceclaims", ref.name, NAMESPACE)
        assert stored is not None and "allocation" not in stored.get("status", {})
    everything, _ = await harness.allocate(gpu_request("all", all_devices=True))
    assert (await harness.prepare(everything))[everything.uid].error == ""
