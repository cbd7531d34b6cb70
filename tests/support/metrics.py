"""Read the agent's OpenTelemetry metrics in tests, from the provider's in-memory reader.

Values are cumulative over the test process, so tests compare before and after.
:func:`reading` installs the agent's meter provider if nothing has yet.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from agent.telemetry.meter_provider import configure_metrics, metrics_data


def _points(name: str) -> Iterator[tuple[dict[str, Any], Any]]:
    data = metrics_data()  # None before the first measurement
    if data is None:
        return
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        yield dict(point.attributes or {}), point


class Reading:
    """Values of the agent's instruments (by OpenTelemetry instrument name)."""

    def value(self, name: str, **labels: str) -> float:
        """A counter's or gauge's value for exactly these labels (0 if never recorded)."""
        for attributes, point in _points(name):
            if attributes == labels:
                return float(point.value)
        return 0.0

    def count(self, name: str, **labels: str) -> int:
        """A histogram's number of measurements for exactly these labels."""
        for attributes, point in _points(name):
            if attributes == labels:
                return int(point.count)
        return 0

    def series(self, name: str) -> list[dict[str, Any]]:
        """The label sets recorded for ``name``."""
        return [attributes for attributes, _ in _points(name)]

    def point(self, name: str, **labels: str) -> Any:
        for attributes, point in _points(name):
            if attributes == labels:
                return point
        raise AssertionError(f"{name}{labels} was never recorded: {self.series(name)}")


def reading() -> Reading:
    configure_metrics()
    return Reading()
