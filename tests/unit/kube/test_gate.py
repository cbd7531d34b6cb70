"""The client's memory of ``Retry-After`` (agent/kube/gate.py), through a real ApiClient and the
embedded API server's request log; and the raw calls' status check (agent/kube/rawcall.py)."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from agent.imex.wiring import _node_address
from agent.kube.gate import RetryAfterGate
from agent.kube.library import CoreV1Api
from agent.kube.rawapi import RawSliceApi
from agent.kube.rawcall import ApiStatusError, send
from agent.sim.apiserver import EmbeddedApiServer

pytestmark = pytest.mark.anyio
NODE_PATH = "/api/v1/nodes/node-a"


def put_node(apiserver: EmbeddedApiServer, address: str = "127.0.9.1") -> None:
    apiserver.put_object(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "node-a"},
            "status": {"addresses": [{"type": "InternalIP", "address": address}]},
        }
    )


async def test_a_429_is_raised_with_its_retry_after_not_parsed_as_the_object(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    put_node(apiserver)
    apiserver.faults.fail_next("GET", NODE_PATH, 429, retry_after=2)
    with pytest.raises(ApiStatusError) as caught:
        await send(CoreV1Api(api_client).read_node, "node-a", request_timeout=5)
    assert caught.value.code == 429 and caught.value.retry_after == 2
    assert "TooManyRequests" in str(caught.value)


async def test_another_read_of_the_same_object_waits_out_the_retry_after(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    """Two parts read the Node: the second, though it never met the 429, is held until the
    Retry-After the first was given has passed."""
    put_node(apiserver)
    apiserver.faults.fail_next("GET", NODE_PATH, 429, retry_after=1)
    with pytest.raises(ApiStatusError):
        await RawSliceApi(api_client, request_timeout=5).read_node_uid("node-a")
    started = time.monotonic()
    node = await send(CoreV1Api(api_client).read_node, "node-a", request_timeout=5)
    assert node["metadata"]["name"] == "node-a"
    assert time.monotonic() - started >= 0.9
    gets = apiserver.requests.records("GET", NODE_PATH)
    assert [g.status for g in gets] == [429, 200]
    assert gets[1].at - gets[0].at >= 1.0
    assert apiserver.requests.early_retries() == []
    gate: RetryAfterGate = api_client.retry_gate
    assert gate.held == 1
    other = await send(CoreV1Api(api_client).list_node, request_timeout=5)  # another path
    assert other["items"]


async def test_the_same_request_in_flight_is_answered_first(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    """Two identical reads at once: the second is sent after the first's answer, so it
    learns the first's Retry-After (no two requests of one client in the server's
    Retry-After window)."""
    put_node(apiserver)
    apiserver.faults.add_latency("GET", NODE_PATH, 0.3, count=1)
    apiserver.faults.fail_next("GET", NODE_PATH, 429, count=1, retry_after=1)
    results: list[Any] = []

    async def read() -> None:
        try:
            results.append(await send(CoreV1Api(api_client).read_node, "node-a", request_timeout=5))
        except ApiStatusError as error:
            results.append(error.code)

    async with anyio.create_task_group() as group:
        group.start_soon(read)
        group.start_soon(read)
    assert sorted(map(str, results))[0] == "429"
    gets = apiserver.requests.records("GET", NODE_PATH)
    assert [g.status for g in gets] == [429, 200]
    assert gets[1].at >= gets[0].answered
    assert gets[1].at - gets[0].at >= 1.0


async def test_the_imex_address_read_waits_out_a_throttled_node_read(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    """The start-up read that once parsed a 429's Status as the Node and crashed the agent:
    it is retried after the Retry-After and finds the address."""
    put_node(apiserver, "127.0.9.7")
    apiserver.faults.fail_next("GET", NODE_PATH, 429, count=2, retry_after=1)
    assert await _node_address(api_client, "node-a", 5.0) == "127.0.9.7"
    assert [g.status for g in apiserver.requests.records("GET", NODE_PATH)] == [429, 429, 200]
    assert apiserver.requests.early_retries() == []


async def test_the_imex_address_read_gives_up_on_a_refusal(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    put_node(apiserver)
    apiserver.faults.fail_next("GET", NODE_PATH, 403)
    assert await _node_address(api_client, "node-a", 5.0) is None


async def test_a_request_cancelled_while_held_does_not_hold_the_next_one_forever(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    """A read given up while it waits out a Retry-After (its caller's timeout) leaves the
    path free: the next identical read is sent once the hold has passed."""
    put_node(apiserver)
    apiserver.faults.fail_next("GET", NODE_PATH, 429, retry_after=1)
    with pytest.raises(ApiStatusError):
        await send(CoreV1Api(api_client).read_node, "node-a", request_timeout=5)
    with pytest.raises(TimeoutError):  # held by the gate, given up before the hold ends
        await send(CoreV1Api(api_client).read_node, "node-a", request_timeout=0.2)
    with anyio.fail_after(3):
        node = await send(CoreV1Api(api_client).read_node, "node-a", request_timeout=5)
    assert node["metadata"]["name"] == "node-a"
    assert apiserver.requests.early_retries() == []
