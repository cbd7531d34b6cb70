"""The DRAResourceHealth stream on a real DRA socket: full lists, many watchers, clean shutdown."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import grpclib.const
import pytest
from grpclib.client import Channel

from agent.health.records import DeviceStatus, Health
from agent.health.stream import HEALTH_VERSIONS, HealthHub, HealthStreamService
from agent.kubelet import api
from agent.kubelet.plugin import KubeletPlugin
from agent.kubelet.registration import DRA_VERSIONS
from tests.unit.kubelet.conftest import FakeEngine, make_plugin, short_dir

__all__ = ["short_dir"]  # the fixture, shared with the kubelet tests

pytestmark = pytest.mark.anyio

NODE = "node-a"


def statuses(unhealthy: Collection[int] = (), count: int = 8) -> list[DeviceStatus]:
    return [
        DeviceStatus(f"gpu-{i}", Health.UNHEALTHY if i in unhealthy else Health.HEALTHY, f"m{i}")
        for i in range(count)
    ]


class Watcher:
    """One kubelet-like client of the stream, reading in a task of its own."""

    def __init__(
        self, socket: Path, pb: Any = api.health_v1, channel: Channel | None = None
    ) -> None:
        self.channel = Channel(path=str(socket)) if channel is None else channel
        self.pb = pb
        self.messages: list[Any] = []
        self.ended_ok = False
        self.error: BaseException | None = None

    async def read(self) -> None:
        stub = self.pb.DraResourceHealthStub(self.channel)
        try:
            async with contextlib.aclosing(
                stub.node_watch_resources(self.pb.NodeWatchResourcesRequest())
            ) as responses:
                async for response in responses:
                    self.messages.append(response)
            self.ended_ok = True
        except Exception as err:  # recorded for the assertions
            self.error = err

    def health(self, index: int = -1) -> dict[str, int]:
        return {d.device.device_name: int(d.health) for d in self.messages[index].devices}

    async def wait(self, count: int, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        with anyio.fail_after(timeout):
            while len(self.messages) < count:  # noqa: ASYNC110
                await anyio.sleep(0.005)


@pytest.fixture
async def served(short_dir: Path) -> AsyncIterator[tuple[KubeletPlugin, HealthHub]]:
    hub = HealthHub(statuses())
    service = HealthStreamService(hub, pool_name=NODE, resend_interval=0.3)
    plugin = make_plugin(
        short_dir,
        FakeEngine(),
        supported_versions=(*DRA_VERSIONS, *HEALTH_VERSIONS),
        extra_services=[service],
        shutdown_grace=2.0,
        registration_backoff=0.05,
    )
    async with anyio.create_task_group() as group:
        await group.start(plugin.run)
        yield plugin, hub
        group.cancel_scope.cancel()


async def test_full_list_on_connect_with_identity_timeout_and_message(served: Any) -> None:
    plugin, _ = served
    for pb in (api.health_v1alpha1, api.health_v1):
        watcher = Watcher(plugin.dra_server.path, pb)
        async with anyio.create_task_group() as group:
            group.start_soon(watcher.read)
            await watcher.wait(1)
            group.cancel_scope.cancel()
        watcher.channel.close()
        [first] = watcher.messages[:1]
        assert [d.device.device_name for d in first.devices] == [f"gpu-{i}" for i in range(8)]
        device = first.devices[0]
        assert device.device.pool_name == NODE
        assert (device.health_check_timeout_seconds, device.message) == (30, "m0")
        assert abs(device.last_updated_time - time.time()) < 5


async def test_changes_and_quiet_periods_are_both_sent(served: Any) -> None:
    plugin, hub = served
    watcher = Watcher(plugin.dra_server.path)
    async with anyio.create_task_group() as group:
        group.start_soon(watcher.read)
        await watcher.wait(1)
        hub.publish(statuses({3}))
        await watcher.wait(2)
        assert watcher.health()["gpu-3"] == 2
        await watcher.wait(4, timeout=2)  # resent every 0.3 s without a change
        assert watcher.health()["gpu-3"] == 2
        group.cancel_scope.cancel()
    watcher.channel.close()


async def test_late_watcher_gets_current_state_and_a_leaving_one_disturbs_nobody(
    served: Any,
) -> None:
    plugin, hub = served
    first, leaving = Watcher(plugin.dra_server.path), Watcher(plugin.dra_server.path)
    async with anyio.create_task_group() as group:
        group.start_soon(first.read)
        group.start_soon(leaving.read)
        await first.wait(1)
        await leaving.wait(1)
        hub.publish(statuses({5}))
        late = Watcher(plugin.dra_server.path)
        group.start_soon(late.read)
        await late.wait(1)
        assert late.health(0)["gpu-5"] == 2
        leaving.channel.close()  # disconnects mid-stream
        await anyio.sleep(0.05)
        hub.publish(statuses({5, 6}))
        await first.wait(3)
        await late.wait(2)
        assert first.health()["gpu-6"] == late.health()["gpu-6"] == 2
        assert hub.watchers == 2
        group.cancel_scope.cancel()
    for watcher in (first, late):
        watcher.channel.close()


async def test_a_slow_watcher_does_not_block_others(served: Any) -> None:
    plugin, hub = served
    slow = Channel(path=str(plugin.dra_server.path))
    stub = api.health_v1.DraResourceHealthStub(slow)
    fast = Watcher(plugin.dra_server.path)
    async with anyio.create_task_group() as group:
        async with stub.channel.request(
            "/v1.DRAResourceHealth/NodeWatchResources",
            grpclib.const.Cardinality.UNARY_STREAM,
            api.health_v1.NodeWatchResourcesRequest,
            api.health_v1.NodeWatchResourcesResponse,
        ) as stream:
            await stream.send_message(api.health_v1.NodeWatchResourcesRequest(), end=True)
            group.start_soon(fast.read)
            await fast.wait(1)
            started = time.monotonic()
            for n in range(2000):  # the slow stream never reads: its window fills up
                hub.publish(statuses({n % 8}))
                if n % 100 == 0:
                    await anyio.lowlevel.checkpoint()
            assert time.monotonic() - started < 1.0
            await anyio.sleep(0.1)
            assert fast.health()[f"gpu-{1999 % 8}"] == 2  # fast got the latest state
            assert len(fast.messages) < 2000  # and skipped stale ones instead of queueing
            await stream.cancel()
        group.cancel_scope.cancel()
    slow.close()
    fast.channel.close()


async def test_shutdown_ends_every_stream_with_status_ok(short_dir: Path) -> None:
    hub = HealthHub(statuses())
    service = HealthStreamService(hub, pool_name=NODE)
    plugin = make_plugin(short_dir, FakeEngine(), extra_services=[service], shutdown_grace=5.0)
    watchers = []
    async with anyio.create_task_group() as outer:
        async with anyio.create_task_group() as group:
            await group.start(plugin.run)
            watchers = [Watcher(plugin.dra_server.path) for _ in range(3)]
            for watcher in watchers:
                outer.start_soon(watcher.read)
            for watcher in watchers:
                await watcher.wait(1)
            started = time.monotonic()
            group.cancel_scope.cancel()  # the plugin's graceful stop
        assert time.monotonic() - started < 2.0  # not the 5 s grace: the streams ended
        with anyio.fail_after(3):
            while not all(w.ended_ok or w.error for w in watchers):  # noqa: ASYNC110
                await anyio.sleep(0.01)
    assert [(w.ended_ok, w.error) for w in watchers] == [(True, None)] * 3
    for watcher in watchers:
        watcher.channel.close()


async def test_every_stream_ended_before_the_registration_socket_goes(short_dir: Path) -> None:
    """The kubelet closes its connection to the DRA socket as soon as it deregisters the plugin:
    a stream whose trailers it has not read by then reaches it as a lost connection. So a stop
    ends every stream, however many on one connection, before the registration socket goes."""
    service = HealthStreamService(HealthHub(statuses()), pool_name=NODE)
    plugin = make_plugin(short_dir, FakeEngine(), extra_services=[service], shutdown_grace=5.0)
    channels: list[Channel] = []

    async def deregister_when_the_socket_goes() -> None:  # as the kubelet's plugin watcher
        while plugin.registrar.path.exists():
            await anyio.lowlevel.checkpoint()
        for channel in channels:
            channel.close()

    async with anyio.create_task_group() as outer:
        async with anyio.create_task_group() as group:
            await group.start(plugin.run)
            channels.extend(Channel(path=str(plugin.dra_server.path)) for _ in range(4))
            watchers = [
                Watcher(plugin.dra_server.path, pb, channel)
                for channel in channels
                for pb in (api.health_v1, api.health_v1alpha1) * 4
            ]
            for watcher in watchers:
                outer.start_soon(watcher.read)
            for watcher in watchers:
                await watcher.wait(1)
            outer.start_soon(deregister_when_the_socket_goes)
            group.cancel_scope.cancel()  # the plugin's graceful stop
        with anyio.fail_after(3):
            while not all(w.ended_ok or w.error for w in watchers):  # noqa: ASYNC110
                await anyio.sleep(0.01)
    assert [(w.ended_ok, w.error) for w in watchers] == [(True, None)] * 32


async def test_a_client_that_stops_reading_holds_a_stop_up_for_a_second_at_most(
    short_dir: Path,
) -> None:
    """Its stream cannot end (the socket's buffers are full): the registration socket goes after
    STREAMS_END_GRACE all the same, the other streams having ended with status OK."""
    hub = HealthHub(statuses())
    service = HealthStreamService(hub, pool_name=NODE)
    plugin = make_plugin(short_dir, FakeEngine(), extra_services=[service], shutdown_grace=5.0)
    stuck = Channel(path=str(plugin.dra_server.path))
    fast = Watcher(plugin.dra_server.path)
    async with anyio.create_task_group() as outer:
        async with stuck.request(
            "/v1.DRAResourceHealth/NodeWatchResources",
            grpclib.const.Cardinality.UNARY_STREAM,
            api.health_v1.NodeWatchResourcesRequest,
            api.health_v1.NodeWatchResourcesResponse,
        ) as stream:
            async with anyio.create_task_group() as group:
                await group.start(plugin.run)
                outer.start_soon(fast.read)
                await stream.send_message(api.health_v1.NodeWatchResourcesRequest(), end=True)
                await stream.recv_message()
                stuck._protocol.connection._transport.pause_reading()  # reads no more
                large = [DeviceStatus(f"gpu-{i}", Health.HEALTHY, "m" * 990) for i in range(100)]
                for _ in range(30):  # 100 KB a message: the socket's buffers fill up
                    hub.publish(large)
                    await anyio.sleep(0.005)
                await fast.wait(2)
                started = time.monotonic()
                group.cancel_scope.cancel()  # the plugin's graceful stop
            stopped_after = time.monotonic() - started
            stuck.close()  # it would wait for trailers forever
        with anyio.fail_after(3):
            while not (fast.ended_ok or fast.error):  # noqa: ASYNC110
                await anyio.sleep(0.01)
    assert 0.9 < stopped_after < 1.8  # STREAMS_END_GRACE, not the 5 s grace
    assert (fast.ended_ok, fast.error) == (True, None)
    assert not plugin.registrar.path.exists() and not plugin.dra_server.path.exists()
    fast.channel.close()


async def test_a_hub_made_before_the_monitor_sends_nothing_until_its_first_look(
    short_dir: Path,
) -> None:
    """The sockets open before the GPUs are discovered (agent.health.front): a stream opened
    then gets its first list only when the monitor publishes, never an empty or stale one;
    a server stopping before that ends the stream with status OK."""
    hub = HealthHub(until_published=True)
    service = HealthStreamService(hub, pool_name=NODE)
    plugin = make_plugin(short_dir, FakeEngine(), extra_services=[service], shutdown_grace=5.0)
    async with anyio.create_task_group() as group:
        await group.start(plugin.run)
        watcher = Watcher(plugin.dra_server.path)
        group.start_soon(watcher.read)
        await anyio.sleep(0.3)
        assert watcher.messages == [] and watcher.error is None
        hub.publish(statuses({5}))  # the monitor's first look
        await watcher.wait(1)
        assert watcher.health(0)["gpu-5"] == 2 and len(watcher.messages[0].devices) == 8
        late = Watcher(plugin.dra_server.path)  # the hub is ready now: at once
        group.start_soon(late.read)
        await late.wait(1)
        group.cancel_scope.cancel()
    watcher.channel.close()
    late.channel.close()
    waiting = HealthHub(until_published=True)
    service = HealthStreamService(waiting, pool_name=NODE)
    plugin = make_plugin(short_dir, FakeEngine(), extra_services=[service], shutdown_grace=5.0)
    async with anyio.create_task_group() as outer:
        async with anyio.create_task_group() as group:
            await group.start(plugin.run)
            never = Watcher(plugin.dra_server.path)
            outer.start_soon(never.read)
            await anyio.sleep(0.2)
            group.cancel_scope.cancel()  # stops before any publish
        with anyio.fail_after(3):
            while not (never.ended_ok or never.error):  # noqa: ASYNC110
                await anyio.sleep(0.01)
    assert (never.ended_ok, never.error, never.messages) == (True, None, [])
    never.channel.close()
