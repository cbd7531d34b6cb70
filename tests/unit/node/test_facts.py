"""Host facts: the common CDI spec names the driver's files by their host paths."""

from __future__ import annotations

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
