"""The async facade over pynvml: every blocking NVML call runs in one worker thread.

NVML calls block (some for seconds under contention) and NVML is not fast when called
concurrently, so the agent funnels them through ``anyio.to_thread.run_sync`` with a
``CapacityLimiter(1)``: the event loop never blocks and NVML sees one caller at a time. The
helpers ``required`` and ``optional`` run inside that thread and turn NVML errors into the agent's
policy: a required call that fails raises ``NvmlCallFailed``; an optional field that NVML does not
support (NOT_SUPPORTED, or a function the installed driver lacks) is simply absent.

Both helpers make each NVML call a child span ``nvml.<Function>`` (``nvml.DeviceGetHandleByUUID``)
when it runs inside a recording span (anyio copies the caller's context into the NVML thread), so
a traced operation shows the NVML calls it waited for. Outside a trace the check costs one
context lookup.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import pynvml
from opentelemetry import trace

from agent.hardware.errors import NvmlCallFailed, NvmlLibraryNotFound
from agent.telemetry.metrics import NVML_CALL_DURATION, observe
from agent.telemetry.tracing import tracer

T = TypeVar("T")

NOT_AVAILABLE = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})


class Nvml:
    """Runs blocking NVML work off the event loop, one call at a time."""

    def __init__(self) -> None:
        self._limiter: anyio.CapacityLimiter | None = None

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        # Created lazily: a limiter belongs to the event loop that first uses it.
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        return self._limiter

    async def run(
        self, fn: Callable[..., T], *args: Any, limiter: anyio.CapacityLimiter | None = None
    ) -> T:
        """Run ``fn(*args)`` (pynvml calls, or a function making several) in the NVML thread.

        Its time in the thread is ``gpu_dra_nvml_call_duration_seconds{call}``: ``call`` is the
        pynvml function's name for ``required``/``optional``, else the function's own name.
        ``limiter``: another limiter than the single worker's (MIG reconfigurations of
        different GPUs, ``mig_ops``)."""
        call = functools.partial(fn, *args)
        target = args[0] if fn in (required, optional) and args else fn
        name = getattr(target, "__name__", type(target).__name__)

        def timed() -> T:
            started = time.perf_counter()
            try:
                return call()
            finally:
                observe(NVML_CALL_DURATION, time.perf_counter() - started, call=name)

        return await anyio.to_thread.run_sync(timed, limiter=limiter or self.limiter)

    async def init(self) -> None:
        """Initialize NVML; raises ``NvmlLibraryNotFound`` when the driver library is missing."""
        await self.run(_init)

    async def shutdown(self) -> None:
        """Release this process's NVML session."""
        await self.run(required, pynvml.nvmlShutdown, "the NVML library")


def _init() -> None:
    try:
        pynvml.nvmlInitWithFlags(0)
    except pynvml.NVMLError_LibraryNotFound as exc:
        raise NvmlLibraryNotFound() from exc
    except pynvml.NVMLError as exc:
        raise call_failed(pynvml.nvmlInitWithFlags, exc, "the NVML library") from exc


def call_failed(fn: Callable[..., Any], exc: pynvml.NVMLError, target: str) -> NvmlCallFailed:
    """The agent's exception for a failed NVML call ``fn`` on ``target``."""
    name = getattr(fn, "__name__", repr(fn))
    return NvmlCallFailed(name, int(exc.value), str(exc), target)


def traced(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, as a child span ``nvml.<Function>`` when a recording span is current."""
    if not trace.get_current_span().is_recording():
        return fn(*args)
    name = getattr(fn, "__name__", "call")
    with tracer().start_as_current_span(
        f"nvml.{name.removeprefix('nvml')}", record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            span.set_attribute("nvml.return_code", int(exc.value))
            span.set_status(trace.StatusCode.ERROR, str(exc))
            raise


def required(fn: Callable[..., T], target: str, *args: Any) -> T:
    """Call an NVML function whose answer we cannot do without (in the NVML thread)."""
    try:
        return traced(fn, *args)
    except pynvml.NVMLError as exc:
        raise call_failed(fn, exc, target) from exc


def optional(fn: Callable[..., T], target: str, *args: Any) -> T | None:
    """Call an NVML function for an optional field: ``None`` when NVML does not support it."""
    try:
        return traced(fn, *args)
    except pynvml.NVMLError as exc:
        if exc.value in NOT_AVAILABLE:
            return None
        raise call_failed(fn, exc, target) from exc


def error_code(exc: BaseException) -> int | None:
    """The NVML error code behind an exception raised by ``required``/``optional``/pynvml."""
    if isinstance(exc, NvmlCallFailed):
        return exc.code
    if isinstance(exc, pynvml.NVMLError):
        return int(exc.value)
    return None
