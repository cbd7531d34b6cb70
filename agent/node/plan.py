"""What a ResourceClaim asks of this node: the devices to prepare and the config of each.

This is the decision half of a prepare, kept free of I/O so that every refusal (replaced
claim, not allocated, another node's pool, a device this node does not have, an invalid
opaque config, sharing configs that do not fit together) is a plain function of the claim's
JSON and the inventory, tested without files or sockets. The engine applies the plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from agent.dra.config import (
    AllocationResult,
    ConfigError,
    DeviceKind,
    OpaqueConfig,
    effective_configs,
    parse_allocation,
    sharing_problems,
)
from agent.dra.devices import publishable_mig_devices
from agent.dra.names import gpu_device_name, mig_device_name
from agent.dra.partitionable import DynamicMig, MigSlot, partition
from agent.errors import AgentError
from agent.hardware.inventory import Gpu, Inventory, MigDevice
from agent.node.types import ClaimRef


class PrepareRefused(AgentError):
    """This claim cannot be prepared on this node; the message says why, naming the claim."""


@dataclass(frozen=True, slots=True)
class NodeDevice:
    """A device this node publishes, with the hardware behind it."""

    name: str
    kind: DeviceKind
    gpu: Gpu
    mig: MigDevice | None = None  # an existing (static) MIG device
    slot: MigSlot | None = None  # a dynamic MIG device, created on prepare (--dynamic-mig)
    #: The GPU is partitionable (--dynamic-mig): a full-GPU device excludes every MIG device
    #: of its GPU and the other way round; the dynamic MIG effector (agent/mig) checks it.
    partitionable: bool = False


def node_devices(
    inventory: Inventory, *, dynamic_mig: bool | DynamicMig = False
) -> dict[str, NodeDevice]:
    """Every allocatable device of ``inventory`` by name (the same rule as ``dra.devices``).

    ``dynamic_mig`` (True, or the settings with the instances the agent owns): partitionable
    GPUs offer the full GPU (unless static instances hold part of it) and every placement
    still free as devices made on prepare; a static instance (one the agent did not make) is
    a static MIG device, prepared as without the flag and never destroyed."""
    settings = DynamicMig() if dynamic_mig is True else dynamic_mig or None
    found: dict[str, NodeDevice] = {}
    for gpu in inventory.gpus:
        parts = partition(gpu, owned=settings.owned, adopt=settings.adopt) if settings else None
        if parts is not None:
            if parts.full_gpu:
                name = gpu_device_name(gpu.minor)
                found[name] = NodeDevice(name, "gpu", gpu, partitionable=True)
            for slot in parts.slots:
                found[slot.name] = NodeDevice(slot.name, "mig", gpu, slot=slot, partitionable=True)
            for name, mig in parts.static.items():
                found[name] = NodeDevice(name, "mig", gpu, mig)
            continue
        if not gpu.mig_enabled:
            found[gpu_device_name(gpu.minor)] = NodeDevice(gpu_device_name(gpu.minor), "gpu", gpu)
            continue
        for mig in publishable_mig_devices(gpu)[0]:
            name = mig_device_name(
                gpu.minor, mig.profile.name, mig.profile.profile_id, mig.placement.start
            )
            found[name] = NodeDevice(name, "mig", gpu, mig)
    return found


@dataclass(frozen=True, slots=True)
class PlannedDevice:
    """One device of a claim to prepare; a device allocated for several requests appears once."""

    device: NodeDevice
    pool: str
    request_names: tuple[str, ...]  # base request names, in allocation order
    admin_access: bool
    config: OpaqueConfig
    #: KEP-5075: the share of the device this claim holds (None: the whole device), and what
    #: it consumes (capacity name -> quantity)
    share_id: str | None = None
    consumed: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    """Everything the engine needs to prepare one claim."""

    claim: ClaimRef
    devices: tuple[PlannedDevice, ...]

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(planned.device.name for planned in self.devices)


def _object(value: Any) -> Mapping[str, Any]:
    """``value`` if it is a JSON object, else an empty one: a claim whose metadata or status
    is of another type (a bad write, a broken proxy) is then refused by what is missing."""
    return value if isinstance(value, Mapping) else {}


def plan_claim(
    ref: ClaimRef,
    claim: Mapping[str, Any],
    *,
    driver: str,
    pool: str,
    devices: Mapping[str, NodeDevice],
    sharing: bool = False,
) -> ClaimPlan:
    """The devices ``claim`` (the ResourceClaim JSON) asks this node to prepare.

    ``sharing``: the engine applies sharing configs (``agent.sharing``); without it a claim
    asking for sharing is refused. Raises :class:`PrepareRefused` with a message that names
    the claim and the problem.
    """
    subject = f"ResourceClaim {ref.namespace}/{ref.name}"
    metadata = _object(claim.get("metadata"))
    uid = metadata.get("uid")
    if uid != ref.uid:
        raise PrepareRefused(
            f"{subject} got replaced: the kubelet asked for uid {ref.uid}, the API server "
            f"has uid {uid}; the pod must be recreated to use the new claim"
        )
    allocation = _object(claim.get("status")).get("allocation")
    if not isinstance(allocation, Mapping):
        raise PrepareRefused(f"{subject} ({ref.uid}) is not allocated")
    try:
        results, configs = parse_allocation(allocation)
    except ConfigError as error:
        raise PrepareRefused(f"{subject} ({ref.uid}): {error}") from None
    ours = [result for result in results if result.driver == driver and result.pool == pool]
    if not ours:
        pools = sorted({result.pool for result in results if result.driver == driver})
        where = f" (its {driver} devices are in pools {', '.join(pools)})" if pools else ""
        raise PrepareRefused(
            f"{subject} ({ref.uid}) has no device of driver {driver} in pool {pool} "
            f"(this node){where}; it was allocated for another node"
        )
    missing = [result.device for result in ours if result.device not in devices]
    if missing:
        raise PrepareRefused(
            f"{subject} ({ref.uid}): device(s) {', '.join(missing)} of pool {pool} do not exist "
            "on this node (the GPU was removed or its MIG layout changed since allocation); "
            "delete the pod so that the claim is allocated again"
        )
    try:
        chosen = effective_configs(
            ours,
            configs,
            driver,
            lambda _pool, name: devices[name].kind if name in devices else None,
            claim=f"{ref.namespace}/{ref.name}",
        )
    except ConfigError as error:
        raise PrepareRefused(f"{subject} ({ref.uid}): {error}") from None
    for effective in chosen:
        asked = effective.config.sharing
        if asked is not None and not sharing:
            raise PrepareRefused(
                f"{subject} ({ref.uid}): {effective.origin} asks for sharing strategy "
                f"{asked.strategy} on device {effective.result.device}, which this agent "
                "does not apply; remove the sharing section to use the device exclusively"
            )
    problems = sharing_problems(chosen, lambda name: _uuid_of(devices[name]))
    if problems:
        invalid = ConfigError(problems, f"{ref.namespace}/{ref.name}")
        raise PrepareRefused(f"{subject} ({ref.uid}): {invalid}")
    return ClaimPlan(ref, _merge(ours, {e.result: e.config for e in chosen}, devices))


def _uuid_of(device: NodeDevice) -> str:
    if device.slot is not None:
        return ""  # made on prepare
    return device.mig.uuid if device.mig is not None else device.gpu.uuid


def _merge(
    results: list[AllocationResult],
    configs: Mapping[AllocationResult, OpaqueConfig],
    devices: Mapping[str, NodeDevice],
) -> tuple[PlannedDevice, ...]:
    """One planned device per device name (and share: two shares of one device in a claim
    are two devices), its base request names merged in order."""
    merged: dict[tuple[str, str | None], PlannedDevice] = {}
    for result in results:
        key = (result.device, result.share_id)
        previous = merged.get(key)
        if previous is None:
            merged[key] = PlannedDevice(
                devices[result.device],
                result.pool,
                (result.base_request,),
                result.admin_access,
                configs[result],
                result.share_id,
                result.consumed,
            )
            continue
        names = previous.request_names
        if result.base_request not in names:
            names = (*names, result.base_request)
        merged[key] = replace(
            previous,
            request_names=names,
            admin_access=previous.admin_access and result.admin_access,
        )
    return tuple(merged.values())
