"""Fixtures for the slice publisher tests: an embedded API server with a Node, a client built
the way the agent builds it, and the devices of the shipped simulated host profiles."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from agent.dra import DraDevice, build_devices
from agent.hardware.discovery import discover_host
from agent.sim.apiserver import EmbeddedApiServer
from tests.unit.kube.helpers import NODE

PROFILES = ("dgx-h100", "dgx-a100", "big-mig-host")


@pytest.fixture(scope="session")
def profile_devices(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[DraDevice]]:
    """The devices the agent builds for each shipped profile, through simulated NVML."""
    out: dict[str, list[DraDevice]] = {}
    for name in PROFILES:
        root = tmp_path_factory.mktemp(f"host-{name}")
        out[name] = build_devices(anyio.run(discover_host, name, root))
    return out


@pytest.fixture
async def apiserver() -> AsyncIterator[EmbeddedApiServer]:
    server = EmbeddedApiServer(bookmark_interval=0.5)
    await server.start("127.0.0.1", 0)
    server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    try:
        yield server
    finally:
        await server.stop()
