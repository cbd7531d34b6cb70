"""The Prometheus endpoint: names as the OpenTelemetry exporter gives them, both exposition
formats, exemplars carrying trace ids, process metrics; and the OTLP push settings."""

from __future__ import annotations

import re
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.exporter.prometheus import _CustomCollector
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from agent.telemetry import metrics as m
from agent.telemetry.meter_provider import metrics_data, open_metrics, push_plan, serve_metrics
from agent.telemetry.prometheus import MetricsEndpoint, OpenTelemetryCollector
from tests.support.metrics import reading

TRACE_ID = 0x5B8AA5A2D2C872E8321CF37308D69DF2
SPAN_ID = 0x051581BF3CB55C13
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def sampled_context(trace_id: int = TRACE_ID) -> object:
    span = NonRecordingSpan(SpanContext(trace_id, SPAN_ID, True, TraceFlags(TraceFlags.SAMPLED)))
    return trace.set_span_in_context(span)


def record_everything() -> None:
    """One measurement on every instrument of the catalog (and the span processor's)."""
    reading()
    m.add(m.RPC_REQUESTS, 1, driver="d", method="NodePrepareResources", code="OK")
    m.observe(m.RPC_DURATION, 0.004, sampled_context(), driver="d", method="NodePrepareResources")
    m.add(m.CLAIM_ERRORS, 1, driver="d", operation="prepare", reason="not_allocated")
    m.add(m.CLAIMS_PREPARED, 1, driver="d")
    m.add(m.CLAIMS_UNPREPARED, 1, driver="d")
    m.add(m.DEVICES_PREPARED, 1, driver="d", type="gpu")
    m.set_gauge(m.PREPARED_CLAIMS, 2, driver="d")
    m.device_health("d", [("gpu-0", "Unhealthy")])
    m.add(m.HEALTH_EVENTS, 1, kind="xid", xid="79")
    m.add(m.SLICE_WRITES, 1, driver="d", verb="create")
    m.add(m.SLICE_PUBLISH_ERRORS, 1, driver="d", reason="500")
    m.add(m.SLICE_WATCH_RESTARTS, 1, reason="ended")
    m.observe(m.NVML_CALL_DURATION, 0.0002, call="nvmlDeviceGetCount_v2")
    m.observe(m.CHECKPOINT_WRITE_DURATION, 0.003)
    m.add(m.MIG_RECONFIGURATIONS, 1, operation="create", outcome="success")
    m.observe(m.MIG_RECONFIGURE_DURATION, 0.2, operation="create")
    m.add(m.SHARING_CHANGES, 1, strategy="MPS", operation="apply", outcome="success")
    m.set_gauge(m.MPS_DAEMONS, 1)
    m.add(m.MPS_DAEMON_RESTARTS, 1, outcome="success")
    from agent.telemetry.export import DropCounter

    DropCounter().add(1, "queue_full")


@pytest.fixture
def endpoint() -> Iterator[MetricsEndpoint]:
    record_everything()
    served = serve_metrics("127.0.0.1", 0)
    yield served
    served.close()


def scrape(url: str, accept: str | None = None) -> tuple[str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


def test_every_documented_name_is_served_in_the_text_format(endpoint: MetricsEndpoint) -> None:
    content_type, text = scrape(endpoint.url)
    assert content_type.startswith("text/plain; version=0.0.4")
    names = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    missing = set(m.PROMETHEUS_NAMES) - names
    assert missing == set()
    assert set(m.PROCESS_NAMES) <= names
    assert 'gpu_dra_rpc_requests_total{code="OK",driver="d",method="NodePrepareResources"}' in text
    assert 'gpu_dra_device_health{device="gpu-0",driver="d",state="Unhealthy"} 1.0' in text
    assert 'gpu_dra_device_health{device="gpu-0",driver="d",state="Healthy"} 0.0' in text
    assert "otel_scope_name" not in text
    # the histogram has exactly the buckets
    les = re.findall(r'gpu_dra_rpc_duration_seconds_bucket\{driver="d",le="([^"]+)"', text)
    assert [float(le) for le in les] == [*m.RPC_BUCKETS, float("inf")]


def test_openmetrics_carries_the_trace_id_as_exemplar(endpoint: MetricsEndpoint) -> None:
    content_type, text = scrape(endpoint.url, OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # This test's own series only: other tests in the same worker record RPC durations
    # (under real drivers' names, with their own traces) into the same process-wide provider.
    buckets = [
        s
        for s in families["gpu_dra_rpc_duration_seconds"].samples
        if s.name.endswith("_bucket")
        and s.labels.get("driver") == "d"
        and s.labels.get("method") == "NodePrepareResources"
    ]
    with_exemplar = [s for s in buckets if s.exemplar is not None]
    assert with_exemplar, text
    exemplar = with_exemplar[0].exemplar
    assert exemplar.labels == {
        "trace_id": format(TRACE_ID, "032x"),
        "span_id": format(SPAN_ID, "016x"),
    }
    assert with_exemplar[0].labels["le"] == "0.005"  # the bucket 0.004 fell into
    # the SDK hands an exemplar out once; the next scrape still shows it
    _, again = scrape(endpoint.url, OPENMETRICS)
    assert format(TRACE_ID, "032x") in again
    # without a sampled span there is no exemplar
    assert "trace_id" not in scrape(endpoint.url)[1]


def test_names_are_the_ones_the_opentelemetry_exporter_gives() -> None:
    """Our collector translates like opentelemetry-exporter-prometheus (plus exemplars)."""
    record_everything()
    data = metrics_data()
    theirs = _CustomCollector(disable_target_info=True, scope_info_enabled=False)
    theirs.add_metrics_data(data)
    registry_theirs, registry_ours = CollectorRegistry(), CollectorRegistry()
    registry_theirs.register(theirs)
    registry_ours.register(OpenTelemetryCollector(lambda: data))

    def samples(registry: CollectorRegistry) -> set[str]:
        text = generate_latest(registry).decode()
        return {line.split(" ")[0] for line in text.splitlines() if not line.startswith("#")}

    ours = samples(registry_ours)
    assert ours == samples(registry_theirs)
    assert any(s.startswith("gpu_dra_checkpoint_write_duration_seconds_bucket") for s in ours)


def test_telemetry_failures_stay_inside() -> None:
    def broken() -> object:
        raise RuntimeError("collector bug")

    assert list(OpenTelemetryCollector(broken).collect()) == []
    m.add(m.RPC_REQUESTS, 1, driver=object())  # type: ignore[arg-type]  # never raises


def test_a_bound_endpoint_refuses_scrapes_until_it_is_opened() -> None:
    """Bound first (the address is the agent's), answering from ``open_metrics`` on: before,
    a scrape fails to connect instead of getting what is recorded so far."""
    served = serve_metrics("127.0.0.1", 0, listen=False)
    try:
        with pytest.raises(urllib.error.URLError) as refused:
            scrape(served.url)
        assert isinstance(refused.value.reason, ConnectionRefusedError)
        assert open_metrics() is served
        assert scrape(served.url)[0].startswith("text/plain")
        served.open()  # again: nothing changes
        assert scrape(served.url)[0].startswith("text/plain")
    finally:
        served.close()


def test_an_address_in_use_fails_when_bound_and_an_unopened_endpoint_closes() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            MetricsEndpoint("127.0.0.1", taken.getsockname()[1], [], listen=False)
    served = MetricsEndpoint("127.0.0.1", 0, [], listen=False)
    served.close()  # returns: no server loop to wait for
    served.open()  # closed: stays closed
    with pytest.raises(urllib.error.URLError):
        scrape(served.url)


@pytest.mark.parametrize(
    ("environ", "protocol"),
    [
        ({}, None),
        ({"OTEL_METRICS_EXPORTER": "none"}, None),
        ({"OTEL_METRICS_EXPORTER": "otlp"}, "http/protobuf"),
        ({"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "grpc"),
        (
            {
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
            },
            "http/protobuf",
        ),
        ({"OTEL_METRICS_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, None),
    ],
)
def test_push_follows_the_standard_variables(environ: dict[str, str], protocol: str | None) -> None:
    assert push_plan(environ).protocol == protocol


def test_unsupported_push_settings_are_warned_about() -> None:
    plan = push_plan({"OTEL_METRICS_EXPORTER": "otlp,zipkin", "OTEL_EXPORTER_OTLP_PROTOCOL": "x"})
    assert plan.protocol == "http/protobuf"
    assert len(plan.warnings) == 2
