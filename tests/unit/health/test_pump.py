"""The NVML event pump against the simulated library: events, lost GPUs, unmonitored GPUs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import anyio
import pynvml
import pytest

from agent.hardware.events import EventPump, WatchedGpu
from agent.hardware.health_events import EventKind, HealthEvent
from agent.hardware.nvml import Nvml
from agent.hardware.simulated import SimulatedHost
from agent.hardware.simulated.install import uninstall

pytestmark = pytest.mark.anyio


class Collected:
    def __init__(self) -> None:
        self.events: list[HealthEvent] = []

    def __call__(self, batch: Sequence[HealthEvent]) -> None:
        self.events.extend(batch)

    def kinds(self, uuid: str) -> list[EventKind]:
        return [e.kind for e in self.events if e.gpu_uuid == uuid]

    async def wait(self, check: Callable[[], bool], timeout: float = 5.0) -> None:  # noqa: ASYNC109
        with anyio.fail_after(timeout):
            while not check():  # noqa: ASYNC110
                await anyio.sleep(0.01)


@pytest.fixture
async def host(tmp_path: Path) -> AsyncIterator[SimulatedHost]:
    started = SimulatedHost.start("dgx-a100", tmp_path / "host")
    await Nvml().init()
    yield started
    started.stop()
    uninstall()


def pump_for(host: SimulatedHost) -> EventPump:
    gpus = [WatchedGpu(i, g.spec.uuid) for i, g in enumerate(host.library.state.gpus)]
    return EventPump(gpus, wait_timeout=0.2)


def uuid(host: SimulatedHost, index: int) -> str:
    return host.library.state.gpus[index].spec.uuid


async def test_events_reach_the_sink_with_their_mig_identity(host: SimulatedHost) -> None:
    pump, seen = pump_for(host), Collected()
    async with anyio.create_task_group() as group:
        group.start_soon(pump.run, seen)
        await seen.wait(lambda: len(pump.watched) == 8)
        assert seen.kinds(uuid(host, 0)) == [EventKind.MONITORED]
        host.library.inject_xid(3, 62, gpu_instance_id=1, compute_instance_id=0)
        host.library.inject_ecc(4)
        host.library.inject_ecc(4, double_bit=False)
        await seen.wait(lambda: len(seen.events) == 11)
        group.cancel_scope.cancel()
    xid, dbe, sbe = seen.events[8:]
    assert (xid.gpu_uuid, xid.kind, xid.xid, xid.gpu_instance_id, xid.compute_instance_id) == (
        uuid(host, 3),
        EventKind.XID,
        62,
        1,
        0,
    )
    assert (dbe.kind, sbe.kind) == (EventKind.ECC_DOUBLE_BIT, EventKind.ECC_SINGLE_BIT)
    assert dbe.gpu_instance_id is None


async def test_a_storm_arrives_in_few_batches(host: SimulatedHost) -> None:
    pump, seen = pump_for(host), Collected()
    async with anyio.create_task_group() as group:
        group.start_soon(pump.run, seen)
        await seen.wait(lambda: len(pump.watched) == 8)
        batches = pump.batches
        for _ in range(5000):
            host.library.inject_xid(1, 62)
        await seen.wait(lambda: pump.events == 8 + 5000)
        group.cancel_scope.cancel()
    assert pump.batches - batches <= 20


async def test_registration_failure_is_reported_unmonitored(host: SimulatedHost) -> None:
    host.library.fail_next("nvmlDeviceRegisterEvents", pynvml.NVML_ERROR_NOT_SUPPORTED)
    pump, seen = pump_for(host), Collected()
    async with anyio.create_task_group() as group:
        group.start_soon(pump.run, seen)
        await seen.wait(lambda: len(seen.events) == 8)
        group.cancel_scope.cancel()
    [failed] = [e for e in seen.events if e.kind is EventKind.UNMONITORED]
    assert failed.gpu_uuid == uuid(host, 0) and "Not Supported" in failed.detail
    assert uuid(host, 0) not in pump.watched and len(pump.watched) == 7


async def test_lost_gpu_is_reported_and_the_others_stay_watched(host: SimulatedHost) -> None:
    pump, seen = pump_for(host), Collected()
    async with anyio.create_task_group() as group:
        group.start_soon(pump.run, seen)
        await seen.wait(lambda: len(pump.watched) == 8)
        host.library.lose_gpu(2)
        await seen.wait(lambda: EventKind.GPU_LOST in seen.kinds(uuid(host, 2)))
        await seen.wait(lambda: len(pump.watched) == 7)
        host.library.inject_xid(5, 62)
        await seen.wait(lambda: EventKind.XID in seen.kinds(uuid(host, 5)))
        host.library.recover_gpu(2)
        pump.rearm(uuid(host, 2))
        await seen.wait(lambda: len(pump.watched) == 8)
        host.library.inject_xid(2, 63)
        await seen.wait(lambda: EventKind.XID in seen.kinds(uuid(host, 2)))
        group.cancel_scope.cancel()
    assert seen.kinds(uuid(host, 2)).count(EventKind.GPU_LOST) == 1


async def test_the_wait_leaves_the_nvml_limiter_free_and_stops_promptly(
    host: SimulatedHost,
) -> None:
    pump, seen, nvml = (
        EventPump([WatchedGpu(0, uuid(host, 0))], wait_timeout=0.5),
        Collected(),
        Nvml(),
    )
    async with anyio.create_task_group() as group:
        group.start_soon(pump.run, seen)
        await seen.wait(lambda: len(pump.watched) == 1)
        await anyio.sleep(0.05)  # the pump is inside its blocking wait now
        started = time.monotonic()
        assert await nvml.run(pynvml.nvmlDeviceGetCount) == 8
        assert time.monotonic() - started < 0.2
        started = time.monotonic()
        group.cancel_scope.cancel()
    # Within one NVML wait of STOP_CHECK_S (0.1 s), not the rest of the 0.5 s wait (as
    # before 2026-12-06: every agent's SIGTERM took that long); the set is freed after it.
    assert time.monotonic() - started < 0.35
    assert host.library.calls["nvmlEventSetFree"] >= 1


async def test_no_event_set_means_unmonitored_then_a_retry(host: SimulatedHost) -> None:
    host.library.fail_next("nvmlEventSetCreate", pynvml.NVML_ERROR_UNKNOWN)
    gpus = [WatchedGpu(i, g.spec.uuid) for i, g in enumerate(host.library.state.gpus)]
    pump, seen = EventPump(gpus, wait_timeout=0.1, rebuild_interval=0.1), Collected()
    async with anyio.create_task_group() as group:
        group.start_soon(pump.run, seen)
        await seen.wait(lambda: len(pump.watched) == 8)
        group.cancel_scope.cancel()
    assert seen.kinds(uuid(host, 0)) == [EventKind.UNMONITORED, EventKind.MONITORED]
    assert "could not create an event set" in seen.events[0].detail


async def test_failed_registration_is_retried_on_a_timer_until_it_succeeds(
    host: SimulatedHost,
) -> None:
    """GPU 2 fails to register twice (at the build and at the first retry), then registers: the
    pump reports it UNMONITORED, then MONITORED, with no rebuild of the event set, and its
    events arrive from then on."""
    host.library.fail_next(
        "nvmlDeviceRegisterEvents", pynvml.NVML_ERROR_UNKNOWN, count=2, gpu_index=2
    )
    gpus = [WatchedGpu(i, g.spec.uuid) for i, g in enumerate(host.library.state.gpus)]
    pump = EventPump(gpus, wait_timeout=0.05, retry_initial=0.1, retry_max=1.0)
    seen = Collected()
    async with anyio.create_task_group() as group:
        group.start_soon(pump.run, seen)
        await seen.wait(lambda: len(pump.watched) == 8)
        host.library.inject_xid(2, 62)
        await seen.wait(lambda: EventKind.XID in seen.kinds(uuid(host, 2)))
        group.cancel_scope.cancel()
    assert seen.kinds(uuid(host, 2)) == [
        EventKind.UNMONITORED,
        EventKind.UNMONITORED,
        EventKind.MONITORED,
        EventKind.XID,
    ]
    assert seen.kinds(uuid(host, 3)) == [EventKind.MONITORED]  # the others are not touched
    assert host.library.calls["nvmlEventSetCreate"] == 1
    assert host.library.calls["nvmlDeviceRegisterEvents"] == 8 + 2


async def test_registration_retries_back_off(host: SimulatedHost) -> None:
    """A GPU that keeps failing is retried at growing intervals (0.1, 0.2, 0.4, 0.4 ... s), not
    at a fixed rate: in 1.6 s that is at most 6 attempts where a fixed 0.1 s would make 16."""
    host.library.fail_next(
        "nvmlDeviceRegisterEvents", pynvml.NVML_ERROR_UNKNOWN, count=1000, gpu_index=0
    )
    pump = EventPump(
        [WatchedGpu(0, uuid(host, 0))], wait_timeout=0.02, retry_initial=0.1, retry_max=0.4
    )
    seen = Collected()
    async with anyio.create_task_group() as group:
        group.start_soon(pump.run, seen)
        await seen.wait(lambda: len(seen.events) >= 1)
        await anyio.sleep(1.6)
        group.cancel_scope.cancel()
    attempts = host.library.calls["nvmlDeviceRegisterEvents"]
    assert 3 <= attempts <= 7
    assert set(seen.kinds(uuid(host, 0))) == {EventKind.UNMONITORED}
    assert len(seen.events) == attempts


def test_retry_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="retry_initial"):
        EventPump([], retry_initial=0)
    with pytest.raises(ValueError, match="retry_max"):
        EventPump([], retry_initial=2.0, retry_max=1.0)
