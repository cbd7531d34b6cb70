"""Watch semantics over raw HTTP: replay, 410 Expired, bookmarks, selectors, timeouts."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import aiohttp
import anyio
import anyio.lowlevel
import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from agent.sim.apiserver import EmbeddedApiServer
from tests.unit.sim.conftest import slice_body

pytestmark = pytest.mark.anyio
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


async def read_events(
    http: aiohttp.ClientSession, path: str, count: int | None = None, **params: str
) -> list[dict[str, Any]]:
    """Read newline-delimited events until ``count`` arrived or the server ended the stream."""
    events: list[dict[str, Any]] = []
    with anyio.fail_after(5):  # a missing event fails the test instead of hanging it
        async with http.get(path, params={"watch": "true", **params}) as response:
            assert response.status == 200
            assert response.headers["Transfer-Encoding"] == "chunked"
            while count is None or len(events) < count:
                line = await response.content.readline()
                if not line:
                    break
                events.append(json.loads(line))
    return events


async def test_initial_state_then_live(
    apiserver: EmbeddedApiServer, http: aiohttp.ClientSession
) -> None:
    apiserver.put_object(slice_body(name="a"))
    events: list[dict[str, Any]] = []
    with anyio.fail_after(5):
        async with http.get(SLICES, params={"watch": "1"}) as response:
            events.append(json.loads(await response.content.readline()))
            apiserver.put_object(slice_body(name="b"))
            apiserver.delete_object("resourceslices", "a")
            events.append(json.loads(await response.content.readline()))
            events.append(json.loads(await response.content.readline()))
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "a"), ("ADDED", "b"), ("DELETED", "a"),
    ]  # fmt: skip
    rvs = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert rvs == sorted(rvs)
    assert events[2]["object"]["kind"] == "ResourceSlice"


async def test_too_old_resource_version_is_410() -> None:
    server = EmbeddedApiServer(history_size=3)
    async with server:
        for i in range(6):
            server.put_object(slice_body(name=f"s{i}"))
        async with aiohttp.ClientSession(base_url=server.url) as session:
            events = await read_events(session, SLICES, resourceVersion="2")
            assert len(events) == 1 and events[0]["type"] == "ERROR"
            status = events[0]["object"]
            assert (status["kind"], status["code"], status["reason"]) == ("Status", 410, "Expired")
            recent = await read_events(
                session, SLICES, count=2, resourceVersion=str(server.resource_version - 2)
            )
            assert [e["object"]["metadata"]["name"] for e in recent] == ["s4", "s5"]


async def test_410_reaches_kubernetes_asyncio_as_api_exception() -> None:
    server = EmbeddedApiServer(history_size=2)
    async with server:
        for i in range(5):
            server.put_object(slice_body(name=f"s{i}"))
        api_client = await config.new_client_from_config_dict(server.kubeconfig_dict())
        async with api_client:
            api = client.ResourceV1Api(api_client)
            stream = watch.Watch()
            with pytest.raises(ApiException) as gone:
                async for _ in stream.stream(api.list_resource_slice, resource_version="2",
                                             timeout_seconds=1):  # fmt: skip
                    pass
            assert gone.value.status == 410


async def test_bookmarks(apiserver: EmbeddedApiServer, http: aiohttp.ClientSession) -> None:
    apiserver.put_object(slice_body(name="a"))
    rv = str(apiserver.resource_version)
    events = await read_events(
        http, SLICES, count=2, resourceVersion=rv, allowWatchBookmarks="true"
    )
    assert [e["type"] for e in events] == ["BOOKMARK", "BOOKMARK"]
    assert events[0]["object"] == {
        "kind": "ResourceSlice",
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {"resourceVersion": rv},
    }
    none = await read_events(http, SLICES, resourceVersion=rv, timeoutSeconds="1")
    assert none == []  # no bookmarks unless asked for


async def test_send_initial_events_ends_with_marked_bookmark(
    apiserver: EmbeddedApiServer, http: aiohttp.ClientSession
) -> None:
    apiserver.put_object(slice_body(name="a"))
    events = await read_events(http, SLICES, count=2, sendInitialEvents="true",
                               allowWatchBookmarks="true", resourceVersionMatch="NotOlderThan")  # fmt: skip
    assert [e["type"] for e in events] == ["ADDED", "BOOKMARK"]
    annotations = events[1]["object"]["metadata"]["annotations"]
    assert annotations == {"k8s.io/initial-events-end": "true"}


async def test_timeout_seconds_ends_stream(http: aiohttp.ClientSession) -> None:
    started = time.monotonic()
    assert await read_events(http, SLICES, timeoutSeconds="1") == []
    assert 0.9 <= time.monotonic() - started < 3


async def test_object_leaving_selector_is_deleted(
    apiserver: EmbeddedApiServer, http: aiohttp.ClientSession
) -> None:
    apiserver.put_object(slice_body(name="a", tier="gold"))
    start = str(apiserver.resource_version)
    apiserver.put_object(slice_body(name="a", tier="silver"))  # leaves the selector
    apiserver.put_object(slice_body(name="a", tier="gold"))  # enters it again
    apiserver.put_object(slice_body(name="b", tier="silver"))  # never matches
    events = await read_events(
        http, SLICES, count=2, resourceVersion=start, labelSelector="tier=gold"
    )
    assert [(e["type"], e["object"]["metadata"]["labels"]["tier"]) for e in events] == [
        ("DELETED", "silver"), ("ADDED", "gold"),
    ]  # fmt: skip


async def test_namespaced_watch_only_sees_its_namespace(
    apiserver: EmbeddedApiServer, http: aiohttp.ClientSession
) -> None:
    def claim(ns: str) -> dict[str, Any]:
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": "c", "namespace": ns}, "spec": {}}  # fmt: skip

    apiserver.put_object(claim("ns1"))
    apiserver.put_object(claim("ns2"))
    events = await read_events(
        http, "/apis/resource.k8s.io/v1/namespaces/ns2/resourceclaims", timeoutSeconds="1"
    )
    assert [e["object"]["metadata"]["namespace"] for e in events] == ["ns2"]
    all_ns = await read_events(http, "/apis/resource.k8s.io/v1/resourceclaims", timeoutSeconds="1")
    assert len(all_ns) == 2


async def test_end_watches_early(apiserver: EmbeddedApiServer, http: aiohttp.ClientSession) -> None:
    async with http.get(SLICES, params={"watch": "true"}) as response:
        with anyio.fail_after(2):
            await apiserver.wait_for_watches(1, SLICES)
        assert apiserver.end_watches("/apis/resource.k8s.io/v1/nodes") == 0
        assert apiserver.end_watches(SLICES) == 1
        with anyio.fail_after(2):
            assert await response.content.readline() == b""  # clean end of stream
    with anyio.fail_after(2):
        await apiserver.wait_for_watches(0)


async def test_watch_replays_state_exactly_under_concurrent_writes(
    apiserver: EmbeddedApiServer, http: aiohttp.ClientSession
) -> None:
    """Applying the events to an empty map reproduces the final list: no gap, no duplicate."""
    rng = random.Random(7)
    for i in range(3):
        apiserver.put_object(slice_body(name=f"s{i}"))
    state: dict[str, str] = {}
    last_rv = 0

    async def writer() -> None:
        await apiserver.wait_for_watches(1, SLICES)
        for step in range(150):
            name = f"s{rng.randrange(8)}"
            if rng.random() < 0.3 and apiserver.get_object("resourceslices", name):
                apiserver.delete_object("resourceslices", name)
            else:
                apiserver.put_object(slice_body(name=name, step=str(step)))
            apiserver.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
            if step % 10 == 0:
                await anyio.lowlevel.checkpoint()  # let the watch stream interleave
        apiserver.put_object(slice_body(name="sentinel"))

    async with (
        anyio.create_task_group() as tasks,
        http.get(SLICES, params={"watch": "1"}) as response,
    ):
        tasks.start_soon(writer)
        with anyio.fail_after(10):
            while "sentinel" not in state:
                event = json.loads(await response.content.readline())
                meta = event["object"]["metadata"]
                rv = int(meta["resourceVersion"])
                assert rv > last_rv
                last_rv = rv
                if event["type"] == "DELETED":
                    assert meta["name"] in state
                    del state[meta["name"]]
                else:
                    assert (event["type"] == "ADDED") == (meta["name"] not in state)
                    state[meta["name"]] = meta["resourceVersion"]
    listed = apiserver.list_objects("resourceslices")
    assert state == {o["metadata"]["name"]: o["metadata"]["resourceVersion"] for o in listed}
