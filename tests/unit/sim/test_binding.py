"""Binding conditions (KEP-5007) in the embedded cluster, over real HTTP: the 1.36 scheduler's
allocation copies and ``allocationTimestamp``, PreBind's wait for the conditions a fake driver
controller writes through ``/status``, the undo on a failure condition or a timeout, and the
retry on the next node (``agent.sim.binding``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import datetime
from functools import partial
from typing import Any

import anyio
import pytest

from agent.sim.allocation import (
    ApiAccess,
    allocate_existing_claim,
    api_request,
    claim_from_request,
    create_claim,
)
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.binding import (
    allocate_and_bind,
    create_and_place_claim,
    place_claim,
    wait_for_binding,
)
from agent.sim.claims import PodReference
from agent.sim.deviceclasses import default_device_classes

Obj = dict[str, Any]
NODES = ("node-a", "node-b")
CD = "compute-domain.nvidia.com"
READY, FAILED = "IMEXDaemonReady", "IMEXDaemonFailed"
CHANNEL_CLASS = "compute-domain-default-channel.nvidia.com"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"


def slices(node: str) -> list[Obj]:
    """A channel pool whose device has binding conditions and a GPU pool without."""
    channel = {
        "name": "channel-0",
        "attributes": {"type": {"string": "channel"}, "id": {"int": 0}},
        "bindingConditions": [READY],
        "bindingFailureConditions": [FAILED],
    }
    gpu = {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}}}
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{driver}"},
            "spec": {
                "driver": driver,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [device],
            },
        }
        for driver, device in ((CD, channel), ("gpu.nvidia.com", gpu))
    ]


async def started(version: str) -> EmbeddedApiServer:
    server = EmbeddedApiServer(kubernetes_version=version, bookmark_interval=0.2)
    await server.start("127.0.0.1", 0)
    any_device = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "any-device"},
        "spec": {"selectors": [{"cel": {"expression": "true"}}]},
    }
    for item in [*default_device_classes(), any_device]:
        server.put_object(item)
    for node in NODES:
        server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        for item in slices(node):
            server.put_object(item)
    return server


@pytest.fixture
async def cluster() -> AsyncIterator[EmbeddedApiServer]:
    server = await started("1.36.0")
    try:
        yield server
    finally:
        await server.stop()


def channel(name: str) -> Obj:
    return claim_from_request(
        name, {"name": "channel", "exactly": {"deviceClassName": CHANNEL_CLASS}}
    )


def results(claim: Obj) -> list[Obj]:
    return list(claim["status"]["allocation"]["devices"]["results"])


async def write_condition(
    access: ApiAccess, name: str, kind: str, status: str = "True", message: str = ""
) -> Obj:
    """What a driver's controller does: the status.devices entry of the allocated channel."""
    path = f"{CLAIMS}/{name}"
    async with access.session() as session:
        claim = await api_request(session, "GET", path)
        (result,) = results(claim)
        entry = {k: result[k] for k in ("driver", "pool", "device")}
        entry["conditions"] = [
            {"type": kind, "status": status, "reason": "Test", "message": message,
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
        ]  # fmt: skip
        claim["status"]["devices"] = [entry]
        return await api_request(session, "PUT", f"{path}/status?fieldValidation=Strict", claim)


def stored(server: EmbeddedApiServer, name: str) -> Obj:
    claim = server.get_object("resourceclaims", name, "default")
    assert claim is not None
    return claim


async def allocated(server: EmbeddedApiServer, name: str) -> Obj:
    with anyio.fail_after(5):
        while not (stored(server, name).get("status") or {}).get("allocation"):  # noqa: ASYNC110
            await anyio.sleep(0.02)
    return stored(server, name)


async def fake_controller(
    server: EmbeddedApiServer,
    access: ApiAccess,
    name: str,
    answers: dict[str, tuple[str, str]],
    written: dict[str, Obj],
) -> None:
    """A driver's controller: when claim ``name`` is allocated on a node's pool, write the
    node's answer (condition type, message) once; ends when every node was answered."""
    while len(written) < len(answers):
        claim = stored(server, name)
        allocation = (claim.get("status") or {}).get("allocation")
        pool = results(claim)[0]["pool"] if allocation else None
        if pool in answers and pool not in written:
            kind, message = answers[pool]
            written[pool] = await write_condition(access, name, kind, message=message)
        await anyio.sleep(0.02)


@pytest.mark.anyio
async def test_on_1_35_nothing_is_copied_and_nothing_waits() -> None:
    server = await started("1.35.0")
    try:
        access = ApiAccess(server.url)
        await create_claim(access, channel("ch"))
        outcome = await allocate_and_bind(access, "default", "ch", "node-a")
    finally:
        await server.stop()
    assert outcome.state == "bound" and outcome.waited_s == 0 and outcome.claim is not None
    allocation = outcome.claim["status"]["allocation"]
    assert "allocationTimestamp" not in allocation
    (result,) = allocation["devices"]["results"]
    assert result["device"] == "channel-0"
    assert "bindingConditions" not in result and "bindingFailureConditions" not in result


@pytest.mark.anyio
async def test_on_1_36_the_wait_ends_when_the_conditions_are_true(
    cluster: EmbeddedApiServer,
) -> None:
    access = ApiAccess(cluster.url)
    await create_claim(access, channel("ch"))
    before = time.time()
    outcomes = []

    async def schedule() -> None:
        outcomes.append(await allocate_and_bind(access, "default", "ch", "node-a"))

    async with anyio.create_task_group() as group:
        group.start_soon(schedule)
        group.cancel_scope.deadline = anyio.current_time() + 10  # a wait that never ends fails
        allocation = (await allocated(cluster, "ch"))["status"]["allocation"]
        (result,) = allocation["devices"]["results"]
        assert result["bindingConditions"] == [READY]
        assert result["bindingFailureConditions"] == [FAILED]
        stamp = datetime.fromisoformat(allocation["allocationTimestamp"]).timestamp()
        assert before - 1 <= stamp <= time.time()
        await write_condition(access, "ch", READY, "False")  # not yet
        await anyio.sleep(0.3)
        assert not outcomes
        written = await write_condition(access, "ch", READY, message="daemon READY")
    (outcome,) = outcomes
    assert outcome.state == "bound" and outcome.waited_s >= 0.3, outcome
    claim = stored(cluster, "ch")
    assert claim["status"]["allocation"] == allocation
    assert claim["status"]["devices"] == written["status"]["devices"]  # stored as written
    assert claim["status"]["devices"][0]["conditions"][0]["message"] == "daemon READY"


@pytest.mark.anyio
async def test_pools_with_binding_conditions_are_tried_last(cluster: EmbeddedApiServer) -> None:
    access = ApiAccess(cluster.url)
    # compute-domain.nvidia.com sorts before gpu.nvidia.com: without the 1.36 rule the
    # channel would be first fit
    any_one = {"name": "dev", "exactly": {"deviceClassName": "any-device"}}
    with anyio.fail_after(10):  # the channel would wait for its conditions, then time out
        placement = await create_and_place_claim(
            access, claim_from_request("one", any_one), ["node-a"], binding_timeout_s=2
        )
    assert placement.node == "node-a" and placement.claim is not None
    (result,) = results(placement.claim)
    assert (result["driver"], result["device"]) == ("gpu.nvidia.com", "gpu-0")
    assert [a.outcome for a in placement.attempts] == ["bound"]


@pytest.mark.anyio
async def test_claims_without_binding_conditions_do_not_wait(cluster: EmbeddedApiServer) -> None:
    access = ApiAccess(cluster.url)
    gpu = {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}
    await create_claim(access, claim_from_request("gpu", gpu))
    outcome = await allocate_and_bind(access, "default", "gpu", "node-a")
    assert outcome.state == "bound" and outcome.waited_s == 0
    assert outcome.claim is not None
    assert "allocationTimestamp" in outcome.claim["status"]["allocation"]  # 1.36: always
    (result,) = results(outcome.claim)
    assert "bindingConditions" not in result
    requests = len(cluster.requests.records())
    again = await wait_for_binding(access, outcome.claim)
    assert again.state == "bound" and len(cluster.requests.records()) == requests


@pytest.mark.anyio
async def test_a_failure_condition_undoes_and_the_claim_binds_on_the_other_node(
    cluster: EmbeddedApiServer,
) -> None:
    """A fake driver controller: node-a's daemon fails, node-b's comes up."""
    access = ApiAccess(cluster.url)
    await create_claim(access, channel("ch"))
    answers = {"node-a": (FAILED, "IMEX daemon on node-a: exited with 1"), "node-b": (READY, "")}
    written: dict[str, Obj] = {}
    controller = partial(fake_controller, cluster, access, "ch", answers, written)

    async with anyio.create_task_group() as group:
        group.start_soon(controller)
        with anyio.fail_after(10):
            placement = await place_claim(
                access, "default", "ch", NODES, reserved_for=(PodReference("p"),)
            )
    assert placement.node == "node-b", placement
    first, second = placement.attempts
    assert (first.node, first.outcome) == ("node-a", "failed")
    assert "IMEXDaemonFailed is True" in first.message and "node-a: exited" in first.message
    assert (second.node, second.outcome) == ("node-b", "bound")
    claim = stored(cluster, "ch")
    assert results(claim)[0]["pool"] == "node-b"
    assert [d["pool"] for d in claim["status"]["devices"]] == ["node-b"]  # node-a's removed
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["p"]
    assert written["node-a"]["status"]["devices"][0]["pool"] == "node-a"


@pytest.mark.anyio
async def test_a_timeout_undoes_the_allocation(cluster: EmbeddedApiServer) -> None:
    access = ApiAccess(cluster.url)
    await create_claim(access, channel("ch"))
    placement = await place_claim(access, "default", "ch", NODES, binding_timeout_s=1)
    assert placement.node is None
    assert [(a.node, a.outcome) for a in placement.attempts] == [
        ("node-a", "timeout"),
        ("node-b", "timeout"),
    ]
    assert all(a.seconds <= 3 for a in placement.attempts)
    assert "IMEXDaemonReady" in placement.attempts[0].message
    status = stored(cluster, "ch").get("status") or {}
    assert not status.get("allocation") and not status.get("reservedFor")


@pytest.mark.anyio
async def test_the_undo_reads_again_after_a_conflict(cluster: EmbeddedApiServer) -> None:
    access = ApiAccess(cluster.url)
    await create_claim(access, channel("ch"))
    claim = await allocate_existing_claim(access, "default", "ch", "node-a")
    await write_condition(access, "ch", READY, "False")  # the claim changed since
    conflict = cluster.faults.fail_next("PUT", f"{CLAIMS}/ch/status", 409)
    outcome = await wait_for_binding(access, claim, binding_timeout_s=1)
    assert outcome.state == "timeout" and conflict.hits == 1
    status = stored(cluster, "ch").get("status") or {}
    assert not status.get("allocation") and not status.get("devices")
