"""The running controller watches instead of polling: idle, it sends nothing but its Lease
renewals (one PUT each); a new domain, a clique's change, a deleted template and a deletion
are acted on within a second or two through the watch (its re-reconcile interval set to a
minute here); a failed write is tried again without a new event."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from agent.imex.cliques import DOMAIN_LABEL, CliqueApi, clique_name
from agent.imex.controller import FINALIZER, Controller
from agent.imex.domains import DomainApi
from agent.sim.apiserver import EmbeddedApiServer
from tests.unit.imex.conftest import compute_domain

pytestmark = pytest.mark.anyio
NS = "gpu-dra-agent"
CLIQUE = "6f1a3c2e-9b4d-4e7a-8c21-3d5f7a9b1c0e.1"
PROMPT_S = 2.0  # "promptly": the watch's event, the pass's debounce, its writes


@asynccontextmanager
async def running(
    api_client: Any, *, lease_seconds: float = 15.0, resync_seconds: float = 60.0
) -> AsyncIterator[Controller]:
    api = DomainApi(api_client)
    controller = Controller(
        api,
        cliques=CliqueApi(api_client, api.call, NS),
        identity="controller-0",
        lease_namespace=NS,
        lease_seconds=lease_seconds,
        resync_seconds=resync_seconds,
    )
    async with anyio.create_task_group() as group:
        group.start_soon(controller.run)
        yield controller
        group.cancel_scope.cancel()


async def eventually(check: Callable[[], bool], timeout: float = PROMPT_S) -> None:  # noqa: ASYNC109
    with anyio.fail_after(timeout):
        while not check():  # noqa: ASYNC110 - another task's pass
            await anyio.sleep(0.02)


def clique(uid: str, *statuses: str) -> dict[str, Any]:
    daemons = [
        {"nodeName": f"tray-{i}", "ipAddress": f"10.0.0.{i + 1}", "cliqueID": CLIQUE,
         "index": i, "status": status}
        for i, status in enumerate(statuses)
    ]  # fmt: skip
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainClique",
        "metadata": {"name": clique_name(uid, CLIQUE), "namespace": NS,
                     "labels": {DOMAIN_LABEL: uid}},
        "daemons": daemons,
    }  # fmt: skip


def status_of(server: EmbeddedApiServer, name: str = "cd") -> str | None:
    domain = server.get_object("computedomains", name, "default") or {}
    return (domain.get("status") or {}).get("status")


def prepared(server: EmbeddedApiServer, name: str = "cd") -> bool:
    domain = server.get_object("computedomains", name, "default") or {}
    return FINALIZER in (domain.get("metadata") or {}).get("finalizers", []) and (
        server.get_object("resourceclaimtemplates", f"{name}-channel", "default") is not None
    )


async def test_an_idle_controller_sends_only_its_lease_renewals(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    """Over four renewal periods of a 3 s Lease (and twenty re-reconciles from the caches)
    the settled controller sends one Lease PUT a renewal and nothing else."""
    uid = apiserver.put_object(compute_domain(num_nodes=1))["metadata"]["uid"]
    apiserver.put_object(clique(uid, "Ready"))
    async with running(api_client, lease_seconds=3.0, resync_seconds=0.2) as controller:
        await eventually(lambda: status_of(apiserver) == "Ready" and prepared(apiserver), 5.0)
        await anyio.sleep(0.5)  # its Events posted
        apiserver.requests.clear()
        await anyio.sleep(4.2)
        sent = [r for r in apiserver.requests.records() if not r.watch]
        lease = [r for r in sent if "/leases" in r.path]
        renewals = [r for r in lease if r.method == "PUT" and r.status == 200]
        assert [(r.method, r.path) for r in sent if r not in lease] == []
        assert len(renewals) >= 3, sent
        assert len(sent) <= len(renewals), [(r.method, r.path) for r in sent]
        assert (controller.cache.lists, controller.cache.watches) == (3, 3)


async def test_changes_are_acted_on_through_the_watch(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    async with running(api_client) as controller:
        await eventually(lambda: controller.cache.watches == 3, 5.0)
        uid = apiserver.put_object(compute_domain(num_nodes=1))["metadata"]["uid"]
        await eventually(lambda: prepared(apiserver) and status_of(apiserver) == "NotReady")
        apiserver.put_object(clique(uid, "NotReady"))
        await eventually(lambda: status_of(apiserver) == "NotReady" and bool(
            (apiserver.get_object("computedomains", "cd", "default") or {})["status"].get("nodes")
        ))  # fmt: skip
        apiserver.put_object(clique(uid, "Ready"))
        await eventually(lambda: status_of(apiserver) == "Ready")
        apiserver.delete_object("resourceclaimtemplates", "cd-channel", "default")
        await eventually(lambda: prepared(apiserver))  # made again
        apiserver.delete_object("computedomains", "cd", "default")
        await eventually(
            lambda: apiserver.get_object("resourceclaimtemplates", "cd-channel", "default") is None
        )
        await anyio.sleep(0.3)
        assert apiserver.get_object("computedomains", "cd", "default") is not None  # its node
        apiserver.put_object(clique(uid))  # the node left
        await eventually(lambda: apiserver.get_object("computedomains", "cd", "default") is None)
        assert apiserver.list_objects("computedomaincliques", NS) == []
        assert controller.cache.lists == 3  # every change came by a watch
        reasons = [e["reason"] for e in apiserver.list_objects("events", "default")]
        assert sorted(reasons) == ["Ready", "TemplateCreated", "TemplateCreated"]


async def test_a_failed_write_is_tried_again_without_a_new_event(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    """The status write of a clique's change is answered 500 twice: the controller writes it
    again after its backoff (not a minute later, when the caches are reconciled again)."""
    async with running(api_client) as controller:
        uid = apiserver.put_object(compute_domain(num_nodes=1))["metadata"]["uid"]
        await eventually(lambda: prepared(apiserver) and status_of(apiserver) == "NotReady", 5.0)
        status = "/apis/resource.nvidia.com/v1beta1/namespaces/default/computedomains/cd/status"
        failing = apiserver.faults.fail_next("PUT", status, 500, count=2)
        apiserver.put_object(clique(uid, "Ready"))
        await eventually(lambda: status_of(apiserver) == "Ready")
        assert failing.remaining == 0
        assert controller.cache.lists == 3
