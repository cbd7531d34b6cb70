"""The hot-path claim reader against the embedded API server: raw JSON, precise errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from agent.kube.claims import ApiClaimReader, ClaimNotFound, ClaimReadError
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.claims import AllocatedDevice, create_allocated_claim

pytestmark = pytest.mark.anyio
CLAIM_PATH = "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/train"


@pytest.fixture
async def reader(api_client: Any) -> AsyncIterator[ApiClaimReader]:
    claim_reader = ApiClaimReader(api_client, timeout_s=5.0)
    yield claim_reader
    await claim_reader.close()


async def create(apiserver: EmbeddedApiServer) -> dict[str, Any]:
    return await create_allocated_claim(
        apiserver.url, "train", [AllocatedDevice("gpu", "gpu-0", "node-a")], namespace="team-a"
    )


async def test_read_returns_the_stored_object_as_a_dict(
    apiserver: EmbeddedApiServer, reader: ApiClaimReader
) -> None:
    created = await create(apiserver)
    claim = await reader.read("team-a", "train")
    assert claim["metadata"]["uid"] == created["metadata"]["uid"]
    assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0"
    assert claim == created


async def test_missing_claim(apiserver: EmbeddedApiServer, reader: ApiClaimReader) -> None:
    with pytest.raises(ClaimNotFound) as caught:
        await reader.read("team-a", "train")
    assert caught.value.status == 404
    assert "team-a/train" in str(caught.value)


async def test_api_error_carries_status_and_message(
    apiserver: EmbeddedApiServer, reader: ApiClaimReader
) -> None:
    await create(apiserver)
    apiserver.faults.fail_next("GET", CLAIM_PATH, 503)
    with pytest.raises(ClaimReadError) as caught:
        await reader.read("team-a", "train")
    assert caught.value.status == 503
    assert "unable to handle the request" in str(caught.value)


async def test_timeout(apiserver: EmbeddedApiServer, api_client: Any) -> None:
    await create(apiserver)
    apiserver.faults.add_latency("GET", CLAIM_PATH, 2.0, count=1)
    impatient = ApiClaimReader(api_client, timeout_s=0.2)
    try:
        with pytest.raises(ClaimReadError) as caught:
            await impatient.read("team-a", "train")
    finally:
        await impatient.close()
    assert caught.value.status == 0
    assert "within 0.2 s" in str(caught.value)


async def test_dropped_connection(apiserver: EmbeddedApiServer, reader: ApiClaimReader) -> None:
    await create(apiserver)
    apiserver.faults.drop_next(
        "GET", CLAIM_PATH, count=2
    )  # aiohttp retries a reused connection once
    with pytest.raises(ClaimReadError) as caught:
        await reader.read("team-a", "train")
    assert caught.value.status == 0
