"""The order a node publishes its devices in: the one lever a driver has over packing.

kube-scheduler allocates devices first fit, with no device scoring (1.34-1.37): it walks the
pools, the slices of a pool (sorted by name from 1.36 on; in no defined order before), and
the devices of a slice in the order the driver listed them, and takes the first solution.
Whatever the driver lists first is what the scheduler takes.

``names`` is the incumbent's order: device names sorted (``gpu-0``, its MIG placements by
profile and then by *lowest* placement start, ``gpu-1``, ...). A first 1g.10gb claim on an
empty H100 then takes memory slice 0, which blocks 4g.40gb@0, 3g.40gb@0, 2g.20gb@0 and the
7g.80gb: one small claim makes the GPU unable to hold a large one.

``packing`` (``--device-order packing``; ``names`` stays the default) lists:

* MIG devices first, GPU by GPU from the lowest minor, so that MIG claims fill a GPU that is
  already partitioned before they touch the next one;
* within a GPU, smaller profiles before larger ones (KEP-4815's advice: otherwise a request
  that any size satisfies always gets the largest), and each profile's placements from the
  *highest* start down: small instances come from the edge of the free region, and 4g@0
  (half the GPU) stays free for as long as anything smaller fits beside it;
* whole GPUs after them, from the lowest minor up, as in the names order.

Whole GPUs from the other end (the highest minor down, so that MIG and whole-GPU claims meet
in the middle) was tried with ``sim packing`` and lost: on the seed's mix it left 1.5 points
more of the cluster unallocated under LeastAllocated, as 1-GPU claims from one end and MIG
claims from the other dirtied both NUMA nodes of a DGX and 4-GPU claims that want one NUMA
node found none (docs/PERFORMANCE.md, "Packing", has the numbers of each order tried).

The names stay the incumbent's, so claims written for it keep working; only the order of the
lists changes. ``packing`` is not the default because it did not clear the bar set for that:
measured with ``sim packing`` it allocates 2.7-3.4 points more of a 32-node cluster on openb
traces under the default scoring, but on the seed's mix, which whole-GPU training dominates,
it changes nothing, and in two cases under MostAllocated it allocates 0.1-0.2 points less. Which slices hold which runs, and how the slices are named so that 1.36 sorts
them into this order, is :mod:`agent.dra.slices`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

from agent.dra.model import DraDevice
from agent.dra.names import device_sort_key, parse_mig_device_name

DeviceOrder = Literal["packing", "names"]
DEVICE_ORDERS: tuple[DeviceOrder, ...] = ("packing", "names")

_GPU_NAME = re.compile(r"gpu-(\d+)")
_PROFILE_SIZE = re.compile(r"(\d+)g(\d+)gb")


def gpu_minor(name: str) -> int | None:
    """The minor of a whole-GPU device name (``gpu-3`` -> 3); None for any other name."""
    match = _GPU_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def is_mig_name(name: str) -> bool:
    return parse_mig_device_name(name) is not None


def _mig_key(name: str) -> tuple[int, int, int, bool, int, str]:
    """(parent minor, compute slices, memory GB, a variant such as ``+me``, -placement
    start, name) of a MIG device: a plain profile before its variants of the same size,
    which take engines (media extensions) a plain request does not need."""
    parsed = parse_mig_device_name(name)
    assert parsed is not None
    minor, profile, _, start = parsed
    size = _PROFILE_SIZE.match(profile)
    if size is None:
        return minor, 99, 0, True, -start, name
    variant = size.end() < len(profile)
    return minor, int(size.group(1)), int(size.group(2)), variant, -start, name


def packing_key(name: str) -> tuple[int, tuple[object, ...]]:
    """Sort key of the ``packing`` order: MIG devices (GPU ascending, smaller profiles
    first, placements from the highest start down), then whole GPUs (minor ascending),
    then anything else in name order."""
    if is_mig_name(name):
        return 0, _mig_key(name)
    minor = gpu_minor(name)
    if minor is not None:
        return 1, (minor,)
    return 2, device_sort_key(name)


def ordered(devices: Iterable[DraDevice], order: DeviceOrder) -> list[DraDevice]:
    """``devices`` in ``order`` (``names``: the natural sort of their names)."""
    if order == "names":
        return sorted(devices, key=lambda device: device_sort_key(device.name))
    return sorted(devices, key=lambda device: packing_key(device.name))
