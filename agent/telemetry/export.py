"""A batch span processor that never makes the agent wait for its collector.

The SDK's ``BatchSpanProcessor`` already keeps spans in a bounded queue, but three things it
does are wrong for a node agent: its ``force_flush`` ignores its timeout (a collector that
accepts connections and never answers holds the caller for the exporter's whole retry
schedule, which would stall the agent's shutdown); a full queue logs a warning for every
dropped span; and the drops are counted only in the SDK's own opt-in metrics. This processor
keeps the SDK's semantics otherwise (``OTEL_BSP_*`` variables, batches of at most
``max_export_batch_size``, one export thread) and adds: a drop counter in the agent's meter
(``gpu_dra_trace_spans_dropped``), one warning a minute at most while spans are being dropped,
and flush/shutdown that return when their timeout is spent, whatever the exporter does.

Memory is bounded by the queue (``OTEL_BSP_MAX_QUEUE_SIZE`` finished spans) plus the batch
the export thread holds. ``on_end`` runs in the thread that ended the span (the event loop):
it appends to a deque and, when a batch is ready, sets an event, nothing else.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

from opentelemetry import context as otel_context
from opentelemetry import metrics
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

DROPPED_METRIC = "gpu_dra_trace_spans_dropped"
WARN_INTERVAL_S = 60.0

#: OTEL_BSP_* defaults of the OpenTelemetry specification (milliseconds, span counts).
_BSP_DEFAULTS = {
    "OTEL_BSP_SCHEDULE_DELAY": 5000,
    "OTEL_BSP_EXPORT_TIMEOUT": 30000,
    "OTEL_BSP_MAX_QUEUE_SIZE": 2048,
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": 512,
}


def bsp_settings(environ: Mapping[str, str] = os.environ) -> dict[str, int]:
    """The ``OTEL_BSP_*`` settings; an invalid value is logged and the default used."""
    settings: dict[str, int] = {}
    for name, default in _BSP_DEFAULTS.items():
        raw = environ.get(name, "").strip()
        try:
            value = int(raw) if raw else default
            if value <= 0 and name != "OTEL_BSP_SCHEDULE_DELAY":
                raise ValueError(raw)
        except ValueError:
            log.warning("ignoring %s=%r: not a positive integer; using %d", name, raw, default)
            value = default
        settings[name] = value
    batch = settings["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"]
    settings["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] = min(batch, settings["OTEL_BSP_MAX_QUEUE_SIZE"])
    return settings


class DropCounter:
    """Counts dropped spans; warns at most once per ``interval``.

    A dead collector drops nearly every span, so the count is a plain integer per reason,
    read by the meter at collection time (an observable counter), not a measurement per
    dropped span: dropping stays a few hundred nanoseconds on the kubelet's call path.
    """

    def __init__(
        self,
        interval: float = WARN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        meter: metrics.Meter | None = None,
    ) -> None:
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._last_warning: float | None = None
        self._since_warning = 0
        self.total = 0
        self.by_reason: dict[str, int] = {}
        _count_in(meter or metrics.get_meter("gpu-dra-agent"), self)

    def add(self, count: int, reason: str) -> None:
        with self._lock:
            self.total += count
            self.by_reason[reason] = self.by_reason.get(reason, 0) + count
            self._since_warning += count
            now = self._clock()
            if self._last_warning is not None and now - self._last_warning < self._interval:
                return
            self._last_warning, dropped = now, self._since_warning
            self._since_warning = 0
        log.warning(
            "dropped %d trace span(s): the span export queue is full (is the collector "
            "reachable?); counted in %s",
            dropped,
            DROPPED_METRIC,
            extra={"reason": reason, "dropped_total": self.total},
        )


#: The drop counters reported by each meter's instrument: a meter keeps the first callback of
#: an instrument name, so one callback per meter sums every counter made on it.
_counted: dict[int, tuple[metrics.Meter, list[DropCounter]]] = {}
_counted_lock = threading.Lock()


def _count_in(meter: metrics.Meter, counter: DropCounter) -> None:
    with _counted_lock:
        kept = _counted.get(id(meter))
        if kept is None:
            counters: list[DropCounter] = []
            kept = _counted[id(meter)] = (meter, counters)

            def observe(_options: metrics.CallbackOptions) -> list[metrics.Observation]:
                totals: dict[str, int] = {"queue_full": 0}  # exported at 0 from the start
                for each in list(counters):
                    for reason, count in list(each.by_reason.items()):
                        totals[reason] = totals.get(reason, 0) + count
                return [metrics.Observation(n, {"reason": r}) for r, n in totals.items()]

            meter.create_observable_counter(
                DROPPED_METRIC,
                callbacks=[observe],
                description="Finished spans dropped because the export queue was full",
            )
        kept[1].append(counter)


#: The exporters' own loggers: they log every failed attempt, which a dead collector turns
#: into a line every few seconds.
EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
)


class OncePerInterval(logging.Filter):
    """Lets one record through per ``interval`` seconds; the next one says how many were held."""

    def __init__(
        self, interval: float = WARN_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._last < self._interval:
                self._held += 1
                return False
            self._last, held, self._held = now, self._held, 0
        if held:
            record.msg = f"{record.msg} ({held} similar message(s) in the last minute not shown)"
        return True


def quiet_exporter_logs(interval: float = WARN_INTERVAL_S) -> None:
    """Rate-limit the exporters' loggers (idempotent)."""
    for name in EXPORTER_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OncePerInterval) for f in logger.filters):
            logger.addFilter(OncePerInterval(interval))


class BoundedBatchSpanProcessor(SpanProcessor):
    """Batches sampled spans to ``exporter`` from one thread; see the module docstring."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        environ: Mapping[str, str] = os.environ,
        drops: DropCounter | None = None,
    ) -> None:
        settings = bsp_settings(environ)
        self._exporter = exporter
        quiet_exporter_logs()
        self._delay = settings["OTEL_BSP_SCHEDULE_DELAY"] / 1000
        self.export_timeout_ms = settings["OTEL_BSP_EXPORT_TIMEOUT"]
        self.max_queue_size = settings["OTEL_BSP_MAX_QUEUE_SIZE"]
        self._batch_size = settings["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"]
        self.drops = drops or DropCounter()
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._exporting = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._work, name="gpu-dra-span-export", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return
        if self._stopped:
            self.drops.add(1, "shutdown")
            return
        if len(self._queue) >= self.max_queue_size:
            self.drops.add(1, "queue_full")
            return
        self._queue.append(span)
        if len(self._queue) >= self._batch_size:
            self._wake.set()

    def _work(self) -> None:
        while not self._stopped:
            self._wake.wait(self._delay)
            self._wake.clear()
            self._drain()

    def _drain(self) -> None:
        """Export everything queued now, batch by batch (in the export thread)."""
        while self._queue and not self._stopped:
            batch: list[ReadableSpan] = []
            while self._queue and len(batch) < self._batch_size:
                batch.append(self._queue.popleft())
            with self._idle:
                self._exporting += 1
            # The exporter's own HTTP/gRPC calls must not be traced (or they would feed
            # this queue): the SDK's suppression key, the same one its processor sets.
            token = otel_context.attach(
                otel_context.set_value(otel_context._SUPPRESS_INSTRUMENTATION_KEY, True)
            )
            try:
                self._exporter.export(batch)
            except Exception:  # an exporter bug must not end the thread
                log.debug("span export failed", exc_info=True)
            finally:
                otel_context.detach(token)
                with self._idle:
                    self._exporting -= 1
                    self._idle.notify_all()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Ask the thread to export what is queued; True if done within the timeout."""
        deadline = time.monotonic() + timeout_millis / 1000
        self._wake.set()
        with self._idle:
            while self._queue or self._exporting:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._wake.set()
                self._idle.wait(min(remaining, 0.05))
        return True

    def shutdown(self, timeout_millis: int | None = None) -> None:
        """Flush within ``timeout_millis`` (default ``OTEL_BSP_EXPORT_TIMEOUT``), then stop.

        Spans still queued after that are counted as dropped."""
        if self._stopped:
            return
        budget = self.export_timeout_ms if timeout_millis is None else timeout_millis
        self.force_flush(int(budget))
        self._stopped = True
        self._wake.set()
        left = len(self._queue)
        self._queue.clear()
        if left:
            self.drops.add(left, "shutdown")
        try:
            self._exporter.shutdown()
        except Exception:
            log.debug("span exporter shutdown failed", exc_info=True)
