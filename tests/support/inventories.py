"""Hand-built inventories of typical nodes, for tests that need a realistic host.

Values are close to real hardware (mig-profiles.md) but tests must not depend on them being
exact: they assert what these builders put in.
"""

from __future__ import annotations

from agent.hardware.inventory import FabricInfo, Gpu, Inventory, MigDevice, MigPlacement, MigProfile

GIB = 2**30
MIB = 2**20
CLUSTER_UUID = "3f2a9c1e-7b4d-4e8a-9c1f-2d5e6f7a8b9c"


def _profile(
    profile_index: int,
    profile_id: int,
    name: str,
    slices: int,
    memory_mib: int,
    sms: int,
    *,
    copy_engines: int,
    decoders: int,
    jpeg: int = 0,
    ofa: int = 0,
    placements: tuple[tuple[int, int], ...],
) -> MigProfile:
    return MigProfile(
        profile_index=profile_index,
        profile_id=profile_id,
        name=name,
        slice_count=slices,
        instance_count=len(placements),
        memory_mib=memory_mib,
        multiprocessors=sms,
        copy_engines=copy_engines,
        decoders=decoders,
        encoders=0,
        jpeg_engines=jpeg,
        ofa_engines=ofa,
        placements=tuple(MigPlacement(start, size) for start, size in placements),
    )


H100_1G = _profile(0, 19, "1g.10gb", 1, 9984, 16, copy_engines=1, decoders=1, jpeg=1,
                   placements=tuple((i, 1) for i in range(7)))  # fmt: skip
H100_1G_ME = _profile(7, 20, "1g.10gb+me", 1, 9984, 16, copy_engines=1, decoders=1, jpeg=1, ofa=1,
                      placements=tuple((i, 1) for i in range(7)))  # fmt: skip
H100_2G = _profile(1, 14, "2g.20gb", 2, 20096, 32, copy_engines=2, decoders=2, jpeg=2,
                   placements=((0, 2), (2, 2), (4, 2)))  # fmt: skip
H100_3G = _profile(2, 9, "3g.40gb", 3, 40320, 60, copy_engines=3, decoders=3, jpeg=3,
                   placements=((0, 4), (4, 4)))  # fmt: skip
H100_7G = _profile(4, 0, "7g.80gb", 7, 80896, 132, copy_engines=8, decoders=7, jpeg=7, ofa=1,
                   placements=((0, 8),))  # fmt: skip
H100_PROFILES = (H100_1G, H100_1G_ME, H100_2G, H100_3G, H100_7G)


def gpu_uuid(minor: int) -> str:
    return f"GPU-5c6a3d1e-{minor:04x}-4b2f-8e7a-0123456789ab"


def mig_uuid(minor: int, gi: int) -> str:
    return f"MIG-9d8c7b6a-{minor:04x}-{gi:04x}-a1b2-c3d4e5f6a7b8"


def h100(minor: int, **changes: object) -> Gpu:
    """An H100 SXM on an NVSwitch baseboard: 8 GPUs per NVLink domain."""
    fields: dict[str, object] = {
        "index": minor,
        "minor": minor,
        "uuid": gpu_uuid(minor),
        "name": "NVIDIA H100 80GB HBM3",
        "brand": "Nvidia",
        "architecture": "Hopper",
        "cuda_compute_capability": (9, 0),
        "pci_bus_id": f"0000:{0x18 + 0x10 * minor:02x}:00.0",
        "memory_bytes": 80 * GIB,
        "pcie_root": f"pci0000:{0x16 + 0x10 * minor:02x}",
        "numa_node": 0 if minor < 4 else 1,
        "mig_capable": True,
        "mig_profiles": H100_PROFILES,
        "nvlink_domain": "nvswitch-domain-0",
        "nvlink_peer_count": 7,
    }
    fields.update(changes)
    return Gpu(**fields)  # type: ignore[arg-type]


def mig(gpu_minor: int, gi: int, profile: MigProfile, start: int) -> MigDevice:
    size = next(p.size for p in profile.placements if p.start == start)
    return MigDevice(
        uuid=mig_uuid(gpu_minor, gi),
        parent_uuid=gpu_uuid(gpu_minor),
        gpu_instance_id=gi,
        compute_instance_id=0,
        profile=profile,
        placement=MigPlacement(start, size),
    )


def inventory(*gpus: Gpu, driver: str = "570.158.01", cuda: str = "12.8") -> Inventory:
    return Inventory(driver_version=driver, cuda_driver_version=cuda, gpus=gpus)


def h100_node(count: int = 8) -> Inventory:
    """8x H100 SXM, MIG disabled everywhere."""
    return inventory(*(h100(minor) for minor in range(count)))


def h100_mixed_mig_node() -> Inventory:
    """GPU 0 whole; GPU 1 split 3g + 2g + 1g; GPU 2 MIG enabled but empty."""
    layout = (
        mig(1, 1, H100_3G, 0),
        mig(1, 2, H100_2G, 4),
        mig(1, 3, H100_1G, 6),
    )
    return inventory(
        h100(0),
        h100(1, mig_enabled=True, mig_devices=layout),
        h100(2, mig_enabled=True),
    )


def gb200_tray() -> Inventory:
    """A GB200 NVL72 compute tray: 4 GPUs whose fabric registration completed."""
    fabric = FabricInfo(cluster_uuid=CLUSTER_UUID, clique_id=32766, state="completed")
    return inventory(
        *(
            h100(
                minor,
                name="NVIDIA GB200",
                architecture="Blackwell",
                cuda_compute_capability=(10, 0),
                memory_bytes=189471 * MIB,
                nvlink_domain=f"{CLUSTER_UUID}.32766",
                nvlink_peer_count=71,
                fabric=fabric,
                mig_profiles=(),
            )
            for minor in range(4)
        ),
        driver="575.57.08",
        cuda="12.9",
    )


def bare_pcie_node() -> Inventory:
    """An L40S-like PCIe GPU where every optional field is unknown."""
    return inventory(
        Gpu(
            index=0,
            minor=0,
            uuid=gpu_uuid(0),
            name="NVIDIA L40S",
            brand="Nvidia",
            architecture="Ada Lovelace",
            cuda_compute_capability=(8, 9),
            pci_bus_id="0000:3b:00.0",
        ),
        driver="565.57",
    )
