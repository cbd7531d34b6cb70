"""``/openapi/v2`` and ``/openapi/v3``: what kubectl reads before it validates, patches or explains."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.apiserver.schema_index import crd_versions, release_for, schema_index

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[3]


async def get(http: aiohttp.ClientSession, path: str, accept: str = "application/json") -> Any:
    async with http.get(path, headers={"Accept": accept}) as response:
        return response.status, await response.json()


async def test_v3_discovery_names_every_group_version_with_a_hash(
    http: aiohttp.ClientSession,
) -> None:
    status, root = await get(http, "/openapi/v3")
    assert status == 200
    assert set(root["paths"]) == {
        "api/v1",
        "apis/resource.k8s.io/v1",
        "apis/resource.nvidia.com/v1beta1",
        "apis/coordination.k8s.io/v1",
    }
    url = root["paths"]["apis/resource.k8s.io/v1"]["serverRelativeURL"]
    assert url.startswith("/openapi/v3/apis/resource.k8s.io/v1?hash=")
    status, doc = await get(http, url)
    assert status == 200 and doc["openapi"] == "3.0.0"
    assert doc["info"]["version"] == "v1.35.0"
    status, body = await get(http, "/openapi/v3/apis/example.com/v1")
    assert (status, body["reason"]) == (404, "NotFound")


async def test_each_kind_has_a_patch_operation_with_field_validation(
    http: aiohttp.ClientSession,
) -> None:
    """What kubectl's field-validation check and its strategic-merge-patch check look for."""
    _, doc = await get(http, "/openapi/v3/apis/resource.k8s.io/v1")
    item = doc["paths"]["/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"]
    patch = item["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {
        "group": "resource.k8s.io", "kind": "ResourceClaim", "version": "v1"
    }  # fmt: skip
    names = {p["name"] for p in patch["parameters"] if p["in"] == "query"}
    assert {"fieldValidation", "fieldManager", "force"} <= names
    assert "application/strategic-merge-patch+json" in patch["requestBody"]["content"]
    assert "application/apply-patch+yaml" in patch["requestBody"]["content"]
    claim = doc["components"]["schemas"]["io.k8s.api.resource.v1.ResourceClaim"]
    assert claim["x-kubernetes-group-version-kind"][0]["kind"] == "ResourceClaim"
    spec_ref = claim["properties"]["spec"]["allOf"][0]["$ref"]
    assert spec_ref == "#/components/schemas/io.k8s.api.resource.v1.ResourceClaimSpec"
    # every reference resolves inside the document
    text = str(doc)
    for name in doc["components"]["schemas"]:
        assert name in text
    _, crds = await get(http, "/openapi/v3/apis/resource.nvidia.com/v1beta1")
    cd_path = "/apis/resource.nvidia.com/v1beta1/namespaces/{namespace}/computedomains/{name}"
    content = crds["paths"][cd_path]["patch"]["requestBody"]["content"]
    assert "application/strategic-merge-patch+json" not in content  # CRDs take none
    domain = crds["components"]["schemas"]["com.nvidia.resource.v1beta1.ComputeDomain"]
    assert "channel" in domain["properties"]["spec"]["properties"]


async def test_v2_is_json_with_definitions_and_refuses_protobuf_only(
    http: aiohttp.ClientSession,
) -> None:
    status, doc = await get(http, "/openapi/v2")
    assert status == 200 and doc["swagger"] == "2.0"
    node = doc["definitions"]["io.k8s.api.core.v1.Node"]
    assert node["properties"]["spec"]["$ref"] == "#/definitions/io.k8s.api.core.v1.NodeSpec"
    assert doc["definitions"]["io.k8s.apimachinery.pkg.util.intstr.IntOrString"]["format"] == (
        "int-or-string"
    )
    patch = doc["paths"]["/api/v1/nodes/{name}"]["patch"]
    assert any(p["name"] == "fieldValidation" and p["in"] == "query" for p in patch["parameters"])
    status, body = await get(
        http, "/openapi/v2", "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"
    )
    assert (status, body["reason"]) == (406, "NotAcceptable")


@pytest.mark.parametrize(
    ("version", "release"),
    [("1.33.0", "1.34"), ("v1.34.2", "1.34"), ("1.36.0", "1.36"), ("1.40.0", "1.37")],
)
def test_the_schemas_follow_the_version_the_server_answers_as(version: str, release: str) -> None:
    assert release_for(version) == release


async def test_a_server_of_another_release_serves_that_release() -> None:
    async with EmbeddedApiServer(kubernetes_version="1.34.1") as server:
        async with aiohttp.ClientSession(base_url=server.url) as http:
            _, doc = await get(http, "/openapi/v3/apis/resource.k8s.io/v1")
    assert doc["info"]["version"] == "v1.34.1"
    assert set(doc["components"]["schemas"]) <= set(schema_index("1.34").schemas)


def test_crd_schemas_and_columns_come_from_deploy() -> None:
    kinds = {(c.kind, c.version) for c in crd_versions()}
    assert kinds == {("ComputeDomain", "v1beta1"), ("ComputeDomainClique", "v1beta1")}
    domain = next(c for c in crd_versions() if c.kind == "ComputeDomain")
    assert [c["name"] for c in domain.columns] == ["Status", "Nodes", "Age"]


def test_the_generated_schemas_are_current() -> None:
    """scripts/generate_openapi.py --check: the committed files match kubernetes-validate's
    definitions and deploy/'s CRDs."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate_openapi.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
