"""The NVML event pump: one event set, a blocking wait in a thread of its own, HealthEvents out.

``nvmlEventSetWait_v2`` blocks until an event arrives or its timeout passes. Run through the
shared NVML limiter it would hold every other NVML call (prepares, recovery polls) hostage, so the
pump has a limiter of its own. Its event set is freed (and NVML shut down) only after the wait
in progress returns, so a stopping pump cannot abandon it; the wait is therefore made of NVML
waits of at most 0.1 s, and a cancelled pump tells its thread to stop between two of them: a
stop takes at most 0.1 s instead of the whole wait (0.5 s: every agent's SIGTERM took that much
longer), while the event loop still wakes up only twice a second when nothing happens. After
the first event of a wakeup the pump drains what else is pending without waiting, so an event
storm reaches the health state machine in a few large batches, not one hop per event.

A GPU whose registration fails is reported ``UNMONITORED``, never skipped silently, and its
registration is retried into the same event set on a timer with exponential backoff (1 s doubling
to 60 s by default), so it becomes ``MONITORED`` again (and loses its taint) as soon as NVML lets
it register, without waiting for the set to be rebuilt for another reason. A GPU that does not
report XID events at all is not retried: that is what it is, not a failure. When the wait
answers GPU_IS_LOST (or an event's device cannot be read) the pump probes every watched GPU,
reports the ones that no longer answer as ``GPU_LOST`` and builds a fresh event set without them:
a set keeps answering GPU_IS_LOST while it holds a lost GPU, and NVML cannot unregister one. A GPU
that comes back is added again by :meth:`EventPump.rearm` (the health monitor polls lost GPUs).
Builds are at least a second apart, so a failing NVML cannot turn the pump into a busy loop; the
price is that events still queued in a set being replaced are dropped (the set holds a lost GPU
and answers GPU_IS_LOST before anything else).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import pynvml

from agent.hardware.health_events import EventKind, HealthEvent

log = logging.getLogger(__name__)

WANTED_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeSingleBitEccError
)
NO_INSTANCE = 0xFFFFFFFF
#: How long the pump's thread waits for events before the loop looks at rebuilds and retries.
DEFAULT_WAIT_TIMEOUT = 0.5
#: Longest single NVML wait: a stopping pump's thread notices the stop within this.
STOP_CHECK_S = 0.1
#: Most events taken from NVML per wakeup; the rest follow in the next batch.
DEFAULT_MAX_BATCH = 4096
#: Least time between two event set builds: a failing NVML must not turn the pump into a busy loop.
DEFAULT_REBUILD_INTERVAL = 1.0
#: First retry of a failed registration (or event set creation), doubling up to the maximum.
DEFAULT_RETRY_INITIAL = 1.0
DEFAULT_RETRY_MAX = 60.0

EventSink = Callable[[Sequence[HealthEvent]], None]


@dataclass(frozen=True, slots=True)
class WatchedGpu:
    index: int
    uuid: str


class EventPump:
    """``await pump.run(sink)``: calls ``sink(events)`` on the event loop for every batch."""

    def __init__(
        self,
        gpus: Sequence[WatchedGpu],
        *,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
        max_batch: int = DEFAULT_MAX_BATCH,
        rebuild_interval: float = DEFAULT_REBUILD_INTERVAL,
        retry_initial: float = DEFAULT_RETRY_INITIAL,
        retry_max: float = DEFAULT_RETRY_MAX,
    ) -> None:
        if not 0 < retry_initial <= retry_max:
            raise ValueError(
                f"retry_initial ({retry_initial}) must be > 0 and <= retry_max ({retry_max})"
            )
        self._gpus = {g.uuid: g for g in gpus}
        self._wait_ms = max(1, int(wait_timeout * 1000))
        self._slice_ms = min(self._wait_ms, int(STOP_CHECK_S * 1000))
        self._stopping = threading.Event()  # set by a cancelled pump: its thread returns
        self._wait_done = threading.Event()  # the thread's wait has returned
        self._max_batch = max_batch
        self._limiter = anyio.CapacityLimiter(1)
        self._event_set: Any = None
        self._handles: dict[int, str] = {}  # device pointer value -> GPU UUID
        self._watched: set[str] = set()
        self._excluded: set[str] = set()  # lost GPUs, left out until rearmed
        self._rebuild = True
        self._rebuild_interval = rebuild_interval
        self._built_at: float | None = None
        self._failed: set[str] = set()  # registration failed: retried into the current set
        self._retry = (retry_initial, retry_max)
        self._retry_delay = retry_initial
        self._retry_at: float | None = None
        #: Batches handed to the sink and events in them (for tests and benchmarks).
        self.batches = 0
        self.events = 0

    @property
    def watched(self) -> frozenset[str]:
        """UUIDs of the GPUs whose events are registered now."""
        return frozenset(self._watched)

    def rearm(self, uuid: str) -> None:
        """Watch a GPU again (it answers NVML again); takes effect within one wait timeout."""
        if uuid in self._excluded:
            self._excluded.discard(uuid)
            self._rebuild = True

    async def run(self, sink: EventSink) -> None:
        try:
            while True:
                if self._rebuild:
                    await self._pace_rebuild()
                    self._rebuild = False
                    self._deliver(sink, await self._in_thread(self._build_set))
                    self._schedule_retry(reset=True)
                if self._event_set is None:  # NVML could not create one: try again later
                    await anyio.sleep(max(0.0, (self._retry_at or 0.0) - anyio.current_time()))
                    self._rebuild = True
                    continue
                batch = await self._wait_in_thread()
                self._deliver(sink, batch)
                if self._failed and not self._rebuild and self._retry_due_now():
                    self._deliver(sink, await self._in_thread(self._retry_failed))
                    self._schedule_retry(reset=False)
        finally:
            with anyio.CancelScope(shield=True):
                await self._in_thread(self._free_set)

    async def _pace_rebuild(self) -> None:
        now = anyio.current_time()
        if self._built_at is not None:
            await anyio.sleep(max(0.0, self._built_at + self._rebuild_interval - now))
        self._built_at = anyio.current_time()

    def _schedule_retry(self, *, reset: bool) -> None:
        """After a build (``reset``) or a retry: when to try the failed registrations again."""
        if not (self._failed or self._event_set is None):
            self._retry_delay, self._retry_at = self._retry[0], None
            return
        if reset and self._event_set is not None:
            self._retry_delay = self._retry[0]
        self._retry_at = anyio.current_time() + self._retry_delay
        self._retry_delay = min(self._retry_delay * 2, self._retry[1])

    def _retry_due_now(self) -> bool:
        return self._retry_at is not None and anyio.current_time() >= self._retry_at

    def _deliver(self, sink: EventSink, events: list[HealthEvent]) -> None:
        if events:
            self.batches += 1
            self.events += len(events)
            sink(events)

    async def _in_thread(self, fn: Callable[[], Any]) -> Any:
        return await anyio.to_thread.run_sync(fn, limiter=self._limiter)

    async def _wait_in_thread(self) -> list[HealthEvent]:
        """The wait, which a cancellation stops within ``STOP_CHECK_S`` (module docstring):
        the caller leaves once the thread has returned, never while it still waits."""
        self._stopping.clear()
        self._wait_done.clear()
        try:
            batch: list[HealthEvent] = await anyio.to_thread.run_sync(
                self._wait_batch, limiter=self._limiter, abandon_on_cancel=True
            )
        except anyio.get_cancelled_exc_class():
            self._stopping.set()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._wait_done.wait, 2 * STOP_CHECK_S + 1.0)
            raise
        return batch

    # -- in the pump's thread ------------------------------------------------------------------

    def _build_set(self) -> list[HealthEvent]:
        """A new event set with every GPU not excluded; frees the old one."""
        self._free_set()
        self._handles.clear()
        self._watched.clear()
        self._failed.clear()
        try:
            self._event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as err:
            log.warning("cannot create an NVML event set (%s); no GPU is watched", err)
            detail = f"NVML could not create an event set: {err}"
            return [
                HealthEvent(g.uuid, EventKind.UNMONITORED, detail=detail)
                for g in self._gpus.values()
                if g.uuid not in self._excluded
            ]
        events = []
        for gpu in self._gpus.values():
            if gpu.uuid in self._excluded:
                continue
            event = self._register(gpu)
            events.append(event)
        return events

    def _retry_failed(self) -> list[HealthEvent]:
        """Register the GPUs whose registration failed into the current set, once more."""
        if self._event_set is None:
            return []
        events = [self._register(self._gpus[uuid]) for uuid in sorted(self._failed)]
        for event in events:
            if event.kind is EventKind.MONITORED:
                log.info("GPU %s is watched for health events again", event.gpu_uuid)
        return events

    def _register(self, gpu: WatchedGpu) -> HealthEvent:
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
            mask = WANTED_EVENTS & supported
            if not mask & pynvml.nvmlEventTypeXidCriticalError:
                self._failed.discard(gpu.uuid)  # a property of the GPU: retrying cannot help
                return HealthEvent(
                    gpu.uuid, EventKind.UNMONITORED, detail="the GPU does not report XID events"
                )
            pynvml.nvmlDeviceRegisterEvents(handle, mask, self._event_set)
        except pynvml.NVMLError as err:
            if err.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                self._failed.discard(gpu.uuid)
                self._excluded.add(gpu.uuid)
                return HealthEvent(gpu.uuid, EventKind.GPU_LOST, detail="while registering events")
            if gpu.uuid not in self._failed:
                log.warning(
                    "cannot watch GPU %d (%s) for health events: %s; retrying with backoff",
                    gpu.index,
                    gpu.uuid,
                    err,
                )
            self._failed.add(gpu.uuid)
            return HealthEvent(gpu.uuid, EventKind.UNMONITORED, detail=f"NVML: {err}")
        self._failed.discard(gpu.uuid)
        self._handles[_pointer(handle)] = gpu.uuid
        self._watched.add(gpu.uuid)
        return HealthEvent(gpu.uuid, EventKind.MONITORED)

    def _wait_batch(self) -> list[HealthEvent]:
        try:
            return self._wait_slices()
        finally:
            self._wait_done.set()

    def _wait_slices(self) -> list[HealthEvent]:
        """Up to ``wait_timeout`` for the first event, in NVML waits of at most
        ``STOP_CHECK_S`` (returning early when the pump stops), then what is pending."""
        if self._event_set is None:
            return []
        events: list[HealthEvent] = []
        remaining = self._wait_ms
        while len(events) < self._max_batch:
            step = min(remaining, self._slice_ms)
            try:
                data = pynvml.nvmlEventSetWait_v2(self._event_set, step)
            except pynvml.NVMLError as err:
                if err.value == pynvml.NVML_ERROR_TIMEOUT:
                    remaining -= step
                    if events or remaining <= 0 or self._stopping.is_set():
                        return events
                    continue
                if err.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                    return events + self._find_lost("the event wait answered GPU_IS_LOST")
                log.warning("NVML event wait failed (%s); building a new event set", err)
                self._rebuild = True
                return events
            remaining = 0  # drain what is pending, without waiting
            event = self._convert(data)
            if event is None:
                return events + self._find_lost("an event's GPU could not be read")
            events.append(event)
        return events

    def _convert(self, data: Any) -> HealthEvent | None:
        uuid = self._handles.get(_pointer(data.device))
        if uuid is None:
            try:
                uuid = pynvml.nvmlDeviceGetUUID(data.device)
            except pynvml.NVMLError:
                return None
            if uuid not in self._gpus:
                return None
        gi = None if data.gpuInstanceId == NO_INSTANCE else int(data.gpuInstanceId)
        ci = None if data.computeInstanceId == NO_INSTANCE else int(data.computeInstanceId)
        event_type = int(data.eventType)
        if event_type & pynvml.nvmlEventTypeXidCriticalError:
            return HealthEvent(uuid, EventKind.XID, int(data.eventData), gi, ci)
        if event_type & pynvml.nvmlEventTypeDoubleBitEccError:
            return HealthEvent(uuid, EventKind.ECC_DOUBLE_BIT, 0, gi, ci)
        return HealthEvent(uuid, EventKind.ECC_SINGLE_BIT, 0, gi, ci)

    def _find_lost(self, why: str) -> list[HealthEvent]:
        """Probe every watched GPU; report and exclude those that no longer answer."""
        lost = []
        for uuid in sorted(self._watched):
            try:
                pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByUUID(uuid))
            except pynvml.NVMLError as err:
                self._excluded.add(uuid)
                lost.append(HealthEvent(uuid, EventKind.GPU_LOST, detail=f"{why}; probe: {err}"))
        if not lost:
            log.warning("%s, but every GPU answers; building a new event set", why)
        self._rebuild = True
        return lost

    def _free_set(self) -> None:
        event_set, self._event_set = self._event_set, None
        if event_set is not None:
            try:
                pynvml.nvmlEventSetFree(event_set)
            except pynvml.NVMLError as err:
                log.debug("freeing the NVML event set failed: %s", err)


def _pointer(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0
