"""What the sharing effector records and applies, as pure functions of the checkpoint's
records: a claim's MPS daemon plan (its devices, limits and environment), the setting an
intent holds on its GPU, and the daemon pid an intent records.

A device shared through MPS that is a KEP-5075 share (``--consumable-shares``: its allocation
has a ``shareID`` and ``consumedCapacity``) gets its consumed memory as the daemon's pinned
device memory limit, both in the daemon's environment (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``,
which binds every client from the daemon's start) and through its pipe
(``set_default_device_pinned_mem_limit``), so the share is enforced, not only accounted. Such
a share leaves its GPU in compute mode ``DEFAULT`` (``MPS/shared``): several shares, each with
its own daemon, run on one GPU, where an exclusive MPS claim needs ``EXCLUSIVE_PROCESS``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from agent.dra.config import MpsConfig, Sharing, SharingStrategy
from agent.dra.shares import consumed_memory
from agent.node import checkpoint as cp

NAME = "sharing"
TIME_SLICING = str(SharingStrategy.TIME_SLICING)
MPS = str(SharingStrategy.MPS)
MPS_SHARED = f"{MPS}/shared"
PINNED_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
_MIB = 2**20


@dataclass(frozen=True)
class MpsPlan:
    """How a claim's MPS daemon is started and limited."""

    config: MpsConfig
    uuids: list[str]  # CUDA_VISIBLE_DEVICES, in UUID order
    environment: dict[str, str] = field(default_factory=dict)


def mps_plan(devices: Sequence[cp.PreparedDevice]) -> MpsPlan:
    """The MPS settings of a claim's shared devices (its opaque config, else the defaults),
    their GPU UUIDs, sorted, and a share's consumed memory as its device's pinned limit."""
    sharing = devices[0].config.sharing
    config = (sharing.mps if sharing is not None else None) or MpsConfig()
    uuids = sorted({d.uuid for d in devices})
    shares: dict[str, int] = {}
    for device in devices:
        amount = consumed_memory(device.consumed) if device.share_id is not None else None
        if amount is not None:
            shares[device.uuid] = shares.get(device.uuid, 0) + amount
    if not shares:
        return MpsPlan(config, uuids)
    mib = {uuid: max(1, amount // _MIB) for uuid, amount in shares.items()}
    limits = {
        key: value
        for key, value in config.default_per_device_pinned_memory_limit
        if key not in mib
        and not (key.isdecimal() and int(key) < len(uuids) and uuids[int(key)] in mib)
    }
    limits.update({uuid: f"{n}Mi" for uuid, n in mib.items()})
    config = replace(config, default_per_device_pinned_memory_limit=tuple(sorted(limits.items())))
    value = ",".join(f"{uuids.index(uuid)}={n}M" for uuid, n in sorted(mib.items()))
    return MpsPlan(config, uuids, {PINNED_LIMIT_ENV: value})


def strategy(device: cp.PreparedDevice) -> str | None:
    sharing: Sharing | None = device.config.sharing
    return None if sharing is None else str(sharing.strategy)


def setting(intent: cp.Intent) -> str | None:
    """What a recorded intent holds on its GPU (None: nothing on the GPU itself)."""
    if intent.get("strategy") == TIME_SLICING:
        return f"{TIME_SLICING}/{intent.get('interval')}"
    if intent.get("strategy") == MPS and intent.get("kind") == "gpu":
        return MPS_SHARED if intent.get("share") else MPS
    return None


def describe(setting: str) -> str:
    if setting.startswith(TIME_SLICING):
        return f"time-slicing with interval {setting.partition('/')[2]}"
    if setting == MPS_SHARED:
        return "MPS shares (default compute mode, a daemon per share)"
    return "MPS (exclusive-process mode)"


def recorded_pid(intents: Iterable[cp.Intent]) -> int | None:
    """The daemon pid recorded in MPS intents (None: not recorded)."""
    return next((p for i in intents if isinstance(p := i.get("pid"), int)), None)


def with_pid(intents: tuple[cp.Intent, ...], pid: object) -> tuple[cp.Intent, ...]:
    """``intents`` with the daemon's ``pid`` recorded in the MPS ones."""
    if not isinstance(pid, int):
        return intents
    return tuple(
        cp.Intent(
            i.effector,
            i.device,
            (*((k, v) for k, v in i.parameters if k != "pid"), ("pid", pid)),
        )
        if i.get("strategy") == MPS
        else i
        for i in intents
    )
