"""OpenTelemetry tracing for the agent.

Spans are always created through the global tracer provider. When the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) variable is set,
:func:`configure_tracing` installs an SDK provider that exports them over OTLP/HTTP in
batches; otherwise the API's no-op provider stays and tracing costs almost nothing.

Incoming gRPC calls from the kubelet may carry a W3C ``traceparent`` header; :func:`context_from_metadata`
turns it into the parent context so that our spans join the kubelet's trace.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

TRACER_NAME = "gpu-dra-agent"
_PROPAGATOR = TraceContextTextMapPropagator()
_configured_provider: Any = None


def tracer() -> trace.Tracer:
    """The agent's tracer (no-op until a provider is configured)."""
    return trace.get_tracer(TRACER_NAME)


def otlp_endpoint_configured(environ: Mapping[str, str] = os.environ) -> bool:
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def configure_tracing(
    *, service_name: str = "gpu-dra-agent", node_name: str | None = None, exporter: Any = None
) -> bool:
    """Install an SDK tracer provider when an OTLP endpoint (or an exporter) is given.

    ``exporter`` lets tests pass an in-memory exporter (it is then used with a simple,
    synchronous span processor). Only the first call in a process takes effect.
    Returns whether spans are being recorded.
    """
    global _configured_provider
    if _configured_provider is not None:
        return True  # OpenTelemetry allows one global provider per process
    if exporter is None and not otlp_endpoint_configured():
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    attributes: dict[str, str] = {"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)}
    if node_name:
        attributes["k8s.node.name"] = node_name
    provider = TracerProvider(resource=Resource.create(attributes))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        log.info("exporting traces over OTLP/HTTP", extra={"service": attributes["service.name"]})
    trace.set_tracer_provider(provider)
    _configured_provider = provider
    return True


def shutdown_tracing() -> None:
    """Flush pending spans (called on agent shutdown)."""
    if _configured_provider is not None:
        _configured_provider.force_flush()


def context_from_metadata(
    metadata: Iterable[tuple[str, str | bytes]] | Mapping[str, Any] | None,
) -> otel_context.Context:
    """The trace context carried by incoming gRPC metadata (``traceparent``/``tracestate``)."""
    carrier: dict[str, str] = {}
    if metadata is not None:
        items = metadata.items() if isinstance(metadata, Mapping) else metadata
        for key, value in items:
            if key.lower() in ("traceparent", "tracestate"):
                carrier[key.lower()] = value.decode() if isinstance(value, bytes) else str(value)
    return _PROPAGATOR.extract(carrier)


def inject_metadata(metadata: dict[str, str] | None = None) -> dict[str, str]:
    """Add the current trace context to outgoing metadata (used by the kubelet emulator)."""
    carrier: dict[str, str] = dict(metadata or {})
    _PROPAGATOR.inject(carrier)
    return carrier
