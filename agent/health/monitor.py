"""The health monitor: runs the event pump and the recovery polls, and applies every transition.

This is the edge around the pure :class:`~agent.health.state.HealthStateMachine`. Inputs: event
batches from the pump, and a poll every ``recovery_poll_seconds`` that asks NVML whether lost
GPUs answer again and whether GPUs with a reset-needing fault still have a recovery action
pending. Outputs of a batch with transitions, in order of latency: the health stream (the hub
hands the new list to every stream at once), the ResourceSlice taints (the publisher merges a
burst into one write), and per changed condition a log line, a ``gpu.health.transition`` span and
a Node Event. Each transition's span starts a trace of its own, and the slice publish it asks
for links to it (the publish is a trace of its own too). A storm is coalesced at each step: repeats do not transition, a batch's transitions
of one condition produce one log line, span and Event, and Events go through a bounded queue
(dropped and counted when full: they are best-effort, the taints and the stream are not).

With ``--dynamic-mig`` the GPU-instance id in an event of a partitionable GPU says nothing by
itself (ids are handed out as instances are created): such events wait for the GPU's live MIG
layout (``hardware.mig_ops.read_layout``, read once per GPU for all the events that arrived
meanwhile), which maps the instance to the placement device it occupies. An instance gone by
then cannot be named, and its event counts for the whole GPU (the safe side).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pynvml
from opentelemetry import context as otel_context
from opentelemetry import trace

from agent.dra import build_device_set
from agent.dra.names import mig_device_name
from agent.dra.partitionable import DynamicMig
from agent.dra.share_mode import SharesMode
from agent.hardware.events import EventPump
from agent.hardware.health_events import EventKind, HealthEvent
from agent.hardware.inventory import Inventory
from agent.hardware.mig_ops import MigLayout, read_layout
from agent.hardware.nvml import Nvml
from agent.health.policy import HealthPolicy
from agent.health.records import Transition, device_map
from agent.health.state import HealthStateMachine
from agent.health.stream import HealthHub
from agent.kube.interfaces import DevicePublisher, EventPoster
from agent.telemetry.tracing import caused_by, tracer

log = logging.getLogger(__name__)

EVENT_QUEUE_SIZE = 64


class HealthMonitor:
    """``await monitor.run()`` in the supervisor's task group, until cancelled."""

    def __init__(
        self,
        *,
        nvml: Nvml,
        inventory: Inventory,
        policy: HealthPolicy,
        publisher: DevicePublisher,
        hub: HealthHub,
        events: EventPoster,
        pump: EventPump,
        clock: Callable[[], float] = time.time,
        dynamic_mig: DynamicMig | None = None,
        shares: SharesMode | None = None,
    ) -> None:
        self._dynamic_mig = dynamic_mig
        self._shares = shares  # --consumable-shares: republished devices keep their policies
        self.machine = HealthStateMachine(policy, device_map(inventory, dynamic_mig))
        self.policy = policy
        self.hub = hub
        self.pump = pump
        self.dropped_events = 0
        self.transitions = 0
        self._nvml = nvml
        self._inventory = inventory
        self._publisher = publisher
        self._events = events
        self._clock = clock
        self._outbox, self._inbox = anyio.create_memory_object_stream[
            tuple[str, str, str, otel_context.Context]
        ](EVENT_QUEUE_SIZE)
        #: Events of MIG instances on partitionable GPUs, waiting for the live layout (a dict:
        #: ordered, and a storm of one event is one entry).
        self._unresolved: dict[HealthEvent, None] = {}
        self._resolve_wake = anyio.Event()
        self.layout_reads = 0
        hub.publish(self.machine.statuses())

    async def run(self) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(self._post_events)
            group.start_soon(self._poll_loop)
            group.start_soon(self._resolve_loop)
            await self.pump.run(self.handle)

    def set_unmonitored_effect(self, effect: str) -> None:
        """The API server's version is known: the ``unmonitored`` taint's effect it accepts,
        for the taints held (republished if one changed) and those to come."""
        if self.machine.set_unmonitored_effect(effect):
            self.hub.publish(self.machine.statuses())
            self._publish()
        self.policy = self.machine.policy

    def set_inventory(self, inventory: Inventory) -> None:
        """Follow a hardware change (MIG devices created or destroyed): conditions stay with
        their GPU, and the taints and the health list are republished for the new devices."""
        self._inventory = inventory
        self.machine.gpus = device_map(inventory, self._dynamic_mig)
        self.hub.publish(self.machine.statuses())
        self._publish()

    def _publish(self) -> None:
        device_set = build_device_set(
            self._inventory,
            taints=self.machine.taints(),
            dynamic_mig=self._dynamic_mig,
            shares=self._shares,
        )
        if device_set.counter_sets:
            self._publisher.set_devices(device_set.devices, device_set.counter_sets)
        else:
            self._publisher.set_devices(device_set.devices)

    def handle(self, events: Sequence[HealthEvent]) -> None:
        """Apply a batch of events (from the pump or a poll) now; those of MIG instances on
        partitionable GPUs once their GPU's layout is read (:meth:`_resolve_loop`)."""
        now: list[HealthEvent] = []
        for event in events:
            gpu = self.machine.gpus.get(event.gpu_uuid)
            if gpu is not None and gpu.partitionable and event.gpu_instance_id is not None:
                self._unresolved[event] = None
                self._resolve_wake.set()
            else:
                now.append(event)
        if now:
            self.apply(self.machine.observe(now, self._clock()))

    async def _resolve_loop(self) -> None:
        while True:
            await self._resolve_wake.wait()
            self._resolve_wake = anyio.Event()
            await self.resolve_pending()

    async def resolve_pending(self) -> None:
        """Read the live layout of every GPU with waiting events, then apply them."""
        events, self._unresolved = list(self._unresolved), {}
        if not events:
            return
        for uuid in dict.fromkeys(event.gpu_uuid for event in events):
            gpu = self.machine.gpus[uuid]
            try:
                layout = await self._nvml.run(read_layout, uuid)
            except Exception as error:  # lost, say: the events count for the whole GPU
                log.warning("cannot read the MIG layout of GPU %s: %s", uuid, error)
                self.machine.learn_instances(uuid, {})
                continue
            self.layout_reads += 1
            self.machine.learn_instances(uuid, self._instance_names(gpu.minor, layout))
        self.apply(self.machine.observe(events, self._clock()))

    def _instance_names(self, minor: int, layout: MigLayout) -> dict[tuple[int, int], str]:
        gpu = next((g for g in self._inventory.gpus if g.minor == minor), None)
        profiles = {p.profile_id: p.name for p in gpu.mig_profiles} if gpu else {}
        out: dict[tuple[int, int], str] = {}
        for gi in layout.instances:
            profile = profiles.get(gi.profile_id)
            if profile is None:
                continue
            name = mig_device_name(minor, profile, gi.profile_id, gi.start)
            for ci in gi.compute_instances:
                out[(gi.id, ci.id)] = name
        return out

    def apply(self, transitions: Sequence[Transition]) -> None:
        if not transitions:
            return
        self.transitions += len(transitions)
        self.hub.publish(self.machine.statuses())
        coalesced = _coalesce(transitions)
        spans = [self._span(transition, repeats) for transition, repeats in coalesced]
        with caused_by(spans):
            self._publish()
        for (transition, repeats), span in zip(coalesced, spans, strict=True):
            with trace.use_span(span, end_on_exit=True):
                self._report(transition, repeats)

    # -- recovery --------------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        while True:
            await anyio.sleep(self.policy.recovery_poll_seconds)
            await self.poll_once()

    async def poll_once(self) -> None:
        """Ask NVML what the due recovery checks need, then apply quarantine expiry."""
        lost, reset = self.machine.due_polls(self._clock())
        if lost or reset:
            with tracer().start_as_current_span("gpu.health.poll") as span:
                span.set_attribute("gpu.uuids", sorted({*lost, *reset}))
                results = await self._nvml.run(_poll, sorted(lost), sorted(reset))
            self.handle(results)
            for event in results:
                if event.kind is EventKind.GPU_ANSWERED:
                    self.pump.rearm(event.gpu_uuid)
        self.apply(self.machine.tick(self._clock()))

    # -- reporting -------------------------------------------------------------------------

    def _span(self, transition: Transition, repeats: int) -> trace.Span:
        """The root span of one transition's trace (ended once it is reported)."""
        gpu = self.machine.gpus[transition.gpu_uuid]
        attributes: dict[str, Any] = {
            "gpu.uuid": transition.gpu_uuid,
            "gpu.index": gpu.index,
            "gpu.device.names": list(transition.devices),
            "gpu.health.taint": transition.taint,
            "gpu.health.change": transition.change,
            "gpu.health.reason": transition.reason,
        }
        if repeats > 1:
            attributes["gpu.health.transitions_in_batch"] = repeats
        return tracer().start_span(
            "gpu.health.transition", context=otel_context.Context(), attributes=attributes
        )

    def _report(self, transition: Transition, repeats: int) -> None:
        gpu = self.machine.gpus[transition.gpu_uuid]
        fault = transition.change != "removed"
        fields: dict[str, Any] = {
            "gpu": gpu.index,
            "gpu_uuid": transition.gpu_uuid,
            "devices": list(transition.devices),
            "taint": transition.taint,
            "change": transition.change,
            "reason": transition.reason,
        }
        if repeats > 1:
            fields["transitions_in_batch"] = repeats
        log.log(
            logging.WARNING if fault else logging.INFO,
            "GPU %d health: %s",
            gpu.index,
            transition.describe(),
            extra=fields,
        )
        event = ("Warning" if fault else "Normal", "GpuUnhealthy" if fault else "GpuHealthy")
        try:
            message = f"GPU {gpu.index}: {transition.describe()}"
            self._outbox.send_nowait((*event, message, otel_context.get_current()))
        except anyio.WouldBlock:
            self.dropped_events += 1

    async def _post_events(self) -> None:
        async with self._inbox:
            async for type_, reason, message, context in self._inbox:
                token = otel_context.attach(context)  # the Event's span joins the transition's
                try:
                    await self._events.post(type_, reason, message)  # type: ignore[arg-type]
                finally:
                    otel_context.detach(token)


def _coalesce(transitions: Sequence[Transition]) -> list[tuple[Transition, int]]:
    """The last transition of each condition in a batch, with how many it stands for."""
    last: dict[tuple[str, tuple[str, ...], str, str], tuple[Transition, int]] = {}
    for t in transitions:
        key = (t.gpu_uuid, t.devices, t.key, t.effect)
        last[key] = (t, last.get(key, (t, 0))[1] + 1)
    return list(last.values())


def _poll(lost: Sequence[str], reset: Sequence[str]) -> list[HealthEvent]:
    """In the NVML thread: which lost GPUs answer, and the recovery action of the others."""
    events = []
    for uuid in lost:
        try:
            pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByUUID(uuid))
        except pynvml.NVMLError:
            continue
        events.append(HealthEvent(uuid, EventKind.GPU_ANSWERED))
    for uuid in reset:
        events.extend(_recovery_action(uuid))
    return events


def _recovery_action(uuid: str) -> list[HealthEvent]:
    field = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    try:
        [value] = pynvml.nvmlDeviceGetFieldValues(pynvml.nvmlDeviceGetHandleByUUID(uuid), [field])
    except pynvml.NVMLError as err:
        if err.value == pynvml.NVML_ERROR_GPU_IS_LOST:
            return [HealthEvent(uuid, EventKind.GPU_LOST, detail="recovery poll")]
        if err.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            return [HealthEvent(uuid, EventKind.RECOVERY_ACTION, recovery_action=None)]
        log.debug("cannot read the recovery action of %s: %s", uuid, err)
        return []
    code = int(value.nvmlReturn)
    if code == pynvml.NVML_SUCCESS:
        action: int | None = int(value.value.uiVal)
    elif code == pynvml.NVML_ERROR_NOT_SUPPORTED:
        action = None
    else:
        return []
    return [HealthEvent(uuid, EventKind.RECOVERY_ACTION, recovery_action=action)]


__all__ = ["HealthMonitor"]
