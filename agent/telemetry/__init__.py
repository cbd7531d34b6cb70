"""Telemetry: OpenTelemetry tracing (and, later, metrics)."""
