"""Hypothesis strategies for hardware inventories and device taints.

They generate any inventory the hardware layer could plausibly report, including the
awkward ones (optional fields missing, values longer than the API allows, MIG enabled with
no MIG devices, fabric registration in any state), so property tests can show that the DRA
model either publishes within the API limits or fails with a DraModelError.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from hypothesis import strategies as st

from agent.dra.model import DeviceTaint
from agent.hardware.inventory import FabricInfo, Gpu, Inventory, MigDevice, MigPlacement, MigProfile

MAX_DEVICES = 300

# One short and one over-long (> 64 characters) value each, to exercise the drop policy.
PRODUCT_NAMES = (
    "NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-40GB",
    "NVIDIA GB200",
    "NVIDIA " + "Z" * 70,
)
BRANDS = ("Nvidia", "Tesla", "NvidiaRTX", "B" * 65)
ARCHITECTURES = ("Hopper", "Ampere", "Blackwell", "Ada Lovelace", "A" * 80)
NVLINK_DOMAINS = ("nvswitch-domain-0", "3f2a9c1e-7b4d-4e8a-9c1f-2d5e6f7a8b9c.7", "d" * 65)
FABRIC_STATES = ("not-supported", "not-started", "in-progress", "completed")
TAINT_KEYS = ("gpu.nvidia.com/xid", "gpu.nvidia.com/ecc", "unhealthy", "example.com/maintenance")
TAINT_VALUES = ("", "79", "48", "double-bit", "a" * 63)


def _profile(
    index: int, pid: int, name: str, slices: int, mem: int, starts: range, size: int
) -> MigProfile:
    return MigProfile(
        profile_index=index,
        profile_id=pid,
        name=name,
        slice_count=slices,
        instance_count=len(starts),
        memory_mib=mem,
        multiprocessors=16 * slices,
        copy_engines=slices,
        decoders=slices,
        encoders=0,
        jpeg_engines=slices,
        ofa_engines=1 if "+me" in name or slices == 7 else 0,
        placements=tuple(MigPlacement(start, size) for start in starts),
    )


PROFILES = (
    _profile(0, 19, "1g.10gb", 1, 9984, range(7), 1),
    _profile(7, 20, "1g.10gb+me", 1, 9984, range(7), 1),
    _profile(9, 15, "1g.20gb", 1, 20096, range(0, 8, 2), 2),
    _profile(1, 14, "2g.20gb", 2, 20096, range(0, 6, 2), 2),
    _profile(2, 9, "3g.40gb", 3, 40320, range(0, 8, 4), 4),
    _profile(3, 5, "4g.40gb", 4, 40320, range(1), 4),
    _profile(4, 0, "7g.80gb", 7, 80896, range(1), 8),
)


@st.composite
def mig_layouts(draw: st.DrawFn, minor: int, parent_uuid: str, salt: str) -> tuple[MigDevice, ...]:
    """A random set of MIG devices with non-overlapping placements on one GPU."""
    used: set[int] = set()
    devices: list[MigDevice] = []
    for profile in draw(st.lists(st.sampled_from(PROFILES), max_size=8)):
        placement = draw(st.sampled_from(profile.placements))
        covered = set(range(placement.start, placement.start + placement.size))
        if covered & used:
            continue
        used |= covered
        gi = len(devices) + 1
        devices.append(
            MigDevice(
                uuid=f"MIG-{uuid.uuid5(uuid.NAMESPACE_OID, f'{salt}/{minor}/{gi}')}",
                parent_uuid=parent_uuid,
                gpu_instance_id=gi,
                compute_instance_id=0,
                profile=profile,
                placement=placement,
            )
        )
    return tuple(devices)


@st.composite
def fabric_infos(draw: st.DrawFn) -> FabricInfo:
    cluster = draw(
        st.sampled_from(
            ("3f2a9c1e-7b4d-4e8a-9c1f-2d5e6f7a8b9c", "00000000-0000-0000-0000-000000000000")
        )
    )
    return FabricInfo(
        cluster_uuid=cluster,
        clique_id=draw(st.integers(0, 2**32 - 1)),
        state=draw(st.sampled_from(FABRIC_STATES)),
        status_ok=draw(st.booleans()),
    )


@st.composite
def gpus(draw: st.DrawFn, minor: int, salt: str, mig_budget: int) -> Gpu:
    """One GPU with random optional fields; at most ``mig_budget`` MIG devices."""
    gpu_uuid = f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, f'{salt}/{minor}')}"
    mig_enabled = draw(st.booleans()) and mig_budget > 0
    layout = draw(mig_layouts(minor, gpu_uuid, salt))[:mig_budget] if mig_enabled else ()
    return Gpu(
        index=minor,
        minor=minor,
        uuid=gpu_uuid,
        name=draw(st.sampled_from(PRODUCT_NAMES)),
        brand=draw(st.sampled_from(BRANDS)),
        architecture=draw(st.sampled_from(ARCHITECTURES)),
        cuda_compute_capability=(draw(st.integers(7, 12)), draw(st.integers(0, 9))),
        pci_bus_id=f"{minor // 256:04x}:{minor % 256:02x}:00.0",
        memory_bytes=draw(st.none() | st.integers(0, 2**40)),
        pcie_root=draw(st.none() | st.just(f"pci0000:{minor % 256:02x}")),
        numa_node=draw(st.none() | st.integers(-1, 7)),
        mig_capable=mig_enabled or draw(st.booleans()),
        mig_enabled=mig_enabled,
        mig_profiles=PROFILES if mig_enabled else (),
        mig_devices=layout,
        nvlink_domain=draw(st.none() | st.sampled_from(NVLINK_DOMAINS)),
        nvlink_peer_count=draw(st.integers(0, 71)),
        fabric=draw(st.none() | fabric_infos()),
    )


@st.composite
def inventories(draw: st.DrawFn, max_devices: int = MAX_DEVICES) -> Inventory:
    """An inventory that yields between 0 and ``max_devices`` DRA devices.

    Minor numbers are unique but not contiguous, so device-name ordering is exercised.
    """
    budget = draw(st.integers(0, min(12, max_devices)) | st.integers(0, max_devices))
    salt = draw(st.text("0123456789abcdef", min_size=4, max_size=4))
    many = budget > 40  # big nodes: mostly whole GPUs, so the example stays cheap to draw
    gpu_list: list[Gpu] = []
    devices = 0
    minor = draw(st.integers(0, 3))
    while devices < budget and len(gpu_list) < max_devices:
        if many and draw(st.integers(0, 9)) > 0:
            gpu = _plain_gpu(minor, salt)
        else:
            gpu = draw(gpus(minor, salt, mig_budget=budget - devices))
        gpu_list.append(gpu)
        devices += len(gpu.mig_devices) if gpu.mig_enabled else 1
        minor += 1 + (draw(st.integers(0, 3)) if not many else 0)
    major = draw(st.integers(400, 999))
    driver = f"{major}.{draw(st.integers(0, 200))}" + draw(st.sampled_from(("", ".01", ".105")))
    cuda = f"{draw(st.integers(10, 13))}.{draw(st.integers(0, 9))}"
    return Inventory(driver_version=driver, cuda_driver_version=cuda, gpus=tuple(gpu_list))


def _plain_gpu(minor: int, salt: str) -> Gpu:
    return Gpu(
        index=minor,
        minor=minor,
        uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, f'{salt}/{minor}')}",
        name=PRODUCT_NAMES[minor % len(PRODUCT_NAMES)],
        brand="Nvidia",
        architecture="Hopper",
        cuda_compute_capability=(9, 0),
        pci_bus_id=f"{minor // 256:04x}:{minor % 256:02x}:00.0",
        memory_bytes=80 * 2**30,
        numa_node=minor % 2,
        nvlink_peer_count=minor % 8,
    )


@st.composite
def device_taints(draw: st.DrawFn) -> DeviceTaint:
    time_added = draw(
        st.none()
        | st.integers(0, 10**9).map(
            lambda s: datetime(2025, 1, 1, tzinfo=UTC) + timedelta(seconds=s)
        )
    )
    return DeviceTaint(
        key=draw(st.sampled_from(TAINT_KEYS)),
        value=draw(st.sampled_from(TAINT_VALUES)),
        effect=draw(st.sampled_from(("NoSchedule", "NoExecute", "None"))),
        time_added=time_added,
    )


@st.composite
def taint_maps(
    draw: st.DrawFn, names: list[str], max_per_device: int = 16
) -> dict[str, list[DeviceTaint]]:
    """Taints for a random subset of ``names`` (plus, sometimes, a name that matches no device)."""
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=20)) if names else []
    if draw(st.booleans()):
        chosen.append("gpu-99999")
    return {name: draw(st.lists(device_taints(), max_size=max_per_device)) for name in chosen}
