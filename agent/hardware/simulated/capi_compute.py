"""Simulated compute mode: ``nvmlDeviceGetComputeMode`` and ``nvmlDeviceSetComputeMode``.

A physical GPU has one compute mode (``NVML_COMPUTEMODE_*``): DEFAULT, PROHIBITED or
EXCLUSIVE_PROCESS (EXCLUSIVE_THREAD was removed from the driver, so setting it answers
NOT_SUPPORTED, as on hardware). A MIG device handle answers NOT_SUPPORTED: the mode is the
whole GPU's. Like MIG instances, the mode belongs to the driver, not to the process that set
it: it is saved with the rest of the simulated state (``persist``) and survives a ``kill -9``.
"""

from __future__ import annotations

from typing import Any

from agent.hardware.simulated.cabi import as_int, handle_value, set_value
from agent.hardware.simulated.core import LibraryCore as Lib
from agent.hardware.simulated.state import (
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NvmlReturn,
    SimGpu,
    SimMigDevice,
)

COMPUTEMODE_DEFAULT = 0
COMPUTEMODE_EXCLUSIVE_THREAD = 1
COMPUTEMODE_PROHIBITED = 2
COMPUTEMODE_EXCLUSIVE_PROCESS = 3


def _gpu(lib: Lib, handle: Any) -> SimGpu:
    obj = lib.resolve(handle_value(handle))
    if isinstance(obj, SimMigDevice):
        raise NvmlReturn(NVML_ERROR_NOT_SUPPORTED)
    if not isinstance(obj, SimGpu):
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    return obj


def _get_compute_mode(lib: Lib, handle: Any, mode: Any) -> None:
    set_value(mode, _gpu(lib, handle).compute_mode)


def _set_compute_mode(lib: Lib, handle: Any, mode: Any) -> None:
    gpu = _gpu(lib, handle)
    value = as_int(mode)
    if value == COMPUTEMODE_EXCLUSIVE_THREAD:
        raise NvmlReturn(NVML_ERROR_NOT_SUPPORTED)
    if value not in (COMPUTEMODE_DEFAULT, COMPUTEMODE_PROHIBITED, COMPUTEMODE_EXCLUSIVE_PROCESS):
        raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
    if gpu.compute_mode != value:
        gpu.compute_mode = value
        lib.mig_changed()  # the listeners persist the state (``SimulatedHost``)


FUNCTIONS = {
    "nvmlDeviceGetComputeMode": _get_compute_mode,
    "nvmlDeviceSetComputeMode": _set_compute_mode,
}
