"""The kubelet emulator: the kubelet's DRA plugin handling, in-process, over real gRPC sockets.

Integration tests and the demo need a kubelet that registers the agent, prepares and unprepares
claims, reads its health stream and wipes its slices, with the 1.34+ kubelet's rules and deadlines,
without a cluster. Everything runs in one anyio task group owned by the emulator: one task polls
the registry directory, one task per plugin socket registers it (retrying with backoff) and then
watches its connection and health stream; leaving the ``async with`` block stops them all.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import anyio
from anyio.abc import TaskGroup
from grpclib.client import Channel

from agent.node.types import ClaimRef
from agent.sim.allocation import ApiAccess, access_from_configuration
from agent.sim.claims import PodReference
from agent.sim.kubelet.dra_client import DEFAULT_CALL_TIMEOUT, DraClient
from agent.sim.kubelet.errors import (
    DraCallError,
    DriverNotRegisteredError,
    KubeletEmulatorError,
    RegistrationError,
)
from agent.sim.kubelet.events import ChangeNotifier, EventKind, EventLog, KubeletEvent
from agent.sim.kubelet.health import (
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_STREAM_RETRY_DELAY,
    DeviceHealthState,
    HealthCache,
    HealthReport,
    watch_health,
)
from agent.sim.kubelet.pods import ClaimSource, PodAdmissionError, PodClaims, admit, release
from agent.sim.kubelet.registration import PluginRegistration, RegistrationTimeouts, register_plugin
from agent.sim.kubelet.watcher import SocketIdentity, diff_scans, scan_registry
from agent.sim.kubelet.wipe import DEFAULT_WIPE_DELAY, SliceWiper


@dataclass
class PluginInstance:
    """One registered plugin instance (several exist for one driver during a rolling update)."""

    registration: PluginRegistration
    sequence: int
    channel: Channel
    client: DraClient
    #: None until the connection was first probed; counts as usable, like a connecting channel.
    connected: bool | None = None


class KubeletEmulator:
    """A 1.34+ kubelet's DRA side: ``async with KubeletEmulator(dir, node_name=...) as kubelet:``."""

    def __init__(
        self,
        registrar_dir: Path,
        *,
        node_name: str,
        kube_client_config: Any = None,
        poll_interval: float = 0.1,
        registration_timeouts: RegistrationTimeouts | None = None,
        backoff_initial: float = 0.5,
        backoff_cap: float = 120.0,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        health_timeout: float = DEFAULT_HEALTH_TIMEOUT,
        health_retry_delay: float = DEFAULT_STREAM_RETRY_DELAY,
        auto_wipe: bool = False,
        wipe_delay: float = DEFAULT_WIPE_DELAY,
        wipe_on_start: bool = False,
        api_access: ApiAccess | None = None,
    ) -> None:
        self.registrar_dir = Path(registrar_dir)
        self.node_name = node_name
        self._poll = poll_interval
        self._timeouts = registration_timeouts or RegistrationTimeouts()
        self._backoff_initial = backoff_initial
        self._backoff_cap = backoff_cap
        self._call_timeout = call_timeout
        self._health_retry_delay = health_retry_delay
        self._auto_wipe = auto_wipe
        self._wipe_delay = wipe_delay
        self._wipe_on_start = wipe_on_start
        self._notifier = ChangeNotifier()
        self._log = EventLog(self._notifier)
        self._health = HealthCache(default_timeout=health_timeout)
        self._wiper = SliceWiper(kube_client_config, node_name, self._log)
        if api_access is None and kube_client_config is not None:
            api_access = access_from_configuration(kube_client_config)
        #: where pods' claims are allocated (the API server of ``kube_client_config`` unless
        #: given); None: run_pod is refused
        self.api_access = api_access
        self._instances: dict[Path, PluginInstance] = {}
        self._sessions: dict[Path, anyio.CancelScope] = {}
        self._known_drivers: set[str] = set()
        self._sequence = 0
        self._stopping = False
        self._stack = contextlib.AsyncExitStack()

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self.registrar_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        async with contextlib.AsyncExitStack() as stack:
            task_group = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(self._stop, task_group)
            task_group.start_soon(self._watch_registry, task_group)
            if self._wipe_on_start:
                task_group.start_soon(self._wiper.wipe_with_retry, None)
            if self._auto_wipe:
                task_group.start_soon(
                    self._wiper.wipe_disconnected,
                    lambda: sorted(self._known_drivers),
                    self.is_connected,
                    self._wipe_delay,
                    self._poll,
                )
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._stack.__aexit__(exc_type, exc, tb)

    def _stop(self, task_group: TaskGroup) -> None:
        self._stopping = True
        task_group.cancel_scope.cancel()

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
                    path, self._timeouts, lambda reg: added.append(self._add_instance(path, reg))
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

    # -- DRA calls -------------------------------------------------------------------------------

    async def prepare(self, driver: str, claims: Sequence[ClaimRef]) -> dict[str, Any]:
        """NodePrepareResources on the chosen instance; v1 ``NodePrepareResourceResponse`` per
        claim UID. Raises DriverNotRegisteredError or a DraCallError subclass."""
        return await self._dra_call(driver, claims, prepare=True)

    async def unprepare(self, driver: str, claims: Sequence[ClaimRef]) -> dict[str, Any]:
        """NodeUnprepareResources on the chosen instance; v1 ``NodeUnprepareResourceResponse``
        per claim UID. Raises DriverNotRegisteredError or a DraCallError subclass."""
        return await self._dra_call(driver, claims, prepare=False)

    async def _dra_call(
        self, driver: str, claims: Sequence[ClaimRef], *, prepare: bool
    ) -> dict[str, Any]:
        instance = self._select(driver)
        socket = str(instance.registration.socket)
        client = instance.client
        try:
            results = await (client.prepare(claims) if prepare else client.unprepare(claims))
        except DraCallError as exc:
            self._log.record(
                EventKind.DRA_CALL_FAILED,
                str(exc),
                driver=driver,
                socket=socket,
                level=logging.WARNING,
            )
            raise
        errors = {uid: r.error for uid, r in results.items() if r.error}
        self._log.record(
            EventKind.PREPARED if prepare else EventKind.UNPREPARED,
            f"{'NodePrepareResources' if prepare else 'NodeUnprepareResources'} {driver} via "
            f"{client.service} claims={[c.uid for c in claims]} errors={errors}",
            driver=driver,
            socket=socket,
        )
        return results

    # -- pods ------------------------------------------------------------------------------------

    async def run_pod(
        self,
        pod: PodReference | str,
        claims: Sequence[ClaimSource],
        *,
        namespace: str = "default",
    ) -> PodClaims:
        """Start a pod that uses ``claims`` on this node, as scheduler and kubelet together:
        claims given as ResourceClaim manifests are created, claims without
        ``status.allocation`` are allocated here by the allocator (as kube-scheduler would),
        all are reserved for the pod, then each driver named in the allocations gets one
        NodePrepareResources with its claims. Returns the stored claims and every driver's
        answer (per-claim errors are in :meth:`PodClaims.errors`, not raised). Raises
        :class:`PodAdmissionError` when a claim cannot be created or does not fit the node,
        DriverNotRegisteredError or a DraCallError subclass as :meth:`prepare` does."""
        access = self._require_api()
        reference = PodReference(pod) if isinstance(pod, str) else pod
        try:
            admitted = await admit(access, self.node_name, reference, namespace, claims)
        except PodAdmissionError as exc:
            self._log.record(EventKind.POD_ADMISSION_FAILED, str(exc), level=logging.WARNING)
            raise
        devices = [
            f"{r['driver']}/{r['pool']}/{r['device']}"
            for c in admitted.claims
            for r in c["status"]["allocation"]["devices"]["results"]
        ]
        self._log.record(
            EventKind.POD_ADMITTED,
            f"pod {namespace}/{reference.name} admitted on {self.node_name}: claims "
            f"{[r.name for r in admitted.refs]} allocated to {devices}",
        )
        for driver, refs in admitted.drivers.items():
            admitted.results[driver] = await self.prepare(driver, refs)
        return admitted

    async def end_pod(self, pod: PodClaims, *, delete_claims: bool = False) -> dict[str, Any]:
        """The pod is gone: NodeUnprepareResources per driver, then its claims are released
        (unreserved and, without other consumers, deallocated, as the resourceclaim controller
        does) or, with ``delete_claims`` (claims from a ResourceClaimTemplate), deleted.
        Returns driver -> claim UID -> v1 ``NodeUnprepareResourceResponse``; a claim a driver
        failed to unprepare is neither released nor deleted (the kubelet retries)."""
        access = self._require_api()
        answers: dict[str, Any] = {}
        failed: set[str] = set()
        for driver, refs in pod.drivers.items():
            answers[driver] = await self.unprepare(driver, refs)
            failed |= {uid for uid, answer in answers[driver].items() if answer.error}
        done = PodClaims(
            pod.pod,
            pod.namespace,
            [c for c in pod.claims if c["metadata"]["uid"] not in failed],
            {},
        )
        await release(access, done, delete_claims=delete_claims)
        return answers

    def _require_api(self) -> ApiAccess:
        if self.api_access is None:
            raise KubeletEmulatorError(
                "running a pod needs the API server: give the emulator a kubeconfig "
                "(kube_client_config or api_access)"
            )
        return self.api_access

    # -- health ----------------------------------------------------------------------------------

    def health(self, driver: str, pool: str, device: str) -> DeviceHealthState:
        """The device's health as the kubelet sees it now (Unknown when stale or never seen)."""
        return self._health.health(driver, pool, device)

    def health_reports(self, driver: str | None = None) -> list[HealthReport]:
        """Every health message received, oldest first, with the emulator's receive time."""
        return [r for r in self._health.reports if driver is None or r.driver == driver]

    async def wait_health(
        self,
        driver: str,
        pool: str,
        device: str,
        state: DeviceHealthState,
        timeout: float = 10.0,  # noqa: ASYNC109
    ) -> None:
        """Wait until the device reads as ``state`` (staleness is re-checked as time passes)."""
        await self._notifier.wait_for(
            lambda: self.health(driver, pool, device) == state, timeout, poll=0.02
        )

    async def next_health_report(self, driver: str, timeout: float = 10.0) -> HealthReport:  # noqa: ASYNC109
        """Wait for the next health message of ``driver`` received after this call."""
        seen = len(self.health_reports(driver))
        await self._notifier.wait_for(lambda: len(self.health_reports(driver)) > seen, timeout)
        return self.health_reports(driver)[seen]

    # -- events ----------------------------------------------------------------------------------

    def events(
        self, kind: EventKind | None = None, driver: str | None = None
    ) -> list[KubeletEvent]:
        """What the emulator did, oldest first."""
        return self._log.events(kind, driver)

    async def wait_event(
        self,
        kind: EventKind,
        driver: str | None = None,
        *,
        count: int = 1,
        timeout: float = 10.0,  # noqa: ASYNC109
    ) -> KubeletEvent:
        """Wait until at least ``count`` events of ``kind`` were recorded; returns the last."""
        await self._notifier.wait_for(lambda: len(self.events(kind, driver)) >= count, timeout)
        return self.events(kind, driver)[-1]

    # -- slice wiping ----------------------------------------------------------------------------

    async def wipe_slices(self, driver: str) -> None:
        """Delete this node's ResourceSlices of ``driver`` with one DeleteCollection, as the
        kubelet does. Raises SliceWipeError."""
        await self._wiper.wipe(driver)
