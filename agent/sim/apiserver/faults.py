"""Fault injection and the request log: how tests make the embedded server misbehave on purpose.

Tests of retry and backoff logic need the failures a real cluster produces: a 409 on a contended
write, 429 with ``Retry-After`` under API priority and fairness, 500/503 from an overloaded or
restarting apiserver, a connection reset, a slow response, a watch the server closes early. Rules are
added from any thread (a lock guards them) and matched by the HTTP middleware on every request.
"""

from __future__ import annotations

import fnmatch
import re
import threading
from dataclasses import dataclass, field
from typing import Literal

Action = Literal["fail", "latency", "drop"]
PathPattern = str | re.Pattern[str]


def path_matches(pattern: PathPattern, path: str) -> bool:
    if isinstance(pattern, re.Pattern):
        return pattern.search(path) is not None
    return fnmatch.fnmatchcase(path, pattern)


@dataclass
class FaultRule:
    """One rule; ``remaining`` counts down on each match (``None`` is unlimited)."""

    action: Action
    method: str
    path: PathPattern
    remaining: int | None
    status: int = 500
    retry_after: int | None = None
    message: str = ""
    delay: float = 0.0
    after: bool = False  # latency: handle the request first, then wait before answering
    watch: bool | None = None  # True: only watch requests; False: only the others; None: both
    hits: int = 0

    def matches(self, method: str, path: str, watch: bool = False) -> bool:
        if self.watch is not None and self.watch != watch:
            return False
        return (self.method in ("*", method.upper())) and path_matches(self.path, path)


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    query: dict[str, str]
    status: int  # 0 when the connection was dropped; a watch is logged when it ends
    watch: bool = False
    content_type: str = ""
    #: when it arrived and was answered (``time.monotonic()``), who sent it, the answer's
    #: ``Retry-After``
    at: float = 0.0
    user_agent: str = ""
    retry_after: float | None = None
    answered: float = 0.0


@dataclass
class FaultPlan:
    """What the middleware must do with one request: sleep, then fail or drop (or neither);
    ``delay_after`` is slept after the request was handled, before the answer is sent."""

    delay: float = 0.0
    delay_after: float = 0.0
    fail: FaultRule | None = None
    drop: bool = False
    rules: list[FaultRule] = field(default_factory=list)


class FaultInjector:
    """Thread-safe set of fault rules, consulted once per request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[FaultRule] = []

    def fail_next(
        self,
        method: str,
        path: PathPattern,
        status: int,
        *,
        count: int | None = 1,
        retry_after: int | None = None,
        message: str = "",
        watch: bool | None = None,
    ) -> FaultRule:
        """Answer the next ``count`` matching requests with ``status`` and a real Status body.

        ``path`` is a glob (``/apis/resource.k8s.io/v1/resourceslices*``) or a compiled regex (searched).
        For 429 ``retry_after`` defaults to 1 second and is sent as the ``Retry-After`` header.
        ``watch`` limits the rule to watch requests (``True``) or to the others (``False``): a
        LIST and a WATCH share their path.
        """
        if status == 429 and retry_after is None:
            retry_after = 1
        rule = FaultRule("fail", method.upper(), path, count, status, retry_after, message)
        rule.watch = watch
        return self._add(rule)

    def add_latency(
        self,
        method: str,
        path: PathPattern,
        seconds: float,
        *,
        count: int | None = None,
        after: bool = False,
        watch: bool | None = None,
    ) -> FaultRule:
        """Delay matching requests by ``seconds`` before they are handled, or with ``after``
        once they are handled (a write is stored, its answer comes late: what a client whose
        timeout is shorter sees as a failure that happened anyway)."""
        rule = FaultRule("latency", method.upper(), path, count, delay=seconds, after=after)
        rule.watch = watch
        return self._add(rule)

    def drop_next(
        self,
        method: str,
        path: PathPattern,
        *,
        count: int | None = 1,
        watch: bool | None = None,
    ) -> FaultRule:
        """Close the connection of the next ``count`` matching requests without any response."""
        return self._add(FaultRule("drop", method.upper(), path, count, watch=watch))

    def remove(self, rule: FaultRule) -> None:
        with self._lock:
            if rule in self._rules:
                self._rules.remove(rule)

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def plan(self, method: str, path: str, watch: bool = False) -> FaultPlan:
        """Consume the rules that match this request; latency rules add up, the first failure wins."""
        plan = FaultPlan()
        with self._lock:
            for rule in list(self._rules):
                if not rule.matches(method, path, watch):
                    continue
                if rule.action == "latency" and rule.after:
                    plan.delay_after += rule.delay
                elif rule.action == "latency":
                    plan.delay += rule.delay
                elif plan.fail is not None or plan.drop:
                    continue
                elif rule.action == "drop":
                    plan.drop = True
                else:
                    plan.fail = rule
                rule.hits += 1
                plan.rules.append(rule)
                if rule.remaining is not None:
                    rule.remaining -= 1
                    if rule.remaining <= 0:
                        self._rules.remove(rule)
        return plan

    def _add(self, rule: FaultRule) -> FaultRule:
        with self._lock:
            self._rules.append(rule)
        return rule


class RequestLog:
    """Every request the server answered, in order, for assertions like "how many slice writes"."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[RequestRecord] = []

    def add(self, record: RequestRecord) -> None:
        with self._lock:
            self._records.append(record)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def records(
        self, method: str | None = None, path: PathPattern | None = None
    ) -> list[RequestRecord]:
        """Records filtered by method (``"GET"``; ``"WRITE"`` for POST/PUT/PATCH/DELETE) and path."""
        with self._lock:
            records = list(self._records)
        if method == "WRITE":
            records = [r for r in records if r.method in ("POST", "PUT", "PATCH", "DELETE")]
        elif method is not None:
            records = [r for r in records if r.method == method.upper()]
        if path is not None:
            records = [r for r in records if path_matches(path, r.path)]
        return records

    def early_retries(self) -> list[tuple[RequestRecord, RequestRecord]]:
        """Requests sent again sooner than the ``Retry-After`` of the one before: each pair is
        an answer that said ``Retry-After`` and the same client's next request of the same
        method, path and selectors (a list after a refused watch of the same objects is a
        retry too) that arrived after that answer was sent but before ``Retry-After`` seconds
        had passed since the first arrived. (One that arrived before the answer was sent was
        not sent again after it: the client asked twice at once.)"""
        with self._lock:
            records = sorted(self._records, key=lambda r: r.at)
        last: dict[tuple[str, ...], RequestRecord] = {}
        early: list[tuple[RequestRecord, RequestRecord]] = []
        for record in records:
            key = (
                record.user_agent,
                record.method,
                record.path,
                record.query.get("fieldSelector", ""),
                record.query.get("labelSelector", ""),
            )
            before = last.get(key)
            if before is not None and before.retry_after is not None:
                if before.answered <= record.at < before.at + before.retry_after:
                    early.append((before, record))
            last[key] = record
        return early
