"""Simulated NVML C functions for event sets: create, register, wait (blocking), free.

``nvmlEventSetWait_v2`` blocks on the library's condition variable up to its timeout, as the real
call blocks in the kernel, and returns GPU_IS_LOST while a GPU registered in the set is lost.
"""

from __future__ import annotations

import time
from typing import Any

from agent.hardware.simulated.cabi import as_int, handle_value, set_value, target, write_handle
from agent.hardware.simulated.capi_device import gpu_of
from agent.hardware.simulated.core import LibraryCore as Lib
from agent.hardware.simulated.events import SUPPORTED_EVENTS, SimEventSet
from agent.hardware.simulated.state import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NvmlReturn,
    SimGpu,
)


def _event_set(lib: Lib, handle: Any) -> SimEventSet:
    obj = lib.state.handles.get(handle_value(handle))
    if not isinstance(obj, SimEventSet) or obj.freed:
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    return obj


def _create(lib: Lib, out: Any) -> None:
    event_set = SimEventSet()
    event_set.handle = lib.state.handles.add(event_set)
    write_handle(out, event_set.handle)


def _supported(lib: Lib, handle: Any, types: Any) -> None:
    gpu_of(lib, handle)
    set_value(types, SUPPORTED_EVENTS)


def _register(lib: Lib, handle: Any, types: Any, event_set: Any) -> None:
    gpu = gpu_of(lib, handle)
    mask = as_int(types)
    target_set = _event_set(lib, event_set)
    if mask & ~SUPPORTED_EVENTS:
        raise NvmlReturn(NVML_ERROR_NOT_SUPPORTED)
    registered = target_set.registrations.get(gpu.handle, 0)
    target_set.registrations[gpu.handle] = registered | mask


def _wait(lib: Lib, event_set: Any, data: Any, timeout_ms: Any) -> None:
    waiting = _event_set(lib, event_set)
    deadline = time.monotonic() + as_int(timeout_ms) / 1000
    while True:
        if waiting.freed:
            raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
        for gpu_handle in waiting.registrations:
            gpu = lib.state.handles.get(gpu_handle)
            if isinstance(gpu, SimGpu) and gpu.lost:
                raise NvmlReturn(NVML_ERROR_GPU_IS_LOST)
        if waiting.pending:
            event = waiting.pending.popleft()
            struct = target(data)
            write_handle(data, event.gpu.handle)  # .device is the struct's first field
            struct.eventType = event.event_type
            struct.eventData = event.data
            struct.gpuInstanceId = event.gpu_instance_id
            struct.computeInstanceId = event.compute_instance_id
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NvmlReturn(NVML_ERROR_TIMEOUT)
        lib.changed.wait(remaining)


def _free(lib: Lib, event_set: Any) -> None:
    freed = _event_set(lib, event_set)
    freed.freed = True
    lib.state.handles.remove(freed.handle)
    lib.changed.notify_all()


FUNCTIONS = {
    "nvmlEventSetCreate": _create,
    "nvmlDeviceGetSupportedEventTypes": _supported,
    "nvmlDeviceRegisterEvents": _register,
    "nvmlEventSetWait_v2": _wait,
    "nvmlEventSetFree": _free,
}
