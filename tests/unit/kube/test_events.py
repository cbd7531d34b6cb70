"""Node Events are posted with the fields kubectl shows, and never raise into the caller."""

from __future__ import annotations

from typing import Any

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
    apiserver.faults.fail_next("POST", EVENTS, 500)
    await ApiEventPoster(api_client, NODE).post("Normal", "NodeRebooted", "rebooted")
    apiserver.faults.add_latency("POST", EVENTS, 2.0, count=1)
    await ApiEventPoster(api_client, NODE, timeout_s=0.2).post("Normal", "NodeRebooted", "x")
    assert apiserver.list_objects("events", "default") == []
    assert sum("could not post Event NodeRebooted" in r.getMessage() for r in caplog.records) == 2
