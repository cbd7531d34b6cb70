"""Kubernetes Events on this Node, so operators see what the agent did without its logs.

A corrupt checkpoint or a reboot that invalidated prepared claims changes what runs on the
node; ``kubectl describe node`` is where an operator looks first. Posting an Event is
best-effort: it must never turn a successful recovery into a failure, so every error is
logged and swallowed here, and each post is bounded by a timeout.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

import aiohttp

from agent.telemetry.tracing import tracer

log = logging.getLogger(__name__)

Obj = dict[str, Any]
EventType = Literal["Normal", "Warning"]
COMPONENT = "gpu-dra-agent"
EVENTS_PATH = "/api/v1/namespaces/{namespace}/events"
# Events about cluster-scoped objects (Nodes) live in the default namespace, as the kubelet's do.
EVENT_NAMESPACE = "default"
DEFAULT_TIMEOUT_S = 5.0


class EventPoster(Protocol):
    """Posts an Event about this Node; never raises."""

    async def post(self, type_: EventType, reason: str, message: str) -> None: ...


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
    ) -> None:
        self._api = api_client
        self._node = node_name
        self._node_uid = node_uid
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def post(self, type_: EventType, reason: str, message: str) -> None:
        event = node_event(self._node, self._node_uid, type_, reason, message)
        with tracer().start_as_current_span("event.post") as span:
            span.set_attribute("k8s.event.reason", reason)
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
            except (TimeoutError, aiohttp.ClientError) as error:
                log.warning("could not post Event %s on node %s: %s", reason, self._node, error)
                return
            span.set_attribute("http.response.status_code", status)
        if not 200 <= status < 300:
            log.warning(
                "could not post Event %s on node %s: the API server answered %d: %s",
                reason,
                self._node,
                status,
                _message(body),
            )


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
