"""The hot-path claim reader against the embedded API server: raw JSON, precise errors; and
against scripted servers: TLS as the kubeconfig says, a proxy when one is set."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.deadline import enter_call, leave_call
from agent.kube.claims import ANSWER_MARGIN_S, ApiClaimReader, ClaimNotFound, ClaimReadError
from agent.kube.client import create_api_client
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
    """An answer that says the request is wrong (403: RBAC) is not sent again."""
    await create(apiserver)
    apiserver.faults.fail_next("GET", CLAIM_PATH, 403, message="not yours to read")
    with pytest.raises(ClaimReadError) as caught:
        await reader.read("team-a", "train")
    assert caught.value.status == 403
    assert "not yours to read" in str(caught.value)
    assert len(apiserver.requests.records("GET", CLAIM_PATH)) == 1
    assert reader.retries == 0


async def test_429_then_200_is_read_after_retry_after(
    apiserver: EmbeddedApiServer, reader: ApiClaimReader
) -> None:
    created = await create(apiserver)
    apiserver.faults.fail_next("GET", CLAIM_PATH, 429, count=2, retry_after=1)
    assert await reader.read("team-a", "train") == created
    gets = apiserver.requests.records("GET", CLAIM_PATH)
    assert [g.status for g in gets] == [429, 429, 200]
    assert all(later.at - earlier.at >= 1.0 for earlier, later in itertools.pairwise(gets))
    assert apiserver.requests.early_retries() == []
    assert reader.retries == 2


@pytest.mark.parametrize("status", [500, 502, 503, 504])
async def test_a_5xx_is_sent_again(
    apiserver: EmbeddedApiServer, reader: ApiClaimReader, status: int
) -> None:
    created = await create(apiserver)
    apiserver.faults.fail_next("GET", CLAIM_PATH, status)
    assert await reader.read("team-a", "train") == created
    assert reader.retries == 1


async def test_a_lasting_failure_fails_within_the_readers_timeout(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    await create(apiserver)
    apiserver.faults.fail_next("GET", CLAIM_PATH, 503, count=None)
    impatient = ApiClaimReader(api_client, timeout_s=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(ClaimReadError) as caught:
            await impatient.read("team-a", "train")
    finally:
        await impatient.close()
    assert time.monotonic() - started < 1.5
    assert caught.value.status == 503
    assert "unable to handle the request" in str(caught.value)
    sent = len(apiserver.requests.records("GET", CLAIM_PATH))
    assert sent > 1 and f"(sent {sent} times)" in str(caught.value)


async def test_retries_fit_the_kubelet_calls_deadline(
    apiserver: EmbeddedApiServer, reader: ApiClaimReader
) -> None:
    """Inside a kubelet call, a retry waits only while the answer can still be sent in time:
    with 2.5 s left (2 s of them the answer's margin) a Retry-After of 1 s is not waited out;
    with 6 s left it is."""
    created = await create(apiserver)
    apiserver.faults.fail_next("GET", CLAIM_PATH, 429, count=None, retry_after=1)
    token = enter_call(ANSWER_MARGIN_S + 0.5)
    try:
        with pytest.raises(ClaimReadError) as caught:
            await reader.read("team-a", "train")
    finally:
        leave_call(token)
    assert caught.value.status == 429 and caught.value.retry_after == 1
    assert len(apiserver.requests.records("GET", CLAIM_PATH)) == 1
    apiserver.faults.clear()
    apiserver.faults.fail_next("GET", CLAIM_PATH, 429, count=1, retry_after=1)
    token = enter_call(ANSWER_MARGIN_S + 4)
    try:
        assert await reader.read("team-a", "train") == created
    finally:
        leave_call(token)


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


async def test_dropped_connections_are_sent_again(
    apiserver: EmbeddedApiServer, reader: ApiClaimReader
) -> None:
    created = await create(apiserver)
    apiserver.faults.drop_next("GET", CLAIM_PATH, count=3)
    assert await reader.read("team-a", "train") == created
    assert [g.status for g in apiserver.requests.records("GET", CLAIM_PATH)] == [0, 0, 0, 200]


async def test_the_get_says_who_sends_it(apiserver: EmbeddedApiServer, api_client: Any) -> None:
    await create(apiserver)
    api_client.user_agent = "gpu-dra-agent/test (linux/amd64) node-a"
    reader = ApiClaimReader(api_client, timeout_s=5.0)
    try:
        await reader.read("team-a", "train")
    finally:
        await reader.close()
    [get] = apiserver.requests.records("GET", CLAIM_PATH)
    assert get.user_agent == "gpu-dra-agent/test (linux/amd64) node-a"


# -- the GET's transport: TLS as the kubeconfig says, a proxy when one is set ---------------

TLS = Path(__file__).parents[2] / "support" / "tls"
CLAIM = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c"}}


class OneAnswerServer:
    """Answers every request with ``answer``; keeps each request's head."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.heads: list[bytes] = []

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                self.heads.append(await reader.readuntil(b"\r\n\r\n"))
                writer.write(self.answer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def json_answer(document: object) -> bytes:
    body = json.dumps(document).encode()
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def client_for(tmp_path: Path, server: str, ca: str | None = None) -> Any:
    cluster: dict[str, str] = {"server": server}
    if ca is not None:
        cluster["certificate-authority"] = str(TLS / ca)
    kubeconfig = tmp_path / f"kubeconfig-{ca}"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": {"token": "the-token"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return await create_api_client(kubeconfig)


@contextlib.asynccontextmanager
async def listening(
    handler: OneAnswerServer, tls: ssl.SSLContext | None = None
) -> AsyncIterator[int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=tls)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_tls_with_the_kubeconfig_ca_and_token(tmp_path: Path) -> None:
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(TLS / "server.pem", TLS / "server-key.pem")
    handler = OneAnswerServer(json_answer(CLAIM))
    async with listening(handler, server_tls) as port:
        for ca, works in (("ca.pem", True), ("other-ca.pem", False)):
            client = await client_for(tmp_path, f"https://127.0.0.1:{port}", ca)
            reader = ApiClaimReader(client, timeout_s=5)
            try:
                if works:
                    assert await reader.read("ns", "c") == CLAIM
                else:
                    with pytest.raises(ClaimReadError, match=r"unreachable.*CERTIFICATE_VERIFY"):
                        await reader.read("ns", "c")
            finally:
                await reader.close()
                await client.close()
    assert len(handler.heads) == 1  # the untrusted server never got the request
    assert handler.heads[0].startswith(b"GET /apis/resource.k8s.io/v1/namespaces/ns/")
    assert b"\r\nauthorization: bearer the-token\r\n" in handler.heads[0].lower()


async def test_a_configured_proxy_carries_the_get(tmp_path: Path) -> None:
    proxy = OneAnswerServer(json_answer(CLAIM))
    async with listening(proxy) as port:
        client = await client_for(tmp_path, "http://api.invalid:6443")
        client.configuration.proxy = f"http://127.0.0.1:{port}"
        reader = ApiClaimReader(client, timeout_s=5)
        try:
            assert await reader.read("ns", "c") == CLAIM
        finally:
            await reader.close()
            await client.close()
    request_line = proxy.heads[0].split(b"\r\n")[0]
    assert request_line == (
        b"GET http://api.invalid:6443/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c "
        b"HTTP/1.1"
    )


async def test_an_answer_that_is_not_http(tmp_path: Path) -> None:
    async with listening(OneAnswerServer(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")) as port:
        client = await client_for(tmp_path, f"http://127.0.0.1:{port}")
        reader = ApiClaimReader(client, timeout_s=5)
        try:
            with pytest.raises(
                ClaimReadError, match=r"not readable HTTP.*[Bb]ad status line"
            ) as caught:
                await reader.read("ns", "c")
        finally:
            await reader.close()
            await client.close()
    assert caught.value.status == 0
