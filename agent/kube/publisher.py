"""The ResourceSlice publisher: this node's devices in the API server, repaired within seconds.

The scheduler allocates only what the agent publishes, and the slices get lost in ordinary
operation: the kubelet wipes them at its start and when the plugin looks gone, someone runs
``kubectl delete``, the API server restarts or throttles. The Go ``resourceslice`` controller
reacts to such a change only after a 30 s delay (kubelet-dra-protocol.md §6), during which
pods cannot be scheduled on the node (user-pain.md items 4-5). This reconcile loop reacts
to every change of its slices at once, with a short window that merges a burst of events or
:meth:`SlicePublisher.set_devices` calls into one pass of writes.

One pass: build the desired slices from the devices (:mod:`agent.dra.slices`), compare them
with the watched ones (:mod:`agent.kube.slicewatch`), decide the writes and the pool
generation (:mod:`agent.kube.sliceplan`), then delete, update and create in that order. A
failed pass is retried with bounded, jittered backoff that honours ``Retry-After``. Writes
feed their results back into the cache, so the next pass sees them at once, and every write
result is checked for fields the API server dropped (:mod:`agent.kube.dropped`). On
cancellation the slices stay where they are: a restarted agent adopts them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from agent.crash import crash_point
from agent.dra.model import CounterSet, DraDevice
from agent.dra.order import DeviceOrder
from agent.dra.slices import SliceLayout, build_slices, pool_layout
from agent.kube.backoff import Backoff, is_transient, retry_after
from agent.kube.dropped import StoredVersions
from agent.kube.nodewatch import NodeWatcher
from agent.kube.rawapi import ApiStatusError, RawSliceApi
from agent.kube.sliceplan import SlicePlan, plan_pool
from agent.kube.slicewatch import SliceWatcher, resource_version
from agent.telemetry.metrics import SLICE_PUBLISH_ERRORS, SLICE_WRITES, add, slice_writes_at_zero
from agent.telemetry.tracing import current_causes, link_to, tracer

Obj = dict[str, Any]
log = logging.getLogger(__name__)


@dataclass
class PublisherStats:
    """What this publisher did since it was created (for tests, benchmarks and logs)."""

    passes: int = 0
    creates: int = 0
    updates: int = 0
    deletes: int = 0
    errors: int = 0
    generation: int = 0

    @property
    def writes(self) -> int:
        return self.creates + self.updates + self.deletes


class SlicePublisher:
    """Keeps this node's ResourceSlices of one driver equal to the devices it is given.

    Call :meth:`set_devices` (from the event loop; any number of times, before or after
    :meth:`run` started) and run :meth:`run` in a task group until shutdown. Nothing is
    published before the first :meth:`set_devices`.

    ``coalesce_window`` is how long a pass waits after a :meth:`set_devices` call for more
    of the same burst; ``event_window`` the same for watch events (a wipe's deletions arrive
    together, so it is short). ``resync_interval`` is the slow periodic re-list; failed passes
    are retried after ``retry_initial`` doubling up to ``retry_max`` seconds, jittered.
    ``slice_layout`` places counter sets (``--dynamic-mig``): ``combined`` for a 1.34 API
    server, ``split`` for 1.35+ (:mod:`agent.dra.slices`). ``device_order`` is the order the
    devices are listed in, which kube-scheduler's first fit follows (:mod:`agent.dra.order`).
    """

    def __init__(
        self,
        api_client: Any,
        *,
        node_name: str,
        driver_name: str,
        node_uid: str | None = None,
        resync_interval: float = 300.0,
        coalesce_window: float = 0.05,
        event_window: float = 0.005,
        request_timeout: float = 10.0,
        retry_initial: float = 0.05,
        retry_max: float = 4.0,
        watch_timeout: int = 240,
        slice_layout: SliceLayout = "split",
        device_order: DeviceOrder = "names",
    ) -> None:
        # validates the names, the layout and the order
        build_slices(
            (),
            node_name=node_name,
            driver_name=driver_name,
            slice_layout=slice_layout,
            device_order=device_order,
        )
        self.node_name = node_name
        self.slice_layout: SliceLayout = slice_layout
        self.device_order: DeviceOrder = device_order
        self.driver_name = driver_name
        slice_writes_at_zero(driver_name)
        self.field_selector = f"spec.nodeName={node_name},spec.driver={driver_name}"
        self.stats = PublisherStats()
        self._api = RawSliceApi(api_client, request_timeout=request_timeout)
        self._retry = (retry_initial, retry_max)
        self._watcher = SliceWatcher(
            self._api,
            self.field_selector,
            on_change=self._slices_changed,
            resync_interval=resync_interval,
            watch_timeout=watch_timeout,
            backoff=Backoff(initial=retry_initial, maximum=retry_max),
        )
        self._coalesce_window = coalesce_window
        self._event_window = event_window
        self._due: float | None = None
        self._node_uid = node_uid
        #: Follows the Node's uid: a recreated Node gets its slices re-owned within one pass.
        self._node_watcher = NodeWatcher(
            self._api,
            node_name,
            on_uid=self._node_uid_changed,
            uid=node_uid,
            watch_timeout=watch_timeout,
            backoff=Backoff(initial=retry_initial, maximum=retry_max),
        )
        self._devices: tuple[DraDevice, ...] | None = None
        self._counter_sets: tuple[CounterSet, ...] = ()
        self._dirty = False
        self._wake: anyio.Event | None = None
        self._converged = False
        self._changed: anyio.Event | None = None
        self._generation_floor = 0
        self._stored = StoredVersions()  # what the server dropped, accepted (kube/dropped)
        self._causes: list[trace.Link] = []  # span links of the next publish

    # -- public API ------------------------------------------------------------------------

    def set_devices(
        self, devices: Sequence[DraDevice], counter_sets: Sequence[CounterSet] = ()
    ) -> None:
        """Publish ``devices`` and the ``counter_sets`` they consume from now on (replacing
        the previous ones).

        Validates at once (duplicate names raise :class:`agent.dra.DuplicateDeviceError`, a
        layout beyond the API's limits :class:`agent.dra.LimitExceededError`); the writes
        happen in :meth:`run`, merged with other calls of the same burst.
        """
        chosen, sets = tuple(devices), tuple(counter_sets)
        pool_layout(chosen, sets, self.slice_layout, self.device_order)
        self._devices, self._counter_sets = chosen, sets
        self._causes = link_to([*self._causes, *current_causes()])[-32:]
        self._trigger(self._coalesce_window)

    @property
    def converged(self) -> bool:
        """Whether the API server held exactly the desired slices at the last check."""
        return self._converged

    async def wait_converged(self) -> None:
        """Return once the desired slices are published (the readiness signal).

        Bound the wait with a cancel scope: ``with anyio.fail_after(10): ...``.
        """
        while not self._converged:
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    async def run(self) -> None:
        """Watch and reconcile until cancelled; the slices are left in place on exit."""
        async with anyio.create_task_group() as group:
            group.start_soon(self._watcher.run)
            group.start_soon(self._node_watcher.run)
            await self._reconcile_loop()

    # -- the loop --------------------------------------------------------------------------

    def _slices_changed(self) -> None:
        self._trigger(self._event_window)

    def _node_uid_changed(self, uid: str) -> None:
        """The Node was (re)created: the slices' ownerReferences must name its new uid."""
        if uid != self._node_uid:
            self._node_uid = uid
            self._trigger(self._event_window)

    def _trigger(self, window: float) -> None:
        """Ask for a pass at most ``window`` seconds from now; later triggers join it."""
        due = time.monotonic() + window
        self._due = due if self._due is None else min(self._due, due)
        self._dirty = True
        self._set_converged(False)
        if self._wake is not None:
            self._wake.set()

    def _set_converged(self, value: bool) -> None:
        self._converged = value
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _reconcile_loop(self) -> None:
        backoff = Backoff(initial=self._retry[0], maximum=self._retry[1])
        verify = False  # after writes, check again at once instead of waiting for a burst
        while True:
            while not self._dirty:
                self._wake = anyio.Event()
                await self._wake.wait()
            if not verify and self._due is not None:
                await anyio.sleep(max(0.0, self._due - time.monotonic()))
            self._dirty = False
            self._due = None
            verify = False
            if self._devices is None or not self._watcher.synced:
                continue  # set_devices() and the first LIST both trigger again
            try:
                wrote = await self._reconcile_once(self._devices)
            except Exception as error:
                self.stats.errors += 1
                reason = (
                    str(error.code) if isinstance(error, ApiStatusError) else type(error).__name__
                )
                add(SLICE_PUBLISH_ERRORS, 1, driver=self.driver_name, reason=reason)
                delay = backoff.next_delay(retry_after(error))
                if is_transient(error):
                    log.warning(
                        "publishing ResourceSlices failed: %r; retrying in %.2f s", error, delay
                    )
                else:  # our request is wrong, or RBAC/admission refuses it: retry slowly
                    delay = max(delay, self._retry[1])
                    log.error(
                        "publishing ResourceSlices failed: %r; check the agent's RBAC "
                        "(resourceslices create/update/delete, nodes get/list/watch) and admission "
                        "policies; retrying in %.2f s",
                        error,
                        delay,
                    )
                self._dirty = True
                await anyio.sleep(delay)
                continue
            backoff.reset()
            if wrote:
                self._dirty = verify = True
            elif not self._dirty:
                self._set_converged(True)

    async def _reconcile_once(self, devices: tuple[DraDevice, ...]) -> bool:
        """One pass; returns whether it wrote anything."""
        self.stats.passes += 1
        if self._node_uid is None:
            self._node_uid = await self._api.read_node_uid(self.node_name)
        desired = build_slices(
            devices,
            node_name=self.node_name,
            driver_name=self.driver_name,
            node_uid=self._node_uid,
            counter_sets=self._counter_sets,
            slice_layout=self.slice_layout,
            device_order=self.device_order,
        )
        plan = plan_pool(
            desired,
            self._watcher.cache.snapshot(),
            pool_name=self.node_name,
            generation_floor=self._generation_floor,
            accepted=self._stored.accepted,
        )
        if plan.empty:
            self.stats.generation = max(self.stats.generation, plan.generation)
            return False
        await self._apply(plan)
        return True

    async def _apply(self, plan: SlicePlan) -> None:
        done = {"create": 0, "update": 0, "delete": 0}
        links, self._causes = self._causes, []
        # A trace of its own, linked to what asked for it (a health transition, say).
        with tracer().start_as_current_span(
            "resourceslice.publish", context=otel_context.Context(), links=links
        ) as span:
            span.set_attribute("k8s.node.name", self.node_name)
            span.set_attribute("dra.driver", self.driver_name)
            span.set_attribute("resourceslice.pool.generation", plan.generation)
            try:
                for obj in plan.deletes:
                    with _write_span("delete", obj):
                        await self._delete(obj)
                    done["delete"] += 1
                    crash_point("slice-publish-after-write", "delete")
                for body, have in plan.updates:
                    with _write_span("update", body):
                        await self._update(body, have)
                    done["update"] += 1
                    crash_point("slice-publish-after-write", "update")
                for body in plan.creates:
                    with _write_span("create", body):
                        await self._create(body)
                    done["create"] += 1
                    crash_point("slice-publish-after-write", "create")
            finally:
                span.set_attribute("resourceslice.deleted", done["delete"])
                span.set_attribute("resourceslice.updated", done["update"])
                span.set_attribute("resourceslice.created", done["create"])
        self._generation_floor = max(self._generation_floor, plan.generation)
        self.stats.generation = plan.generation
        log.info(
            "published ResourceSlices of %s on %s: generation %d, %d created, %d updated, "
            "%d deleted",
            self.driver_name,
            self.node_name,
            plan.generation,
            done["create"],
            done["update"],
            done["delete"],
        )

    # -- the writes ------------------------------------------------------------------------

    async def _create(self, body: Obj) -> None:
        stored = await self._api.create(body)
        self._count("create")
        self._stored.check(body, stored)
        self._watcher.cache.apply("ADDED", stored)

    async def _update(self, body: Obj, have: Obj) -> None:
        name = str(body["metadata"]["name"])
        try:
            stored = await self._api.replace(name, body)
        except ApiStatusError as error:
            if error.code in (404, 409):
                await self._refresh(name)
            raise
        self._count("update")
        self._stored.check(body, stored)
        self._watcher.cache.apply("MODIFIED", stored)

    async def _delete(self, obj: Obj) -> None:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name"))
        try:
            await self._api.delete(
                name,
                uid=str(meta.get("uid", "")),
                resource_version=str(meta.get("resourceVersion", "")),
            )
        except ApiStatusError as error:
            if error.code == 404:
                self._watcher.cache.forget(name, resource_version(obj))
                return
            if error.code == 409:
                await self._refresh(name)
            raise
        self._count("delete")
        self._stored.forget(name)
        self._watcher.cache.forget(name, resource_version(obj))

    async def _refresh(self, name: str) -> None:
        """After a conflict: read the current object, so the retry starts from it."""
        try:
            current = await self._api.read(name)
        except ApiStatusError as error:
            if error.code == 404:
                self._watcher.cache.forget(name, None)
            return
        current.setdefault("apiVersion", "resource.k8s.io/v1")
        current.setdefault("kind", "ResourceSlice")
        self._watcher.cache.apply("MODIFIED", current)

    def _count(self, verb: str) -> None:
        add(SLICE_WRITES, 1, driver=self.driver_name, verb=verb)
        if verb == "create":
            self.stats.creates += 1
        elif verb == "update":
            self.stats.updates += 1
        else:
            self.stats.deletes += 1


def _write_span(verb: str, obj: Obj) -> Any:
    """The client span of one ResourceSlice write (``resourceslice.<verb>``)."""
    name = str(obj.get("metadata", {}).get("name", ""))
    return tracer().start_as_current_span(
        f"resourceslice.{verb}", kind=SpanKind.CLIENT, attributes={"k8s.resourceslice.name": name}
    )
