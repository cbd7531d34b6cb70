"""ResourceSlices of a simulated profile, exactly as ``gpu-dra-agent run --simulate`` publishes
them (discovery beneath the real pynvml, then ``agent.dra.build_slices``), cached per profile."""

from __future__ import annotations

import copy
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import anyio

from agent.dra import build_device_set, build_slices
from agent.dra.order import DeviceOrder
from agent.dra.partitionable import DynamicMig
from agent.dra.share_mode import SharesMode
from agent.dra.slices import SliceLayout, name_for_preview
from agent.hardware.discovery import discover_host
from agent.hardware.inventory import Inventory

DRIVER = "gpu.nvidia.com"


@cache
def profile_inventory(profile: str) -> Inventory:
    """The inventory ``discover --simulate PROFILE`` finds (cached: inventories are frozen)."""
    with tempfile.TemporaryDirectory(prefix="slices-") as root:
        return anyio.run(discover_host, profile, Path(root))


@cache
def _slices(
    profile: str,
    node: str,
    dynamic_mig: DynamicMig | None,
    slice_layout: SliceLayout,
    shares: SharesMode | None,
    device_order: DeviceOrder,
) -> tuple[dict[str, Any], ...]:
    device_set = build_device_set(
        profile_inventory(profile), dynamic_mig=dynamic_mig, shares=shares
    )
    slices = build_slices(
        device_set.devices,
        node_name=node,
        driver_name=DRIVER,
        counter_sets=device_set.counter_sets,
        slice_layout=slice_layout,
        device_order=device_order,
    )
    return tuple(name_for_preview(slices))  # named as the API server names them


def profile_slices(
    profile: str,
    node: str = "node-a",
    *,
    dynamic_mig: DynamicMig | None = None,
    slice_layout: SliceLayout = "split",
    shares: SharesMode | None = None,
    device_order: DeviceOrder = "names",
) -> list[dict[str, Any]]:
    """A fresh copy each call: tests may edit them (taints, counters). ``dynamic_mig``
    publishes as ``--dynamic-mig`` does, laid out by ``slice_layout``; ``shares`` as
    ``--consumable-shares``."""
    return copy.deepcopy(
        list(_slices(profile, node, dynamic_mig, slice_layout, shares, device_order))
    )
