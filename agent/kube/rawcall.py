"""Every raw call to the API server, its status checked in one place.

The agent and the controller talk to the API server through kubernetes-asyncio with
``_preload_content=False``: the body comes back as the server sent it, as plain JSON, without
the generated models (dependency-notes.md §3). Such a call does not raise for a non-2xx
answer: a 429's ``Status`` object comes back like any other body. A caller that parsed it
as the object it asked for would read a ``Status`` as a Node (an agent once exited at start
that way). So no module makes such a call itself: a request goes through :func:`send`, a
watch through :func:`open_watch`, and the claim GET of prepare, which has its own session,
checks its answer with :func:`check`. Each turns a non-2xx answer into an
:class:`ApiStatusError` carrying the code, the Status's reason and message, and the
``Retry-After`` the server sent, which every retry loop honours
(:mod:`agent.kube.backoff`, :mod:`agent.kube.throttle`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import aiohttp
import anyio

from agent.errors import AgentError

Obj = dict[str, Any]
#: The largest watch event line accepted (etcd's request limit is 1.5 MiB).
MAX_EVENT_BYTES = 16 * 2**20
#: How long a watch may stay silent beyond its ``timeoutSeconds`` (not even a bookmark)
#: before the connection is taken as dead.
WATCH_READ_GRACE_S = 30


class ApiStatusError(AgentError):
    """The API server answered with a non-2xx status."""

    def __init__(self, code: int, reason: str, message: str, retry_after: float | None = None):
        self.code = code
        self.reason = reason
        self.retry_after = retry_after
        hint = f" (retry after {retry_after:g} s)" if retry_after is not None else ""
        super().__init__(f"API server answered {code} {reason}: {message}{hint}")


class WatchExpiredError(ApiStatusError):
    """The watch's resourceVersion is no longer in the server's history (410 Gone): re-list."""


async def send(method: Any, *args: Any, request_timeout: float, **kwargs: Any) -> Obj:
    """One request through a kubernetes-asyncio API method (or ``ApiClient.call_api``), bounded
    by ``request_timeout``: the decoded JSON object of a 2xx answer, else :class:`ApiStatusError`."""
    with anyio.fail_after(request_timeout):
        response: Any = await method(
            *args, _preload_content=False, _request_timeout=request_timeout, **kwargs
        )
        try:
            body = await response.read()
        finally:
            response.release()
    check(response.status, body, response.headers)
    decoded = json.loads(body)
    if not isinstance(decoded, dict):
        raise ApiStatusError(response.status, "BadResponse", "the body is not a JSON object")
    return decoded


async def open_watch(
    method: Any, *args: Any, connect_timeout: float, timeout_seconds: int, **kwargs: Any
) -> Any:
    """Start a watch (``watch=True`` is added) whose answer was 2xx: its response, which
    the caller reads with :func:`watch_events` and closes. A non-2xx answer is raised here,
    as :class:`WatchExpiredError` for 410. A silent connection is noticed when no byte (not
    even a bookmark) arrives for ``timeout_seconds`` plus :data:`WATCH_READ_GRACE_S`."""
    request_timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=connect_timeout, sock_read=timeout_seconds + WATCH_READ_GRACE_S
    )
    with anyio.fail_after(connect_timeout):
        response: Any = await method(
            *args,
            watch=True,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout_seconds,
            _preload_content=False,
            _request_timeout=request_timeout,
            **kwargs,
        )
        if not 200 <= response.status < 300:
            try:
                body = await response.read()
            finally:
                response.close()
            check(response.status, body, response.headers)
    return response


async def watch_events(response: Any) -> AsyncGenerator[Obj, None]:
    """The events of a watch response, line by line, until the server ends it; a non-2xx
    answer or an ``ERROR`` event is raised (:class:`WatchExpiredError` for 410)."""
    if not 200 <= response.status < 300:
        check(response.status, await response.read(), response.headers)
    while True:
        line = await response.content.readuntil(b"\n", max_size=MAX_EVENT_BYTES)
        if not line:
            return
        if not line.strip():
            continue
        event = json.loads(line)
        if event.get("type") == "ERROR":
            status = event.get("object") or {}
            raise status_error(int(status.get("code") or 500), line, {})
        yield event


def check(code: int, body: bytes, headers: Mapping[str, str] | None) -> None:
    """Nothing for a 2xx answer; else its :func:`status_error`, raised."""
    if not 200 <= code < 300:
        raise status_error(code, body, headers)


def status_error(code: int, body: bytes, headers: Mapping[str, str] | None) -> ApiStatusError:
    """The error of a non-2xx answer: the Status body's reason and message, ``Retry-After``."""
    reason, message = "", body[:300].decode(errors="replace")
    try:
        status = json.loads(body)
        if status.get("type") == "ERROR":
            status = status.get("object") or {}
        reason = str(status.get("reason") or "")
        message = str(status.get("message") or message)
    except (ValueError, AttributeError):
        pass
    retry_after = parse_retry_after(headers.get("Retry-After") if headers else None)
    cls = WatchExpiredError if code == 410 else ApiStatusError
    return cls(code, reason or str(code), message, retry_after)


def parse_retry_after(raw: str | None) -> float | None:
    """Seconds of a ``Retry-After`` header (kube-apiserver sends whole seconds; an HTTP date,
    which it never sends, is not read: None)."""
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        return None
