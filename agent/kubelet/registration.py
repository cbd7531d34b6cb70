"""Plugin registration: the socket the kubelet finds in its registry directory.

The kubelet learns about the plugin by a socket appearing in ``plugins_registry``; it calls
GetInfo (1 s deadline) and then tells us with NotifyRegistrationStatus whether it accepted us.
A rejection is final for that socket: the kubelet only tries again when the socket is recreated.
So :class:`Registrar` keeps the socket up, and after a rejection logs the kubelet's reason, counts
it and recreates the socket after a growing delay (a kubelet that rejects us keeps doing so until
something changes, e.g. it is upgraded). A registration socket deleted from under us is recreated
at once, since the kubelet has then forgotten the plugin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import grpclib.const
from anyio.abc import TaskStatus

from agent.kubelet import api
from agent.kubelet.rpc import InFlightCalls, unary_handler
from agent.kubelet.server import UnixGrpcServer
from agent.kubelet.sockets import SocketIdentity

log = logging.getLogger(__name__)

pr = api.pluginregistration
SERVICE = "pluginregistration.Registration"
#: Version strings of the DRA services this plugin serves, v1 first (the kubelet takes the
#: first one it supports, in plugin order).
DRA_VERSIONS = (api.DRA_V1_SERVICE, api.DRA_V1BETA1_SERVICE)


class RegistrationService:
    """Answers GetInfo and records the kubelet's verdict through ``on_status``."""

    def __init__(
        self,
        *,
        driver_name: str,
        endpoint: Path,
        supported_versions: Sequence[str],
        calls: InFlightCalls,
        on_status: Callable[[bool, str], None],
    ) -> None:
        self._info = pr.PluginInfo(
            type=api.DRA_PLUGIN_TYPE,
            name=driver_name,
            endpoint=str(endpoint),
            supported_versions=list(supported_versions),
        )
        self._calls = calls
        self._on_status = on_status
        self._driver = driver_name

    async def get_info(self, request: Any) -> Any:
        return self._info

    async def notify_registration_status(self, request: Any) -> Any:
        self._on_status(bool(request.plugin_registered), str(request.error))
        return pr.RegistrationStatusResponse()

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            f"/{SERVICE}/GetInfo": unary_handler(
                service=SERVICE,
                short_service="Registration",
                method="GetInfo",
                request_type=pr.InfoRequest,
                response_type=pr.PluginInfo,
                function=self.get_info,
                calls=self._calls,
                driver=self._driver,
            ),
            f"/{SERVICE}/NotifyRegistrationStatus": unary_handler(
                service=SERVICE,
                short_service="Registration",
                method="NotifyRegistrationStatus",
                request_type=pr.RegistrationStatus,
                response_type=pr.RegistrationStatusResponse,
                function=self.notify_registration_status,
                calls=self._calls,
                driver=self._driver,
            ),
        }


class Registrar:
    """Keeps ``<registrar-dir>/<driver>[-<id>]-reg.sock`` registered with the kubelet."""

    def __init__(
        self,
        path: Path,
        *,
        driver_name: str,
        endpoint: Path,
        supported_versions: Sequence[str] = DRA_VERSIONS,
        backoff_initial: float = 1.0,
        backoff_cap: float = 60.0,
        check_interval: float = 1.0,
    ) -> None:
        self.path = path
        self.driver_name = driver_name
        self.endpoint = endpoint
        self.supported_versions = tuple(supported_versions)
        #: How many times the kubelet rejected the plugin.
        self.rejections = 0
        #: The kubelet's last verdict: None before the first, then True or False.
        self.registered: bool | None = None
        #: How many times the registration socket was created (1 + re-registrations).
        self.sockets_created = 0
        self._backoff_initial = backoff_initial
        self._backoff_cap = backoff_cap
        self._check_interval = check_interval
        self._delay = backoff_initial
        self._rejected = anyio.Event()

    def _on_status(self, registered: bool, error: str) -> None:
        self.registered = registered
        if registered:
            self._delay = self._backoff_initial
            log.info(
                "registered with the kubelet",
                extra={"driver": self.driver_name, "socket": str(self.path)},
            )
            return
        self.rejections += 1
        log.warning(
            "the kubelet rejected the plugin: %s; re-registering in %.3g s",
            error or "(no reason given)",
            self._delay,
            extra={"driver": self.driver_name, "rejections": self.rejections},
        )
        self._rejected.set()

    def _new_server(self) -> UnixGrpcServer:
        calls = InFlightCalls()
        service = RegistrationService(
            driver_name=self.driver_name,
            endpoint=self.endpoint,
            supported_versions=self.supported_versions,
            calls=calls,
            on_status=self._on_status,
        )
        return UnixGrpcServer(self.path, [service], calls, name="registration")

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status.started()`` once the first socket exists."""
        started = False
        while True:
            self._rejected = anyio.Event()
            server = self._new_server()
            await server.start()
            self.sockets_created += 1
            if not started:
                started = True
                task_status.started()
            try:
                rejected = await self._wait_for_trouble(server)
            finally:
                await server.stop(grace=1.0)
            if rejected:
                await anyio.sleep(self._delay)
                self._delay = min(self._delay * 2, self._backoff_cap)
            else:
                log.warning(
                    "the registration socket was deleted; recreating it",
                    extra={"socket": str(self.path)},
                )

    async def _wait_for_trouble(self, server: UnixGrpcServer) -> bool:
        """Wait for a rejection (True) or for our socket to disappear (False)."""
        ours = SocketIdentity.of(self.path)
        while True:
            with anyio.move_on_after(self._check_interval):
                await self._rejected.wait()
                return True
            if SocketIdentity.of(self.path) is None and ours is not None:
                return False
