"""Host facts: the common CDI spec names the driver's files by their host paths."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import anyio

from agent.hardware.discovery import discover_host
from agent.node.facts import HostFacts


def _mount_paths(facts: HostFacts) -> list[str]:
    edits = facts.common_spec["devices"][0]["containerEdits"]
    return [m["hostPath"] for m in edits.get("mounts", [])]


def test_driver_files_are_named_by_their_host_paths(tmp_path: Path) -> None:
    host = tmp_path / "host"
    inventory = anyio.run(discover_host, "dgx-h100", host)
    # the driver root as a container sees it: the host's tree mounted somewhere else
    mounted = tmp_path / "driver-root"
    shutil.copytree(host / "driver-root", mounted, symlinks=True)
    on_host = Path("/run/nvidia/driver")

    facts = HostFacts.read("gpu.nvidia.com", "node-a", inventory, host, on_host, mounted)

    paths = _mount_paths(facts)
    assert paths, "the simulated driver root has libraries and nvidia-smi"
    assert all(p.startswith("/run/nvidia/driver/") for p in paths), paths
    assert any(p.endswith("/nvidia-smi") for p in paths)
    assert any("libnvidia-ml.so" in p for p in paths)


def test_without_a_mount_the_driver_root_is_read_where_it_is(tmp_path: Path) -> None:
    host = tmp_path / "host"
    inventory = anyio.run(discover_host, "dgx-h100", host)
    facts = HostFacts.read("gpu.nvidia.com", "node-a", inventory, host, host / "driver-root")
    paths = _mount_paths(facts)
    assert paths and all(p.startswith(str(host / "driver-root")) for p in paths)
    # nothing is found where the driver root is not mounted
    elsewhere = HostFacts.read(
        "gpu.nvidia.com", "node-a", inventory, host, Path("/run/nvidia/driver"), tmp_path / "x"
    )
    assert _mount_paths(elsewhere) == []


def test_control_nodes_symlinked_libraries_and_the_ldcache_hook(tmp_path: Path) -> None:
    host = tmp_path / "host"
    inventory = anyio.run(discover_host, "dgx-h100", host)
    driver_root = host / "driver-root"
    lib = driver_root / "usr/lib/x86_64-linux-gnu"
    (lib / "libnvidia-gone.so.1").symlink_to("libnvidia-gone.so.999")  # names nothing
    (lib / "libnvidia-out.so.1").symlink_to("/etc/hostname")  # leaves the driver root
    facts = HostFacts.read(
        "gpu.nvidia.com", "node-a", inventory, host, driver_root, ldconfig="/sbin/ldconfig"
    )
    edits = facts.common_spec["devices"][0]["containerEdits"]
    mounts = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
    version = "570.158.01"
    target = str(lib / f"libcuda.so.{version}")
    # a soname link is mounted as the file it names, under its own name
    assert mounts["/usr/lib/x86_64-linux-gnu/libcuda.so.1"] == target
    assert mounts[f"/usr/lib/x86_64-linux-gnu/libcuda.so.{version}"] == target
    assert not [p for p in mounts if "gone" in p or "-out" in p]
    [hook] = edits["hooks"]
    assert hook["args"][-2:] == ["/sbin/ldconfig", "/usr/lib/x86_64-linux-gnu"]
    nodes = {n["path"]: n for n in edits["deviceNodes"]}
    assert set(nodes) == {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
    if os.geteuid() == 0:  # the simulated nodes are character devices: numbers in the spec
        assert nodes["/dev/nvidiactl"] == {
            "path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255,
        }  # fmt: skip
    without = HostFacts.read("gpu.nvidia.com", "node-a", inventory, host, driver_root)
    assert "hooks" not in without.common_spec["devices"][0]["containerEdits"]
