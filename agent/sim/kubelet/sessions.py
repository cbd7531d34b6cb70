"""The kubelet emulator's plugin side: the registry watcher, one registration session per
plugin socket (registration with backoff, the connection monitor, the health stream) and the
registered instances, as a base class of :class:`~agent.sim.kubelet.emulator.KubeletEmulator`
(which owns the state and the task group these methods run in)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup
from grpclib.client import Channel

from agent.sim.kubelet.dra_client import DraClient
from agent.sim.kubelet.errors import DriverNotRegisteredError, RegistrationError
from agent.sim.kubelet.events import ChangeNotifier, EventKind, EventLog
from agent.sim.kubelet.health import HealthCache, watch_health
from agent.sim.kubelet.registration import (
    PluginRegistration,
    RegistrationTimeouts,
    register_plugin,
)
from agent.sim.kubelet.watcher import SocketIdentity, diff_scans, scan_registry


@dataclass
class PluginInstance:
    """One registered plugin instance (several exist for one driver during a rolling update)."""

    registration: PluginRegistration
    sequence: int
    channel: Channel
    client: DraClient
    #: None until the connection was first probed; counts as usable, like a connecting channel.
    connected: bool | None = None


class PluginSessions:
    """Registration and the registered plugin instances (state set by the emulator)."""

    registrar_dir: Path
    _poll: float
    _timeouts: RegistrationTimeouts
    _backoff_initial: float
    _backoff_cap: float
    _call_timeout: float
    _health_retry_delay: float
    _health_services: tuple[str, ...]
    _notifier: ChangeNotifier
    _log: EventLog
    _health: HealthCache
    _instances: dict[Path, PluginInstance]
    _sessions: dict[Path, anyio.CancelScope]
    _known_drivers: set[str]
    _sequence: int
    _stopping: bool

    # -- plugin watcher and registration ---------------------------------------------------------

    async def _watch_registry(self, task_group: TaskGroup) -> None:
        known: dict[Path, SocketIdentity] = {}
        while True:
            current = scan_registry(self.registrar_dir)
            changes = diff_scans(known, current)
            for path in changes.removed:  # the kubelet unregisters before it registers
                self._end_session(
                    path, "socket removed" if path not in current else "socket recreated"
                )
            for path in changes.added:
                scope = anyio.CancelScope()
                self._sessions[path] = scope
                task_group.start_soon(self._plugin_session, path, scope)
            known = current
            await anyio.sleep(self._poll)

    def _end_session(self, path: Path, reason: str) -> None:
        self._deregister(path, reason)
        scope = self._sessions.pop(path, None)
        if scope is not None:
            scope.cancel()

    async def _plugin_session(self, path: Path, scope: anyio.CancelScope) -> None:
        added: list[PluginInstance] = []  # what this session registered, to undo on exit
        with scope:
            try:
                registration = await self._register_with_backoff(path, added)
                instance = added[-1]
                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(self._monitor_connection, instance)
                    if registration.health_service is not None:
                        task_group.start_soon(
                            watch_health,
                            registration.driver,
                            instance.channel,
                            registration.health_service,
                            self._health,
                            self._log,
                            self._notifier,
                            self._health_retry_delay,
                        )
            finally:
                for instance in added:
                    self._deregister(path, "stopping", only=instance)

    async def _register_with_backoff(
        self, path: Path, added: list[PluginInstance]
    ) -> PluginRegistration:
        delay = self._backoff_initial
        while True:
            try:
                registration, notify_error = await register_plugin(
                    path,
                    self._timeouts,
                    lambda reg: added.append(self._add_instance(path, reg)),
                    self._health_services,
                )
            except RegistrationError as exc:
                self._log.record(
                    EventKind.REGISTRATION_FAILED,
                    f"registering plugin at {path} failed: {exc}; retrying in {delay:g}s",
                    socket=str(path),
                    level=logging.WARNING,
                )
                await anyio.sleep(delay)
                delay = min(delay * 2, self._backoff_cap)
                continue
            if notify_error is not None:
                # Registered anyway: the kubelet added the plugin before notifying it.
                self._log.record(
                    EventKind.REGISTRATION_FAILED,
                    f"plugin {registration.driver} at {path} is registered but {notify_error}",
                    driver=registration.driver,
                    socket=str(path),
                    level=logging.WARNING,
                )
            return registration

    def _add_instance(self, path: Path, registration: PluginRegistration) -> PluginInstance:
        self._sequence += 1
        channel = Channel(path=registration.endpoint)
        client = DraClient(
            registration.driver, channel, registration.dra_service, self._call_timeout
        )
        instance = PluginInstance(registration, self._sequence, channel, client)
        self._instances[path] = instance
        self._known_drivers.add(registration.driver)
        self._log.record(
            EventKind.REGISTERED,
            f"registered plugin {registration.driver} endpoint={registration.endpoint} "
            f"service={registration.dra_service} health={registration.health_service or 'none'} "
            f"socket={path}",
            driver=registration.driver,
            socket=str(path),
        )
        return instance

    def _deregister(self, path: Path, reason: str, only: PluginInstance | None = None) -> None:
        """Forget the instance registered from ``path`` (``only``: if it is still that one, as a
        recreated socket may already have registered a successor)."""
        instance = self._instances.get(path)
        if instance is None or (only is not None and instance is not only):
            return
        del self._instances[path]
        instance.channel.close()
        if self._stopping:
            return
        reg = instance.registration
        self._log.record(
            EventKind.DEREGISTERED,
            f"deregistered plugin {reg.driver} endpoint={reg.endpoint} socket={path} ({reason})",
            driver=reg.driver,
            socket=str(path),
        )

    async def _monitor_connection(self, instance: PluginInstance) -> None:
        """Track whether the DRA endpoint is connected, reconnecting when it drops (the
        kubelet's ConnBegin/ConnEnd monitoring of 1.34)."""
        channel: Any = instance.channel
        reg = instance.registration
        while True:
            connected = bool(channel._connected)
            if not connected:
                try:
                    with anyio.fail_after(self._timeouts.dial):
                        await channel.__connect__()
                    connected = True
                except (OSError, TimeoutError):
                    connected = False
            registered = self._instances.get(reg.socket) is instance
            if registered and connected != instance.connected:
                instance.connected = connected
                kind = EventKind.CONNECTED if connected else EventKind.DISCONNECTED
                self._log.record(
                    kind,
                    f"{kind} to plugin {reg.driver} endpoint={reg.endpoint}"
                    if connected
                    else f"{kind} from plugin {reg.driver} endpoint={reg.endpoint}",
                    driver=reg.driver,
                    socket=str(reg.socket),
                )
            await anyio.sleep(self._poll)

    # -- registered plugins ----------------------------------------------------------------------

    def registrations(self, driver: str) -> list[PluginRegistration]:
        """Registered instances of ``driver``, oldest first."""
        instances = sorted(self._driver_instances(driver), key=lambda i: i.sequence)
        return [i.registration for i in instances]

    def is_connected(self, driver: str) -> bool:
        """Whether some registered instance of ``driver`` is (or may be) connected."""
        return any(i.connected is not False for i in self._driver_instances(driver))

    def _driver_instances(self, driver: str) -> list[PluginInstance]:
        return [i for i in self._instances.values() if i.registration.driver == driver]

    def _select(self, driver: str) -> PluginInstance:
        """The most recently registered connected instance, else the most recent one."""
        instances = self._driver_instances(driver)
        if not instances:
            raise DriverNotRegisteredError(driver)
        usable = [i for i in instances if i.connected is not False]
        return max(usable or instances, key=lambda i: i.sequence)

    async def wait_registered(self, driver: str, timeout: float = 10.0) -> PluginRegistration:  # noqa: ASYNC109
        """Wait until an instance of ``driver`` is registered; returns the newest."""
        await self._notifier.wait_for(lambda: bool(self._driver_instances(driver)), timeout)
        return self._select(driver).registration

    async def wait_deregistered(self, driver: str, timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Wait until no instance of ``driver`` is registered."""
        await self._notifier.wait_for(lambda: not self._driver_instances(driver), timeout)
