"""The simulated NVML library object: NVML's C functions as attributes, plus fault injection.

``pynvml`` looks every C function up with ``getattr(pynvml.nvmlLib, name)``; this object answers
those lookups with callables that take the same ctypes arguments as ``libnvidia-ml.so.1`` and
return NVML return codes. Tests and the simulation mode inject faults through the Python methods
(``inject_xid``, ``lose_gpu``, ``fail_next``, ...), which are safe to call from any thread.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import pynvml

from agent.hardware.simulated import (
    capi_compute,
    capi_device,
    capi_events,
    capi_fields,
    capi_mig,
)
from agent.hardware.simulated.cabi import handle_value
from agent.hardware.simulated.events import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID_CRITICAL,
    NO_INSTANCE,
    RECOVERY_ACTION_GPU_RESET,
    RECOVERY_ACTION_NONE,
    XID_RECOVERY_ACTIONS,
    SimEvent,
    SimEventSet,
)
from agent.hardware.simulated.profile import HostProfile
from agent.hardware.simulated.state import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_UNINITIALIZED,
    NVML_SUCCESS,
    HostState,
    NvmlReturn,
    SimComputeInstance,
    SimGpu,
    SimGpuInstance,
    SimMigDevice,
)

CFunctionImpl = Callable[..., Any]
_NEEDS_NO_INIT = {"nvmlInit_v2", "nvmlInitWithFlags", "nvmlErrorString"}


class CFunction:
    """One simulated C function; an object (not a method) so pynvml may set ``restype`` on it."""

    def __init__(self, library: SimulatedNvmlLibrary, name: str, impl: CFunctionImpl) -> None:
        self.library = library
        self.name = name
        self.impl = impl
        self.restype: Any = None

    def __call__(self, *args: Any) -> Any:
        return self.library._dispatch(self.name, self.impl, args)

    def __repr__(self) -> str:
        return f"<simulated NVML function {self.name}>"


class SimulatedNvmlLibrary:
    """A stateful stand-in for ``libnvidia-ml.so.1`` built from a host profile."""

    def __init__(self, profile: HostProfile) -> None:
        self.profile = profile
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.state = HostState(profile)
        self.init_count = 0
        self.calls: Counter[str] = Counter()
        #: Seconds spent inside the simulated C functions (their latency, lock and state
        #: file included): benchmarks subtract it to get the agent's own time.
        self.seconds_in_calls = 0.0
        self._failures: dict[str, deque[int]] = {}
        self._gpu_failures: dict[tuple[str, int], deque[int]] = {}  # (function, GPU handle)
        self._latency: dict[str | None, float] = {}
        self._mig_listeners: list[Callable[[], None]] = []
        for module in (capi_device, capi_mig, capi_events, capi_fields, capi_compute):
            for name, impl in module.FUNCTIONS.items():
                setattr(self, name, CFunction(self, name, impl))

    # -- fault and event injection (any thread) -------------------------------------------------

    def inject_xid(
        self,
        gpu_index: int,
        xid: int,
        gpu_instance_id: int | None = None,
        compute_instance_id: int | None = None,
    ) -> int:
        """Deliver an XID critical-error event; returns how many event sets received it.

        XIDs after which the real driver wants a reset also set the GPU's pending recovery
        action (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``), which :meth:`recover_gpu` clears.
        """
        with self.lock:
            action = XID_RECOVERY_ACTIONS.get(xid)
            if action is not None:
                self.state.gpus[gpu_index].recovery_action = action
            return self.inject_event(
                gpu_index, EVENT_XID_CRITICAL, xid, gpu_instance_id, compute_instance_id
            )

    def inject_ecc(self, gpu_index: int, double_bit: bool = True) -> int:
        """Deliver a double-bit (default; it also schedules a GPU reset) or single-bit ECC
        error event."""
        kind = EVENT_DOUBLE_BIT_ECC if double_bit else EVENT_SINGLE_BIT_ECC
        with self.lock:
            if double_bit:
                self.state.gpus[gpu_index].recovery_action = RECOVERY_ACTION_GPU_RESET
            return self.inject_event(gpu_index, kind, 0)

    def inject_event(
        self,
        gpu_index: int,
        event_type: int,
        data: int,
        gpu_instance_id: int | None = None,
        compute_instance_id: int | None = None,
    ) -> int:
        """Deliver any event to every event set registered for it on that GPU."""
        with self.lock:
            gpu = self.state.gpus[gpu_index]
            event = SimEvent(
                gpu,
                event_type,
                data,
                NO_INSTANCE if gpu_instance_id is None else gpu_instance_id,
                NO_INSTANCE if compute_instance_id is None else compute_instance_id,
            )
            delivered = 0
            for event_set in self._event_sets():
                if event_set.registrations.get(gpu.handle, 0) & event_type:
                    event_set.pending.append(event)
                    delivered += 1
            self.changed.notify_all()
            return delivered

    def lose_gpu(self, gpu_index: int) -> None:
        """Make the GPU fall off the bus: its calls and event waits return GPU_IS_LOST."""
        with self.lock:
            self.state.gpus[gpu_index].lost = True
            self.changed.notify_all()

    def recover_gpu(self, gpu_index: int) -> None:
        """Complete a GPU reset: a lost GPU answers again and no recovery action is pending."""
        with self.lock:
            gpu = self.state.gpus[gpu_index]
            gpu.lost = False
            gpu.recovery_action = RECOVERY_ACTION_NONE
            self.changed.notify_all()

    def fail_next(
        self, function: str, error: int, count: int = 1, gpu_index: int | None = None
    ) -> None:
        """Make the next ``count`` calls of the C function ``function`` return ``error``.

        With ``gpu_index``, only the calls whose first argument is that GPU's handle fail (a
        fault of one GPU, whatever the order in which the GPUs are called).
        """
        with self.lock:
            if gpu_index is None:
                self._failures.setdefault(function, deque()).extend([error] * count)
            else:
                key = (function, self.state.gpus[gpu_index].handle)
                self._gpu_failures.setdefault(key, deque()).extend([error] * count)

    def set_latency(self, seconds: float, function: str | None = None) -> None:
        """Delay every call (``function=None``) or the calls of one C function."""
        with self.lock:
            self._latency[function] = seconds

    def mark_busy(self, gpu_index: int, gpu_instance_id: int, busy: bool = True) -> None:
        """Mark a GPU instance as used by a process: destroying it answers IN_USE until
        ``busy=False`` (what a CUDA process still running in it causes on hardware)."""
        with self.lock:
            gpu = self.state.gpus[gpu_index]
            gpu.gpu_instances[gpu_instance_id].busy = busy
            self.mig_changed()

    def destroy_gpu_instance(self, gpu_index: int, gpu_instance_id: int) -> None:
        """Destroy a GPU instance and its compute instances outside of NVML's calls, as an
        operator's ``nvidia-smi mig -dci``/``-dgi`` does behind the agent's back."""
        with self.lock:
            gi = self.state.gpus[gpu_index].gpu_instances[gpu_instance_id]
            for ci in list(gi.compute_instances.values()):
                self.state.destroy_compute_instance(ci)
            gi.busy = False
            self.state.destroy_gpu_instance(gi)
            self.mig_changed()

    def remove_function(self, function: str) -> None:
        """Drop a C function, as an older driver lacks it: pynvml then raises FUNCTION_NOT_FOUND."""
        with self.lock:
            if isinstance(getattr(self, function, None), CFunction):
                delattr(self, function)
            pynvml._nvmlGetFunctionPointer_cache.pop(function, None)

    def add_mig_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (under the library lock) after every MIG instance change."""
        with self.lock:
            self._mig_listeners.append(listener)

    # -- used by the C functions ----------------------------------------------------------------

    def mig_changed(self) -> None:
        for listener in self._mig_listeners:
            listener()

    def resolve(self, handle: int) -> object:
        obj = self.state.handles.get(handle)
        if obj is None:
            raise NvmlReturn(NVML_ERROR_INVALID_ARGUMENT)
        gpu = _owning_gpu(obj)
        if gpu is not None and gpu.lost:
            raise NvmlReturn(NVML_ERROR_GPU_IS_LOST)
        return obj

    def _event_sets(self) -> list[SimEventSet]:
        return [obj for obj in self.state.handles._objects.values() if isinstance(obj, SimEventSet)]

    def _dispatch(self, name: str, impl: CFunctionImpl, args: tuple[Any, ...]) -> Any:
        started = time.perf_counter()
        try:
            return self._call(name, impl, args)
        finally:
            elapsed = time.perf_counter() - started
            with self.lock:
                self.seconds_in_calls += elapsed

    def _call(self, name: str, impl: CFunctionImpl, args: tuple[Any, ...]) -> Any:
        delay = self._latency.get(name, self._latency.get(None, 0.0))
        if delay:
            time.sleep(delay)
        with self.lock:
            self.calls[name] += 1
            failures = self._failures.get(name)
            if not failures and self._gpu_failures and args:
                failures = self._gpu_failures.get((name, _handle_or_zero(args[0])))
            if failures:
                return failures.popleft()
            if name not in _NEEDS_NO_INIT and self.init_count == 0:
                return NVML_ERROR_UNINITIALIZED
            try:
                result = impl(self, *args)
            except NvmlReturn as returned:
                return returned.code
            return NVML_SUCCESS if result is None else result


def _handle_or_zero(arg: Any) -> int:
    """The handle value of a call's first argument, or 0 when it is not a handle."""
    try:
        return handle_value(arg)
    except (TypeError, ctypes.ArgumentError):
        return 0


def _owning_gpu(obj: object) -> SimGpu | None:
    if isinstance(obj, SimGpu):
        return obj
    if isinstance(obj, SimMigDevice):
        return obj.gpu
    if isinstance(obj, SimGpuInstance):
        return obj.gpu
    if isinstance(obj, SimComputeInstance):
        return obj.gpu_instance.gpu
    return None
