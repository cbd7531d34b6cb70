"""A list-then-watch cache of one collection (an informer), and its "something changed" signal.

A controller that re-lists its objects every second costs the API server a steady stream of
requests for nothing while nothing changes. An :class:`Informer` costs one LIST, then one WATCH
from the list's resourceVersion with bookmarks; at rest it sends no request at all. A watch
that ends (``timeoutSeconds``, a dropped connection, a failure) is resumed from the last
resourceVersion seen, a bookmark's included; 410 Gone means that version left the server's
history, so the cache is rebuilt from a fresh LIST. Every retry waits a jittered, growing
delay, never shorter than a ``Retry-After`` the server sent, and a server that ends each
watch at once (no event, under a second) is met with the same backoff, not a hot loop.

The cache keeps objects by ``namespace/name`` (``name`` for cluster-scoped kinds), optionally
reduced by a ``transform`` (only the fields its reader needs). Its owner may feed it what its
own writes returned (:meth:`Informer.record`, :meth:`Informer.forget`), so that its next pass
sees them at once; resourceVersions keep a late watch event from moving an object backwards,
and tombstones keep one from bringing back an object the owner deleted (the store the slice
cache shares: :mod:`agent.kube.versioned`). Every change a LIST or a watch brings sets a
:class:`Changed`, which several informers may share and one consumer waits on.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from agent.errors import describe
from agent.kube.backoff import Backoff, retry_after
from agent.kube.rawcall import Obj, WatchExpiredError, open_watch, watch_events
from agent.kube.versioned import VersionedCache, object_key, resource_version

log = logging.getLogger(__name__)

#: One LIST of the collection: the decoded ``…List`` object.
ListCall = Callable[[], Awaitable[Obj]]
#: One WATCH from a resourceVersion for about ``timeoutSeconds``: the open response (2xx),
#: read with :func:`agent.kube.rawcall.watch_events`.
WatchCall = Callable[[str, int], Awaitable[Any]]
Transform = Callable[[Obj], Obj]


class Changed:
    """A "something changed" flag: set by informers, waited on and cleared by one consumer."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()

    def clear(self) -> None:
        if self._event.is_set():
            self._event = anyio.Event()


def collection(
    call: Callable[..., Awaitable[Obj]],
    method: Any,
    *args: Any,
    request_timeout: float,
    **kwargs: Any,
) -> tuple[ListCall, WatchCall]:
    """The LIST and the WATCH of a kubernetes-asyncio list method (``*args`` and ``**kwargs``
    choose the collection: its group, namespace, ``label_selector``…); the LIST goes through
    ``call`` (one JSON call with its timeout and 429 retries), the WATCH through
    :func:`agent.kube.rawcall.open_watch`."""

    async def list_once() -> Obj:
        return await call(method, *args, **kwargs)

    async def watch_once(version: str, seconds: int) -> Any:
        return await open_watch(
            method, *args, connect_timeout=request_timeout, timeout_seconds=seconds,
            resource_version=version, **kwargs,
        )  # fmt: skip

    return list_once, watch_once


class Informer:
    """Keeps a cache of one collection equal to the server's while :meth:`run` runs; ``what``
    names the collection in logs."""

    def __init__(
        self,
        what: str,
        list_call: ListCall,
        watch_call: WatchCall,
        *,
        changed: Changed | None = None,
        transform: Transform | None = None,
        watch_timeout: int = 300,
        backoff: Backoff | None = None,
    ) -> None:
        self.what = what
        self.changed = changed or Changed()
        self._list = list_call
        self._watch = watch_call
        self._watch_timeout = watch_timeout
        self._backoff = backoff or Backoff(initial=0.2, maximum=4.0)
        self._cache = VersionedCache(transform=transform)
        self._synced = anyio.Event()
        self._seen = ""  # the last resourceVersion the current watch delivered
        #: LIST and WATCH requests sent
        self.lists = 0
        self.watches = 0

    # -- the cache ----------------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        """Whether a LIST filled the cache (before that it holds nothing the server said)."""
        return self._synced.is_set()

    async def wait_synced(self) -> None:
        await self._synced.wait()

    def get(self, key: str) -> Obj | None:
        """The object with :func:`agent.kube.versioned.object_key` ``key``; shared: readers
        must not change it."""
        return self._cache.get(key)

    def items(self) -> list[Obj]:
        """The objects in key order; shared: readers must not change them."""
        return self._cache.items()

    def snapshot(self) -> dict[str, Obj]:
        return self._cache.snapshot()

    def __len__(self) -> int:
        return len(self._cache)

    def record(self, obj: Obj) -> None:
        """What a write of the owner's returned (it is stored): the cache has it at once."""
        self._cache.apply("MODIFIED", obj)

    def forget(self, obj: Obj) -> None:
        """The owner deleted ``obj`` (as last seen): gone from the cache, and no late event
        of it (of its version or an older one) brings it back."""
        self._cache.forget(object_key(obj), resource_version(obj))

    # -- list and watch -----------------------------------------------------------------------

    async def relist(self) -> str:
        """One LIST into the cache; returns its resourceVersion (where a watch starts)."""
        self.lists += 1
        listed = await self._list()
        version = str((listed.get("metadata") or {}).get("resourceVersion", ""))
        self._cache.replace_all(
            listed.get("items") or [], int(version) if version.isdigit() else None
        )
        self._synced.set()
        self.changed.set()
        # no backoff reset here: only a watch that delivers events proves the server well
        # (a server that lists fine but answers every watch with 410 must not be hammered)
        return version

    async def run(self) -> None:
        """List, then watch until cancelled."""
        version: str | None = None
        while True:
            try:
                if version is None:
                    version = await self.relist()
                self._seen = version
                version = await self._watch_once(version)
            except WatchExpiredError:
                delay = self._backoff.next_delay()  # a server answering 410 again and again
                log.info("watch of %s expired (410 Gone); listing again in %.2f s",
                         self.what, delay)  # fmt: skip
                version = None
                await anyio.sleep(delay)
            except Exception as error:
                if version is not None:
                    version = self._seen  # resumed where the failed watch got to
                delay = self._backoff.next_delay(retry_after(error))
                log.warning("list/watch of %s failed: %s; again in %.2f s",
                            self.what, describe(error), delay)  # fmt: skip
                await anyio.sleep(delay)

    async def _watch_once(self, version: str) -> str:
        """One WATCH from ``version`` until the server ends it; the last version seen."""
        self.watches += 1
        seconds = random.randint(self._watch_timeout, self._watch_timeout * 3 // 2)
        started, events = anyio.current_time(), 0
        response = await self._watch(version, seconds)
        try:
            async for event in watch_events(response):
                events += 1
                version = self._seen = self._handle(event) or version
        finally:
            response.close()
        if events:
            self._backoff.reset()
        elif anyio.current_time() - started < 1.0:
            await anyio.sleep(self._backoff.next_delay())  # a server ending watches at once
        return version

    def _handle(self, event: Obj) -> str | None:
        obj = event.get("object") or {}
        kind = str(event.get("type"))
        if kind in ("ADDED", "MODIFIED", "DELETED") and self._cache.apply(kind, obj):
            self.changed.set()
        version = resource_version(obj)
        if version is not None:
            self._cache.passed(version)
        raw = (obj.get("metadata") or {}).get("resourceVersion")
        return str(raw) if raw else None
