"""Server-side printing: the Table kube-apiserver answers ``kubectl get`` with."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pytest

from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.apiserver.errors import ApiError
from agent.sim.apiserver.kinds import KindRegistry
from agent.sim.apiserver.printers import human_duration
from agent.sim.apiserver.tables import table, table_version
from tests.unit.sim.conftest import slice_body

pytestmark = pytest.mark.anyio
KUBECTL_ACCEPT = (
    "application/json;as=Table;v=v1;g=meta.k8s.io,"
    "application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json"
)
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
KINDS = KindRegistry()


def ago(**delta: float) -> str:
    return (NOW - timedelta(**delta)).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(-5, "<invalid>"), (-1, "0s"), (0, "0s"), (119, "119s"), (120, "2m"), (150, "2m30s"),
     (600, "10m"), (10799, "179m"), (3 * 3600 + 60, "3h1m"), (8 * 3600, "8h"),
     (47 * 3600, "47h"), (50 * 3600, "2d2h"), (8 * 86400, "8d"), (800 * 86400, "2y70d"),
     (9 * 365 * 86400, "9y")],
)  # fmt: skip
def test_ages_are_apimachinery_human_durations(seconds: int, text: str) -> None:
    assert human_duration(seconds) == text


def test_accept_negotiation() -> None:
    assert table_version(KUBECTL_ACCEPT) == "v1"
    assert table_version("application/json;as=Table;v=v1beta1;g=meta.k8s.io") == "v1beta1"
    assert table_version("application/json") is None
    assert table_version("") is None
    with pytest.raises(ApiError) as error:
        table_version("application/json;as=Table;v=v2;g=meta.k8s.io")
    assert error.value.code == 406


def _row(kind: str, obj: dict[str, Any]) -> list[Any]:
    result = table(KINDS.resolve(kind), [obj], version="v1", include="Metadata",
                   metadata={}, now=NOW)  # fmt: skip
    cells: list[Any] = result["rows"][0]["cells"]
    return cells


def test_resource_claim_states() -> None:
    claim: dict[str, Any] = {"metadata": {"name": "c", "creationTimestamp": ago(seconds=30)}}
    assert _row("resourceclaims", claim) == ["c", "pending", "30s"]
    claim["status"] = {"allocation": {"devices": {}}}
    assert _row("resourceclaims", claim)[1] == "allocated"
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": "p", "uid": "u"}]
    assert _row("resourceclaims", claim)[1] == "allocated,reserved"
    claim["metadata"]["deletionTimestamp"] = ago(seconds=1)
    assert _row("resourceclaims", claim)[1] == "deleted,allocated,reserved"
    del claim["status"]
    assert _row("resourceclaims", claim)[1] == "deleted"


def test_resource_slice_node_and_pod_rows() -> None:
    body = slice_body(name="s1")
    body["metadata"]["creationTimestamp"] = ago(minutes=5)
    assert _row("resourceslices", body) == ["s1", "node1", "gpu.nvidia.com", "node1", "5m"]
    node = {
        "metadata": {"name": "n", "creationTimestamp": ago(hours=3),
                     "labels": {"node-role.kubernetes.io/gpu": "", "kubernetes.io/role": "edge"}},
        "spec": {"unschedulable": True},
        "status": {"conditions": [{"type": "Ready", "status": "False"}],
                   "nodeInfo": {"kubeletVersion": "v1.35.0"},
                   "addresses": [{"type": "InternalIP", "address": "10.0.0.5"}]},
    }  # fmt: skip
    assert _row("nodes", node) == [
        "n", "NotReady,SchedulingDisabled", "edge,gpu", "3h", "v1.35.0", "10.0.0.5", "<none>",
        "<unknown>", "<unknown>", "<unknown>",
    ]  # fmt: skip
    pod = {
        "metadata": {"name": "p", "creationTimestamp": ago(seconds=10)},
        "spec": {"containers": [{"name": "a"}, {"name": "b"}], "nodeName": "n"},
        "status": {"phase": "Running", "podIPs": [{"ip": "10.1.0.7"}], "containerStatuses": [
            {"name": "a", "ready": True, "restartCount": 2, "state": {"running": {}},
             "lastState": {"terminated": {"finishedAt": ago(seconds=4)}}},
            {"name": "b", "ready": False, "state": {"waiting": {"reason": "CrashLoopBackOff"}}},
        ]},
    }  # fmt: skip
    assert _row("pods", pod) == [
        "p", "1/2", "CrashLoopBackOff", "2 (4s ago)", "10s", "10.1.0.7", "n", "<none>", "<none>"
    ]  # fmt: skip


def test_event_row_and_the_crd_columns() -> None:
    event = {
        "metadata": {"name": "e1"}, "type": "Warning", "reason": "GpuXid",
        "involvedObject": {"kind": "Node", "name": "node-a"}, "message": " XID 79 \n",
        "firstTimestamp": ago(minutes=20), "lastTimestamp": ago(seconds=40), "count": 3,
        "source": {"component": "gpu-dra-agent", "host": "node-a"},
    }  # fmt: skip
    assert _row("events", event) == [
        "40s", "Warning", "GpuXid", "node/node-a", "", "gpu-dra-agent, node-a", "XID 79",
        "20m", 3, "e1",
    ]  # fmt: skip
    domain = {"metadata": {"name": "d", "creationTimestamp": ago(days=3)},
              "spec": {"numNodes": 4}, "status": {"status": "Ready"}}  # fmt: skip
    result = table(KINDS.resolve("computedomains"), [domain], version="v1", include="None",
                   metadata={}, now=NOW)  # fmt: skip
    assert [c["name"] for c in result["columnDefinitions"]] == ["Name", "Status", "Nodes", "Age"]
    assert result["rows"] == [{"cells": ["d", "Ready", 4, "3d"], "object": None}]
    clique = {"metadata": {"name": "x.0"}, "daemons": [{"index": 5}, {"index": 2}]}
    result = table(KINDS.resolve("computedomaincliques"), [clique], version="v1",
                   include="Metadata", metadata={}, now=NOW, headers=False)  # fmt: skip
    assert result["columnDefinitions"] is None
    assert result["rows"][0]["cells"] == ["x.0", 5, None]  # no creationTimestamp: a nil cell
    assert result["rows"][0]["object"]["kind"] == "PartialObjectMetadata"


async def test_list_get_and_watch_answer_tables(
    apiserver: EmbeddedApiServer, http: aiohttp.ClientSession
) -> None:
    apiserver.put_object(slice_body(name="s1"))
    path = "/apis/resource.k8s.io/v1/resourceslices"
    async with http.get(path, headers={"Accept": KUBECTL_ACCEPT}) as response:
        listed = await response.json()
    assert listed["kind"] == "Table" and listed["apiVersion"] == "meta.k8s.io/v1"
    assert [c["name"] for c in listed["columnDefinitions"]] == [
        "Name", "Node", "Driver", "Pool", "Age"
    ]  # fmt: skip
    assert listed["rows"][0]["cells"][:4] == ["s1", "node1", "gpu.nvidia.com", "node1"]
    assert listed["metadata"]["resourceVersion"] == str(apiserver.resource_version)
    async with http.get(f"{path}/s1", headers={"Accept": KUBECTL_ACCEPT},
                        params={"includeObject": "Object"}) as response:  # fmt: skip
        single = await response.json()
    assert single["rows"][0]["object"]["spec"]["driver"] == "gpu.nvidia.com"
    async with http.get(path) as response:  # plain JSON still
        assert (await response.json())["kind"] == "ResourceSliceList"
    params = {"watch": "1", "resourceVersion": "0", "timeoutSeconds": "1"}
    async with http.get(path, headers={"Accept": KUBECTL_ACCEPT}, params=params) as response:
        apiserver.put_object(slice_body(name="s2"))
        events = [line for line in (await response.text()).splitlines() if line]
    first, second = (json.loads(line) for line in events[:2])
    assert first["type"] == "ADDED" and first["object"]["kind"] == "Table"
    assert first["object"]["columnDefinitions"] and second["object"]["columnDefinitions"] is None
    assert second["object"]["rows"][0]["cells"][0] == "s2"
