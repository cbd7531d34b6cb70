"""Kubernetes Events on this Node, so operators see what the agent did without its logs.

A corrupt checkpoint or a reboot that invalidated prepared claims changes what runs on the
node; ``kubectl describe node`` is where an operator looks first. Posting an Event is
best-effort: it must never turn a successful recovery into a failure, so every error is
logged and swallowed here, and each post is bounded by a timeout. A transient failure (429,
5xx, a dropped connection) is retried a few times with backoff, honouring ``Retry-After``
up to :data:`MAX_EVENT_RETRY_AFTER_S`, so one throttled or failed request does not lose the
Event; a timeout is not retried, because the server may have stored the first post.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from datetime import UTC, datetime
from typing import Any

import aiohttp
import anyio

from agent.errors import describe
from agent.kube.backoff import Backoff
from agent.kube.interfaces import EventPoster as EventPoster  # re-exported
from agent.kube.interfaces import EventType, Obj
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
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._attempts = max(1, attempts)
        self._retry_initial = retry_initial

    async def post(self, type_: EventType, reason: str, message: str) -> None:
        event = node_event(self._node, self._node_uid, type_, reason, message)
        backoff = Backoff(initial=self._retry_initial, maximum=2.0)
        with tracer().start_as_current_span("event.post") as span:
            span.set_attribute("k8s.event.reason", reason)
            for attempt in range(1, self._attempts + 1):
                failure = await self._post_once(event, span)
                if failure is None:
                    return
                why, retryable, retry_after = failure
                if not retryable or attempt == self._attempts:
                    tries = f" (after {attempt} attempts)" if attempt > 1 else ""
                    log.warning(
                        "could not post Event %s on node %s%s: %s", reason, self._node, tries, why
                    )
                    return
                capped = None if retry_after is None else min(retry_after, MAX_EVENT_RETRY_AFTER_S)
                await anyio.sleep(backoff.next_delay(capped))

    async def _post_once(self, event: Obj, span: Any) -> tuple[str, bool, float | None] | None:
        """One POST; ``None`` when stored, else (why, worth retrying, Retry-After seconds)."""
        try:
            response = await self._api.call_api(
                EVENTS_PATH.format(namespace=EVENT_NAMESPACE),
                "POST",
                header_params={
                    "Accept": "application/json",
                    "Content-Type": "application/json",
                },
                body=event,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=self._timeout,
            )
            async with response:
                status = response.status
                body = await response.read()
                raw_retry_after = response.headers.get("Retry-After")
        except TimeoutError as error:
            return f"no answer in time ({error or 'timeout'})", False, None
        except aiohttp.ClientError as error:
            return describe(error), True, None
        span.set_attribute("http.response.status_code", status)
        if 200 <= status < 300:
            return None
        retry_after: float | None = None
        if raw_retry_after is not None:
            try:
                retry_after = max(0.0, float(raw_retry_after))
            except ValueError:
                retry_after = None
        why = f"the API server answered {status}: {_message(body)}"
        return why, status in RETRYABLE_STATUSES, retry_after


class LoggingEventPoster:
    """An :class:`EventPoster` that only logs (no API server, e.g. tools and some tests)."""

    def __init__(self) -> None:
        self.posted: list[tuple[EventType, str, str]] = []

    async def post(self, type_: EventType, reason: str, message: str) -> None:
        self.posted.append((type_, reason, message))
        level = logging.WARNING if type_ == "Warning" else logging.INFO
        log.log(level, "event %s: %s", reason, message)


def _message(body: bytes) -> str:
    try:
        message = json.loads(body).get("message")
    except (ValueError, AttributeError):
        message = None
    return message if isinstance(message, str) else body[:200].decode(errors="replace")
