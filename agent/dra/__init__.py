"""The Kubernetes DRA domain, pure and synchronous: inventory in, devices and slices out.

Nothing in this package performs I/O, so all of it is tested with plain unit and property
tests. ``devices`` decides what is allocatable and how it is described, ``slices`` lays the
devices out as ResourceSlice objects, ``model`` holds the validated types, ``names``,
``quantity`` and ``limits`` the Kubernetes rules they follow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.dra.devices import DeviceSet, DroppedAttribute, build_device_set, build_devices
    from agent.dra.errors import (
        DraModelError,
        DuplicateDeviceError,
        InvalidNameError,
        InvalidValueError,
        LimitExceededError,
    )
    from agent.dra.model import DeviceAttribute, DeviceTaint, DraDevice
    from agent.dra.slices import build_slices, slice_differences, slices_match

# Loaded on first use (PEP 562): the agent's start imports agent.dra.names before it opens the
# kubelet's sockets, and the device and slice modules are needed only after that.
_HOMES = {
    "DeviceSet": "devices",
    "DroppedAttribute": "devices",
    "build_device_set": "devices",
    "build_devices": "devices",
    "DraModelError": "errors",
    "DuplicateDeviceError": "errors",
    "InvalidNameError": "errors",
    "InvalidValueError": "errors",
    "LimitExceededError": "errors",
    "DeviceAttribute": "model",
    "DeviceTaint": "model",
    "DraDevice": "model",
    "build_slices": "slices",
    "slice_differences": "slices",
    "slices_match": "slices",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"agent.dra.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "DeviceAttribute",
    "DeviceSet",
    "DeviceTaint",
    "DraDevice",
    "DraModelError",
    "DroppedAttribute",
    "DuplicateDeviceError",
    "InvalidNameError",
    "InvalidValueError",
    "LimitExceededError",
    "build_device_set",
    "build_devices",
    "build_slices",
    "slice_differences",
    "slices_match",
]
