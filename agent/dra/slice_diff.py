"""Compare ResourceSlice objects: what identifies a slice's content, and where an observed
slice differs from the desired one, tolerant of what the API server sets or re-serializes on
its own (the slice publisher's matching, :mod:`agent.kube.sliceplan`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from fractions import Fraction
from typing import Any

from agent.dra.errors import InvalidValueError
from agent.dra.quantity import parse_quantity

#: Tolerance for taint ``timeAdded``: the API server stores it at second precision.
TIME_ADDED_TOLERANCE_S = 1.0


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
