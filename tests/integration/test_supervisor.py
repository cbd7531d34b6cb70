"""The supervisor in-process: a failing child brings the agent down cleanly."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from agent.config import load_config
from agent.kube.publisher import SlicePublisher
from agent.sim.apiserver import EmbeddedApiServer
from agent.supervisor import Supervisor

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_failing_child_stops_the_agent_and_removes_sockets(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed = anyio.Event()
    sockets_when_failing: list[str] = []

    async def broken_run(self: SlicePublisher) -> None:
        await anyio.sleep(0.3)  # fail after the sockets are up
        sockets_when_failing.extend(sorted(p.name for p in short_dir.rglob("*.sock")))  # noqa: ASYNC240
        failed.set()
        raise RuntimeError("publisher broke")

    monkeypatch.setattr(SlicePublisher, "run", broken_run)
    async with EmbeddedApiServer() as server:
        kubeconfig = server.write_kubeconfig(short_dir / "kubeconfig")
        config = load_config(
            {
                "node_name": "node-a",
                "kubeconfig": str(kubeconfig),
                "simulate": "dgx-h100",
                "registrar_dir": str(short_dir / "registry"),
                "plugins_dir": str(short_dir / "plugins"),
                "cdi_root": str(short_dir / "cdi"),
            },
            {},
        )
        supervisor = Supervisor(config)
        with anyio.fail_after(20):
            status = await supervisor.run()
    assert failed.is_set()
    assert sockets_when_failing == ["dra.sock", "gpu.nvidia.com-reg.sock", "sim-control.sock"]
    assert status == 1
    assert isinstance(supervisor.failure, RuntimeError)
    assert not config.dra_socket.exists()
    assert not config.registration_socket.exists()
    assert not (config.plugin_dir / "sim-control.sock").exists()
