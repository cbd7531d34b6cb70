"""The prepare engine's vocabulary, shared by the kubelet surface and the engine.

The kubelet surface (gRPC, either DRA API version) converts wire messages into these
records and back; the engine never sees protobuf types, and the surface never sees the
checkpoint or CDI files.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A ResourceClaim as the kubelet names it in NodePrepare/NodeUnprepareResources."""

    namespace: str
    uid: str
    name: str


@dataclass(frozen=True, slots=True)
class PreparedDeviceResult:
    """One prepared device as the kubelet needs it (the wire ``Device`` message)."""

    request_names: tuple[str, ...]  # base request names ("req", never "req/sub")
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]  # fully qualified, vendor/class=name
    share_id: str | None = None  # KEP-5075: the allocation's shareID, echoed (v1 share_id)


@dataclass(frozen=True, slots=True)
class ClaimPrepareResult:
    """The outcome for one claim: its devices, or an error that names what went wrong."""

    devices: tuple[PreparedDeviceResult, ...] = ()
    error: str | None = None
