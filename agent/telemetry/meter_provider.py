"""The process's OpenTelemetry meter provider: one pull reader, an optional OTLP push, the endpoint.

The instruments (:mod:`agent.telemetry.metrics`, and the span processor's drop counter) are
created through the global API at import time and record nothing until a provider exists, so
the supervisor installs it first thing (:func:`configure_metrics`). The provider always has one
pull reader, an ``InMemoryMetricReader``: the Prometheus endpoint collects from it on each
scrape, and tests read values from it (:func:`metrics_data`), so the order in which tests and
an in-process agent install things does not matter. A provider cannot gain readers later,
which is why the endpoint (:func:`serve_metrics`) is separate and may start after it. The
agent binds the endpoint's address first thing and lets it answer (:func:`open_metrics`) once
its series exist: a scrape never sees part of them.

Push over OTLP follows the standard variables: ``OTEL_METRICS_EXPORTER`` (``otlp``; default
``none``, as Prometheus scrapes), ``OTEL_EXPORTER_OTLP_METRICS_PROTOCOL`` or
``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc`` or ``http/protobuf``), and the endpoint, headers,
timeout and ``OTEL_METRIC_EXPORT_INTERVAL`` that the SDK's exporter and periodic reader read by
themselves. ``OTEL_METRICS_EXEMPLAR_FILTER`` (default ``trace_based``) decides which
measurements may become exemplars: those taken inside a sampled span.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # prometheus_client is imported only when the endpoint is served
    from agent.telemetry.prometheus import MetricsEndpoint

log = logging.getLogger(__name__)

GRPC = "grpc"
HTTP_PROTOBUF = "http/protobuf"

_lock = threading.Lock()
_provider: Any = None
_reader: Any = None
_endpoint: MetricsEndpoint | None = None


@dataclass(frozen=True)
class MetricsPushPlan:
    """Whether to push metrics over OTLP and how; ``warnings`` go to the start-up log."""

    protocol: str | None = None  # None: no push
    warnings: tuple[str, ...] = field(default=())


def push_plan(environ: Mapping[str, str] = os.environ) -> MetricsPushPlan:
    """Read ``OTEL_METRICS_EXPORTER`` and the OTLP protocol variables (no side effects)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return MetricsPushPlan()
    names = [n.strip() for n in environ.get("OTEL_METRICS_EXPORTER", "").lower().split(",")]
    names = [n for n in names if n]
    warnings = [
        f"OTEL_METRICS_EXPORTER: exporter {n!r} is not supported (otlp or none); ignored"
        for n in names
        if n not in ("otlp", "none", "prometheus")
    ]
    if "otlp" not in names or "none" in names:
        return MetricsPushPlan(None, tuple(warnings))
    protocol = HTTP_PROTOBUF
    for variable in ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        raw = environ.get(variable, "").strip().lower()
        if raw:
            if raw in (GRPC, HTTP_PROTOBUF):
                protocol = raw
            else:
                warnings.append(f"{variable}={raw!r} is not supported; using {HTTP_PROTOBUF}")
            break
    return MetricsPushPlan(protocol, tuple(warnings))


def _otlp_exporter(protocol: str) -> Any:
    if protocol == GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # type: ignore[assignment]
            OTLPMetricExporter,
        )
    return OTLPMetricExporter()


def configure_metrics(
    *, node_name: str | None = None, environ: Mapping[str, str] = os.environ
) -> bool:
    """Install the SDK meter provider (first call in a process only); True if installed now.

    Never raises: without metrics the agent still works, so a failure is logged.
    """
    global _provider, _reader
    with _lock:
        if _provider is not None:
            return False
        try:
            from opentelemetry import metrics
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import (
                InMemoryMetricReader,
                PeriodicExportingMetricReader,
            )
            from opentelemetry.sdk.resources import Resource

            attributes = {"service.name": environ.get("OTEL_SERVICE_NAME") or "gpu-dra-agent"}
            if node_name:
                attributes["k8s.node.name"] = node_name
            reader = InMemoryMetricReader()
            readers: list[Any] = [reader]
            plan = push_plan(environ)
            for warning in plan.warnings:
                log.warning("%s", warning)
            if plan.protocol is not None:
                readers.append(PeriodicExportingMetricReader(_otlp_exporter(plan.protocol)))
                log.info("pushing metrics over OTLP", extra={"protocol": plan.protocol})
            provider = MeterProvider(metric_readers=readers, resource=Resource.create(attributes))
            metrics.set_meter_provider(provider)
        except Exception:
            log.exception("metrics are off: the meter provider could not be installed")
            return False
        _provider, _reader = provider, reader
        return True


def metrics_data() -> Any:
    """Everything recorded so far (cumulative), or None before :func:`configure_metrics`."""
    return None if _reader is None else _reader.get_metrics_data()


def serve_metrics(host: str, port: int, *, listen: bool = True) -> MetricsEndpoint:
    """Start the Prometheus endpoint on ``host:port`` (port 0: any free one); with ``listen``
    false, bind it only: it answers from :func:`open_metrics` on.

    Raises ``OSError`` when the address cannot be bound: an operator asked for the endpoint,
    so not getting it is a start-up error rather than a silent gap in the graphs.
    """
    global _endpoint
    from agent.telemetry.prometheus import MetricsEndpoint, OpenTelemetryCollector

    configure_metrics()
    with _lock:
        if _endpoint is not None:
            _endpoint.close()
        _endpoint = MetricsEndpoint(
            host, port, [OpenTelemetryCollector(metrics_data)], listen=listen
        )
        return _endpoint


def open_metrics() -> MetricsEndpoint | None:
    """Let the endpoint bound by :func:`serve_metrics` answer (the supervisor calls it once
    the series of every enabled feature exist); the endpoint, or None if there is none.
    Raises ``OSError`` if its address cannot be listened on."""
    with _lock:
        endpoint = _endpoint
    if endpoint is not None:
        endpoint.open()
    return endpoint


def shutdown_metrics() -> None:
    """Stop the endpoint and push what is pending (agent shutdown); never raises."""
    global _endpoint
    with _lock:
        endpoint, _endpoint = _endpoint, None
        provider = _provider
    try:
        if endpoint is not None:
            endpoint.close()
        if provider is not None:
            provider.force_flush(timeout_millis=5000)
    except Exception:
        log.warning("stopping metrics failed", exc_info=True)
