"""agent/threadload.py: a module load in a worker thread runs with the short switch interval,
and the process's interval comes back when the last load running at once ends."""

from __future__ import annotations

import sys
import threading

import anyio
import pytest

from agent.threadload import LOAD_SWITCH_INTERVAL_S, load_in_thread

pytestmark = pytest.mark.anyio


async def test_a_load_runs_in_another_thread_with_the_short_interval() -> None:
    before = sys.getswitchinterval()
    seen: list[tuple[float, bool]] = []

    def load(tag: str) -> None:
        assert tag == "modules"
        seen.append(
            (sys.getswitchinterval(), threading.current_thread() is threading.main_thread())
        )

    await load_in_thread(load, "modules")
    assert seen == [(LOAD_SWITCH_INTERVAL_S, False)]
    assert sys.getswitchinterval() == before


async def test_overlapping_loads_restore_the_interval_once_the_last_ends() -> None:
    before = sys.getswitchinterval()
    first_may_end, second_may_end = threading.Event(), threading.Event()
    during: list[float] = []

    async def first() -> None:
        await load_in_thread(first_may_end.wait, 10)

    async def second() -> None:
        await load_in_thread(second_may_end.wait, 10)

    async with anyio.create_task_group() as group:
        group.start_soon(first)
        group.start_soon(second)
        await anyio.sleep(0.05)
        first_may_end.set()  # the first ends while the second still runs
        await anyio.sleep(0.05)
        during.append(sys.getswitchinterval())
        second_may_end.set()
    assert during == [LOAD_SWITCH_INTERVAL_S]
    assert sys.getswitchinterval() == before


async def test_a_failing_load_restores_the_interval() -> None:
    before = sys.getswitchinterval()

    def broken() -> None:
        raise ImportError("no module named 'missing'")

    with pytest.raises(ImportError, match="missing"):
        await load_in_thread(broken)
    assert sys.getswitchinterval() == before
