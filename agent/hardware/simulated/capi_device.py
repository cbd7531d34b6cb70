"""Simulated NVML C functions for the library session, the system and whole devices.

Each function takes the library object first, then the C arguments, writes its results into the
out-parameters and returns ``None`` (success) or raises ``NvmlReturn`` with an NVML error code.
"""

from __future__ import annotations

from typing import Any

from agent.hardware.simulated.cabi import (
    as_int,
    fill_pci_info,
    handle_value,
    set_value,
    target,
    write_handle,
    write_string,
)
from agent.hardware.simulated.core import LibraryCore as Lib
from agent.hardware.simulated.models import GpuModel
from agent.hardware.simulated.state import (
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNINITIALIZED,
    NvmlReturn,
    SimGpu,
    SimMigDevice,
)

NVLINK_DEVICE_TYPE_GPU = 0
NVLINK_DEVICE_TYPE_SWITCH = 2
FABRIC_INFO_V2 = 0x02000024
MEMORY_V2 = 0x02000028
_ERROR_STRINGS = {
    1: "Uninitialized",
    2: "Invalid Argument",
    3: "Not Supported",
    6: "Not Found",
    10: "Timeout",
    15: "GPU is lost",
    19: "In use by another client",
    23: "Insufficient resources",
    29: "Invalid state",
}


def gpu_of(lib: Lib, handle: Any) -> SimGpu:
    """The physical GPU behind a device handle (not a MIG device)."""
    obj = lib.resolve(handle_value(handle))
    if not isinstance(obj, SimGpu):
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    return obj


def device_of(lib: Lib, handle: Any) -> SimGpu | SimMigDevice:
    """A GPU or MIG device behind a device handle."""
    obj = lib.resolve(handle_value(handle))
    if not isinstance(obj, SimGpu | SimMigDevice):
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    return obj


def _init(lib: Lib, flags: Any = 0) -> None:
    lib.init_count += 1


def _shutdown(lib: Lib) -> None:
    if lib.init_count == 0:
        raise NvmlReturn(NVML_ERROR_UNINITIALIZED)
    lib.init_count -= 1


def _error_string(lib: Lib, code: Any) -> bytes:
    return _ERROR_STRINGS.get(as_int(code), "Unknown Error").encode()


def _driver_version(lib: Lib, buffer: Any, length: Any) -> None:
    write_string(buffer, length, lib.profile.driver_version)


def _cuda_driver_version(lib: Lib, version: Any) -> None:
    set_value(version, lib.profile.cuda_driver_version)


def _count(lib: Lib, count: Any) -> None:
    set_value(count, len(lib.state.gpus))


def _handle_by_index(lib: Lib, index: Any, device: Any) -> None:
    i = as_int(index)
    if not 0 <= i < len(lib.state.gpus):
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    gpu = lib.state.gpus[i]
    if gpu.lost:
        raise NvmlReturn(NVML_ERROR_GPU_IS_LOST)
    write_handle(device, gpu.handle)


def _handle_by_uuid(lib: Lib, value: Any, device: Any) -> None:
    text = getattr(value, "value", value)
    text = text.decode() if isinstance(text, bytes) else str(text)
    gpu = lib.state.gpu_by_uuid(text)
    if gpu is not None:
        lib.resolve(gpu.handle)
        write_handle(device, gpu.handle)
        return
    for candidate in lib.state.gpus:
        for ci in candidate.mig_devices():
            if ci.uuid == text:
                lib.resolve(ci.mig_handle)
                write_handle(device, ci.mig_handle)
                return
    raise NvmlReturn(NVML_ERROR_NOT_FOUND)


def _uuid(lib: Lib, handle: Any, buffer: Any, length: Any) -> None:
    device = device_of(lib, handle)
    if isinstance(device, SimMigDevice):
        write_string(buffer, length, device.compute_instance.uuid)
    else:
        write_string(buffer, length, device.spec.uuid)


def _minor(lib: Lib, handle: Any, minor: Any) -> None:
    set_value(minor, gpu_of(lib, handle).spec.minor)


def _name(lib: Lib, handle: Any, buffer: Any, length: Any) -> None:
    device = device_of(lib, handle)
    if isinstance(device, SimMigDevice):
        profile = device.compute_instance.gpu_instance.profile
        write_string(buffer, length, f"{device.gpu.model.name} MIG {profile.name}")
    else:
        write_string(buffer, length, device.model.name)


def _brand(lib: Lib, handle: Any, brand: Any) -> None:
    set_value(brand, _model(lib, handle).brand)


def _model(lib: Lib, handle: Any) -> GpuModel:
    device = device_of(lib, handle)
    return device.gpu.model if isinstance(device, SimMigDevice) else device.model


def _architecture(lib: Lib, handle: Any, arch: Any) -> None:
    set_value(arch, _model(lib, handle).architecture)


def _compute_capability(lib: Lib, handle: Any, major: Any, minor: Any) -> None:
    cc = _model(lib, handle).cuda_compute_capability
    set_value(major, cc[0])
    set_value(minor, cc[1])


def _memory_info(lib: Lib, handle: Any, memory: Any) -> None:
    device = device_of(lib, handle)
    if isinstance(device, SimMigDevice):
        total = device.compute_instance.gpu_instance.profile.memory_mib << 20
    else:
        total = device.model.memory_mib << 20
    info = target(memory)
    info.total, info.free, info.used = total, total, 0


def _memory_info_v2(lib: Lib, handle: Any, memory: Any) -> None:
    info = target(memory)
    if info.version != MEMORY_V2:
        raise NvmlReturn(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    _memory_info(lib, handle, memory)
    info.reserved = 0


def _pci_info(lib: Lib, handle: Any, info: Any) -> None:
    gpu = gpu_of(lib, handle)
    fill_pci_info(target(info), gpu.spec.pci_bus_id, gpu.model.pci_device_id)


def _link_peer(lib: Lib, handle: Any, link: Any) -> tuple[SimGpu, str, int]:
    """The far end of one NVLink: (GPU, remote PCI bus id, remote device type)."""
    gpu = gpu_of(lib, handle)
    links = gpu.model.nvlinks
    profile = lib.profile
    if links == 0 or not (profile.nvswitches or profile.bridges):
        raise NvmlReturn(NVML_ERROR_NOT_SUPPORTED)
    number = as_int(link)
    if not 0 <= number < links:
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    if profile.nvswitches:
        switch = profile.nvswitches[number % len(profile.nvswitches)]
        return gpu, switch, NVLINK_DEVICE_TYPE_SWITCH
    for a, b in profile.bridges:
        if gpu.spec.index in (a, b):
            peer = lib.state.gpus[b if gpu.spec.index == a else a]
            return gpu, peer.spec.pci_bus_id, NVLINK_DEVICE_TYPE_GPU
    raise NvmlReturn(NVML_ERROR_NOT_SUPPORTED)


def _nvlink_state(lib: Lib, handle: Any, link: Any, active: Any) -> None:
    _link_peer(lib, handle, link)
    set_value(active, 1)


def _nvlink_remote_pci(lib: Lib, handle: Any, link: Any, info: Any) -> None:
    _, bus_id, _ = _link_peer(lib, handle, link)
    fill_pci_info(target(info), bus_id, 0)


def _nvlink_remote_type(lib: Lib, handle: Any, link: Any, kind: Any) -> None:
    set_value(kind, _link_peer(lib, handle, link)[2])


def _fill_fabric(lib: Lib, handle: Any, info: Any) -> None:
    gpu_of(lib, handle)
    fabric = lib.profile.fabric
    if fabric is None:
        raise NvmlReturn(NVML_ERROR_NOT_SUPPORTED)
    struct = target(info)
    for i, byte in enumerate(fabric.cluster_uuid.bytes):
        struct.clusterUuid[i] = byte
    struct.status = 0
    struct.cliqueId = fabric.clique_id
    struct.state = fabric.state


def _fabric_info_v(lib: Lib, handle: Any, info: Any) -> None:
    if target(info).version != FABRIC_INFO_V2:
        raise NvmlReturn(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    _fill_fabric(lib, handle, info)
    target(info).healthMask = 0


FUNCTIONS = {
    "nvmlInit_v2": _init,
    "nvmlInitWithFlags": _init,
    "nvmlShutdown": _shutdown,
    "nvmlErrorString": _error_string,
    "nvmlSystemGetDriverVersion": _driver_version,
    "nvmlSystemGetCudaDriverVersion": _cuda_driver_version,
    "nvmlSystemGetCudaDriverVersion_v2": _cuda_driver_version,
    "nvmlDeviceGetCount_v2": _count,
    "nvmlDeviceGetHandleByIndex_v2": _handle_by_index,
    "nvmlDeviceGetHandleByUUID": _handle_by_uuid,
    "nvmlDeviceGetUUID": _uuid,
    "nvmlDeviceGetMinorNumber": _minor,
    "nvmlDeviceGetName": _name,
    "nvmlDeviceGetBrand": _brand,
    "nvmlDeviceGetArchitecture": _architecture,
    "nvmlDeviceGetCudaComputeCapability": _compute_capability,
    "nvmlDeviceGetMemoryInfo": _memory_info,
    "nvmlDeviceGetMemoryInfo_v2": _memory_info_v2,
    "nvmlDeviceGetPciInfo_v3": _pci_info,
    "nvmlDeviceGetNvLinkState": _nvlink_state,
    "nvmlDeviceGetNvLinkRemotePciInfo_v2": _nvlink_remote_pci,
    "nvmlDeviceGetNvLinkRemoteDeviceType": _nvlink_remote_type,
    "nvmlDeviceGetGpuFabricInfo": _fill_fabric,
    "nvmlDeviceGetGpuFabricInfoV": _fabric_info_v,
}
