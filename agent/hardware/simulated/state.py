"""The mutable state of a simulated host: GPUs, MIG instances, handles, and NVML's MIG rules.

Kept free of ctypes so the rules (placement validity, overlap, instance counts) read plainly; the
C-function layer in ``capi_*`` translates between this and NVML's calling convention.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field

from agent.hardware.simulated.models import CiProfileSpec, GiProfileSpec, GpuModel
from agent.hardware.simulated.profile import GpuSpec, HostProfile

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_IN_USE = 19
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_INVALID_STATE = 29

COMPUTE_SLICES = 7
MIG_UUID_NAMESPACE = uuid.UUID("5f0c6b1e-2f9a-4c5e-9d0b-6a7e1c3b8d24")
_HANDLE_BASE = 0x5EED_0000_1000
_HANDLE_STEP = 0x40


class NvmlReturn(Exception):
    """Raised inside the simulated library to return an NVML error code to the caller."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@dataclass(eq=False)
class SimComputeInstance:
    gpu_instance: SimGpuInstance
    id: int
    profile: CiProfileSpec
    start: int
    uuid: str
    handle: int = 0
    mig_handle: int = 0  # the MIG device this compute instance is


@dataclass(eq=False)
class SimGpuInstance:
    gpu: SimGpu
    id: int
    profile: GiProfileSpec
    start: int
    handle: int = 0
    compute_instances: dict[int, SimComputeInstance] = field(default_factory=dict)
    busy: bool = False  # a process uses it: destroying it answers IN_USE (``mark_busy``)

    @property
    def memory_slices(self) -> set[int]:
        return set(range(self.start, self.start + self.size))

    @property
    def size(self) -> int:
        return next(size for start, size in self.profile.placements if start == self.start)


@dataclass(eq=False)
class SimGpu:
    spec: GpuSpec
    model: GpuModel
    handle: int = 0
    mig_current: int = 0
    mig_pending: int = 0
    lost: bool = False
    recovery_action: int = 0  # NVML_GPU_RECOVERY_ACTION_*: what the driver wants done next
    compute_mode: int = 0  # NVML_COMPUTEMODE_*, saved with the MIG state (``capi_compute``)
    generation: int = 0  # bumps on every MIG creation, so recreated MIG devices get new UUIDs
    gpu_instances: dict[int, SimGpuInstance] = field(default_factory=dict)

    def mig_devices(self) -> list[SimComputeInstance]:
        """Compute instances in the order NVML enumerates MIG devices (by GI id, then CI id)."""
        return [
            ci
            for _, gi in sorted(self.gpu_instances.items())
            for _, ci in sorted(gi.compute_instances.items())
        ]


class HandleTable:
    """Stable fake pointer values for simulated objects, and the way back from a value."""

    def __init__(self) -> None:
        self._next = itertools.count(_HANDLE_BASE, _HANDLE_STEP)
        self._objects: dict[int, object] = {}

    def add(self, obj: object) -> int:
        handle = next(self._next)
        self._objects[handle] = obj
        return handle

    def remove(self, handle: int) -> None:
        self._objects.pop(handle, None)

    def get(self, handle: int | None) -> object | None:
        return self._objects.get(handle or 0)

    def objects(self) -> list[object]:
        return list(self._objects.values())


class HostState:
    """GPUs and their MIG instances, with NVML's rules for creating and destroying instances."""

    def __init__(self, profile: HostProfile) -> None:
        self.profile = profile
        self.handles = HandleTable()
        self.gpus: list[SimGpu] = []
        for spec in profile.gpus:
            gpu = SimGpu(spec=spec, model=profile.model)
            gpu.handle = self.handles.add(gpu)
            gpu.mig_current = gpu.mig_pending = int(profile.mig_enabled)
            self.gpus.append(gpu)
            for name, start in spec.mig_layout:
                gi_profile = profile.model.gi_by_name(name)
                assert gi_profile is not None  # validated by the profile loader
                size = dict(gi_profile.placements)[start]
                gi = self.create_gpu_instance(gpu, gi_profile.id, start, size)
                self.create_compute_instance(gi, profile.model.full_ci_profile(gi_profile).enum)

    def gpu_by_uuid(self, value: str) -> SimGpu | None:
        return next((g for g in self.gpus if g.spec.uuid == value), None)

    def set_mig_mode(self, gpu: SimGpu, mode: int) -> None:
        if not gpu.model.mig_capable:
            raise NvmlReturn(NVML_ERROR_NOT_SUPPORTED)
        if mode not in (0, 1):
            raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
        if gpu.gpu_instances and mode != gpu.mig_current:
            raise NvmlReturn(NVML_ERROR_IN_USE)  # no mode change while instances exist
        # Hopper and later switch without a GPU reset; we model that for every model.
        gpu.mig_pending = gpu.mig_current = mode

    def create_gpu_instance(
        self, gpu: SimGpu, profile_id: int, start: int, size: int
    ) -> SimGpuInstance:
        # NVML answers NOT_SUPPORTED both without MIG support and with MIG mode disabled.
        if not gpu.model.mig_capable or not gpu.mig_current:
            raise NvmlReturn(NVML_ERROR_NOT_SUPPORTED)
        profile = gpu.model.gi_by_id(profile_id)
        if profile is None or (start, size) not in profile.placements:
            raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
        existing = list(gpu.gpu_instances.values())
        used = set().union(*(gi.memory_slices for gi in existing))
        wanted = set(range(start, start + size))
        same_profile = sum(1 for gi in existing if gi.profile.id == profile_id)
        compute_used = sum(gi.profile.slices for gi in existing)
        if (
            used & wanted
            or same_profile >= profile.instances
            or compute_used + profile.slices > COMPUTE_SLICES
        ):
            raise NvmlReturn(NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = next(i for i in itertools.count(1) if i not in gpu.gpu_instances)
        gpu.generation += 1
        return self.add_gpu_instance(gpu, gi_id, profile, start)

    def add_gpu_instance(
        self, gpu: SimGpu, gi_id: int, profile: GiProfileSpec, start: int
    ) -> SimGpuInstance:
        """Put a GPU instance in place without NVML's checks (creation, or a restored state)."""
        gi = SimGpuInstance(gpu=gpu, id=gi_id, profile=profile, start=start)
        gi.handle = self.handles.add(gi)
        gpu.gpu_instances[gi_id] = gi
        return gi

    def destroy_gpu_instance(self, gi: SimGpuInstance) -> None:
        if gi.compute_instances or gi.busy:
            raise NvmlReturn(NVML_ERROR_IN_USE)
        del gi.gpu.gpu_instances[gi.id]
        self.handles.remove(gi.handle)

    def create_compute_instance(self, gi: SimGpuInstance, ci_profile_id: int) -> SimComputeInstance:
        profile = next(
            (p for p in gi.gpu.model.ci_profiles(gi.profile) if p.enum == ci_profile_id), None
        )
        if profile is None:
            raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
        existing = list(gi.compute_instances.values())
        taken = {s for ci in existing for s in range(ci.start, ci.start + ci.profile.slices)}
        same_profile = sum(1 for ci in existing if ci.profile.enum == ci_profile_id)
        start = next(
            (
                s
                for s in range(0, gi.profile.slices - profile.slices + 1)
                if not taken & set(range(s, s + profile.slices))
            ),
            None,
        )
        if start is None or same_profile >= profile.instances:
            raise NvmlReturn(NVML_ERROR_INSUFFICIENT_RESOURCES)
        ci_id = next(i for i in itertools.count(0) if i not in gi.compute_instances)
        gpu = gi.gpu
        name = f"{gpu.spec.uuid}/{gi.id}/{ci_id}/{gpu.generation}"
        return self.add_compute_instance(
            gi, ci_id, profile, start, f"MIG-{uuid.uuid5(MIG_UUID_NAMESPACE, name)}"
        )

    def add_compute_instance(
        self, gi: SimGpuInstance, ci_id: int, profile: CiProfileSpec, start: int, mig_uuid: str
    ) -> SimComputeInstance:
        """Put a compute instance in place without NVML's checks."""
        ci = SimComputeInstance(
            gpu_instance=gi, id=ci_id, profile=profile, start=start, uuid=mig_uuid
        )
        ci.handle = self.handles.add(ci)
        ci.mig_handle = self.handles.add(SimMigDevice(ci))
        gi.compute_instances[ci_id] = ci
        return ci

    def clear_instances(self, gpu: SimGpu) -> None:
        """Forget every instance of ``gpu`` (before a saved state is put back)."""
        for gi in list(gpu.gpu_instances.values()):
            for ci in list(gi.compute_instances.values()):
                self.destroy_compute_instance(ci)
            self.handles.remove(gi.handle)
        gpu.gpu_instances.clear()

    def destroy_compute_instance(self, ci: SimComputeInstance) -> None:
        del ci.gpu_instance.compute_instances[ci.id]
        self.handles.remove(ci.handle)
        self.handles.remove(ci.mig_handle)


@dataclass(eq=False)
class SimMigDevice:
    """What a MIG device handle points at: one compute instance seen as a device."""

    compute_instance: SimComputeInstance

    @property
    def gpu(self) -> SimGpu:
        return self.compute_instance.gpu_instance.gpu
