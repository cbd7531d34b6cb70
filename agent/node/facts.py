"""The host facts a prepared device is recorded with, read once so prepare does no host I/O.

A checkpoint entry must be enough to rebuild a claim's CDI spec without NVML or the
ResourceClaim (``agent.node.checkpoint``): the device's UUID, its GPU minor and, for a MIG
device, the GPU and compute instance ids and the ``nvidia-caps`` device numbers of their
capability files. Those come from the inventory and from ``/proc``, which do not change while
the agent runs with a given inventory, so :class:`HostFacts` reads them when the engine
starts; the hot path only looks them up. It also builds the driver's common CDI spec (the
control device nodes and driver files that exist on the host).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.dra import cdi
from agent.dra.partitionable import DynamicMig
from agent.hardware.hostfiles import HostFiles
from agent.hardware.inventory import Inventory
from agent.node.checkpoint import MigInstance, PreparedDevice
from agent.node.plan import NodeDevice, PlannedDevice, PrepareRefused, node_devices

CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
# Driver files a CUDA container needs, relative to the driver root.
LIBRARY_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64")
LIBRARY_PREFIXES = ("libnvidia-", "libcuda.so", "libcudadebugger.so", "libnvcuvid.so")
BINARY_DIR = "usr/bin"
BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control")


@dataclass(frozen=True, slots=True)
class HostFacts:
    """Devices of this node with their host facts, and the driver's common CDI spec."""

    driver: str
    pool: str  # this node's pool (the node name)
    devices: Mapping[str, NodeDevice]
    mig: Mapping[str, MigInstance]  # device name -> its MIG instance numbers
    problems: Mapping[str, str]  # device name -> why it cannot be prepared now
    common_spec: Mapping[str, Any]

    @classmethod
    def read(
        cls,
        driver: str,
        pool: str,
        inventory: Inventory,
        host_root: Path,
        driver_root: Path,
        driver_files: Path | None = None,
        *,
        dynamic_mig: bool | DynamicMig = False,
        ldconfig: str | None = None,
    ) -> HostFacts:
        """Read ``/proc`` under ``host_root`` and the driver's files under ``driver_files``
        (where this process sees the driver root; default ``driver_root``), naming them in the
        common CDI spec by their host paths under ``driver_root`` (blocking). ``dynamic_mig``:
        partitionable GPUs offer their MIG placements (``node_devices``). ``ldconfig``: the
        host's ldconfig, run by the common spec's hook on every container's root file system
        (``cdi.ldcache_hook``); None: no hook."""
        host = HostFiles(host_root)
        devices = node_devices(inventory, dynamic_mig=dynamic_mig)
        caps_major = host.device_majors().get("nvidia-caps")
        mig: dict[str, MigInstance] = {}
        problems: dict[str, str] = {}
        for name, device in devices.items():
            if device.slot is not None and caps_major is None:
                problems[name] = (
                    f"MIG device {name}: no nvidia-caps major in {host_root}/proc/devices, so "
                    "its capability device nodes cannot be named; is the nvidia-caps module "
                    "loaded?"
                )
            if device.mig is None:
                continue
            gi, ci = device.mig.gpu_instance_id, device.mig.compute_instance_id
            gi_minor = host.mig_capability_minor(device.gpu.minor, gi)
            ci_minor = host.mig_capability_minor(device.gpu.minor, gi, ci)
            if caps_major is None or gi_minor is None or ci_minor is None:
                problems[name] = (
                    f"MIG device {name}: no nvidia-caps major in {host_root}/proc/devices or no "
                    f"capability file for gpu{device.gpu.minor}/gi{gi}/ci{ci} under "
                    f"{host_root}/proc/driver/nvidia/capabilities; is the nvidia-caps module "
                    "loaded?"
                )
                continue
            mig[name] = MigInstance(device.gpu.uuid, gi, ci, caps_major, gi_minor, ci_minor)
        mounts = _driver_mounts(Path(driver_files or driver_root), Path(driver_root))
        library_dirs = sorted(
            {c.rpartition("/")[0] for _, c in mounts if not c.startswith(f"/{BINARY_DIR}/")}
        )
        hooks = [cdi.ldcache_hook(ldconfig, library_dirs)] if ldconfig and library_dirs else []
        common = cdi.common_spec(driver, _control_nodes(host_root), mounts, hooks)
        return cls(driver, pool, devices, mig, problems, common)

    def prepared_device(self, claim_uid: str, planned: PlannedDevice) -> PreparedDevice:
        """The checkpoint record of one planned device; raises ``PrepareRefused``.

        A device made on prepare (a dynamic MIG slot) has no UUID and no instance numbers
        yet: its effector fills them in (``agent.node.effectors``)."""
        device = planned.device
        problem = self.problems.get(device.name)
        if problem is not None:
            raise PrepareRefused(f"claim {claim_uid}: {problem}")
        return PreparedDevice(
            requests=planned.request_names,
            pool=planned.pool,
            device=device.name,
            cdi_device_ids=self.device_ids(claim_uid, _cdi_name(device.name, planned.share_id)),
            kind=device.kind,
            uuid=_uuid(device),
            gpu_minor=device.gpu.minor,
            config=planned.config,
            mig=self.mig.get(device.name),
            admin_access=planned.admin_access,
            share_id=planned.share_id,
            consumed=planned.consumed,
        )

    def device_ids(self, claim_uid: str, device_name: str) -> tuple[str, ...]:
        """The CDI ids handed to the kubelet for one device: the common device, then its own."""
        return (
            cdi.common_device_id(self.driver),
            cdi.claim_device_id(self.driver, claim_uid, device_name),
        )


def _cdi_name(device: str, share_id: str | None) -> str:
    """As ``PreparedDevice.cdi_name``: a share is a CDI device of its own."""
    return device if share_id is None else f"{device}-{share_id}"


def _uuid(device: NodeDevice) -> str:
    if device.slot is not None:
        return ""  # made on prepare
    return device.mig.uuid if device.mig is not None else device.gpu.uuid


def claim_spec(driver: str, claim_uid: str, devices: tuple[PreparedDevice, ...]) -> dict[str, Any]:
    """A prepared claim's CDI document, from its checkpoint record alone."""
    return cdi.claim_spec(driver, claim_uid, [device.cdi_device() for device in devices])


def _control_nodes(host_root: Path) -> list[cdi.DeviceNode]:
    """The control nodes under ``host_root``/dev; a character device with its numbers, so the
    runtime makes it in the container without looking for it on its own host (a path alone
    otherwise: the runtime reads the host's node, as for any other file)."""
    nodes = []
    for name in CONTROL_NODES:
        try:
            found = os.stat(host_root / "dev" / name)
        except OSError:
            continue
        path = f"/dev/{name}"
        if stat.S_ISCHR(found.st_mode):
            major, minor = os.major(found.st_rdev), os.minor(found.st_rdev)
            nodes.append(cdi.DeviceNode(path, type="c", major=major, minor=minor))
        else:
            nodes.append(cdi.DeviceNode(path))
    return nodes


def _driver_mounts(seen_at: Path, on_host: Path) -> list[tuple[str, str]]:
    """(host path, container path) of the driver's libraries and tools.

    They are looked for under ``seen_at`` (where this process sees the driver root) and named
    under ``on_host``: the container runtime reads the CDI spec on the host. A symlink
    (``libcuda.so.1 -> libcuda.so.<version>``) is mounted as the file it names, under its own
    name, so the loader finds the soname without a symlink hook; one that leaves the driver
    root or names nothing is left out.
    """
    mounts: list[tuple[str, str]] = []
    top = os.path.realpath(seen_at)
    for relative in LIBRARY_DIRS:
        try:
            names = sorted(os.listdir(seen_at / relative))
        except OSError:
            continue
        for name in names:
            if not (name.startswith(LIBRARY_PREFIXES) and ".so" in name):
                continue
            target = os.path.realpath(seen_at / relative / name)
            if os.path.commonpath([top, target]) != top or not os.path.isfile(target):
                continue
            host = on_host / os.path.relpath(target, top)
            mounts.append((str(host), f"/{relative}/{name}"))
    for name in BINARIES:
        if (seen_at / BINARY_DIR / name).is_file():
            mounts.append((str(on_host / BINARY_DIR / name), f"/{BINARY_DIR}/{name}"))
    return mounts
