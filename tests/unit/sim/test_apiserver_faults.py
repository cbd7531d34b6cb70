"""Fault injection: each fault reaches clients as the real status code or behaviour."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import aiohttp
import anyio
import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from agent.sim.apiserver import EmbeddedApiServer
from tests.unit.sim.conftest import slice_body

pytestmark = pytest.mark.anyio
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (409, "Conflict"),
        (429, "TooManyRequests"),
        (500, "InternalError"),
        (503, "ServiceUnavailable"),
    ],
)
async def test_failures_reach_kubernetes_asyncio(
    apiserver: EmbeddedApiServer, k8s: Any, status: int, reason: str
) -> None:
    api = client.ResourceV1Api(k8s)
    apiserver.faults.fail_next("POST", SLICES, status)
    with pytest.raises(ApiException) as failed:
        await api.create_resource_slice(slice_body())
    assert failed.value.status == status
    assert f'"reason": "{reason}"' in failed.value.body
    if status == 429:
        assert failed.value.headers["Retry-After"] == "1"
    assert apiserver.list_objects("resourceslices") == []  # the write did not happen
    await api.create_resource_slice(slice_body())  # only the next request failed
    assert [r.status for r in apiserver.requests.records("POST")] == [status, 201]


async def test_retry_after_and_counted_regex_rule(
    apiserver: EmbeddedApiServer, http: aiohttp.ClientSession
) -> None:
    rule = apiserver.faults.fail_next(
        "GET", re.compile(r"/resourceslices/s\d$"), 429, count=2, retry_after=7
    )
    apiserver.put_object(slice_body(name="s1"))
    statuses = []
    for _ in range(3):
        async with http.get(f"{SLICES}/s1") as response:
            statuses.append(response.status)
            body = await response.json()
            if response.status == 429:
                assert response.headers["Retry-After"] == "7"
                assert body["kind"] == "Status" and body["code"] == 429
    assert statuses == [429, 429, 200]
    assert rule.hits == 2
    async with http.get(SLICES) as response:  # the list path does not match the regex
        assert response.status == 200


async def test_dropped_connection(apiserver: EmbeddedApiServer, k8s: Any) -> None:
    api = client.ResourceV1Api(k8s)
    apiserver.faults.drop_next("POST", SLICES)
    with pytest.raises(aiohttp.ClientError):
        await api.create_resource_slice(slice_body())
    assert apiserver.list_objects("resourceslices") == []
    await api.create_resource_slice(slice_body())
    assert [r.status for r in apiserver.requests.records("POST")] == [0, 201]


async def test_dropped_idempotent_request_is_retried_once_by_aiohttp(
    apiserver: EmbeddedApiServer, k8s: Any
) -> None:
    # aiohttp silently retries an idempotent request once after a disconnect (RFC 9112 §9.3.1),
    # so a GET needs two drops in a row before the client sees the error.
    api = client.ResourceV1Api(k8s)
    apiserver.faults.drop_next("GET", SLICES)
    assert (await api.list_resource_slice()).items == []
    apiserver.faults.drop_next("GET", SLICES, count=2)
    with pytest.raises(aiohttp.ClientError):
        await api.list_resource_slice()
    assert [r.status for r in apiserver.requests.records("GET", SLICES)] == [0, 200, 0, 0]


async def test_latency(apiserver: EmbeddedApiServer, http: aiohttp.ClientSession) -> None:
    rule = apiserver.faults.add_latency("GET", "/version", 0.3)
    started = time.monotonic()
    async with http.get("/version") as response:
        assert response.status == 200
    assert time.monotonic() - started >= 0.3
    apiserver.faults.remove(rule)
    started = time.monotonic()
    async with http.get("/version") as response:
        assert response.status == 200
    assert time.monotonic() - started < 0.3


async def test_latency_after_handling_stores_the_write_and_answers_late(
    apiserver: EmbeddedApiServer, k8s: Any
) -> None:
    """A client that gives up before the late answer still finds its write stored."""
    api = client.ResourceV1Api(k8s)
    apiserver.faults.add_latency("POST", SLICES, 1.0, count=1, after=True)
    with pytest.raises(TimeoutError):
        await api.create_resource_slice(slice_body(), _request_timeout=0.2)
    assert len(apiserver.list_objects("resourceslices")) == 1  # stored before the wait
    await anyio.sleep(1.0)
    [record] = apiserver.requests.records("POST", SLICES)
    assert record.status == 201  # answered, too late for that client


async def test_rules_can_pick_watches_or_lists(apiserver: EmbeddedApiServer, k8s: Any) -> None:
    """A LIST and a WATCH share their path; ``watch=`` sends a fault to one of them."""
    api = client.ResourceV1Api(k8s)
    apiserver.faults.fail_next("GET", SLICES, 410, watch=True)
    apiserver.faults.fail_next("GET", SLICES, 503, watch=False)
    with pytest.raises(ApiException) as failed:
        await api.list_resource_slice()
    assert failed.value.status == 503
    response = await api.list_resource_slice(watch=True, _preload_content=False)
    assert response.status == 410
    response.release()
    assert (await api.list_resource_slice()).items == []
    statuses = [(r.watch, r.status) for r in apiserver.requests.records("GET", SLICES)]
    assert statuses == [(False, 503), (True, 410), (False, 200)]


async def test_rules_can_be_added_from_another_thread(
    apiserver: EmbeddedApiServer, http: aiohttp.ClientSession
) -> None:
    worker = threading.Thread(target=apiserver.faults.fail_next, args=("GET", "/api", 503))
    worker.start()
    worker.join()
    async with http.get("/api") as response:
        assert response.status == 503
        assert (await response.json())["reason"] == "ServiceUnavailable"


async def test_watch_ended_early_makes_kubernetes_asyncio_reconnect(
    apiserver: EmbeddedApiServer, k8s: Any
) -> None:
    api = client.ResourceV1Api(k8s)
    start = (await api.list_resource_slice()).metadata.resource_version
    await api.create_resource_slice(slice_body())
    seen: list[str] = []
    stream = watch.Watch()
    with anyio.fail_after(5):
        async with stream:
            # No timeout_seconds: the client watches "forever" and re-establishes ended streams.
            async for event in stream.stream(api.list_resource_slice,
                                             resource_version=start):  # fmt: skip
                seen.append(event["object"].metadata.name)
                if len(seen) == 1:
                    await apiserver.wait_for_watches(1, SLICES)
                    assert apiserver.end_watches(SLICES) == 1
                    await anyio.sleep(0.1)
                    await api.create_resource_slice(slice_body(name="after-end"))
                if len(seen) == 2:
                    stream.stop()
    assert seen[1] == "after-end"
    with anyio.fail_after(3):  # the server notices the client went away within a second
        await apiserver.wait_for_watches(0)
    watches = apiserver.requests.records("GET", SLICES)
    assert sum(1 for r in watches if r.watch) == 2  # the ended watch and the resumed one
