"""The standard OTEL_* variables decide trace export as the specification says."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter, SpanExportResult

from agent.telemetry.export import (
    DROPPED_METRIC,
    BoundedBatchSpanProcessor,
    DropCounter,
    OncePerInterval,
    bsp_settings,
)
from agent.telemetry.tracing import build_provider, build_resource, make_exporter
from agent.telemetry.tracing_env import plan_from_environ

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}


def test_nothing_configured_means_no_export() -> None:
    plan = plan_from_environ({})
    assert not plan.enabled and "no OTEL_TRACES_EXPORTER" in plan.reason


@pytest.mark.parametrize(
    ("environ", "exporters", "protocol"),
    [
        (ENDPOINT, ("otlp",), "http/protobuf"),  # the specification's default protocol
        (
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"},
            ("otlp",),
            "http/protobuf",
        ),
        ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ("otlp",), "grpc"),
        (
            {
                **ENDPOINT,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            },
            ("otlp",),
            "http/protobuf",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_TRACES_EXPORTER": "otlp"},
            ("otlp",),
            "grpc",
        ),
        ({"OTEL_TRACES_EXPORTER": "console"}, ("console",), "http/protobuf"),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ("otlp", "console"), "http/protobuf"),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, (), "http/protobuf"),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, (), "http/protobuf"),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "false"}, ("otlp",), "http/protobuf"),
    ],
)
def test_plan(environ: dict[str, str], exporters: tuple[str, ...], protocol: str) -> None:
    plan = plan_from_environ(environ)
    assert plan.exporters == exporters
    if plan.enabled:
        assert plan.protocol == protocol


def test_unsupported_protocol_and_exporter_are_warned_about() -> None:
    plan = plan_from_environ(
        {
            **ENDPOINT,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
            "OTEL_TRACES_EXPORTER": "otlp,zipkin",
        }
    )
    assert plan.exporters == ("otlp",) and plan.protocol == "http/protobuf"
    assert any("http/json" in w for w in plan.warnings)
    assert any("zipkin" in w for w in plan.warnings)


def test_exporter_classes_and_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    http = make_exporter("otlp", "http/protobuf")
    assert isinstance(http, HttpExporter)
    assert http._endpoint == "http://collector:4318/v1/traces"  # the spec's path rule
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://other:9999/custom")
    assert make_exporter("otlp", "http/protobuf")._endpoint == "http://other:9999/custom"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4317")
    grpc = make_exporter("otlp", "grpc")
    assert isinstance(grpc, GrpcExporter)
    assert grpc._endpoint == "collector:4317"
    assert isinstance(make_exporter("console", "grpc"), ConsoleSpanExporter)


def _sampled(provider: TracerProvider) -> bool:
    with provider.get_tracer("t").start_as_current_span("s") as span:
        return span.is_recording()


@pytest.mark.parametrize(
    ("environ", "recording"),
    [
        ({}, True),  # parentbased_always_on
        ({"OTEL_TRACES_SAMPLER": "always_off"}, False),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, False),
        ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1"}, True),
    ],
)
def test_sampler_from_environment(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], recording: bool
) -> None:
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    plan = plan_from_environ({"OTEL_TRACES_EXPORTER": "console"})
    provider, processors = build_provider(plan, environ={"OTEL_BSP_SCHEDULE_DELAY": "10"})
    try:
        assert _sampled(provider) is recording
    finally:
        for processor in processors:
            processor.shutdown(timeout_millis=100)


def test_sdk_disabled_records_nothing_even_if_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    provider = TracerProvider()
    assert not _sampled(provider)


def test_resource_defaults_and_environment_precedence() -> None:
    resource = build_resource("node-a", environ={})
    attributes = dict(resource.attributes)
    assert attributes["service.name"] == "gpu-dra-agent"
    assert attributes["k8s.node.name"] == "node-a"
    assert attributes["host.name"] and attributes["service.version"]
    overridden = build_resource(
        "node-a",
        environ={
            "OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs,deployment.environment=lab",
            "OTEL_SERVICE_NAME": "from-service-name",
        },
    )
    assert overridden.attributes["service.name"] == "from-service-name"
    assert overridden.attributes["deployment.environment"] == "lab"
    assert (
        build_resource(None, environ={"OTEL_RESOURCE_ATTRIBUTES": "service.name=x"}).attributes[
            "service.name"
        ]
        == "x"
    )


def test_bsp_settings_follow_environment_and_reject_nonsense() -> None:
    settings = bsp_settings(
        {
            "OTEL_BSP_MAX_QUEUE_SIZE": "16",
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "64",
            "OTEL_BSP_SCHEDULE_DELAY": "x",
        }
    )
    assert settings["OTEL_BSP_MAX_QUEUE_SIZE"] == 16
    assert settings["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] == 16  # never above the queue
    assert settings["OTEL_BSP_SCHEDULE_DELAY"] == 5000


class StuckExporter(SpanExporter):
    """An exporter whose collector never answers (until released)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.exported: list[str] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.release.wait(10)
        self.exported += [s.name for s in spans]
        return SpanExportResult.SUCCESS


def test_full_queue_drops_counts_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    reader = InMemoryMetricReader()
    drops = DropCounter(meter=MeterProvider(metric_readers=[reader]).get_meter("t"))
    exporter = StuckExporter()
    processor = BoundedBatchSpanProcessor(
        exporter,
        environ={"OTEL_BSP_MAX_QUEUE_SIZE": "8", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4"},
        drops=drops,
    )
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("t")
    with caplog.at_level(logging.WARNING, logger="agent.telemetry.export"):
        for i in range(200):
            tracer.start_span(f"s{i}").end()
    assert processor.queued <= 8
    # at most one batch (4) is held by the stuck export, 8 wait in the queue: the rest dropped
    assert drops.total >= 200 - 8 - 4
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1
    assert not processor.force_flush(timeout_millis=100)  # returns although the export hangs
    exporter.release.set()
    assert processor.force_flush(timeout_millis=5000)
    assert 0 < len(exporter.exported) <= 12
    processor.shutdown(timeout_millis=1000)
    data = reader.get_metrics_data()
    assert data is not None
    points = [
        point.value
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == DROPPED_METRIC
        for point in metric.data.data_points
    ]
    assert sum(points) == drops.total


def test_drops_of_counters_sharing_a_meter_are_summed_per_reason() -> None:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    first, second = DropCounter(meter=meter), DropCounter(meter=meter)
    for _ in range(1000):
        first.add(1, "queue_full")
    second.add(3, "shutdown")
    second.add(2, "queue_full")
    data = reader.get_metrics_data()
    assert data is not None
    points = {
        point.attributes["reason"]: point.value
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == DROPPED_METRIC
        for point in metric.data.data_points
    }
    assert points == {"queue_full": 1002, "shutdown": 3}
    assert (first.total, second.total) == (1000, 5)


def test_tracer_is_kept_per_provider_and_leaves_the_warning_filters_alone() -> None:
    import warnings

    from agent.telemetry.tracing import tracer

    kept = tracer()
    filters = len(warnings.filters)
    assert all(tracer() is kept for _ in range(100))
    assert len(warnings.filters) == filters


def test_unsampled_spans_never_reach_the_queue() -> None:
    processor = BoundedBatchSpanProcessor(
        StuckExporter(), drops=DropCounter(meter=MeterProvider().get_meter("t"))
    )
    context = trace.SpanContext(1, 2, is_remote=True, trace_flags=trace.TraceFlags(0))
    provider = TracerProvider()
    provider.add_span_processor(processor)
    parent = trace.set_span_in_context(trace.NonRecordingSpan(context))
    provider.get_tracer("t").start_span("unsampled", context=parent).end()
    assert processor.queued == 0
    processor.shutdown(timeout_millis=10)


def test_once_per_interval_filter() -> None:
    now = [0.0]
    limit = OncePerInterval(60, clock=lambda: now[0])
    record = logging.LogRecord("x", logging.WARNING, "", 0, "export failed", None, None)
    assert limit.filter(record)
    assert not limit.filter(record) and not limit.filter(record)
    now[0] = 61
    again = logging.LogRecord("x", logging.WARNING, "", 0, "export failed", None, None)
    assert limit.filter(again) and "2 similar" in again.getMessage()
