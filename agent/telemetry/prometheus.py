"""The Prometheus endpoint: OpenTelemetry metrics in the text format and OpenMetrics, exemplars included.

opentelemetry-exporter-prometheus (0.66b2) translates OpenTelemetry metrics for
prometheus_client but drops exemplars, and Prometheus stores exemplars only from OpenMetrics
scrapes. The latency histograms are where an operator wants to jump from a slow bucket to the
trace of that prepare, so this collector does the translation itself, following the same rules
as that exporter (name sanitised, the unit's Prometheus word appended, monotonic sums as
counters with ``_total``, other sums and gauges as gauges, histograms with cumulative buckets)
and attaching each bucket's exemplar (``trace_id``, ``span_id``) from the SDK's aligned
reservoir. It leaves out the exporter's ``otel_scope_*`` labels: every instrument comes from
one meter. prometheus_client serves it: the OpenMetrics format (with exemplars) when the
scraper asks for it in ``Accept``, the classic text format otherwise, and the process metrics
(``process_cpu_seconds_total``, ...) from its own process collector.
"""

from __future__ import annotations

import logging
import math
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Exemplar

from agent.telemetry.metrics import EmptyHistogram, empty_histograms

log = logging.getLogger(__name__)

#: OpenTelemetry (UCUM) units and the words Prometheus names end with; as the exporter maps them.
UNIT_WORDS = {
    "d": "days",
    "h": "hours",
    "min": "minutes",
    "s": "seconds",
    "ms": "milliseconds",
    "us": "microseconds",
    "ns": "nanoseconds",
    "By": "bytes",
    "KiBy": "kibibytes",
    "MiBy": "mebibytes",
    "GiBy": "gibibytes",
    "1": "",
    "%": "percent",
}
_INVALID_NAME = re.compile(r"[^a-zA-Z0-9:]+")
_INVALID_LABEL = re.compile(r"[^a-zA-Z0-9]+")
_ANNOTATION = re.compile(r"{.*}")


def metric_name(name: str) -> str:
    """An OpenTelemetry instrument name as a Prometheus metric name (before unit suffixes)."""
    if name and name[0].isdigit():
        name = "_" + name[1:]
    return _INVALID_NAME.sub("_", name)


def label_name(key: str) -> str:
    if key and key[0].isdigit():
        key = "_" + key[1:]
    return _INVALID_LABEL.sub("_", key)


def unit_word(unit: str) -> str:
    """The Prometheus unit suffix of an OpenTelemetry unit (``{request}`` annotations: none)."""
    unit = _ANNOTATION.sub("", unit)
    if unit in UNIT_WORDS:
        return UNIT_WORDS[unit]
    return _INVALID_NAME.sub("_", unit).strip("_")


def _label_value(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


class OpenTelemetryCollector:
    """A prometheus_client collector over an SDK metric reader's ``MetricsData``.

    ``collect_data`` is the reader's pull (``InMemoryMetricReader.get_metrics_data``); it runs
    in the scrape's thread, and the SDK makes that safe against concurrent recording.

    The SDK hands out each exemplar once (its reservoirs reset on every collection), so the
    latest exemplar of each bucket is kept here and shown on every scrape, as prometheus_client
    does for its own histograms: two Prometheus replicas scraping one agent both see them.
    """

    def __init__(self, collect_data: Callable[[], Any]) -> None:
        self._collect_data = collect_data
        self._lock = threading.Lock()
        self._exemplars: dict[tuple[str, tuple[str, ...], int], Exemplar] = {}

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # one scrape at a time updates the kept exemplars
            return iter(self._families())

    def _families(self) -> list[Metric]:
        try:
            data = self._collect_data()
        except Exception:  # a scrape gets what is there; the agent never notices
            log.warning("collecting metrics for Prometheus failed", exc_info=True)
            return []
        if data is None:
            return []
        families: dict[str, Metric] = {}
        for resource_metrics in data.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    try:
                        self._translate(metric, families)
                    except Exception:
                        log.warning("cannot translate metric %s", metric.name, exc_info=True)
        _add_empty_histograms(families, empty_histograms())
        return list(families.values())

    def _translate(self, metric: Any, families: dict[str, Metric]) -> None:
        from opentelemetry.sdk.metrics.export import AggregationTemporality, Gauge, Histogram, Sum

        name, unit = metric_name(metric.name), unit_word(metric.unit or "")
        description = metric.description or ""
        points: Sequence[Any] = metric.data.data_points
        keys = sorted({label_name(k) for p in points for k in (p.attributes or {})})

        def labels(point: Any) -> list[str]:
            named = {label_name(k): _label_value(v) for k, v in (point.attributes or {}).items()}
            return [named.get(k, "") for k in keys]

        data = metric.data
        family: Metric
        if isinstance(data, Sum) and data.is_monotonic:
            family = families.setdefault(
                f"{name}|counter",
                CounterMetricFamily(name, description, labels=keys, unit=unit),
            )
            for point in points:
                family.add_metric(labels(point), point.value)  # type: ignore[attr-defined]
        elif isinstance(data, Gauge) or (
            isinstance(data, Sum)
            and data.aggregation_temporality == AggregationTemporality.CUMULATIVE
        ):
            family = families.setdefault(
                f"{name}|gauge", GaugeMetricFamily(name, description, labels=keys, unit=unit)
            )
            for point in points:
                family.add_metric(labels(point), point.value)  # type: ignore[attr-defined]
        elif isinstance(data, Histogram):
            family = families.setdefault(
                f"{name}|histogram",
                HistogramMetricFamily(name, description, labels=keys, unit=unit),
            )
            for point in points:
                values = labels(point)
                kept = {
                    index: self._exemplars.get((name, tuple(values), index))
                    for index in range(len(point.bucket_counts))
                }
                buckets = histogram_buckets(point, kept)
                for index, bucket in enumerate(buckets):
                    if len(bucket) == 3:
                        self._exemplars[(name, tuple(values), index)] = bucket[2]
                family.add_metric(labels(point), buckets, point.sum)  # type: ignore[attr-defined]


def _add_empty_histograms(families: dict[str, Metric], empty: Sequence[EmptyHistogram]) -> None:
    """The declared histogram series that have no measurement yet, with empty buckets."""
    for histogram in empty:
        name, unit = metric_name(histogram.name), unit_word(histogram.unit)
        keys = [label_name(k) for k, _ in histogram.labels]
        family = families.get(f"{name}|histogram")
        if family is None:
            family = families[f"{name}|histogram"] = HistogramMetricFamily(
                name, histogram.description, labels=keys, unit=unit
            )
        present = {tuple(sorted(s.labels.items())) for s in family.samples}
        wanted = tuple(sorted((label_name(k), v) for k, v in histogram.labels))
        if any(set(wanted) <= set(labels) for labels in present):
            continue  # measured already
        bounds = [repr(float(b)) for b in histogram.buckets] + ["+Inf"]
        values = [dict(wanted).get(k, "") for k in family._labelnames]  # type: ignore[attr-defined]
        family.add_metric(values, [(le, 0) for le in bounds], 0.0)  # type: ignore[attr-defined]


def histogram_buckets(point: Any, kept: Mapping[int, Exemplar | None] | None = None) -> list[Any]:
    """Cumulative ``(le, count[, exemplar])`` buckets of an OpenTelemetry histogram point;
    each bucket carries the exemplar the SDK kept for a measurement that fell into it, else
    the one in ``kept`` (from an earlier collection)."""
    bounds: list[float] = [*point.explicit_bounds, math.inf]
    by_bucket: dict[int, Any] = {}
    for exemplar in point.exemplars or ():
        if exemplar.trace_id:
            index = next(i for i, bound in enumerate(bounds) if exemplar.value <= bound)
            by_bucket[index] = _exemplar(exemplar)
    buckets: list[Any] = []
    total = 0
    for index, (bound, count) in enumerate(zip(bounds, point.bucket_counts, strict=True)):
        total += count
        le = "+Inf" if math.isinf(bound) else repr(float(bound))
        exemplar = by_bucket.get(index) or (kept or {}).get(index)
        if exemplar is None:
            buckets.append((le, total))
        else:
            buckets.append((le, total, exemplar))
    return buckets


def _exemplar(exemplar: Any) -> Exemplar:
    labels = {"trace_id": format(exemplar.trace_id, "032x")}
    if exemplar.span_id:
        labels["span_id"] = format(exemplar.span_id, "016x")
    return Exemplar(labels, exemplar.value, exemplar.time_unix_nano / 1e9)


class _Server(ThreadingMixIn, WSGIServer):
    """prometheus_client's server: a thread per scrape, none waited for at close."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log: a scrape every few seconds is not news."""


class MetricsEndpoint:
    """The HTTP server of ``--metrics-address`` (prometheus_client's WSGI app, in a daemon
    thread), started in two steps so that no scrape sees part of the agent's series.

    Made, it has bound its address (one in use fails here, at the start); it accepts
    connections once :meth:`open` is called (``listen``: at once), which the supervisor does
    when the series of every enabled feature exist. Until then a scraper's connection is
    refused (the socket is bound, not listening): its scrape fails as before the process
    started, rather than answering without the series registered later in the start.
    """

    def __init__(
        self, host: str, port: int, collectors: Iterable[Any], *, listen: bool = True
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        for collector in collectors:
            self.registry.register(collector)
        # the address family of the host, as prometheus_client's start_http_server finds it
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        server_class = type("MetricsServer", (_Server,), {"address_family": family})
        self._server = server_class((address[0], port), _QuietHandler, bind_and_activate=False)
        try:
            self._server.server_bind()
        except BaseException:
            self._server.server_close()
            raise
        self._server.set_app(make_wsgi_app(self.registry))
        self._thread: threading.Thread | None = None
        self.host = host
        self.port = int(self._server.server_address[1])
        self._stopped = threading.Event()
        if listen:
            self.open()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def open(self) -> None:
        """Accept scrapes from now on (a second call does nothing). Raises ``OSError`` if the
        address cannot be listened on after all (another process bound it meanwhile)."""
        if self._thread is not None or self._stopped.is_set():
            return
        self._server.server_activate()
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-endpoint", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._thread is not None:  # shutdown() waits for serve_forever, which must run
            self._server.shutdown()
        self._server.server_close()
