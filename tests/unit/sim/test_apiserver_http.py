"""The REST semantics, seen through raw HTTP (aiohttp), independent of kubernetes-asyncio."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client

from agent.dra.partitionable import DynamicMig
from agent.dra.share_mode import parse_mode
from agent.sim.apiserver import EmbeddedApiServer
from tests.support.profile_slices import profile_slices
from tests.unit.sim.conftest import slice_body

pytestmark = pytest.mark.anyio
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/ns1/resourceclaims"


async def call(
    http: aiohttp.ClientSession,
    method: str,
    path: str,
    body: Any = None,
    content_type: str = "application/json",
    **params: str,
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body)
    async with http.request(
        method, path, data=data, params=params, headers={"Content-Type": content_type}
    ) as response:
        return response.status, await response.json()


async def test_same_object_through_both_clients(k8s: Any, http: aiohttp.ClientSession) -> None:
    status, created = await call(http, "POST", SLICES, slice_body())
    assert status == 201
    status, raw = await call(http, "GET", f"{SLICES}/{created['metadata']['name']}")
    assert status == 200 and raw == created
    typed = await client.ResourceV1Api(k8s).read_resource_slice(created["metadata"]["name"])
    normalized = k8s.sanitize_for_serialization(typed)
    # The model turns the timestamp into a datetime; compare it as an instant, the rest as JSON.
    typed_ts = datetime.fromisoformat(normalized["metadata"].pop("creationTimestamp"))
    raw_ts = datetime.fromisoformat(raw["metadata"].pop("creationTimestamp"))
    assert typed_ts == raw_ts
    assert normalized == raw


async def test_status_bodies(http: aiohttp.ClientSession) -> None:
    status, body = await call(http, "GET", f"{SLICES}/nope")
    assert status == 404
    assert body == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'resourceslices.resource.k8s.io "nope" not found', "reason": "NotFound",
        "details": {"name": "nope", "group": "resource.k8s.io", "kind": "resourceslices"},
        "code": 404,
    }  # fmt: skip
    await call(http, "POST", SLICES, slice_body(name="s1"))
    status, body = await call(http, "POST", SLICES, slice_body(name="s1"))
    assert (status, body["reason"]) == (409, "AlreadyExists")
    status, body = await call(http, "GET", "/apis/resource.k8s.io/v1/widgets")
    assert (status, body["reason"]) == (404, "NotFound")
    status, body = await call(http, "POST", f"{SLICES}/s1")
    assert (status, body["reason"]) == (405, "MethodNotAllowed")
    status, body = await call(http, "PATCH", f"{SLICES}/s1", {}, "application/yaml")
    assert status == 415
    status, body = await call(http, "GET", SLICES, fieldSelector="spec.bogus=1")
    assert (status, body["reason"]) == (400, "BadRequest")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b["metadata"].pop("generateName"), "metadata.name: Required value"),
        (lambda b: b["spec"].pop("driver"), "spec.driver: Required value"),
        (lambda b: b["spec"].pop("pool"), "spec.pool: Required value"),
        (lambda b: b.update(kind="Node"), "kind: Invalid value"),
        (lambda b: b.update(apiVersion="resource.k8s.io/v1beta1"), "apiVersion: Invalid value"),
        (lambda b: b["metadata"].update(name="Upper_Case"), "RFC 1123"),
        (lambda b: b["spec"].update(allNodes=True), "exactly one of"),
    ],
)
async def test_create_validation(http: aiohttp.ClientSession, mutate: Any, message: str) -> None:
    body = slice_body()
    mutate(body)
    status, result = await call(http, "POST", SLICES, body)
    assert (status, result["reason"]) == (422, "Invalid")
    assert message in result["message"]


async def test_namespace_mismatch_and_immutable_node(http: aiohttp.ClientSession) -> None:
    claim = {"metadata": {"name": "c", "namespace": "other"}, "spec": {}}
    status, body = await call(http, "POST", CLAIMS, claim)
    assert (status, body["reason"]) == (422, "Invalid")
    _, created = await call(http, "POST", SLICES, slice_body(name="s1"))
    created["spec"]["nodeName"] = "node2"
    status, body = await call(http, "PUT", f"{SLICES}/s1", created)
    assert status == 422 and "spec.nodeName" in body["message"]
    created["spec"]["nodeName"] = "node1"
    created["metadata"]["uid"] = "6a1f0c1e-0000-4000-8000-000000000000"
    status, body = await call(http, "PUT", f"{SLICES}/s1", created)
    assert (status, body["reason"]) == (409, "Conflict")
    assert body["message"].startswith("Precondition failed: UID in precondition")


async def test_update_generation_and_noop(http: aiohttp.ClientSession) -> None:
    _, created = await call(http, "POST", SLICES, slice_body(name="s1"))
    _, same = await call(http, "PUT", f"{SLICES}/s1", created)
    assert same["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    created["metadata"]["labels"] = {"a": "b"}
    _, relabelled = await call(http, "PUT", f"{SLICES}/s1", created)
    assert relabelled["metadata"]["generation"] == 1  # metadata-only change
    relabelled["spec"]["pool"]["generation"] = 2
    relabelled["metadata"].pop("resourceVersion")  # unconditional update
    _, respec = await call(http, "PUT", f"{SLICES}/s1", relabelled)
    assert respec["metadata"]["generation"] == 2
    assert respec["metadata"]["uid"] == created["metadata"]["uid"]


async def test_patches(apiserver: EmbeddedApiServer, http: aiohttp.ClientSession) -> None:
    _, created = await call(http, "POST", SLICES, slice_body(name="s1", team="a"))
    merge = {"metadata": {"labels": {"team": None, "tier": "x"}},
             "spec": {"devices": [{"name": "gpu-9"}]}}  # fmt: skip
    status, merged = await call(
        http, "PATCH", f"{SLICES}/s1", merge, "application/merge-patch+json"
    )
    assert status == 200
    assert merged["metadata"]["labels"] == {"tier": "x"}
    assert merged["spec"]["devices"] == [{"name": "gpu-9"}]  # lists are replaced
    assert merged["metadata"]["generation"] == 2

    strategic = {"spec": {"pool": {"generation": 5}}}
    _, smp = await call(http, "PATCH", f"{SLICES}/s1", strategic,
                        "application/strategic-merge-patch+json")  # fmt: skip
    assert smp["spec"]["pool"] == {"name": "node1", "generation": 5, "resourceSliceCount": 1}

    ops = [{"op": "test", "path": "/spec/pool/generation", "value": 5},
           {"op": "add", "path": "/spec/devices/-", "value": {"name": "gpu-10"}},
           {"op": "replace", "path": "/metadata/labels/tier", "value": "y"}]  # fmt: skip
    _, jp = await call(http, "PATCH", f"{SLICES}/s1", ops, "application/json-patch+json")
    assert [d["name"] for d in jp["spec"]["devices"]] == ["gpu-9", "gpu-10"]
    assert jp["metadata"]["labels"] == {"tier": "y"}

    failing = [{"op": "test", "path": "/spec/pool/generation", "value": 1}]
    status, _ = await call(http, "PATCH", f"{SLICES}/s1", failing, "application/json-patch+json")
    assert status == 422

    patches = apiserver.requests.records("PATCH")
    assert [r.content_type for r in patches[:3]] == [
        "application/merge-patch+json",
        "application/strategic-merge-patch+json",
        "application/json-patch+json",
    ]

    stale = {"metadata": {"resourceVersion": created["metadata"]["resourceVersion"]}, "spec": {}}
    status, body = await call(http, "PATCH", f"{SLICES}/s1", stale, "application/merge-patch+json")
    assert (status, body["reason"]) == (409, "Conflict")


async def test_status_subresource_patch(http: aiohttp.ClientSession) -> None:
    await call(http, "POST", CLAIMS, {"metadata": {"name": "c"}, "spec": {"devices": {}}})
    patch = {"status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]},
             "spec": {"devices": {"requests": []}}}  # fmt: skip
    _, body = await call(http, "PATCH", f"{CLAIMS}/c/status", patch, "application/merge-patch+json")
    assert body["status"]["reservedFor"][0]["name"] == "p"
    assert body["spec"] == {"devices": {}}  # spec untouched through /status
    _, body = await call(
        http, "PATCH", f"{CLAIMS}/c", {"status": None}, "application/merge-patch+json"
    )
    assert "reservedFor" in body["status"]  # status untouched through the main resource


async def test_delete_preconditions(http: aiohttp.ClientSession) -> None:
    _, created = await call(http, "POST", SLICES, slice_body(name="s1"))
    wrong = {"preconditions": {"uid": "00000000-0000-0000-0000-000000000000"}}
    status, body = await call(http, "DELETE", f"{SLICES}/s1", wrong)
    assert (status, body["reason"]) == (409, "Conflict")
    stale = {"preconditions": {"resourceVersion": "1"}}
    status, _ = await call(http, "DELETE", f"{SLICES}/s1", stale)
    assert status == 409
    right = {"preconditions": {"uid": created["metadata"]["uid"],
                               "resourceVersion": created["metadata"]["resourceVersion"]}}  # fmt: skip
    status, deleted = await call(http, "DELETE", f"{SLICES}/s1", right)
    assert status == 200 and deleted["metadata"]["uid"] == created["metadata"]["uid"]


async def test_label_selectors_and_pagination(http: aiohttp.ClientSession) -> None:
    for i, labels in enumerate([{"tier": "a"}, {"tier": "b"}, {"tier": "c", "gpu": "1"}, {}]):
        await call(http, "POST", SLICES, slice_body(name=f"s{i}", **labels))

    async def names(selector: str) -> list[str]:
        _, body = await call(http, "GET", SLICES, labelSelector=selector)
        return [item["metadata"]["name"] for item in body["items"]]

    assert await names("tier=a") == ["s0"]
    assert await names("tier==b") == ["s1"]
    assert await names("tier!=a") == ["s1", "s2", "s3"]
    assert await names("tier in (a, c)") == ["s0", "s2"]
    assert await names("tier notin (a,c)") == ["s1", "s3"]
    assert await names("gpu") == ["s2"]
    assert await names("!tier") == ["s3"]
    assert await names("tier,!gpu") == ["s0", "s1"]

    _, page = await call(http, "GET", SLICES, limit="3")
    assert [i["metadata"]["name"] for i in page["items"]] == ["s0", "s1", "s2"]
    assert page["metadata"]["remainingItemCount"] == 1
    assert "kind" not in page["items"][0]  # built-in list items are untyped, as in the real server
    _, rest = await call(
        http, "GET", SLICES, limit="3", **{"continue": page["metadata"]["continue"]}
    )
    assert [i["metadata"]["name"] for i in rest["items"]] == ["s3"]
    assert "continue" not in rest["metadata"]


async def test_other_kinds_and_discovery(http: aiohttp.ClientSession) -> None:
    cd = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
          "metadata": {"name": "cd"}, "spec": {"numNodes": 2}, "status": {"status": "Ready"}}  # fmt: skip
    status, created = await call(
        http, "POST", "/apis/resource.nvidia.com/v1beta1/namespaces/ns1/computedomains", cd
    )
    assert status == 201 and "status" not in created
    status, _ = await call(http, "POST", "/apis/resource.k8s.io/v1/deviceclasses",
                           {"metadata": {"name": "gpu.nvidia.com"}, "spec": {}})  # fmt: skip
    assert status == 201
    _, version = await call(http, "GET", "/version")
    assert version["gitVersion"] == "v1.35.0"
    _, groups = await call(http, "GET", "/apis")
    assert {g["name"] for g in groups["groups"]} == {
        "resource.k8s.io",
        "resource.nvidia.com",
        "coordination.k8s.io",
    }
    _, core = await call(http, "GET", "/api/v1")
    assert {r["name"] for r in core["resources"]} == {
        "nodes",
        "nodes/status",
        "pods",
        "pods/status",
        "events",
    }
    _, api = await call(http, "GET", "/api")
    assert api["versions"] == ["v1"]


async def test_direct_store_access_and_request_log(
    apiserver: EmbeddedApiServer, http: aiohttp.ClientSession
) -> None:
    stored = apiserver.put_object(slice_body(name="s1"))
    assert apiserver.get_object("resourceslices", "s1") == stored
    _, via_http = await call(http, "GET", f"{SLICES}/s1")
    assert via_http == stored
    apiserver.put_object(
        {**stored, "metadata": {"name": "s1"}, "spec": {**stored["spec"], "devices": []}}
    )
    assert apiserver.get_object("ResourceSlice", "s1")["metadata"]["generation"] == 2  # type: ignore[index]
    assert apiserver.delete_object("resourceslices", "s1") is not None
    assert apiserver.get_object("resourceslices", "s1") is None
    writes = apiserver.requests.records("WRITE", f"{SLICES}*")
    reads = apiserver.requests.records("GET", f"{SLICES}/*")
    assert (len(writes), len(reads)) == (0, 1)


async def test_claim_spec_is_immutable_and_bad_params_are_400(http: aiohttp.ClientSession) -> None:
    _, claim = await call(
        http, "POST", CLAIMS, {"metadata": {"name": "c"}, "spec": {"devices": {}}}
    )
    claim["spec"]["devices"]["requests"] = [{"name": "x"}]
    status, body = await call(http, "PUT", f"{CLAIMS}/c", claim)
    assert (status, body["reason"]) == (422, "Invalid")
    assert "spec: Invalid value: field is immutable" in body["message"]
    for params in ({"limit": "ten"}, {"watch": "true", "timeoutSeconds": "-1"}):
        status, body = await call(http, "GET", SLICES, **params)
        assert (status, body["reason"]) == (400, "BadRequest")


@pytest.fixture(params=["dgx-h100", "dgx-a100"])
def shared_slices(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """What ``--dynamic-mig --consumable-shares memory`` publishes on a simulated host (built
    outside the event loop: discovery runs its own)."""
    shares, dynamic_mig = parse_mode("memory"), DynamicMig()
    return profile_slices(request.param, "node1", dynamic_mig=dynamic_mig, shares=shares)


async def test_request_policies_over_http(
    http: aiohttp.ClientSession, shared_slices: list[dict[str, Any]]
) -> None:
    """The slices ``--dynamic-mig --consumable-shares memory`` publishes are accepted; the
    same slice with a step on a capacity of 0 (a 1g placement's encoders) is refused with 422,
    as kube-apiserver refuses it."""
    slices = shared_slices
    for item in slices:
        status, _ = await call(http, "POST", SLICES, item)
        assert status == 201
    bad = next(item for item in slices if item["spec"].get("devices"))
    bad["metadata"] = {"name": "bad"}
    device = next(d for d in bad["spec"]["devices"] if "-mig-1g" in d["name"])
    device["capacity"]["encoders"]["requestPolicy"] = {
        "default": "0",
        "validRange": {"min": "0", "max": "0", "step": "1"},
    }
    status, body = await call(http, "POST", SLICES, bad)
    assert (status, body["reason"]) == (422, "Invalid")
    assert "capacity[encoders].requestPolicy.validRange.step" in body["message"]
    assert "one step 1 is larger than capacity value: 0" in body["message"]
