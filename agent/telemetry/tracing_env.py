"""Which trace exporters the standard ``OTEL_*`` variables ask for, decided without side effects.

The OpenTelemetry SDK reads most of its configuration from the environment by itself, and the
agent lets it: the sampler (``OTEL_TRACES_SAMPLER``/``_ARG``, default parentbased_always_on) in
``TracerProvider``; ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` in the resource
detector; endpoints (with the ``/v1/traces`` path rule for OTLP/HTTP), headers, timeout,
compression, certificates and ``insecure`` in each OTLP exporter, per-signal variables first.
What the SDK leaves to its auto-instrumentation entry point, which the agent does not use, is
decided here: ``OTEL_SDK_DISABLED``, ``OTEL_TRACES_EXPORTER`` and the OTLP protocol
(``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else ``OTEL_EXPORTER_OTLP_PROTOCOL``, else the
specification's default ``http/protobuf``).

One deliberate difference from the specification: with no ``OTEL_TRACES_EXPORTER`` and no OTLP
endpoint variable at all, tracing stays off rather than sending to ``localhost:4318``. A node
agent must not start talking to a port nobody configured; setting either variable turns it on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

GRPC = "grpc"
HTTP_PROTOBUF = "http/protobuf"
DEFAULT_PROTOCOL = HTTP_PROTOBUF
KNOWN_EXPORTERS = ("otlp", "console", "none")

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


@dataclass(frozen=True)
class TraceExportPlan:
    """What :func:`plan_from_environ` decided; ``reason`` says why, for the start-up log."""

    exporters: tuple[str, ...] = ()
    protocol: str = DEFAULT_PROTOCOL
    reason: str = ""
    warnings: tuple[str, ...] = field(default=())

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def otlp_protocol(environ: Mapping[str, str] = os.environ) -> tuple[str, str | None]:
    """The OTLP protocol for traces, and a warning when an unsupported one was asked for."""
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        raw = environ.get(name, "").strip().lower()
        if not raw:
            continue
        if raw in (GRPC, HTTP_PROTOBUF):
            return raw, None
        return DEFAULT_PROTOCOL, (
            f"{name}={raw!r} is not supported (grpc or http/protobuf); using {DEFAULT_PROTOCOL}"
        )
    return DEFAULT_PROTOCOL, None


def plan_from_environ(environ: Mapping[str, str] = os.environ) -> TraceExportPlan:
    """Decide from the environment whether and how to export spans."""
    if _true(environ.get("OTEL_SDK_DISABLED")):
        return TraceExportPlan(reason="OTEL_SDK_DISABLED=true")
    protocol, protocol_warning = otlp_protocol(environ)
    warnings = [protocol_warning] if protocol_warning else []
    raw = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if raw:
        names = [n.strip() for n in raw.split(",") if n.strip()]
        unknown = [n for n in names if n not in KNOWN_EXPORTERS]
        warnings += [f"OTEL_TRACES_EXPORTER: unknown exporter {n!r} ignored" for n in unknown]
        chosen = tuple(dict.fromkeys(n for n in names if n in ("otlp", "console")))
        if "none" in names or not chosen:
            return TraceExportPlan(
                reason=f"OTEL_TRACES_EXPORTER={raw}", protocol=protocol, warnings=tuple(warnings)
            )
        return TraceExportPlan(chosen, protocol, f"OTEL_TRACES_EXPORTER={raw}", tuple(warnings))
    for name in _ENDPOINT_VARIABLES:
        if environ.get(name, "").strip():
            return TraceExportPlan(("otlp",), protocol, f"{name} is set", tuple(warnings))
    return TraceExportPlan(
        reason="no OTEL_TRACES_EXPORTER and no OTLP endpoint variable", protocol=protocol
    )
