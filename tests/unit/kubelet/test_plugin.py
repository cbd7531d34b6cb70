"""Registration, socket order and lifecycle of the kubelet plugin, over real unix sockets."""

from __future__ import annotations

import gc
import os
import socket
import stat
from pathlib import Path
from typing import Any

import anyio
import pytest
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.const import Status
from h2.connection import H2Connection

from agent.kubelet import api
from agent.kubelet.registration import Registrar
from agent.kubelet.server import CLOSED_STREAMS_KEPT
from agent.kubelet.sockets import SocketPathError
from tests.unit.kubelet.conftest import DRIVER, FakeEngine, RunningPlugin, make_plugin, wait_until

pytestmark = pytest.mark.anyio
pr = api.pluginregistration


async def get_info(path: Path) -> Any:
    channel = Channel(path=str(path))
    try:
        return await pr.RegistrationStub(channel).get_info(pr.InfoRequest(), timeout=1.0)
    finally:
        channel.close()


async def notify(path: Path, registered: bool, error: str = "") -> None:
    channel = Channel(path=str(path))
    try:
        status = pr.RegistrationStatus(plugin_registered=registered, error=error)
        await pr.RegistrationStub(channel).notify_registration_status(status, timeout=5.0)
    finally:
        channel.close()


async def empty_prepare(path: Path) -> dict[str, Any]:
    channel = Channel(path=str(path))
    try:
        stub = api.dra_v1.DraPluginStub(channel)
        answer = await stub.node_prepare_resources(api.dra_v1.NodePrepareResourcesRequest())
        return dict(answer.claims)
    finally:
        channel.close()


def stale_socket(path: Path) -> None:
    """Leave a socket file nobody listens on, as a killed agent does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()


async def test_get_info_answers_like_a_dra_plugin(running: RunningPlugin) -> None:
    info = await get_info(running.registration_socket)
    assert info.type == "DRAPlugin"
    assert info.name == DRIVER
    assert info.endpoint == str(running.dra_socket)
    assert Path(info.endpoint).is_absolute()
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]


async def test_supported_versions_are_a_parameter(short_dir: Path) -> None:
    versions = ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"]
    plugin = make_plugin(short_dir, FakeEngine(), supported_versions=versions)
    async with anyio.create_task_group() as task_group:
        await task_group.start(plugin.run)
        info = await get_info(plugin.registrar.path)
        task_group.cancel_scope.cancel()
    assert list(info.supported_versions) == versions


async def test_dra_socket_answers_before_registration_socket_appears(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin = make_plugin(short_dir, FakeEngine())
    seen: list[tuple[bool, dict[str, Any]]] = []
    original = Registrar.run

    async def checked_run(self: Registrar, **kwargs: Any) -> None:
        # at the moment registration starts: no registration socket yet, DRA already answers
        seen.append((self.path.exists(), await empty_prepare(plugin.dra_server.path)))
        await original(self, **kwargs)

    monkeypatch.setattr(Registrar, "run", checked_run)
    async with anyio.create_task_group() as task_group:
        await task_group.start(plugin.run)
        assert plugin.registrar.path.exists()
        task_group.cancel_scope.cancel()
    assert seen == [(False, {})]


async def test_stale_sockets_are_replaced(short_dir: Path) -> None:
    plugin = make_plugin(short_dir, FakeEngine())
    for path in (plugin.dra_server.path, plugin.registrar.path):
        stale_socket(path)
    with pytest.raises(ConnectionRefusedError):
        await empty_prepare(plugin.dra_server.path)
    async with anyio.create_task_group() as task_group:
        await task_group.start(plugin.run)
        assert (await get_info(plugin.registrar.path)).name == DRIVER
        assert await empty_prepare(plugin.dra_server.path) == {}
        task_group.cancel_scope.cancel()


async def test_a_regular_file_in_the_way_is_not_deleted(short_dir: Path) -> None:
    plugin = make_plugin(short_dir, FakeEngine())
    plugin.dra_server.path.parent.mkdir(parents=True)
    plugin.dra_server.path.write_text("precious")
    with pytest.raises(SocketPathError, match="is not a unix socket"):
        await plugin.run()
    assert plugin.dra_server.path.read_text() == "precious"
    assert not plugin.registrar.path.exists()


async def test_socket_modes_do_not_depend_on_the_umask(short_dir: Path) -> None:
    plugin = make_plugin(short_dir, FakeEngine())
    old = os.umask(0)
    try:
        async with anyio.create_task_group() as task_group:
            await task_group.start(plugin.run)
            for path in (plugin.dra_server.path, plugin.registrar.path):
                assert stat.S_IMODE(path.stat().st_mode) == 0o755, path
            task_group.cancel_scope.cancel()
    finally:
        os.umask(old)


async def _call_prepare(path: Path, answers: list[Any]) -> None:
    channel = Channel(path=str(path))
    try:
        stub = api.dra_v1.DraPluginStub(channel)
        claim = api.dra_v1.Claim(namespace="default", uid="uid-1", name="c")
        request = api.dra_v1.NodePrepareResourcesRequest(claims=[claim])
        try:
            answers.append(dict((await stub.node_prepare_resources(request, timeout=10)).claims))
        except GRPCError as err:
            answers.append(err)
    finally:
        channel.close()


async def test_sockets_removed_on_shutdown_after_in_flight_call(short_dir: Path) -> None:
    engine = FakeEngine()
    engine.gate = anyio.Event()
    plugin = make_plugin(short_dir, engine, shutdown_grace=5.0)
    answers: list[Any] = []
    running_while_stopping: list[int] = []

    async def release_when_registration_gone() -> None:
        await wait_until(lambda: not plugin.registrar.path.exists())
        await anyio.sleep(0.1)
        running_while_stopping.append(plugin.calls.running)
        assert engine.gate is not None
        engine.gate.set()

    async with anyio.create_task_group() as outer:
        async with anyio.create_task_group() as plugin_group:
            await plugin_group.start(plugin.run)
            outer.start_soon(_call_prepare, plugin.dra_server.path, answers)
            await engine.entered.wait()
            outer.start_soon(release_when_registration_gone)
            plugin_group.cancel_scope.cancel()  # SIGTERM, in effect
    assert running_while_stopping == [1]  # registration gone first, the DRA call still running
    assert not plugin.dra_server.path.exists()
    assert not plugin.registrar.path.exists()
    [answer] = answers
    assert answer["uid-1"].error == ""


async def test_call_outliving_the_grace_gets_unavailable_not_silence(short_dir: Path) -> None:
    engine = FakeEngine()
    engine.gate = anyio.Event()  # never set
    plugin = make_plugin(short_dir, engine, shutdown_grace=0.2)
    answers: list[Any] = []
    async with anyio.create_task_group() as outer:
        async with anyio.create_task_group() as plugin_group:
            await plugin_group.start(plugin.run)
            outer.start_soon(_call_prepare, plugin.dra_server.path, answers)
            await engine.entered.wait()
            plugin_group.cancel_scope.cancel()
        await wait_until(lambda: bool(answers), timeout=3)  # far less than the 10 s deadline
    [error] = answers
    assert isinstance(error, GRPCError) and error.status == Status.UNAVAILABLE
    assert engine.cancelled == 1


async def test_rejection_is_counted_and_registration_retried(running: RunningPlugin) -> None:
    await notify(running.registration_socket, False, "plugin name conflicts with another")
    registrar = running.plugin.registrar
    assert registrar.rejections == 1
    assert registrar.registered is False
    await wait_until(
        lambda: registrar.sockets_created >= 2 and running.registration_socket.exists()
    )
    # the new socket is a working registration endpoint
    assert (await get_info(running.registration_socket)).name == DRIVER
    await notify(running.registration_socket, True)
    assert registrar.registered is True


async def test_deleted_registration_socket_is_recreated(short_dir: Path) -> None:
    plugin = make_plugin(short_dir, FakeEngine())
    plugin.registrar._check_interval = 0.05
    async with anyio.create_task_group() as task_group:
        await task_group.start(plugin.run)
        plugin.registrar.path.unlink()
        await wait_until(plugin.registrar.path.exists)
        assert (await get_info(plugin.registrar.path)).name == DRIVER
        task_group.cancel_scope.cancel()


async def test_rolling_update_names_do_not_clash(short_dir: Path) -> None:
    """Removal only deletes our own socket: a successor's socket at the path stays."""
    plugin = make_plugin(short_dir, FakeEngine())
    async with anyio.create_task_group() as task_group:
        await task_group.start(plugin.run)
        plugin.registrar._check_interval = 3600  # do not recreate behind the test's back
        plugin.dra_server.path.unlink()
        stale_socket(plugin.dra_server.path)  # "the next instance" took the path
        task_group.cancel_scope.cancel()
    assert plugin.dra_server.path.exists()


async def test_a_long_lived_connection_remembers_a_bounded_number_of_closed_streams(
    running: RunningPlugin,
) -> None:
    """The kubelet keeps one connection for months: h2's record of closed streams (65 536 by
    default, about 7 MB) must stay at CLOSED_STREAMS_KEPT, and calls keep working past it."""
    calls = CLOSED_STREAMS_KEPT + 200
    channel = running.dra_channel()
    try:
        stub = api.dra_v1.DraPluginStub(channel)
        for _ in range(calls):
            answer = await stub.node_prepare_resources(api.dra_v1.NodePrepareResourcesRequest())
            assert dict(answer.claims) == {}
    finally:
        channel.close()
    servers = [
        c for c in gc.get_objects() if isinstance(c, H2Connection) and not c.config.client_side
    ]
    assert servers, "no server-side HTTP/2 connection found"
    assert max(len(c._closed_streams) for c in servers) == CLOSED_STREAMS_KEPT
