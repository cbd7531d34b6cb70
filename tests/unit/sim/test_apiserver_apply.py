"""Server-side apply (merge, managed fields, conflicts) and server-side field validation."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.apiserver.apply import server_side_apply
from agent.sim.apiserver.errors import ApiError
from agent.sim.apiserver.fieldsets import decode, encode, field_set, merge
from agent.sim.apiserver.kinds import KindRegistry
from agent.sim.apiserver.schema_index import schema_index

pytestmark = pytest.mark.anyio
INDEX = schema_index("1.35")
KINDS = KindRegistry()
NODE = KINDS.resolve("nodes")
POD = KINDS.resolve("pods")
APPLY = "application/apply-patch+yaml"
NODES = "/api/v1/nodes"


def node(**labels: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "n1", "labels": labels} if labels else {"name": "n1"}
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta}


def apply(live: dict[str, Any] | None, config: Any, manager: str, force: bool = False) -> Any:
    return server_side_apply(INDEX, NODE, live, config, name="n1", namespace=None,
                             manager=manager, force=force, now="2026-01-01T00:00:00Z")  # fmt: skip


def owners(obj: dict[str, Any]) -> dict[str, set[tuple[str, ...]]]:
    return {e["manager"]: decode(e["fieldsV1"]) for e in obj["metadata"]["managedFields"]}


def test_fields_v1_round_trip_and_keyed_lists() -> None:
    schema = INDEX.schema_for("", "v1", "Pod")
    pod = {"metadata": {"labels": {"a": "1"}, "finalizers": ["x"]},
           "spec": {"containers": [{"name": "c", "image": "i"}]}}  # fmt: skip
    paths = set(field_set(INDEX, schema, pod))
    assert ("f:spec", "f:containers", 'k:{"name":"c"}') in paths  # the item itself
    assert ("f:spec", "f:containers", 'k:{"name":"c"}', "f:image") in paths
    assert ("f:metadata", "f:finalizers", 'v:"x"') in paths  # a set-list member
    encoded = encode(paths)
    assert encoded["f:spec"]["f:containers"]['k:{"name":"c"}'] == {
        ".": {}, "f:image": {}, "f:name": {}
    }  # fmt: skip
    assert decode(encoded) == paths
    live = {"spec": {"containers": [{"name": "c", "image": "old", "args": ["x"]}]}}
    merged = merge(INDEX, schema, live, {"spec": {"containers": [{"name": "c", "image": "new"},
                                                                 {"name": "d"}]}})  # fmt: skip
    assert merged["spec"]["containers"] == [
        {"name": "c", "image": "new", "args": ["x"]}, {"name": "d"}
    ]  # fmt: skip


def test_apply_creates_records_the_manager_and_removes_what_it_dropped() -> None:
    created = apply(None, node(a="1", b="2"), "one")
    assert created["metadata"]["labels"] == {"a": "1", "b": "2"}
    (entry,) = created["metadata"]["managedFields"]
    assert (entry["manager"], entry["operation"], entry["apiVersion"]) == ("one", "Apply", "v1")
    assert entry["fieldsV1"] == {"f:metadata": {"f:labels": {"f:a": {}, "f:b": {}}}}
    # another manager co-owns b by applying the same value: no conflict
    shared = apply(created, node(b="2"), "two")
    changed = apply(shared, node(a="9"), "one")  # one drops b: two still owns it, it stays
    assert changed["metadata"]["labels"] == {"a": "9", "b": "2"}
    gone = apply(changed, node(), "two")  # nobody owns b any more: removed
    assert gone["metadata"]["labels"] == {"a": "9"}
    assert set(owners(gone)) == {"one"}  # an empty entry is dropped
    assert apply(gone, node(a="9"), "one") is gone  # a no-op keeps the object as it is


def test_a_conflict_names_field_and_manager_and_force_takes_the_field() -> None:
    live = apply(None, node(a="1", b="1"), "one")
    with pytest.raises(ApiError) as error:
        apply(live, node(a="2", b="2"), "two")
    status = error.value.status()
    assert status["code"] == 409 and status["reason"] == "Conflict"
    assert status["message"] == (
        'Apply failed with 2 conflicts: conflicts with "one":\n- .metadata.labels.a\n'
        "- .metadata.labels.b"
    )
    assert status["details"]["causes"][0] == {
        "type": "FieldManagerConflict", "message": 'conflict with "one"',
        "field": ".metadata.labels.a",
    }  # fmt: skip
    with pytest.raises(ApiError) as error:
        apply(live, node(a="2"), "two")
    assert error.value.message == (
        'Apply failed with 1 conflict: conflict with "one": .metadata.labels.a'
    )
    forced = apply(live, node(a="2"), "two", force=True)
    assert forced["metadata"]["labels"] == {"a": "2", "b": "1"}
    assert owners(forced) == {
        "one": {("f:metadata", "f:labels", "f:b")},
        "two": {("f:metadata", "f:labels", "f:a")},
    }


def test_apply_refusals_are_kube_apiservers() -> None:
    with pytest.raises(ApiError) as error:
        apply(None, node(), "")
    assert error.value.code == 422 and "fieldManager: Required value" in error.value.message
    with pytest.raises(ApiError) as error:
        apply(None, {**node(), "apiVersion": "v2"}, "m")
    assert error.value.code == 400 and "Incorrect version specified in apply patch" in str(
        error.value
    )
    with pytest.raises(ApiError) as error:
        apply(None, {**node(), "spec": {"taintz": []}}, "m")
    assert error.value.code == 500
    assert error.value.message == (
        "failed to create typed patch object (/n1; /v1, Kind=Node): .spec.taintz: field not "
        "declared in schema"
    )
    assert "reason" not in error.value.status()


async def call(
    http: aiohttp.ClientSession, method: str, path: str, body: Any, content_type: str, **params: str
) -> tuple[int, Any, list[str]]:
    async with http.request(method, path, data=json.dumps(body), params=params,
                            headers={"Content-Type": content_type}) as response:  # fmt: skip
        return response.status, await response.json(), response.headers.getall("Warning", [])


async def test_apply_over_http(apiserver: EmbeddedApiServer, http: aiohttp.ClientSession) -> None:
    status, created, _ = await call(http, "PATCH", f"{NODES}/n1", node(a="1"), APPLY,
                                    fieldManager="one")  # fmt: skip
    assert status == 201 and created["metadata"]["managedFields"][0]["manager"] == "one"
    status, body, _ = await call(http, "PATCH", f"{NODES}/n1", node(a="2"), APPLY,
                                 fieldManager="two")  # fmt: skip
    assert (status, body["reason"]) == (409, "Conflict")
    status, body, _ = await call(http, "PATCH", f"{NODES}/n1", node(a="2"), APPLY,
                                 fieldManager="two", force="true")  # fmt: skip
    assert status == 200 and body["metadata"]["labels"] == {"a": "2"}
    assert int(body["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    status, body, _ = await call(http, "PATCH", f"{NODES}/n1", {}, "application/merge-patch+json",
                                 force="true")  # fmt: skip
    assert status == 422 and "may not be specified for non-apply patch" in body["message"]
    # a write that omits managedFields keeps them
    stored = apiserver.get_object("nodes", "n1")
    assert stored is not None
    stored["metadata"].pop("managedFields")
    status, body, _ = await call(http, "PUT", f"{NODES}/n1", stored, "application/json")
    assert status == 200 and body["metadata"]["managedFields"][0]["manager"] == "two"


async def test_field_validation(apiserver: EmbeddedApiServer, http: aiohttp.ClientSession) -> None:
    pods = "/api/v1/namespaces/default/pods"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "imagee": "x"}], "nodeNam": "n"}}  # fmt: skip
    status, body, _ = await call(http, "POST", pods, pod, "application/json",
                                 fieldValidation="Strict")  # fmt: skip
    assert (status, body["reason"]) == (400, "BadRequest")
    assert body["message"] == (
        'Pod in version "v1" cannot be handled as a Pod: strict decoding error: unknown field '
        '"spec.containers[0].imagee", unknown field "spec.nodeNam"'
    )
    status, body, warnings = await call(http, "POST", pods, pod, "application/json",
                                        fieldValidation="Warn")  # fmt: skip
    assert status == 201 and "nodeNam" not in body["spec"]  # dropped, as kube-apiserver does
    assert warnings == [
        '299 - "unknown field \\"spec.containers[0].imagee\\""',
        '299 - "unknown field \\"spec.nodeNam\\""',
    ]
    status, body, _ = await call(http, "PATCH", f"{pods}/p", {"spec": {"nodeNam": "n"}},
                                 "application/strategic-merge-patch+json",
                                 fieldValidation="Strict")  # fmt: skip
    assert (status, body["reason"]) == (422, "Invalid")
    assert body["message"].endswith('strict decoding error: unknown field "spec.nodeNam"')
    status, body, _ = await call(http, "PATCH", f"{pods}/p", {"metadata": {"labels": {"a": "b"}}},
                                 "application/strategic-merge-patch+json",
                                 fieldValidation="Strict")  # fmt: skip
    assert status == 200
    status, body, _ = await call(http, "POST", pods, {**pod, "metadata": {"name": "q"}},
                                 "application/json")  # fmt: skip
    assert status == 201, "no fieldValidation: not checked (the agent's own writes)"
    status, body, _ = await call(http, "POST", pods, pod, "application/json",
                                 fieldValidation="Sometimes")  # fmt: skip
    assert status == 422 and 'supported values: "Ignore", "Strict", "Warn"' in body["message"]
