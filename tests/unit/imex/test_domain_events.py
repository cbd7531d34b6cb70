"""Events about a ComputeDomain: a throttled or failed post is posted again, a late one is
not; a template whose create, or a status whose write, was answered late still gets its
Event (TemplateCreated, Ready), once."""

from __future__ import annotations

from typing import Any

import pytest

from agent.imex.controller import Controller
from agent.imex.domains import EVENT_ATTEMPTS, DomainApi, domain_ref
from agent.sim.apiserver import EmbeddedApiServer
from tests.unit.imex.conftest import compute_domain

pytestmark = pytest.mark.anyio
EVENTS = "/api/v1/namespaces/default/events"


def stored(server: EmbeddedApiServer) -> list[dict[str, Any]]:
    return [e for e in server.list_objects("events", "default") if e["reason"] == "Ready"]


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_a_transient_failure_is_posted_again(
    apiserver: EmbeddedApiServer, api_client: Any, status: int
) -> None:
    ref = domain_ref(apiserver.put_object(compute_domain()))
    rule = apiserver.faults.fail_next("POST", EVENTS, status, count=EVENT_ATTEMPTS - 1)
    await DomainApi(api_client).event(ref, "Normal", "Ready", "the domain is Ready")
    assert rule.remaining == 0
    assert len(stored(apiserver)) == 1


async def test_a_dropped_connection_is_posted_again(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    ref = domain_ref(apiserver.put_object(compute_domain()))
    rule = apiserver.faults.drop_next("POST", EVENTS, count=1)
    await DomainApi(api_client).event(ref, "Normal", "Ready", "the domain is Ready")
    assert rule.remaining == 0
    assert len(stored(apiserver)) == 1


async def test_it_gives_up_after_the_last_attempt_and_on_a_late_answer(
    apiserver: EmbeddedApiServer, api_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ref = domain_ref(apiserver.put_object(compute_domain()))
    failing = apiserver.faults.fail_next("POST", EVENTS, 500, count=EVENT_ATTEMPTS + 1)
    await DomainApi(api_client).event(ref, "Normal", "Ready", "the domain is Ready")
    assert failing.remaining == 1 and not stored(apiserver)  # never raises
    apiserver.faults.clear()
    late = apiserver.faults.add_latency("POST", EVENTS, 0.5, count=1, after=True)
    await DomainApi(api_client, request_timeout=0.2).event(ref, "Normal", "Ready", "the domain")
    assert late.remaining == 0
    assert len(stored(apiserver)) == 1  # stored once, not posted again after the timeout
    warned = [r.getMessage() for r in caplog.records if "could not post Event" in r.getMessage()]
    assert len(warned) == 2, warned


async def first_pass_answered_late(
    apiserver: EmbeddedApiServer, api_client: Any, method: str, path: str
) -> Controller:
    """A controller whose first pass times out on ``method path``, which the server stores
    and answers 0.5 s late (the client gives up after 0.2 s); returned for the next passes."""
    late = apiserver.faults.add_latency(method, path, 0.5, count=1, after=True)
    controller = Controller(
        DomainApi(api_client, request_timeout=0.2), identity="c", lease_namespace="default"
    )
    with pytest.raises(TimeoutError):
        await controller.reconcile_all()
    assert late.remaining == 0
    return controller


async def test_a_template_stored_but_answered_late_gets_its_event_once(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    """The controller's create of a domain's template times out after the server stored it:
    the next pass finds the template and posts TemplateCreated then, once."""
    domain = apiserver.put_object(compute_domain())
    templates = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates"
    controller = await first_pass_answered_late(apiserver, api_client, "POST", templates)
    assert apiserver.get_object("resourceclaimtemplates", "cd-channel", "default") is not None
    created = apiserver.list_objects("events", "default")
    assert not [e for e in created if e["reason"] == "TemplateCreated"]
    await controller.reconcile_all()
    await controller.reconcile_all()
    made = apiserver.list_objects("events", "default")
    assert [e["involvedObject"]["uid"] for e in made if e["reason"] == "TemplateCreated"] == [
        domain["metadata"]["uid"]
    ]


async def test_a_status_stored_but_answered_late_gets_its_event_once(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    """The controller's write of ``status.status: Ready`` times out after the server stored
    it: the next pass finds the domain Ready and posts the Ready Event then, once; later
    passes post nothing more."""
    domain = compute_domain(num_nodes=1)
    domain["status"] = {
        "status": "NotReady",
        "nodes": [
            {"name": "tray-a", "ipAddress": "10.0.0.1", "cliqueID": "c", "index": 0,
             "status": "Ready"}
        ],
    }  # fmt: skip
    domain = apiserver.put_object(domain)
    status = "/apis/resource.nvidia.com/v1beta1/namespaces/default/computedomains/cd/status"
    controller = await first_pass_answered_late(apiserver, api_client, "PUT", status)
    stored_domain = apiserver.get_object("computedomains", "cd", "default") or {}
    assert stored_domain["status"]["status"] == "Ready"  # the late write was stored
    assert not stored(apiserver)
    for _ in range(3):
        await controller.reconcile_all()
    assert [e["involvedObject"]["uid"] for e in stored(apiserver)] == [domain["metadata"]["uid"]]


async def test_a_throttled_post_waits_its_retry_after(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    """The domain's Events once came back 0.13 s after a 429 that said Retry-After: 1."""
    ref = domain_ref(apiserver.put_object(compute_domain()))
    apiserver.faults.fail_next("POST", EVENTS, 429, count=1, retry_after=1)
    await DomainApi(api_client).event(ref, "Normal", "Ready", "the domain is Ready")
    posts = apiserver.requests.records("POST", EVENTS)
    assert [p.status for p in posts] == [429, 201]
    assert posts[1].at - posts[0].at >= 1.0
    assert apiserver.requests.early_retries() == []
