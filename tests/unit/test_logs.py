"""Log format: JSON off a terminal, text on one; trace and span ids inside a recording span."""

from __future__ import annotations

import io
import json
import logging

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from agent.logs import JsonFormatter, TextFormatter, configure_logging, resolve_format

TRACER = TracerProvider().get_tracer("test")


def record(message: str = "prepared", **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("agent.test", logging.INFO, __file__, 1, message, None, None)
    rec.__dict__.update(extra)
    return rec


def test_json_line_inside_a_span_carries_its_ids() -> None:
    with TRACER.start_as_current_span("claim.prepare") as span:
        line = JsonFormatter().format(record(claim="uid-1"))
        context = span.get_span_context()
    entry = json.loads(line)
    assert entry["trace_id"] == format(context.trace_id, "032x")
    assert entry["span_id"] == format(context.span_id, "016x")
    assert entry["message"] == "prepared" and entry["claim"] == "uid-1"


def test_no_ids_outside_a_span_or_in_a_span_that_does_not_record() -> None:
    assert "trace_id" not in json.loads(JsonFormatter().format(record()))
    remote = trace.SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=trace.TraceFlags(1))
    with trace.use_span(trace.NonRecordingSpan(remote)):
        entry = json.loads(JsonFormatter().format(record()))
    assert "trace_id" not in entry and "span_id" not in entry


def test_text_line_inside_a_span() -> None:
    with TRACER.start_as_current_span("x") as span:
        line = TextFormatter().format(record())
    assert f"trace_id={format(span.get_span_context().trace_id, '032x')}" in line
    assert "trace_id" not in TextFormatter().format(record())


class Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    ("fmt", "tty", "chosen"),
    [
        ("auto", True, "text"),
        ("auto", False, "json"),
        ("text", False, "text"),
        ("json", True, "json"),
    ],
)
def test_format_follows_the_stream_unless_chosen(fmt: str, tty: bool, chosen: str) -> None:
    assert resolve_format(fmt, Stream(tty)) == chosen


def test_configure_logging_writes_json_to_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = Stream(False)
    monkeypatch.setattr("sys.stderr", stream)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("info")
        logging.getLogger("agent.test").info("hello %s", "there")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert json.loads(stream.getvalue().splitlines()[-1])["message"] == "hello there"
