"""The embedded API server and a kubernetes-asyncio client for the ComputeDomain tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.kube.client import create_api_client
from agent.sim.apiserver import EmbeddedApiServer


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def apiserver() -> AsyncIterator[EmbeddedApiServer]:
    server = EmbeddedApiServer(bookmark_interval=0.2)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def kubeconfig(apiserver: EmbeddedApiServer, tmp_path: Path) -> Path:
    return apiserver.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
async def api_client(kubeconfig: Path) -> AsyncIterator[Any]:
    client = await create_api_client(kubeconfig)
    try:
        yield client
    finally:
        await client.close()


def compute_domain(name: str = "cd", namespace: str = "default", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "numNodes": spec.get("num_nodes", 0),
            "channel": {
                "resourceClaimTemplate": {"name": f"{name}-channel"},
                "allocationMode": spec.get("mode", "Single"),
            },
        },
    }
