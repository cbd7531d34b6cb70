"""Load shedding and request accounting of the embedded API server (what a fleet run measures).

kube-apiserver protects itself with API priority and fairness (and, before it, the
max-in-flight filter): a request beyond the seats it has is answered at once with 429
``TooManyRequests`` and ``Retry-After``, and well-behaved clients wait that long before they
try again. :class:`InFlightLimit` is the opt-in equivalent here: at most ``limit`` requests
are handled at the same time; long-running requests (watches) hold no seat, as in
kube-apiserver. :class:`RequestCounts` counts every answered request by verb, resource and
status code, the table ``make fleet`` prints (409 and 429 among them).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

#: What the 429 of a full server says (kube-apiserver's words).
THROTTLED_MESSAGE = "Too many requests, please try again later."


@dataclass
class InFlightLimit:
    """At most ``limit`` non-watch requests handled at once; the others get 429 with
    ``Retry-After: retry_after`` seconds. ``limit`` 0 or less: no limit."""

    limit: int = 0
    retry_after: int = 1
    in_flight: int = 0
    peak: int = 0
    rejected: int = 0

    def enter(self) -> bool:
        """Take a seat; False (and counted) when every seat is taken."""
        if self.limit > 0 and self.in_flight >= self.limit:
            self.rejected += 1
            return False
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        return True

    def leave(self) -> None:
        self.in_flight -= 1


def verb_of(method: str, watch: bool, item: bool) -> str:
    """The Kubernetes verb of a request: ``get``/``list``/``watch``/``create``/``update``/
    ``patch``/``delete``/``deletecollection``."""
    if method == "GET":
        if watch:
            return "watch"
        return "get" if item else "list"
    if method == "DELETE":
        return "delete" if item else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


def resource_of(path: str, plurals: frozenset[str]) -> tuple[str, bool]:
    """(resource, whether the path names one object) of an API path: ``computedomains/status``
    for ``/apis/g/v/namespaces/ns/computedomains/x/status``; ``other`` outside the API."""
    parts = [p for p in path.split("/") if p]
    for position, part in enumerate(parts):
        if part in plurals and not (position > 0 and parts[position - 1] == "namespaces"):
            rest = parts[position + 1 :]
            resource = part + (f"/{rest[1]}" if len(rest) > 1 else "")
            return resource, bool(rest)
    return "other", False


class RequestCounts:
    """Answered requests by (verb, resource, status); thread-safe, cheap per request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str, int]] = Counter()

    def add(self, verb: str, resource: str, status: int) -> None:
        with self._lock:
            self._counts[(verb, resource, status)] += 1

    def snapshot(self) -> list[dict[str, object]]:
        """The counts as JSON rows, sorted."""
        with self._lock:
            items = sorted(self._counts.items())
        return [
            {"verb": verb, "resource": resource, "code": code, "count": count}
            for (verb, resource, code), count in items
        ]

    def clear(self) -> None:
        with self._lock:
            self._counts.clear()
