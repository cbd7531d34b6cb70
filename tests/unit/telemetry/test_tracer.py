"""The agent's tracer: quiet while no provider is set, the SDK's once one is."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from agent.telemetry import tracing

PARENT = SpanContext(
    trace_id=0x0AF7651916CD43DD8448EB211C80319C,
    span_id=0xB7AD6B7169203331,
    is_remote=True,
    trace_flags=TraceFlags(TraceFlags.SAMPLED),
)


def test_tracer_is_quiet_until_a_provider_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_tracer_of", None)
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.ProxyTracerProvider())
    quiet = tracing.tracer()
    assert isinstance(quiet, tracing._QuietTracer)
    provider = TracerProvider()
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    recording = tracing.tracer()
    assert not isinstance(recording, tracing._QuietTracer)
    assert tracing.tracer() is recording  # kept for its provider
    with recording.start_as_current_span("real") as span:
        assert span.is_recording()


def test_quiet_spans_keep_the_callers_trace_context() -> None:
    """With a kubelet's ``traceparent`` and no provider, what a quiet span hands out and what
    is current inside it carry the caller's context, as the API's no-op tracer did."""
    quiet = tracing._QuietTracer()
    with quiet.start_as_current_span("alone", kind=SpanKind.CLIENT) as span:
        assert not span.get_span_context().is_valid
        assert not span.is_recording()
    with trace.use_span(trace.NonRecordingSpan(PARENT)):
        with quiet.start_as_current_span(
            "child", kind=SpanKind.CLIENT, attributes={"a": 1}, record_exception=False
        ) as span:
            span.set_attribute("ignored", "yes")
            assert span.get_span_context() == PARENT
            assert trace.get_current_span().get_span_context() == PARENT
        assert quiet.start_span("other").get_span_context() == PARENT


def test_a_quiet_span_with_an_explicit_context_makes_that_context_current() -> None:
    """The RPC's span starts from the kubelet's ``traceparent``: inside it, the kubelet's
    trace is current (what the latency's exemplar and the claims' spans see)."""
    quiet = tracing._QuietTracer()
    parent = trace.set_span_in_context(trace.NonRecordingSpan(PARENT))
    assert not trace.get_current_span().get_span_context().is_valid
    with quiet.start_as_current_span("rpc", context=parent, kind=SpanKind.SERVER) as span:
        assert span.get_span_context() == PARENT
        assert trace.get_current_span().get_span_context() == PARENT
    assert not trace.get_current_span().get_span_context().is_valid


def test_quiet_spans_let_exceptions_through() -> None:
    quiet = tracing._QuietTracer()
    with pytest.raises(KeyError), quiet.start_as_current_span("failing"):
        raise KeyError("x")
