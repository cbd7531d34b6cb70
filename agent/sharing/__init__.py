"""GPU sharing: time-slicing and MPS, applied through the engine's device effector protocol.

``SharingEffector`` (``effector``) is what the engine runs; ``mps`` starts and stops the
per-claim MPS control daemons; ``tools`` runs the driver's own programs from the driver root.
"""

from __future__ import annotations

from pathlib import Path

from agent.hardware.compute_mode import ComputeModes
from agent.hardware.inventory import Inventory
from agent.hardware.nvml import Nvml
from agent.node.plan import node_devices
from agent.sharing.effector import SharingEffector
from agent.sharing.mps import MpsDaemons
from agent.sharing.tools import DriverTools
from agent.telemetry.metrics import MPS_DAEMONS, SHARING_CHANGES, at_zero, set_gauge

__all__ = ["SharingEffector", "build_sharing"]


def build_sharing(
    nvml: Nvml,
    inventory: Inventory,
    *,
    plugin_dir: Path,
    host_root: Path,
    driver_root: Path,
    dynamic_mig: bool,
    simulated: bool,
) -> SharingEffector:
    """The sharing effector of an agent: tools from ``driver_root`` (where this process sees
    it), MPS directories under ``plugin_dir``; the MPS shm directory is a size-limited tmpfs
    only as root on a real host (``simulated`` never mounts)."""
    import os

    tools = DriverTools(driver_root)
    daemons = MpsDaemons(
        tools, plugin_dir, host_root, mount_shm=not simulated and os.geteuid() == 0
    )
    devices = node_devices(inventory, dynamic_mig=dynamic_mig)
    metrics_at_zero()
    return SharingEffector(ComputeModes(nvml), tools, daemons, devices)


def metrics_at_zero() -> None:
    """The sharing metrics at 0 from start: every change counter, no MPS daemon."""
    at_zero(
        SHARING_CHANGES,
        *(
            {"strategy": strategy, "operation": operation, "outcome": outcome}
            for strategy in ("TimeSlicing", "MPS")
            for operation in ("apply", "restore")
            for outcome in ("success", "error")
        ),
    )
    set_gauge(MPS_DAEMONS, 0)
