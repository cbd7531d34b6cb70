"""Helpers to read and write NVML's C calling convention from Python with ctypes.

The simulated library receives exactly what ``pynvml`` hands to the real ``libnvidia-ml.so.1``:
opaque handle pointers, ``byref`` pointers to out-parameters, char buffers with their length,
structs and arrays. These helpers write results into them the way C code would.
"""

from __future__ import annotations

import ctypes
from typing import Any

from agent.hardware.simulated.state import (
    NVML_ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_INVALID_ARGUMENT,
    NvmlReturn,
)


def as_int(arg: Any) -> int:
    """An integer argument, given as a Python int or a ctypes integer."""
    value = getattr(arg, "value", arg)
    if not isinstance(value, int):
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    return value


def handle_value(arg: Any) -> int:
    """The pointer value of an opaque handle argument (0 for NULL)."""
    if arg is None:
        return 0
    if isinstance(arg, int):
        return arg
    obj = getattr(arg, "_obj", None)  # a byref() to a handle
    if obj is not None:
        arg = obj
    return ctypes.cast(arg, ctypes.c_void_p).value or 0


def target(arg: Any) -> Any:
    """The ctypes object an out-parameter points to (``byref(x)``, ``pointer(x)`` or ``x``)."""
    if arg is None:
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    obj = getattr(arg, "_obj", None)
    if obj is not None:
        return obj
    if isinstance(arg, ctypes._Pointer):
        return arg.contents
    return arg


def set_value(arg: Any, value: int) -> None:
    """Write an integer out-parameter (``unsigned int *`` and friends)."""
    target(arg).value = value


def write_handle(arg: Any, value: int) -> None:
    """Write an opaque handle out-parameter (``nvmlDevice_t *`` and friends)."""
    ctypes.c_void_p.from_buffer(target(arg)).value = value


def handle_of(ctype: Any, value: int) -> Any:
    """A handle object of ``ctype`` (e.g. ``c_nvmlDevice_t``) pointing at ``value``."""
    return ctypes.cast(ctypes.c_void_p(value), ctype)


def write_string(buffer: Any, length: Any, text: str) -> None:
    """Copy a NUL-terminated string into a caller's char buffer of the given length."""
    data = text.encode()
    if buffer is None:
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    if len(data) + 1 > as_int(length):
        raise NvmlReturn(NVML_ERROR_INSUFFICIENT_SIZE)
    ctypes.memmove(buffer, data + b"\0", len(data) + 1)


def nvml_bus_id(bus_id: str) -> str:
    """NVML's spelling of a PCI bus id: 8-digit domain, upper-case hex (``00000000:18:00.0``)."""
    domain, rest = bus_id.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


def fill_pci_info(info: Any, bus_id: str, device_id: int) -> None:
    """Fill an ``nvmlPciInfo_t`` for ``bus_id`` (normalized ``dddd:bb:dd.f``)."""
    domain, bus, rest = bus_id.split(":")
    device, _function = rest.split(".")
    nvml_id = nvml_bus_id(bus_id).encode()
    info.busId = nvml_id
    info.busIdLegacy = nvml_id[:15]
    info.domain = int(domain, 16)
    info.bus = int(bus, 16)
    info.device = int(device, 16)
    info.pciDeviceId = device_id
    info.pciSubSystemId = 0
