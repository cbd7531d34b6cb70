"""Read the host files the agent needs (sysfs, procfs) through a configurable host root.

This is the only module that reads ``/sys`` and ``/proc``. In production the root is ``/`` (or
the host filesystem mounted into the container); in simulation it is a directory laid out by
``agent.hardware.simulated.hostfs``. A missing or unreadable file yields ``None``: the value is
then omitted from what the agent publishes, never fatal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_PCIE_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
_ACCESS_MINOR = re.compile(r"^DeviceFileMinor:\s*(\d+)\s*$", re.MULTILINE)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


@dataclass(frozen=True, slots=True)
class HostFiles:
    """Readers of host files under ``root``."""

    root: Path = Path("/")

    def pcie_root(self, pci_bus_id: str) -> str | None:
        """The PCIe root complex of a device, e.g. ``pci0000:16`` (as Kubernetes derives it)."""
        link = self.root / "sys/bus/pci/devices" / pci_bus_id.lower()
        try:
            resolved = link.resolve(strict=True)
            relative = resolved.relative_to((self.root / "sys/devices").resolve())
        except (OSError, ValueError):
            return None
        first = relative.parts[0] if relative.parts else ""
        return first if _PCIE_ROOT.match(first) else None

    def numa_node(self, pci_bus_id: str) -> int | None:
        """The NUMA node of a PCI device; ``None`` if unknown (the kernel writes -1)."""
        text = _read(self.root / "sys/bus/pci/devices" / pci_bus_id.lower() / "numa_node")
        try:
            node = int(text.strip()) if text is not None else -1
        except ValueError:
            return None
        return node if node >= 0 else None

    def boot_id(self) -> str | None:
        """This boot's id: a checkpoint written under another boot id is from before a reboot."""
        text = _read(self.root / "proc/sys/kernel/random/boot_id")
        return text.strip() or None if text is not None else None

    def device_majors(self) -> dict[str, int]:
        """Character-device majors by driver name, from ``/proc/devices`` (empty if unreadable)."""
        text = _read(self.root / "proc/devices")
        majors: dict[str, int] = {}
        if text is None:
            return majors
        for line in text.split("\n\n", 1)[0].splitlines()[1:]:
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit():
                majors.setdefault(parts[1], int(parts[0]))
        return majors

    def mig_capability_minor(
        self, gpu_minor: int, gpu_instance_id: int, compute_instance_id: int | None = None
    ) -> int | None:
        """The nvidia-caps minor of a GPU instance's (or compute instance's) access file."""
        path = (
            self.root
            / "proc/driver/nvidia/capabilities"
            / f"gpu{gpu_minor}/mig/gi{gpu_instance_id}"
        )
        if compute_instance_id is not None:
            path = path / f"ci{compute_instance_id}"
        text = _read(path / "access")
        match = _ACCESS_MINOR.search(text) if text is not None else None
        return int(match.group(1)) if match else None

    def mig_config_minor(self) -> int | None:
        """The nvidia-caps minor of ``mig/config`` (needed to create MIG instances)."""
        text = _read(self.root / "proc/driver/nvidia/capabilities/mig/config")
        match = _ACCESS_MINOR.search(text) if text is not None else None
        return int(match.group(1)) if match else None
