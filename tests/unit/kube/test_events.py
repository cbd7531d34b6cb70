"""Node Events are posted with the fields kubectl shows, and never raise into the caller."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from agent.kube.events import ApiEventPoster
from agent.sim.apiserver import EmbeddedApiServer
from tests.unit.kube.helpers import NODE

pytestmark = pytest.mark.anyio
EVENTS = "/api/v1/namespaces/default/events"


async def test_event_on_the_node(apiserver: EmbeddedApiServer, api_client: Any) -> None:
    poster = ApiEventPoster(api_client, NODE, node_uid="1234")
    await poster.post("Warning", "CheckpointCorrupted", "the checkpoint was damaged")
    (event,) = apiserver.list_objects("events", "default")
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": NODE,
        "uid": "1234",
    }
    assert (event["type"], event["reason"]) == ("Warning", "CheckpointCorrupted")
    assert event["message"] == "the checkpoint was damaged"
    assert event["source"]["component"] == "gpu-dra-agent"


async def test_failures_are_swallowed(
    apiserver: EmbeddedApiServer, api_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    apiserver.faults.fail_next("POST", EVENTS, 403)  # our request is wrong: not retried
    await ApiEventPoster(api_client, NODE).post("Normal", "NodeRebooted", "rebooted")
    apiserver.faults.fail_next("POST", EVENTS, 500, count=None)  # down for good: given up
    await ApiEventPoster(api_client, NODE, retry_initial=0.01).post("Normal", "NodeRebooted", "y")
    apiserver.faults.clear()
    assert apiserver.list_objects("events", "default") == []
    posts = apiserver.requests.records("POST", EVENTS)
    assert [r.status for r in posts] == [403, 500, 500, 500, 500]
    warned = [r.getMessage() for r in caplog.records if "could not post Event" in r.getMessage()]
    assert len(warned) == 2 and "after 4 attempts" in warned[1], warned


async def test_a_timeout_is_not_retried(apiserver: EmbeddedApiServer, api_client: Any) -> None:
    """The server may store a post whose answer came too late: a retry would duplicate it."""
    apiserver.faults.add_latency("POST", EVENTS, 1.0, count=1, after=True)
    await ApiEventPoster(api_client, NODE, timeout_s=0.2).post("Normal", "NodeRebooted", "x")
    await anyio.sleep(1.2)
    assert len(apiserver.requests.records("POST", EVENTS)) == 1
    assert len(apiserver.list_objects("events", "default")) == 1  # stored late, once


@pytest.mark.parametrize("fault", ["429", "500", "503", "drop"], ids=lambda f: f"{f}-then-ok")
async def test_a_transient_failure_is_retried_and_the_event_written_once(
    apiserver: EmbeddedApiServer, api_client: Any, fault: str
) -> None:
    if fault == "drop":
        apiserver.faults.drop_next("POST", EVENTS)
    else:
        apiserver.faults.fail_next(
            "POST", EVENTS, int(fault), retry_after=1 if fault == "429" else None
        )
    started = time.monotonic()
    await ApiEventPoster(api_client, NODE, retry_initial=0.01).post("Warning", "GpuUnhealthy", "m")
    elapsed = time.monotonic() - started
    [event] = apiserver.list_objects("events", "default")
    assert event["reason"] == "GpuUnhealthy"
    assert len(apiserver.requests.records("POST", EVENTS)) == 2
    if fault == "429":
        assert elapsed >= 0.9  # Retry-After: 1 honoured


async def test_a_retry_after_longer_than_an_event_is_worth_is_not_cut_short(
    apiserver: EmbeddedApiServer, api_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A server asking for more than MAX_EVENT_RETRY_AFTER_S gets no early retry: the Event
    is given up, and the log says why."""
    apiserver.faults.fail_next("POST", EVENTS, 429, count=1, retry_after=30)
    started = time.monotonic()
    await ApiEventPoster(api_client, NODE).post("Warning", "GpuUnhealthy", "m")
    assert time.monotonic() - started < 1.0
    assert len(apiserver.requests.records("POST", EVENTS)) == 1
    warned = [r.getMessage() for r in caplog.records if "could not post Event" in r.getMessage()]
    assert len(warned) == 1 and "not posted again after more than 5 s" in warned[0], warned
