"""What the API server holds of this node's slices: a list-then-watch cache.

The publisher decides from this cache, so it must learn within milliseconds that the
kubelet wiped the slices or someone edited one, and it must never trust a cache that has
silently fallen behind. Hence: one LIST, then a WATCH from the list's resourceVersion with
bookmarks; a watch that ends is resumed from the last version seen; 410 Gone means the
history is gone, so the cache is rebuilt from a fresh LIST; any other failure is retried
with backoff; and a slow periodic re-list repairs whatever a bug or a lost event left.

The publisher also feeds the cache with the objects its own writes return, so the next
reconcile sees them at once (client-go needs a mutation cache for that); resourceVersions
keep a late watch event from overwriting a newer write, and tombstones keep a late event
from resurrecting a slice the publisher just deleted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import anyio

from agent.kube.backoff import Backoff, retry_after
from agent.kube.rawapi import RawSliceApi, WatchExpiredError
from agent.kube.versioned import VersionedCache
from agent.kube.versioned import resource_version as resource_version  # re-exported
from agent.telemetry.metrics import SLICE_WATCH_REASONS, SLICE_WATCH_RESTARTS, add, at_zero

Obj = dict[str, Any]
log = logging.getLogger(__name__)


def _name(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


class SliceCache(VersionedCache):
    """Slices by name, never moved backwards by an older event (:mod:`agent.kube.versioned`)."""

    def __init__(self) -> None:
        super().__init__(key=_name)


class SliceWatcher:
    """Keeps :attr:`cache` equal to the server's slices for one field selector."""

    def __init__(
        self,
        api: RawSliceApi,
        field_selector: str,
        *,
        on_change: Callable[[], None],
        resync_interval: float = 300.0,
        watch_timeout: int = 240,
        backoff: Backoff | None = None,
    ) -> None:
        self.cache = SliceCache()
        self.synced = False
        at_zero(SLICE_WATCH_RESTARTS, *({"reason": r} for r in SLICE_WATCH_REASONS))
        self._api = api
        self._selector = field_selector
        self._on_change = on_change
        self._resync_interval = resync_interval
        self._watch_timeout = watch_timeout
        self._backoff = backoff or Backoff()

    async def run(self) -> None:
        """List and watch until cancelled."""
        version: str | None = None
        next_resync = anyio.current_time() + self._resync_interval
        while True:
            try:
                if version is None or anyio.current_time() >= next_resync:
                    if version is not None:
                        add(SLICE_WATCH_RESTARTS, 1, reason="resync")
                    version = await self._relist()
                    next_resync = anyio.current_time() + self._resync_interval
                until_resync = next_resync - anyio.current_time()
                started, events = anyio.current_time(), 0
                with anyio.move_on_after(until_resync) as resync_due:
                    stream = self._api.watch(
                        self._selector,
                        version,
                        max(1, math.ceil(min(self._watch_timeout, until_resync))),
                    )
                    async with aclosing(stream) as watch_events:
                        async for event in watch_events:
                            events += 1
                            version = self._handle(event) or version
                            self._backoff.reset()
                if resync_due.cancelled_caught:
                    continue
                add(SLICE_WATCH_RESTARTS, 1, reason="ended")
                if events == 0 and anyio.current_time() - started < 1.0:
                    await anyio.sleep(self._backoff.next_delay())  # a server ending watches at once
            except WatchExpiredError:
                add(SLICE_WATCH_RESTARTS, 1, reason="expired")
                delay = self._backoff.next_delay()  # a server answering 410 again and again
                log.info("slice watch expired (410 Gone); listing again in %.2f s", delay)
                version = None
                await anyio.sleep(delay)
            except Exception as error:
                add(SLICE_WATCH_RESTARTS, 1, reason="error")
                delay = self._backoff.next_delay(retry_after(error))
                log.warning("slice list/watch failed: %r; retrying in %.2f s", error, delay)
                await anyio.sleep(delay)

    async def _relist(self) -> str:
        listed = await self._api.list(self._selector)
        items = listed.get("items") or []
        for item in items:  # list items come without apiVersion/kind
            item.setdefault("apiVersion", "resource.k8s.io/v1")
            item.setdefault("kind", "ResourceSlice")
        version = str((listed.get("metadata") or {}).get("resourceVersion", ""))
        self.cache.replace_all(items, int(version) if version.isdigit() else None)
        self.synced = True
        # no backoff reset here: only a watch that delivers events proves the server well
        # (a server that lists fine but answers every watch with 410 must not be hammered)
        self._on_change()
        return version

    def _handle(self, event: Obj) -> str | None:
        obj = event.get("object") or {}
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if event.get("type") in ("ADDED", "MODIFIED", "DELETED") and self.cache.apply(
            str(event["type"]), obj
        ):
            self._on_change()
        return str(version) if version else None
