"""ResourceSlice and Node calls as plain JSON, each bounded by a timeout.

The publisher compares what it wants with what the API server holds field by field
(:func:`agent.dra.slices.slice_differences` works on the wire shape), so it needs the
objects exactly as the server sent them. kubernetes-asyncio's typed models would get in the
way: they rename fields to snake_case, validate client-side and turn a delete's ``Status``
into errors (dependency-notes.md §3). Every call here goes through the shared ``ApiClient``
and :mod:`agent.kube.rawcall`, which checks each answer's status (a non-2xx answer becomes an
:class:`ApiStatusError` carrying the code, the reason and ``Retry-After``) and returns the
decoded JSON.

The watch stream is read line by line (:func:`agent.kube.rawcall.watch_events`), because
kubernetes-asyncio's ``Watch`` hides the HTTP status, swallows one 410 on its own and
reconnects behind the caller's back; the slice watcher wants to decide each of those itself.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator
from typing import Any

from agent.kube.rawcall import (
    MAX_EVENT_BYTES,
    ApiStatusError,
    Obj,
    WatchExpiredError,
    open_watch,
    send,
    status_error,
    watch_events,
)

__all__ = [
    "MAX_EVENT_BYTES",
    "ApiStatusError",
    "Obj",
    "RawSliceApi",
    "WatchExpiredError",
    "parse_server_version",
    "status_error",
    "watch_events",
]


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
        list_method = self._core.list_node if nodes else self._slices.list_resource_slice
        response = await open_watch(
            list_method,
            connect_timeout=self.request_timeout,
            timeout_seconds=timeout_seconds,
            field_selector=field_selector,
            resource_version=resource_version,
        )
        try:
            async for event in watch_events(response):
                yield event
        finally:
            response.close()

    async def _call(self, method: Any, *args: Any, **kwargs: Any) -> Obj:
        return await send(method, *args, request_timeout=self.request_timeout, **kwargs)


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


_status_error = status_error  # the name the unit tests know
