"""Read a GPU's MIG state from NVML (synchronous; runs in the NVML worker thread).

GPU-instance profiles and their placements are readable whenever the GPU supports MIG.
Compute-instance profiles can only be asked of an existing GPU instance, so a profile lists them
only when the GPU has an instance of it (static MIG); otherwise ``compute_profiles`` is empty.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass
from typing import Any

import pynvml

from agent.hardware.inventory import ComputeInstanceProfile, MigDevice, MigPlacement, MigProfile
from agent.hardware.nvml import NOT_AVAILABLE, call_failed, optional, required

_SKIP_PROFILE = NOT_AVAILABLE | {pynvml.NVML_ERROR_INVALID_ARGUMENT}


@dataclass(frozen=True, slots=True)
class MigState:
    capable: bool = False
    enabled: bool = False
    profiles: tuple[MigProfile, ...] = ()
    devices: tuple[MigDevice, ...] = ()


def read_mig(handle: Any, gpu_uuid: str, where: str) -> MigState:
    mode = optional(pynvml.nvmlDeviceGetMigMode, where, handle)
    if mode is None:
        return MigState()
    enabled = mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    profiles = [p for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)
                if (p := _profile(handle, enum, where)) is not None]  # fmt: skip
    devices: list[MigDevice] = []
    if enabled:
        devices, compute = _devices(handle, gpu_uuid, {p.profile_id: p for p in profiles}, where)
        profiles = [dataclasses.replace(p, compute_profiles=compute.get(p.profile_id, ()))
                    for p in profiles]  # fmt: skip
        by_id = {p.profile_id: p for p in profiles}
        devices = [dataclasses.replace(d, profile=by_id[d.profile.profile_id]) for d in devices]
    return MigState(True, enabled, tuple(profiles), tuple(devices))


def _profile_info(handle: Any, enum: int) -> Any:
    try:
        return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum)
    except pynvml.NVMLError_FunctionNotFound:
        return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum, version=1)


def _profile(handle: Any, enum: int, where: str) -> MigProfile | None:
    try:
        info = _profile_info(handle, enum)
    except pynvml.NVMLError as exc:
        if exc.value in _SKIP_PROFILE:
            return None
        raise call_failed(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, exc, where) from exc
    name = getattr(info, "name", b"")
    name = name.decode() if isinstance(name, bytes) else str(name)
    if not name:  # version-1 structs carry no name: approximate it (drivers >= 565 have V)
        suffix = "+me" if enum == pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 else ""
        name = f"{info.sliceCount}g.{(info.memorySizeMB + 1023) // 1024}gb{suffix}"
    return MigProfile(
        profile_index=enum,
        profile_id=int(info.id),
        name=name.removeprefix("MIG "),
        slice_count=int(info.sliceCount),
        instance_count=int(info.instanceCount),
        memory_mib=int(info.memorySizeMB),
        multiprocessors=int(info.multiprocessorCount),
        copy_engines=int(info.copyEngineCount),
        decoders=int(info.decoderCount),
        encoders=int(info.encoderCount),
        jpeg_engines=int(info.jpegCount),
        ofa_engines=int(info.ofaCount),
        placements=_placements(handle, int(info.id), where),
    )


def _placements(handle: Any, profile_id: int, where: str) -> tuple[MigPlacement, ...]:
    array = (pynvml.c_nvmlGpuInstancePlacement_t * 8)()
    count = ctypes.c_uint(0)
    done = optional(
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements,
        where, handle, profile_id, array, ctypes.byref(count),
    )  # fmt: skip
    if done is None:
        return ()
    return tuple(MigPlacement(array[i].start, array[i].size) for i in range(count.value))


def _compute_profiles(gpu_instance: Any, where: str) -> tuple[ComputeInstanceProfile, ...]:
    found = []
    for enum in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gpu_instance, enum, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
        except pynvml.NVMLError as exc:
            if exc.value in _SKIP_PROFILE:
                continue
            raise call_failed(
                pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo, exc, where
            ) from exc
        found.append(
            ComputeInstanceProfile(
                profile_index=enum,
                profile_id=int(info.id),
                slice_count=int(info.sliceCount),
                instance_count=int(info.instanceCount),
                multiprocessors=int(info.multiprocessorCount),
            )
        )
    return tuple(found)


def _devices(
    handle: Any, parent_uuid: str, profiles: dict[int, MigProfile], where: str
) -> tuple[list[MigDevice], dict[int, tuple[ComputeInstanceProfile, ...]]]:
    devices = []
    compute: dict[int, tuple[ComputeInstanceProfile, ...]] = {}
    count = optional(pynvml.nvmlDeviceGetMaxMigDeviceCount, where, handle) or 0
    for index in range(count):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_NOT_FOUND:
                continue
            raise call_failed(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, exc, where) from exc
        mig_uuid = required(pynvml.nvmlDeviceGetUUID, where, mig)
        mig_where = f"MIG device {mig_uuid} of {where}"
        gi_id = required(pynvml.nvmlDeviceGetGpuInstanceId, mig_where, mig)
        ci_id = required(pynvml.nvmlDeviceGetComputeInstanceId, mig_where, mig)
        gpu_instance = required(pynvml.nvmlDeviceGetGpuInstanceById, mig_where, handle, gi_id)
        info = required(pynvml.nvmlGpuInstanceGetInfo, mig_where, gpu_instance)
        profile = profiles.get(int(info.profileId))
        if profile is None:
            continue  # an instance of a profile NVML did not list: nothing we could publish
        if profile.profile_id not in compute:
            compute[profile.profile_id] = _compute_profiles(gpu_instance, mig_where)
        memory = optional(pynvml.nvmlDeviceGetMemoryInfo, mig_where, mig)
        devices.append(
            MigDevice(
                uuid=mig_uuid,
                parent_uuid=parent_uuid,
                gpu_instance_id=int(gi_id),
                compute_instance_id=int(ci_id),
                profile=profile,
                placement=MigPlacement(int(info.placement.start), int(info.placement.size)),
                memory_bytes=int(memory.total) if memory is not None else None,
            )
        )
    return devices, compute
