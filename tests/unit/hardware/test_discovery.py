"""Discovery of every shipped profile through the real pynvml bindings on the simulated library."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.hardware.discovery import discover_host, format_cuda_version
from agent.hardware.inventory import Inventory, MigPlacement
from agent.hardware.simulated import shipped_profiles

pytestmark = pytest.mark.anyio


async def discover_profile(name: str, tmp_path: Path) -> Inventory:
    return await discover_host(name, tmp_path / name)


def placements(*pairs: tuple[int, int]) -> tuple[MigPlacement, ...]:
    return tuple(MigPlacement(start, size) for start, size in pairs)


def test_cuda_version_format() -> None:
    assert format_cuda_version(12080) == "12.8"
    assert format_cuda_version(13000) == "13.0"
    assert format_cuda_version(12040) == "12.4"


def test_every_shipped_profile_is_listed() -> None:
    assert set(shipped_profiles()) >= {
        "dgx-h100", "dgx-a100", "gb200-nvl72-tray", "l40s-pcie", "h200-nvl-bridged", "big-mig-host",
    }  # fmt: skip


async def test_dgx_h100(tmp_path: Path) -> None:
    inventory = await discover_profile("dgx-h100", tmp_path)
    assert inventory.driver_version == "570.158.01"
    assert inventory.cuda_driver_version == "12.8"
    gpus = inventory.gpus
    assert len(gpus) == 8
    assert {g.name for g in gpus} == {"NVIDIA H100 80GB HBM3"}
    assert {g.architecture for g in gpus} == {"Hopper"}
    assert {g.cuda_compute_capability for g in gpus} == {(9, 0)}
    assert {g.memory_bytes for g in gpus} == {80 * 2**30}
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len({g.pcie_root for g in gpus}) == 8
    assert gpus[0].pci_bus_id == "0000:18:00.0"
    assert gpus[0].pcie_root == "pci0000:15"
    assert [g.minor for g in gpus] == list(range(8))
    assert all(g.mig_capable and not g.mig_enabled and not g.mig_devices for g in gpus)
    domains = {g.nvlink_domain for g in gpus}
    assert len(domains) == 1 and None not in domains
    assert {g.nvlink_peer_count for g in gpus} == {7}
    assert all(len(g.nvlinks) == 18 and all(n.remote_is_switch for n in g.nvlinks) for g in gpus)
    assert all(g.fabric is None for g in gpus)


async def test_h100_mig_profiles_follow_the_tables(tmp_path: Path) -> None:
    gpu = (await discover_profile("dgx-h100", tmp_path)).gpus[0]
    profiles = {p.name: p for p in gpu.mig_profiles}
    assert list(profiles) == [
        "1g.10gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
        "1g.10gb+me",
        "1g.20gb",
    ]  # fmt: skip (listed in NVML profile-enum order)
    expected = {  # name: (id, slices, instances, SMs)
        "1g.10gb": (19, 1, 7, 16), "1g.10gb+me": (20, 1, 1, 16), "1g.20gb": (15, 1, 4, 26),
        "2g.20gb": (14, 2, 3, 32), "3g.40gb": (9, 3, 2, 60), "4g.40gb": (5, 4, 1, 64),
        "7g.80gb": (0, 7, 1, 132),
    }  # fmt: skip
    for name, (pid, slices, instances, sms) in expected.items():
        p = profiles[name]
        assert (p.profile_id, p.slice_count, p.instance_count, p.multiprocessors) == (
            pid, slices, instances, sms,
        ), name  # fmt: skip
    assert profiles["1g.10gb"].placements == placements(*((s, 1) for s in range(7)))
    assert profiles["1g.20gb"].placements == placements((0, 2), (2, 2), (4, 2), (6, 2))
    assert profiles["2g.20gb"].placements == placements((0, 2), (2, 2), (4, 2))
    assert profiles["3g.40gb"].placements == placements((0, 4), (4, 4))
    assert profiles["4g.40gb"].placements == placements((0, 4))
    assert profiles["7g.80gb"].placements == placements((0, 8))
    assert profiles["7g.80gb"].copy_engines == 8
    assert profiles["1g.10gb"].jpeg_engines == 1 and profiles["1g.10gb"].ofa_engines == 0
    assert profiles["1g.10gb+me"].ofa_engines == 1
    assert profiles["3g.40gb"].memory_mib == 40448
    # Read-only discovery cannot ask for CI profiles without a GPU instance.
    assert all(p.compute_profiles == () for p in profiles.values())


async def test_dgx_a100_static_mig(tmp_path: Path) -> None:
    inventory = await discover_profile("dgx-a100", tmp_path)
    gpus = inventory.gpus
    assert len(gpus) == 8 and all(g.mig_enabled for g in gpus)
    assert {g.architecture for g in gpus} == {"Ampere"}
    assert sum(len(g.mig_devices) for g in gpus) == 42
    first = gpus[0].mig_devices
    assert [d.profile.name for d in first] == ["1g.10gb"] * 7
    assert tuple(d.placement for d in first) == placements(*((s, 1) for s in range(7)))
    assert [(d.gpu_instance_id, d.compute_instance_id) for d in first] == [
        (i, 0) for i in range(1, 8)
    ]
    assert all(d.uuid.startswith("MIG-") and d.parent_uuid == gpus[0].uuid for d in first)
    assert len({d.uuid for g in gpus for d in g.mig_devices}) == 42
    mixed = gpus[4].mig_devices
    assert [(d.profile.name, d.placement) for d in mixed] == [
        ("3g.40gb", MigPlacement(0, 4)),
        ("2g.20gb", MigPlacement(4, 2)),
        ("1g.10gb", MigPlacement(6, 1)),
    ]
    assert mixed[0].memory_bytes == 40192 * 2**20
    cis = {c.slice_count: c for c in mixed[0].profile.compute_profiles}
    assert sorted(cis) == [1, 2, 3]
    assert (cis[1].instance_count, cis[1].multiprocessors) == (3, 14)
    assert (cis[3].profile_id, cis[3].multiprocessors) == (2, 42)


async def test_dgx_a100_discovery_is_stable(tmp_path: Path) -> None:
    first = await discover_host("dgx-a100", tmp_path / "a")
    second = await discover_host("dgx-a100", tmp_path / "b")
    assert first == second


async def test_gb200_fabric_clique(tmp_path: Path) -> None:
    gpus = (await discover_profile("gb200-nvl72-tray", tmp_path)).gpus
    assert len(gpus) == 4
    assert {g.architecture for g in gpus} == {"Blackwell"}
    assert {g.cuda_compute_capability for g in gpus} == {(10, 0)}
    fabric = gpus[0].fabric
    assert fabric is not None
    assert fabric.clique == "6f1a3c2e-9b4d-4e7a-8c21-3d5f7a9b1c0e.32766"
    assert fabric.state == "completed" and fabric.status_ok
    assert {g.fabric for g in gpus} == {fabric}
    assert {g.nvlink_peer_count for g in gpus} == {3}
    assert [g.numa_node for g in gpus] == [0, 0, 1, 1]
    assert gpus[0].pcie_root == "pci0008:00" and gpus[0].pci_bus_id == "0008:01:00.0"


async def test_l40s_has_no_mig_nvlink_or_fabric(tmp_path: Path) -> None:
    gpus = (await discover_profile("l40s-pcie", tmp_path)).gpus
    assert len(gpus) == 4
    assert {g.name for g in gpus} == {"NVIDIA L40S"}
    assert {g.architecture for g in gpus} == {"Ada Lovelace"}
    assert {g.cuda_compute_capability for g in gpus} == {(8, 9)}
    assert {g.memory_bytes for g in gpus} == {48 * 2**30}
    for gpu in gpus:
        assert not gpu.mig_capable and not gpu.mig_enabled and gpu.mig_profiles == ()
        assert gpu.nvlinks == () and gpu.nvlink_domain is None and gpu.nvlink_peer_count == 0
        assert gpu.fabric is None


async def test_h200_nvl_bridges_make_two_domains(tmp_path: Path) -> None:
    gpus = (await discover_profile("h200-nvl-bridged", tmp_path)).gpus
    assert {g.name for g in gpus} == {"NVIDIA H200 NVL"}
    assert {g.nvlink_peer_count for g in gpus} == {1}
    assert gpus[0].nvlink_domain == gpus[1].nvlink_domain
    assert gpus[2].nvlink_domain == gpus[3].nvlink_domain
    assert gpus[0].nvlink_domain != gpus[2].nvlink_domain
    assert all(not link.remote_is_switch for link in gpus[0].nvlinks)
    assert {link.remote_pci_bus_id for link in gpus[0].nvlinks} == {gpus[1].pci_bus_id}
    assert {p.name for p in gpus[0].mig_profiles} >= {"1g.18gb", "7g.141gb"}


async def test_big_mig_host_has_more_than_128_devices(tmp_path: Path) -> None:
    gpus = (await discover_profile("big-mig-host", tmp_path)).gpus
    assert len(gpus) == 24
    assert sum(len(g.mig_devices) for g in gpus) == 168
    assert {g.numa_node for g in gpus} == {0, 1}
