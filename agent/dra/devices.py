"""Turn a hardware inventory into the DRA devices this node publishes.

This is where the agent decides what is allocatable: a GPU with MIG disabled is one
``gpu-<minor>`` device, a GPU with MIG enabled offers its existing MIG devices (static MIG)
and nothing else. Names, attributes and capacities match the incumbent NVIDIA driver
(nvidia-driver-facts.md §2.2-2.3) so existing claims keep working, plus the topology the
incumbent does not publish (NUMA node, NVLink domain and peer count, fabric clique; §13) so
a claim can ask for GPUs that talk to each other fast.

Values that break an API limit are handled by one policy: identity and version attributes
(``uuid``, ``parentUUID``, ``pciBusID``, ``profile``, the versions) raise, because a device
without them must not be published; descriptive attributes (product name, brand,
architecture, PCIe root, NVLink domain, fabric clique) that are too long are dropped and the
reason is reported in :attr:`DeviceSet.dropped`. Nothing is ever truncated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.dra import limits
from agent.dra.errors import (
    DraModelError,
    DuplicateDeviceError,
    InvalidValueError,
    LimitExceededError,
)
from agent.dra.model import (
    Capacity,
    CounterConsumption,
    CounterSet,
    DeviceAttribute,
    DeviceTaint,
    DraDevice,
)
from agent.dra.names import device_sort_key, gpu_device_name, mig_device_name, semver_from_numeric
from agent.dra.partitionable import DynamicMig, MigSlot, partition, slot_consumption
from agent.dra.share_mode import SharesMode
from agent.dra.shares import share_device
from agent.hardware.inventory import Gpu, Inventory, MigDevice, MigPlacement, MigProfile

#: Standard attribute names defined by Kubernetes (``k8s.io/dynamic-resource-allocation/deviceattribute``).
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
NUMA_NODE = "resource.kubernetes.io/numaNode"

_ZERO_UUIDS = frozenset({"", "00000000-0000-0000-0000-000000000000"})


@dataclass(frozen=True, slots=True)
class DroppedAttribute:
    """An optional attribute left out of a device, and why."""

    device: str
    attribute: str
    reason: str


@dataclass(frozen=True, slots=True)
class DeviceSet:
    """The devices of one node, plus what the caller should warn about."""

    devices: tuple[DraDevice, ...]
    #: Optional attributes that were left out because their value breaks an API limit.
    dropped: tuple[DroppedAttribute, ...] = ()
    #: UUIDs of GPUs with MIG enabled but no MIG device: their capacity is not allocatable.
    stranded_gpus: tuple[str, ...] = ()
    #: Names in the ``taints`` argument that match no device (ignored).
    unknown_taint_targets: tuple[str, ...] = ()
    #: MIG layouts that are not published, each with the reason.
    unpublished_mig: tuple[str, ...] = ()
    #: ``--dynamic-mig``: the counter set of every partitionable GPU, by GPU minor.
    counter_sets: tuple[CounterSet, ...] = ()
    #: ``--dynamic-mig``: MIG placements not published, each with the reason (static
    #: instances hold what they need).
    held_back: tuple[str, ...] = ()


def publishable_mig_devices(gpu: Gpu) -> tuple[list[MigDevice], list[str]]:
    """The MIG devices of ``gpu`` that are published, and why the others are not.

    A MIG device is published when it is the only compute instance of its GPU instance.
    A GPU instance split into several compute instances (``nvidia-smi mig -cci``) is left
    out: the device name (profile, GPU-instance profile id, placement start) would be the
    same for each of them, and each would claim the whole instance's capacity.
    """
    per_instance: dict[int, list[MigDevice]] = {}
    for mig in gpu.mig_devices:
        per_instance.setdefault(mig.gpu_instance_id, []).append(mig)
    published: list[MigDevice] = []
    reasons: list[str] = []
    for gi, devices in per_instance.items():
        if len(devices) == 1:
            published.append(devices[0])
        else:
            reasons.append(
                f"GPU {gpu.minor} ({gpu.uuid}): GPU instance {gi} ({devices[0].profile.name}) is "
                f"split into {len(devices)} compute instances; only a GPU instance with one "
                "compute instance is published"
            )
    return published, reasons


def build_devices(
    inventory: Inventory,
    *,
    taints: Mapping[str, Sequence[DeviceTaint]] | None = None,
    max_taints_per_device: int = limits.MAX_TAINTS_PER_DEVICE,
    dynamic_mig: DynamicMig | None = None,
    shares: SharesMode | None = None,
) -> list[DraDevice]:
    """The devices of ``inventory``, sorted by name; see :func:`build_device_set`."""
    return list(
        build_device_set(
            inventory,
            taints=taints,
            max_taints_per_device=max_taints_per_device,
            dynamic_mig=dynamic_mig,
            shares=shares,
        ).devices
    )


def build_device_set(
    inventory: Inventory,
    *,
    taints: Mapping[str, Sequence[DeviceTaint]] | None = None,
    max_taints_per_device: int = limits.MAX_TAINTS_PER_DEVICE,
    dynamic_mig: DynamicMig | None = None,
    shares: SharesMode | None = None,
) -> DeviceSet:
    """Build every allocatable device of ``inventory``.

    ``taints`` maps device names to the taints to publish on them (health decides). The
    default limit of 16 taints per device is the API's on 1.35+; pass
    ``limits.MAX_TAINTS_PER_DEVICE_1_34`` (4) for a 1.34 API server. Raises a
    :class:`DraModelError` subclass naming the device when the inventory cannot be
    published (duplicate names, invalid versions, too many taints).

    With ``dynamic_mig`` (``--dynamic-mig``) every partitionable GPU is published as
    KEP-4815 partitionable devices: its counter set (in :attr:`DeviceSet.counter_sets`),
    the full GPU and every MIG placement consuming from it (``agent.dra.partitionable``).
    With ``shares`` (``--consumable-shares``) full GPUs and static MIG devices may be
    allocated to several claims at once (``agent.dra.shares``).
    """
    common = _InventoryVersions.of(inventory)
    dropped: list[DroppedAttribute] = []
    stranded: list[str] = []
    unpublished: list[str] = []
    built: list[DraDevice] = []
    counter_sets: list[CounterSet] = []
    held_back: list[str] = []
    for gpu in inventory.gpus:
        split = (
            None
            if dynamic_mig is None
            else partition(gpu, owned=dynamic_mig.owned, adopt=dynamic_mig.adopt)
        )
        if split is not None:
            if split.full_gpu or split.slots:  # static instances alone consume nothing
                counter_sets.append(split.counters)
            held_back += [f"{name}: {why}" for name, why in split.held_back]
            if split.full_gpu:
                built.append(
                    _full_gpu_device(gpu, common, dropped, (split.full_gpu_consumption(),))
                )
            for slot in split.slots:
                built.append(_slot_device(gpu, slot, common, dropped))
            for mig in split.static.values():
                built.append(_mig_device(gpu, mig, common, dropped))
            continue
        if not gpu.mig_enabled:
            built.append(_full_gpu_device(gpu, common, dropped))
            continue
        if not gpu.mig_devices:
            stranded.append(gpu.uuid)
        migs, reasons = publishable_mig_devices(gpu)
        unpublished += reasons
        for mig in migs:
            built.append(_mig_device(gpu, mig, common, dropped))

    by_name: dict[str, DraDevice] = {}
    for device in built:
        if device.name in by_name:
            raise DuplicateDeviceError(
                f"two devices are named {device.name!r}; GPU minor numbers and MIG placements "
                "must be unique on a node (check the hardware inventory)"
            )
        by_name[device.name] = device

    wanted = taints or {}
    for name, device_taints in wanted.items():
        if name not in by_name or not device_taints:
            continue
        if len(device_taints) > max_taints_per_device:
            raise LimitExceededError(
                f"device {name!r} would carry {len(device_taints)} taints; at most "
                f"{max_taints_per_device} are allowed for the target Kubernetes version"
            )
        by_name[name] = by_name[name].with_taints(tuple(device_taints))
    if shares is not None:
        by_name = {name: share_device(device, shares) for name, device in by_name.items()}

    return DeviceSet(
        devices=tuple(by_name[name] for name in sorted(by_name, key=device_sort_key)),
        dropped=tuple(dropped),
        stranded_gpus=tuple(stranded),
        unknown_taint_targets=tuple(sorted(name for name in wanted if name not in by_name)),
        unpublished_mig=tuple(unpublished),
        counter_sets=tuple(counter_sets),
        held_back=tuple(held_back),
    )


@dataclass(frozen=True, slots=True)
class _InventoryVersions:
    driver_version: DeviceAttribute
    cuda_driver_version: DeviceAttribute

    @classmethod
    def of(cls, inventory: Inventory) -> _InventoryVersions:
        try:
            return cls(
                DeviceAttribute.of_version(semver_from_numeric(inventory.driver_version)),
                DeviceAttribute.of_version(semver_from_numeric(inventory.cuda_driver_version)),
            )
        except InvalidValueError as error:
            raise InvalidValueError(f"driver/CUDA version of this node: {error}") from None


class _DeviceBuilder:
    """Collects one device's attributes and capacities, applying the drop policy."""

    def __init__(self, name: str, dropped: list[DroppedAttribute]) -> None:
        self.name = name
        self.attributes: dict[str, DeviceAttribute] = {}
        self.capacity: dict[str, Capacity] = {}
        self._dropped = dropped

    def required(self, attribute: str, value: DeviceAttribute | str) -> None:
        """An identity attribute: a bad value is an error naming the device."""
        try:
            self.attributes[attribute] = (
                DeviceAttribute.of_string(value) if isinstance(value, str) else value
            )
        except InvalidValueError as error:
            raise InvalidValueError(
                f"device {self.name!r}: required attribute {attribute!r}: {error}"
            ) from None

    def optional(self, attribute: str, value: str | None) -> None:
        """A descriptive string attribute: omitted when unknown, dropped when too long."""
        if value is None:
            return
        if len(value) > limits.MAX_ATTRIBUTE_VALUE_LENGTH:
            self._dropped.append(
                DroppedAttribute(
                    self.name,
                    attribute,
                    f"value has {len(value)} characters, the API allows "
                    f"{limits.MAX_ATTRIBUTE_VALUE_LENGTH}: {value[:20]!r}...",
                )
            )
            return
        self.attributes[attribute] = DeviceAttribute.of_string(value)

    def build(self, consumes: tuple[CounterConsumption, ...] = ()) -> DraDevice:
        return DraDevice(
            self.name, dict(self.attributes), dict(self.capacity), consumes_counters=consumes
        )


def _gpu_attributes(builder: _DeviceBuilder, gpu: Gpu, versions: _InventoryVersions) -> None:
    """The attributes a full GPU and its MIG devices share (those of the physical GPU)."""
    major, minor = gpu.cuda_compute_capability
    builder.optional("productName", gpu.name)
    builder.optional("brand", gpu.brand)
    builder.optional("architecture", gpu.architecture)
    builder.required("cudaComputeCapability", DeviceAttribute.of_version(f"{major}.{minor}.0"))
    builder.required("driverVersion", versions.driver_version)
    builder.required("cudaDriverVersion", versions.cuda_driver_version)
    builder.required(PCI_BUS_ID, gpu.pci_bus_id)
    builder.optional(PCIE_ROOT, gpu.pcie_root)
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        builder.attributes[NUMA_NODE] = DeviceAttribute.of_int(gpu.numa_node)
    builder.optional("nvlinkDomain", gpu.nvlink_domain or None)
    builder.attributes["nvlinkPeerCount"] = DeviceAttribute.of_int(gpu.nvlink_peer_count)
    builder.optional("fabricClique", fabric_clique(gpu))


def fabric_clique(gpu: Gpu) -> str | None:
    """The GPU's fabric clique ``<clusterUUID>.<cliqueId>``, or None when it has no usable one.

    Usable means the fabric registration completed successfully and the cluster UUID is not
    all zeros, the same test the incumbent applies before it trusts a clique id (§6.5).
    """
    fabric = gpu.fabric
    if fabric is None or fabric.state != "completed" or not fabric.status_ok:
        return None
    if fabric.cluster_uuid.lower() in _ZERO_UUIDS:
        return None
    return fabric.clique


def _full_gpu_device(
    gpu: Gpu,
    versions: _InventoryVersions,
    dropped: list[DroppedAttribute],
    consumes: tuple[CounterConsumption, ...] = (),
) -> DraDevice:
    builder = _DeviceBuilder(gpu_device_name(gpu.minor), dropped)
    builder.required("type", "gpu")
    builder.required("uuid", gpu.uuid)
    _gpu_attributes(builder, gpu, versions)
    if gpu.memory_bytes is not None:
        builder.capacity["memory"] = gpu.memory_bytes
    return builder.build(consumes)


def _slot_device(
    gpu: Gpu, slot: MigSlot, versions: _InventoryVersions, dropped: list[DroppedAttribute]
) -> DraDevice:
    """A MIG device that does not exist yet (``--dynamic-mig``): the attributes of a static
    MIG device but ``uuid`` (the instance gets one when a claim is prepared), and the
    counters it consumes."""
    _check_placement(slot.name, slot.placement)
    builder = _DeviceBuilder(slot.name, dropped)
    builder.required("type", "mig")
    builder.required("parentUUID", gpu.uuid)
    builder.required("profile", slot.profile.name)
    _gpu_attributes(builder, gpu, versions)
    _mig_capacity(builder, slot.profile, slot.placement)
    return builder.build((slot_consumption(slot),))


def _check_placement(name: str, placement: MigPlacement) -> None:
    if placement.start < 0 or placement.size < 1:
        raise InvalidValueError(
            f"MIG device {name!r}: placement start {placement.start}, size {placement.size} "
            "is not a valid memory-slice range"
        )


def _mig_capacity(builder: _DeviceBuilder, profile: MigProfile, placement: MigPlacement) -> None:
    builder.capacity.update(
        {
            "multiprocessors": profile.multiprocessors,
            "copyEngines": profile.copy_engines,
            "decoders": profile.decoders,
            "encoders": profile.encoders,
            "jpegEngines": profile.jpeg_engines,
            "ofaEngines": profile.ofa_engines,
            "memory": profile.memory_mib * 2**20,
        }
    )
    for index in range(placement.start, placement.start + placement.size):
        builder.capacity[f"memorySlice{index}"] = 1


def _mig_device(
    gpu: Gpu, mig: MigDevice, versions: _InventoryVersions, dropped: list[DroppedAttribute]
) -> DraDevice:
    profile, placement = mig.profile, mig.placement
    name = mig_device_name(gpu.minor, profile.name, profile.profile_id, placement.start)
    if mig.parent_uuid != gpu.uuid:
        raise DraModelError(
            f"MIG device {name!r} ({mig.uuid}) names parent {mig.parent_uuid!r} but was found "
            f"on GPU {gpu.uuid!r}; the hardware inventory is inconsistent"
        )
    _check_placement(name, placement)
    builder = _DeviceBuilder(name, dropped)
    builder.required("type", "mig")
    builder.required("uuid", mig.uuid)
    builder.required("parentUUID", mig.parent_uuid)
    builder.required("profile", profile.name)
    _gpu_attributes(builder, gpu, versions)
    _mig_capacity(builder, profile, placement)
    return builder.build()
