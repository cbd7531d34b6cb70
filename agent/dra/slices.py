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
API server has by content and rewrite only what changed. :func:`slice_differences` is that
comparison, tolerant of what the API server sets or re-serializes on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from fractions import Fraction
from itertools import pairwise
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
from agent.dra.quantity import parse_quantity

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
#: Tolerance for taint ``timeAdded``: the API server stores it at second precision.
TIME_ADDED_TOLERANCE_S = 1.0

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


def build_slices(
    devices: Iterable[DraDevice],
    *,
    node_name: str,
    driver_name: str,
    generation: int = 0,
    node_uid: str | None = None,
    counter_sets: Iterable[CounterSet] = (),
    slice_layout: SliceLayout = "split",
) -> list[dict[str, Any]]:
    """Complete ResourceSlice objects for this node's pool, ready to create.

    Devices are sorted by name and cut into runs of at most 128; a run holding a device
    with taints or consumesCounters is halved, so no slice with such a device has more
    than 64. Tainting one device therefore reshapes only its own run of 128. There is
    always at least one slice: an empty pool is published as one slice without devices.
    With ``node_uid`` the slices get the Node as controlling owner, so Kubernetes garbage
    collects them with the Node, as the Go helper does. ``counter_sets`` and the devices
    that consume them are laid out by ``slice_layout`` (:func:`pool_layout`).
    """
    validate_node_name(node_name)
    validate_driver_name(driver_name)
    if (
        isinstance(generation, bool)
        or not isinstance(generation, int)
        or not 0 <= generation < 2**63
    ):
        raise InvalidValueError(f"pool generation {generation!r} must be an int64 >= 0")
    chunks = pool_layout(devices, counter_sets, slice_layout)
    metadata: dict[str, Any] = {"generateName": f"{node_name}-{driver_name}-"}
    if node_uid is not None:
        metadata["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "name": node_name,
                "uid": node_uid,
                "controller": True,
            }
        ]
    return [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {**metadata},
            "spec": _spec(chunk, driver_name, node_name, generation, len(chunks)),
        }
        for chunk in chunks
    ]


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
) -> list[SliceContent]:
    """Split devices and counter sets into slices (see :func:`build_slices`).

    Raises :class:`DraModelError` naming the device or set when a device consumes a counter
    set or counter that is not published, and :class:`LimitExceededError` when a counter set
    and its devices cannot fit the API's per-slice limits in this layout.
    """
    if slice_layout not in SLICE_LAYOUTS:
        raise InvalidValueError(
            f"slice layout {slice_layout!r} is not one of {', '.join(SLICE_LAYOUTS)}"
        )
    sets = sorted(counter_sets, key=lambda item: device_sort_key(item.name))
    by_name: dict[str, CounterSet] = {}
    for counter_set in sets:
        if counter_set.name in by_name:
            raise DuplicateDeviceError(
                f"counter set {counter_set.name!r} appears twice; names must be unique in a pool"
            )
        by_name[counter_set.name] = counter_set
    ordered = _sorted_unique(devices)
    consumers: dict[str, list[DraDevice]] = {name: [] for name in by_name}
    plain: list[DraDevice] = []
    for device in ordered:
        if not device.consumes_counters:
            plain.append(device)
            continue
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
        consumers[device.consumes_counters[0].counter_set].append(device)
    half = limits.MAX_DEVICES_PER_SLICE_WITH_TAINTS
    out: list[SliceContent] = []
    if slice_layout == "combined":
        for counter_set in sets:
            out.append(_combined_slice(counter_set, consumers[counter_set.name]))
    else:
        step = limits.MAX_COUNTER_SETS_PER_SLICE
        out += [SliceContent(sets[i : i + step]) for i in range(0, len(sets), step)]
        for counter_set in sets:
            run = consumers[counter_set.name]
            out += [SliceContent((), run[i : i + half]) for i in range(0, len(run), half)]
    if plain or not out:
        out += [SliceContent((), chunk) for chunk in _chunks(plain)]
    return out


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


def layout(devices: Iterable[DraDevice]) -> list[list[DraDevice]]:
    """Split devices into slices (see :func:`build_slices`); never returns an empty list."""
    return _chunks(_sorted_unique(devices))


def _sorted_unique(devices: Iterable[DraDevice]) -> list[DraDevice]:
    ordered = sorted(devices, key=lambda device: device_sort_key(device.name))
    for previous, current in pairwise(ordered):
        if previous.name == current.name:
            raise DuplicateDeviceError(
                f"device name {current.name!r} appears twice; names must be unique in a pool"
            )
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


def device_names(resource_slice: Mapping[str, Any]) -> frozenset[str]:
    """The names of the devices in a ResourceSlice object (desired or observed)."""
    devices = (resource_slice.get("spec") or {}).get("devices") or []
    return frozenset(str(device["name"]) for device in devices)


def content_names(resource_slice: Mapping[str, Any]) -> frozenset[str]:
    """What identifies a slice's content: its device names and its counter sets' names
    (``counterSet/<name>``, which cannot clash with a device name), so counters-only slices
    are told apart too."""
    sets = (resource_slice.get("spec") or {}).get("sharedCounters") or []
    names = {f"counterSet/{item.get('name')}" for item in sets if isinstance(item, Mapping)}
    return device_names(resource_slice) | names


def slice_differences(desired: Mapping[str, Any], observed: Mapping[str, Any]) -> list[str]:
    """Where the spec of an observed ResourceSlice differs from the desired one.

    Returns dotted paths with both values, empty when they match. Metadata is ignored,
    and so is what the API server sets or rewrites itself: empty maps and lists versus
    missing ones, quantities in another spelling (``"1024Mi"`` vs ``"1Gi"``), an empty taint
    value, a taint ``timeAdded`` we did not set, and one we set within ±1 s.
    """
    out: list[str] = []
    _diff_spec(desired.get("spec") or {}, observed.get("spec") or {}, out)
    return out


def slices_match(desired: Mapping[str, Any], observed: Mapping[str, Any]) -> bool:
    """Whether the observed slice already says what the desired one says."""
    return not slice_differences(desired, observed)


def _diff_spec(desired: Mapping[str, Any], observed: Mapping[str, Any], out: list[str]) -> None:
    for key in sorted(set(desired) | set(observed)):
        if key == "devices":
            _diff_devices(desired.get(key) or [], observed.get(key) or [], out)
        elif key == "sharedCounters":
            _diff_counters("spec.sharedCounters", "name", desired.get(key), observed.get(key), out)
        else:
            _diff_plain(f"spec.{key}", desired.get(key), observed.get(key), out)


def _diff_devices(desired: Sequence[Any], observed: Sequence[Any], out: list[str]) -> None:
    wanted = {device["name"]: device for device in desired}
    seen = {device.get("name"): device for device in observed}
    for name in sorted(set(wanted) - set(seen), key=str):
        out.append(f"spec.devices[{name}]: missing")
    for name in sorted(set(seen) - set(wanted), key=str):
        out.append(f"spec.devices[{name}]: unexpected")
    for name in sorted(set(wanted) & set(seen), key=str):
        mine, theirs, path = wanted[name], seen[name], f"spec.devices[{name}]"
        for key in sorted(set(mine) | set(theirs)):
            if key == "capacity":
                _diff_capacity(f"{path}.capacity", mine.get(key) or {}, theirs.get(key) or {}, out)
            elif key == "taints":
                _diff_taints(f"{path}.taints", mine.get(key) or [], theirs.get(key) or [], out)
            elif key == "consumesCounters":
                _diff_counters(
                    f"{path}.consumesCounters", "counterSet", mine.get(key), theirs.get(key), out
                )
            else:
                _diff_plain(f"{path}.{key}", mine.get(key), theirs.get(key), out)


def _diff_capacity(
    path: str, desired: Mapping[str, Any], observed: Mapping[str, Any], out: list[str]
) -> None:
    for name in sorted(set(desired) | set(observed)):
        mine, theirs = desired.get(name), observed.get(name)
        if mine is None or theirs is None:
            _diff_plain(f"{path}.{name}", mine, theirs, out)
            continue
        if _quantity(mine.get("value")) != _quantity(theirs.get("value")):
            out.append(f"{path}.{name}.value: {mine.get('value')!r} != {theirs.get('value')!r}")
        rest_mine = {k: v for k, v in mine.items() if k != "value"}
        rest_theirs = {k: v for k, v in theirs.items() if k != "value"}
        _diff_plain(f"{path}.{name}", rest_mine, rest_theirs, out)


def _diff_counters(path: str, key: str, desired: Any, observed: Any, out: list[str]) -> None:
    """Counter sets (``sharedCounters``) or consumptions (``consumesCounters``): the same
    entries in the same order, each counter equal by value (quantity spellings differ)."""
    mine, theirs = desired or [], observed or []
    if not isinstance(mine, list) or not isinstance(theirs, list):
        _diff_plain(path, mine, theirs, out)
        return
    if [e.get(key) for e in mine] != [e.get(key) if isinstance(e, Mapping) else e for e in theirs]:
        _diff_plain(path, mine, theirs, out)
        return
    for want, have in zip(mine, theirs, strict=True):
        here = f"{path}[{want.get(key)}]"
        _diff_capacity(
            f"{here}.counters", want.get("counters") or {}, have.get("counters") or {}, out
        )
        rest = sorted((set(want) | set(have)) - {key, "counters"})
        for name in rest:
            _diff_plain(f"{here}.{name}", want.get(name), have.get(name), out)


def _diff_taints(
    path: str, desired: Sequence[Any], observed: Sequence[Any], out: list[str]
) -> None:
    if len(desired) != len(observed):
        out.append(f"{path}: {len(desired)} taints != {len(observed)}")
        return
    for index, (mine, theirs) in enumerate(zip(desired, observed, strict=True)):
        here = f"{path}[{index}]"
        for key in ("key", "value", "effect"):
            _diff_plain(f"{here}.{key}", mine.get(key) or None, theirs.get(key) or None, out)
        wanted_time = mine.get("timeAdded")
        if wanted_time is not None and not _close_in_time(wanted_time, theirs.get("timeAdded")):
            out.append(f"{here}.timeAdded: {wanted_time!r} != {theirs.get('timeAdded')!r}")
        extra = sorted((set(mine) | set(theirs)) - {"key", "value", "effect", "timeAdded"})
        for key in extra:
            _diff_plain(f"{here}.{key}", mine.get(key), theirs.get(key), out)


def _diff_plain(path: str, desired: Any, observed: Any, out: list[str]) -> None:
    desired, observed = _absent_if_empty(desired), _absent_if_empty(observed)
    if isinstance(desired, Mapping) and isinstance(observed, Mapping):
        for key in sorted(set(desired) | set(observed), key=str):
            _diff_plain(f"{path}.{key}", desired.get(key), observed.get(key), out)
    elif isinstance(desired, list) and isinstance(observed, list) and len(desired) == len(observed):
        for index, (mine, theirs) in enumerate(zip(desired, observed, strict=True)):
            _diff_plain(f"{path}[{index}]", mine, theirs, out)
    elif desired != observed or isinstance(desired, bool) != isinstance(observed, bool):
        out.append(f"{path}: {desired!r} != {observed!r}")


def _absent_if_empty(value: Any) -> Any:
    return None if value is None or (isinstance(value, Mapping | list) and not value) else value


def _quantity(value: Any) -> Fraction | str:
    try:
        return parse_quantity(value) if isinstance(value, str) else Fraction(value)
    except (InvalidValueError, TypeError, ValueError):
        return repr(value)  # unparsable: compare as text, so it shows up as a difference


def _close_in_time(desired: Any, observed: Any) -> bool:
    try:
        wanted = datetime.fromisoformat(str(desired))
        actual = datetime.fromisoformat(str(observed))
        return abs((wanted - actual).total_seconds()) <= TIME_ADDED_TOLERANCE_S
    except (TypeError, ValueError):
        return bool(desired == observed)
