"""The embedded API server's max-in-flight limit (429 with Retry-After, as kube-apiserver's
priority and fairness answers), its request counts, and its restart."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.apiserver.limits import resource_of, verb_of
from tests.unit.sim.conftest import slice_body

pytestmark = pytest.mark.anyio
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
PLURALS = frozenset({"resourceslices", "computedomains", "computedomaincliques", "nodes"})


def test_verbs_and_resources_are_named_as_kubernetes_names_them() -> None:
    assert resource_of(SLICES, PLURALS) == ("resourceslices", False)
    path = "/apis/resource.nvidia.com/v1beta1/namespaces/ns/computedomains/cd/status"
    assert resource_of(path, PLURALS) == ("computedomains/status", True)
    assert resource_of("/api/v1/nodes/n1", PLURALS) == ("nodes", True)
    assert resource_of("/version", PLURALS) == ("other", False)
    assert verb_of("GET", False, True) == "get"
    assert verb_of("GET", False, False) == "list"
    assert verb_of("GET", True, False) == "watch"
    assert verb_of("PUT", False, True) == "update"
    assert verb_of("DELETE", False, False) == "deletecollection"


async def test_beyond_the_limit_requests_get_429_with_retry_after() -> None:
    server = EmbeddedApiServer(max_in_flight=2)
    await server.start()
    try:
        # every request waits inside the server, so the third and later find no seat
        server.faults.add_latency("GET", SLICES, 0.3, watch=False)
        async with aiohttp.ClientSession(base_url=server.url) as http:

            async def one() -> tuple[int, str | None]:
                async with http.get(SLICES) as response:
                    body = await response.json()
                    if response.status == 429:
                        assert body["reason"] == "TooManyRequests"
                    return response.status, response.headers.get("Retry-After")

            answers = await asyncio.gather(*(one() for _ in range(6)))
            # a watch holds no seat: it is served while the seats are taken
            server.faults.clear()
            async with http.get(SLICES, params={"watch": "1", "timeoutSeconds": "1"}) as watch:
                assert watch.status == 200
        codes = sorted(code for code, _ in answers)
        assert codes.count(200) == 2 and codes.count(429) == 4, answers
        assert {after for code, after in answers if code == 429} == {"1"}
        assert server.in_flight.rejected == 4 and server.in_flight.peak == 2
        rows = {(r["verb"], r["resource"], r["code"]): r["count"] for r in server.counts.snapshot()}
        assert rows[("list", "resourceslices", 429)] == 4
        assert rows[("list", "resourceslices", 200)] == 2
    finally:
        await server.stop()


async def test_no_limit_by_default(apiserver: EmbeddedApiServer) -> None:
    apiserver.faults.add_latency("GET", SLICES, 0.2)
    async with aiohttp.ClientSession(base_url=apiserver.url) as http:

        async def one() -> int:
            async with http.get(SLICES) as response:
                return response.status

        assert set(await asyncio.gather(*(one() for _ in range(20)))) == {200}


async def test_counts_over_http_and_a_restart_keeps_the_objects(
    apiserver: EmbeddedApiServer,
) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(apiserver.url + SLICES, json=slice_body(name="s1")) as created:
            assert created.status == 201
        async with http.get(apiserver.url + "/debug/embedded/requests") as answer:
            counts = await answer.json()
        assert {"verb": "create", "resource": "resourceslices", "code": 201, "count": 1} in counts[
            "counts"
        ]
        assert all(r["resource"] != "other" or r["verb"] != "get" for r in counts["counts"])
        async with http.post(
            apiserver.url + "/debug/embedded/restart", params={"downSeconds": "0.3"}
        ) as answer:
            assert answer.status == 200
    await asyncio.sleep(0.1)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(apiserver.url + SLICES):
                pass
        await asyncio.sleep(0.4)
        async with http.get(apiserver.url + SLICES) as listed:
            names = [i["metadata"]["name"] for i in (await listed.json())["items"]]
    assert names == ["s1"]


async def test_an_observer_reads_objects_without_being_counted(
    apiserver: EmbeddedApiServer,
) -> None:
    async with aiohttp.ClientSession(base_url=apiserver.url) as http:
        async with http.post(SLICES, json=slice_body(name="s1", team="a")) as created:
            assert created.status == 201
        before = apiserver.counts.snapshot()
        params = {"kind": "resourceslices", "labelSelector": "team=a"}
        async with http.get("/debug/embedded/objects", params=params) as answer:
            assert [i["metadata"]["name"] for i in (await answer.json())["items"]] == ["s1"]
        async with http.get("/debug/embedded/objects", params={"kind": "nope"}) as answer:
            assert answer.status == 400
        assert apiserver.counts.snapshot() == before
