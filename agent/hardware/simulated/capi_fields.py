"""Simulated ``nvmlDeviceGetFieldValues``: the GPU recovery action field, per-value returns.

The real call fills each requested ``nvmlFieldValue_t`` and reports problems per value in its
``nvmlReturn`` member (the call itself succeeds); the health monitor reads
``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` to learn whether a reset is still pending, so that is
the field simulated here. Every other field answers NOT_SUPPORTED, as on a GPU that lacks it.
"""

from __future__ import annotations

import time
from typing import Any

from agent.hardware.simulated.cabi import as_int, target
from agent.hardware.simulated.capi_device import gpu_of
from agent.hardware.simulated.core import LibraryCore as Lib
from agent.hardware.simulated.state import NVML_ERROR_NOT_SUPPORTED, NVML_SUCCESS

FI_DEV_GET_GPU_RECOVERY_ACTION = 230
VALUE_TYPE_UNSIGNED_INT = 1


def _field_values(lib: Lib, handle: Any, count: Any, values: Any) -> None:
    gpu = gpu_of(lib, handle)
    array = target(values)
    stamp = int(time.time() * 1_000_000)
    for i in range(as_int(count)):
        value = array[i]
        value.timestamp = stamp
        value.latencyUsec = 0
        if value.fieldId == FI_DEV_GET_GPU_RECOVERY_ACTION:
            value.valueType = VALUE_TYPE_UNSIGNED_INT
            value.value.uiVal = gpu.recovery_action
            value.nvmlReturn = NVML_SUCCESS
        else:
            value.nvmlReturn = NVML_ERROR_NOT_SUPPORTED


FUNCTIONS = {"nvmlDeviceGetFieldValues": _field_values}
