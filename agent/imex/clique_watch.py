"""The one ComputeDomainClique a node follows, kept by a list-then-watch (no polling).

While a node serves a domain its engine re-renders the daemon's node list every second from
the members of its clique. Reading them with a GET each time would cost every idle node 60
requests a minute, a fleet's worth of load on the API server for nothing. Instead the node
watches its one clique object by name (``fieldSelector=metadata.name=<domainUID>.<cliqueID>``):
one LIST, then a WATCH from the list's resourceVersion, resumed when it ends, re-listed after
410 Gone, retried with jittered backoff otherwise (after an API server restart the fleet's
reconnects spread out rather than arrive in lockstep). An idle watch costs no request.

:meth:`CliqueWatch.members` answers from the cache once the watch of that name has listed;
before that (or for another name) the caller reads the object itself.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio

from agent.imex.cliques import CLIQUE_PLURAL, daemon_entries
from agent.imex.documents import GROUP, VERSION, NodeEntry, Obj
from agent.kube.backoff import Backoff, retry_after
from agent.kube.rawcall import WatchExpiredError, open_watch, watch_events

log = logging.getLogger(__name__)


class CliqueWatch:
    def __init__(
        self,
        api_client: Any,
        call: Any,
        namespace: str,
        *,
        request_timeout: float = 10.0,
        watch_timeout: int = 300,
        backoff: Backoff | None = None,
    ) -> None:
        from agent.kube.library import CustomObjectsApi

        self._custom = CustomObjectsApi(api_client)
        self._call = call  # one JSON call (DomainApi.call: timeout, 429s waited out)
        self.namespace = namespace
        self.request_timeout = request_timeout
        self.watch_timeout = watch_timeout
        self._backoff = backoff or Backoff(initial=0.2, maximum=5.0)
        self._wanted: str | None = None
        self._changed = anyio.Event()
        #: name -> the object as last seen (None: it does not exist); only the wanted name
        self._cache: dict[str, Obj | None] = {}
        #: LIST and WATCH requests sent (the fleet benchmark's re-list count)
        self.lists = 0
        self.watches = 0

    def follow(self, name: str | None) -> None:
        """Follow the clique ``name`` from now on (None: none)."""
        if name != self._wanted:
            self._wanted = name
            self._cache.clear()
            self._changed.set()

    def daemons(self, name: str) -> list[NodeEntry] | None:
        """The daemons of clique ``name`` in the object's order; None when not known."""
        if name != self._wanted or name not in self._cache:
            return None
        return daemon_entries(self._cache[name])

    def members(self, name: str) -> list[NodeEntry] | None:
        """The daemons of clique ``name`` as the watch last saw them; None when not known."""
        if name != self._wanted or name not in self._cache:
            return None
        return sorted(daemon_entries(self._cache[name]), key=lambda e: e.index)

    async def run(self) -> None:
        """Follow the wanted clique until cancelled; a new name restarts the watch."""
        while True:
            changed = self._changed
            name = self._wanted
            async with anyio.create_task_group() as group:
                if name is not None:
                    group.start_soon(self._follow, name)
                await changed.wait()
                group.cancel_scope.cancel()
            self._changed = anyio.Event()

    async def _follow(self, name: str) -> None:
        version: str | None = None
        while True:
            try:
                if version is None:
                    version = await self._list(name)
                version = await self._watch(name, version)
                self._backoff.reset()
            except WatchExpiredError:
                version = None
            except Exception as error:
                version = None
                delay = self._backoff.next_delay(retry_after(error))
                log.info("watching ComputeDomainClique %s: %r; again in %.2f s", name, error, delay)
                await anyio.sleep(delay)

    async def _list(self, name: str) -> str:
        self.lists += 1
        listed = await self._call(
            self._custom.list_namespaced_custom_object,
            GROUP, VERSION, self.namespace, CLIQUE_PLURAL, field_selector=f"metadata.name={name}",
        )  # fmt: skip
        items = listed.get("items") or []
        self._cache[name] = items[0] if items else None
        return str((listed.get("metadata") or {}).get("resourceVersion", ""))

    async def _watch(self, name: str, version: str) -> str:
        """One watch request from ``version``; returns the last version seen."""
        self.watches += 1
        response = await open_watch(
            self._custom.list_namespaced_custom_object,
            GROUP, VERSION, self.namespace, CLIQUE_PLURAL,
            connect_timeout=self.request_timeout, timeout_seconds=self.watch_timeout,
            field_selector=f"metadata.name={name}", resource_version=version,
        )  # fmt: skip
        started, events = anyio.current_time(), 0
        try:
            async for event in watch_events(response):
                kind, obj = event.get("type"), event.get("object") or {}
                events += 1
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED"):
                    self._cache[name] = obj
                elif kind == "DELETED":
                    self._cache[name] = None
        finally:
            response.close()
        if events == 0 and anyio.current_time() - started < 1.0:
            await anyio.sleep(self._backoff.next_delay())  # a server ending watches at once
        return version
