"""ResourceSlices of a simulated profile, exactly as ``gpu-dra-agent run --simulate`` publishes
them (discovery beneath the real pynvml, then ``agent.dra.build_slices``), cached per profile."""

from __future__ import annotations

import copy
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import anyio

from agent.dra import build_devices, build_slices
from agent.hardware.discovery import discover_host

DRIVER = "gpu.nvidia.com"


@cache
def _slices(profile: str, node: str) -> tuple[dict[str, Any], ...]:
    with tempfile.TemporaryDirectory(prefix="slices-") as root:
        inventory = anyio.run(discover_host, profile, Path(root))
    slices = build_slices(build_devices(inventory), node_name=node, driver_name=DRIVER)
    for index, item in enumerate(slices):
        item["metadata"]["name"] = f"{node}-{DRIVER}-{index}"
    return tuple(slices)


def profile_slices(profile: str, node: str = "node-a") -> list[dict[str, Any]]:
    """A fresh copy each call: tests may edit them (taints, counters)."""
    return copy.deepcopy(list(_slices(profile, node)))
