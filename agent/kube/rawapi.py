"""ResourceSlice and Node calls as plain JSON, each bounded by a timeout.

The publisher compares what it wants with what the API server holds field by field
(:func:`agent.dra.slices.slice_differences` works on the wire shape), so it needs the
objects exactly as the server sent them. kubernetes-asyncio's typed models would get in the
way: they rename fields to snake_case, validate client-side and turn a delete's ``Status``
into errors (dependency-notes.md §3). Every call here goes through the shared ``ApiClient``
with ``_preload_content=False`` and returns the decoded JSON; a non-2xx answer becomes an
:class:`ApiStatusError` carrying the code, the reason and ``Retry-After``.

The watch stream is read here as well, line by line, because kubernetes-asyncio's ``Watch``
hides the HTTP status, swallows one 410 on its own and reconnects behind the caller's back;
the slice watcher wants to decide each of those itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
import anyio

from agent.errors import AgentError

Obj = dict[str, Any]
#: The largest watch event line accepted (etcd's request limit is 1.5 MiB).
MAX_EVENT_BYTES = 16 * 2**20


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


class RawSliceApi:
    """The few ResourceSlice, Node and version calls the publisher and the supervisor make, on
    one shared ApiClient."""

    def __init__(self, api_client: Any, *, request_timeout: float = 10.0) -> None:
        from agent.kube.library import CoreV1Api, ResourceV1Api, VersionApi

        self._slices = ResourceV1Api(api_client)
        self._core = CoreV1Api(api_client)
        self._version = VersionApi(api_client)
        self.request_timeout = request_timeout

    async def read_node_uid(self, node_name: str) -> str:
        node = await self._call(self._core.read_node, node_name)
        return str(node["metadata"]["uid"])

    async def list_nodes(self, field_selector: str) -> Obj:
        return await self._call(self._core.list_node, field_selector=field_selector)

    async def read_server_version(self) -> tuple[int, int]:
        """The API server's (major, minor) from ``/version``; ValueError when unreadable."""
        return parse_server_version(await self._call(self._version.get_code))

    async def list(self, field_selector: str) -> Obj:
        return await self._call(self._slices.list_resource_slice, field_selector=field_selector)

    async def read(self, name: str) -> Obj:
        return await self._call(self._slices.read_resource_slice, name)

    async def create(self, body: Obj) -> Obj:
        return await self._call(self._slices.create_resource_slice, body)

    async def replace(self, name: str, body: Obj) -> Obj:
        return await self._call(self._slices.replace_resource_slice, name, body)

    async def delete(self, name: str, *, uid: str, resource_version: str) -> Obj:
        preconditions = {"uid": uid, "resourceVersion": resource_version}
        return await self._call(
            self._slices.delete_resource_slice, name, body={"preconditions": preconditions}
        )

    async def watch(
        self,
        field_selector: str,
        resource_version: str,
        timeout_seconds: int,
        *,
        nodes: bool = False,
    ) -> AsyncGenerator[Obj, None]:
        """The events of one watch request (of ResourceSlices, or of Nodes with ``nodes``),
        until the server ends it.

        Raises :class:`WatchExpiredError` for 410 (as HTTP status or ERROR event) and
        :class:`ApiStatusError` for other failures. A silent connection is noticed when no
        byte (not even a bookmark) arrives for ``timeout_seconds`` plus a grace period.
        """
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.request_timeout, sock_read=timeout_seconds + 30
        )
        with anyio.fail_after(self.request_timeout):
            list_method = self._core.list_node if nodes else self._slices.list_resource_slice
            response: Any = await list_method(
                field_selector=field_selector,
                watch=True,
                allow_watch_bookmarks=True,
                resource_version=resource_version,
                timeout_seconds=timeout_seconds,
                _preload_content=False,
                _request_timeout=timeout,
            )
        try:
            async for event in watch_events(response):
                yield event
        finally:
            response.close()

    async def _call(self, method: Any, *args: Any, **kwargs: Any) -> Obj:
        with anyio.fail_after(self.request_timeout):
            response: Any = await method(
                *args, _preload_content=False, _request_timeout=self.request_timeout, **kwargs
            )
            try:
                body = await response.read()
            finally:
                response.release()
        if not 200 <= response.status < 300:
            raise status_error(response.status, body, response.headers)
        decoded = json.loads(body)
        if not isinstance(decoded, dict):
            raise ApiStatusError(response.status, "BadResponse", "the body is not a JSON object")
        return decoded


async def watch_events(response: Any) -> AsyncGenerator[Obj, None]:
    """The events of a watch response, line by line, until the server ends it; a non-2xx
    answer or an ``ERROR`` event is raised (:class:`WatchExpiredError` for 410)."""
    if not 200 <= response.status < 300:
        raise status_error(response.status, await response.read(), response.headers)
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


def parse_server_version(info: Obj) -> tuple[int, int]:
    """(major, minor) of a ``/version`` document: from ``gitVersion`` (``v1.34.2-eks-1``), else
    from ``major``/``minor`` (managed clusters write ``"34+"``). ValueError names what it got."""
    match = re.match(r"v?(\d+)\.(\d+)", str(info.get("gitVersion") or ""))
    if match is not None:
        return int(match[1]), int(match[2])
    major = re.match(r"\d+", str(info.get("major") or ""))
    minor = re.match(r"\d+", str(info.get("minor") or ""))
    if major is None or minor is None:
        raise ValueError(
            f"the API server's /version names no version: gitVersion {info.get('gitVersion')!r},"
            f" major {info.get('major')!r}, minor {info.get('minor')!r}"
        )
    return int(major[0]), int(minor[0])


def status_error(code: int, body: bytes, headers: Any) -> ApiStatusError:
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
    retry_after: float | None = None
    raw = headers.get("Retry-After") if headers else None
    if raw is not None:
        try:
            retry_after = max(0.0, float(raw))
        except ValueError:
            retry_after = None
    cls = WatchExpiredError if code == 410 else ApiStatusError
    return cls(code, reason or str(code), message, retry_after)


_status_error = status_error  # the name the unit tests know
