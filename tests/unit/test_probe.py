"""``gpu-dra-agent probe`` against a real KubeletPlugin on unix sockets (agent/probe.py).

The plugin runs in the test's event loop; the probe runs through the CLI in a worker thread
(it starts its own event loop, as it does in an exec probe), so each test sees the exit status
and the one line a kubelet would record.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from agent.cli import main
from agent.kubelet.plugin import KubeletPlugin
from tests.unit.kubelet.conftest import DRIVER, FakeEngine

pytestmark = pytest.mark.anyio
UID = "0b6e1c2a-4f4e-4a7e-9d55-3c1d2e6f7a80"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def short_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for name in ("POD_UID", "KUBELET_REGISTRAR_DIRECTORY_PATH", "KUBELET_PLUGINS_DIRECTORY_PATH"):
        monkeypatch.delenv(name, raising=False)
    path = Path(tempfile.mkdtemp(prefix="pb-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def dirs(root: Path) -> list[str]:
    return ["--registrar-dir", str(root / "registry"), "--plugins-dir", str(root / "plugins")]


async def serve(root: Path, instance: str | None = None) -> KubeletPlugin:
    suffix = f"-{instance}" if instance else ""
    dra = "dra" + suffix + ".sock"
    return KubeletPlugin(
        driver_name=DRIVER,
        dra_socket=root / "plugins" / DRIVER / dra,
        registration_socket=root / "registry" / f"{DRIVER}{suffix}-reg.sock",
        engine=FakeEngine(),
    )


@pytest.fixture
async def plugin(short_dir: Path) -> AsyncIterator[KubeletPlugin]:
    served = await serve(short_dir)
    async with anyio.create_task_group() as group:
        await group.start(served.run)
        yield served
        group.cancel_scope.cancel()


async def probe(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    status = await anyio.to_thread.run_sync(main, ["probe", *argv])
    captured = capsys.readouterr()
    return status, (captured.out + captured.err).splitlines()


async def test_a_serving_agent_passes(
    plugin: KubeletPlugin, short_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, lines = await probe(capsys, *dirs(short_dir))
    assert status == 0, lines
    assert len(lines) == 1 and lines[0].startswith(f"ok: {DRIVER} answered GetInfo on ")
    assert str(plugin.dra_server.path) in lines[0]


async def test_instance_id_from_the_pod_uid_finds_the_rolling_update_sockets(
    short_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    served = await serve(short_dir, UID)
    async with anyio.create_task_group() as group:
        await group.start(served.run)
        status, lines = await probe(capsys, *dirs(short_dir))
        assert status == 1 and "does not exist" in lines[0], "without the id: other names"
        monkeypatch.setenv("POD_UID", UID)  # what the DaemonSet's probe inherits
        status, lines = await probe(capsys, *dirs(short_dir))
        assert status == 0, lines
        assert f"dra-{UID}.sock" in lines[0]
        group.cancel_scope.cancel()


async def test_no_agent_fails_with_one_line(
    short_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, lines = await probe(capsys, *dirs(short_dir))
    assert status == 1
    assert lines == [
        f"probe failed: registration socket {short_dir}/registry/{DRIVER}-reg.sock does not "
        "exist: the agent is not running, is still starting, or the registry directory is not "
        "the kubelet's"
    ]


async def test_a_stale_registration_socket_fails(
    short_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = short_dir / "registry" / f"{DRIVER}-reg.sock"
    path.parent.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(path))  # a killed agent's socket: nobody listens
    status, lines = await probe(capsys, *dirs(short_dir))
    assert status == 1 and len(lines) == 1
    assert lines[0].startswith(f"probe failed: GetInfo on {path} failed: ")


async def test_a_hung_agent_fails_within_the_deadline(
    short_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = short_dir / "registry" / f"{DRIVER}-reg.sock"
    path.parent.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hung:
        hung.bind(str(path))
        hung.listen(4)  # connections queue up, nothing ever answers: a stuck event loop
        with anyio.fail_after(5):
            status, lines = await probe(capsys, *dirs(short_dir), "--timeout", "0.5")
    assert status == 1 and len(lines) == 1
    assert lines[0].startswith("probe failed: no answer within 0.5 s from ")


async def test_a_missing_dra_socket_fails_even_when_registration_answers(
    plugin: KubeletPlugin, short_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plugin.dra_server.path.unlink()  # e.g. the plugins hostPath was replaced under the pod
    status, lines = await probe(capsys, *dirs(short_dir))
    assert status == 1 and len(lines) == 1
    assert lines[0].startswith(
        f"probe failed: NodePrepareResources on {plugin.dra_server.path} failed: "
    )


async def test_another_driver_or_endpoint_behind_the_socket_fails(
    short_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    registration = short_dir / "registry" / f"{DRIVER}-reg.sock"
    impostor = KubeletPlugin(
        driver_name="other.example.com",
        dra_socket=short_dir / "plugins" / DRIVER / "dra.sock",
        registration_socket=registration,
        engine=FakeEngine(),
    )
    elsewhere = KubeletPlugin(
        driver_name=DRIVER,
        dra_socket=short_dir / "elsewhere" / "dra.sock",
        registration_socket=registration,
        engine=FakeEngine(),
    )
    outcomes = []
    for served in (impostor, elsewhere):
        async with anyio.create_task_group() as group:
            await group.start(served.run)
            outcomes.append(await probe(capsys, *dirs(short_dir)))
            group.cancel_scope.cancel()
    assert outcomes == [
        (1, [f"probe failed: GetInfo answered driver 'other.example.com', expected {DRIVER!r}"]),
        (
            1,
            [
                f"probe failed: GetInfo names the DRA socket {short_dir}/elsewhere/dra.sock, "
                f"expected {short_dir}/plugins/{DRIVER}/dra.sock: the probe and the agent do "
                "not share their settings (instance id, plugins directory)"
            ],
        ),
    ]
