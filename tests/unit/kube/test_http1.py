"""The hot path's HTTP/1.1 GET client against scripted servers on real sockets: the pool
(connection reuse and its failures, expiry, concurrency), deadlines, cancellation and TLS.
How one connection reads what a server may answer: ``test_http1_wire.py``."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.kube import http1
from agent.kube.http1 import ConnectionClosedError, Http1Client, tls_context
from tests.unit.kube.http_servers import Server, answer, serve

__all__ = ["serve"]  # the fixture

pytestmark = pytest.mark.anyio
TLS = Path(__file__).parents[2] / "support" / "tls"


async def test_request_bytes_and_keep_alive_reuse(serve: Callable[..., Awaitable[Server]]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await server.request(reader)
            writer.write(answer(b'{"n": %d}' % len(server.requests)))

    server = await serve(handler)
    client = Http1Client(server.url + "/prefix/", user_agent="tester/1")
    try:
        first = await client.get("/apis/x", {"Authorization": "Bearer t"}, 5)
        second = await client.get("/apis/y", {}, 5)
    finally:
        await client.close()
    assert first == (200, b'{"n": 1}') and second == (200, b'{"n": 2}')
    assert server.connections == 1  # the second GET reused the first connection
    port = server.url.rsplit(":", 1)[1]
    assert (
        server.requests[0]
        == (
            f"GET /prefix/apis/x HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: tester/1\r\n"
            "Authorization: Bearer t\r\n\r\n"
        ).encode()
    )


async def test_a_reused_connection_closed_before_the_answer_is_retried_once(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.request(reader)
        writer.write(answer(b"first" if n == 0 else b"again"))
        await writer.drain()
        if n == 0:  # reads the next request, then hangs up without answering
            await server.request(reader)
            return
        await asyncio.sleep(5)

    server = await serve(handler)
    client = Http1Client(server.url)
    try:
        assert await client.get("/", {}, 5) == (200, b"first")
        assert await client.get("/", {}, 5) == (200, b"again")
    finally:
        await client.close()
    assert server.connections == 2 and len(server.requests) == 3


async def test_a_fresh_connection_or_a_half_answer_is_not_retried(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.request(reader)
        if n == 0:
            return  # hangs up on the first request of a new connection
        writer.write(answer(b"whole"))
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")  # then hangs up

    server = await serve(handler)
    client = Http1Client(server.url)
    try:
        with pytest.raises(ConnectionClosedError, match="before answering") as fresh:
            await client.get("/", {}, 5)
        assert fresh.value.before_response
        assert await client.get("/", {}, 5) == (200, b"whole")
        with pytest.raises(ConnectionClosedError, match="in the middle of its answer"):
            await client.get("/", {}, 5)
    finally:
        await client.close()
    assert server.connections == 2 and len(server.requests) == 3


async def test_deadline_covers_a_silent_server_and_the_connection_is_dropped(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.request(reader)
        if n == 0:
            await asyncio.sleep(10)  # never answers
        writer.write(answer(b"late"))  # would answer the next request on this connection
        await asyncio.sleep(10)

    server = await serve(handler)
    client = Http1Client(server.url)
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        with pytest.raises(TimeoutError):
            await client.get("/", {}, 0.2)
        assert 0.15 < loop.time() - started < 2
        assert await client.get("/", {}, 5) == (200, b"late")
    finally:
        await client.close()
    assert server.connections == 2


async def test_a_cancelled_request_leaves_no_connection_behind(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.request(reader)
        if n == 0:
            await asyncio.sleep(0.3)  # answers after the caller gave up
        writer.write(answer(b"answer %d" % n))
        await asyncio.sleep(10)

    server = await serve(handler)
    client = Http1Client(server.url)
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):  # the caller's own deadline cancels the task
                await client.get("/", {}, 5)
        await asyncio.sleep(0.4)
        assert await client.get("/", {}, 5) == (200, b"answer 1")  # not the late answer 0
    finally:
        await client.close()


async def test_many_concurrent_gets_then_reuse(serve: Callable[..., Awaitable[Server]]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            head = await server.request(reader)
            path = head.split(b" ")[1]
            await asyncio.sleep(0.01)
            writer.write(answer(path))

    server = await serve(handler)
    client = Http1Client(server.url)
    try:
        paths = [f"/claim-{i}" for i in range(40)]
        answers = await asyncio.gather(*(client.get(p, {}, 5) for p in paths))
        assert answers == [(200, p.encode()) for p in paths]
        opened = server.connections
        assert opened == 40
        await asyncio.gather(*(client.get(p, {}, 5) for p in paths))
        assert server.connections == opened  # every second-round GET found an idle one
    finally:
        await client.close()


async def test_idle_connections_expire(
    serve: Callable[..., Awaitable[Server]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle connection is not reused after ``KEEPALIVE_S``, and is closed by then even
    when no request comes (the server sees its end)."""
    ended: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        try:
            while True:
                await server.request(reader)
                writer.write(answer(b"ok"))
        finally:
            ended.append(n)

    server = await serve(handler)
    monkeypatch.setattr(http1, "KEEPALIVE_S", 0.6)
    client = Http1Client(server.url)
    try:
        await asyncio.gather(client.get("/", {}, 5), client.get("/", {}, 5))
        assert server.connections == 2 and ended == []
        await asyncio.sleep(0.4)
        await client.get("/", {}, 5)  # reuses one of them, and makes it young again
        assert server.connections == 2
        await asyncio.sleep(0.4)  # the other expired at 0.6 s: closed without any request
        assert ended == [0] or ended == [1]
        await asyncio.sleep(0.5)  # then the reused one, at 1.0 s
        assert sorted(ended) == [0, 1]
        await client.get("/", {}, 5)
        assert server.connections == 3
    finally:
        await client.close()


async def test_header_injection_and_bad_urls_are_refused() -> None:
    client = Http1Client("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="does not allow"):
        await client.get("/", {"Authorization": "Bearer x\r\nX-Evil: 1"}, 1)
    with pytest.raises(ValueError, match="not an http"):
        Http1Client("ftp://example.com")
    with pytest.raises(ValueError, match="TLS context"):
        Http1Client("https://example.com")


async def test_a_connection_made_while_the_client_closes_is_closed_too(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    ended = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        try:
            await server.request(reader)  # a request sent on it would wait here in vain
            await asyncio.sleep(10)
        finally:
            ended.set()

    server = await serve(handler)
    client = Http1Client(server.url)
    getting = asyncio.ensure_future(client.get("/", {}, 5))
    await asyncio.sleep(0)  # the GET is connecting
    await client.close()
    with pytest.raises(ConnectionClosedError, match="closed"):
        await getting
    async with asyncio.timeout(2):
        await ended.wait()  # the server saw the connection end


async def test_closed_client_and_unreachable_server() -> None:
    client = Http1Client("http://127.0.0.1:1")  # nothing listens on port 1
    with pytest.raises(OSError):
        await client.get("/", {}, 2)
    await client.close()
    with pytest.raises(ConnectionClosedError, match="closed"):
        await client.get("/", {}, 2)


def configuration(ca: str, *, verify: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        ssl_ca_cert=str(TLS / ca),
        cert_file=None,
        key_file=None,
        verify_ssl=verify,
        disable_strict_ssl_verification=False,
    )


async def test_tls_verifies_the_server_against_the_configured_ca(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(TLS / "server.pem", TLS / "server-key.pem")

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await server.request(reader)
            writer.write(answer(b"secret"))

    server = await serve(handler, server_tls)
    trusted = Http1Client(server.url, tls=tls_context(configuration("ca.pem")))
    by_name = Http1Client(
        server.url, tls=tls_context(configuration("ca.pem")), server_hostname="localhost"
    )
    strangers = Http1Client(server.url, tls=tls_context(configuration("other-ca.pem")))
    wrong_name = Http1Client(
        server.url, tls=tls_context(configuration("ca.pem")), server_hostname="api.example.com"
    )
    unverified = Http1Client(
        server.url, tls=tls_context(configuration("other-ca.pem", verify=False))
    )
    try:
        assert await trusted.get("/", {}, 5) == (200, b"secret")
        assert await trusted.get("/", {}, 5) == (200, b"secret")
        assert await by_name.get("/", {}, 5) == (200, b"secret")
        with pytest.raises(ssl.SSLCertVerificationError):
            await strangers.get("/", {}, 5)
        with pytest.raises(ssl.SSLCertVerificationError):
            await wrong_name.get("/", {}, 5)
        assert await unverified.get("/", {}, 5) == (200, b"secret")  # verify_ssl: false
    finally:
        for client in (trusted, by_name, strangers, wrong_name, unverified):
            await client.close()
