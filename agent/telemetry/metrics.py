"""In-process counters: how many slice writes, retries and errors, for tests and exposition.

The agent needs a handful of monotonically increasing counters (writes by verb, errors by
reason) that tests can read directly and a Prometheus endpoint can render later. A full
client library is not needed for that, so this is a tiny registry: counters with label sets,
safe to increment from the event loop and from worker threads, rendered in the Prometheus
text format by :meth:`Registry.render`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

LabelKey = tuple[tuple[str, str], ...]


class Counter:
    """A counter with optional labels: ``writes.inc(verb="create")``."""

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text
        self._lock = threading.Lock()
        self._values: dict[LabelKey, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} can only go up, not by {amount}")
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        """The count for exactly these labels (0 when never incremented)."""
        with self._lock:
            return self._values.get(tuple(sorted(labels.items())), 0.0)

    def total(self) -> float:
        """The sum over every label set."""
        with self._lock:
            return sum(self._values.values())

    def samples(self) -> dict[LabelKey, float]:
        with self._lock:
            return dict(self._values)


class Registry:
    """Counters by name; asking twice for a name gives the same counter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, Counter] = {}

    def counter(self, name: str, help_text: str) -> Counter:
        with self._lock:
            existing = self._counters.get(name)
            if existing is None:
                existing = self._counters[name] = Counter(name, help_text)
            return existing

    def render(self) -> str:
        """Every counter in the Prometheus text exposition format."""
        with self._lock:
            counters = sorted(self._counters.values(), key=lambda counter: counter.name)
        lines: list[str] = []
        for counter in counters:
            lines.append(f"# HELP {counter.name} {counter.help}")
            lines.append(f"# TYPE {counter.name} counter")
            for labels, value in sorted(counter.samples().items()):
                lines.append(f"{counter.name}{_labels(dict(labels))} {value:g}")
        return "\n".join(lines) + ("\n" if lines else "")


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    escaped = (
        f'{key}="{value.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for key, value in sorted(labels.items())
    )
    return "{" + ",".join(escaped) + "}"


#: The process-wide registry.
REGISTRY = Registry()


def counter(name: str, help_text: str) -> Counter:
    """A counter of the process-wide registry."""
    return REGISTRY.counter(name, help_text)
