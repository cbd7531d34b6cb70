"""The kubelet-facing side of one DRA driver: its DRA socket and its registration socket.

Order matters to the kubelet (kubelet-dra-protocol §6, §8): the DRA socket must accept calls
before the registration socket appears, because the kubelet dials the endpoint right after
registering; on the way out the streams end first (status OK, their trailers read by the
kubelet), because the kubelet closes its connection to the DRA socket as soon as it deregisters
the plugin; then the registration socket goes (the kubelet deregisters and stops sending calls),
then the DRA socket, after the calls in flight have finished.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus

from agent.kubelet.dra_service import ClaimPreparer, DraPluginService
from agent.kubelet.registration import DRA_VERSIONS, Registrar
from agent.kubelet.rpc import InFlightCalls
from agent.kubelet.server import DEFAULT_SHUTDOWN_GRACE, UnixGrpcServer

log = logging.getLogger(__name__)


class KubeletPlugin:
    """Serve one driver to the kubelet: ``await task_group.start(plugin.run)``.

    ``extra_services`` are served on the DRA socket next to DRAPlugin (the health service), and
    ``supported_versions`` is what GetInfo advertises; the two go together. A service with an
    ``attach_server(server)`` method is given the DRA server, to share its in-flight count and
    ``stopping`` event.
    """

    def __init__(
        self,
        *,
        driver_name: str,
        dra_socket: Path,
        registration_socket: Path,
        engine: ClaimPreparer,
        supported_versions: Sequence[str] = DRA_VERSIONS,
        extra_services: Sequence[Any] = (),
        shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
        registration_backoff: float = 1.0,
    ) -> None:
        self.driver_name = driver_name
        self.calls = InFlightCalls()
        self.dra_server = UnixGrpcServer(
            dra_socket,
            [DraPluginService(engine, self.calls, driver_name), *extra_services],
            self.calls,
            name="DRA",
        )
        for service in extra_services:
            # a streaming service ends its streams when the server stops (see server.py)
            attach = getattr(service, "attach_server", None)
            if attach is not None:
                attach(self.dra_server)
        self.registrar = Registrar(
            registration_socket,
            driver_name=driver_name,
            endpoint=dra_socket,
            supported_versions=supported_versions,
            backoff_initial=registration_backoff,
        )
        self._grace = shutdown_grace

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled, then stop gracefully and remove both sockets."""
        await self.dra_server.start()
        registration = anyio.CancelScope()
        try:
            async with anyio.create_task_group() as task_group:
                try:
                    await task_group.start(self._register, registration)
                    # a stop cancels the registrar only below, once the streams have ended
                    registration.shield = True
                    log.info(
                        "serving the kubelet",
                        extra={
                            "driver": self.driver_name,
                            "dra_socket": str(self.dra_server.path),
                            "registration_socket": str(self.registrar.path),
                        },
                    )
                    task_status.started()
                    await anyio.sleep_forever()
                finally:
                    try:
                        await self.dra_server.end_streams()
                    finally:
                        registration.cancel()
        finally:
            await self.dra_server.stop(self._grace)

    async def _register(
        self,
        scope: anyio.CancelScope,
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        with scope:
            await self.registrar.run(task_status=task_status)
