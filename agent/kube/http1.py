"""A small HTTP/1.1 GET client for the one request on the prepare hot path.

Every claim of a prepare request costs one GET of its ResourceClaim, and a request of many
claims makes them all on the event loop. Through aiohttp one such GET took about 80 us of the
loop's CPU on the development VM (request and response objects, header multidicts, a timer
context, the connector's bookkeeping): a batch of 32 claims spent 2.5 ms of its 7 ms there.
This client makes the same GET in about 30 us, because it does only what that GET needs:

- one request line and a few headers written as one ``bytes``; the response parsed from a
  ``bytearray`` by an ``asyncio.Protocol`` (status line, the headers that frame the body,
  ``Content-Length``, ``chunked`` or a body that ends with the connection);
- keep-alive connections kept in a LIFO pool, idle ones closed after ``KEEPALIVE_S`` (as
  aiohttp does: a load balancer may forget an idle connection without closing it, and a
  burst's connections should not stay open at the server once the traffic is gone); a
  reused connection that the server closed before answering is retried once on a new one
  (the request is an idempotent GET, as every HTTP client does it);
- one deadline per request, a timer on the loop that fails the request and aborts its
  connection, no task cancellation.

TLS uses an ``ssl.SSLContext`` the caller builds (``tls_context``: the kubeconfig's CA,
client certificate and verification settings, as kubernetes-asyncio builds its own).
Proxies are not spoken here: a caller with a proxy keeps its aiohttp session.

This module is the pool; one connection, its request and the parsing of its answer (with the
limits that make a broken or hostile answer fail its request and nothing else) are
:mod:`agent.kube.http1_wire`.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from agent.kube.http1_wire import Connection
from agent.kube.http1_wire import ConnectionClosedError as ConnectionClosedError
from agent.kube.http1_wire import HttpProtocolError as HttpProtocolError

#: Idle connections older than this are closed, not reused (aiohttp's default too).
KEEPALIVE_S = 15.0
#: Idle connections kept at most; more are closed when they come back.
MAX_IDLE = 64


def tls_context(configuration: Any) -> ssl.SSLContext:
    """The TLS context a kubernetes-asyncio ``Configuration`` asks for (its CA, client
    certificate, ``verify_ssl``, ``disable_strict_ssl_verification``)."""
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, keyfile=configuration.key_file)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if getattr(configuration, "disable_strict_ssl_verification", False):
        context.verify_flags &= ~ssl.VERIFY_X509_STRICT
    return context


class Http1Client:
    """GETs to one server (``url``: scheme, host, port and an optional path prefix)."""

    def __init__(
        self,
        url: str,
        *,
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        user_agent: str = "gpu-dra-agent",
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self._https = parts.scheme == "https"
        if self._https and tls is None:
            raise ValueError(f"{url} needs a TLS context")
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._tls = tls if self._https else None
        self._server_hostname = (server_hostname or None) if self._https else None
        self._prefix = parts.path.rstrip("/")
        host = parts.netloc.rpartition("@")[2]  # never the user information
        self._head = f"Host: {host}\r\nUser-Agent: {user_agent}\r\n"
        self._idle: collections.deque[Connection] = collections.deque()
        self._open: set[Connection] = set()
        self._pruning: asyncio.TimerHandle | None = None
        self._closed = False

    async def get(
        self, path: str, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[int, bytes]:
        """GET ``path``: the status and the whole body. Raises ``TimeoutError`` when no whole
        answer came within ``timeout_s`` (connecting included), ``OSError`` (``ssl.SSLError``
        and ``ConnectionError`` among them) or :class:`HttpProtocolError`."""
        if self._closed:
            raise ConnectionClosedError("the client is closed", before_response=True)
        request = self._request(path, headers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        connection = self._take()
        if connection is not None:
            try:
                return await self._exchange(connection, request, deadline)
            except ConnectionClosedError as error:
                if not error.before_response or self._closed:
                    raise
                # The server closed the idle connection as the request went out: once more,
                # on a new connection (an idempotent GET).
        connection = await self._connect(loop, deadline)
        return await self._exchange(connection, request, deadline)

    async def close(self) -> None:
        """Close every connection (a request in flight fails)."""
        self._closed = True
        if self._pruning is not None:
            self._pruning.cancel()
            self._pruning = None
        self._idle.clear()
        for connection in list(self._open):
            connection.abort()
        self._open.clear()

    def _request(self, path: str, headers: Mapping[str, str]) -> bytes:
        lines = [f"GET {self._prefix}{path} HTTP/1.1\r\n", self._head]
        for name, value in headers.items():
            if "\n" in value or "\r" in value or "\n" in name or "\r" in name or ":" in name:
                raise ValueError(f"header {name!r} has a character HTTP does not allow")
            lines.append(f"{name}: {value}\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    def _take(self) -> Connection | None:
        """The most recently used idle connection that is still usable, if any."""
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if not _stale(connection, now):
                return connection
            self._forget(connection)
        return None

    async def _connect(self, loop: asyncio.AbstractEventLoop, deadline: float) -> Connection:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TimeoutError
        async with asyncio.timeout(remaining):
            _, connection = await loop.create_connection(
                Connection,
                self._host,
                self._port,
                ssl=self._tls,
                server_hostname=self._server_hostname,
            )
        if self._closed:  # closed while this one connected: it would stay open, unowned
            connection.abort()
            raise ConnectionClosedError("the client is closed", before_response=True)
        self._open.add(connection)
        return connection

    async def _exchange(
        self, connection: Connection, request: bytes, deadline: float
    ) -> tuple[int, bytes]:
        clean = False
        try:
            status, body, reusable = await connection.exchange(request, deadline)
            clean = True
        finally:
            if not clean:  # failed, timed out or cancelled: the connection's state is unknown
                self._forget(connection)
        if reusable and not self._closed and len(self._idle) < MAX_IDLE:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
            if self._pruning is None:
                self._pruning = asyncio.get_running_loop().call_later(KEEPALIVE_S, self._prune)
        else:
            self._forget(connection)
        return status, body

    def _prune(self) -> None:
        """Close the idle connections that expired (the oldest are on the left), so that a
        burst's connections do not stay open at the server once the traffic is gone."""
        self._pruning = None
        now = time.monotonic()
        while self._idle and _stale(self._idle[0], now):
            self._forget(self._idle.popleft())
        if self._idle and not self._closed:
            wait = self._idle[0].idle_since + KEEPALIVE_S - now
            self._pruning = asyncio.get_running_loop().call_later(max(wait, 0.1), self._prune)

    def _forget(self, connection: Connection) -> None:
        connection.abort()
        self._open.discard(connection)


def _stale(connection: Connection, now: float) -> bool:
    """Closed by the server, or idle for ``KEEPALIVE_S`` (not to be reused)."""
    return connection.closed or now - connection.idle_since >= KEEPALIVE_S
