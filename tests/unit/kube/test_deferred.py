"""The stand-ins the prepare engine starts with while the API client is being made: a claim
read waits for the real reader (within its timeout), an Event waits in a queue."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from agent.kube.deferred import (
    DeferredClaimReader,
    DeferredEventPoster,
    DeferredPublisher,
    Pending,
)
from agent.kube.events import LoggingEventPoster
from agent.kube.interfaces import ClaimReader, ClaimReadError, Obj

pytestmark = pytest.mark.anyio


class _Reader:
    def __init__(self) -> None:
        self.reads: list[tuple[str, str]] = []

    async def read(self, namespace: str, name: str) -> Obj:
        self.reads.append((namespace, name))
        return {"metadata": {"namespace": namespace, "name": name}}


async def test_a_read_waits_for_the_reader() -> None:
    pending: Pending[ClaimReader] = Pending("API client")
    deferred = DeferredClaimReader(pending, timeout_s=5)
    real = _Reader()
    result: list[Obj] = []

    async def read() -> None:
        result.append(await deferred.read("ns", "claim"))

    async with anyio.create_task_group() as group:
        group.start_soon(read)
        await anyio.sleep(0.05)
        assert not result  # still waiting
        pending.set(real)
    assert result == [{"metadata": {"namespace": "ns", "name": "claim"}}]
    assert await deferred.read("ns", "other") == {"metadata": {"namespace": "ns", "name": "other"}}
    assert real.reads == [("ns", "claim"), ("ns", "other")]


async def test_a_read_gives_up_after_its_timeout() -> None:
    deferred = DeferredClaimReader(Pending("API client"), timeout_s=0.05)
    with pytest.raises(ClaimReadError, match=r"no API client within 0\.05 s") as raised:
        await deferred.read("ns", "claim")
    assert raised.value.status == 0


async def test_a_read_fails_when_the_client_never_comes() -> None:
    pending: Pending[ClaimReader] = Pending("API client")
    deferred = DeferredClaimReader(pending, timeout_s=5)
    pending.fail("cannot load Kubernetes configuration")
    with pytest.raises(ClaimReadError, match="no API client: cannot load Kubernetes"):
        await deferred.read("ns", "claim")


async def test_events_wait_in_order_until_the_poster_is_attached() -> None:
    deferred = DeferredEventPoster()
    await deferred.post("Warning", "CheckpointCorrupted", "first")
    await deferred.post("Normal", "NodeRebooted", "second")
    assert deferred.queued == 2
    real = LoggingEventPoster()
    await deferred.attach(real)
    await deferred.post("Warning", "GpuUnhealthy", "third")
    assert deferred.queued == 0
    assert real.posted == [
        ("Warning", "CheckpointCorrupted", "first"),
        ("Normal", "NodeRebooted", "second"),
        ("Warning", "GpuUnhealthy", "third"),
    ]


class _Publisher:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = []

    def set_devices(self, devices: Sequence[Any], counter_sets: Sequence[Any] = ()) -> None:
        self.calls.append((tuple(devices), tuple(counter_sets)))


def test_the_latest_devices_wait_for_the_publisher() -> None:
    deferred = DeferredPublisher()
    deferred.set_devices(["old"])
    deferred.set_devices(["tainted"], ["counters"])
    real = _Publisher()
    deferred.attach(real)
    assert real.calls == [(("tainted",), ("counters",))]  # the latest only
    deferred.set_devices(["healthy"])
    assert real.calls[-1] == (("healthy",), ())


def test_nothing_is_handed_over_when_nothing_was_set() -> None:
    deferred = DeferredPublisher()
    real = _Publisher()
    deferred.attach(real)
    assert real.calls == []
