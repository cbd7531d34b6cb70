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
instances, then the GPU instance (``teardown``: retries while the instance is in use, MIG mode
off when the GPU's last instance is gone). A full-GPU device of a partitionable GPU is
checked too: it needs a GPU without instances, and MIG mode is switched off for it.

Shares (``--consumable-shares``, KEP-5075): a placement allocated to several claims is one
instance. The first share's prepare makes it; a further share (of another claim, or of the
same claim) finds it in ``users``, checks under the GPU's lock that it still exists, and gets
the same MIG UUID and capability devices in a CDI device of its own
(``after-mig-share-attach``); unprepare destroys the instance only with its last share
(``teardown``). The count of a placement's users comes from the checkpoint's intents
(``users``), rebuilt at startup and after another agent instance wrote the checkpoint, so
startup recovery never destroys an instance a completed claim's share uses, even when a
claim that never completed names the same placement.

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
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import anyio

from agent.crash import crash_point
from agent.dra.partitionable import (
    DynamicMig,
    MigSlot,
    is_partitionable,
    owned_by_intents,
)
from agent.hardware.hostfiles import HostFiles
from agent.hardware.inventory import Inventory
from agent.hardware.mig_ops import MigOps
from agent.mig import rules
from agent.mig.making import MigMaking
from agent.mig.steps import (
    full_compute_profile,
)
from agent.mig.teardown import NAME, Made, MigTeardown
from agent.mig.users import InstanceUsers
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

log = logging.getLogger(__name__)

#: A device of a claim and the share of it (None: the whole device).
Share = tuple[str, str | None]


class MigEffector(MigMaking, MigTeardown):
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
        #: placement device -> the claims using its instance (shares: several)
        self._users = InstanceUsers(NAME)

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
        slots = {d.device: slot for d in mine if (slot := self._devices[d.device].slot)}
        intents = tuple(self._intent(name, slot) for name, slot in slots.items())  # one each
        if intents:
            await record(intents)
            crash_point("after-mig-intent")
        by_gpu: dict[str, list[cp.PreparedDevice]] = {}
        for device in mine:
            by_gpu.setdefault(self._devices[device.device].gpu.uuid, []).append(device)
        made: dict[Share, cp.PreparedDevice] = {}
        created: list[Made] = []
        errors: list[str] = []
        async with anyio.create_task_group() as group:
            for parent, items in by_gpu.items():
                group.start_soon(self._apply_gpu, uid, parent, items, made, created, errors)
        if errors:
            leftover = await self._destroy_made(uid, created)
            kept = {i.device for i in leftover}
            for parent, items in by_gpu.items():  # MIG mode may have gone on for nothing
                async with self._lock(parent):
                    for name in {d.device for d in items} - kept:  # shares found, not made
                        self._users.release(name, uid)
                    await self._mode_off_if_idle(parent)
            raise EffectFailed("; ".join(errors), leftover)
        return tuple(made.get((d.device, d.share_id), d) for d in devices)

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
                        await self._release(uid, intent, mig.gi_id if mig else None, mode_off=last)
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
        self.reload(checkpoint)
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

    def reload(self, checkpoint: cp.Checkpoint) -> None:
        """Who owns and who uses each instance, from ``checkpoint`` (at startup, and when
        another agent instance wrote it: ``effectors.ReloadingEffector``)."""
        self._owners.clear()
        for claim in checkpoint.completed():
            for device in claim.devices:
                if device.mig is not None:
                    self._owners[(device.mig.parent_uuid, device.mig.gi_id)] = claim.uid
        self._users.rebuild(checkpoint)

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
        made: dict[Share, cp.PreparedDevice],
        created: list[Made],
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
                    shared = self._users.made(device.device)
                    if shared is not None and device.share_id is not None:
                        result, gi = await self._attach(uid, node, device, shared)
                    else:
                        intent = self._intent(device.device, node.slot)
                        result, gi = await self._create(uid, node, device, intent, created)
                    made[(device.device, device.share_id)] = result
                    self._users.add(device.device, uid, result)
                    enabled = True
                    instances.append(gi)
                except EffectFailed as error:
                    errors.append(str(error))
                    return
                except Exception as error:  # an NVML error, or a bug: this claim only
                    errors.append(f"claim {uid}: device {device.device}: {error}")
                    return
