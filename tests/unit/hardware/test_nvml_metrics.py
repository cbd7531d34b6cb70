"""Every piece of NVML work is timed under the name of the NVML function it calls."""

from __future__ import annotations

import time

import pytest

from agent.hardware.nvml import Nvml, required
from tests.support.metrics import reading

pytestmark = pytest.mark.anyio


# named like the NVML call it stands for
def nvmlDeviceGetSlowThing(value: int) -> int:
    time.sleep(0.01)
    return value


async def test_calls_are_timed_by_nvml_function() -> None:
    metrics = reading()
    before = metrics.count("gpu_dra_nvml_call_duration", call="nvmlDeviceGetSlowThing")
    nvml = Nvml()
    assert await nvml.run(required, nvmlDeviceGetSlowThing, "GPU 0", 7) == 7
    assert await nvml.run(nvmlDeviceGetSlowThing, 8) == 8
    point = metrics.point("gpu_dra_nvml_call_duration", call="nvmlDeviceGetSlowThing")
    assert point.count - before == 2
    assert point.min >= 0.01 or before > 0
