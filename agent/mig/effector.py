"""The dynamic MIG effector: MIG instances made on prepare and destroyed on unprepare.

With ``--dynamic-mig`` a claim may be allocated a MIG device that does not exist yet (a
profile at a placement, ``agent.dra.partitionable``). The engine hands such devices to this
effector (``agent.node.effectors``), which:

1. checks the exclusivity rules (``rules``) against every claim prepared or in flight, so a
   full-GPU claim on a GPU with MIG devices, a MIG claim on a GPU prepared whole and an
   overlapping placement each get an error naming the claim in the way;
2. records its intent (parent GPU UUID, GPU-instance profile and placement, compute-instance
   profile) durably in the claim's ``PrepareStarted`` entry, before any NVML call changes
   anything; the parent is named by UUID, never by minor or PCI bus id (the incumbent's
   rollback looked the parent up by a bus id it never recorded, nvidia-driver-facts.md §4.2);
3. under the GPU's lock (different GPUs reconfigure in parallel; the engine's other claims go
   on), reads the GPU's MIG layout, enables MIG mode on a Hopper or newer GPU that has it
   off, refuses a placement another instance occupies (naming it, and whether this agent
   made it), creates the GPU instance at exactly the allocated placement, then the compute
   instance of the profile that spans the whole GPU instance, and reads the MIG UUID;
4. returns the device with its live ids and the ``nvidia-caps`` device numbers of the GPU-
   and compute-instance capability files, which the CDI spec names next to the parent's
   ``/dev/nvidia<minor>`` (majors from ``/proc/devices``).

A failure at any step destroys what this attempt made; what cannot be destroyed stays as an
intent. Unprepare (and the rollback of a claim that never completed) destroys the compute
instances, then the GPU instance, retrying an instance a process still uses (NVML
``IN_USE``) with backoff for ``busy_timeout_s`` (well inside the kubelet's 45 s deadline),
then failing with a retryable error; on Hopper and newer MIG mode goes back off when the
GPU's last instance is gone (``--mig-mode-off-when-idle``). A full-GPU device of a
partitionable GPU is checked too: it needs a GPU without instances, and MIG mode is switched
off for it.

Ownership: an instance is this agent's when an intent of the checkpoint names its placement
on its parent (the intent is written before the instance exists and removed only after it is
gone). Startup recovery destroys the instances of claims that never completed; instances no
intent names (made by an operator, mig-parted, another tool) are never destroyed, unless
``--adopt-mig-instances`` says that the agent may destroy every instance that no completed
claim uses.

Each change is a ``mig.reconfigure`` span under the claim's prepare or unprepare span, with
the NVML calls as child spans (``hardware.mig_ops``), and is counted in
``gpu_dra_mig_reconfigurations_total{operation,outcome}`` and timed in
``gpu_dra_mig_reconfigure_duration_seconds{operation}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import anyio

from agent.crash import crash_point
from agent.dra.partitionable import (
    MIG_EFFECTOR,
    DynamicMig,
    MigSlot,
    is_partitionable,
    mode_change_without_reset,
    owned_by_intents,
)
from agent.hardware.errors import NvmlCallFailed
from agent.hardware.hostfiles import HostFiles
from agent.hardware.inventory import Inventory
from agent.hardware.mig_ops import LiveGpuInstance, MigOps
from agent.mig import rules
from agent.mig.steps import (
    HalfMade,
    InstanceBusy,
    ModeOff,
    Occupied,
    destroy_instance,
    full_compute_profile,
    make_instance,
    reconfigure_span,
)
from agent.node import checkpoint as cp
from agent.node.effectors import (
    Describe,
    EffectFailed,
    Prepared,
    RecordIntents,
    StartupRecovery,
    undo_unfinished,
)
from agent.node.plan import NodeDevice, node_devices
from agent.telemetry.metrics import MIG_RECONFIGURATIONS, add

log = logging.getLogger(__name__)

NAME = MIG_EFFECTOR
#: NVML_ERROR_IN_USE: a process still uses the instance (or a GI still has compute instances).
IN_USE = 19
BUSY_BACKOFF_START_S = 0.05
BUSY_BACKOFF_MAX_S = 1.0


_T = TypeVar("_T")


@dataclass
class _Made:
    """An instance this attempt created (to destroy again if the attempt fails)."""

    intent: cp.Intent
    gi_id: int | None  # None: found by placement when destroyed
    ci_id: int | None = None


class MigEffector:
    """The effector of the module docstring, for the partitionable GPUs of ``inventory``."""

    name = NAME

    def __init__(
        self,
        ops: MigOps,
        inventory: Inventory,
        host_root: Path,
        *,
        mode_off_when_idle: bool = True,
        adopt_instances: bool = False,
        busy_timeout_s: float = 10.0,
    ) -> None:
        self._ops = ops
        self._inventory = inventory
        self._devices = self._partitionable(DynamicMig(adopt=adopt_instances))
        self._gpus = {gpu.uuid: gpu for gpu in inventory.gpus if is_partitionable(gpu)}
        self._host = HostFiles(host_root)
        self._caps_major = self._host.device_majors().get("nvidia-caps")
        self._mode_off_when_idle = mode_off_when_idle
        self._adopt = adopt_instances
        self._busy_timeout_s = busy_timeout_s
        self._locks: dict[str, anyio.Lock] = {}
        #: (parent UUID, GI id) -> the claim whose instance it is (made by this process, or
        #: recorded in the checkpoint at startup): an intent never destroys another's.
        self._owners: dict[tuple[str, int], str] = {}

    def _partitionable(self, settings: DynamicMig) -> dict[str, NodeDevice]:
        """The devices this effector makes: the free placements and full GPUs of the
        partitionable GPUs (a static instance is a static device, not this effector's)."""
        devices = node_devices(self._inventory, dynamic_mig=settings)
        return {name: device for name, device in devices.items() if device.partitionable}

    # -- the protocol ---------------------------------------------------------------------

    def handles(self, device: str) -> bool:
        return device in self._devices

    def conflict(
        self, uid: str, devices: Prepared, held: Mapping[str, Prepared], describe: Describe
    ) -> str | None:
        mine = [self._devices[d.device] for d in devices if self._exclusive(d)]
        theirs = {
            other: [self._devices[d.device] for d in prepared if self._exclusive(d)]
            for other, prepared in held.items()
        }
        return rules.first_clash(uid, mine, theirs, describe)

    def _exclusive(self, device: cp.PreparedDevice) -> bool:
        return device.device in self._devices and not device.admin_access

    async def apply(self, uid: str, devices: Prepared, record: RecordIntents) -> Prepared:
        mine = [d for d in devices if d.device in self._devices]
        intents = tuple(
            self._intent(d.device, slot)
            for d in mine
            if (slot := self._devices[d.device].slot) is not None
        )
        if intents:
            await record(intents)
            crash_point("after-mig-intent")
        by_gpu: dict[str, list[cp.PreparedDevice]] = {}
        for device in mine:
            by_gpu.setdefault(self._devices[device.device].gpu.uuid, []).append(device)
        made: dict[str, cp.PreparedDevice] = {}
        created: list[_Made] = []
        errors: list[str] = []
        async with anyio.create_task_group() as group:
            for parent, items in by_gpu.items():
                group.start_soon(self._apply_gpu, uid, parent, items, made, created, errors)
        if errors:
            leftover = await self._destroy_made(uid, created)
            for parent in by_gpu:  # MIG mode may have gone on for nothing
                async with self._lock(parent):
                    await self._mode_off_if_idle(parent)
            raise EffectFailed("; ".join(errors), leftover)
        return tuple(made.get(d.device, d) for d in devices)

    async def undo(self, uid: str, intents: tuple[cp.Intent, ...], devices: Prepared) -> None:
        live = {d.device: d.mig for d in devices if d.mig is not None}
        by_gpu: dict[str, list[cp.Intent]] = {}
        for intent in intents:
            by_gpu.setdefault(intent.string("parentUUID"), []).append(intent)
        leftover: list[cp.Intent] = []
        errors: list[str] = []

        async def one_gpu(parent: str, items: list[cp.Intent]) -> None:
            async with self._lock(parent):
                for index, intent in enumerate(items):
                    mig = live.get(intent.device)
                    last = index == len(items) - 1
                    try:
                        await self._destroy(uid, intent, mig.gi_id if mig else None, mode_off=last)
                    except EffectFailed as error:
                        leftover.append(intent)
                        errors.append(str(error))

        async with anyio.create_task_group() as group:
            for parent, items in by_gpu.items():
                group.start_soon(one_gpu, parent, items)
        if errors:
            raise EffectFailed("; ".join(errors), tuple(leftover))

    async def recover(self, checkpoint: cp.Checkpoint) -> StartupRecovery:
        # The instances found at startup that the checkpoint's intents name are this agent's
        # (their placements are its devices again); the others are static.
        self._devices = self._partitionable(
            owned_by_intents(
                ((i.effector, i.device) for c in checkpoint.claims.values() for i in c.intents),
                self._adopt,
            )
        )
        self._owners.clear()
        for claim in checkpoint.completed():
            for device in claim.devices:
                if device.mig is not None:
                    self._owners[(device.mig.parent_uuid, device.mig.gi_id)] = claim.uid
        recovery = await undo_unfinished(NAME, checkpoint, self.undo)
        problems = list(recovery.problems)
        if self._adopt:
            problems.extend(await self._destroy_unowned(checkpoint))
        if recovery.rolled_back:
            log.info(
                "rolled back the MIG instances of %d claim(s) that never completed",
                len(recovery.rolled_back),
                extra={"claims": list(recovery.rolled_back)},
            )
        return replace(recovery, problems=tuple(problems))

    # -- prepare --------------------------------------------------------------------------

    def _intent(self, device: str, slot: MigSlot) -> cp.Intent:
        parameters: tuple[tuple[str, str | int], ...] = (
            ("parentUUID", slot.parent_uuid),
            ("parentMinor", slot.parent_minor),
            ("profile", slot.profile.name),
            ("profileID", slot.profile.profile_id),
            ("start", slot.placement.start),
            ("size", slot.placement.size),
            ("computeProfile", full_compute_profile(slot)),
        )
        return cp.Intent(NAME, device, parameters)

    def _lock(self, parent: str) -> anyio.Lock:
        lock = self._locks.get(parent)
        if lock is None:
            lock = self._locks[parent] = anyio.Lock()
        return lock

    async def _apply_gpu(
        self,
        uid: str,
        parent: str,
        devices: list[cp.PreparedDevice],
        made: dict[str, cp.PreparedDevice],
        created: list[_Made],
        errors: list[str],
    ) -> None:
        async with self._lock(parent):
            enabled, instances = True, []
            if any(self._devices[d.device].slot is None for d in devices):  # a full GPU
                try:
                    layout = await self._ops.read_layout(parent, with_uuids=False)
                except Exception as error:  # NVML failed: this claim fails, the agent goes on
                    errors.append(
                        f"claim {uid}: cannot read the MIG layout of GPU {parent}: {error}"
                    )
                    return
                enabled, instances = layout.mig_enabled, list(layout.instances)
            for device in devices:
                node = self._devices[device.device]
                try:
                    if node.slot is None:
                        enabled = await self._whole(uid, node, enabled, instances)
                        continue
                    intent = self._intent(device.device, node.slot)
                    made[device.device], gi = await self._create(uid, node, device, intent, created)
                    enabled = True
                    instances.append(gi)
                except EffectFailed as error:
                    errors.append(str(error))
                    return
                except Exception as error:  # an NVML error, or a bug: this claim only
                    errors.append(f"claim {uid}: device {device.device}: {error}")
                    return

    async def _whole(
        self, uid: str, node: NodeDevice, enabled: bool, instances: list[LiveGpuInstance]
    ) -> bool:
        """A full-GPU device: no instance may exist; MIG mode goes off. Returns the mode."""
        gpu = node.gpu
        if instances:
            listed = ", ".join(self._describe_instance(gpu.uuid, gi) for gi in instances)
            raise EffectFailed(
                f"claim {uid}: device {node.name} is the whole GPU {gpu.minor} ({gpu.uuid}), "
                f"which has MIG instances: {listed}; it can be prepared once they are gone"
            )
        if not enabled:
            return False
        with reconfigure_span("mode", gpu) as span:
            span.set_attribute("mig.mode", "off")
            await self._ops.set_mig_mode(gpu.uuid, False)
        return False

    async def _create(
        self,
        uid: str,
        node: NodeDevice,
        device: cp.PreparedDevice,
        intent: cp.Intent,
        created: list[_Made],
    ) -> tuple[cp.PreparedDevice, LiveGpuInstance]:
        gpu, slot = node.gpu, node.slot
        assert slot is not None
        start, size = slot.placement.start, slot.placement.size
        with reconfigure_span("create", gpu, intent) as span:
            try:  # one trip to the NVML thread for the whole sequence
                gi_id, ci_id, mig_uuid, minors, mode_on = await self._ops.run(
                    make_instance,
                    self._host,
                    gpu.uuid,
                    gpu.minor,
                    mode_change_without_reset(gpu),
                    slot.profile.profile_id,
                    start,
                    size,
                    intent.integer("computeProfile"),
                )
            except Occupied as occupied:
                raise EffectFailed(
                    f"claim {uid}: device {node.name} cannot be made: placement "
                    f"{start}+{size} of GPU {gpu.minor} ({gpu.uuid}) is occupied by "
                    f"{self._describe_instance(gpu.uuid, occupied.instance)}"
                ) from None
            except ModeOff:
                raise EffectFailed(
                    f"claim {uid}: device {node.name}: MIG mode of GPU {gpu.minor} "
                    f"({gpu.uuid}) is off, and an {gpu.architecture} GPU needs a reset to "
                    "turn it on; enable MIG mode (nvidia-smi -mig 1) and reset the GPU"
                ) from None
            except HalfMade as half:
                created.append(_Made(intent, half.gi_id))
                if half.gi_id is not None:
                    self._owners[(gpu.uuid, half.gi_id)] = uid
                    span.set_attribute("mig.gpu_instance.id", half.gi_id)
                raise EffectFailed(f"claim {uid}: device {node.name}: {half.cause}") from half
            if mode_on:
                span.set_attribute("mig.mode", "on")
            created.append(_Made(intent, gi_id, ci_id))
            self._owners[(gpu.uuid, gi_id)] = uid
            span.set_attribute("mig.gpu_instance.id", gi_id)
            span.set_attribute("mig.compute_instance.id", ci_id)
            if not mig_uuid.startswith("MIG-"):
                raise EffectFailed(
                    f"claim {uid}: device {node.name}: NVML gave no MIG UUID for GPU "
                    f"instance {gi_id} compute instance {ci_id} of GPU {gpu.uuid}"
                )
            if self._caps_major is None or minors is None:
                raise EffectFailed(
                    f"claim {uid}: device {node.name}: no nvidia-caps major in /proc/devices or "
                    f"no capability file for gpu{gpu.minor}/gi{gi_id}/ci{ci_id} under "
                    "/proc/driver/nvidia/capabilities; is the nvidia-caps module loaded?"
                )
        mig = cp.MigInstance(gpu.uuid, gi_id, ci_id, self._caps_major, *minors)
        live = LiveGpuInstance(gi_id, slot.profile.profile_id, start, size)
        return replace(device, uuid=mig_uuid, mig=mig), live

    async def _destroy_made(self, uid: str, created: list[_Made]) -> tuple[cp.Intent, ...]:
        """Destroy what a failed attempt made; the intents of what is still there."""
        leftover: list[cp.Intent] = []
        for made in created:
            parent = made.intent.string("parentUUID")
            async with self._lock(parent):
                try:
                    await self._destroy(uid, made.intent, made.gi_id)
                except EffectFailed as error:
                    log.warning("%s", error)
                    leftover.append(made.intent)
        return tuple(leftover)

    # -- destroy --------------------------------------------------------------------------

    async def _destroy(
        self, uid: str, intent: cp.Intent, gi_id: int | None, *, mode_off: bool = False
    ) -> None:
        """Destroy the instance ``intent`` names (the caller holds the GPU's lock); with
        ``mode_off``, MIG mode goes off too when no instance is left on a GPU that allows it."""
        parent = intent.string("parentUUID")
        gpu = self._gpus.get(parent)
        mode_off = (
            mode_off
            and self._mode_off_when_idle
            and gpu is not None
            and mode_change_without_reset(gpu)
        )
        with reconfigure_span("destroy", gpu, intent, parent=parent) as span:
            outcome, found, cis, switched = await self._retry_busy(
                uid,
                intent,
                destroy_instance,
                self._owners,
                uid,
                parent,
                intent.integer("start"),
                intent.integer("profileID"),
                gi_id,
                mode_off,
            )
            if found is not None:
                span.set_attribute("mig.gpu_instance.id", found)
                self._owners.pop((parent, found), None)
            if cis:
                span.set_attribute("mig.compute_instance.id", cis[0])
            if outcome != "destroyed":
                span.set_attribute("mig.outcome", outcome)
            if switched:
                span.set_attribute("mig.mode", "off")
                add(MIG_RECONFIGURATIONS, 1, operation="mode", outcome="success")

    async def _retry_busy(
        self,
        uid: str,
        intent: cp.Intent,
        call: Callable[..., _T],
        *args: object,
    ) -> _T:
        """``call(*args)`` in the NVML thread; an instance in use (NVML IN_USE) is retried
        with backoff for ``busy_timeout_s``, then a retryable error; other NVML errors fail."""
        deadline = time.monotonic() + self._busy_timeout_s
        delay = BUSY_BACKOFF_START_S
        while True:
            try:
                return await self._ops.run(call, *args)
            except NvmlCallFailed as error:
                if error.code != IN_USE:
                    raise EffectFailed(
                        f"claim {uid}: cannot destroy {intent.device}: {error}"
                    ) from error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise InstanceBusy(
                        f"claim {uid}: {intent.device} (GPU {intent.string('parentUUID')}) is "
                        f"still in use by a process after {self._busy_timeout_s:g} s of retries "
                        "(NVML IN_USE); the kubelet retries the unprepare, stop the process to "
                        "let it finish"
                    ) from error
            except Exception as error:  # a layout read failed, or a bug: this claim only
                raise EffectFailed(
                    f"claim {uid}: cannot destroy {intent.device}: {error}"
                ) from error
            await anyio.sleep(min(delay, remaining))
            delay = min(delay * 2, BUSY_BACKOFF_MAX_S)

    async def _mode_off_if_idle(self, parent: str) -> None:
        """MIG mode off on a Hopper+ GPU without instances (``--mig-mode-off-when-idle``)."""
        gpu = self._gpus.get(parent)
        if not self._mode_off_when_idle or gpu is None or not mode_change_without_reset(gpu):
            return
        try:
            layout = await self._ops.read_layout(parent)
            if not layout.mig_enabled or layout.instances:
                return
            with reconfigure_span("mode", gpu) as span:
                span.set_attribute("mig.mode", "off")
                await self._ops.set_mig_mode(parent, False)
        except Exception as error:  # the next unprepare or start tries again
            log.warning("could not switch MIG mode off on GPU %s: %s", parent, error)

    async def _destroy_unowned(self, checkpoint: cp.Checkpoint) -> list[str]:
        """``--adopt-mig-instances``: destroy every instance no completed claim uses."""
        used = {
            (d.mig.parent_uuid, d.mig.gi_id)
            for claim in checkpoint.claims.values()
            for d in claim.devices
            if d.mig is not None
        }
        intents = {
            (i.string("parentUUID"), i.integer("start"))
            for claim in checkpoint.claims.values()
            for i in claim.intents
            if i.effector == NAME
        }
        problems: list[str] = []
        for parent in self._gpus:
            async with self._lock(parent):
                try:
                    layout = await self._ops.read_layout(parent)
                except Exception as error:
                    problems.append(f"cannot read the MIG layout of GPU {parent}: {error}")
                    continue
                for gi in layout.instances:
                    if (parent, gi.id) in used or (parent, gi.start) in intents:
                        continue
                    intent = cp.Intent(
                        NAME,
                        f"adopted GPU instance {gi.id}",
                        (("parentUUID", parent), ("profileID", gi.profile_id), ("start", gi.start)),
                    )
                    try:
                        await self._destroy("(adopted)", intent, gi.id)
                    except EffectFailed as error:
                        problems.append(str(error))
                await self._mode_off_if_idle(parent)
        return problems

    # -- telemetry ------------------------------------------------------------------------

    def _describe_instance(self, parent: str, gi: LiveGpuInstance) -> str:
        owner = self._owners.get((parent, gi.id))
        whose = f"made for claim {owner}" if owner else "not made by this agent for any claim"
        return f"GPU instance {gi.id} (profile id {gi.profile_id}, placement {gi.start}+{gi.size}, {whose})"
