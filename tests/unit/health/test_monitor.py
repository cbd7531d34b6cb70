"""The health monitor with the simulated NVML library: every output of a transition, recovery."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path

import anyio
import pynvml
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agent.dra.model import DraDevice
from agent.hardware.discovery import discover
from agent.hardware.events import EventPump, WatchedGpu
from agent.hardware.nvml import Nvml
from agent.hardware.simulated import SimulatedHost
from agent.hardware.simulated.install import uninstall
from agent.health.monitor import HealthMonitor
from agent.health.policy import HealthPolicy
from agent.health.records import Health
from agent.health.stream import HealthHub
from agent.kube.events import LoggingEventPoster
from agent.telemetry.tracing import configure_tracing

pytestmark = pytest.mark.anyio

Start = Callable[..., Awaitable["Running"]]
POLICY = HealthPolicy(recovery_poll_seconds=0.05, reset_hold_seconds=0.2)


class FakePublisher:
    def __init__(self) -> None:
        self.calls: list[list[DraDevice]] = []

    def set_devices(self, devices: Sequence[DraDevice]) -> None:
        self.calls.append(list(devices))

    def taints(self) -> dict[str, list[tuple[str, str, str]]]:
        last = self.calls[-1] if self.calls else []
        return {d.name: [(t.key, t.value, t.effect) for t in d.taints] for d in last if d.taints}


class Running:
    def __init__(
        self,
        host: SimulatedHost,
        monitor: HealthMonitor,
        publisher: FakePublisher,
        events: LoggingEventPoster,
    ) -> None:
        self.host, self.monitor, self.publisher, self.events = host, monitor, publisher, events

    def health(self) -> dict[str, Health]:
        return {s.name: s.health for s in self.monitor.hub.current}

    async def until(self, check: Callable[[], bool], timeout: float = 5.0) -> None:  # noqa: ASYNC109
        with anyio.fail_after(timeout):
            while not check():  # noqa: ASYNC110
                await anyio.sleep(0.01)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    configure_tracing(exporter=InMemorySpanExporter())  # one provider per process
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    hosts: list[SimulatedHost] = []

    async def begin(group: anyio.abc.TaskGroup, fail_registration: int = 0) -> Running:
        host = SimulatedHost.start("dgx-h100", tmp_path / "host")
        hosts.append(host)
        nvml = Nvml()
        await nvml.init()
        if fail_registration:  # GPU 0's first registrations fail
            host.library.fail_next(
                "nvmlDeviceRegisterEvents",
                pynvml.NVML_ERROR_UNKNOWN,
                count=fail_registration,
                gpu_index=0,
            )
        inventory = await discover(nvml, tmp_path / "host")
        publisher, events = FakePublisher(), LoggingEventPoster()
        pump = EventPump(
            [WatchedGpu(g.index, g.uuid) for g in inventory.gpus],
            wait_timeout=0.1,
            retry_initial=0.2,
        )
        monitor = HealthMonitor(
            nvml=nvml,
            inventory=inventory,
            policy=POLICY,
            publisher=publisher,
            hub=HealthHub(),
            events=events,
            pump=pump,
        )
        group.start_soon(monitor.run)
        running = Running(host, monitor, publisher, events)
        await running.until(lambda: len(pump.watched) >= 8 - bool(fail_registration))
        return running

    yield begin
    for host in hosts:
        host.stop()
    uninstall()


async def test_xid_79_every_output_then_recovery(start: Start, spans: InMemorySpanExporter) -> None:
    async with anyio.create_task_group() as group:
        run: Running = await start(group)
        assert run.publisher.calls == []  # nothing to change yet
        run.host.library.inject_xid(4, 79)
        await run.until(lambda: run.health()["gpu-4"] is Health.UNHEALTHY)
        assert run.publisher.taints() == {"gpu-4": [("gpu.nvidia.com/xid", "79", "NoExecute")]}
        assert sum(h is Health.HEALTHY for h in run.health().values()) == 7
        await run.until(lambda: len(run.events.posted) == 1)
        type_, reason, message = run.events.posted[0]
        assert (type_, reason) == ("Warning", "GpuUnhealthy") and "XID 79" in message
        [span] = [s for s in spans.get_finished_spans() if s.name == "gpu.health.transition"]
        assert span.attributes is not None and span.attributes["gpu.health.taint"] == (
            "gpu.nvidia.com/xid=79:NoExecute"
        )
        await anyio.sleep(0.5)  # polls find the recovery action still pending
        assert run.publisher.taints() != {}
        run.host.library.recover_gpu(4)
        await run.until(lambda: run.publisher.taints() == {})
        assert run.health()["gpu-4"] is Health.HEALTHY
        await run.until(lambda: len(run.events.posted) == 2)
        assert run.events.posted[1][:2] == ("Normal", "GpuHealthy")
        group.cancel_scope.cancel()


async def test_registration_failure_shows_as_unmonitored_until_a_retry_succeeds(
    start: Start,
) -> None:
    """GPU 0 fails to register at the build and at the first timed retry, then registers: the
    unmonitored taint (NoSchedule, valid on 1.34) is added once and removed once, with no event
    set rebuild and no other GPU touched."""
    async with anyio.create_task_group() as group:
        run: Running = await start(group, fail_registration=2)
        await run.until(lambda: run.publisher.calls != [])
        assert run.publisher.taints() == {
            "gpu-0": [("gpu.nvidia.com/unmonitored", "", "NoSchedule")]
        }
        assert run.health()["gpu-0"] is Health.UNKNOWN
        await run.until(lambda: run.health()["gpu-0"] is Health.HEALTHY)
        assert run.publisher.taints() == {}
        assert len(run.publisher.calls) == 2  # taint added, taint removed
        assert run.host.library.calls["nvmlDeviceRegisterEvents"] == 8 + 2
        assert run.host.library.calls["nvmlEventSetCreate"] == 1
        await run.until(lambda: len(run.events.posted) == 2)
        assert [e[:2] for e in run.events.posted] == [
            ("Warning", "GpuUnhealthy"),
            ("Normal", "GpuHealthy"),
        ]
        group.cancel_scope.cancel()


async def test_storm_is_coalesced_into_few_writes_and_events(start: Start) -> None:
    async with anyio.create_task_group() as group:
        run: Running = await start(group)
        for _ in range(3000):
            run.host.library.inject_xid(1, 62)
            run.host.library.inject_xid(1, 63)  # alternating values: each one is a change
        await run.until(lambda: run.monitor.pump.events >= 8 + 6000)
        await anyio.sleep(0.1)
        assert run.publisher.taints() == {"gpu-1": [("gpu.nvidia.com/xid", "63", "NoSchedule")]}
        assert len(run.publisher.calls) <= 20  # one per batch, not per event
        assert len(run.events.posted) + run.monitor.dropped_events <= 20
        group.cancel_scope.cancel()


async def test_a_new_inventory_keeps_the_gpus_conditions(start: Start) -> None:
    async with anyio.create_task_group() as group:
        run = await start(group)
        run.host.library.inject_xid(0, 79)
        await run.until(lambda: run.publisher.taints() != {})
        inventory = run.monitor._inventory
        fewer = type(inventory)(
            inventory.driver_version, inventory.cuda_driver_version, inventory.gpus[:2]
        )
        run.monitor.set_inventory(fewer)
        assert [s.name for s in run.monitor.hub.current] == ["gpu-0", "gpu-1"]
        assert run.publisher.taints() == {"gpu-0": [("gpu.nvidia.com/xid", "79", "NoExecute")]}
        group.cancel_scope.cancel()


async def test_the_unmonitored_effect_learnt_after_start_republishes_the_taint(
    start: Start,
) -> None:
    """The monitor starts before the API server's version is read (NoSchedule, valid
    everywhere); a 1.35+ server's effect replaces it on the held taint, republished once."""
    async with anyio.create_task_group() as group:
        run: Running = await start(group, fail_registration=1000)
        await run.until(lambda: run.publisher.calls != [])
        calls = len(run.publisher.calls)
        run.monitor.set_unmonitored_effect("None")
        assert len(run.publisher.calls) == calls + 1
        assert run.publisher.taints() == {"gpu-0": [("gpu.nvidia.com/unmonitored", "", "None")]}
        assert run.health()["gpu-0"] is Health.UNKNOWN
        run.monitor.set_unmonitored_effect("None")
        assert len(run.publisher.calls) == calls + 1  # nothing changed: nothing republished
        group.cancel_scope.cancel()
