"""Kubernetes Events on this Node, so operators see what the agent did without its logs.

A corrupt checkpoint or a reboot that invalidated prepared claims changes what runs on the
node; ``kubectl describe node`` is where an operator looks first. Posting an Event is
best-effort: it must never turn a successful recovery into a failure, so every error is
logged and swallowed here, and each post is bounded by a timeout. A transient failure (429,
5xx, a dropped connection) is retried a few times with backoff, never sooner than the
``Retry-After`` the server sent, so one throttled or failed request does not lose the Event;
a timeout is not retried, because the server may have stored the first post, and neither is
a post the server asks to hold back longer than :data:`MAX_EVENT_RETRY_AFTER_S` (an Event
that late says little; giving up is logged). :func:`post_with_retries` is that policy, for
the node's Events here and the ComputeDomains' (:mod:`agent.imex.domains`).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from functools import partial
from typing import Any

import aiohttp
import anyio

from agent.errors import describe
from agent.kube.backoff import Backoff, retry_after
from agent.kube.interfaces import EventPoster as EventPoster  # re-exported
from agent.kube.interfaces import EventType, Obj
from agent.kube.rawcall import ApiStatusError, send
from agent.telemetry.tracing import tracer

log = logging.getLogger(__name__)

COMPONENT = "gpu-dra-agent"
EVENTS_PATH = "/api/v1/namespaces/{namespace}/events"
# Events about cluster-scoped objects (Nodes) live in the default namespace, as the kubelet's do.
EVENT_NAMESPACE = "default"
DEFAULT_TIMEOUT_S = 5.0
#: Posts of one Event at most (the first and its retries of transient failures).
DEFAULT_ATTEMPTS = 4
#: Statuses worth another post: throttling and server-side trouble.
RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
#: The longest ``Retry-After`` honoured for an Event (it must not hold later ones for long).
MAX_EVENT_RETRY_AFTER_S = 5.0


def node_event(
    node_name: str, node_uid: str | None, type_: EventType, reason: str, message: str
) -> Obj:
    """A core/v1 Event manifest about Node ``node_name`` (pure; the poster sends it)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    involved: Obj = {"apiVersion": "v1", "kind": "Node", "name": node_name}
    if node_uid:
        involved["uid"] = node_uid
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{node_name}.", "namespace": EVENT_NAMESPACE},
        "involvedObject": involved,
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": COMPONENT, "host": node_name},
        "reportingComponent": COMPONENT,
        "reportingInstance": f"{node_name}-{socket.gethostname()}-{os.getpid()}",
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


class ApiEventPoster:
    """Posts Node events through a kubernetes-asyncio ``ApiClient`` that the caller owns."""

    def __init__(
        self,
        api_client: Any,
        node_name: str,
        *,
        node_uid: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        attempts: int = DEFAULT_ATTEMPTS,
        retry_initial: float = 0.5,
    ) -> None:
        self._api = api_client
        self._node = node_name
        self._node_uid = node_uid
        self._timeout_s = timeout_s
        self._attempts = max(1, attempts)
        self._retry_initial = retry_initial

    async def post(self, type_: EventType, reason: str, message: str) -> None:
        event = node_event(self._node, self._node_uid, type_, reason, message)
        with tracer().start_as_current_span("event.post") as span:
            span.set_attribute("k8s.event.reason", reason)
            await post_with_retries(
                partial(self._post_once, event, span),
                f"Event {reason} on node {self._node}",
                attempts=self._attempts,
                backoff=Backoff(initial=self._retry_initial, maximum=2.0),
            )

    async def _post_once(self, event: Obj, span: Any) -> None:
        """One POST; raises what :func:`agent.kube.rawcall.send` raises."""
        try:
            await send(
                self._api.call_api,
                EVENTS_PATH.format(namespace=EVENT_NAMESPACE),
                "POST",
                header_params={"Accept": "application/json", "Content-Type": "application/json"},
                body=event,
                auth_settings=["BearerToken"],
                request_timeout=self._timeout_s,
            )
        except ApiStatusError as error:
            span.set_attribute("http.response.status_code", error.code)
            raise
        span.set_attribute("http.response.status_code", 201)


async def post_with_retries(
    post: Callable[[], Awaitable[object]], what: str, *, attempts: int, backoff: Backoff
) -> None:
    """``await post()``, again after a transient failure (429, 5xx, a dropped connection), at
    most ``attempts`` times in all, each retry no sooner than the server's ``Retry-After``;
    never raises: a failure for good is logged as a warning naming ``what``."""
    for attempt in range(1, attempts + 1):
        try:
            await post()
            return
        except Exception as error:  # Events are best effort
            why = "no answer in time" if isinstance(error, TimeoutError) else describe(error)
            after = retry_after(error)
            again = not isinstance(error, TimeoutError) and (
                isinstance(error, aiohttp.ClientError)
                or (isinstance(error, ApiStatusError) and error.code in RETRYABLE_STATUSES)
            )
        if again and after is not None and after > MAX_EVENT_RETRY_AFTER_S:
            why += f"; not posted again after more than {MAX_EVENT_RETRY_AFTER_S:g} s"
            again = False
        if not again or attempt == attempts:
            tries = f" (after {attempt} attempts)" if attempt > 1 else ""
            log.warning("could not post %s%s: %s", what, tries, why)
            return
        await anyio.sleep(backoff.next_delay(after))


class LoggingEventPoster:
    """An :class:`EventPoster` that only logs (no API server, e.g. tools and some tests)."""

    def __init__(self) -> None:
        self.posted: list[tuple[EventType, str, str]] = []

    async def post(self, type_: EventType, reason: str, message: str) -> None:
        self.posted.append((type_, reason, message))
        level = logging.WARNING if type_ == "Warning" else logging.INFO
        log.log(level, "event %s: %s", reason, message)
