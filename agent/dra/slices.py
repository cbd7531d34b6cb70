"""Lay a node's devices out as ``resource.k8s.io/v1`` ResourceSlice objects.

The pool is the node (as with the incumbent, nvidia-driver-facts.md §2.4), and slices are
cut so that each one stays within the API's device limits (kubelet-dra-protocol.md §4).

Partitionable devices (``--dynamic-mig``, KEP-4815) bring counter sets, laid out one of two
ways (:data:`SliceLayout`). ``combined`` is the only layout 1.34 accepts: a device may only
consume counters of its own slice, so each counter set shares a slice with the devices that
consume it (one slice per GPU). ``split`` is the only one 1.35+ accepts: a slice holds
counter sets or devices, never both, so counter sets go into counters-only slices (at most 8
sets each) and the devices that consume them into device slices of their own, one run per
counter set (a GPU's devices stay together, so a taint on one reshapes one slice). Devices
that consume nothing are laid out as before, after them.
The layout is a pure function of the devices: the same devices always give the same
slices, in the same order, so the slice publisher can match what it wants against what the
API server has by content and rewrite only what changed (:mod:`agent.dra.slice_diff`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from agent.dra import limits
from agent.dra.errors import (
    DraModelError,
    DuplicateDeviceError,
    InvalidValueError,
    LimitExceededError,
)
from agent.dra.model import CounterSet, DraDevice
from agent.dra.names import device_sort_key, validate_driver_name, validate_node_name
from agent.dra.order import DEVICE_ORDERS, DeviceOrder, is_mig_name
from agent.dra.order import ordered as order_devices

# The comparison of slices (the publisher's matching) lives in agent.dra.slice_diff; these
# names are re-exported for the callers of this module.
from agent.dra.slice_diff import content_names as content_names
from agent.dra.slice_diff import device_names as device_names
from agent.dra.slice_diff import slice_differences as slice_differences
from agent.dra.slice_diff import slices_match as slices_match

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"

#: How counter sets and the devices consuming them share slices: ``combined`` for 1.34,
#: ``split`` for 1.35 and later (see the module docstring).
SliceLayout = Literal["combined", "split"]
SLICE_LAYOUTS: tuple[SliceLayout, ...] = ("combined", "split")


def layout_for_version(version: tuple[int, int] | None) -> SliceLayout:
    """The layout an API server of ``version`` (major, minor) accepts; unknown: ``split``
    (what every supported release from 1.35 on requires; 1.34 needs ``--slice-layout``)."""
    if version is not None and version < (1, 35):
        return "combined"
    return "split"


def slice_name_prefix(index: int, driver_name: str, node_name: str) -> str:
    """The ``generateName`` of the pool's ``index``-th slice: ``<index, hex, 5+ digits>-
    <driver>-<node>-``, as the Go resourceslice library names slices since 1.36. The 1.36
    scheduler tries a pool's slices in name order, so the index makes that order the
    layout's; it comes first because the API server cuts a long ``generateName`` short."""
    return f"{index:05x}-{driver_name}-{node_name}-"


def build_slices(
    devices: Iterable[DraDevice],
    *,
    node_name: str,
    driver_name: str,
    generation: int = 0,
    node_uid: str | None = None,
    counter_sets: Iterable[CounterSet] = (),
    slice_layout: SliceLayout = "split",
    device_order: DeviceOrder = "names",
) -> list[dict[str, Any]]:
    """Complete ResourceSlice objects for this node's pool, ready to create.

    Devices are listed in ``device_order`` (:mod:`agent.dra.order`) and cut into runs of at
    most 128; a run holding a device with taints or consumesCounters is halved, so no slice
    with such a device has more than 64. Tainting one device therefore reshapes only its own
    run. There is always at least one slice: an empty pool is published as one slice without
    devices. Each slice's ``generateName`` starts with its index (:func:`slice_name_prefix`),
    so a 1.36 scheduler walks the slices in this order. With ``node_uid`` the slices get the
    Node as controlling owner, so Kubernetes garbage collects them with the Node, as the Go
    helper does. ``counter_sets`` and the devices that consume them are laid out by
    ``slice_layout`` (:func:`pool_layout`).
    """
    validate_node_name(node_name)
    validate_driver_name(driver_name)
    if (
        isinstance(generation, bool)
        or not isinstance(generation, int)
        or not 0 <= generation < 2**63
    ):
        raise InvalidValueError(f"pool generation {generation!r} must be an int64 >= 0")
    chunks = pool_layout(devices, counter_sets, slice_layout, device_order)
    owners: list[dict[str, Any]] = []
    if node_uid is not None:
        owners = [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "name": node_name,
                "uid": node_uid,
                "controller": True,
            }
        ]
    out = []
    for index, chunk in enumerate(chunks):
        metadata: dict[str, Any] = {
            "generateName": slice_name_prefix(index, driver_name, node_name)
        }
        if owners:
            metadata["ownerReferences"] = [dict(owner) for owner in owners]
        out.append(
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "metadata": metadata,
                "spec": _spec(chunk, driver_name, node_name, generation, len(chunks)),
            }
        )
    return out


def name_for_preview(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each slice with a concrete name, its ``generateName`` then its place in the list, as
    the API server would name it from ``generateName`` (the index first, so the order by
    name stays the layout's): for output that is applied or validated as it is, and for
    simulators and tests that allocate from the slices."""
    named = []
    for index, item in enumerate(slices):
        metadata = dict(item["metadata"])
        metadata["name"] = f"{metadata['generateName']}{index}"
        named.append({**item, "metadata": metadata})
    return named


def _spec(
    chunk: SliceContent, driver: str, node: str, generation: int, count: int
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": driver,
        "nodeName": node,
        "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
    }
    if chunk.counter_sets:
        spec["sharedCounters"] = [counter_set.to_dict() for counter_set in chunk.counter_sets]
    if chunk.devices or not chunk.counter_sets:  # a counters-only slice has no device list
        spec["devices"] = [device.to_dict() for device in chunk.devices]
    return spec


class SliceContent:
    """What one slice holds: counter sets, devices, or (``combined``) both."""

    __slots__ = ("counter_sets", "devices")

    def __init__(
        self, counter_sets: Sequence[CounterSet] = (), devices: Sequence[DraDevice] = ()
    ) -> None:
        self.counter_sets = tuple(counter_sets)
        self.devices = tuple(devices)

    def __repr__(self) -> str:
        sets = [s.name for s in self.counter_sets]
        return f"SliceContent(counter_sets={sets}, devices={[d.name for d in self.devices]})"


def pool_layout(
    devices: Iterable[DraDevice],
    counter_sets: Iterable[CounterSet] = (),
    slice_layout: SliceLayout = "split",
    device_order: DeviceOrder = "names",
) -> list[SliceContent]:
    """Split devices and counter sets into slices (see :func:`build_slices`).

    ``split``: the counters-only slices first, then the devices that consume counters, then
    the others. In the ``names`` order each GPU's consumers are a run of their own (at most
    64 a slice), GPU after GPU, as the incumbent lays them out. In the ``packing`` order
    the MIG placements of consecutive GPUs share a slice (up to 64 devices, a GPU's run never
    cut unless it alone is longer): Kubernetes 1.34 and 1.35 walk slices in no defined order
    and only the order within a slice is kept, so the fewer slices, the more of the order
    holds there; whole GPUs follow, in one run of their own (:mod:`agent.dra.order`).
    ``combined`` (1.34): one slice per counter set with its consumers, in the device order.

    Raises :class:`DraModelError` naming the device or set when a device consumes a counter
    set or counter that is not published, and :class:`LimitExceededError` when a counter set
    and its devices cannot fit the API's per-slice limits in this layout.
    """
    if slice_layout not in SLICE_LAYOUTS:
        raise InvalidValueError(
            f"slice layout {slice_layout!r} is not one of {', '.join(SLICE_LAYOUTS)}"
        )
    if device_order not in DEVICE_ORDERS:
        raise InvalidValueError(
            f"device order {device_order!r} is not one of {', '.join(DEVICE_ORDERS)}"
        )
    sets = sorted(counter_sets, key=lambda item: device_sort_key(item.name))
    by_name: dict[str, CounterSet] = {}
    for counter_set in sets:
        if counter_set.name in by_name:
            raise DuplicateDeviceError(
                f"counter set {counter_set.name!r} appears twice; names must be unique in a pool"
            )
        by_name[counter_set.name] = counter_set
    ordered = _unique(order_devices(devices, device_order))
    consumers: dict[str, list[DraDevice]] = {name: [] for name in by_name}
    plain: list[DraDevice] = []
    for device in ordered:
        if not device.consumes_counters:
            plain.append(device)
            continue
        _check_consumption(device, by_name, slice_layout)
        consumers[device.consumes_counters[0].counter_set].append(device)
    out: list[SliceContent] = []
    if slice_layout == "combined":
        for counter_set in sets:
            out.append(_combined_slice(counter_set, consumers[counter_set.name]))
    else:
        step = limits.MAX_COUNTER_SETS_PER_SLICE
        out += [SliceContent(sets[i : i + step]) for i in range(0, len(sets), step)]
        runs = [consumers[counter_set.name] for counter_set in sets]
        if device_order == "packing":
            out += _packing_runs(runs)
        else:
            out += [SliceContent((), chunk) for run in runs for chunk in _halves(run)]
    if plain or not out:
        out += [SliceContent((), chunk) for chunk in _chunks(plain)]
    return out


def _check_consumption(
    device: DraDevice, by_name: Mapping[str, CounterSet], slice_layout: SliceLayout
) -> None:
    for entry in device.consumes_counters:
        published = by_name.get(entry.counter_set)
        if published is None:
            raise DraModelError(
                f"device {device.name!r} consumes counter set {entry.counter_set!r}, "
                "which is not published"
            )
        missing = sorted(set(entry.counters) - set(published.counters))
        if missing:
            raise DraModelError(
                f"device {device.name!r} consumes counters {missing} that counter set "
                f"{entry.counter_set!r} does not have"
            )
    if slice_layout == "combined" and len(device.consumes_counters) > 1:
        raise LimitExceededError(
            f"device {device.name!r} consumes from {len(device.consumes_counters)} counter "
            "sets; the combined layout (Kubernetes 1.34) keeps one set per slice"
        )


def _packing_runs(runs: Sequence[Sequence[DraDevice]]) -> list[SliceContent]:
    """The ``packing`` order's consumer slices: every GPU's MIG placements, consecutive
    GPUs sharing a slice while they fit, then the whole GPUs (already in their order)."""
    half = limits.MAX_DEVICES_PER_SLICE_WITH_TAINTS
    migs = [[d for d in run if is_mig_name(d.name)] for run in runs]
    whole = order_devices((d for run in runs for d in run if not is_mig_name(d.name)), "packing")
    out: list[SliceContent] = []
    current: list[DraDevice] = []
    for run in migs:
        if current and len(current) + len(run) > half:
            out.append(SliceContent((), current))
            current = []
        if len(run) > half:
            out += [SliceContent((), chunk) for chunk in _halves(run)]
            continue
        current += run
    if current:
        out.append(SliceContent((), current))
    out += [SliceContent((), chunk) for chunk in _halves(whole)]
    return out


def _halves(run: Sequence[DraDevice]) -> list[list[DraDevice]]:
    half = limits.MAX_DEVICES_PER_SLICE_WITH_TAINTS
    return [list(run[i : i + half]) for i in range(0, len(run), half)]


def _combined_slice(counter_set: CounterSet, devices: Sequence[DraDevice]) -> SliceContent:
    """One 1.34 slice: a counter set with every device that consumes it, within its limits."""
    problems = []
    if len(devices) > limits.MAX_DEVICES_PER_SLICE_WITH_TAINTS:
        problems.append(
            f"{len(devices)} devices (at most {limits.MAX_DEVICES_PER_SLICE_WITH_TAINTS})"
        )
    if len(counter_set.counters) > limits.MAX_SHARED_COUNTERS_PER_SLICE_1_34:
        problems.append(
            f"{len(counter_set.counters)} shared counters "
            f"(at most {limits.MAX_SHARED_COUNTERS_PER_SLICE_1_34})"
        )
    consumed = sum(device.consumed_counter_count for device in devices)
    if consumed > limits.MAX_CONSUMED_COUNTERS_PER_SLICE_1_34:
        problems.append(
            f"{consumed} consumed counters (at most {limits.MAX_CONSUMED_COUNTERS_PER_SLICE_1_34})"
        )
    if problems:
        raise LimitExceededError(
            f"counter set {counter_set.name!r} and its devices need one slice in the combined "
            f"layout (Kubernetes 1.34), which would hold {', '.join(problems)}; use the split "
            "layout (Kubernetes 1.35+)"
        )
    return SliceContent((counter_set,), devices)


def layout(
    devices: Iterable[DraDevice], device_order: DeviceOrder = "names"
) -> list[list[DraDevice]]:
    """Split devices into slices (see :func:`build_slices`); never returns an empty list."""
    return _chunks(_unique(order_devices(devices, device_order)))


def _unique(ordered: list[DraDevice]) -> list[DraDevice]:
    seen: set[str] = set()
    for device in ordered:
        if device.name in seen:
            raise DuplicateDeviceError(
                f"device name {device.name!r} appears twice; names must be unique in a pool"
            )
        seen.add(device.name)
    return ordered


def _chunks(ordered: list[DraDevice]) -> list[list[DraDevice]]:
    chunks: list[list[DraDevice]] = []
    full = limits.MAX_DEVICES_PER_SLICE
    half = limits.MAX_DEVICES_PER_SLICE_WITH_TAINTS
    for start in range(0, len(ordered), full):
        run = ordered[start : start + full]
        if any(device.uses_advanced_features for device in run):
            chunks.extend(run[offset : offset + half] for offset in range(0, len(run), half))
        else:
            chunks.append(run)
    return chunks or [[]]
