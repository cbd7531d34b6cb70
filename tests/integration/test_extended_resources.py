"""Extended resources backed by DRA (KEP-5004, Kubernetes 1.36) end to end: a pod written for
the device plugin (``nvidia.com/gpu: 2``) in the embedded cluster gets the special claim
kube-scheduler 1.36 makes, the real agent prepares it through the kubelet emulator, and the
DeviceClass's own config (time-slicing) applies, since the claim has none."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.config import SIMULATED_HOST_DIR
from agent.demo.extended import TIME_SLICING as TIME_SLICING_LONG
from agent.hardware.simulated.tools import read_timeslices
from agent.sim.allocation import RESOURCE, api_request
from agent.sim.deviceclasses import default_device_classes
from agent.sim.extended import (
    EXTENDED_RESOURCE_CLAIM_ANNOTATION,
    ExtendedResourceError,
    end_pod,
    pod_manifest,
    start_pod,
)
from tests.integration.conftest import DRIVER, NAMESPACE, NODE, AgentHarness, cluster

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
async def extended() -> AsyncIterator[AgentHarness]:
    """The 1.36 overlay's DeviceClasses, ``gpu.nvidia.com`` with a time-slicing config."""
    workdir = Path(tempfile.mkdtemp(prefix="gx-", dir="/tmp"))
    try:
        async with cluster(workdir) as harness:
            [gpu_class] = [
                c
                for c in default_device_classes(extended_resources=True)
                if c["metadata"]["name"] == "gpu.nvidia.com"
            ]
            gpu_class["spec"]["config"] = [TIME_SLICING_LONG]
            harness.server.put_object(gpu_class)
            await harness.start_agent()
            await harness.wait_slices()
            yield harness
            assert await harness.stop_agent() == 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def uuid_of(harness: AgentHarness, device: str) -> str:
    return str(await harness.device_attribute(device, "uuid"))


async def test_a_legacy_pod_gets_its_gpus_through_dra(extended: AgentHarness) -> None:
    harness = extended
    manifest = pod_manifest(
        "legacy", {"cuda": {"nvidia.com/gpu": "2", "cpu": "1", "memory": "1Gi"}}
    )
    pod, started = await start_pod(harness.api, harness.kubelet, manifest, NODE)

    [claim] = started.claims
    meta = claim["metadata"]
    assert meta["name"].startswith("legacy-extended-resources-")
    assert meta["annotations"] == {EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"}
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "legacy",
            "uid": pod["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    # sorted requests of the container: cpu, memory, nvidia.com/gpu -> index 2
    assert claim["spec"]["devices"] == {
        "requests": [
            {
                "name": "container-0-request-2",
                "exactly": {
                    "deviceClassName": "gpu.nvidia.com",
                    "allocationMode": "ExactCount",
                    "count": 2,
                },
            }
        ]
    }
    assert pod["status"]["extendedResourceClaimStatus"] == {
        "resourceClaimName": meta["name"],
        "requestMappings": [
            {
                "containerName": "cuda",
                "resourceName": "nvidia.com/gpu",
                "requestName": "container-0-request-2",
            }
        ],
    }
    allocation = claim["status"]["allocation"]["devices"]
    assert allocation["config"] == [
        {"source": "FromClass", "requests": ["container-0-request-2"], **TIME_SLICING_LONG}
    ]
    assert started.errors() == {}
    answer = started.results[DRIVER][meta["uid"]]
    devices = [d.device_name for d in answer.devices]
    assert len(devices) == 2
    assert all(list(d.request_names) == ["container-0-request-2"] for d in answer.devices)

    # the class's config applied: both GPUs time-sliced (Long), restored after the pod
    host = harness.plugin_dir / SIMULATED_HOST_DIR
    uuids = [await uuid_of(harness, d) for d in devices]
    assert [read_timeslices(host).get(u) for u in uuids] == [3, 3]

    answers = await end_pod(harness.api, harness.kubelet, started)
    assert answers[DRIVER][meta["uid"]].error == ""
    assert [read_timeslices(host).get(u, 0) for u in uuids] == [0, 0]
    assert harness.server.list_objects("resourceclaims", namespace=NAMESPACE) == []
    harness.assert_consistent()


async def test_a_pod_on_a_device_plugin_node_gets_no_claim(extended: AgentHarness) -> None:
    """Where the node advertises nvidia.com/gpu itself (the device plugin runs there), the
    scheduler leaves the resource to it: the reason never to run both on one node."""
    harness = extended
    node = harness.server.get_object("nodes", NODE)
    node.setdefault("status", {})["allocatable"] = {"nvidia.com/gpu": "8"}
    harness.server.put_object(node)
    try:
        manifest = pod_manifest("plugin-pod", {"cuda": {"nvidia.com/gpu": "1"}})
        with pytest.raises(ExtendedResourceError, match="asks for no extended resource"):
            await start_pod(harness.api, harness.kubelet, manifest, NODE)
        assert harness.server.list_objects("resourceclaims", namespace=NAMESPACE) == []
    finally:
        node["status"].pop("allocatable")
        harness.server.put_object(node)
        async with harness.api.session() as session:
            await api_request(session, "DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/plugin-pod")


async def test_the_implicit_class_name_and_init_containers(extended: AgentHarness) -> None:
    harness = extended
    manifest: dict[str, Any] = pod_manifest(
        "implicit", {"main": {"deviceclass.resource.kubernetes.io/gpu.nvidia.com": "1"}}
    )
    manifest["spec"]["initContainers"] = [
        {"name": "warmup", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    ]
    pod, started = await start_pod(harness.api, harness.kubelet, manifest, NODE)
    [claim] = started.claims
    names = [r["name"] for r in claim["spec"]["devices"]["requests"]]
    assert names == ["container-0-request-0", "container-1-request-0"]
    mappings = pod["status"]["extendedResourceClaimStatus"]["requestMappings"]
    assert [(m["containerName"], m["resourceName"]) for m in mappings] == [
        ("warmup", "nvidia.com/gpu"),
        ("main", "deviceclass.resource.kubernetes.io/gpu.nvidia.com"),
    ]
    assert started.errors() == {}
    await end_pod(harness.api, harness.kubelet, started)
    async with harness.api.session() as session:
        listed = await api_request(
            session, "GET", f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims"
        )
    assert listed["items"] == []
