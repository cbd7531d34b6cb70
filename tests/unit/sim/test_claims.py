"""The claim helper: claims land in the API server allocated as the scheduler would leave them."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio import client

from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.claims import (
    AllocatedDevice,
    ClaimCreationError,
    OpaqueConfig,
    PodReference,
    create_allocated_claim,
)

pytestmark = pytest.mark.anyio


async def test_allocated_claim_shape(apiserver: EmbeddedApiServer, k8s: Any) -> None:
    pod = PodReference("trainer-0", "4a2c1e7e-0000-4000-8000-000000000001")
    created = await create_allocated_claim(
        apiserver.url,
        "train",
        [
            AllocatedDevice("gpus", "gpu-0", "node1"),
            AllocatedDevice("gpus", "gpu-1", "node1"),
            AllocatedDevice("monitor", "gpu-2", "node1", admin_access=True),
        ],
        namespace="ml",
        configs=[
            OpaqueConfig({"sharing": {"strategy": "TimeSlicing"}}, requests=["gpus"]),
            OpaqueConfig({"kind": "GpuConfig"}, source="FromClass"),
        ],
        reserved_for=[pod],
        node_name="node1",
    )
    assert created["metadata"]["uid"]
    assert created["spec"]["devices"]["requests"] == [
        {"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com",
                                     "allocationMode": "ExactCount", "count": 2}},
        {"name": "monitor", "exactly": {"deviceClassName": "gpu.nvidia.com", "adminAccess": True}},
    ]  # fmt: skip
    assert created["spec"]["devices"]["config"] == [
        {"requests": ["gpus"], "opaque": {"driver": "gpu.nvidia.com",
                                          "parameters": {"sharing": {"strategy": "TimeSlicing"}}}}
    ]  # fmt: skip
    allocation = created["status"]["allocation"]
    assert allocation["devices"]["results"][2] == {
        "request": "monitor", "driver": "gpu.nvidia.com", "pool": "node1", "device": "gpu-2",
        "adminAccess": True,
    }  # fmt: skip
    assert [c["source"] for c in allocation["devices"]["config"]] == ["FromClass", "FromClaim"]
    assert allocation["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [
        "node1"
    ]
    assert created["status"]["reservedFor"] == [
        {"resource": "pods", "name": "trainer-0", "uid": pod.uid}
    ]

    # What a driver reads back through kubernetes-asyncio is the same claim.
    claim = await client.ResourceV1Api(k8s).read_namespaced_resource_claim("train", "ml")
    assert claim.metadata.uid == created["metadata"]["uid"]
    assert [r.device for r in claim.status.allocation.devices.results] == [
        "gpu-0",
        "gpu-1",
        "gpu-2",
    ]
    assert claim.status.allocation.devices.config[1].opaque.parameters == {
        "sharing": {"strategy": "TimeSlicing"}
    }


async def test_default_reservation_and_errors(apiserver: EmbeddedApiServer) -> None:
    created = await create_allocated_claim(
        apiserver.url, "c1", [AllocatedDevice("gpu", "gpu-0", "node1")]
    )
    assert created["status"]["reservedFor"][0]["name"] == "c1-pod"
    assert "config" not in created["spec"]["devices"]
    unreserved = await create_allocated_claim(
        apiserver.url, "c2", [AllocatedDevice("gpu", "gpu-0", "node1")], reserved_for=()
    )
    assert "reservedFor" not in unreserved["status"]
    with pytest.raises(ClaimCreationError, match="already exists"):
        await create_allocated_claim(
            apiserver.url, "c1", [AllocatedDevice("gpu", "gpu-0", "node1")]
        )
    apiserver.faults.fail_next("PUT", "*/resourceclaims/c3/status", 503)
    with pytest.raises(ClaimCreationError, match="503"):
        await create_allocated_claim(apiserver.url, "c3", [AllocatedDevice("gpu", "gpu-0", "n")])
