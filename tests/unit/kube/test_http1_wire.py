"""How one connection of the HTTP/1.1 client reads what a server may answer, on real sockets:
the framings (length, chunks, until the close), interim and bodiless answers, answers that
are not HTTP or over the limits, and bytes nobody asked for."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from agent.kube import http1_wire
from agent.kube.http1 import Http1Client, HttpProtocolError
from tests.unit.kube.http_servers import Server, answer, serve

__all__ = ["serve"]  # the fixture
pytestmark = pytest.mark.anyio


async def test_chunked_body_arriving_a_byte_at_a_time(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    wire = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n1\r\n \r\n6\r\nworld!\r\n0\r\nX-Trailer: t\r\n\r\n"
    )

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await server.request(reader)
            for byte in wire:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0)

    server = await serve(handler)
    client = Http1Client(server.url)
    try:
        assert await client.get("/", {}, 5) == (200, b"hello world!")
        assert await client.get("/", {}, 5) == (200, b"hello world!")
    finally:
        await client.close()
    assert server.connections == 1


async def test_body_ended_by_close_and_connection_close_are_not_reused(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.request(reader)
        if n == 0:  # HTTP/1.0 style: no length, the body ends with the connection
            writer.write(b"HTTP/1.0 200 OK\r\n\r\nuntil the end")
        else:
            writer.write(answer(b"closing", "Connection: close"))
            await asyncio.sleep(10)  # keeps it open: a request sent on it would wait in vain

    server = await serve(handler)
    client = Http1Client(server.url)
    try:
        assert await client.get("/", {}, 2) == (200, b"until the end")
        assert await client.get("/", {}, 2) == (200, b"closing")
        assert await client.get("/", {}, 2) == (200, b"closing")
    finally:
        await client.close()
    assert server.connections == 3


async def test_interim_and_bodiless_answers(serve: Callable[..., Awaitable[Server]]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" * 5000)  # in one buffer: no recursion
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n")
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await server.request(reader)
        writer.write(answer(b"", status="404 Not Found"))

    server = await serve(handler)
    client = Http1Client(server.url)
    try:
        assert await client.get("/", {}, 5) == (204, b"")
        assert await client.get("/", {}, 5) == (404, b"")
    finally:
        await client.close()


@pytest.mark.parametrize(
    "wire, message",
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 2\xb20 OK\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "bad Content"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "transfer coding"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY", "end with CRLF"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n", "over"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70_000, "head over"),
    ],
)
async def test_unreadable_answers_fail_the_request_and_drop_the_connection(
    serve: Callable[..., Awaitable[Server]], wire: bytes, message: str
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await server.request(reader)
            writer.write(wire if n == 0 else answer(b"ok"))

    server = await serve(handler)
    client = Http1Client(server.url)
    try:
        with pytest.raises(HttpProtocolError, match=message):
            await client.get("/", {}, 5)
        assert await client.get("/", {}, 5) == (200, b"ok")
    finally:
        await client.close()
    assert server.connections == 2


async def test_a_chunked_body_over_the_limit(
    serve: Callable[..., Awaitable[Server]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http1_wire, "MAX_BODY", 8)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n12345\r\n")
        writer.write(b"5\r\n67890\r\n0\r\n\r\n")

    server = await serve(handler)
    client = Http1Client(server.url)
    try:
        with pytest.raises(HttpProtocolError, match="over 8 bytes"):
            await client.get("/", {}, 5)
    finally:
        await client.close()


async def test_an_unasked_answer_drops_the_connection(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    """Bytes after an answer (with it, or later on the idle connection) mean the server and
    the client disagree about the framing: the connection is never used again."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.request(reader)
        if n == 0:  # an answer with a second one glued to it
            writer.write(answer(b"ok") + answer(b"stale"))
        elif n == 1:
            writer.write(answer(b"ok"))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(answer(b"nobody asked"))  # while the connection is idle
        else:
            writer.write(answer(b"fresh"))
        await asyncio.sleep(10)  # reads nothing more: a reused connection would wait in vain

    server = await serve(handler)
    client = Http1Client(server.url)
    try:
        assert await client.get("/", {}, 2) == (200, b"ok")
        assert await client.get("/", {}, 2) == (200, b"ok")
        await asyncio.sleep(0.2)
        assert await client.get("/", {}, 2) == (200, b"fresh")
    finally:
        await client.close()
    assert server.connections == 3
