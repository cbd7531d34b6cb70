"""MIG state of the simulated library, driven through the ordinary pynvml functions."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from agent.hardware.simulated import SimulatedHost

Start = Callable[[str], SimulatedHost]


def placement(start: int, size: int) -> Any:
    value = pynvml.c_nvmlGpuInstancePlacement_t()
    value.start, value.size = start, size
    return ctypes.byref(value)


def create(handle: Any, profile_enum: int, start: int, size: int) -> Any:
    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_enum)
    return pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, info.id, placement(start, size))


def error_of(call: Callable[[], object]) -> int:
    with pytest.raises(pynvml.NVMLError) as caught:
        call()
    return int(caught.value.value)


def test_create_needs_mig_mode(nvml_host: Start) -> None:
    nvml_host("dgx-h100")
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetMigMode(handle) == [0, 0]
    assert error_of(lambda: create(handle, 0, 0, 1)) == pynvml.NVML_ERROR_NOT_SUPPORTED
    pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
    assert pynvml.nvmlDeviceGetMigMode(handle) == [1, 1]
    gi = create(handle, 0, 0, 1)
    info = pynvml.nvmlGpuInstanceGetInfo(gi)
    assert (info.profileId, info.placement.start, info.placement.size) == (19, 0, 1)


def test_placement_rules(nvml_host: Start) -> None:
    nvml_host("dgx-h100")
    handle = pynvml.nvmlDeviceGetHandleByIndex(1)
    pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
    three_g = pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE
    assert error_of(lambda: create(handle, three_g, 2, 4)) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert error_of(lambda: create(handle, three_g, 0, 3)) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    create(handle, three_g, 0, 4)
    overlapping = pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE
    code = error_of(lambda: create(handle, overlapping, 2, 2))
    assert code == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    create(handle, three_g, 4, 4)
    one_g = pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE
    assert error_of(lambda: create(handle, one_g, 6, 1)) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES


def test_instance_count_is_enforced(nvml_host: Start) -> None:
    nvml_host("dgx-h100")
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
    with_me = pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1
    create(handle, with_me, 0, 1)
    assert (
        error_of(lambda: create(handle, with_me, 1, 1)) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    )


def test_compute_instances_and_mig_devices(nvml_host: Start) -> None:
    host = nvml_host("dgx-h100")
    handle = pynvml.nvmlDeviceGetHandleByIndex(2)
    pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
    gi = create(handle, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 4, 4)
    ci_profile = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 0
    )
    assert (ci_profile.sliceCount, ci_profile.multiprocessorCount) == (3, 60)
    ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id)
    assert pynvml.nvmlComputeInstanceGetInfo(ci).id == 0
    code = error_of(lambda: pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id))
    assert code == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    assert pynvml.nvmlDeviceIsMigDeviceHandle(mig)
    mig_uuid = pynvml.nvmlDeviceGetUUID(mig)
    assert mig_uuid.startswith("MIG-")
    gi_id = pynvml.nvmlGpuInstanceGetInfo(gi).id
    assert pynvml.nvmlDeviceGetGpuInstanceId(mig) == gi_id
    parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
    assert pynvml.nvmlDeviceGetUUID(parent) == pynvml.nvmlDeviceGetUUID(handle)
    gpu_minor = pynvml.nvmlDeviceGetMinorNumber(handle)
    access = host.root / f"proc/driver/nvidia/capabilities/gpu{gpu_minor}/mig/gi{gi_id}/ci0/access"
    assert access.read_text().startswith("DeviceFileMinor: ")
    assert error_of(lambda: pynvml.nvmlGpuInstanceDestroy(gi)) == pynvml.NVML_ERROR_IN_USE
    pynvml.nvmlComputeInstanceDestroy(ci)
    pynvml.nvmlGpuInstanceDestroy(gi)
    assert not access.exists() and not access.parent.parent.exists()
    code = error_of(lambda: pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0))
    assert code == pynvml.NVML_ERROR_NOT_FOUND
    # The freed space can be used again, and the new device gets a new UUID.
    gi = create(handle, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 4, 4)
    pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id)
    again = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    assert pynvml.nvmlDeviceGetUUID(again) != mig_uuid


def test_gpu_instances_listing(nvml_host: Start) -> None:
    nvml_host("dgx-a100")
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, 0)
    array = (pynvml.c_nvmlGpuInstance_t * 7)()
    count = ctypes.c_uint(0)
    pynvml.nvmlDeviceGetGpuInstances(handle, info.id, array, ctypes.byref(count))
    assert count.value == 7
    starts = [pynvml.nvmlGpuInstanceGetInfo(array[i]).placement.start for i in range(7)]
    assert starts == list(range(7))


def test_disabling_mig_with_instances_is_refused(nvml_host: Start) -> None:
    nvml_host("dgx-a100")
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    code = error_of(lambda: pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_DISABLE))
    assert code == pynvml.NVML_ERROR_IN_USE


def test_no_mig_on_l40s(nvml_host: Start) -> None:
    nvml_host("l40s-pcie")
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert error_of(lambda: pynvml.nvmlDeviceGetMigMode(handle)) == pynvml.NVML_ERROR_NOT_SUPPORTED
    code = error_of(lambda: pynvml.nvmlDeviceSetMigMode(handle, 1))
    assert code == pynvml.NVML_ERROR_NOT_SUPPORTED
    code = error_of(lambda: pynvml.nvmlDeviceGetNvLinkState(handle, 0))
    assert code == pynvml.NVML_ERROR_NOT_SUPPORTED
