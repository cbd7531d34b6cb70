"""Shared pytest configuration: async tests run on asyncio through the anyio plugin; the
``spans`` fixture collects the spans the code under test ends in this process."""

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agent.telemetry.tracing import configure_tracing


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
