"""The health state machine: events and time in, transitions, taints and device health out.

Pure and synchronous (the h11 way): no NVML, no clock, no I/O, so every rule, including
recovery and the coalescing of an event storm, is tested with plain values. A *condition* is one
active fault on a GPU (or on one MIG device of it), with the rule that clears it:

- ``ANSWER``: the GPU was lost; it clears when NVML answers for the GPU again;
- ``RESET``: an XID that needs a reset, or a double-bit ECC error; it clears when a poll at least
  ``reset_hold_seconds`` after the last occurrence finds no pending recovery action (where the
  driver cannot tell, the quarantine rule applies instead);
- ``QUARANTINE``: any other XID; it clears after ``quarantine_seconds`` without recurrence;
- ``MONITORED``: event registration failed; it clears when registration succeeds.

Repeats of an active condition only refresh it, so a storm of thousands of identical XIDs is one
transition. MIG devices follow their parent GPU: GPU-wide conditions taint every device of the
GPU; an XID that names a MIG device and needs no reset taints only that device.

With ``--dynamic-mig`` a partitionable GPU's devices are its full GPU and every MIG placement,
created or not, all sharing its counters: a GPU-wide condition taints every one of them, and
an XID of a MIG instance taints the placement device the instance occupies (its GPU-instance id
is mapped to the placement by the monitor, from the live MIG layout: :meth:`learn_instances`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Literal, cast, get_args

from agent.dra.model import DeviceTaint, TaintEffect
from agent.dra.names import device_sort_key
from agent.hardware.health_events import EventKind, HealthEvent
from agent.health.policy import (
    TAINT_ECC,
    TAINT_GPU_LOST,
    TAINT_UNMONITORED,
    TAINT_XID,
    HealthPolicy,
    XidAction,
)
from agent.health.records import (
    CLEARING_STRENGTH,
    MAX_MESSAGE_LENGTH,
    RECOVERY_ACTION_NONE,
    Clearing,
    Condition,
    DeviceStatus,
    GpuDevices,
    Health,
    Transition,
    device_map,
)
from agent.health.xids import describe_xid

__all__ = [
    "MAX_MESSAGE_LENGTH",
    "Clearing",
    "Condition",
    "DeviceStatus",
    "GpuDevices",
    "Health",
    "HealthStateMachine",
    "Transition",
    "device_map",
]


class HealthStateMachine:
    """Feed it :meth:`observe` and :meth:`tick`; read :meth:`taints` and :meth:`statuses`."""

    def __init__(self, policy: HealthPolicy, gpus: Mapping[str, GpuDevices]) -> None:
        self.policy = policy
        self.gpus = dict(gpus)
        self._conditions: dict[tuple[str, str | None, str, str], Condition] = {}
        self._pending_action: dict[str, int] = {}
        self._no_recovery_field: set[str] = set()

    @property
    def conditions(self) -> tuple[Condition, ...]:
        return tuple(self._conditions.values())

    def set_unmonitored_effect(self, effect: str) -> bool:
        """The ``unmonitored`` taint's effect from now on and for the conditions held (the
        monitor starts before the API server's version, which chooses it, is known); True if
        a held taint changed."""
        if effect not in get_args(TaintEffect):
            raise ValueError(f"not a taint effect: {effect!r}")
        self.policy = replace(self.policy, unmonitored_effect=effect)
        changed = False
        for ident, cond in list(self._conditions.items()):
            if cond.key == TAINT_UNMONITORED and cond.effect != effect:
                del self._conditions[ident]
                moved = replace(cond, effect=cast(TaintEffect, effect))
                self._conditions[moved.ident] = moved
                changed = True
        return changed

    def learn_instances(self, uuid: str, live: Mapping[tuple[int, int], str]) -> None:
        """The MIG instances now on partitionable GPU ``uuid``: (GI id, CI id) -> the device
        name of the placement each occupies. Names the GPU does not publish are ignored."""
        gpu = self.gpus.get(uuid)
        if gpu is None:
            return
        known = set(gpu.names)
        self.gpus[uuid] = replace(
            gpu, mig={key: name for key, name in live.items() if name in known}
        )

    # -- inputs ----------------------------------------------------------------------------

    def observe(self, events: Iterable[HealthEvent], now: float) -> list[Transition]:
        """Apply events observed at ``now`` (wall-clock seconds); returns the transitions."""
        transitions: list[Transition] = []
        for event in events:
            if event.gpu_uuid in self.gpus:
                transitions.extend(self._observe_one(event, now))
        return transitions

    def tick(self, now: float) -> list[Transition]:
        """Clear what time alone clears: quarantines without recurrence."""
        expired = [
            c
            for c in self._conditions.values()
            if self._by_quarantine(c) and now - c.last_seen >= self.policy.quarantine_seconds
        ]
        return [self._remove(c, now, "quarantine over without recurrence") for c in expired]

    def due_polls(self, now: float) -> tuple[set[str], set[str]]:
        """(lost GPUs to probe, GPUs whose pending recovery action to read) at ``now``."""
        lost = {c.gpu_uuid for c in self._conditions.values() if c.clearing is Clearing.ANSWER}
        reset = {
            c.gpu_uuid
            for c in self._conditions.values()
            if c.clearing is Clearing.RESET
            and c.gpu_uuid not in lost
            and c.gpu_uuid not in self._no_recovery_field
            and now - c.last_seen >= self.policy.reset_hold_seconds
        }
        return lost, reset

    # -- outputs ---------------------------------------------------------------------------

    def taints(self) -> dict[str, list[DeviceTaint]]:
        """Device name -> its taints; one taint per (key, effect), the latest value winning."""
        chosen: dict[str, dict[tuple[str, str], Condition]] = {}
        for cond in self._conditions.values():
            for name in self._devices_of(cond):
                slot = chosen.setdefault(name, {})
                held = slot.get((cond.key, cond.effect))
                if held is None or cond.last_seen >= held.last_seen:
                    slot[(cond.key, cond.effect)] = cond
        return {
            name: [
                DeviceTaint(
                    key=c.key,
                    value=c.value,
                    effect=c.effect,
                    time_added=datetime.fromtimestamp(c.since, UTC),
                )
                for _, c in sorted(slot.items())
            ]
            for name, slot in chosen.items()
        }

    def statuses(self) -> list[DeviceStatus]:
        """Every device's health and why, sorted by device name."""
        by_device: dict[str, list[Condition]] = {}
        for cond in self._conditions.values():
            for name in self._devices_of(cond):
                by_device.setdefault(name, []).append(cond)
        statuses = []
        for gpu in self.gpus.values():
            for name in gpu.names:
                statuses.append(self._status(name, gpu, by_device.get(name, [])))
        return sorted(statuses, key=lambda s: device_sort_key(s.name))

    # -- rules -----------------------------------------------------------------------------

    def _observe_one(self, event: HealthEvent, now: float) -> list[Transition]:
        uuid = event.gpu_uuid
        match event.kind:
            case EventKind.XID:
                return self._xid(event, now)
            case EventKind.ECC_DOUBLE_BIT:
                reason = "double-bit ECC error: memory contents are corrupt until a reset"
                return self._set(
                    uuid, None, TAINT_ECC, "double-bit", "NoExecute", Clearing.RESET, reason, now
                )
            case EventKind.GPU_LOST:
                reason = "GPU is lost (NVML: GPU_IS_LOST)" + _detail(event)
                return self._set(
                    uuid, None, TAINT_GPU_LOST, "", "NoExecute", Clearing.ANSWER, reason, now
                )
            case EventKind.UNMONITORED:
                effect: TaintEffect = self.policy.unmonitored_effect  # type: ignore[assignment]
                reason = "health is not monitored: NVML event registration failed" + _detail(event)
                return self._set(
                    uuid, None, TAINT_UNMONITORED, "", effect, Clearing.MONITORED, reason, now
                )
            case EventKind.MONITORED:
                return self._clear(uuid, Clearing.MONITORED, now, "NVML events registered")
            case EventKind.GPU_ANSWERED:
                return self._clear(uuid, Clearing.ANSWER, now, "the GPU answers NVML again")
            case EventKind.RECOVERY_ACTION:
                return self._recovery_action(uuid, event.recovery_action, now)
            case _:  # single-bit ECC errors are corrected by the hardware: no change
                return []

    def _xid(self, event: HealthEvent, now: float) -> list[Transition]:
        action = self.policy.action(event.xid)
        if action is XidAction.IGNORE:
            return []
        needs_reset = self.policy.needs_reset(event.xid)
        device = None
        if not needs_reset and event.gpu_instance_id is not None:
            mig_key = (event.gpu_instance_id, event.compute_instance_id or 0)
            device = self.gpus[event.gpu_uuid].mig.get(mig_key)
        reason = describe_xid(event.xid) + _detail(event)
        clearing = Clearing.RESET if needs_reset else Clearing.QUARANTINE
        effect: TaintEffect = action.value  # type: ignore[assignment]
        return self._set(
            event.gpu_uuid, device, TAINT_XID, str(event.xid), effect, clearing, reason, now
        )

    def _recovery_action(self, uuid: str, action: int | None, now: float) -> list[Transition]:
        if action is None:
            self._no_recovery_field.add(uuid)  # quarantine rule from now on (see tick)
            return []
        self._no_recovery_field.discard(uuid)
        if action != RECOVERY_ACTION_NONE:
            self._pending_action[uuid] = action
            return []
        self._pending_action.pop(uuid, None)
        done = [
            c
            for c in self._conditions.values()
            if c.gpu_uuid == uuid
            and c.clearing is Clearing.RESET
            and now - c.last_seen >= self.policy.reset_hold_seconds
        ]
        return [self._remove(c, now, "NVML reports no pending recovery action") for c in done]

    def _set(
        self,
        uuid: str,
        device: str | None,
        key: str,
        value: str,
        effect: TaintEffect,
        clearing: Clearing,
        reason: str,
        now: float,
    ) -> list[Transition]:
        new = Condition(uuid, device, key, value, effect, clearing, reason, now, now)
        held = self._conditions.get(new.ident)
        if held is not None and held.value == value:
            self._conditions[new.ident] = replace(held, last_seen=now, count=held.count + 1)
            return []
        if held is not None:
            new = replace(new, since=held.since, count=held.count + 1)
            if CLEARING_STRENGTH[held.clearing] > CLEARING_STRENGTH[clearing]:
                # A later, milder event with the same taint (an override can give a reset XID
                # and a plain one the same effect) must not let a pending reset quarantine out.
                new = replace(new, clearing=held.clearing)
        self._conditions[new.ident] = new
        return [self._transition(new, "changed" if held else "added", reason, now)]

    def _clear(self, uuid: str, clearing: Clearing, now: float, why: str) -> list[Transition]:
        gone = [
            c for c in self._conditions.values() if c.gpu_uuid == uuid and c.clearing is clearing
        ]
        return [self._remove(c, now, why) for c in gone]

    def _remove(self, cond: Condition, now: float, why: str) -> Transition:
        del self._conditions[cond.ident]
        return self._transition(cond, "removed", f"{cond.reason}; cleared: {why}", now)

    def _transition(
        self,
        cond: Condition,
        change: Literal["added", "changed", "removed"],
        reason: str,
        now: float,
    ) -> Transition:
        devices = self._devices_of(cond)
        return Transition(
            cond.gpu_uuid, devices, cond.key, cond.value, cond.effect, change, reason, now
        )

    def _by_quarantine(self, cond: Condition) -> bool:
        return cond.clearing is Clearing.QUARANTINE or (
            cond.clearing is Clearing.RESET and cond.gpu_uuid in self._no_recovery_field
        )

    def _devices_of(self, cond: Condition) -> tuple[str, ...]:
        return (cond.device,) if cond.device else self.gpus[cond.gpu_uuid].names

    def _status(self, name: str, gpu: GpuDevices, conds: list[Condition]) -> DeviceStatus:
        faults = [c for c in conds if c.key != TAINT_UNMONITORED]
        if faults:
            parts = [self._explain(c) for c in sorted(faults, key=lambda c: -c.last_seen)]
            pending = self._pending_action.get(gpu.uuid)
            if pending is not None:
                parts.append(f"NVML recovery action pending: {pending}")
            return DeviceStatus(name, Health.UNHEALTHY, _clip("; ".join(parts)))
        if conds:
            return DeviceStatus(name, Health.UNKNOWN, _clip(conds[0].reason))
        return DeviceStatus(name, Health.HEALTHY, f"GPU {gpu.index} ({gpu.uuid}): no active fault")

    def _explain(self, cond: Condition) -> str:
        until = {
            Clearing.ANSWER: "until NVML answers for the GPU again",
            Clearing.RESET: "until NVML reports no pending recovery action (GPU reset)",
            Clearing.QUARANTINE: f"until {self.policy.quarantine_seconds:g} s without recurrence",
            Clearing.MONITORED: "until event registration succeeds",
        }[cond.clearing]
        if self._by_quarantine(cond):
            until = f"until {self.policy.quarantine_seconds:g} s without recurrence"
        seen = f", seen {cond.count} times" if cond.count > 1 else ""
        stamp = datetime.fromtimestamp(cond.last_seen, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return f"{cond.reason} (last at {stamp}{seen}); {cond.effect} {until}"


def _detail(event: HealthEvent) -> str:
    return f" ({event.detail})" if event.detail else ""


def _clip(message: str) -> str:
    if len(message) <= MAX_MESSAGE_LENGTH:
        return message
    return message[: MAX_MESSAGE_LENGTH - 3] + "..."
