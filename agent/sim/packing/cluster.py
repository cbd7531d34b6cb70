"""The simulated cluster's nodes, built from the product's own parts.

Each node's ResourceSlices are exactly what ``gpu-dra-agent run --simulate PROFILE``
publishes: the profile is discovered once beneath the real pynvml bindings (the simulated
NVML library), its devices built by :func:`agent.dra.build_device_set` with the same
``--dynamic-mig`` and ``--consumable-shares`` settings, and laid out by
:func:`agent.dra.build_slices` in the order being measured. Every node of a profile has the
same hardware, so the discovery is done once and only the node name differs. The slices get
the names the API server would give them (their ``generateName``, which starts with the
slice's index, then five characters), so the allocator walks them as a 1.36 scheduler does.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.dra import build_device_set, build_slices
from agent.dra.order import DeviceOrder
from agent.dra.partitionable import DynamicMig
from agent.dra.share_mode import SharesMode
from agent.dra.slices import name_for_preview
from agent.hardware.inventory import Inventory
from agent.sim.packing.workload import MigSize

Obj = dict[str, Any]
DRIVER = "gpu.nvidia.com"


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """What the metrics need of one GPU: its place in the node's topology."""

    minor: int
    numa: int | None
    nvlink_domain: str | None


@dataclass(frozen=True)
class NodeTemplate:
    """One hardware profile: its GPUs, MIG sizes and published devices."""

    profile: str
    gpus: tuple[GpuInfo, ...]
    sizes: tuple[MigSize, ...]  # the MIG profiles of its GPU model (none: not MIG-capable)
    compute_slices: int  # a whole GPU's MIG compute slices (7), 1 without MIG
    inventory: Inventory
    dynamic_mig: bool
    shares: SharesMode | None
    #: what each request shape's selectors select, by device order (:mod:`models`): the
    #: devices are the same on every node and in every replay of this template
    selections: dict[Any, list[int]] = field(default_factory=dict, compare=False, repr=False)

    def slices(self, node: str, order: DeviceOrder) -> list[Obj]:
        """The node's ResourceSlices in ``order``, named as the API server names them."""
        device_set = build_device_set(
            self.inventory,
            dynamic_mig=DynamicMig() if self.dynamic_mig else None,
            shares=self.shares,
        )
        return name_for_preview(
            build_slices(
                device_set.devices,
                node_name=node,
                driver_name=DRIVER,
                counter_sets=device_set.counter_sets,
                device_order=order,
            )
        )

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)


def mig_sizes(inventory: Inventory) -> tuple[MigSize, ...]:
    """The MIG profiles of the inventory's first MIG-capable GPU, as workload sizes."""
    for gpu in inventory.gpus:
        if not gpu.mig_profiles:
            continue
        total = max(p.slice_count for p in gpu.mig_profiles)
        return tuple(
            MigSize(
                profile=p.name,
                compute_slices=p.slice_count,
                memory_slices=max((pl.size for pl in p.placements), default=p.slice_count),
                total_compute=total,
            )
            for p in gpu.mig_profiles
        )
    return ()


async def load_template(
    profile: str, *, dynamic_mig: bool = True, shares: SharesMode | None = None
) -> NodeTemplate:
    """Discover ``profile`` (a shipped profile name or a profile file) once."""
    from agent.hardware.discovery import discover_host

    with tempfile.TemporaryDirectory(prefix="gpu-dra-packing-") as root:
        inventory = await discover_host(profile, Path(root))
    sizes = mig_sizes(inventory)
    return NodeTemplate(
        profile=profile,
        gpus=tuple(
            GpuInfo(gpu.minor, gpu.numa_node, gpu.nvlink_domain)
            for gpu in sorted(inventory.gpus, key=lambda g: g.minor)
        ),
        sizes=sizes,
        compute_slices=max((s.total_compute for s in sizes), default=1),
        inventory=inventory,
        dynamic_mig=dynamic_mig,
        shares=shares,
    )


def node_names(count: int) -> list[str]:
    return [f"node-{index:03d}" for index in range(count)]
