"""Logging setup: human-readable text on a terminal, one JSON object per line for journald.

The format follows where stderr goes (``--log-format auto``, the default): a terminal gets text,
anything else (the systemd journal, a pod's log, a file) gets JSON lines, which log shippers
parse without a regular expression. Structured fields passed as
``logger.info("...", extra={"claim": uid})`` appear as keys of the JSON object (and as
``key=value`` in text mode), so operators can filter on them. A line logged inside a recording
OpenTelemetry span carries ``trace_id`` and ``span_id`` (lowercase hex, as the OpenTelemetry log
data model writes them), so a log line leads to its trace and a trace to its log lines.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD_ATTRS = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys() | {"message", "asctime"}
)


FORMATS = ("auto", "text", "json")


def _extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = {k: v for k, v in record.__dict__.items() if k not in _STANDARD_ATTRS}
    fields.update(trace_fields())
    return fields


def trace_fields() -> dict[str, str]:
    """``trace_id``/``span_id`` of the current span when it is recording, else nothing."""
    span = trace.get_current_span()
    if not span.is_recording():
        return {}
    context = span.get_span_context()
    return {
        "trace_id": trace.format_trace_id(context.trace_id),
        "span_id": trace.format_span_id(context.span_id),
    }


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_extra_fields(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...`` for people at a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = _extra_fields(record)
        if extra:
            line += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        return line


def resolve_format(fmt: str, stream: Any = None) -> str:
    """``text`` or ``json``; ``auto`` is text on a terminal, JSON anywhere else."""
    if fmt != "auto":
        return fmt
    stream = sys.stderr if stream is None else stream
    try:
        return "text" if stream.isatty() else "json"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return "json"


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Send the agent's logs to stderr in the chosen format; idempotent."""
    handler = logging.StreamHandler(sys.stderr)
    chosen = resolve_format(fmt, sys.stderr)
    handler.setFormatter(JsonFormatter() if chosen == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
