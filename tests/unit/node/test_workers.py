"""run_workers: plain tasks with a task group's semantics (errors, cancellation, shields)."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from agent.node.workers import run_workers


@pytest.mark.anyio
async def test_all_workers_run_to_the_end() -> None:
    items, done = iter(range(10)), []

    async def work() -> None:
        for item in items:
            await asyncio.sleep(0)
            done.append(item)

    await run_workers(3, work)
    assert sorted(done) == list(range(10))


@pytest.mark.anyio
async def test_an_error_stops_the_others_after_their_shielded_part() -> None:
    log: list[str] = []
    roles = iter(["fail", "slow", "slow"])

    async def work() -> None:
        if next(roles) == "fail":
            await asyncio.sleep(0.01)
            raise ValueError("bug")
        with anyio.CancelScope(shield=True):
            await asyncio.sleep(0.05)
            log.append("shielded part done")
        await asyncio.sleep(5)
        log.append("not stopped")

    with anyio.fail_after(2), pytest.raises(ExceptionGroup) as caught:
        await run_workers(3, work)
    assert [type(e) for e in caught.value.exceptions] == [ValueError]
    assert log == ["shielded part done", "shielded part done"]


@pytest.mark.anyio
async def test_a_cancelled_caller_waits_for_shielded_parts() -> None:
    log: list[str] = []

    async def work() -> None:
        with anyio.CancelScope(shield=True):
            await asyncio.sleep(0.05)
            log.append("written")
        await asyncio.sleep(5)
        log.append("not stopped")

    task = asyncio.ensure_future(run_workers(2, work))
    await asyncio.sleep(0.01)
    task.cancel()  # a plain cancel, as grpclib's deadline makes it
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["written", "written"]

    log.clear()
    with anyio.move_on_after(0.01):  # an anyio scope around the caller
        await run_workers(2, work)
    assert log == ["written", "written"]
