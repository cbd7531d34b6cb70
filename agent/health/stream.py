"""The DRAResourceHealth service (v1alpha1 and v1): the device health list, streamed to the kubelet.

The kubelet stamps each reported device with its own receive time and reads a device as Unknown
once no report came for its timeout (kubelet-dra-protocol.md §3), so every message is the full
list, sent on connect, after every change and at least every 10 s. Any number of streams may be
open (kubelet restarts, tools). Each has a latest-state slot of its own: publishing never waits
for a stream, and a slow stream skips straight to the newest list instead of queueing old ones.

grpclib's ``Server.close()`` would cancel the handlers without ending their streams
(dependency-notes.md §2); so the handlers watch the server's ``stopping`` event, end their
streams with status OK themselves (:func:`~agent.kubelet.server.end_stream`: the trailers sent
and read by the kubelet) and return, and they count as the server's open streams, which the
kubelet plugin waits for before its registration socket goes (the kubelet then closes its
connection) and the server before it closes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import anyio
import grpclib.const
from grpclib.const import Status
from opentelemetry.trace import SpanKind

from agent.health.records import DeviceStatus
from agent.kubelet import api
from agent.kubelet.rpc import InFlightCalls, receive_request
from agent.kubelet.server import end_stream
from agent.telemetry.tracing import context_from_metadata, tracer

log = logging.getLogger(__name__)

METHOD = "NodeWatchResources"
SERVICES: dict[str, ModuleType] = {
    "v1alpha1.DRAResourceHealth": api.health_v1alpha1,
    "v1.DRAResourceHealth": api.health_v1,
}
#: Version strings for GetInfo, after the DRAPlugin ones.
HEALTH_VERSIONS = (api.HEALTH_V1ALPHA1_SERVICE, api.HEALTH_V1_SERVICE)
#: The longest gap between two messages on a stream.
DEFAULT_RESEND_INTERVAL = 10.0


class _Watcher:
    """One open stream: its latest-state slot and the event that wakes its handler."""

    def __init__(self) -> None:
        self.latest: tuple[DeviceStatus, ...] | None = None
        self.wake = anyio.Event()

    def offer(self, statuses: tuple[DeviceStatus, ...]) -> None:
        self.latest = statuses  # replaces an unsent list: latest-state semantics
        self.wake.set()

    def take(self) -> tuple[DeviceStatus, ...] | None:
        latest, self.latest = self.latest, None
        self.wake = anyio.Event()
        return latest


class HealthHub:
    """The current device health list and the streams that want it."""

    def __init__(
        self, statuses: Sequence[DeviceStatus] = (), *, until_published: bool = False
    ) -> None:
        self.current: tuple[DeviceStatus, ...] = tuple(statuses)
        self.published = 0
        self._watchers: set[_Watcher] = set()
        #: Set once there is a list to send: at once, or (``until_published``: the hub exists
        #: before the health monitor, whose first look at the GPUs is its first publish) then.
        self.ready = anyio.Event()
        if not until_published:
            self.ready.set()

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    def publish(self, statuses: Sequence[DeviceStatus]) -> None:
        """Make ``statuses`` current and offer it to every stream (never blocks)."""
        self.current = tuple(statuses)
        self.published += 1
        self.ready.set()
        for watcher in self._watchers:
            watcher.offer(self.current)

    def add(self) -> _Watcher:
        watcher = _Watcher()
        self._watchers.add(watcher)
        return watcher

    def remove(self, watcher: _Watcher) -> None:
        self._watchers.discard(watcher)


class HealthStreamService:
    """grpclib service object for both DRAResourceHealth versions, fed by a :class:`HealthHub`.

    Served on the DRA socket; :class:`~agent.kubelet.plugin.KubeletPlugin` calls
    :meth:`attach_server` so that the handlers count as the server's open streams and see it stop.
    """

    def __init__(
        self,
        hub: HealthHub,
        *,
        pool_name: str,
        health_check_timeout_seconds: int = 30,
        resend_interval: float = DEFAULT_RESEND_INTERVAL,
    ) -> None:
        self.hub = hub
        self.pool_name = pool_name
        self.timeout_seconds = health_check_timeout_seconds
        self.resend_interval = resend_interval
        self.streams = InFlightCalls()
        self.stopping = anyio.Event()

    def attach_server(self, server: Any) -> None:
        """Share the server's open streams and ``stopping`` event (a ``UnixGrpcServer``)."""
        self.streams = server.streams
        self.stopping = server.stopping

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        mapping = {}
        for service, pb in SERVICES.items():

            async def handle(stream: Any, service: str = service, pb: ModuleType = pb) -> None:
                await self._watch(stream, service, pb)

            mapping[f"/{service}/{METHOD}"] = grpclib.const.Handler(
                handle,
                grpclib.const.Cardinality.UNARY_STREAM,
                pb.NodeWatchResourcesRequest,
                pb.NodeWatchResourcesResponse,
            )
        return mapping

    def response(self, pb: ModuleType, statuses: Sequence[DeviceStatus]) -> Any:
        """One NodeWatchResourcesResponse holding every device."""
        now = int(time.time())
        return pb.NodeWatchResourcesResponse(
            devices=[
                pb.DeviceHealth(
                    device=pb.DeviceIdentifier(pool_name=self.pool_name, device_name=s.name),
                    health=pb.HealthStatus(int(s.health)),
                    last_updated_time=now,
                    health_check_timeout_seconds=self.timeout_seconds,
                    message=s.message,
                )
                for s in statuses
            ]
        )

    async def _watch(self, stream: Any, service: str, pb: ModuleType) -> None:
        self.streams.enter(METHOD)
        try:
            await receive_request(stream, METHOD, pb.NodeWatchResourcesRequest)
            with tracer().start_as_current_span(
                f"{service}/{METHOD}",
                context=context_from_metadata(stream.metadata),
                kind=SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": METHOD},
            ) as span:
                sent = await self._serve(stream, pb)
                await end_stream(stream)  # before the stream counts as ended
                span.set_attribute("gpu.health.messages_sent", sent)
                span.set_attribute("rpc.grpc.status_code", Status.OK.value)
        finally:
            self.streams.leave()

    async def _serve(self, stream: Any, pb: ModuleType) -> int:
        watcher = self.hub.add()
        sent = 0
        log.info("health stream opened", extra={"watchers": self.hub.watchers})
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._wake_on_stop, watcher)
                if not self.hub.ready.is_set():  # no list before the monitor has looked
                    await self._until_ready()
                statuses: tuple[DeviceStatus, ...] | None = self.hub.current
                while not self.stopping.is_set():
                    await stream.send_message(self.response(pb, statuses or self.hub.current))
                    sent += 1
                    with anyio.move_on_after(self.resend_interval):
                        await watcher.wake.wait()
                    statuses = watcher.take()  # None after a quiet interval: resend current
                group.cancel_scope.cancel()
        finally:
            self.hub.remove(watcher)
            log.info("health stream ended", extra={"messages": sent, "watchers": self.hub.watchers})
        return sent

    async def _until_ready(self) -> None:
        """Until the hub has a list or the server stops."""
        async with anyio.create_task_group() as group:

            async def ready() -> None:
                await self.hub.ready.wait()
                group.cancel_scope.cancel()

            group.start_soon(ready)
            await self.stopping.wait()
            group.cancel_scope.cancel()

    async def _wake_on_stop(self, watcher: _Watcher) -> None:
        await self.stopping.wait()
        watcher.wake.set()
