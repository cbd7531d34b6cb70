"""Shared pytest configuration: async tests run on asyncio through the anyio plugin; the
``spans`` fixture collects the spans the code under test ends in this process; ``apiserver``
(the embedded API server on port 0), ``kubeconfig`` for it and ``api_client`` (a
kubernetes-asyncio client built from it the way the agent builds one). A folder that needs a
different server (tests/unit/kube: one with a Node in it) overrides ``apiserver``; the other
two fixtures then use that one.

``make test`` runs the suite on parallel workers (pytest-xdist): every test makes its own
directories (``tmp_path`` or ``mkdtemp``) and servers on port 0, so workers never share one.
Tests marked ``slow`` are collected first, so that the workers start on them and do not end
the run waiting for one long test that came last."""

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agent.kube.client import create_api_client
from agent.sim.apiserver import EmbeddedApiServer
from agent.telemetry.tracing import configure_tracing


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``slow`` tests first (a stable sort: otherwise the order of collection)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The spans ended during the test. OpenTelemetry allows one tracer provider per process:
    the first use configures it, each test adds (and shuts down) an exporter of its own."""
    configure_tracing(exporter=InMemorySpanExporter())
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


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
