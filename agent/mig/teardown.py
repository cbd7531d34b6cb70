"""Destroying dynamic MIG instances: unprepare, the rollback of a failed prepare, startup
recovery's rollback and ``--adopt-mig-instances``.

An instance is destroyed only when no claim uses it any more: a claim that lets go of a
placement another claim's share still uses (``users``) leaves the instance to that claim
(``after-mig-share-release``). Otherwise, under the GPU's lock and in one trip to the NVML
thread (``steps.destroy_instance``), its compute instances go, then the GPU instance, then
MIG mode on a Hopper or newer GPU left without instances (``--mig-mode-off-when-idle``). An
instance in use (NVML ``IN_USE``) is retried with backoff for ``busy_timeout_s``, then the
claim gets a retryable error.

``MigEffector`` (``effector``) is the class; this mixin holds these methods so that each
module stays readable in one sitting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import anyio

from agent.crash import crash_point
from agent.dra.partitionable import MIG_EFFECTOR, mode_change_without_reset
from agent.hardware.errors import NvmlCallFailed
from agent.hardware.inventory import Gpu
from agent.hardware.mig_ops import MigOps
from agent.mig.steps import InstanceBusy, destroy_instance, reconfigure_span
from agent.mig.users import InstanceUsers
from agent.node import checkpoint as cp
from agent.node.effectors import EffectFailed
from agent.telemetry.metrics import MIG_RECONFIGURATIONS, add

log = logging.getLogger(__name__)

NAME = MIG_EFFECTOR
#: NVML_ERROR_IN_USE: a process still uses the instance (or a GI still has compute instances).
IN_USE = 19
BUSY_BACKOFF_START_S = 0.05
BUSY_BACKOFF_MAX_S = 1.0

_T = TypeVar("_T")


@dataclass
class Made:
    """An instance an attempt created (to destroy again if the attempt fails)."""

    intent: cp.Intent
    gi_id: int | None  # None: found by placement when destroyed
    ci_id: int | None = None


class MigTeardown:
    """The destroying half of :class:`agent.mig.effector.MigEffector`."""

    _ops: MigOps
    _gpus: Mapping[str, Gpu]
    _mode_off_when_idle: bool
    _busy_timeout_s: float
    _users: InstanceUsers
    #: (parent UUID, GI id) -> the claim whose instance it is
    _owners: dict[tuple[str, int], str]
    _lock: Callable[[str], anyio.Lock]

    async def _release(
        self, uid: str, intent: cp.Intent, gi_id: int | None, *, mode_off: bool = False
    ) -> None:
        """Claim ``uid`` lets go of the instance ``intent`` names (the caller holds the GPU's
        lock): destroyed, unless another claim's share still uses it."""
        others = self._users.release(intent.device, uid)
        if not others:
            await self._destroy(uid, intent, gi_id, mode_off=mode_off)
            return
        parent = intent.string("parentUUID")
        for key, owner in list(self._owners.items()):  # the instance is the others' now
            if key[0] == parent and owner == uid and (gi_id is None or key[1] == gi_id):
                self._owners[key] = others[0]
        log.info(
            "claim %s let go of %s; its instance stays for claim(s) %s",
            uid,
            intent.device,
            ", ".join(others),
            extra={"claim": uid, "device": intent.device, "users": list(others)},
        )
        crash_point("after-mig-share-release")

    async def _destroy_made(self, uid: str, created: list[Made]) -> tuple[cp.Intent, ...]:
        """Destroy what a failed attempt made (unless a share of another claim found it in
        the meantime); the intents of what is still there."""
        leftover: list[cp.Intent] = []
        for made in created:
            parent = made.intent.string("parentUUID")
            async with self._lock(parent):
                try:
                    await self._release(uid, made.intent, made.gi_id)
                except EffectFailed as error:
                    log.warning("%s", error)
                    leftover.append(made.intent)
        return tuple(leftover)

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
