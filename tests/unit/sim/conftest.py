"""Fixtures for the embedded API server tests: a server on port 0 and clients pointed at it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import config

from agent.sim.apiserver import EmbeddedApiServer


@pytest.fixture
async def k8s(kubeconfig: Path) -> AsyncIterator[Any]:
    """A kubernetes-asyncio ``ApiClient`` built the way the agent builds it: from a kubeconfig."""
    client = await config.new_client_from_config(config_file=str(kubeconfig))
    async with client:
        yield client


@pytest.fixture
async def http(apiserver: EmbeddedApiServer) -> AsyncIterator[aiohttp.ClientSession]:
    """A raw HTTP client, independent of kubernetes-asyncio, rooted at the server URL."""
    async with aiohttp.ClientSession(base_url=apiserver.url) as session:
        yield session


def slice_body(
    node: str = "node1", driver: str = "gpu.nvidia.com", name: str | None = None, **labels: str
) -> dict[str, Any]:
    """A minimal valid ResourceSlice manifest."""
    metadata: dict[str, Any] = {"name": name} if name else {"generateName": f"{node}-{driver}-"}
    if labels:
        metadata["labels"] = labels
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", "attributes": {"productName": {"string": "H100"}}}],
        },
    }
