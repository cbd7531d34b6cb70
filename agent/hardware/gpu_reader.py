"""Read one GPU's record from NVML (synchronous; runs in the NVML worker thread).

Only identity fields are required (UUID, name, PCI bus id, minor, compute capability); every
other field is optional and omitted when NVML answers NOT_SUPPORTED or lacks the function.
"""

from __future__ import annotations

import uuid
from ctypes import byref
from typing import Any

import pynvml

from agent.hardware.inventory import FabricInfo, Gpu, NvLink
from agent.hardware.mig_reader import read_mig
from agent.hardware.nvml import NOT_AVAILABLE, call_failed, optional, required

BRANDS = {
    0: "Unknown", 1: "Quadro", 2: "Tesla", 3: "NVS", 4: "Grid", 5: "GeForce", 6: "Titan",
    7: "NvidiaVApps", 8: "NvidiaVPC", 9: "NvidiaVCS", 10: "NvidiaVWS", 11: "NvidiaCloudGaming",
    12: "QuadroRTX", 13: "NvidiaRTX", 14: "Nvidia", 15: "GeForceRTX", 16: "TitanRTX",
}  # fmt: skip
ARCHITECTURES = {
    2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere",
    8: "Ada Lovelace", 9: "Hopper", 10: "Blackwell", 13: "Rubin",
}  # fmt: skip
FABRIC_STATES = {1: "not-started", 2: "in-progress", 3: "completed"}


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML's ``00000000:18:00.0`` as Kubernetes spells it: ``0000:18:00.0``, lower case."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    domain, rest = text.strip().lower().split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def read_gpu(index: int) -> Gpu:
    """Everything NVML tells about GPU ``index``, except host files and NVLink domains."""
    where = f"GPU {index}"
    handle = required(pynvml.nvmlDeviceGetHandleByIndex, where, index)
    gpu_uuid = required(pynvml.nvmlDeviceGetUUID, where, handle)
    where = f"GPU {index} ({gpu_uuid})"
    pci = required(pynvml.nvmlDeviceGetPciInfo, where, handle)
    memory = optional(pynvml.nvmlDeviceGetMemoryInfo, where, handle)
    brand = optional(pynvml.nvmlDeviceGetBrand, where, handle)
    architecture = optional(pynvml.nvmlDeviceGetArchitecture, where, handle)
    mig = read_mig(handle, gpu_uuid, where)
    return Gpu(
        index=index,
        minor=required(pynvml.nvmlDeviceGetMinorNumber, where, handle),
        uuid=gpu_uuid,
        name=required(pynvml.nvmlDeviceGetName, where, handle),
        brand=BRANDS.get(brand, "Unknown") if brand is not None else "Unknown",
        architecture=ARCHITECTURES.get(architecture, "Unknown") if architecture else "Unknown",
        cuda_compute_capability=tuple(
            required(pynvml.nvmlDeviceGetCudaComputeCapability, where, handle)
        ),
        pci_bus_id=normalize_bus_id(pci.busId),
        memory_bytes=int(memory.total) if memory is not None else None,
        mig_capable=mig.capable,
        mig_enabled=mig.enabled,
        mig_profiles=mig.profiles,
        mig_devices=mig.devices,
        nvlinks=read_nvlinks(handle, where),
        fabric=read_fabric(handle, where),
    )


def read_nvlinks(handle: Any, where: str) -> tuple[NvLink, ...]:
    """The GPU's NVLinks; empty when the GPU has none (NOT_SUPPORTED on link 0)."""
    links = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            active = pynvml.nvmlDeviceGetNvLinkState(handle, link)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_INVALID_ARGUMENT:
                break  # past the GPU's last link
            if exc.value in NOT_AVAILABLE:
                continue
            raise call_failed(pynvml.nvmlDeviceGetNvLinkState, exc, where) from exc
        remote = None
        is_switch = False
        if active:
            pci = optional(pynvml.nvmlDeviceGetNvLinkRemotePciInfo, where, handle, link)
            remote = normalize_bus_id(pci.busId) if pci is not None else None
            kind = optional(pynvml.nvmlDeviceGetNvLinkRemoteDeviceType, where, handle, link)
            is_switch = kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
        links.append(NvLink(link, bool(active), remote, is_switch))
    return tuple(links)


def read_fabric(handle: Any, where: str) -> FabricInfo | None:
    """The GPU's NVLink fabric (IMEX) membership; ``None`` where the GPU has no fabric."""
    info: Any = pynvml.c_nvmlGpuFabricInfoV_t()
    try:
        pynvml.nvmlDeviceGetGpuFabricInfoV(handle, byref(info))
    except pynvml.NVMLError as exc:
        if exc.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            if exc.value in NOT_AVAILABLE:
                return None
            raise call_failed(pynvml.nvmlDeviceGetGpuFabricInfoV, exc, where) from exc
        info = pynvml.c_nvmlGpuFabricInfo_t()
        if optional(pynvml.nvmlDeviceGetGpuFabricInfo, where, handle, byref(info)) is None:
            return None
    state = FABRIC_STATES.get(int(info.state))
    if state is None:
        return None
    return FabricInfo(
        cluster_uuid=str(uuid.UUID(bytes=bytes(info.clusterUuid))),
        clique_id=int(info.cliqueId),
        state=state,
        status_ok=int(info.status) == pynvml.NVML_SUCCESS,
    )
