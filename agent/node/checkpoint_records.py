"""The checkpoint's records: prepared claims and devices, their intents, and the whole
document of one boot (``agent.node.checkpoint`` documents them and holds their encoding)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from agent.dra import cdi
from agent.dra.config import DeviceKind, OpaqueConfig
from agent.node.errors import NodeError


class ClaimState(StrEnum):
    PREPARE_STARTED = "PrepareStarted"
    PREPARE_COMPLETED = "PrepareCompleted"


@dataclass(frozen=True)
class MigInstance:
    """The live MIG instance behind a mig device, and its capability device numbers."""

    parent_uuid: str
    gi_id: int
    ci_id: int
    caps_major: int  # the nvidia-caps major of /proc/devices
    gi_cap_minor: int  # minor of /dev/nvidia-caps/nvidia-cap<N> for the GPU instance
    ci_cap_minor: int  # ... and for the compute instance


@dataclass(frozen=True)
class MpsShare:
    """The MPS control daemon a device is shared through (``agent.sharing``): the host
    directories its containers get (CDI), recorded so that the spec can be rebuilt."""

    pipe_dir: str
    log_dir: str
    shm_dir: str


@dataclass(frozen=True)
class Intent:
    """A hardware change an effector makes for one device of a claim, recorded before it.

    ``parameters`` are the effector's own (for MIG: the parent GPU's UUID, the GPU-instance
    profile and placement); the checkpoint only checks that they are strings or non-negative
    integers, kept in key order so that equal intents compare equal.
    """

    effector: str
    device: str
    parameters: tuple[tuple[str, str | int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "parameters", tuple(sorted(self.parameters)))

    def get(self, key: str) -> str | int | None:
        return next((value for name, value in self.parameters if name == key), None)

    def integer(self, key: str) -> int:
        value = self.get(key)
        if not isinstance(value, int):
            raise NodeError(f"intent of {self.device}: parameter {key} is not an integer")
        return value

    def string(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str):
            raise NodeError(f"intent of {self.device}: parameter {key} is not a string")
        return value


@dataclass(frozen=True)
class PreparedDevice:
    """One prepared device: the kubelet's view of it plus what is needed to undo it."""

    requests: tuple[str, ...]  # base request names
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    kind: DeviceKind
    uuid: str  # GPU UUID, or MIG UUID for a mig device
    gpu_minor: int  # /dev/nvidia<minor>; the parent GPU's minor for a mig device
    config: OpaqueConfig
    mig: MigInstance | None = None
    # Prepared for an ``adminAccess`` request: it does not hold the device exclusively.
    # Stored as ``adminAccess`` only when true, so files without admin devices stay
    # readable by agents that predate the field (a rollback of a rolling upgrade).
    admin_access: bool = False
    # Shared through an MPS daemon; stored as ``mps`` only when set (like ``adminAccess``).
    mps: MpsShare | None = None
    # KEP-5075: the share of the device this claim holds (``shareID``; None: the whole
    # device) and what it consumes (``consumedCapacity``, name -> quantity), stored only when
    # set. A shared device is held by several claims at once; a share never holds it alone.
    share_id: str | None = None
    consumed: tuple[tuple[str, str], ...] = ()

    def cdi_device(self) -> cdi.ClaimDevice:
        """The input of ``cdi.claim_spec`` for this device."""
        caps = None
        if self.mig is not None:
            caps = cdi.MigCapabilities(
                self.mig.caps_major, self.mig.gi_cap_minor, self.mig.ci_cap_minor
            )
        mps = None
        if self.mps is not None:
            mps = cdi.MpsDirectories(self.mps.pipe_dir, self.mps.log_dir, self.mps.shm_dir)
        return cdi.ClaimDevice(self.cdi_name, self.gpu_minor, caps, mps)

    @property
    def cdi_name(self) -> str:
        """The device's part of its CDI device name: ``<device>``, ``<device>-<shareID>``
        for a share (two shares of one device in a claim are two CDI devices)."""
        return self.device if self.share_id is None else f"{self.device}-{self.share_id}"


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    state: ClaimState
    devices: tuple[PreparedDevice, ...] = ()
    cdi_spec_file: str | None = None
    #: Hardware changes made (or about to be made) for this claim; see the module docstring.
    intents: tuple[Intent, ...] = ()


@dataclass(frozen=True)
class Checkpoint:
    """All prepared claims of one boot; ``claims`` is read-only, keyed by claim UID."""

    boot_id: str
    claims: Mapping[str, PreparedClaim] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "claims", MappingProxyType(dict(self.claims)))

    def completed(self) -> tuple[PreparedClaim, ...]:
        return tuple(c for c in self.claims.values() if c.state is ClaimState.PREPARE_COMPLETED)
