"""Host files read through a host root: the simulated layout, and missing files as None."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

from agent.hardware.hostfiles import HostFiles
from agent.hardware.simulated.hostfs import (
    DRIVER_LIBRARIES,
    ci_capability_minor,
    gi_capability_minor,
    lay_out_host,
    write_mig_capabilities,
)
from agent.hardware.simulated.profile import load_profile
from agent.hardware.simulated.state import HostState


def test_simulated_layout_is_read_back(tmp_path: Path) -> None:
    profile = load_profile("dgx-a100")
    lay_out_host(profile, tmp_path)
    write_mig_capabilities(HostState(profile), tmp_path)
    files = HostFiles(tmp_path)
    gpu = profile.gpus[5]
    assert files.pcie_root(gpu.pci_bus_id) == gpu.pcie_root == "pci0000:81"
    assert files.pcie_root(gpu.pci_bus_id.upper()) == "pci0000:81"
    assert files.numa_node(gpu.pci_bus_id) == 1
    assert files.boot_id() == profile.boot_id
    majors = files.device_majors()
    assert majors["nvidia"] == 195 and majors["nvidia-frontend"] == 195
    assert majors["nvidia-uvm"] == 508 and majors["nvidia-caps"] == 510
    assert "sd" not in majors  # block devices are not character devices
    assert files.mig_capability_minor(5, 1) == gi_capability_minor(5, 1)
    assert files.mig_capability_minor(5, 1, 0) == ci_capability_minor(5, 1, 0)
    assert files.mig_capability_minor(5, 9) is None
    assert files.mig_config_minor() == 1
    assert (tmp_path / "dev/nvidia5").exists() and (tmp_path / "dev/nvidiactl").exists()
    assert (tmp_path / "driver-root/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.570.158.01").exists()
    assert (tmp_path / "sys/bus/pci/devices" / gpu.pci_bus_id).is_symlink()


def test_driver_files_and_device_nodes_are_as_a_real_drivers(tmp_path: Path) -> None:
    profile = load_profile("dgx-h100")
    lay_out_host(profile, tmp_path)
    lay_out_host(profile, tmp_path)  # a second start finds everything in place
    lib = tmp_path / "driver-root/usr/lib/x86_64-linux-gnu"
    version = profile.driver_version
    assert os.readlink(lib / "libcuda.so.1") == f"libcuda.so.{version}"
    assert os.readlink(lib / "libcuda.so") == "libcuda.so.1"
    assert os.readlink(lib / "libnvidia-ml.so.1") == f"libnvidia-ml.so.{version}"
    for prefix, soname in DRIVER_LIBRARIES:
        data = (lib / f"{prefix}.{version}").read_bytes()
        assert data[:4] == b"\x7fELF" and soname.encode() + b"\0" in data
    if shutil.which("readelf"):
        dynamic = subprocess.run(
            ["readelf", "-d", str(lib / f"libcuda.so.{version}")],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "Library soname: [libcuda.so.1]" in dynamic
    node = os.stat(tmp_path / "dev/nvidia3")
    if os.geteuid() == 0:  # mknod: real character devices with the driver's numbers
        assert stat.S_ISCHR(node.st_mode)
        assert (os.major(node.st_rdev), os.minor(node.st_rdev)) == (195, 3)
        uvm = os.stat(tmp_path / "dev/nvidia-uvm").st_rdev
        assert (os.major(uvm), os.minor(uvm)) == (508, 0)
    else:
        assert stat.S_ISREG(node.st_mode)


def test_missing_files_are_none(tmp_path: Path) -> None:
    files = HostFiles(tmp_path)
    assert files.pcie_root("0000:18:00.0") is None
    assert files.numa_node("0000:18:00.0") is None
    assert files.boot_id() is None
    assert files.device_majors() == {}
    assert files.mig_capability_minor(0, 1) is None
    assert files.mig_config_minor() is None


def test_unknown_numa_node_and_odd_pcie_path(tmp_path: Path) -> None:
    device = tmp_path / "sys/devices/platform/0000:18:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("-1\n")
    link = tmp_path / "sys/bus/pci/devices/0000:18:00.0"
    link.parent.mkdir(parents=True)
    link.symlink_to("../../../devices/platform/0000:18:00.0")
    files = HostFiles(tmp_path)
    assert files.numa_node("0000:18:00.0") is None
    assert files.pcie_root("0000:18:00.0") is None
