"""OpenTelemetry tracing for the agent: the tracer, its set-up from ``OTEL_*``, trace context.

Spans are always created through the global tracer provider, so code that makes spans never
knows whether tracing is on. :func:`configure_tracing` installs an SDK provider only when the
standard variables ask for export (``tracing_env.py`` decides; the SDK itself reads sampler,
resource, endpoint, headers, timeout and TLS variables); otherwise the API's no-op provider
stays and a span costs a function call. Spans leave through :mod:`agent.telemetry.export`,
whose bounded queue keeps a slow or dead collector away from the kubelet's calls.

Incoming gRPC calls from the kubelet may carry a W3C ``traceparent``; :func:`context_from_metadata`
turns it into the parent context so that our spans join the kubelet's trace, and
:func:`inject_metadata` does the reverse for the kubelet emulator. Work that starts a trace of
its own (a slice publish, a health transition) links to what caused it with :func:`link_to`.

Set-up and shutdown never raise: telemetry problems are logged, the agent runs on.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from agent.telemetry.tracing_env import GRPC, TraceExportPlan, plan_from_environ

log = logging.getLogger(__name__)

TRACER_NAME = "gpu-dra-agent"
SERVICE_NAME = "gpu-dra-agent"
#: Longest the agent's shutdown waits for queued spans to leave.
SHUTDOWN_FLUSH_MS = 5000
_PROPAGATOR = TraceContextTextMapPropagator()
_configured_provider: Any = None
_processors: list[Any] = []
_tracer_of: tuple[trace.TracerProvider, trace.Tracer] | None = None
_causes: contextvars.ContextVar[tuple[trace.Link, ...]] = contextvars.ContextVar(
    "gpu_dra_trace_causes", default=()
)


def tracer() -> trace.Tracer:
    """The agent's tracer (no-op until a provider is configured).

    Kept per provider: the SDK's ``get_tracer`` builds two scope objects and edits the
    process's warning filters on every call, which cost a traced prepare more than its spans.
    While no provider is set, a :class:`_QuietTracer`.
    """
    global _tracer_of
    provider = trace.get_tracer_provider()
    kept = _tracer_of
    if kept is None or kept[0] is not provider:
        quiet = isinstance(provider, trace.ProxyTracerProvider)
        made = _QuietTracer() if quiet else provider.get_tracer(TRACER_NAME)
        kept = _tracer_of = (provider, made)
    return kept[1]


class _QuietTracer(trace.NoOpTracer):
    """The API's no-op tracer (tracing off), whose ``start_as_current_span`` without an
    explicit ``context`` does not make its span current: that span is the current one
    already (the no-op tracer hands out the current span, or one of the same context), so
    attaching it changed nothing, and the API's two nested generator context managers and
    the attach cost some 5 us a span, 0.5 ms of a request of 32 claims. With a ``context``
    (a kubelet's ``traceparent``: the RPC's span) the span is attached as the API does, so
    what runs inside sees the caller's trace (the latency's exemplar)."""

    def start_as_current_span(  # type: ignore[override]
        self, name: str, context: otel_context.Context | None = None, *args: Any, **kwargs: Any
    ) -> contextlib.AbstractContextManager[trace.Span]:
        if context is not None:
            return super().start_as_current_span(name, context, *args, **kwargs)
        return contextlib.nullcontext(self.start_span(name))


def in_span(span: trace.Span) -> contextlib.AbstractContextManager[Any]:
    """``trace.use_span(span, end_on_exit=False)``, or nothing when ``span`` carries no trace
    context (no provider and no caller's trace: the span was made from a context without
    one, so making it current changes nothing). Attach and detach cost a request of 32
    claims some 0.3 ms of the event loop, tracing off as by default."""
    if span.get_span_context().is_valid:
        return trace.use_span(span, end_on_exit=False)
    return contextlib.nullcontext()


@contextlib.contextmanager
def outcome_span(
    name: str,
    attributes: Mapping[str, str | int],
    outcome_attribute: str,
    ended: Callable[[str], None],
    failed: Callable[[BaseException], str] = lambda error: "error",
) -> Iterator[trace.Span]:
    """A span for one change to the node (a MIG reconfiguration, a sharing change): its
    outcome (``success``, or what ``failed`` calls the exception) is the attribute
    ``outcome_attribute`` and goes to ``ended`` (the change's metrics); an exception sets the
    span's status and goes on to the caller, which records it in its own error."""
    outcome = "error"
    with tracer().start_as_current_span(
        name, attributes=dict(attributes), record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            yield span
            outcome = "success"
        except BaseException as error:
            outcome = failed(error)
            span.set_status(trace.StatusCode.ERROR, str(error) or repr(error))
            raise
        finally:
            span.set_attribute(outcome_attribute, outcome)
            ended(outcome)


def agent_version() -> str:
    """The installed package's version (importlib.metadata is loaded only when asked)."""
    from importlib import metadata as importlib_metadata

    try:
        return importlib_metadata.version("gpu-dra-agent")
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


def build_resource(
    node_name: str | None,
    service_name: str = SERVICE_NAME,
    environ: Mapping[str, str] = os.environ,
) -> Any:
    """The resource: our defaults, overridden by ``OTEL_RESOURCE_ATTRIBUTES`` and then
    ``OTEL_SERVICE_NAME`` (the specification's precedence)."""
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    defaults: dict[str, str] = {
        "service.name": service_name,
        "service.version": agent_version(),
        "host.name": socket.gethostname(),
    }
    if node_name:
        defaults["k8s.node.name"] = node_name
    saved = {k: os.environ.get(k) for k in ("OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME")}
    # The detector reads os.environ; ``environ`` is os.environ except in unit tests.
    try:
        for key in saved:
            if key in environ:
                os.environ[key] = environ[key]
            else:
                os.environ.pop(key, None)
        from_environment = OTELResourceDetector().detect()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return Resource.create(defaults).merge(from_environment)


def make_exporter(name: str, protocol: str) -> Any:
    """The span exporter ``name`` (``otlp`` over ``protocol``, or ``console``)."""
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if protocol == GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter()


def build_provider(
    plan: TraceExportPlan,
    node_name: str | None = None,
    service_name: str = SERVICE_NAME,
    exporter: Any = None,
    environ: Mapping[str, str] = os.environ,
) -> tuple[Any, list[Any]]:
    """A tracer provider for ``plan`` (not installed) and its batch processors."""
    from opentelemetry.sdk.trace import TracerProvider

    # TracerProvider reads OTEL_TRACES_SAMPLER/_ARG and OTEL_SDK_DISABLED by itself.
    provider = TracerProvider(resource=build_resource(node_name, service_name, environ))
    processors: list[Any] = []
    if exporter is not None:
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return provider, processors
    from agent.telemetry.export import BoundedBatchSpanProcessor

    for name in plan.exporters:
        processor = BoundedBatchSpanProcessor(make_exporter(name, plan.protocol), environ=environ)
        processors.append(processor)
        provider.add_span_processor(processor)
    return provider, processors


def configure_tracing(
    *,
    service_name: str = SERVICE_NAME,
    node_name: str | None = None,
    exporter: Any = None,
    environ: Mapping[str, str] = os.environ,
) -> bool:
    """Install an SDK tracer provider when the environment asks for export (or ``exporter``
    is given: tests pass an in-memory one, used with a synchronous processor).

    Only the first effective call in a process counts (OpenTelemetry allows one global
    provider). Returns whether spans are being recorded; never raises.
    """
    global _configured_provider
    if _configured_provider is not None:
        return True
    plan = TraceExportPlan(("test",), reason="exporter given") if exporter else None
    try:
        plan = plan or plan_from_environ(environ)
        for warning in plan.warnings:
            log.warning("tracing: %s", warning)
        if not plan.enabled:
            log.debug("tracing off: %s", plan.reason)
            return False
        provider, processors = build_provider(plan, node_name, service_name, exporter, environ)
        _processors.extend(processors)
        if exporter is None:
            log.info(
                "exporting traces: %s",
                ", ".join(
                    f"otlp over {plan.protocol}" if n == "otlp" else n for n in plan.exporters
                ),
                extra={"because": plan.reason},
            )
        trace.set_tracer_provider(provider)
        _configured_provider = provider
        return True
    except Exception as error:  # the agent runs without traces
        log.warning("tracing could not be set up, continuing without it: %s", error)
        return False


def shutdown_tracing(timeout_ms: int | None = None) -> None:
    """Send what is queued, then stop exporting; never raises. Waits at most ``timeout_ms``
    per exporter, by default ``OTEL_BSP_EXPORT_TIMEOUT`` but no more than 5 s."""
    try:
        for processor in _processors:
            budget = min(processor.export_timeout_ms, SHUTDOWN_FLUSH_MS)
            processor.shutdown(timeout_millis=budget if timeout_ms is None else timeout_ms)
        if _configured_provider is not None and not _processors:
            _configured_provider.force_flush(timeout_ms or SHUTDOWN_FLUSH_MS)
    except Exception as error:
        log.warning("tracing shutdown failed: %s", error)


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


def current_link() -> trace.Link | None:
    """A link to the current span, to hand to work that will start a trace of its own."""
    context = trace.get_current_span().get_span_context()
    return trace.Link(context) if context.is_valid else None


def link_to(links: Iterable[trace.Link | None]) -> list[trace.Link]:
    """The valid links among ``links``, without duplicates (span links of a new root)."""
    seen: dict[tuple[int, int], trace.Link] = {}
    for link in links:
        if link is not None and link.context.is_valid:
            seen.setdefault((link.context.trace_id, link.context.span_id), link)
    return list(seen.values())


@contextlib.contextmanager
def caused_by(spans: Iterable[trace.Span]) -> Iterator[None]:
    """Within this block, :func:`current_causes` names ``spans`` (for work queued here that
    will run as a trace of its own, e.g. the slice publish a health transition asks for)."""
    links = tuple(trace.Link(s.get_span_context()) for s in spans)
    token = _causes.set(_causes.get() + links)
    try:
        yield
    finally:
        _causes.reset(token)


def current_causes() -> list[trace.Link]:
    """Links to what caused the work being queued now: :func:`caused_by` spans, and the
    current span (when there is a valid one)."""
    return link_to([*_causes.get(), current_link()])
