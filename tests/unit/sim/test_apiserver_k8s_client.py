"""kubernetes-asyncio, unchanged, against the embedded API server (built from the written kubeconfig)."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from agent.sim.apiserver import EmbeddedApiServer
from tests.unit.sim.conftest import slice_body

pytestmark = pytest.mark.anyio
SELECTOR = "spec.nodeName=node1,spec.driver=gpu.nvidia.com"


async def test_slice_lifecycle(k8s: Any) -> None:
    api = client.ResourceV1Api(k8s)
    created = await api.create_resource_slice(slice_body())
    name = created.metadata.name
    assert (
        name.startswith("node1-gpu.nvidia.com-") and len(name) == len("node1-gpu.nvidia.com-") + 5
    )
    assert created.metadata.uid and created.metadata.generation == 1
    assert created.metadata.creation_timestamp is not None

    read = await api.read_resource_slice(name)
    assert read.spec.devices[0].attributes["productName"].string == "H100"
    assert read.metadata.resource_version == created.metadata.resource_version

    read.spec.devices[0].name = "gpu-1"
    updated = await api.replace_resource_slice(name, read)
    assert updated.metadata.generation == 2
    assert int(updated.metadata.resource_version) > int(read.metadata.resource_version)

    read.spec.devices[0].name = "gpu-2"  # still carries the old resourceVersion
    with pytest.raises(ApiException) as stale:
        await api.replace_resource_slice(name, read)
    assert stale.value.status == 409
    assert "the object has been modified" in stale.value.body

    deleted = await api.delete_resource_slice(name)
    assert deleted.metadata.name == name
    assert deleted.spec.devices[0].name == "gpu-1"
    with pytest.raises(ApiException) as missing:
        await api.read_resource_slice(name)
    assert missing.value.status == 404


async def test_list_and_delete_collection_with_field_selector(k8s: Any) -> None:
    api = client.ResourceV1Api(k8s)
    for node, driver in [("node1", "gpu.nvidia.com"), ("node1", "gpu.nvidia.com"),
                         ("node1", "compute-domain.nvidia.com"), ("node2", "gpu.nvidia.com")]:  # fmt: skip
        await api.create_resource_slice(slice_body(node, driver))
    listed = await api.list_resource_slice(field_selector=SELECTOR)
    assert len(listed.items) == 2
    assert {(s.spec.node_name, s.spec.driver) for s in listed.items} == {
        ("node1", "gpu.nvidia.com")
    }
    assert int(listed.metadata.resource_version) >= 5

    await api.delete_collection_resource_slice(field_selector=SELECTOR)
    remaining = await api.list_resource_slice()
    assert sorted((s.spec.node_name, s.spec.driver) for s in remaining.items) == [
        ("node1", "compute-domain.nvidia.com"),
        ("node2", "gpu.nvidia.com"),
    ]


async def test_watch_sees_changes_in_order_and_resumes(k8s: Any) -> None:
    api = client.ResourceV1Api(k8s)
    start = (await api.list_resource_slice()).metadata.resource_version
    created = await api.create_resource_slice(slice_body())
    created.spec.devices[0].name = "gpu-7"
    modified = await api.replace_resource_slice(created.metadata.name, created)
    await api.delete_resource_slice(created.metadata.name)

    seen: list[tuple[str, str]] = []
    stream = watch.Watch()
    async with stream:
        async for event in stream.stream(
            api.list_resource_slice, resource_version=start, timeout_seconds=2
        ):
            seen.append((event["type"], type(event["object"]).__name__))
            if len(seen) == 3:
                stream.stop()
    assert seen == [("ADDED", "V1ResourceSlice"), ("MODIFIED", "V1ResourceSlice"),
                    ("DELETED", "V1ResourceSlice")]  # fmt: skip

    # Resume after the MODIFIED event: only the deletion is replayed.
    resumed = watch.Watch()
    async with resumed:
        async for event in resumed.stream(
            api.list_resource_slice,
            resource_version=modified.metadata.resource_version,
            timeout_seconds=1,
        ):
            assert event["type"] == "DELETED"
            assert event["object"].metadata.name == created.metadata.name
            resumed.stop()
    assert int(resumed.resource_version) > int(modified.metadata.resource_version)


async def test_watch_live_events_with_selector(k8s: Any, apiserver: EmbeddedApiServer) -> None:
    api = client.ResourceV1Api(k8s)
    await api.create_resource_slice(slice_body("node1"))
    stream = watch.Watch()
    types: list[str] = []
    async with stream:
        async for event in stream.stream(
            api.list_resource_slice, field_selector=SELECTOR, timeout_seconds=3
        ):
            types.append(event["type"])
            if len(types) == 1:  # initial state delivered; now write live
                await api.create_resource_slice(slice_body("node2"))  # filtered out
                await api.create_resource_slice(slice_body("node1"))
            else:
                stream.stop()
    assert types == ["ADDED", "ADDED"]


async def test_resource_claim_status_and_model(k8s: Any) -> None:
    api = client.ResourceV1Api(k8s)
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "claim-a", "namespace": "ns1"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        "status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]},
    }  # fmt: skip
    created = await api.create_namespaced_resource_claim("ns1", claim)
    assert type(created).__name__ == "ResourceV1ResourceClaim"
    assert created.status is None  # status is dropped on create, as the real strategy does

    created.status = {
        "allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com",
                                                "pool": "node1", "device": "gpu-0"}]}}
    }  # fmt: skip
    with_status = await api.replace_namespaced_resource_claim_status("claim-a", "ns1", created)
    result = with_status.status.allocation.devices.results[0]
    assert (result.driver, result.device) == ("gpu.nvidia.com", "gpu-0")
    assert with_status.metadata.generation == 1  # status writes do not bump generation

    # A main-resource update ignores status.
    with_status.status = None
    again = await api.replace_namespaced_resource_claim("claim-a", "ns1", with_status)
    assert again.status.allocation.devices.results[0].device == "gpu-0"
    read = await api.read_namespaced_resource_claim("claim-a", "ns1")
    assert read.metadata.uid == created.metadata.uid
    everywhere = await api.list_resource_claim_for_all_namespaces()
    assert [c.metadata.name for c in everywhere.items] == ["claim-a"]


async def test_node_and_event(k8s: Any, apiserver: EmbeddedApiServer) -> None:
    core = client.CoreV1Api(k8s)
    node = await core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1"},
                                   "status": {"capacity": {"cpu": "8"}}})  # fmt: skip
    assert node.status.capacity == {"cpu": "8"}  # nodes keep status on create
    read = await core.read_node("node1")
    assert read.metadata.uid == node.metadata.uid

    event = await core.create_namespaced_event(
        "default",
        {
            "metadata": {"generateName": "gpu-agent-"},
            "involvedObject": {"kind": "Node", "name": "node1", "uid": node.metadata.uid},
            "reason": "GpuUnhealthy",
            "message": "XID 79 on gpu-0",
            "type": "Warning",
        },
    )
    assert event.metadata.namespace == "default"
    listed = await core.list_namespaced_event("default", field_selector="involvedObject.name=node1")
    assert [e.reason for e in listed.items] == ["GpuUnhealthy"]


async def test_slices_owned_by_node_are_deleted_with_it(k8s: Any) -> None:
    core = client.CoreV1Api(k8s)
    api = client.ResourceV1Api(k8s)
    node = await core.create_node({"metadata": {"name": "node1"}})
    owned = slice_body()
    owned["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Node", "name": "node1", "uid": node.metadata.uid,
         "controller": True}
    ]  # fmt: skip
    await api.create_resource_slice(owned)
    await api.create_resource_slice(slice_body("node2"))
    await core.delete_node("node1")
    assert [s.spec.node_name for s in (await api.list_resource_slice()).items] == ["node2"]


async def test_version_and_discovery(k8s: Any) -> None:
    version = await client.VersionApi(k8s).get_code()
    assert (version.git_version, version.major, version.minor) == ("v1.35.0", "1", "35")
    resources = await client.ResourceV1Api(k8s).get_api_resources()
    names = {r.name for r in resources.resources}
    assert {"resourceslices", "resourceclaims", "resourceclaims/status", "deviceclasses"} <= names


async def test_load_kube_config_accepts_the_written_file(kubeconfig: Any) -> None:
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    assert configuration.host.startswith("http://127.0.0.1:")
    assert configuration.api_key["BearerToken"] == "Bearer embedded-apiserver-token"
    async with client.ApiClient(configuration) as api_client:
        nodes = await client.CoreV1Api(api_client).list_node()
        assert nodes.items == []
