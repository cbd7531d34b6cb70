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

Limits, so a broken or hostile answer fails its request and nothing else: a response head
over ``MAX_HEAD`` bytes, a body over ``MAX_BODY`` bytes (etcd stores objects of at most
1.5 MiB), a malformed status line, length or chunk: :class:`HttpProtocolError`.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

MAX_HEAD = 64 * 1024
MAX_BODY = 16 * 1024 * 1024
#: Idle connections older than this are closed, not reused (aiohttp's default too).
KEEPALIVE_S = 15.0
#: Idle connections kept at most; more are closed when they come back.
MAX_IDLE = 64

_LENGTH, _CHUNKED, _UNTIL_CLOSE = 0, 1, 2


class HttpProtocolError(Exception):
    """The server's answer is not HTTP/1.1 we can read (or exceeds the limits)."""


class ConnectionClosedError(ConnectionError):
    """The connection ended before the response did."""

    def __init__(self, message: str, *, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response


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
        self._idle: collections.deque[_Connection] = collections.deque()
        self._open: set[_Connection] = set()
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

    def _take(self) -> _Connection | None:
        """The most recently used idle connection that is still usable, if any."""
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and now - connection.idle_since < KEEPALIVE_S:
                return connection
            self._forget(connection)
        return None

    async def _connect(self, loop: asyncio.AbstractEventLoop, deadline: float) -> _Connection:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TimeoutError
        async with asyncio.timeout(remaining):
            _, connection = await loop.create_connection(
                _Connection,
                self._host,
                self._port,
                ssl=self._tls,
                server_hostname=self._server_hostname,
            )
        self._open.add(connection)
        return connection

    async def _exchange(
        self, connection: _Connection, request: bytes, deadline: float
    ) -> tuple[int, bytes]:
        clean = False
        try:
            status, body, reusable = await connection.exchange(request, deadline)
            clean = True
        finally:
            if not clean:  # failed, timed out or cancelled: the connection's state is unknown
                connection.abort()
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
        while self._idle and (
            self._idle[0].closed or now - self._idle[0].idle_since >= KEEPALIVE_S
        ):
            self._forget(self._idle.popleft())
        if self._idle and not self._closed:
            wait = self._idle[0].idle_since + KEEPALIVE_S - now
            self._pruning = asyncio.get_running_loop().call_later(max(wait, 0.1), self._prune)

    def _forget(self, connection: _Connection) -> None:
        connection.abort()
        self._open.discard(connection)


class _Connection(asyncio.Protocol):
    """One connection, one request at a time; parses the answer as it arrives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._buffer = bytearray()
        self._received = False
        self._status = 0  # 0 until the head is read
        self._mode = _LENGTH
        self._length = 0
        self._keep_alive = True
        self._chunks: list[bytes] = []
        self._body_size = 0
        self._chunk_left = -1  # bytes of the current chunk to come (+2 for its CRLF); -1: size

    # -- the request --------------------------------------------------------------------

    async def exchange(self, request: bytes, deadline: float) -> tuple[int, bytes, bool]:
        """Send ``request``; the status, body and whether the connection may be reused."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ConnectionClosedError("the connection is closed", before_response=True)
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        self._received = False
        self._status = 0
        self._buffer.clear()
        self._chunks = []
        self._body_size = 0
        self._chunk_left = -1
        self._timer = loop.call_at(deadline, self._expire)
        try:
            self.transport.write(request)
            return await self._waiter
        finally:
            self._timer.cancel()
            self._timer = None
            self._waiter = None

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _expire(self) -> None:
        self._fail(TimeoutError())
        self.abort()

    def _fail(self, error: BaseException) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _finish(self, body: bytes) -> None:
        waiter = self._waiter
        reusable = self._keep_alive and not self._buffer  # nothing unasked-for after it
        if waiter is not None and not waiter.done():
            waiter.set_result((self._status, body, reusable))

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():
            self.abort()  # an answer nobody asked for: the connection cannot be trusted
            return
        self._received = True
        self._buffer += data
        try:
            self._parse()
        except HttpProtocolError as error:
            self._fail(error)
            self.abort()

    def eof_received(self) -> bool:
        self.closed = True
        return False  # close the transport; connection_lost ends the request

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is None or self._waiter.done():
            return
        if self._status and self._mode == _UNTIL_CLOSE and exc is None:
            body = bytes(self._buffer)
            self._buffer.clear()
            self._keep_alive = False
            self._finish(body)
            return
        before = not self._received
        reason = f": {exc}" if exc is not None else ""
        what = "before answering" if before else "in the middle of its answer"
        message = f"the server closed the connection {what}{reason}"
        self._fail(ConnectionClosedError(message, before_response=before))

    # -- the response ------------------------------------------------------------------

    def _parse(self) -> None:
        if not self._status:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEAD:
                    raise HttpProtocolError(f"a response head over {MAX_HEAD} bytes")
                return
            head = bytes(self._buffer[:end])
            del self._buffer[: end + 4]
            self._read_head(head)
            if 100 <= self._status < 200:  # an interim answer (103 Early Hints): skip it
                self._status = 0
                self._parse()
                return
        if self._mode == _LENGTH:
            if len(self._buffer) >= self._length:
                body = bytes(self._buffer[: self._length])
                del self._buffer[: self._length]
                self._finish(body)
        elif self._mode == _CHUNKED:
            self._parse_chunks()
        elif len(self._buffer) > MAX_BODY:
            raise HttpProtocolError(f"a response body over {MAX_BODY} bytes")

    def _read_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise HttpProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self._status = int(code)
        self._keep_alive = version == "HTTP/1.1"
        length = None
        chunked = False
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon:
                raise HttpProtocolError(f"a malformed header line: {line[:80]!r}")
            name = name.strip().lower()
            if name == "content-length":
                value = value.strip()
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise HttpProtocolError(f"a bad Content-Length: {value[:40]!r}")
                length = int(value)
            elif name == "transfer-encoding":
                codings = [part.strip().lower() for part in value.split(",")]
                if codings[-1] != "chunked" or len(codings) > 1:
                    raise HttpProtocolError(f"a transfer coding we cannot read: {value[:40]!r}")
                chunked = True
            elif name == "connection":
                tokens = {part.strip().lower() for part in value.split(",")}
                if "close" in tokens:
                    self._keep_alive = False
                elif "keep-alive" in tokens:
                    self._keep_alive = True
        if self._status in (204, 304) or 100 <= self._status < 200:
            self._mode, self._length = _LENGTH, 0
        elif chunked:  # wins over a Content-Length (RFC 9112 6.3)
            self._mode = _CHUNKED
            self._keep_alive = self._keep_alive and length is None
        elif length is not None:
            if length > MAX_BODY:
                raise HttpProtocolError(f"a response body of {length} bytes (over {MAX_BODY})")
            self._mode, self._length = _LENGTH, length
        else:
            self._mode, self._keep_alive = _UNTIL_CLOSE, False

    def _parse_chunks(self) -> None:
        buffer = self._buffer
        while True:
            if self._chunk_left < 0:  # a size line, or the trailers after the last chunk
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > 1024:
                        raise HttpProtocolError("a chunk size line over 1024 bytes")
                    return
                size_text = bytes(buffer[:end]).split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise HttpProtocolError(f"a bad chunk size: {size_text[:20]!r}") from None
                if size < 0:
                    raise HttpProtocolError(f"a bad chunk size: {size_text[:20]!r}")
                if size == 0:  # the last chunk: (trailer lines and) an empty line end it
                    trailers_end = buffer.find(b"\r\n\r\n", end)
                    if trailers_end >= 0:
                        del buffer[: trailers_end + 4]
                        self._finish(b"".join(self._chunks))
                    elif len(buffer) > MAX_HEAD:
                        raise HttpProtocolError(f"trailers over {MAX_HEAD} bytes")
                    return
                self._body_size += size
                if self._body_size > MAX_BODY:
                    raise HttpProtocolError(f"a response body over {MAX_BODY} bytes")
                del buffer[: end + 2]
                self._chunk_left = size + 2
            if len(buffer) < self._chunk_left:
                return
            data = bytes(buffer[: self._chunk_left])
            if data[-2:] != b"\r\n":
                raise HttpProtocolError("a chunk that does not end with CRLF")
            self._chunks.append(data[:-2])
            del buffer[: self._chunk_left]
            self._chunk_left = -1
