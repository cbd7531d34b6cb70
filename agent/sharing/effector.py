"""The sharing effector: time-slicing and MPS, applied on prepare and undone on unprepare.

Several containers or pods sharing one claim is native to DRA (they reference the same
ResourceClaim); *how* they share its devices is the claim's opaque config
(``GpuConfig.sharing`` / ``MigDeviceConfig.sharing``, decoded in ``agent.dra.config``). The
engine hands every claim to this effector after the dynamic MIG effector (``agent.mig``), so a
dynamic MIG device arrives here with the UUID it was just given. Sharing is chosen by the
config, never by the device name: a device without ``sharing`` passes through untouched, at
no cost (no intent, no write, no NVML call).

- **TimeSlicing** on a full GPU: compute mode ``DEFAULT`` (NVML) and the time-slice of the
  config's interval (``nvidia-smi compute-policy --set-timeslice``; NVML has no call for it).
  Claims sharing a GPU (``adminAccess``) must ask for the same interval, else the second gets
  an error naming the first. The GPU goes back to the ``Default`` time-slice when the last
  claim using the setting goes. On a MIG device time-slicing is what already happens, and
  nothing is changed.
- **MPS**: one control daemon per claim for all its MPS devices (``mps``), the full GPUs
  among them in compute mode ``EXCLUSIVE_PROCESS`` while it runs, the limits applied, and
  ready before prepare returns. The devices come back with the daemon's directories
  (``PreparedDevice.mps``), which the claim's CDI spec mounts into the containers with
  ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY``. Unprepare stops the daemon,
  removes its directories and puts compute mode back to ``DEFAULT``.

Every change is first recorded as an intent in the claim's ``PrepareStarted`` entry (the
GPU's UUID, the strategy, the interval, the daemon's directory; the daemon's pid is added as
soon as it runs), so a crash at any step leaves enough on disk to undo it: startup recovery
(``recover``) stops the daemons of claims that never completed and puts their GPUs back to the
default compute mode and time-slice; the settings of completed claims stay, and a completed
claim's daemon that is not running (it died, or a container restart took it along with the
agent) is started again with its limits.

Each change is a span ``sharing.apply`` or ``sharing.restore`` (``sharing.strategy``,
``gpu.uuid``, ``k8s.device.name``, ``sharing.result``) under the claim's span, counted in
``gpu_dra_sharing_changes_total{strategy,operation,outcome}``; ``gpu_dra_mps_daemons`` is the
number of daemons this agent runs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

import anyio

from agent.crash import crash_point
from agent.dra.config import SharingStrategy
from agent.hardware.compute_mode import ComputeMode, ComputeModes
from agent.node import checkpoint as cp
from agent.node.effectors import (
    Describe,
    EffectFailed,
    Maintain,
    Prepared,
    RecordIntents,
    StartupRecovery,
    undo_unfinished,
)
from agent.node.plan import NodeDevice
from agent.sharing.mps import MpsDaemons
from agent.sharing.settings import (
    MPS,
    MPS_SHARED,
    NAME,
    TIME_SLICING,
    describe,
    mps_plan,
    recorded_pid,
    setting,
    strategy,
    with_pid,
)
from agent.sharing.supervise import DaemonSupervisor
from agent.sharing.tools import DriverTools
from agent.sharing.upkeep import DaemonUpkeep
from agent.telemetry.metrics import (
    MPS_DAEMONS,
    set_gauge,
)

log = logging.getLogger(__name__)


class SharingEffector(DaemonUpkeep):
    """The effector of the module docstring for the devices of ``devices``."""

    name = NAME

    def __init__(
        self,
        compute_modes: ComputeModes,
        tools: DriverTools,
        daemons: MpsDaemons,
        devices: Mapping[str, NodeDevice],
        supervisor: DaemonSupervisor | None = None,
    ) -> None:
        self._modes = compute_modes
        self._tools = tools
        self._daemons = daemons
        self._devices = devices
        self.supervisor = supervisor or DaemonSupervisor(daemons)
        self._maintain: Maintain | None = None
        #: GPU UUID -> claim UID -> the setting it holds ("TimeSlicing/<interval>" or "MPS"):
        #: what this agent changed on each GPU, for whom (rebuilt from the checkpoint at start).
        self._settings: dict[str, dict[str, str]] = {}
        self._locks: dict[str, anyio.Lock] = {}
        #: Claims whose MPS daemon runs (``gpu_dra_mps_daemons``).
        self._with_daemon: set[str] = set()

    @property
    def daemons(self) -> MpsDaemons:
        return self._daemons

    # -- the protocol ---------------------------------------------------------------------

    def handles(self, device: str) -> bool:
        # Every device may be shared; ``apply`` looks at the config and skips the others.
        return device in self._devices

    def conflict(
        self, uid: str, devices: Prepared, held: Mapping[str, Prepared], describe: Describe
    ) -> str | None:
        return None  # decided under the GPU's lock in ``apply``, against what is applied

    async def apply(self, uid: str, devices: Prepared, record: RecordIntents) -> Prepared:
        shared = [d for d in devices if d.config.sharing is not None]
        if not shared:
            return devices
        intents = tuple(i for d in shared if (i := self._intent(uid, d)) is not None)
        if not intents:
            return devices
        await record(intents)
        started: list[int] = []  # the daemon's pid, once it runs
        try:
            changed = False
            for intent in intents:
                if intent.string("strategy") == TIME_SLICING:
                    await self._time_slice(uid, intent)
                    changed = True
                elif intent.get("kind") == "gpu":
                    await self._exclusive(uid, intent)
                    changed = True
            if changed:
                crash_point("after-compute-mode")
            mps_devices = [d for d in shared if strategy(d) == MPS]
            if not mps_devices:
                return devices
            await self._start_daemon(uid, mps_devices, record, intents, started)
        except Exception as error:  # an NVML or tool error, or a bug: this claim only
            pid = started[0] if started else None
            leftover = await self._undo_quietly(uid, with_pid(intents, pid))
            message = str(error) if isinstance(error, EffectFailed) else f"claim {uid}: {error}"
            raise EffectFailed(message, leftover) from error
        if started:
            self.supervisor.watch(uid, started[0])
        shares = self._share(uid)
        names = {d.device for d in mps_devices}
        return tuple(replace(d, mps=shares) if d.device in names else d for d in devices)

    async def undo(self, uid: str, intents: tuple[cp.Intent, ...], devices: Prepared) -> None:
        errors: list[str] = []
        leftover: list[cp.Intent] = []
        mps = tuple(i for i in intents if i.get("strategy") == MPS)
        if mps:
            try:
                await self._stop_daemon(uid, mps)
            except Exception as error:
                errors.append(f"claim {uid}: cannot stop its MPS control daemon: {error}")
                leftover.extend(mps)
        for intent in intents:
            if intent in leftover:
                continue
            try:
                await self._restore(uid, intent)
            except Exception as error:
                errors.append(
                    f"claim {uid}: cannot restore GPU {intent.get('gpuUUID')} after "
                    f"{intent.get('strategy')}: {error}"
                )
                leftover.append(intent)
        if errors:
            raise EffectFailed("; ".join(errors), tuple(leftover))

    async def recover(self, checkpoint: cp.Checkpoint) -> StartupRecovery:
        daemons = self._rebuild_settings(checkpoint)
        recovery = await undo_unfinished(NAME, checkpoint, self.undo)
        problems = list(recovery.problems)
        running, revive_problems = await self._revive_daemons(checkpoint)
        problems.extend(revive_problems)
        for uid, (pid, unrecorded) in running.items():
            self.supervisor.watch(uid, pid, confirm=unrecorded)
        self._with_daemon = daemons
        set_gauge(MPS_DAEMONS, len(self._with_daemon))
        if recovery.rolled_back:
            log.info(
                "undid the sharing settings of %d claim(s) that never completed",
                len(recovery.rolled_back),
                extra={"claims": list(recovery.rolled_back)},
            )
        return replace(recovery, problems=tuple(problems))

    def _rebuild_settings(self, checkpoint: cp.Checkpoint) -> set[str]:
        """The per-GPU settings of the completed claims of ``checkpoint``; the claims
        with an MPS daemon."""
        self._settings.clear()
        daemons: set[str] = set()
        for claim in checkpoint.completed():
            mine = [i for i in claim.intents if i.effector == NAME]
            for intent in mine:
                held = setting(intent)
                if held is not None:
                    self._settings.setdefault(intent.string("gpuUUID"), {})[claim.uid] = held
            if any(i.get("strategy") == MPS for i in mine):
                daemons.add(claim.uid)
        return daemons

    # -- intents --------------------------------------------------------------------------

    def _intent(self, uid: str, device: cp.PreparedDevice) -> cp.Intent | None:
        sharing = device.config.sharing
        assert sharing is not None
        node = self._devices.get(device.device)
        gpu_uuid = node.gpu.uuid if node is not None else device.uuid
        if device.mig is not None:
            gpu_uuid = device.mig.parent_uuid
        if sharing.strategy is SharingStrategy.TIME_SLICING:
            if device.kind != "gpu":
                return None  # a MIG device is time-sliced already; nothing to change
            interval = sharing.time_slicing.interval if sharing.time_slicing else "Default"
            parameters: tuple[tuple[str, str | int], ...] = (
                ("strategy", TIME_SLICING),
                ("gpuUUID", gpu_uuid),
                ("interval", str(interval)),
            )
            return cp.Intent(NAME, device.device, parameters)
        directory = self._daemons.directories(uid).root
        return cp.Intent(
            NAME,
            device.device,
            (
                ("strategy", MPS),
                ("kind", device.kind),
                ("uuid", device.uuid),
                ("gpuUUID", gpu_uuid),
                ("directory", str(directory)),
                *((("share", device.share_id),) if device.share_id is not None else ()),
            ),
        )

    # -- time-slicing ---------------------------------------------------------------------

    def _lock(self, gpu: str) -> anyio.Lock:
        lock = self._locks.get(gpu)
        if lock is None:
            lock = self._locks[gpu] = anyio.Lock()
        return lock

    def _claim_in_the_way(self, uid: str, gpu: str, setting: str) -> str | None:
        for other, theirs in self._settings.get(gpu, {}).items():
            if other != uid and theirs != setting:
                return f"claim {other} holds GPU {gpu} with {describe(theirs)}"
        return None

    async def _time_slice(self, uid: str, intent: cp.Intent) -> None:
        gpu, interval = intent.string("gpuUUID"), intent.string("interval")
        setting = f"{TIME_SLICING}/{interval}"
        async with self._lock(gpu):
            other = self._claim_in_the_way(uid, gpu, setting)
            if other is not None:
                raise EffectFailed(
                    f"claim {uid}: device {intent.device} asks for time-slicing with interval "
                    f"{interval}, but {other}; claims sharing a GPU must ask for the same "
                    "setting"
                )
            with self._change("apply", TIME_SLICING, gpu, intent.device) as span:
                span.set_attribute("sharing.interval", interval)
                await self._modes.set(gpu, ComputeMode.DEFAULT)
                await self._tools.set_timeslice(gpu, interval)
            self._settings.setdefault(gpu, {})[uid] = setting

    async def _exclusive(self, uid: str, intent: cp.Intent) -> None:
        """MPS on a full GPU: exclusive-process mode for the claim's one daemon, or, for a
        KEP-5075 share, the default mode that the daemons of the GPU's other shares need."""
        gpu = intent.string("gpuUUID")
        shared = intent.get("share") is not None
        wanted = MPS_SHARED if shared else MPS
        async with self._lock(gpu):
            others = [u for u in self._settings.get(gpu, {}) if u != uid]
            other = self._claim_in_the_way(uid, gpu, wanted)
            if other is None and others and not shared:  # exclusive-process allows one daemon
                other = f"claim {others[0]} shares GPU {gpu} through its own MPS daemon"
            if other is not None:
                needs = (
                    "MPS shares need the GPU in the default compute mode"
                    if shared
                    else "an MPS daemon needs the GPU in exclusive-process mode for itself"
                )
                raise EffectFailed(
                    f"claim {uid}: device {intent.device} asks for MPS, but {other}; {needs}"
                )
            mode = ComputeMode.DEFAULT if shared else ComputeMode.EXCLUSIVE_PROCESS
            with self._change("apply", MPS, gpu, intent.device) as span:
                span.set_attribute("sharing.compute_mode", mode.name)
                await self._modes.set(gpu, mode)
            self._settings.setdefault(gpu, {})[uid] = wanted

    async def _restore(self, uid: str, intent: cp.Intent) -> None:
        """Forget ``uid``'s setting of the intent's GPU; the last one out restores it."""
        strategy = intent.get("strategy")
        if strategy == MPS and intent.get("kind") != "gpu":
            return  # a MIG device: its GPU's compute mode was never changed
        gpu = intent.string("gpuUUID")
        async with self._lock(gpu):
            holders = self._settings.get(gpu, {})
            holders.pop(uid, None)
            if holders:
                return  # another claim still uses the setting
            self._settings.pop(gpu, None)
            with self._change("restore", str(strategy), gpu, intent.device):
                await self._modes.set(gpu, ComputeMode.DEFAULT)
                if strategy == TIME_SLICING:
                    await self._tools.set_timeslice(gpu, "Default")

    # -- MPS ------------------------------------------------------------------------------

    async def _start_daemon(
        self,
        uid: str,
        devices: list[cp.PreparedDevice],
        record: RecordIntents,
        intents: tuple[cp.Intent, ...],
        started: list[int],
    ) -> None:
        """Start the claim's daemon (its pid into ``started`` and the intents), wait until
        it is ready and apply the limits."""
        missing = [d.device for d in devices if not d.uuid]
        if missing:
            raise EffectFailed(f"claim {uid}: device(s) {', '.join(missing)} have no UUID yet")
        plan = mps_plan(devices)
        uuids = plan.uuids
        with self._change("apply", MPS, ",".join(uuids), ",".join(d.device for d in devices)):
            pid = await self._daemons.start(uid, uuids, plan.environment)
            started.append(pid)
            self._with_daemon.add(uid)
            set_gauge(MPS_DAEMONS, len(self._with_daemon))
            await record(with_pid(intents, pid))
            crash_point("after-mps-daemon-start")
            await self._serve(uid, pid, plan.config, uuids)
            if plan.environment:  # a KEP-5075 share, limited to its consumed memory
                crash_point("after-mps-share-limits")

    def _share(self, uid: str) -> cp.MpsShare:
        dirs = self._daemons.directories(uid)
        return cp.MpsShare(str(dirs.pipe), str(dirs.log), str(dirs.shm))

    async def _stop_daemon(self, uid: str, intents: tuple[cp.Intent, ...]) -> None:
        watched = await self.supervisor.stop(uid)  # first: this exit is no crash
        pid = watched if watched is not None else recorded_pid(intents)
        directory = intents[0].string("directory")
        expected = str(self._daemons.directories(uid).root)
        if directory != expected:  # written by an agent with another plugin directory
            log.warning("MPS directory %s of claim %s is not %s", directory, uid, expected)
        with self._change("restore", MPS, str(intents[0].get("uuid")), intents[0].device):
            await self._daemons.stop(uid, pid)
        self._with_daemon.discard(uid)
        set_gauge(MPS_DAEMONS, len(self._with_daemon))

    # -- failure path ---------------------------------------------------------------------

    async def _undo_quietly(
        self, uid: str, intents: tuple[cp.Intent, ...]
    ) -> tuple[cp.Intent, ...]:
        try:
            await self.undo(uid, intents, ())
        except EffectFailed as error:
            log.warning("%s", error)
            return error.leftover or intents
        return ()
