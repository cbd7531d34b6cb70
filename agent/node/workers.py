"""Concurrent workers on plain asyncio tasks, with an anyio task group's semantics.

A prepare request of many claims reads and writes them in up to ``CLAIMS_IN_FLIGHT`` worker
tasks (``agent.node.batch``). An anyio task group spawns a task for about 45 us of the event
loop's time on the development VM (1.5 ms for 32 workers, measured alone), an asyncio task
for about 5 us, so :func:`run_workers` makes plain tasks and keeps what the batch relies on
from the task group:

* each worker runs inside an anyio ``CancelScope`` of its own, and workers are stopped by
  cancelling that scope, never with ``Task.cancel``: a shielded section of a worker (a spec
  write that started, an effector's hardware change) runs to its end, as in a task group;
* the first worker that raises stops the others; once all have ended, the errors are raised
  together as an exception group (an anyio task group raises one too);
* when the caller is cancelled (the kubelet's deadline), the workers are stopped the same
  way and waited for, then the cancellation goes on; the wait is shielded, and a second
  cancellation does not cut it short.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import anyio


async def run_workers(count: int, work: Callable[[], Awaitable[None]]) -> None:
    """Run ``count`` calls of ``work`` concurrently until all have ended (module docstring)."""
    loop = asyncio.get_running_loop()
    scopes = [anyio.CancelScope() for _ in range(count)]
    tasks = [loop.create_task(_scoped(scope, work)) for scope in scopes]
    cancelled: BaseException | None = None
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException as error:  # cancelled: stop the workers, then go on cancelling
        cancelled = error
    if not all(task.done() for task in tasks):
        for scope in scopes:
            scope.cancel()
        while True:
            try:
                with anyio.CancelScope(shield=True):
                    await asyncio.wait(tasks)
                break
            except asyncio.CancelledError as error:  # a plain Task.cancel passes the shield
                cancelled = cancelled or error
    if cancelled is not None:
        raise cancelled
    errors = [
        failure
        for task in tasks
        if not task.cancelled() and (failure := task.exception()) is not None
    ]
    if errors:
        raise BaseExceptionGroup("prepare workers failed", errors)


async def _scoped(scope: anyio.CancelScope, work: Callable[[], Awaitable[None]]) -> None:
    with scope:
        await work()
