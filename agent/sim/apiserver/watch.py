"""Watch streams: newline-delimited JSON events over chunked HTTP, as the real apiserver sends them.

A watch either starts from "now" (``resourceVersion`` absent, ``""`` or ``"0"``: synthetic ADDED events
for what exists, then live events) or resumes after a version (replayed from the store's history, or a
410 ``Expired`` ERROR event when that version has left the history window). Selectors are evaluated on
both sides of a change, so an object that stops matching is sent as DELETED and one that starts
matching as ADDED, which is what informers rely on. Bookmarks, ``timeoutSeconds`` and early termination
(for fault injection and shutdown) are handled here too.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from agent.sim.apiserver.errors import ApiError
from agent.sim.apiserver.faults import PathPattern, path_matches
from agent.sim.apiserver.kinds import ResourceKind
from agent.sim.apiserver.selectors import Selector
from agent.sim.apiserver.store import ObjectStore, StoreEvent

Obj = dict[str, Any]
_TRUE = ("1", "t", "T", "true", "TRUE", "True")
_DISCONNECT_POLL_S = 1.0


def parse_bool(value: str | None) -> bool:
    """Go's ``strconv.ParseBool`` truthy spellings (kubernetes-asyncio sends ``True``)."""
    return value in _TRUE


def query_number(query: Mapping[str, str], name: str) -> int | None:
    """An integer query parameter (``timeoutSeconds``, ``limit``); malformed ones are a 400."""
    text = query.get(name, "")
    if not text:
        return None
    if not text.isdigit():
        raise ApiError(400, f"invalid value for {name}: {text!r}: must be a non-negative integer")
    return int(text)


@dataclass(eq=False)
class OpenWatch:
    path: str
    queue: asyncio.Queue[StoreEvent | None]
    loop: asyncio.AbstractEventLoop

    def end(self) -> None:
        """Ask the stream to finish; safe from any thread."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


@dataclass
class WatchHub:
    """The open watches, so tests (and shutdown) can end them early."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _open: set[OpenWatch] = field(default_factory=set)
    _waiters: set[asyncio.Event] = field(default_factory=set)  # only touched on the loop

    def add(self, watch: OpenWatch) -> None:
        with self._lock:
            self._open.add(watch)
        self._wake()

    def discard(self, watch: OpenWatch) -> None:
        with self._lock:
            self._open.discard(watch)
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            waiter.set()

    async def wait_for_count(self, count: int, path: PathPattern = "*") -> None:
        """Return once exactly ``count`` open watches match ``path`` (call on the server's loop)."""
        while self.count(path) != count:
            changed = asyncio.Event()
            self._waiters.add(changed)
            try:
                await changed.wait()
            finally:
                self._waiters.discard(changed)

    def count(self, path: PathPattern = "*") -> int:
        with self._lock:
            return sum(1 for w in self._open if path_matches(path, w.path))

    def end_watches(self, path: PathPattern = "*") -> int:
        """End every open watch whose request path matches; returns how many were ended."""
        with self._lock:
            chosen = [w for w in self._open if path_matches(path, w.path)]
        for watch in chosen:
            watch.end()
        return len(chosen)


def translate(event: StoreEvent, kind: ResourceKind, selector: Selector) -> tuple[str, Obj] | None:
    """What this watch sees of a store write, given its selector, or ``None`` for nothing."""
    if event.kind is not kind:
        return None
    was = selector.matches(event.old)
    if event.type == "DELETED":
        return ("DELETED", event.obj) if was else None
    now = selector.matches(event.obj)
    if now and (was or event.type == "ADDED"):
        return (event.type, event.obj)
    if now:
        return ("ADDED", event.obj)
    if was:
        return ("DELETED", event.obj)
    return None


def _bookmark(kind: ResourceKind, rv: int, initial_end: bool = False) -> Obj:
    meta: Obj = {"resourceVersion": str(rv)}
    if initial_end:
        meta["annotations"] = {"k8s.io/initial-events-end": "true"}
    return {"kind": kind.kind, "apiVersion": kind.api_version, "metadata": meta}


Transform = Callable[[Obj], Obj]


class _Stream:
    def __init__(self, response: web.StreamResponse, transform: Transform | None) -> None:
        self.response = response
        self.transform = transform

    async def send(self, type_: str, obj: Obj) -> None:
        if self.transform is not None and type_ in ("ADDED", "MODIFIED", "DELETED"):
            obj = self.transform(obj)  # a Table of one row, for kubectl get -w
        line = json.dumps({"type": type_, "object": obj}, separators=(",", ":")) + "\n"
        await self.response.write(line.encode())


async def serve_watch(
    request: web.Request,
    store: ObjectStore,
    hub: WatchHub,
    kind: ResourceKind,
    selector: Selector,
    bookmark_interval: float,
    transform: Transform | None = None,
) -> web.StreamResponse:
    query = request.query
    since = query.get("resourceVersion", "")
    bookmarks = parse_bool(query.get("allowWatchBookmarks"))
    send_initial = query.get("sendInitialEvents")
    timeout_s = query_number(query, "timeoutSeconds")
    if since and not since.isdigit():
        raise ApiError(400, f"invalid resource version: {since!r}")

    loop = asyncio.get_running_loop()
    queue = store.subscribe()
    watch = OpenWatch(request.path, queue, loop)
    hub.add(watch)
    try:
        # Subscribing and taking the initial events happen without an await in between, so no
        # write can fall into a gap between the two.
        initial: list[tuple[str, Obj]] = []
        expired: ApiError | None = None
        from_now = since in ("", "0") or parse_bool(send_initial)
        if from_now:
            initial = [("ADDED", obj) for obj in store.select(kind, selector)]
        else:
            try:
                initial = [
                    seen
                    for event in store.events_after(int(since))
                    if (seen := translate(event, kind, selector)) is not None
                ]
            except ApiError as error:
                expired = error
        initial_rv = store.resource_version

        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        stream = _Stream(response, transform)
        if expired is not None:
            await stream.send("ERROR", expired.status())
            return response
        for type_, obj in initial:
            await stream.send(type_, obj)
        if bookmarks and parse_bool(send_initial):
            await stream.send("BOOKMARK", _bookmark(kind, initial_rv, initial_end=True))
        await _pump(stream, request, store, kind, selector, queue, timeout_s, bookmarks,
                    bookmark_interval)  # fmt: skip
        return response
    except ConnectionResetError:
        return web.StreamResponse()
    finally:
        store.unsubscribe(queue)
        hub.discard(watch)


async def _pump(
    stream: _Stream,
    request: web.Request,
    store: ObjectStore,
    kind: ResourceKind,
    selector: Selector,
    queue: asyncio.Queue[StoreEvent | None],
    timeout_s: float | None,
    bookmarks: bool,
    bookmark_interval: float,
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s if timeout_s is not None else None
    next_bookmark = loop.time() + bookmark_interval if bookmarks else None
    while True:
        if queue.empty():
            now = loop.time()
            if deadline is not None and now >= deadline:
                return
            if next_bookmark is not None and now >= next_bookmark:
                await stream.send("BOOKMARK", _bookmark(kind, store.resource_version))
                next_bookmark = now + bookmark_interval
            transport = request.transport
            if transport is None or transport.is_closing():
                return
            waits = [t - now for t in (deadline, next_bookmark) if t is not None]
            wait = max(0.0, min([_DISCONNECT_POLL_S, *waits]))
            try:
                item = await asyncio.wait_for(queue.get(), wait)
            except TimeoutError:
                continue
        else:
            item = queue.get_nowait()
        if item is None:
            return
        seen = translate(item, kind, selector)
        if seen is not None:
            await stream.send(seen[0], copy.deepcopy(seen[1]))
