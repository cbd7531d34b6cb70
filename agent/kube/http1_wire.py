"""One HTTP/1.1 connection of :mod:`agent.kube.http1`: a request out, its answer parsed.

An ``asyncio.Protocol`` that sends one request at a time and parses the answer from a
``bytearray`` as it arrives: the status line, the headers that frame the body
(``Content-Length``, ``Transfer-Encoding: chunked``, ``Connection``), then the body by its
length, by chunks (trailers skipped) or until the connection ends (HTTP/1.0 style). Interim
answers (1xx) are skipped; 204 and 304 have no body. It tells its pool whether the
connection may be reused: HTTP/1.1 or ``keep-alive``, no ``Connection: close``, and nothing
after the answer that nobody asked for (bytes after it, or on the idle connection, mean the
two sides disagree about the framing: it is closed).

Limits, so a broken or hostile answer fails its request and nothing else: a response head
over ``MAX_HEAD`` bytes, a body over ``MAX_BODY`` bytes (etcd stores objects of at most
1.5 MiB), a malformed status line, length or chunk: :class:`HttpProtocolError`. A deadline
is a timer on the loop that fails the request and aborts the connection.
"""

from __future__ import annotations

import asyncio

MAX_HEAD = 64 * 1024
MAX_BODY = 16 * 1024 * 1024

_LENGTH, _CHUNKED, _UNTIL_CLOSE = 0, 1, 2


def _digits(text: str) -> bool:
    """ASCII digits only (``str.isdigit`` also takes the superscripts latin-1 decodes)."""
    return text.isascii() and text.isdigit()


class HttpProtocolError(Exception):
    """The server's answer is not HTTP/1.1 we can read (or exceeds the limits)."""


class ConnectionClosedError(ConnectionError):
    """The connection ended before the response did."""

    def __init__(self, message: str, *, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response


class Connection(asyncio.Protocol):
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
        while not self._status:
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
        if not version.startswith("HTTP/1.") or len(code) != 3 or not _digits(code):
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
                if not _digits(value) or (length is not None and int(value) != length):
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
