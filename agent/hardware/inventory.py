"""Immutable records of what the hardware layer discovered on this host.

These dataclasses are the contract between the hardware layer (which fills them from
NVML and sysfs) and the pure DRA model (which turns them into devices and slices).
Nothing here performs I/O. Optional fields are ``None`` when NVML answered
``NOT_SUPPORTED`` for them: a missing field is omitted from what we publish, never fatal.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class MigPlacement:
    """A position of a GPU instance on the GPU, in memory-slice units (8 per GPU)."""

    start: int
    size: int


@dataclass(frozen=True, slots=True)
class ComputeInstanceProfile:
    """A compute-instance profile offered inside a GPU instance of some profile."""

    profile_index: int  # NVML_COMPUTE_INSTANCE_PROFILE_* enum value
    profile_id: int  # nvmlComputeInstanceProfileInfo_t.id
    slice_count: int
    instance_count: int
    multiprocessors: int


@dataclass(frozen=True, slots=True)
class MigProfile:
    """A GPU-instance profile of one GPU model, with where it may be placed."""

    profile_index: int  # NVML_GPU_INSTANCE_PROFILE_* enum value (0 = 1 slice, 4 = 7 slices, ...)
    profile_id: int  # nvmlGpuInstanceProfileInfo_t.id, the nvidia-smi ID (19, 20, 15, 14, 9, 5, 0)
    name: str  # NVIDIA's profile name, e.g. "1g.10gb", "1g.10gb+me", "7g.80gb"
    slice_count: int
    instance_count: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    placements: tuple[MigPlacement, ...] = ()
    compute_profiles: tuple[ComputeInstanceProfile, ...] = ()


@dataclass(frozen=True, slots=True)
class MigDevice:
    """An existing MIG device (a GPU instance with one compute instance)."""

    uuid: str
    parent_uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: MigProfile
    placement: MigPlacement
    memory_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class NvLink:
    """One NVLink of a GPU as NVML reports it."""

    link: int
    active: bool
    remote_pci_bus_id: str | None  # normalized "0000:18:00.0"; None when unknown
    remote_is_switch: bool  # the far end is an NVSwitch, not a GPU


@dataclass(frozen=True, slots=True)
class FabricInfo:
    """NVLink fabric (IMEX) membership of a GPU, where the GPU supports it."""

    cluster_uuid: str
    clique_id: int
    state: str  # "not-supported" | "not-started" | "in-progress" | "completed"
    status_ok: bool = True

    @property
    def clique(self) -> str:
        """The fabric clique as published: ``<clusterUUID>.<cliqueId>``."""
        return f"{self.cluster_uuid}.{self.clique_id}"


@dataclass(frozen=True, slots=True)
class Gpu:
    """One physical GPU and everything the DRA model may publish about it."""

    index: int
    minor: int
    uuid: str
    name: str  # product name, e.g. "NVIDIA H100 80GB HBM3"
    brand: str  # e.g. "Nvidia", "Tesla"
    architecture: str  # e.g. "Hopper", "Ampere", "Blackwell"
    cuda_compute_capability: tuple[int, int]
    pci_bus_id: str  # normalized lower case "0000:18:00.0"
    memory_bytes: int | None = None
    pcie_root: str | None = None  # e.g. "pci0000:16"
    numa_node: int | None = None
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_profiles: tuple[MigProfile, ...] = ()
    mig_devices: tuple[MigDevice, ...] = ()
    nvlinks: tuple[NvLink, ...] = ()
    nvlink_domain: str | None = None  # same for every GPU of one NVLink-connected group
    nvlink_peer_count: int = 0  # other GPUs reachable over NVLink (directly or via NVSwitch)
    fabric: FabricInfo | None = None


@dataclass(frozen=True, slots=True)
class Inventory:
    """Everything discovered on one host at one point in time."""

    driver_version: str  # e.g. "570.158.01"
    cuda_driver_version: str  # "major.minor", e.g. "12.8"
    gpus: tuple[Gpu, ...] = field(default_factory=tuple)
    # GPUs NVML could not read (e.g. fallen off the bus): left out, each with the reason
    unreadable_gpus: tuple[str, ...] = ()

    def gpu_by_uuid(self, uuid: str) -> Gpu | None:
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        return None
