"""Health composes with dynamic MIG: an XID of a MIG instance taints the placement device it
occupies only; a GPU-level fault taints the full GPU and every device sharing its counters
(every placement, created or not); the health stream reports both. First with plain values,
then with the monitor over the simulated NVML beneath pynvml (instances made by mig_ops)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import anyio
import pytest

from agent.dra.model import CounterSet, DraDevice
from agent.dra.partitionable import DynamicMig
from agent.hardware import mig_ops
from agent.hardware.discovery import discover
from agent.hardware.events import EventPump, WatchedGpu
from agent.hardware.health_events import EventKind, HealthEvent
from agent.hardware.nvml import Nvml
from agent.hardware.simulated import SimulatedHost
from agent.hardware.simulated.install import uninstall
from agent.health.monitor import HealthMonitor
from agent.health.policy import HealthPolicy
from agent.health.records import Health, device_map
from agent.health.state import HealthStateMachine
from agent.health.stream import HealthHub
from agent.kube.events import LoggingEventPoster
from tests.support.profile_slices import profile_inventory

DYNAMIC = DynamicMig()
POLICY = HealthPolicy(recovery_poll_seconds=0.05, reset_hold_seconds=0.2)
T0 = 1_800_000_000.0
THREE_G_AT_4 = "gpu-0-mig-3g40gb-9-4"


def xid(uuid: str, number: int, gi: int | None = None, ci: int | None = None) -> HealthEvent:
    return HealthEvent(uuid, EventKind.XID, number, gi, ci)


# -- the state machine -------------------------------------------------------------------------


def test_device_map_lists_every_device_sharing_the_counters() -> None:
    inventory = profile_inventory("dgx-h100")
    gpus = device_map(inventory, DYNAMIC)
    gpu0 = gpus[inventory.gpus[0].uuid]
    assert gpu0.partitionable and len(gpu0.names) == 26
    assert gpu0.names[0] == "gpu-0" and THREE_G_AT_4 in gpu0.names
    # without the flag: the GPU alone, as before
    assert device_map(inventory)[inventory.gpus[0].uuid].names == ("gpu-0",)
    adopted = device_map(profile_inventory("dgx-a100"), DynamicMig(adopt=True))
    assert all(
        len(g.names) == 25 and "gpu-" + str(g.index) not in g.names for g in adopted.values()
    )


def test_mig_xid_taints_its_placement_only_and_a_gpu_fault_taints_all() -> None:
    inventory = profile_inventory("dgx-h100")
    uuid = inventory.gpus[0].uuid
    sm = HealthStateMachine(HealthPolicy(), device_map(inventory, DYNAMIC))
    sm.learn_instances(uuid, {(1, 0): THREE_G_AT_4, (2, 0): "gpu-0-mig-2g20gb-14-0"})
    [added] = sm.observe([xid(uuid, 62, 1, 0)], T0)
    assert added.devices == (THREE_G_AT_4,)
    assert set(sm.taints()) == {THREE_G_AT_4}
    statuses = {s.name: s.health for s in sm.statuses()}
    assert statuses[THREE_G_AT_4] is Health.UNHEALTHY
    assert statuses["gpu-0"] is statuses["gpu-0-mig-3g40gb-9-0"] is Health.HEALTHY
    # a parent fault: every device of the GPU, created or not
    [parent] = sm.observe([xid(uuid, 79)], T0 + 1)
    names = device_map(inventory, DYNAMIC)[uuid].names
    assert parent.devices == names
    assert set(sm.taints()) == set(names)
    assert all(s.health is Health.UNHEALTHY for s in sm.statuses() if s.name in names)
    assert all(s.health is Health.HEALTHY for s in sm.statuses() if s.name not in names)


def test_an_instance_not_in_the_layout_counts_for_the_gpu() -> None:
    inventory = profile_inventory("dgx-h100")
    uuid = inventory.gpus[1].uuid
    sm = HealthStateMachine(HealthPolicy(), device_map(inventory, DYNAMIC))
    sm.learn_instances(uuid, {(9, 0): "not-a-device-of-this-gpu"})  # ignored
    [added] = sm.observe([xid(uuid, 62, 9, 0)], T0)
    assert len(added.devices) == 26


# -- the monitor over the simulated NVML --------------------------------------------------------


class Publisher:
    def __init__(self) -> None:
        self.calls: list[tuple[list[DraDevice], list[CounterSet]]] = []

    def set_devices(
        self, devices: Sequence[DraDevice], counter_sets: Sequence[CounterSet] = ()
    ) -> None:
        self.calls.append((list(devices), list(counter_sets)))

    def tainted(self) -> dict[str, list[str]]:
        devices = self.calls[-1][0] if self.calls else []
        return {d.name: [t.value for t in d.taints] for d in devices if d.taints}


Begin = Callable[[anyio.abc.TaskGroup], Awaitable[tuple[SimulatedHost, HealthMonitor, Publisher]]]


@pytest.fixture
async def begin(tmp_path: Path) -> AsyncIterator[Begin]:
    hosts: list[SimulatedHost] = []

    async def start(
        group: anyio.abc.TaskGroup,
    ) -> tuple[SimulatedHost, HealthMonitor, Publisher]:
        host = SimulatedHost.start("dgx-h100", tmp_path / "host")
        hosts.append(host)
        nvml = Nvml()
        await nvml.init()
        inventory = await discover(nvml, tmp_path / "host")
        pump = EventPump([WatchedGpu(g.index, g.uuid) for g in inventory.gpus], wait_timeout=0.1)
        publisher = Publisher()
        monitor = HealthMonitor(
            nvml=nvml,
            inventory=inventory,
            policy=POLICY,
            publisher=publisher,
            hub=HealthHub(),
            events=LoggingEventPoster(),
            pump=pump,
            dynamic_mig=DYNAMIC,
        )
        group.start_soon(monitor.run)
        with anyio.fail_after(5):
            while len(pump.watched) < 8:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        return host, monitor, publisher

    yield start
    for host in hosts:
        host.stop()
    uninstall()


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:  # noqa: ASYNC109
    with anyio.fail_after(timeout):
        while not check():  # noqa: ASYNC110
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_xid_on_a_mig_instance_taints_only_it_and_on_the_parent_all(begin: Begin) -> None:
    async with anyio.create_task_group() as group:
        host, monitor, publisher = await begin(group)
        parent = host.profile.gpus[0].uuid

        def make() -> tuple[int, int, int]:  # an instance elsewhere first: ids are not placements
            mig_ops.set_mig_mode(parent, True)
            other = mig_ops.create_gpu_instance(parent, 14, 0, 2)
            mig_ops.create_compute_instance(parent, other, 1)
            gi = mig_ops.create_gpu_instance(parent, 9, 4, 4)
            ci, _ = mig_ops.create_compute_instance(parent, gi, 2)
            return other, gi, ci

        other, gi, ci = await anyio.to_thread.run_sync(make)
        assert gi != other
        host.library.inject_xid(0, 62, gi, ci)
        await until(lambda: bool(publisher.tainted()))
        assert publisher.tainted() == {THREE_G_AT_4: ["62"]}
        assert monitor.layout_reads == 1
        devices, counter_sets = publisher.calls[-1]
        assert len(devices) == 8 * 26 and len(counter_sets) == 8  # the dynamic pool
        health = {s.name: s.health for s in monitor.hub.current}
        assert health[THREE_G_AT_4] is Health.UNHEALTHY
        assert sum(h is Health.UNHEALTHY for h in health.values()) == 1

        host.library.inject_xid(0, 79)  # the parent falls off the bus
        names = monitor.machine.gpus[parent].names
        await until(lambda: len(publisher.tainted()) == 26)
        assert set(publisher.tainted()) == set(names)
        assert sorted(publisher.tainted()[THREE_G_AT_4]) == ["62", "79"]
        assert publisher.tainted()["gpu-0"] == ["79"]
        health = {s.name: s.health for s in monitor.hub.current}
        assert {n for n, h in health.items() if h is Health.UNHEALTHY} == set(names)
        group.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_storm_on_one_instance_reads_the_layout_a_few_times(begin: Begin) -> None:
    async with anyio.create_task_group() as group:
        host, monitor, publisher = await begin(group)
        parent = host.profile.gpus[2].uuid

        def make() -> tuple[int, int]:
            mig_ops.set_mig_mode(parent, True)
            gi = mig_ops.create_gpu_instance(parent, 19, 6, 1)
            return gi, mig_ops.create_compute_instance(parent, gi, 0)[0]

        gi, ci = await anyio.to_thread.run_sync(make)
        for _ in range(2000):
            host.library.inject_xid(2, 62, gi, ci)
        await until(lambda: monitor.pump.events >= 8 + 2000)
        await until(lambda: bool(publisher.tainted()))
        await anyio.sleep(0.2)
        assert publisher.tainted() == {"gpu-2-mig-1g10gb-19-6": ["62"]}
        assert monitor.layout_reads <= 40  # per batch of events, not per event
        group.cancel_scope.cancel()
