"""A minimal DRA plugin for testing the kubelet emulator: a few grpclib servicers that record what
they were asked, on a registration socket and a DRA socket (the DRA socket listens first)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from grpclib import GRPCError
from grpclib.const import Status
from grpclib.server import Server

from agent.kubelet import api

DRIVER = "gpu.nvidia.com"
pr = api.pluginregistration


@contextmanager
def short_tmpdir() -> Iterator[Path]:
    """A temporary directory with a path short enough for Unix sockets (< 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class FakeRegistration(api.pluginregistration.RegistrationBase):
    """Answers GetInfo (optionally slowly) and records NotifyRegistrationStatus, answering a
    ``false`` with a gRPC error the way the Go helper does."""

    def __init__(self, info: Any, get_info_delay: float = 0.0, slow_calls: int = 1_000_000) -> None:
        self.info = info
        self.get_info_delay = get_info_delay
        self.slow_calls = slow_calls
        self.get_info_times: list[float] = []
        self.statuses: list[Any] = []

    async def get_info(self, message: Any) -> Any:
        self.get_info_times.append(asyncio.get_running_loop().time())
        if len(self.get_info_times) <= self.slow_calls and self.get_info_delay:
            await asyncio.sleep(self.get_info_delay)
        return self.info

    async def notify_registration_status(self, message: Any) -> Any:
        self.statuses.append(message)
        if not message.plugin_registered:
            raise GRPCError(Status.UNKNOWN, f"registration failed: {message.error}")
        return pr.RegistrationStatusResponse()


class _DraRecorder:
    """Records requests; answers each claim with one device unless ``answer`` overrides."""

    pb: Any

    def __init__(self) -> None:
        self.prepare_requests: list[Any] = []
        self.unprepare_requests: list[Any] = []
        self.prepare_answer: Callable[[Any], dict[str, Any]] | None = None
        self.unprepare_answer: Callable[[Any], dict[str, Any]] | None = None

    async def node_prepare_resources(self, message: Any) -> Any:
        self.prepare_requests.append(message)
        if self.prepare_answer is not None:
            return self.pb.NodePrepareResourcesResponse(claims=self.prepare_answer(message))
        claims = {
            c.uid: self.pb.NodePrepareResourceResponse(
                devices=[
                    self.pb.Device(
                        request_names=["gpu"],
                        pool_name="node-a",
                        device_name="gpu-0",
                        cdi_device_ids=[f"k8s.gpu.nvidia.com/gpu={c.uid}-gpu-0"],
                    )
                ]
            )
            for c in message.claims
        }
        return self.pb.NodePrepareResourcesResponse(claims=claims)

    async def node_unprepare_resources(self, message: Any) -> Any:
        self.unprepare_requests.append(message)
        if self.unprepare_answer is not None:
            return self.pb.NodeUnprepareResourcesResponse(claims=self.unprepare_answer(message))
        claims = {c.uid: self.pb.NodeUnprepareResourceResponse() for c in message.claims}
        return self.pb.NodeUnprepareResourcesResponse(claims=claims)


class DraV1(_DraRecorder, api.dra_v1.DraPluginBase):
    pb = api.dra_v1


class DraV1beta1(_DraRecorder, api.dra_v1beta1.DraPluginBase):
    pb = api.dra_v1beta1


class _HealthStreamer:
    """Streams whatever the test queues; ``end_streams`` makes every open stream return (grpclib's
    Server.close() would leave the client hanging)."""

    pb: Any

    def __init__(self) -> None:
        self.opened: list[float] = []
        self._queues: list[asyncio.Queue[Any]] = []

    async def node_watch_resources(self, message: Any) -> AsyncIterator[Any]:
        self.opened.append(asyncio.get_running_loop().time())
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues.append(queue)
        try:
            while (item := await queue.get()) is not None:
                yield item
        finally:
            self._queues.remove(queue)

    def send(self, devices: list[tuple[str, str, int, int]]) -> None:
        """Queue one message: (pool, device, health 0/1/2, health_check_timeout_seconds)."""
        response = self.pb.NodeWatchResourcesResponse(
            devices=[
                self.pb.DeviceHealth(
                    device=self.pb.DeviceIdentifier(pool_name=pool, device_name=name),
                    health=self.pb.HealthStatus(health),
                    last_updated_time=1,  # ancient on purpose: the kubelet ignores it
                    health_check_timeout_seconds=timeout,
                )
                for pool, name, health, timeout in devices
            ]
        )
        for queue in self._queues:
            queue.put_nowait(response)

    def end_streams(self) -> None:
        for queue in self._queues:
            queue.put_nowait(None)


class HealthV1alpha1(_HealthStreamer, api.health_v1alpha1.DraResourceHealthBase):
    pb = api.health_v1alpha1


class HealthV1(_HealthStreamer, api.health_v1.DraResourceHealthBase):
    pb = api.health_v1


class _ClosingServer(Server):
    """A grpclib Server whose close() also closes open connections, as the death of a plugin
    process would (on Python 3.11 asyncio leaves accepted connections open)."""

    def __init__(self, handlers: list[Any]) -> None:
        super().__init__(handlers)
        self._protocols: list[Any] = []

    def _protocol_factory(self) -> Any:
        protocol = super()._protocol_factory()
        self._protocols.append(protocol)
        return protocol

    def close(self) -> None:
        super().close()
        for protocol in self._protocols:
            connection = getattr(protocol, "connection", None)
            if connection is not None:
                connection.close()


class FakePlugin:
    """Registration socket ``<registry>/<name>-reg.sock`` and DRA socket ``<root>/<name>/dra.sock``."""

    def __init__(
        self,
        root: Path,
        registry: Path,
        *,
        driver: str = DRIVER,
        name: str | None = None,
        versions: list[str] | None = None,
        plugin_type: str = api.DRA_PLUGIN_TYPE,
        get_info_delay: float = 0.0,
        slow_calls: int = 1_000_000,
        dra: tuple[str, ...] = ("v1",),
        health: tuple[str, ...] = (),
    ) -> None:
        name = name or driver
        self.reg_socket = registry / f"{name}-reg.sock"
        self.dra_socket = root / name / "dra.sock"
        self.dra_socket.parent.mkdir(parents=True, exist_ok=True)
        if versions is None:
            versions = [api.DRA_V1_SERVICE, api.DRA_V1BETA1_SERVICE]
        info = pr.PluginInfo(
            type=plugin_type,
            name=driver,
            endpoint=str(self.dra_socket),
            supported_versions=versions,
        )
        self.registration = FakeRegistration(info, get_info_delay, slow_calls)
        self.v1 = DraV1()
        self.v1beta1 = DraV1beta1()
        self.health_v1alpha1 = HealthV1alpha1()
        self.health_v1 = HealthV1()
        services: list[Any] = []
        services += [self.v1] if "v1" in dra else []
        services += [self.v1beta1] if "v1beta1" in dra else []
        services += [self.health_v1alpha1] if "v1alpha1" in health else []
        services += [self.health_v1] if "v1" in health else []
        self._dra_services = services
        self._dra_server: _ClosingServer | None = None
        self._reg_server: _ClosingServer | None = None

    async def start(self) -> None:
        await self.start_dra()
        await self.start_registration()

    async def start_dra(self) -> None:
        self._dra_server = _ClosingServer(self._dra_services)
        await self._dra_server.start(path=str(self.dra_socket))

    async def start_registration(self) -> None:
        self._reg_server = _ClosingServer([self.registration])
        await self._reg_server.start(path=str(self.reg_socket))

    async def stop_dra(self) -> None:
        self.health_v1alpha1.end_streams()
        self.health_v1.end_streams()
        await asyncio.sleep(0.05)  # let the streams end before the server drops them
        if self._dra_server is not None:
            self._dra_server.close()
            await self._dra_server.wait_closed()
            self._dra_server = None

    async def stop_registration(self, *, unlink: bool = True) -> None:
        if self._reg_server is not None:
            self._reg_server.close()
            await self._reg_server.wait_closed()
            self._reg_server = None
        if unlink:
            self.reg_socket.unlink(missing_ok=True)

    async def stop(self) -> None:
        await self.stop_registration()
        await self.stop_dra()
        self.dra_socket.unlink(missing_ok=True)

    async def __aenter__(self) -> FakePlugin:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def eventually(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Wait until ``predicate()`` holds (for what the plugin side observes)."""
    deadline = asyncio.get_running_loop().time() + within
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)
