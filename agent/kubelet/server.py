"""One grpclib server on one unix socket, started over a stale socket and stopped gracefully.

grpclib's ``Server.close()`` cancels every running handler at once and sends nothing to open
streams, so a client mid-call would hang until its deadline (dependency-notes §2). A graceful stop
here is therefore done in steps: unlink the socket (nobody can connect any more), end the streams
(:meth:`UnixGrpcServer.end_streams`, which the kubelet plugin calls earlier, before its
registration socket goes), refuse new calls on open connections (UNAVAILABLE), wait a bounded
time for unary calls in flight, let grpclib finish sending their trailers, and only then close
the server.

A streaming handler ends its own stream (:func:`end_stream`): it sends the trailers (status OK)
itself and waits, bounded, until the client has read them, and only then counts as ended. The
kubelet closes its connection as soon as it deregisters the plugin, and a stream whose trailers
were still on their way (unsent: grpclib sends them in its request task after the handler
returned; or unread) reaches it as a lost connection instead of a clean end.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import hashlib
import logging
import os
import termios
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
from grpclib.server import Server
from h2.connection import H2Connection
from h2.exceptions import StreamClosedError

from agent.kubelet.codec import DraCodec
from agent.kubelet.rpc import InFlightCalls
from agent.kubelet.sockets import SocketIdentity, clear_stale_socket, remove_socket

log = logging.getLogger(__name__)

#: How long a stop waits for unary calls in flight before cancelling them.
DEFAULT_SHUTDOWN_GRACE = 10.0
#: How long a stop waits for the streams to end (their trailers read by the client): they end
#: within milliseconds, unless a client stopped reading.
STREAMS_END_GRACE = 1.0
#: How long a stop waits for grpclib's connections to close once the calls are done.
CLOSE_LIMIT = 2.0
#: How long one ending stream waits for its client to read the trailers.
TRAILERS_READ_LIMIT = 0.5
#: The first and the longest pause between two looks at whether the client has read them.
_READ_POLL_FIRST, _READ_POLL_MAX = 0.0005, 0.02


#: The mode of the agent's gRPC sockets: the kubelet (root) connects, nobody else may.
SOCKET_MODE = 0o755

#: How many closed streams each HTTP/2 connection remembers (h2's default: 65 536). h2 keeps
#: how each stream ended, to answer a late frame on it with a stream rather than a connection
#: error; a peer's late frames come within a round trip, but the record fills up to its limit
#: on a long-lived connection: the kubelet's, two streams per claim prepared and unprepared,
#: about 110 bytes each, 7 MB after some 33 000 cycles (the soak's drift, docs/RELIABILITY.md).
CLOSED_STREAMS_KEPT = 1024


def limit_closed_stream_record(kept: int = CLOSED_STREAMS_KEPT) -> None:
    """Make every HTTP/2 connection opened from now on remember at most ``kept`` closed
    streams (h2's class attribute; the agent's only HTTP/2 connections are its gRPC
    servers')."""
    H2Connection.MAX_CLOSED_STREAMS = kept


class UnixGrpcServer:
    """``await start()``, then ``await stop()``; ``calls`` must be shared with the unary
    handlers, :attr:`streams` and :attr:`stopping` with the streaming ones."""

    def __init__(
        self,
        path: Path,
        services: Sequence[Any],
        calls: InFlightCalls,
        *,
        name: str,
    ) -> None:
        self.path = path
        self.name = name
        self.calls = calls
        #: Set when stopping; streaming handlers watch it and end their streams cleanly.
        self.stopping = anyio.Event()
        #: The open streams: a streaming handler counts here (not in ``calls``) until its
        #: stream has ended (:func:`end_stream`).
        self.streams = InFlightCalls()
        self._services = list(services)
        self._server: Server | None = None
        self._identity: SocketIdentity | None = None

    @property
    def serving(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        """Replace a stale socket and listen; the socket accepts calls when this returns."""
        clear_stale_socket(self.path)
        limit_closed_stream_record()
        # the codec grpclib would pick (with the prepare answer encoded by hand, ``codec``),
        # named so that it does not also load googleapis' status-details codec (protobuf's
        # runtime: 10-20 ms of a start, some MB): the agent sends no error details
        server = Server(self._services, codec=DraCodec())
        # connect(2) needs write permission: only the owner (root, as the kubelet) may call,
        # whatever the process umask (which alone would give 0777 & ~umask). The socket is
        # bound under a hidden name (the kubelet's plugin watcher skips dot-names), given its
        # mode and renamed into place, so it never appears with another mode nor changes after
        # it appeared (a chmod after the bind, run after asyncio's yield in the bind, raced a
        # watcher: the kubelet emulator took the changed ctime for a recreated socket and
        # registered the plugin again, closing the connection of a call in flight).
        hidden = _hidden_path(self.path)
        hidden.unlink(missing_ok=True)
        await server.start(path=str(hidden))
        os.chmod(hidden, SOCKET_MODE)
        os.replace(hidden, self.path)
        self._server = server
        self._identity = SocketIdentity.of(self.path)
        log.info("%s socket listening", self.name, extra={"socket": str(self.path)})

    async def end_streams(self, limit: float = STREAMS_END_GRACE) -> bool:
        """Set :attr:`stopping`, so that every streaming handler ends its stream with status OK,
        and wait up to ``limit`` seconds until they all have (their trailers read by the
        client); a stream opened from now on is refused (UNAVAILABLE). Unary calls go on. True
        if no stream is left open; a second call does not wait again. Shielded from
        cancellation, like :meth:`stop`."""
        with anyio.CancelScope(shield=True):
            if self.stopping.is_set():
                return self.streams.running == 0
            self.stopping.set()
            ended = await self.streams.drain(limit)
        if not ended:
            log.warning(
                "%s: %d stream(s) still open after %.3g s; they will be cancelled",
                self.name,
                self.streams.running,
                limit,
                extra={"socket": str(self.path)},
            )
        return ended

    async def stop(self, grace: float = DEFAULT_SHUTDOWN_GRACE) -> None:
        """Stop as described in the module docstring; safe to call twice, and shielded from
        cancellation so that a cancelled caller still leaves no socket behind."""
        server, self._server = self._server, None
        if server is None:
            return
        with anyio.CancelScope(shield=True):
            remove_socket(self.path, self._identity)
            ended = await self.end_streams(min(grace, STREAMS_END_GRACE))
            idle = await self.calls.drain(grace)
            if not idle:
                log.warning(
                    "%s: %d call(s) still running after %.3g s; cancelling them",
                    self.name,
                    self.calls.running,
                    grace,
                    extra={"socket": str(self.path)},
                )
            if idle:
                await _request_tasks_done(server, grace, 0 if ended else self.streams.running)
            server.close()
            # bounded: grpclib waits forever for a request task whose client reset its
            # stream and stopped reading (its error trailers can never be sent)
            with anyio.move_on_after(CLOSE_LIMIT) as waited:
                await server.wait_closed()
            if waited.cancelled_caught:
                log.warning(
                    "%s: a connection did not close within %g s; left to the process's exit",
                    self.name,
                    CLOSE_LIMIT,
                )
        log.info("%s socket closed", self.name, extra={"socket": str(self.path)})


def _hidden_path(path: Path) -> Path:
    """A dot-name next to ``path`` and no longer than it (whose length was checked against
    ``sun_path``), the same for the same path."""
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()
    return path.with_name("." + digest[: max(len(path.name) - 1, 1)])


async def _request_tasks_done(server: Server, limit_s: float, still_open: int = 0) -> None:
    """Wait (bounded) for grpclib's own request tasks to end, all but ``still_open`` of them
    (the tasks of streams that did not end: their handlers are still running).

    A handler that returned has not yet sent its trailers: grpclib does that in the request task
    after the handler returns, and ``Server.close()`` would cancel it, so a call that ended
    cleanly would reach the client as a lost connection. grpclib 0.4.9 (pinned) keeps those tasks
    in ``Handler._tasks``; if a later version does not, this waits for nothing.
    """
    pending = {
        task
        for handler in getattr(server, "_handlers", ())
        for task in getattr(handler, "_tasks", {}).values()
        if not task.done()
    }
    with anyio.move_on_after(limit_s):
        while len(pending) > still_open:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)


async def end_stream(stream: Any, limit_s: float = TRAILERS_READ_LIMIT) -> None:
    """End a grpclib server ``stream`` with status OK now, then wait (at most ``limit_s``)
    until the client has read everything sent on its connection, the trailers included.

    For a streaming handler that returns once :attr:`UnixGrpcServer.stopping` is set: after
    this, its stream has ended for the client too, and the handler may count as ended. A
    stream the client has already closed has nothing left to end.
    """
    try:
        await stream.send_trailing_metadata()  # status OK; grpclib sends no second trailers
    except StreamClosedError:
        return
    transport = getattr(getattr(stream, "_stream", None), "_transport", None)
    if transport is not None:
        await _client_has_read(transport, limit_s)


async def _client_has_read(transport: Any, limit_s: float) -> bool:
    """Wait (bounded) until ``transport`` has handed all its data to the kernel and the client
    has read it from the socket; True if so, False at once where that cannot be told.

    Linux counts, for a unix stream socket, what the peer has not read yet (``SIOCOUTQ``): the
    data stays charged to the sender until the receiver takes it. The client reads in its own
    time, so this looks again after a pause that doubles, from half a millisecond.
    """
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    pause = _READ_POLL_FIRST
    with anyio.move_on_after(limit_s):
        while not transport.is_closing():
            try:
                unread = _unread_by_peer(sock.fileno())
            except OSError:  # not a socket that can tell (or already closed)
                return False
            if unread == 0 and transport.get_write_buffer_size() == 0:
                return True
            await anyio.sleep(pause)
            pause = min(pause * 2, _READ_POLL_MAX)
    return False


def _unread_by_peer(fd: int) -> int:
    """What the peer of socket ``fd`` has not read yet (bytes and their buffers' overhead)."""
    unread = array.array("i", [0])
    fcntl.ioctl(fd, termios.TIOCOUTQ, unread, True)  # TIOCOUTQ is SIOCOUTQ's number
    return unread[0]
