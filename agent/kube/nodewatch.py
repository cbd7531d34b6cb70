"""The uid of this node's Node object, followed with a list-then-watch.

The slices name the Node as their controlling owner (by uid), so that Kubernetes deletes them
with the Node. A Node can be deleted and registered again under the same name (a node re-joins
the cluster, someone runs ``kubectl delete node``): the new object has a new uid, the garbage
collector deletes the slices owned by the old one, and slices that still name the old uid are
orphans it will delete again. The publisher must therefore learn the new uid as soon as the Node
is back, and re-own its slices. A periodic GET would cost one request per node per period on
the API server; a watch of one Node by name costs nothing while nothing changes, and tells
within milliseconds.

One LIST by ``metadata.name`` (the Node may not exist yet), then a WATCH from the list's
resourceVersion; a watch that ends is resumed, 410 Gone lists again, other failures back off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import anyio

from agent.kube.backoff import Backoff, retry_after
from agent.kube.rawapi import RawSliceApi, WatchExpiredError

Obj = dict[str, Any]
log = logging.getLogger(__name__)


class NodeWatcher:
    """Calls ``on_uid(uid)`` whenever the Node named ``node_name`` has a uid not seen before."""

    def __init__(
        self,
        api: RawSliceApi,
        node_name: str,
        *,
        on_uid: Callable[[str], None],
        uid: str | None = None,
        watch_timeout: int = 240,
        backoff: Backoff | None = None,
    ) -> None:
        self.node_name = node_name
        #: The uid of the Node as last seen (None: not seen yet).
        self.uid = uid
        self._api = api
        self._selector = f"metadata.name={node_name}"
        self._on_uid = on_uid
        self._watch_timeout = watch_timeout
        self._backoff = backoff or Backoff()

    async def run(self) -> None:
        """List and watch until cancelled."""
        version: str | None = None
        while True:
            try:
                if version is None:
                    version = await self._list()
                started, events = anyio.current_time(), 0
                stream = self._api.watch(self._selector, version, self._watch_timeout, nodes=True)
                async with aclosing(stream) as watch_events:
                    async for event in watch_events:
                        events += 1
                        version = self._handle(event) or version
                        self._backoff.reset()
                if events == 0 and anyio.current_time() - started < 1.0:
                    await anyio.sleep(self._backoff.next_delay())  # a server ending watches at once
            except WatchExpiredError:
                version = None
                await anyio.sleep(self._backoff.next_delay())
            except Exception as error:
                delay = self._backoff.next_delay(retry_after(error))
                log.warning(
                    "Node %s list/watch failed: %r; retrying in %.2f s",
                    self.node_name,
                    error,
                    delay,
                )
                await anyio.sleep(delay)

    async def _list(self) -> str:
        listed = await self._api.list_nodes(self._selector)
        for item in listed.get("items") or []:
            self._seen(item)
        return str((listed.get("metadata") or {}).get("resourceVersion", ""))

    def _handle(self, event: Obj) -> str | None:
        obj = event.get("object") or {}
        kind = event.get("type")
        if kind in ("ADDED", "MODIFIED"):
            self._seen(obj)
        elif kind == "DELETED":
            log.warning(
                "Node %s was deleted; its slices keep naming it until it is registered again",
                self.node_name,
            )
        version = (obj.get("metadata") or {}).get("resourceVersion")
        return str(version) if version else None

    def _seen(self, node: Obj) -> None:
        metadata = node.get("metadata") or {}
        uid = metadata.get("uid")
        if metadata.get("name") != self.node_name or not isinstance(uid, str) or not uid:
            return
        if uid == self.uid:
            return
        previous, self.uid = self.uid, uid
        if previous is not None:
            log.warning(
                "Node %s was recreated (uid %s, before %s); re-owning its ResourceSlices",
                self.node_name,
                uid,
                previous,
            )
        self._on_uid(uid)
