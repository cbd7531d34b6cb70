"""The simulation control socket: requests reach the simulated library; bad ones are refused."""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from agent.hardware.simulated import SimulatedHost
from agent.hardware.simulated.install import uninstall
from agent.sim.control import client, control_socket_path
from agent.sim.control.client import ControlError, send_request
from agent.sim.control.server import SimulationControl

pytestmark = pytest.mark.anyio


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory under /tmp: a unix socket's path must stay under 108 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="ctl-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
async def control() -> AsyncIterator[tuple[SimulatedHost, Path]]:
    folder = Path(tempfile.mkdtemp(prefix="ctl-", dir="/tmp"))
    host = SimulatedHost.start("dgx-h100", folder / "host")
    path = control_socket_path(folder)
    try:
        async with anyio.create_task_group() as group:
            await group.start(SimulationControl(path, host.library).run)
            yield host, path
            group.cancel_scope.cancel()
        assert not path.exists()
    finally:
        host.stop()
        uninstall()
        shutil.rmtree(folder, ignore_errors=True)


async def test_requests_act_on_the_library(control: tuple[SimulatedHost, Path]) -> None:
    host, path = control
    gpus = host.library.state.gpus
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    reply = await send_request(path, {"op": "xid", "gpu": gpus[2].spec.uuid, "xid": 79})
    assert (reply["gpu"], reply["uuid"], reply["delivered"]) == (2, gpus[2].spec.uuid, 0)
    assert abs(reply["injected_at"] - time.monotonic()) < 5
    assert gpus[2].recovery_action != 0
    await send_request(path, {"op": "gpu-lost", "gpu": "2"})
    assert gpus[2].lost
    await send_request(path, {"op": "recover", "gpu": "2"})
    assert not gpus[2].lost and gpus[2].recovery_action == 0
    await send_request(path, {"op": "ecc", "gpu": "1"})
    assert gpus[1].recovery_action != 0


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        ({"op": "xid", "gpu": "8", "xid": 79}, "no GPU '8'.*index 0-7"),
        ({"op": "reboot", "gpu": "0"}, "unknown operation 'reboot'"),
        ({"op": "xid", "gpu": "0", "xid": 79, "count": 0}, "count must be"),
        ({"op": "xid", "gpu": "0"}, "xid"),
    ],
)
async def test_bad_requests_are_refused(
    control: tuple[SimulatedHost, Path], request_: dict[str, object], message: str
) -> None:
    _, path = control
    with pytest.raises(ControlError, match=message):
        await send_request(path, request_)


async def test_no_agent_listening_says_what_to_check(tmp_path: Path) -> None:
    with pytest.raises(ControlError, match="is `gpu-dra-agent run --simulate"):
        await send_request(tmp_path / "none.sock", {"op": "recover", "gpu": "0"})


async def test_a_request_waits_for_a_socket_that_opens_later(
    short_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent opens its control socket once its engine runs: a request sent right after
    its start waits for it (and says so after a moment) instead of failing."""
    monkeypatch.setattr(client, "NOTICE_AFTER", 0.1)
    host = SimulatedHost.start("dgx-h100", short_dir / "host")
    path = control_socket_path(short_dir / "plugins" / "gpu.nvidia.com")  # no directory yet
    try:
        async with anyio.create_task_group() as group:

            async def agent_starts() -> None:
                await anyio.sleep(0.5)
                path.parent.mkdir(parents=True)
                await group.start(SimulationControl(path, host.library).run)

            group.start_soon(agent_starts)
            with caplog.at_level(logging.INFO, logger=client.__name__):
                reply = await send_request(path, {"op": "recover", "gpu": "1"}, wait=10)
            group.cancel_scope.cancel()
    finally:
        host.stop()
        uninstall()
    assert reply["ok"] is True and reply["gpu"] == 1
    [notice] = [r.getMessage() for r in caplog.records if r.name == client.__name__]
    assert notice.startswith(f"waiting up to 10 s for the simulated agent's control socket {path}")


@pytest.mark.parametrize("where", ["no directory", "no socket", "a dead socket"])
async def test_the_wait_is_bounded_and_says_what_it_waited_for(short_dir: Path, where: str) -> None:
    path = control_socket_path(short_dir / "plugin")
    if where != "no directory":
        path.parent.mkdir()
    dead = socket.socket(socket.AF_UNIX)
    if where == "a dead socket":  # a killed agent's file: bound, nobody listening
        dead.bind(str(path))
    why = {
        "no directory": f"its directory {path.parent} does not exist",
        "no socket": "the socket does not exist",
        "a dead socket": "nothing listens on it (connection refused",
    }[where]
    started = time.monotonic()
    try:
        with pytest.raises(ControlError) as raised:
            await send_request(path, {"op": "recover", "gpu": "0"}, wait=0.3)
    finally:
        dead.close()
    assert 0.3 <= time.monotonic() - started < 3
    message = str(raised.value)
    assert message.startswith(
        f"cannot reach the simulated agent's control socket {path} after 0.3 s of waiting for "
        f"the agent to open it (once its prepare engine runs): {why}"
    ), message


async def test_a_gpu_instance_destroyed_behind_the_agents_back(
    control: tuple[SimulatedHost, Path],
) -> None:
    host, path = control
    state = host.library.state
    gpu = state.gpus[1]
    profile = gpu.model.gi_by_id(19)  # 1g.10gb
    assert profile is not None
    gi = state.add_gpu_instance(gpu, 5, profile, 0)
    ci_profile = gpu.model.ci_profiles(profile)[0]
    state.add_compute_instance(gi, 0, ci_profile, 0, "MIG-5d11a304-ead0-5519-b54a-361764500a99")
    changes: list[int] = []
    host.library.add_mig_listener(lambda: changes.append(1))  # what persists the state
    request = {"op": "destroy-gpu-instance", "gpu": "1", "gpu_instance_id": 5}
    await send_request(path, request)
    assert gpu.gpu_instances == {} and changes == [1]
    with pytest.raises(ControlError, match="GPU 1 has no GPU instance 5"):
        await send_request(path, request)


async def test_a_client_gone_before_its_request_leaves_the_socket_serving(
    control: tuple[SimulatedHost, Path],
) -> None:
    """A connection closed without a request (a readiness probe, a half-written line) is not a
    failure: the socket goes on serving (it once stopped the agent)."""
    from agent.sim.control.client import wait_engine_started

    _, path = control
    await wait_engine_started(path.parent, timeout=5)  # connects, then closes at once
    async with await anyio.connect_unix(path) as stream:
        await stream.send(b'{"op": "recover"')  # no end of line
    reply = await send_request(path, {"op": "recover", "gpu": "0"})
    assert reply["ok"] is True and reply["gpu"] == 0
