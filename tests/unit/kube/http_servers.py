"""Scripted HTTP servers on real sockets for the HTTP/1.1 client's tests."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Server:
    """A TCP server calling ``handler(reader, writer, n)`` for its n-th connection (0-based);
    it records every request head it read through :func:`request`."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self.connections
        self.connections += 1
        try:
            await self.handler(reader, writer, index)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        self.requests.append(head)
        return head


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[Server]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler, tls: ssl.SSLContext | None = None) -> Server:
        server = Server(handler)
        listening = await asyncio.start_server(server._serve, "127.0.0.1", 0, ssl=tls)
        servers.append(listening)
        port = listening.sockets[0].getsockname()[1]
        server.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        return server

    yield start
    for listening in servers:
        listening.close()


def answer(body: bytes, *extra: str, status: str = "200 OK") -> bytes:
    headers = "".join(f"{line}\r\n" for line in extra)
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode() + body
