"""Lay a node's devices out as ``resource.k8s.io/v1`` ResourceSlice objects.

The pool is the node (as with the incumbent, nvidia-driver-facts.md §2.4), and slices are
cut so that each one stays within the API's device limits (kubelet-dra-protocol.md §4).
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
from typing import Any

from agent.dra import limits
from agent.dra.errors import DuplicateDeviceError, InvalidValueError
from agent.dra.model import DraDevice
from agent.dra.names import device_sort_key, validate_driver_name, validate_node_name
from agent.dra.quantity import parse_quantity

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
#: Tolerance for taint ``timeAdded``: the API server stores it at second precision.
TIME_ADDED_TOLERANCE_S = 1.0


def build_slices(
    devices: Iterable[DraDevice],
    *,
    node_name: str,
    driver_name: str,
    generation: int = 0,
    node_uid: str | None = None,
) -> list[dict[str, Any]]:
    """Complete ResourceSlice objects for this node's pool, ready to create.

    Devices are sorted by name and cut into runs of at most 128; a run holding a device
    with taints (or, later, consumesCounters) is halved, so no slice with such a device has
    more than 64. Tainting one device therefore reshapes only its own run of 128. There is
    always at least one slice: an empty pool is published as one slice without devices.
    With ``node_uid`` the slices get the Node as controlling owner, so Kubernetes garbage
    collects them with the Node, as the Go helper does.
    """
    validate_node_name(node_name)
    validate_driver_name(driver_name)
    if (
        isinstance(generation, bool)
        or not isinstance(generation, int)
        or not 0 <= generation < 2**63
    ):
        raise InvalidValueError(f"pool generation {generation!r} must be an int64 >= 0")
    chunks = layout(devices)
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
            "spec": {
                "driver": driver_name,
                "nodeName": node_name,
                "pool": {
                    "name": node_name,
                    "generation": generation,
                    "resourceSliceCount": len(chunks),
                },
                "devices": [device.to_dict() for device in chunk],
            },
        }
        for chunk in chunks
    ]


def layout(devices: Iterable[DraDevice]) -> list[list[DraDevice]]:
    """Split devices into slices (see :func:`build_slices`); never returns an empty list."""
    ordered = sorted(devices, key=lambda device: device_sort_key(device.name))
    for previous, current in pairwise(ordered):
        if previous.name == current.name:
            raise DuplicateDeviceError(
                f"device name {current.name!r} appears twice; names must be unique in a pool"
            )
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
