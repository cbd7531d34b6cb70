"""Lay out the files of a simulated host under a directory standing in for ``/``.

Discovery reads sysfs, procfs and /dev through a configurable host root; in simulation that root
is a temporary directory holding the same paths a real NVIDIA host has, so the readers are
exercised exactly as in production.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from agent.hardware.simulated.profile import HostProfile
from agent.hardware.simulated.state import HostState

NVIDIA_MAJOR = 195
NVIDIA_UVM_MAJOR = 508
NVIDIA_CAPS_MAJOR = 510
CAPS_PER_GPU = 135  # 15 GPU instances x (1 GI + 8 CI) capability files
CAPS_FIRST = 3  # 1 and 2 are mig/config and mig/monitor
CAPS_MODE = 292  # 0444


def gi_capability_minor(gpu_minor: int, gi_id: int) -> int:
    """The nvidia-caps minor of a GPU instance's access file (``mig-minors`` layout)."""
    return CAPS_FIRST + gpu_minor * CAPS_PER_GPU + gi_id * 9


def ci_capability_minor(gpu_minor: int, gi_id: int, ci_id: int) -> int:
    """The nvidia-caps minor of a compute instance's access file."""
    return gi_capability_minor(gpu_minor, gi_id) + 1 + ci_id


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _access(minor: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {CAPS_MODE}\n"


def lay_out_host(profile: HostProfile, root: Path) -> None:
    """Create sysfs, procfs, /dev and driver-root files for ``profile`` under ``root``."""
    for gpu in profile.gpus:
        domain = gpu.pci_bus_id.split(":")[0]
        root_bus = gpu.pcie_root.split(":")[1]
        port = f"{domain}:{root_bus}:01.0"
        device_dir = root / "sys/devices" / gpu.pcie_root / port / gpu.pci_bus_id
        _write(device_dir / "numa_node", f"{gpu.numa_node}\n")
        _write(device_dir / "vendor", "0x10de\n")
        link = root / "sys/bus/pci/devices" / gpu.pci_bus_id
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            relative = Path("../../..") / "devices" / gpu.pcie_root / port / gpu.pci_bus_id
            os.symlink(relative, link)
        _write(root / "dev" / f"nvidia{gpu.minor}", "")
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        _write(root / "dev" / name, "")
    _write(root / "proc/sys/kernel/random/boot_id", f"{profile.boot_id}\n")
    _write(
        root / "proc/devices",
        "Character devices:\n  1 mem\n  4 tty\n"
        f"{NVIDIA_MAJOR} nvidia-frontend\n{NVIDIA_MAJOR} nvidia\n"
        f"{NVIDIA_UVM_MAJOR} nvidia-uvm\n{NVIDIA_CAPS_MAJOR} nvidia-caps\n\n"
        "Block devices:\n  8 sd\n",
    )
    caps = root / "proc/driver/nvidia/capabilities"
    _write(caps / "mig/config", _access(1))
    _write(caps / "mig/monitor", _access(2))
    lib_dir = root / "driver-root/usr/lib/x86_64-linux-gnu"
    for library in ("libnvidia-ml.so", "libcuda.so"):
        _write(lib_dir / f"{library}.{profile.driver_version}", "simulated driver library\n")
    for tool in ("nvidia-smi", "nvidia-cuda-mps-control"):  # simulated tools (``tools``)
        _write_tool(root / "driver-root/usr/bin" / tool, tool, root)


def _write_tool(path: Path, tool: str, root: Path) -> None:
    """A driver tool of the simulated host: a script running ``simulated.tools``."""
    command = [sys.executable, "-m", "agent.hardware.simulated.tools", tool, str(root.absolute())]
    _write(path, f'#!/bin/sh\nexec {shlex.join(command)} "$@"\n')
    path.chmod(0o755)


def write_mig_capabilities(state: HostState, root: Path) -> None:
    """(Re)write the per-GPU MIG capability files for the GPU and compute instances that exist.

    Incremental, as procfs behaves: the access file of an instance that still exists is never
    missing, even for an instant, while another instance comes or goes (an agent reads them
    right after creating an instance, while other GPUs reconfigure)."""
    caps = root / "proc/driver/nvidia/capabilities"
    for gpu in state.gpus:
        mig_dir = caps / f"gpu{gpu.spec.minor}" / "mig"
        wanted: dict[Path, str] = {}
        for gi in gpu.gpu_instances.values():
            minor = gi_capability_minor(gpu.spec.minor, gi.id)
            wanted[mig_dir / f"gi{gi.id}/access"] = _access(minor)
            for ci in gi.compute_instances.values():
                ci_minor = ci_capability_minor(gpu.spec.minor, gi.id, ci.id)
                wanted[mig_dir / f"gi{gi.id}/ci{ci.id}/access"] = _access(ci_minor)
        if mig_dir.is_dir():
            for path in sorted(mig_dir.rglob("access"), reverse=True):
                if path not in wanted:
                    path.unlink()
            for directory in sorted(mig_dir.rglob("*"), reverse=True):
                if directory.is_dir() and not any(directory.iterdir()):
                    directory.rmdir()
        for path, text in wanted.items():
            try:
                if path.read_text() == text:
                    continue
            except OSError:
                pass
            _write(path, text)
