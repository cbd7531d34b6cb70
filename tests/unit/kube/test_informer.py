"""The list-then-watch cache (informer) against the embedded API server: one LIST then a watch
(every namespace, or by label), nothing sent at rest, a watch the server ends resumed from
its version, a re-list after 410 (an answer or an expired history), no hot loop against a
server that ends each watch at once, Retry-After honoured; and the cache never goes back in
time."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.imex.documents import GROUP, PLURAL, VERSION
from agent.kube.client import create_api_client
from agent.kube.informer import Informer, collection
from agent.kube.library import CustomObjectsApi, ResourceV1Api
from agent.kube.rawcall import send
from agent.sim.apiserver import EmbeddedApiServer
from tests.unit.imex.conftest import compute_domain

pytestmark = pytest.mark.anyio
DOMAINS = "/apis/resource.nvidia.com/v1beta1/computedomains"
LABEL = "resource.nvidia.com/computeDomain"


def domains(api_client: Any, **options: Any) -> Informer:
    """An informer of every ComputeDomain, its LIST sent once (no 429 retries)."""
    calls = collection(
        partial(send, request_timeout=5.0),
        CustomObjectsApi(api_client).list_cluster_custom_object,
        GROUP, VERSION, PLURAL, request_timeout=5.0,
    )  # fmt: skip
    return Informer("ComputeDomains", *calls, **options)


async def eventually(check: Callable[[], bool], timeout: float = 3.0) -> None:  # noqa: ASYNC109
    with anyio.fail_after(timeout):
        while not check():  # noqa: ASYNC110 - another task's watch
            await anyio.sleep(0.02)


def names(informer: Informer) -> list[str]:
    return sorted(informer.snapshot())


def template(name: str, namespace: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": {"spec": {"devices": {"requests": []}}},
    }


async def test_one_list_then_the_watch_of_every_namespace(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    apiserver.put_object(compute_domain("a", "team-a"))
    apiserver.put_object(compute_domain("b", "team-b"))
    informer = domains(api_client)
    async with anyio.create_task_group() as group:
        group.start_soon(informer.run)
        with anyio.fail_after(3):
            await informer.wait_synced()
        assert names(informer) == ["team-a/a", "team-b/b"] and informer.changed.is_set()
        informer.changed.clear()
        apiserver.put_object(compute_domain("c", "team-c"))
        await eventually(lambda: "team-c/c" in informer.snapshot())
        assert informer.changed.is_set()
        changed = compute_domain("c", "team-c", num_nodes=4)
        apiserver.put_object(changed)
        await eventually(lambda: informer.snapshot()["team-c/c"]["spec"]["numNodes"] == 4)
        apiserver.delete_object("computedomains", "a", "team-a")
        await eventually(lambda: names(informer) == ["team-b/b", "team-c/c"])
        informer.changed.clear()
        apiserver.requests.clear()
        await anyio.sleep(0.7)  # bookmarks come (every 0.2 s) and change nothing
        assert apiserver.requests.records() == [], "an idle informer sent requests"
        assert not informer.changed.is_set()
        assert (informer.lists, informer.watches) == (1, 1)
        group.cancel_scope.cancel()


async def test_a_label_selector_follows_objects_into_and_out_of_it(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    """ResourceClaimTemplates of every namespace by label: one that gains the label enters
    the cache, one that loses it leaves it (the embedded server sends ADDED and DELETED)."""
    apiserver.put_object(template("mine", "team-a", {LABEL: "uid-1"}))
    apiserver.put_object(template("theirs", "team-b"))
    calls = collection(
        partial(send, request_timeout=5.0),
        ResourceV1Api(api_client).list_resource_claim_template_for_all_namespaces,
        request_timeout=5.0, label_selector=LABEL,
    )  # fmt: skip
    informer = Informer("ResourceClaimTemplates", *calls)
    async with anyio.create_task_group() as group:
        group.start_soon(informer.run)
        with anyio.fail_after(3):
            await informer.wait_synced()
        assert names(informer) == ["team-a/mine"]
        apiserver.put_object(template("theirs", "team-b", {LABEL: "uid-2"}))
        await eventually(lambda: names(informer) == ["team-a/mine", "team-b/theirs"])
        apiserver.put_object(template("mine", "team-a"))
        await eventually(lambda: names(informer) == ["team-b/theirs"])
        assert informer.lists == 1
        group.cancel_scope.cancel()


async def test_a_watch_the_server_ends_is_resumed(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    """The server ends the watch (a timeout, a restart): the next one starts from the last
    version seen and brings what changed meanwhile, without a LIST."""
    informer = domains(api_client)
    async with anyio.create_task_group() as group:
        group.start_soon(informer.run)
        await eventually(lambda: informer.synced and apiserver.open_watches(DOMAINS) == 1)
        assert apiserver.end_watches(DOMAINS) == 1
        apiserver.put_object(compute_domain("meanwhile"))
        await eventually(lambda: names(informer) == ["default/meanwhile"])
        await eventually(lambda: apiserver.open_watches(DOMAINS) == 1)
        assert (informer.lists, informer.watches) == (1, 2)
        group.cancel_scope.cancel()


async def test_410_lists_again(apiserver: EmbeddedApiServer, api_client: Any) -> None:
    """A watch answered 410 Gone: the cache is listed again, with what changed meanwhile."""
    informer = domains(api_client)
    async with anyio.create_task_group() as group:
        group.start_soon(informer.run)
        await eventually(lambda: informer.synced and apiserver.open_watches(DOMAINS) == 1)
        rule = apiserver.faults.fail_next("GET", DOMAINS, 410, watch=True)
        apiserver.put_object(compute_domain("late"))
        assert apiserver.end_watches(DOMAINS) == 1
        await eventually(lambda: informer.lists == 2 and apiserver.open_watches(DOMAINS) == 1)
        assert rule.remaining == 0 and names(informer) == ["default/late"]
        group.cancel_scope.cancel()


async def test_an_expired_history_lists_again(tmp_path: Path) -> None:
    """The watch resumes from a version the server's history (3 writes) no longer holds:
    the ERROR event 410 makes the informer list again, which brings every write."""
    async with EmbeddedApiServer(history_size=3) as server:
        client = await create_api_client(server.write_kubeconfig(tmp_path / "kubeconfig"))
        try:
            informer = domains(client)
            async with anyio.create_task_group() as group:
                group.start_soon(informer.run)
                await eventually(lambda: informer.synced and server.open_watches() == 1)
                late = server.faults.add_latency("GET", DOMAINS, 0.5, count=1, watch=True)
                server.end_watches()
                await eventually(lambda: late.hits == 1)  # the resumed watch waits there
                for index in range(5):
                    server.put_object(compute_domain(f"cd-{index}"))
                await eventually(lambda: len(informer) == 5)
                assert informer.lists == 2
                group.cancel_scope.cancel()
        finally:
            await client.close()


async def test_a_server_that_ends_every_watch_at_once_is_not_hammered(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    """Watches of ``timeoutSeconds=0`` end before any event: the informer waits longer each
    time (a few watches in 1.5 s, not hundreds) and still sees a change."""
    informer = domains(api_client, watch_timeout=0)
    async with anyio.create_task_group() as group:
        group.start_soon(informer.run)
        await anyio.sleep(1.5)
        assert 2 <= informer.watches <= 8, informer.watches
        apiserver.put_object(compute_domain())
        await eventually(lambda: names(informer) == ["default/cd"], timeout=5)
        assert informer.lists == 1
        group.cancel_scope.cancel()


async def test_retry_after_is_honoured(apiserver: EmbeddedApiServer, api_client: Any) -> None:
    """A watch answered 503 with Retry-After: 1 is not tried again sooner (the backoff alone
    would wait 0.1-0.2 s)."""
    informer = domains(api_client)
    async with anyio.create_task_group() as group:
        group.start_soon(informer.run)
        await eventually(lambda: informer.synced and apiserver.open_watches(DOMAINS) == 1)
        rule = apiserver.faults.fail_next("GET", DOMAINS, 503, retry_after=1, watch=True)
        apiserver.end_watches(DOMAINS)
        await eventually(lambda: rule.hits == 1)
        failed = anyio.current_time()
        with anyio.fail_after(3):
            await apiserver.wait_for_watches(1, DOMAINS)
        assert anyio.current_time() - failed >= 0.95
        assert informer.lists == 1  # resumed from its version: no LIST
        group.cancel_scope.cancel()


def test_the_cache_never_goes_back_in_time() -> None:
    """A late event (an older version) does not undo a newer write the owner recorded, nor
    bring back an object the owner deleted; a LIST older than a write keeps the write."""

    async def unused(version: str, seconds: int) -> Any:
        raise AssertionError("no watch here")

    listed: dict[str, Any] = {}

    async def list_once() -> dict[str, Any]:
        return copy.deepcopy(listed)

    def obj(name: str, rv: int, value: int = 0) -> dict[str, Any]:
        meta = {"name": name, "namespace": "ns", "resourceVersion": str(rv)}
        return {"metadata": meta, "spec": {"value": value}}

    informer = Informer("things", list_once, unused)
    informer.record(obj("a", 7, 2))
    informer.record(obj("a", 5, 1))
    assert informer.get("ns/a") == obj("a", 7, 2)
    informer.forget(obj("a", 7, 2))
    informer.record(obj("a", 7, 2))  # the watch event of the version deleted
    assert informer.get("ns/a") is None
    informer.record(obj("a", 9))  # created again since
    assert informer.get("ns/a") == obj("a", 9)
    informer.record(obj("b", 12))
    informer.forget(obj("a", 11))
    # a LIST served at version 10 knows neither the write at 12 nor the delete after 11
    listed.update(metadata={"resourceVersion": "10"}, items=[obj("a", 9), obj("c", 3)])
    anyio.run(informer.relist)
    assert sorted(informer.snapshot()) == ["ns/b", "ns/c"]
    assert informer.synced and informer.changed.is_set() and informer.lists == 1
