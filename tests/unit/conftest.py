"""Fixtures shared by the unit tests: the embedded API server on port 0, a kubeconfig for it
and a kubernetes-asyncio client built from it the way the agent builds one. A folder that
needs a different server (tests/unit/kube: one with a Node in it) overrides ``apiserver``; the
other two fixtures then use that one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.kube.client import create_api_client
from agent.sim.apiserver import EmbeddedApiServer


@pytest.fixture
async def apiserver() -> AsyncIterator[EmbeddedApiServer]:
    server = EmbeddedApiServer(bookmark_interval=0.2)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def kubeconfig(apiserver: EmbeddedApiServer, tmp_path: Path) -> Path:
    return apiserver.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
async def api_client(kubeconfig: Path) -> AsyncIterator[Any]:
    client = await create_api_client(kubeconfig)
    try:
        yield client
    finally:
        await client.close()
