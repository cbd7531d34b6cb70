"""The embedded API server's support for the controller: finalizers (graceful deletion),
ResourceClaimTemplates and Leases, over real HTTP."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from agent.sim.apiserver import EmbeddedApiServer
from tests.unit.imex.conftest import compute_domain

pytestmark = pytest.mark.anyio
CD = "/apis/resource.nvidia.com/v1beta1/namespaces/default/computedomains"


async def test_an_object_with_finalizers_is_marked_then_removed_with_the_last_one(
    apiserver: EmbeddedApiServer,
) -> None:
    body = compute_domain()
    body["metadata"]["finalizers"] = ["resource.nvidia.com/computeDomain", "example.com/other"]
    async with aiohttp.ClientSession(base_url=apiserver.url) as http:
        async with http.post(CD, json=body) as response:
            assert response.status == 201
            created = await response.json()
        async with http.delete(f"{CD}/cd") as response:
            assert response.status == 200
            marked = await response.json()
        assert marked["metadata"]["deletionTimestamp"]
        stored = apiserver.get_object("computedomains", "cd", "default")
        assert stored is not None and stored["metadata"]["deletionTimestamp"]
        # a status write keeps the mark; deleting again changes nothing
        stored["status"] = {"status": "NotReady"}
        async with http.put(f"{CD}/cd/status", json=stored) as response:
            assert response.status == 200
            stored = await response.json()
        assert stored["metadata"]["deletionTimestamp"] == marked["metadata"]["deletionTimestamp"]
        async with http.delete(f"{CD}/cd") as response:
            assert response.status == 200
        # removing one finalizer: still there; a stale resourceVersion: 409
        stored["metadata"]["finalizers"] = ["example.com/other"]
        async with http.put(f"{CD}/cd", json=stored) as response:
            assert response.status == 200
            stored = await response.json()
        async with http.put(f"{CD}/cd", json={**created, "spec": {}}) as response:
            assert response.status == 409
        assert apiserver.get_object("computedomains", "cd", "default") is not None
        stored["metadata"]["finalizers"] = []
        async with http.put(f"{CD}/cd", json=stored) as response:
            assert response.status == 200
        assert apiserver.get_object("computedomains", "cd", "default") is None
        # without finalizers deletion is immediate, as before
        async with http.post(CD, json=compute_domain("quick")) as response:
            assert response.status == 201
        async with http.delete(f"{CD}/quick") as response:
            assert response.status == 200
        assert apiserver.get_object("computedomains", "quick", "default") is None


async def test_resource_claim_templates_and_leases_are_served(apiserver: EmbeddedApiServer) -> None:
    template: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t", "namespace": "team-a"},
        "spec": {"spec": {"devices": {"requests": []}}},
    }
    lease: dict[str, Any] = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "l", "namespace": "gpu-dra-agent"},
        "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15},
    }
    async with aiohttp.ClientSession(base_url=apiserver.url) as http:
        for path, body in (
            ("/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaimtemplates", template),
            ("/apis/coordination.k8s.io/v1/namespaces/gpu-dra-agent/leases", lease),
        ):
            async with http.post(path, json=body) as response:
                assert response.status == 201, await response.text()
            async with http.get(f"{path}/{body['metadata']['name']}") as response:
                assert (await response.json())["spec"] == body["spec"]
