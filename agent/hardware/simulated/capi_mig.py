"""Simulated NVML C functions for MIG: mode, profiles, placements, GPU and compute instances.

Errors follow the NVML reference: NOT_SUPPORTED on GPUs without MIG (and for creation while MIG
mode is disabled), INVALID_ARGUMENT for an unknown profile or a placement the profile does not
offer, INSUFFICIENT_RESOURCES when the placement overlaps an existing instance or the profile's
instance count is used up, IN_USE when destroying a GPU instance that still has compute instances.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from agent.hardware.simulated.cabi import (
    as_int,
    handle_value,
    set_value,
    target,
    write_handle,
)
from agent.hardware.simulated.capi_device import device_of, gpu_of
from agent.hardware.simulated.core import LibraryCore as Lib
from agent.hardware.simulated.state import (
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    NVML_ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NvmlReturn,
    SimComputeInstance,
    SimGpu,
    SimGpuInstance,
    SimMigDevice,
)

GI_PROFILE_COUNT = 0x12
GI_PROFILE_INFO_V2 = 0x02000098
CI_PROFILE_INFO_V2 = 0x02000088
MAX_MIG_DEVICES = 7


def _mig_gpu(lib: Lib, handle: Any) -> SimGpu:
    gpu = gpu_of(lib, handle)
    if not gpu.model.mig_capable:
        raise NvmlReturn(NVML_ERROR_NOT_SUPPORTED)
    return gpu


def _gpu_instance(lib: Lib, handle: Any) -> SimGpuInstance:
    obj = lib.resolve(handle_value(handle))
    if not isinstance(obj, SimGpuInstance):
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    return obj


def _compute_instance(lib: Lib, handle: Any) -> SimComputeInstance:
    obj = lib.resolve(handle_value(handle))
    if not isinstance(obj, SimComputeInstance):
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    return obj


def _mig_device(lib: Lib, handle: Any) -> SimMigDevice:
    device = device_of(lib, handle)
    if not isinstance(device, SimMigDevice):
        raise NvmlReturn(NVML_ERROR_NOT_SUPPORTED)
    return device


def _write_array(array: Any, count: Any, values: Sequence[Any], write: Any) -> None:
    """Fill a caller's array (NULL: report the count only) and the count out-parameter."""
    if array is not None:
        if isinstance(array, ctypes.Array) and len(array) < len(values):
            set_value(count, len(values))
            raise NvmlReturn(NVML_ERROR_INSUFFICIENT_SIZE)
        for i, value in enumerate(values):
            write(array, i, value)
    set_value(count, len(values))


def _get_mig_mode(lib: Lib, handle: Any, current: Any, pending: Any) -> None:
    gpu = _mig_gpu(lib, handle)
    set_value(current, gpu.mig_current)
    set_value(pending, gpu.mig_pending)


def _set_mig_mode(lib: Lib, handle: Any, mode: Any, activation: Any) -> None:
    gpu = gpu_of(lib, handle)
    before = gpu.mig_current
    lib.state.set_mig_mode(gpu, as_int(mode))
    set_value(activation, 0)
    if gpu.mig_current != before:
        lib.mig_changed()


def _gi_profile_info(lib: Lib, handle: Any, profile: Any, info: Any) -> None:
    gpu = _mig_gpu(lib, handle)
    enum = as_int(profile)
    if not 0 <= enum < GI_PROFILE_COUNT:
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    spec = gpu.model.gi_by_enum(enum)
    if spec is None:
        raise NvmlReturn(NVML_ERROR_NOT_SUPPORTED)
    struct = target(info)
    struct.id, struct.isP2pSupported = spec.id, 0
    struct.sliceCount, struct.instanceCount = spec.slices, spec.instances
    struct.multiprocessorCount, struct.copyEngineCount = spec.sm, spec.ce
    struct.decoderCount, struct.encoderCount = spec.dec, spec.enc
    struct.jpegCount, struct.ofaCount = spec.jpeg, spec.ofa
    struct.memorySizeMB = spec.memory_mib


def _gi_profile_info_v(lib: Lib, handle: Any, profile: Any, info: Any) -> None:
    if target(info).version != GI_PROFILE_INFO_V2:
        raise NvmlReturn(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    _gi_profile_info(lib, handle, profile, info)
    spec = gpu_of(lib, handle).model.gi_by_enum(as_int(profile))
    assert spec is not None
    target(info).name = f"MIG {spec.name}".encode()


def _possible_placements(lib: Lib, handle: Any, profile_id: Any, array: Any, count: Any) -> None:
    spec = _mig_gpu(lib, handle).model.gi_by_id(as_int(profile_id))
    if spec is None:
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)

    def write(arr: Any, i: int, placement: tuple[int, int]) -> None:
        arr[i].start, arr[i].size = placement

    _write_array(array, count, spec.placements, write)


def _create_gi(lib: Lib, handle: Any, profile_id: Any, placement: Any, out: Any) -> None:
    where = target(placement)
    gi = lib.state.create_gpu_instance(
        gpu_of(lib, handle), as_int(profile_id), where.start, where.size
    )
    write_handle(out, gi.handle)
    lib.mig_changed()


def _write_handle_item(array: Any, i: int, obj: SimGpuInstance | SimComputeInstance) -> None:
    ctypes.c_void_p.from_buffer(array, i * ctypes.sizeof(ctypes.c_void_p)).value = obj.handle


def _gpu_instances(lib: Lib, handle: Any, profile_id: Any, array: Any, count: Any) -> None:
    gpu = _mig_gpu(lib, handle)
    wanted = as_int(profile_id)
    found = [gi for _, gi in sorted(gpu.gpu_instances.items()) if gi.profile.id == wanted]
    _write_array(array, count, found, _write_handle_item)


def _gpu_instance_by_id(lib: Lib, handle: Any, gi_id: Any, out: Any) -> None:
    gpu = _mig_gpu(lib, handle)
    if not gpu.mig_current:
        raise NvmlReturn(NVML_ERROR_NOT_SUPPORTED)
    gi = gpu.gpu_instances.get(as_int(gi_id))
    if gi is None:
        raise NvmlReturn(NVML_ERROR_NOT_FOUND)
    write_handle(out, gi.handle)


def _gi_info(lib: Lib, handle: Any, info: Any) -> None:
    gi = _gpu_instance(lib, handle)
    struct = target(info)
    ctypes.c_void_p.from_buffer(struct, 0).value = gi.gpu.handle
    struct.id, struct.profileId = gi.id, gi.profile.id
    struct.placement.start, struct.placement.size = gi.start, gi.size


def _gi_destroy(lib: Lib, handle: Any) -> None:
    lib.state.destroy_gpu_instance(_gpu_instance(lib, handle))
    lib.mig_changed()


def _ci_profile_info(lib: Lib, handle: Any, profile: Any, engines: Any, info: Any) -> None:
    gi = _gpu_instance(lib, handle)
    ci = next((c for c in gi.gpu.model.ci_profiles(gi.profile) if c.enum == as_int(profile)), None)
    if ci is None:
        raise NvmlReturn(NVML_ERROR_NOT_SUPPORTED)
    struct = target(info)
    struct.id, struct.sliceCount, struct.instanceCount = ci.enum, ci.slices, ci.instances
    struct.multiprocessorCount = ci.sm
    struct.sharedCopyEngineCount, struct.sharedDecoderCount = gi.profile.ce, gi.profile.dec
    struct.sharedEncoderCount, struct.sharedJpegCount = gi.profile.enc, gi.profile.jpeg
    struct.sharedOfaCount = gi.profile.ofa


def _ci_profile_info_v(lib: Lib, handle: Any, profile: Any, engines: Any, info: Any) -> None:
    if target(info).version != CI_PROFILE_INFO_V2:
        raise NvmlReturn(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    _ci_profile_info(lib, handle, profile, engines, info)
    gi = _gpu_instance(lib, handle)
    slices = target(info).sliceCount
    name = gi.profile.name if slices == gi.profile.slices else f"{slices}c.{gi.profile.name}"
    target(info).name = f"MIG {name}".encode()


def _create_ci(lib: Lib, handle: Any, profile_id: Any, out: Any) -> None:
    ci = lib.state.create_compute_instance(_gpu_instance(lib, handle), as_int(profile_id))
    write_handle(out, ci.handle)
    lib.mig_changed()


def _compute_instances(lib: Lib, handle: Any, profile_id: Any, array: Any, count: Any) -> None:
    gi = _gpu_instance(lib, handle)
    wanted = as_int(profile_id)
    found = [c for _, c in sorted(gi.compute_instances.items()) if c.profile.enum == wanted]
    _write_array(array, count, found, _write_handle_item)


def _compute_instance_by_id(lib: Lib, handle: Any, ci_id: Any, out: Any) -> None:
    ci = _gpu_instance(lib, handle).compute_instances.get(as_int(ci_id))
    if ci is None:
        raise NvmlReturn(NVML_ERROR_NOT_FOUND)
    write_handle(out, ci.handle)


def _ci_info(lib: Lib, handle: Any, info: Any) -> None:
    ci = _compute_instance(lib, handle)
    struct = target(info)
    pointer_size = ctypes.sizeof(ctypes.c_void_p)
    ctypes.c_void_p.from_buffer(struct, 0).value = ci.gpu_instance.gpu.handle
    ctypes.c_void_p.from_buffer(struct, pointer_size).value = ci.gpu_instance.handle
    struct.id, struct.profileId = ci.id, ci.profile.enum
    struct.placement.start, struct.placement.size = ci.start, ci.profile.slices


def _ci_destroy(lib: Lib, handle: Any) -> None:
    lib.state.destroy_compute_instance(_compute_instance(lib, handle))
    lib.mig_changed()


def _max_mig_devices(lib: Lib, handle: Any, count: Any) -> None:
    _mig_gpu(lib, handle)
    set_value(count, MAX_MIG_DEVICES)


def _mig_handle_by_index(lib: Lib, handle: Any, index: Any, out: Any) -> None:
    gpu = _mig_gpu(lib, handle)
    i = as_int(index)
    if not 0 <= i < MAX_MIG_DEVICES:
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    devices = gpu.mig_devices()
    if i >= len(devices):
        raise NvmlReturn(NVML_ERROR_NOT_FOUND)
    write_handle(out, devices[i].mig_handle)


def _gi_id(lib: Lib, handle: Any, out: Any) -> None:
    set_value(out, _mig_device(lib, handle).compute_instance.gpu_instance.id)


def _ci_id(lib: Lib, handle: Any, out: Any) -> None:
    set_value(out, _mig_device(lib, handle).compute_instance.id)


def _parent(lib: Lib, handle: Any, out: Any) -> None:
    device = device_of(lib, handle)
    if not isinstance(device, SimMigDevice):
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    write_handle(out, device.gpu.handle)


def _is_mig(lib: Lib, handle: Any, out: Any) -> None:
    set_value(out, int(isinstance(device_of(lib, handle), SimMigDevice)))


FUNCTIONS = {
    "nvmlDeviceGetMigMode": _get_mig_mode,
    "nvmlDeviceSetMigMode": _set_mig_mode,
    "nvmlDeviceGetGpuInstanceProfileInfo": _gi_profile_info,
    "nvmlDeviceGetGpuInstanceProfileInfoV": _gi_profile_info_v,
    "nvmlDeviceGetGpuInstancePossiblePlacements_v2": _possible_placements,
    "nvmlDeviceCreateGpuInstanceWithPlacement": _create_gi,
    "nvmlDeviceGetGpuInstances": _gpu_instances,
    "nvmlDeviceGetGpuInstanceById": _gpu_instance_by_id,
    "nvmlGpuInstanceGetInfo": _gi_info,
    "nvmlGpuInstanceDestroy": _gi_destroy,
    "nvmlGpuInstanceGetComputeInstanceProfileInfo": _ci_profile_info,
    "nvmlGpuInstanceGetComputeInstanceProfileInfoV": _ci_profile_info_v,
    "nvmlGpuInstanceCreateComputeInstance": _create_ci,
    "nvmlGpuInstanceGetComputeInstances": _compute_instances,
    "nvmlGpuInstanceGetComputeInstanceById": _compute_instance_by_id,
    "nvmlComputeInstanceGetInfo_v2": _ci_info,
    "nvmlComputeInstanceDestroy": _ci_destroy,
    "nvmlDeviceGetMaxMigDeviceCount": _max_mig_devices,
    "nvmlDeviceGetMigDeviceHandleByIndex": _mig_handle_by_index,
    "nvmlDeviceGetGpuInstanceId": _gi_id,
    "nvmlDeviceGetComputeInstanceId": _ci_id,
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": _parent,
    "nvmlDeviceIsMigDeviceHandle": _is_mig,
}
