"""The Kubernetes DRA domain, pure and synchronous: inventory in, devices and slices out.

Nothing in this package performs I/O, so all of it is tested with plain unit and property
tests. ``devices`` decides what is allocatable and how it is described, ``slices`` lays the
devices out as ResourceSlice objects, ``model`` holds the validated types, ``names``,
``quantity`` and ``limits`` the Kubernetes rules they follow.
"""

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
