"""The kubelet emulator: the kubelet's DRA plugin handling, in-process, over real gRPC sockets.

Integration tests and the demo need a kubelet that registers the agent, prepares and unprepares
claims, reads its health stream and wipes its slices, with the 1.34+ kubelet's rules and deadlines,
without a cluster. Everything runs in one anyio task group owned by the emulator: one task polls
the registry directory, one task per plugin socket registers it (retrying with backoff) and then
watches its connection and health stream (``sessions.py``); leaving the ``async with`` block
stops them all. ``health_services`` says which health services the emulated kubelet consumes:
both, v1 first, by default (1.37); ``KUBELET_1_36_HEALTH_SERVICES`` for 1.34-1.36 (v1alpha1).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import anyio
from anyio.abc import TaskGroup

from agent.node.types import ClaimRef
from agent.sim.allocation import ApiAccess, access_from_configuration
from agent.sim.binding import needs_binding
from agent.sim.binding_flag import DEFAULT_BINDING_TIMEOUT_S
from agent.sim.claims import PodReference
from agent.sim.kubelet.dra_client import DEFAULT_CALL_TIMEOUT
from agent.sim.kubelet.errors import DraCallError, KubeletEmulatorError
from agent.sim.kubelet.events import ChangeNotifier, EventKind, EventLog, KubeletEvent
from agent.sim.kubelet.health import (
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_STREAM_RETRY_DELAY,
    DeviceHealthState,
    HealthCache,
    HealthReport,
)
from agent.sim.kubelet.pods import (
    ClaimSource,
    PodAdmissionError,
    PodClaims,
    admit,
    prebind,
    release,
)
from agent.sim.kubelet.registration import SUPPORTED_HEALTH_SERVICES, RegistrationTimeouts
from agent.sim.kubelet.sessions import PluginInstance, PluginSessions
from agent.sim.kubelet.wipe import DEFAULT_WIPE_DELAY, SliceWiper


class KubeletEmulator(PluginSessions):
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
        health_services: Sequence[str] = SUPPORTED_HEALTH_SERVICES,
    ) -> None:
        self.registrar_dir = Path(registrar_dir)
        self.node_name = node_name
        self._poll = poll_interval
        self._timeouts = registration_timeouts or RegistrationTimeouts()
        self._backoff_initial = backoff_initial
        self._backoff_cap = backoff_cap
        self._call_timeout = call_timeout
        self._health_retry_delay = health_retry_delay
        #: the health services this kubelet consumes, best first (1.36: v1alpha1 only)
        self._health_services = tuple(health_services)
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
        binding_timeout_s: float = DEFAULT_BINDING_TIMEOUT_S,
    ) -> PodClaims:
        """Start a pod that uses ``claims`` on this node, as scheduler and kubelet together:
        claims given as ResourceClaim manifests are created, claims without
        ``status.allocation`` are allocated here by the allocator (as kube-scheduler would),
        all are reserved for the pod, the pod waits in PreBind for claims whose devices have
        binding conditions (1.36+; :class:`PodBindingError` after their failure or
        ``binding_timeout_s``, the claims given back), then each driver named in the
        allocations gets one NodePrepareResources with its claims. Returns the stored claims and every driver's
        answer (per-claim errors are in :meth:`PodClaims.errors`, not raised). Raises
        :class:`PodAdmissionError` when a claim cannot be created or does not fit the node,
        DriverNotRegisteredError or a DraCallError subclass as :meth:`prepare` does."""
        access = self._require_api()
        reference = PodReference(pod) if isinstance(pod, str) else pod
        try:
            admitted = await admit(access, self.node_name, reference, namespace, claims)
            if any(needs_binding(c) for c in admitted.claims):
                self._log.record(
                    EventKind.POD_PREBIND,
                    f"pod {namespace}/{reference.name} waits in PreBind on {self.node_name} "
                    "for the binding conditions of claims "
                    f"{[c['metadata']['name'] for c in admitted.claims if needs_binding(c)]}",
                )
                admitted = await prebind(access, admitted, binding_timeout_s=binding_timeout_s)
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
