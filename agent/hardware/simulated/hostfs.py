"""Lay out the files of a simulated host under a directory standing in for ``/``.

Discovery reads sysfs, procfs and /dev through a configurable host root; in simulation that root
is a temporary directory holding the same paths a real NVIDIA host has, so the readers are
exercised exactly as in production.
"""

from __future__ import annotations

import errno
import os
import shlex
import stat
import sys
from pathlib import Path

from agent.hardware.simulated.elfstub import shared_object
from agent.hardware.simulated.profile import HostProfile
from agent.hardware.simulated.state import HostState

NVIDIA_MAJOR = 195
NVIDIA_UVM_MAJOR = 508
NVIDIA_CAPS_MAJOR = 510
CAPS_PER_GPU = 135  # 15 GPU instances x (1 GI + 8 CI) capability files
CAPS_FIRST = 3  # 1 and 2 are mig/config and mig/monitor
CAPS_MODE = 292  # 0444
#: The control nodes: (major, minor). nvidiactl and nvidia-modeset are minors of the GPU
#: major; nvidia-uvm's major is the one this simulated /proc/devices gives it.
CONTROL_NODES = {
    "nvidiactl": (NVIDIA_MAJOR, 255),
    "nvidia-uvm": (NVIDIA_UVM_MAJOR, 0),
    "nvidia-uvm-tools": (NVIDIA_UVM_MAJOR, 1),
}
#: The driver's libraries as its installer lays them out: (file name prefix, soname); the
#: file is ``<prefix>.<driver version>``, the soname a symlink to it, and libcuda.so (the
#: link name) a symlink to the soname.
DRIVER_LIBRARIES = (
    ("libcuda.so", "libcuda.so.1"),
    ("libnvidia-ml.so", "libnvidia-ml.so.1"),
    ("libnvidia-ptxjitcompiler.so", "libnvidia-ptxjitcompiler.so.1"),
    ("libnvidia-nvvm.so", "libnvidia-nvvm.so.4"),
    ("libcudadebugger.so", "libcudadebugger.so.1"),
)
LINK_NAMES = {"libcuda.so": "libcuda.so.1"}


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
        _device_node(root / "dev" / f"nvidia{gpu.minor}", NVIDIA_MAJOR, gpu.minor)
    for name, (major, minor) in CONTROL_NODES.items():
        _device_node(root / "dev" / name, major, minor)
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
    lib_dir.mkdir(parents=True, exist_ok=True)
    for prefix, soname in DRIVER_LIBRARIES:
        file_name = f"{prefix}.{profile.driver_version}"
        (lib_dir / file_name).write_bytes(shared_object(soname))
        _symlink(lib_dir / soname, file_name)
    for link_name, soname in LINK_NAMES.items():
        _symlink(lib_dir / link_name, soname)
    for tool in ("nvidia-smi", "nvidia-cuda-mps-control"):  # simulated tools (``tools``)
        _write_tool(root / "driver-root/usr/bin" / tool, tool, root)


def _symlink(path: Path, target: str) -> None:
    if not path.is_symlink():
        path.symlink_to(target)


def _device_node(path: Path, major: int, minor: int) -> None:
    """A character device node where this process may make one (root), as the driver's
    nodes are; a regular file elsewhere (discovery only asks whether the path exists). A
    path that exists already is left as it is."""
    if path.exists() or path.is_symlink():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EACCES, errno.EROFS, errno.EINVAL):
            raise
        path.write_text("")


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
