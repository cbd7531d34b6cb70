"""Running grpclib calls with deadlines inside anyio tasks.

grpclib enforces a client deadline by calling ``task.cancel()`` on the calling task and turning
the CancelledError into TimeoutError, without ``uncancel()``. The calling task is left with a
pending cancellation request, which anyio's cancel scopes then misread as an outside
cancellation: the emulator's task group ends up cancelling its host (a test, or the CLI). Each
call with a deadline therefore runs in a task of its own that nothing else shares; the caller
awaits it and cancels it if the caller itself is cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import anyio
from grpclib.exceptions import GRPCError, StreamTerminatedError

T = TypeVar("T")

#: What a failed call raises: deadline, gRPC status, broken stream, socket errors.
CALL_ERRORS = (TimeoutError, GRPCError, StreamTerminatedError, OSError)


async def call_with_deadline(call: Coroutine[Any, Any, T], deadline: float) -> T:
    """Await ``call`` (which passes ``timeout=deadline`` to grpclib) in its own task, with an
    anyio deadline one second later as a backstop should grpclib not enforce its own."""
    task = asyncio.get_running_loop().create_task(call)
    try:
        with anyio.fail_after(deadline + 1.0):
            return await asyncio.shield(task)
    finally:
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait([task])
        if task.done() and not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it as never retrieved


def describe_failure(exc: BaseException, deadline: float) -> str:
    """A short reason for a failed gRPC step, as the emulator logs it."""
    if isinstance(exc, TimeoutError):
        return f"deadline exceeded after {deadline:g}s"
    if isinstance(exc, GRPCError):
        return f"gRPC status {exc.status.name}: {exc.message or ''}".rstrip(": ")
    return f"{type(exc).__name__}: {exc}"
