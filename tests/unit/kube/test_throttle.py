"""``call_with_retries``: 429 with Retry-After honoured (with jitter on top), at most 3
retries, writes not retried after failures that may have been stored; against the embedded
API server through the DomainApi the agents and the controller use."""

from __future__ import annotations

import random
import time

import aiohttp
import pytest

from agent.imex.domains import DomainApi
from agent.kube.backoff import Backoff
from agent.kube.client import create_api_client
from agent.kube.rawapi import ApiStatusError
from agent.kube.throttle import MAX_RETRIES, call_with_retries, retry_delay, worth_retrying
from agent.sim.apiserver import EmbeddedApiServer

pytestmark = pytest.mark.anyio
DOMAINS = "/apis/resource.nvidia.com/v1beta1/namespaces/default/computedomains*"


def test_what_is_worth_retrying() -> None:
    throttled = ApiStatusError(429, "TooManyRequests", "", retry_after=1)
    assert worth_retrying(throttled)
    assert worth_retrying(ApiStatusError(503, "x", "", retry_after=2))
    assert not worth_retrying(ApiStatusError(503, "x", ""))
    assert not worth_retrying(ApiStatusError(409, "Conflict", ""))
    assert not worth_retrying(TimeoutError())
    assert not worth_retrying(ValueError())


def test_retry_after_is_a_lower_bound_with_jitter_on_top() -> None:
    rng = random.Random(1)
    delays = [
        retry_delay(ApiStatusError(429, "", "", retry_after=1), Backoff(), rng) for _ in range(50)
    ]
    assert min(delays) >= 1.0 and max(delays) <= 1.5
    assert len({round(d, 3) for d in delays}) > 40  # spread, not in lockstep


async def test_at_most_three_retries() -> None:
    sent = 0

    async def send() -> int:
        nonlocal sent
        sent += 1
        raise ApiStatusError(429, "TooManyRequests", "", retry_after=0)

    with pytest.raises(ApiStatusError):
        await call_with_retries(send, rng=random.Random(0))
    assert sent == MAX_RETRIES + 1 == 4


async def test_the_domain_api_waits_for_retry_after(
    apiserver: EmbeddedApiServer, tmp_path: object
) -> None:
    kubeconfig = apiserver.write_kubeconfig(tmp_path / "kubeconfig")  # type: ignore[operator]
    apiserver.put_object(
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomain",
            "metadata": {"name": "cd", "namespace": "default"},
            "spec": {},
        }
    )
    client = await create_api_client(kubeconfig)
    try:
        api = DomainApi(client)
        apiserver.faults.fail_next("GET", DOMAINS, 429, count=2, retry_after=1)
        started = time.monotonic()
        domain = await api.get("default", "cd")
        assert domain["metadata"]["name"] == "cd"
        assert time.monotonic() - started >= 2.0  # two waits of at least Retry-After
        assert api.retries == 2 and api.throttled == 2
        apiserver.faults.fail_next("GET", DOMAINS, 429, count=10, retry_after=0)
        with pytest.raises(ApiStatusError) as failed:
            await api.get("default", "cd")
        assert failed.value.code == 429
        gets = [r for r in apiserver.requests.records("GET") if "computedomains" in r.path]
        assert len(gets) == 3 + 4  # the first call: 2 throttled + 1; the second: 4 sends
        # a write whose connection dropped is not sent again (it may be stored)
        templates = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates"
        apiserver.faults.drop_next("POST", templates)
        with pytest.raises(aiohttp.ClientError):
            await api.create_template("default", {"metadata": {"name": "t"}, "spec": {}})
        assert len(apiserver.requests.records("POST", templates)) == 1
    finally:
        await client.close()
