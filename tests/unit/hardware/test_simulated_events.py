"""Events and faults of the simulated library, seen through pynvml."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pynvml
import pytest

from agent.hardware.simulated import SimulatedHost

Start = Callable[[str], SimulatedHost]
HEALTH = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError


def registered_set(*indexes: int) -> object:
    event_set = pynvml.nvmlEventSetCreate()
    for index in indexes:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pynvml.nvmlDeviceRegisterEvents(handle, HEALTH, event_set)
    return event_set


def test_wait_times_out(nvml_host: Start) -> None:
    nvml_host("dgx-h100")
    event_set = registered_set(0)
    started = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, 100)
    assert 0.09 <= time.monotonic() - started < 1.0
    pynvml.nvmlEventSetFree(event_set)


def test_xid_is_delivered_with_its_data(nvml_host: Start) -> None:
    host = nvml_host("dgx-a100")
    event_set = registered_set(0, 3)
    timer = threading.Timer(0.05, host.library.inject_xid, args=(3, 79))
    timer.start()
    data = pynvml.nvmlEventSetWait_v2(event_set, 2000)
    timer.join()
    assert data.eventType == pynvml.nvmlEventTypeXidCriticalError
    assert data.eventData == 79
    assert pynvml.nvmlDeviceGetUUID(data.device) == pynvml.nvmlDeviceGetUUID(
        pynvml.nvmlDeviceGetHandleByIndex(3)
    )
    assert data.gpuInstanceId == 0xFFFFFFFF
    assert host.library.inject_xid(0, 31, gpu_instance_id=2, compute_instance_id=0) == 1
    data = pynvml.nvmlEventSetWait_v2(event_set, 0)
    assert (data.eventData, data.gpuInstanceId, data.computeInstanceId) == (31, 2, 0)
    pynvml.nvmlEventSetFree(event_set)


def test_events_only_reach_registered_sets(nvml_host: Start) -> None:
    host = nvml_host("dgx-h100")
    event_set = registered_set(1)
    assert host.library.inject_xid(0, 79) == 0
    assert host.library.inject_ecc(1, double_bit=False) == 0  # single-bit not registered
    assert host.library.inject_ecc(1) == 1
    data = pynvml.nvmlEventSetWait_v2(event_set, 0)
    assert data.eventType == pynvml.nvmlEventTypeDoubleBitEccError
    pynvml.nvmlEventSetFree(event_set)


def test_gpu_lost_and_recovered(nvml_host: Start) -> None:
    host = nvml_host("dgx-h100")
    handle = pynvml.nvmlDeviceGetHandleByIndex(2)
    event_set = registered_set(2)
    waiter_result: list[int] = []

    def wait() -> None:
        try:
            pynvml.nvmlEventSetWait_v2(event_set, 5000)
        except pynvml.NVMLError as exc:
            waiter_result.append(int(exc.value))

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    host.library.lose_gpu(2)
    waiter.join(timeout=2)
    assert waiter_result == [pynvml.NVML_ERROR_GPU_IS_LOST]
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetUUID(handle)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetHandleByIndex(2)
    assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(3)).startswith("GPU-")
    host.library.recover_gpu(2)
    assert pynvml.nvmlDeviceGetUUID(handle).startswith("GPU-")
    pynvml.nvmlEventSetFree(event_set)


def test_fail_next_and_latency(nvml_host: Start) -> None:
    host = nvml_host("dgx-h100")
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    host.library.fail_next("nvmlDeviceGetName", pynvml.NVML_ERROR_UNKNOWN, count=2)
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_Unknown):
            pynvml.nvmlDeviceGetName(handle)
    assert pynvml.nvmlDeviceGetName(handle) == "NVIDIA H100 80GB HBM3"
    host.library.set_latency(0.05, "nvmlDeviceGetName")
    started = time.monotonic()
    pynvml.nvmlDeviceGetName(handle)
    assert time.monotonic() - started >= 0.05
    assert host.library.calls["nvmlDeviceGetName"] == 4


def test_calls_before_init_and_error_strings(start_host: Start) -> None:
    start_host("dgx-h100")
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 8
    assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_GPU_IS_LOST) == "GPU is lost"
    pynvml.nvmlShutdown()


def test_handles_by_uuid_and_memory_v2(nvml_host: Start) -> None:
    host = nvml_host("dgx-a100")
    spec = host.profile.gpus[6]
    handle = pynvml.nvmlDeviceGetHandleByUUID(spec.uuid)
    assert pynvml.nvmlDeviceGetPciInfo(handle).busId == "00000000:" + spec.pci_bus_id[5:].upper()
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    mig_uuid = pynvml.nvmlDeviceGetUUID(mig)
    again = pynvml.nvmlDeviceGetHandleByUUID(mig_uuid)
    assert pynvml.nvmlDeviceGetUUID(again) == mig_uuid
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    assert memory.total == 80 * 2**30 and memory.used == 0
