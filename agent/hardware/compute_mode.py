"""A GPU's compute mode through NVML: read it, set it (the mechanism of GPU sharing).

The compute mode says how many processes may hold a context on a GPU: ``DEFAULT`` (any number,
time-sliced), ``EXCLUSIVE_PROCESS`` (one; an MPS server is that one process and its clients
share it) or ``PROHIBITED``. ``agent.sharing`` decides when to change it; this module only
makes the calls, naming the GPU by UUID, in the NVML thread (``Nvml.run``), each a child span
``nvml.DeviceSetComputeMode`` / ``nvml.DeviceGetComputeMode`` inside a traced operation.

NVML has no call for the compute time-slice (``nvidia-smi compute-policy --set-timeslice``
sets it through the driver directly); ``agent.sharing.tools`` runs that tool.
"""

from __future__ import annotations

from enum import IntEnum

import pynvml

from agent.hardware.nvml import Nvml, required


class ComputeMode(IntEnum):
    """``NVML_COMPUTEMODE_*`` (EXCLUSIVE_THREAD is gone from current drivers)."""

    DEFAULT = pynvml.NVML_COMPUTEMODE_DEFAULT
    PROHIBITED = pynvml.NVML_COMPUTEMODE_PROHIBITED
    EXCLUSIVE_PROCESS = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


def get_compute_mode(gpu_uuid: str) -> int:
    """The compute mode of the GPU ``gpu_uuid`` (blocking; in the NVML thread)."""
    where = f"GPU {gpu_uuid}"
    handle = required(pynvml.nvmlDeviceGetHandleByUUID, where, gpu_uuid)
    return int(required(pynvml.nvmlDeviceGetComputeMode, where, handle))


def set_compute_mode(gpu_uuid: str, mode: ComputeMode) -> bool:
    """Set the GPU's compute mode unless it is already ``mode``; whether it changed.

    Raises ``NvmlCallFailed`` (for example NO_PERMISSION without root, NOT_SUPPORTED on a
    GPU or driver without compute modes)."""
    where = f"GPU {gpu_uuid}"
    handle = required(pynvml.nvmlDeviceGetHandleByUUID, where, gpu_uuid)
    if int(required(pynvml.nvmlDeviceGetComputeMode, where, handle)) == int(mode):
        return False
    required(pynvml.nvmlDeviceSetComputeMode, where, handle, int(mode))
    return True


class ComputeModes:
    """The async side: the functions above in the agent's NVML thread."""

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml

    async def get(self, gpu_uuid: str) -> int:
        return await self._nvml.run(get_compute_mode, gpu_uuid)

    async def set(self, gpu_uuid: str, mode: ComputeMode) -> bool:
        return await self._nvml.run(set_compute_mode, gpu_uuid, mode)
