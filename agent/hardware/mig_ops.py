"""MIG reconfiguration through NVML: mode, GPU and compute instances of one parent GPU.

The mechanism only; the policy (what to create, when, under which lock, how to retry and what
to roll back) is ``agent.mig``'s. Every function names the parent by UUID (minors and indexes
can change across a reboot, and the incumbent's rollback failed because it looked the parent
up by a PCI bus id it never recorded, nvidia-driver-facts.md §4.2) and runs in an NVML worker
thread. Each NVML call that changes the hardware is a child span named as in NVML's API
(``nvml.SetMigMode``, ``nvml.CreateGpuInstanceWithPlacement``, ``nvml.CreateComputeInstance``,
``nvml.DestroyComputeInstance``, ``nvml.DestroyGpuInstance``) when it runs inside a recording
span.

Reconfigurations run on a limiter of their own (:class:`MigOps`), one thread per GPU at most:
creating or destroying a GPU instance takes up to seconds, and the agent's single NVML worker
would make the GPUs of a node wait for each other. Reads stay on that worker.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import pynvml
from opentelemetry import trace

from agent.hardware.nvml import Nvml, call_failed
from agent.telemetry.tracing import tracer

T = TypeVar("T")
NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
#: NVML_COMPUTE_INSTANCE_PROFILE_* enum of the compute instance that spans a whole GPU
#: instance of n compute slices (mig-profiles.md §1, §5).
FULL_CI_PROFILE_BY_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}


@dataclass(frozen=True, slots=True)
class LiveComputeInstance:
    id: int
    profile_id: int
    mig_uuid: str


@dataclass(frozen=True, slots=True)
class LiveGpuInstance:
    id: int
    profile_id: int
    start: int
    size: int
    compute_instances: tuple[LiveComputeInstance, ...] = ()


@dataclass(frozen=True, slots=True)
class MigLayout:
    """The MIG state of one GPU as NVML reports it."""

    parent_uuid: str
    mig_enabled: bool
    instances: tuple[LiveGpuInstance, ...] = ()


def _call(span_name: str, fn: Callable[..., T], target: str, *args: Any) -> T:
    """``fn(*args)`` as span ``nvml.<span_name>`` (when traced); NVML errors become
    ``NvmlCallFailed`` with the code kept."""
    recording = trace.get_current_span().is_recording()
    try:
        if not recording:
            return fn(*args)
        with tracer().start_as_current_span(
            f"nvml.{span_name}", record_exception=False, set_status_on_exception=False
        ) as span:
            try:
                return fn(*args)
            except pynvml.NVMLError as exc:
                span.set_attribute("nvml.return_code", int(exc.value))
                span.set_status(trace.StatusCode.ERROR, str(exc))
                raise
    except pynvml.NVMLError as exc:
        raise call_failed(fn, exc, target) from exc


#: What NVML answers for a profile a GPU (or GPU instance) does not offer. Any other error
#: while listing profiles or instances fails the read: a layout with a profile silently
#: missing would hide its instances (an unprepare would find "nothing to destroy").
_NOT_OFFERED = frozenset(
    {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT, NOT_FOUND}
)


def _handle(parent_uuid: str) -> Any:
    return _call(
        "DeviceGetHandleByUUID", pynvml.nvmlDeviceGetHandleByUUID, parent_uuid, parent_uuid
    )


def read_layout(parent_uuid: str, *, with_uuids: bool = True) -> MigLayout:
    """The GPU's MIG mode and every GPU instance with its compute instances (blocking).

    ``with_uuids=False`` skips the walk of the MIG device handles (the compute instances'
    ``mig_uuid`` is then empty): what a caller needs to find or count instances."""
    where = f"GPU {parent_uuid}"
    device = _handle(parent_uuid)
    mode = _call("DeviceGetMigMode", pynvml.nvmlDeviceGetMigMode, where, device)
    enabled = mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    if not enabled:
        return MigLayout(parent_uuid, False)
    profile_ids: set[int] = set()
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            profile_ids.add(int(pynvml.nvmlDeviceGetGpuInstanceProfileInfo(device, enum).id))
        except pynvml.NVMLError as exc:
            if exc.value in _NOT_OFFERED:
                continue  # a profile this GPU does not offer
            raise call_failed(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, exc, where) from exc
    mig_uuids = _mig_uuids(device, where) if with_uuids else {}
    found: list[LiveGpuInstance] = []
    for profile_id in sorted(profile_ids):
        array = (pynvml.c_nvmlGpuInstance_t * 8)()
        count = ctypes.c_uint(0)
        _call(
            "DeviceGetGpuInstances",
            pynvml.nvmlDeviceGetGpuInstances,
            where,
            device,
            profile_id,
            array,
            ctypes.byref(count),
        )
        for i in range(count.value):
            info = _call("GpuInstanceGetInfo", pynvml.nvmlGpuInstanceGetInfo, where, array[i])
            gi_id = int(info.id)
            found.append(
                LiveGpuInstance(
                    gi_id,
                    int(info.profileId),
                    int(info.placement.start),
                    int(info.placement.size),
                    tuple(
                        LiveComputeInstance(ci_id, ci_profile, mig_uuids.get((gi_id, ci_id), ""))
                        for ci_id, ci_profile in _compute_instances(array[i], where)
                    ),
                )
            )
    return MigLayout(parent_uuid, True, tuple(sorted(found, key=lambda gi: gi.start)))


def read_instances(parent_uuid: str) -> MigLayout:
    """``read_layout`` without the MIG UUIDs (no walk of the MIG device handles)."""
    return read_layout(parent_uuid, with_uuids=False)


def _compute_instances(gpu_instance: Any, where: str) -> list[tuple[int, int]]:
    found = []
    for enum in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        array = (pynvml.c_nvmlComputeInstance_t * 8)()
        count = ctypes.c_uint(0)
        try:
            pynvml.nvmlGpuInstanceGetComputeInstances(
                gpu_instance, enum, array, ctypes.byref(count)
            )
        except pynvml.NVMLError as exc:
            if exc.value in _NOT_OFFERED:
                continue
            raise call_failed(pynvml.nvmlGpuInstanceGetComputeInstances, exc, where) from exc
        for i in range(count.value):
            info = _call(
                "ComputeInstanceGetInfo", pynvml.nvmlComputeInstanceGetInfo, where, array[i]
            )
            found.append((int(info.id), int(info.profileId)))
    return sorted(found)


def _mig_uuids(device: Any, where: str) -> dict[tuple[int, int], str]:
    """(GI id, CI id) -> MIG device UUID, by walking the GPU's MIG device handles; a failed
    read is ``NvmlCallFailed`` like every other call here (it escaped as a bare NVMLError)."""
    found: dict[tuple[int, int], str] = {}
    count = _call(
        "DeviceGetMaxMigDeviceCount", pynvml.nvmlDeviceGetMaxMigDeviceCount, where, device
    )
    for index in range(count):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(device, index)
        except pynvml.NVMLError:
            continue
        mig_where = f"MIG device {index} of {where}"
        key = (
            int(_call("DeviceGetGpuInstanceId", pynvml.nvmlDeviceGetGpuInstanceId, mig_where, mig)),
            int(
                _call(
                    "DeviceGetComputeInstanceId",
                    pynvml.nvmlDeviceGetComputeInstanceId,
                    mig_where,
                    mig,
                )
            ),
        )
        found[key] = str(_call("DeviceGetUUID", pynvml.nvmlDeviceGetUUID, mig_where, mig))
    return found


def set_mig_mode(parent_uuid: str, enabled: bool) -> None:
    """Enable or disable MIG mode (Hopper and newer switch without a GPU reset)."""
    device = _handle(parent_uuid)
    mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
    _call("SetMigMode", pynvml.nvmlDeviceSetMigMode, f"GPU {parent_uuid}", device, mode)


def create_gpu_instance(parent_uuid: str, profile_id: int, start: int, size: int) -> int:
    """Create a GPU instance of ``profile_id`` at exactly (start, size); its GI id.

    NVML answers INSUFFICIENT_RESOURCES for an occupied placement (it cannot tell "exists")."""
    device = _handle(parent_uuid)
    placement = pynvml.c_nvmlGpuInstancePlacement_t()
    placement.start, placement.size = start, size
    instance = _call(
        "CreateGpuInstanceWithPlacement",
        pynvml.nvmlDeviceCreateGpuInstanceWithPlacement,
        f"GPU {parent_uuid}",
        device,
        profile_id,
        ctypes.byref(placement),
    )
    info = _call("GpuInstanceGetInfo", pynvml.nvmlGpuInstanceGetInfo, parent_uuid, instance)
    return int(info.id)


def create_compute_instance(parent_uuid: str, gi_id: int, ci_profile: int) -> tuple[int, str]:
    """Create the compute instance of profile enum ``ci_profile`` in GPU instance ``gi_id``;
    returns its CI id and the MIG device UUID."""
    where = f"GPU instance {gi_id} of GPU {parent_uuid}"
    device = _handle(parent_uuid)
    gpu_instance = _call(
        "DeviceGetGpuInstanceById", pynvml.nvmlDeviceGetGpuInstanceById, where, device, gi_id
    )
    info = _call(
        "GpuInstanceGetComputeInstanceProfileInfo",
        pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo,
        where,
        gpu_instance,
        ci_profile,
        pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    )
    instance = _call(
        "CreateComputeInstance",
        pynvml.nvmlGpuInstanceCreateComputeInstance,
        where,
        gpu_instance,
        int(info.id),
    )
    ci_info = _call("ComputeInstanceGetInfo", pynvml.nvmlComputeInstanceGetInfo, where, instance)
    ci_id = int(ci_info.id)
    return ci_id, _mig_uuids(device, where).get((gi_id, ci_id), "")


def destroy_compute_instance(parent_uuid: str, gi_id: int, ci_id: int) -> bool:
    """Destroy a compute instance; False when it (or its GPU instance) was already gone."""
    where = f"compute instance {ci_id} of GPU instance {gi_id} of GPU {parent_uuid}"
    device = _handle(parent_uuid)
    try:
        gpu_instance = pynvml.nvmlDeviceGetGpuInstanceById(device, gi_id)
        instance = pynvml.nvmlGpuInstanceGetComputeInstanceById(gpu_instance, ci_id)
    except pynvml.NVMLError as exc:
        if exc.value in (NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED):
            return False  # NOT_SUPPORTED: MIG mode is off, so no instance exists
        raise call_failed(pynvml.nvmlGpuInstanceGetComputeInstanceById, exc, where) from exc
    _call("DestroyComputeInstance", pynvml.nvmlComputeInstanceDestroy, where, instance)
    return True


def destroy_gpu_instance(parent_uuid: str, gi_id: int) -> bool:
    """Destroy a GPU instance (its compute instances must be gone); False when already gone.

    A GPU instance that a process still uses answers IN_USE (the caller retries)."""
    where = f"GPU instance {gi_id} of GPU {parent_uuid}"
    device = _handle(parent_uuid)
    try:
        gpu_instance = pynvml.nvmlDeviceGetGpuInstanceById(device, gi_id)
    except pynvml.NVMLError as exc:
        if exc.value in (NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED):
            return False
        raise call_failed(pynvml.nvmlDeviceGetGpuInstanceById, exc, where) from exc
    _call("DestroyGpuInstance", pynvml.nvmlGpuInstanceDestroy, where, gpu_instance)
    return True


class MigOps:
    """The async side: each function above in a thread of the reconfiguration limiter."""

    def __init__(self, nvml: Nvml, parallel: int = 8) -> None:
        self._nvml = nvml
        self._parallel = parallel
        self._limiter: anyio.CapacityLimiter | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._limiter is None:  # belongs to the event loop that first uses it
            self._limiter = anyio.CapacityLimiter(self._parallel)
        return await self._nvml.run(fn, *args, limiter=self._limiter)

    async def read_layout(self, parent_uuid: str, *, with_uuids: bool = True) -> MigLayout:
        return await self.run(read_layout if with_uuids else read_instances, parent_uuid)

    async def set_mig_mode(self, parent_uuid: str, enabled: bool) -> None:
        await self.run(set_mig_mode, parent_uuid, enabled)

    async def create_gpu_instance(
        self, parent_uuid: str, profile_id: int, start: int, size: int
    ) -> int:
        return await self.run(create_gpu_instance, parent_uuid, profile_id, start, size)

    async def create_compute_instance(
        self, parent_uuid: str, gi_id: int, ci_profile: int
    ) -> tuple[int, str]:
        return await self.run(create_compute_instance, parent_uuid, gi_id, ci_profile)

    async def destroy_compute_instance(self, parent_uuid: str, gi_id: int, ci_id: int) -> bool:
        return await self.run(destroy_compute_instance, parent_uuid, gi_id, ci_id)

    async def destroy_gpu_instance(self, parent_uuid: str, gi_id: int) -> bool:
        return await self.run(destroy_gpu_instance, parent_uuid, gi_id)
