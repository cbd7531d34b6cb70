"""One grpclib server on one unix socket, started over a stale socket and stopped gracefully.

grpclib's ``Server.close()`` cancels every running handler at once and sends nothing to open
streams, so a client mid-call would hang until its deadline (dependency-notes §2). A graceful stop
here is therefore done in steps: unlink the socket (nobody can connect any more), refuse new calls
on open connections (UNAVAILABLE), let streaming handlers end by setting :attr:`stopping`, wait a
bounded time for unary calls in flight, let grpclib finish sending their trailers, and only
then close the server.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
from grpclib.server import Server
from h2.connection import H2Connection

from agent.kubelet.codec import DraCodec
from agent.kubelet.rpc import InFlightCalls
from agent.kubelet.sockets import SocketIdentity, clear_stale_socket, remove_socket

log = logging.getLogger(__name__)

#: How long a stop waits for unary calls in flight before cancelling them.
DEFAULT_SHUTDOWN_GRACE = 10.0


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
    """``await start()``, then ``await stop()``; ``calls`` must be shared with the handlers."""

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

    async def stop(self, grace: float = DEFAULT_SHUTDOWN_GRACE) -> None:
        """Stop as described in the module docstring; safe to call twice, and shielded from
        cancellation so that a cancelled caller still leaves no socket behind."""
        server, self._server = self._server, None
        if server is None:
            return
        with anyio.CancelScope(shield=True):
            remove_socket(self.path, self._identity)
            self.stopping.set()
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
                await _request_tasks_done(server, grace)
            server.close()
            await server.wait_closed()
        log.info("%s socket closed", self.name, extra={"socket": str(self.path)})


def _hidden_path(path: Path) -> Path:
    """A dot-name next to ``path`` and no longer than it (whose length was checked against
    ``sun_path``), the same for the same path."""
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()
    return path.with_name("." + digest[: max(len(path.name) - 1, 1)])


async def _request_tasks_done(server: Server, limit_s: float) -> None:
    """Wait (bounded) for grpclib's own request tasks to end.

    A handler that returned has not yet sent its trailers: grpclib does that in the request task
    after the handler returns, and ``Server.close()`` would cancel it, so a stream that ended
    cleanly would reach the client as a lost connection. grpclib 0.4.9 (pinned) keeps those tasks
    in ``Handler._tasks``; if a later version does not, this waits for nothing.
    """
    tasks = [
        task
        for handler in getattr(server, "_handlers", ())
        for task in getattr(handler, "_tasks", {}).values()
        if not task.done()
    ]
    if tasks:
        await asyncio.wait(tasks, timeout=limit_s)
