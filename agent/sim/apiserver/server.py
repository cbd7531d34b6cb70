"""The embedded API server: an aiohttp application around the store, with faults and a request log.

This is what the demo, the integration tests and the unit tests start instead of a kube-apiserver.
It speaks plain HTTP on a loopback address; clients get a kubeconfig with a dummy bearer token (the
token is not checked: there is no authentication or authorization).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml
from aiohttp import web
from aiohttp.typedefs import Handler

from agent.sim.apiserver.discovery import Discovery
from agent.sim.apiserver.errors import CONFLICT_MESSAGE, ApiError, status_body
from agent.sim.apiserver.faults import FaultInjector, PathPattern, RequestLog, RequestRecord
from agent.sim.apiserver.handlers import ResourceHandlers
from agent.sim.apiserver.kinds import DEFAULT_KINDS, KindRegistry, ResourceKind
from agent.sim.apiserver.limits import (
    THROTTLED_MESSAGE,
    InFlightLimit,
    RequestCounts,
    resource_of,
    verb_of,
)
from agent.sim.apiserver.openapi import OpenApi
from agent.sim.apiserver.selectors import Selector
from agent.sim.apiserver.store import ObjectStore
from agent.sim.apiserver.watch import WatchHub, parse_bool

Obj = dict[str, Any]
log = logging.getLogger(__name__)
DEBUG_PREFIX = "/debug/embedded/"
DEBUG_COUNTS = DEBUG_PREFIX + "requests"
DEBUG_RESTART = DEBUG_PREFIX + "restart"
DEBUG_OBJECTS = DEBUG_PREFIX + "objects"
DEBUG_SHED = DEBUG_PREFIX + "shed"

_FAULT_MESSAGES = {
    409: CONFLICT_MESSAGE,
    429: THROTTLED_MESSAGE,
    500: "Internal error occurred: injected fault",
    503: "the server is currently unable to handle the request",
}


class EmbeddedApiServer:
    """An in-memory Kubernetes API server for the DRA kinds the agent uses.

    Use as ``async with EmbeddedApiServer() as server:`` or call :meth:`start`/:meth:`stop`. Direct
    store access (:meth:`get_object`, :meth:`put_object`, …) must happen on the server's event loop;
    :attr:`faults`, :attr:`requests` and :meth:`end_watches` may be used from any thread.
    """

    def __init__(
        self,
        *,
        kubernetes_version: str = "1.35.0",
        kinds: Iterable[ResourceKind] = DEFAULT_KINDS,
        history_size: int = 1000,
        bookmark_interval: float = 60.0,
        token: str = "embedded-apiserver-token",
        max_in_flight: int = 0,
    ) -> None:
        self.kinds = KindRegistry(kinds)
        self.store = ObjectStore(self.kinds, history_size)
        self.faults = FaultInjector()
        self.requests = RequestLog()
        #: answered requests by verb, resource and status (``make fleet``'s table)
        self.counts = RequestCounts()
        #: opt-in load shedding: 429 with Retry-After beyond ``max_in_flight`` (0: none)
        self.in_flight = InFlightLimit(max_in_flight)
        self._plurals = frozenset(k.plural for k in self.kinds)
        self._listen: tuple[str, int] | None = None
        self._restarts: set[asyncio.Task[None]] = set()
        self.watches = WatchHub()
        self.token = token
        self._discovery = Discovery(self.kinds, kubernetes_version)
        self._openapi = OpenApi(self.kinds, self._discovery.version["gitVersion"])
        self._handlers = ResourceHandlers(
            self.store, self.watches, bookmark_interval, self._openapi.release
        )
        self._runner: web.AppRunner | None = None
        self._url: str | None = None

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def bookmark_interval(self) -> float:
        return self._handlers.bookmark_interval

    @bookmark_interval.setter
    def bookmark_interval(self, seconds: float) -> None:
        self._handlers.bookmark_interval = seconds

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the embedded API server is not started; call start() first")
        return self._url

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0 picks a free port) and return the base URL."""
        app = web.Application(middlewares=[self._middleware], client_max_size=16 * 1024 * 1024)
        app.router.add_get(DEBUG_COUNTS, self._serve_counts)
        app.router.add_post(DEBUG_RESTART, self._serve_restart)
        app.router.add_get(DEBUG_OBJECTS, self._serve_objects)
        app.router.add_post(DEBUG_SHED, self._serve_shed)
        self._discovery.add_routes(app.router)
        self._openapi.add_routes(app.router)
        self._handlers.add_routes(app.router, self.kinds)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        bound = runner.addresses[0]
        self._listen = (bound[0], bound[1])
        self._url = f"http://{bound[0]}:{bound[1]}"
        log.info("embedded API server listening on %s", self._url)
        return self._url

    async def stop(self) -> None:
        """End all watches and stop listening."""
        self.watches.end_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def restart(self, down_seconds: float = 0.5) -> None:
        """What a kube-apiserver restart looks like to its clients: every watch and
        connection drops, nothing answers for ``down_seconds``, then the same address serves
        the same objects (etcd keeps them) with the same resourceVersions."""
        if self._listen is None:
            raise RuntimeError("the embedded API server is not started; call start() first")
        host, port = self._listen
        await self.stop()
        await asyncio.sleep(down_seconds)
        await self.start(host, port)

    async def _serve_counts(self, request: web.Request) -> web.Response:
        """``GET /debug/embedded/requests``: the request counts and in-flight figures (a
        fleet run reads them from the server's process; not counted themselves)."""
        limit = self.in_flight
        body = {
            "counts": self.counts.snapshot(),
            "inFlight": {"limit": limit.limit, "peak": limit.peak, "rejected": limit.rejected},
            "openWatches": self.watches.count(),
        }
        if request.query.get("earlyRetries"):
            early = self.requests.early_retries()
            body["earlyRetries"] = [
                {
                    "userAgent": first.user_agent,
                    "method": first.method,
                    "path": first.path,
                    "retryAfter": first.retry_after,
                    "after": round(then.at - first.at, 3),
                }
                for first, then in early
            ]
        return web.Response(text=json.dumps(body), content_type="application/json")

    async def _serve_objects(self, request: web.Request) -> web.Response:
        """``GET /debug/embedded/objects?kind=K[&namespace=N][&labelSelector=S]``: the stored
        objects, for an observer whose own reads must not count as the fleet's requests."""
        query = request.query
        try:
            items = self.list_objects(
                query.get("kind", ""),
                query.get("namespace") or None,
                label_selector=query.get("labelSelector", ""),
            )
        except KeyError as error:
            raise ApiError(400, str(error)) from None
        return web.Response(text=json.dumps({"items": items}), content_type="application/json")

    async def _serve_shed(self, request: web.Request) -> web.Response:
        """``POST /debug/embedded/shed?seconds=S&retryAfter=R``: answer every request 429 with
        ``Retry-After: R`` (1 by default) for ``S`` seconds, as kube-apiserver's priority and
        fairness does when a whole fleet starts at once."""
        try:
            seconds = float(request.query.get("seconds", "20"))
            retry_after = int(request.query.get("retryAfter", "1"))
        except ValueError:
            raise ApiError(400, "seconds and retryAfter must be numbers") from None
        rule = self.faults.fail_next("*", "*", 429, count=None, retry_after=retry_after)
        asyncio.get_running_loop().call_later(seconds, self.faults.remove, rule)
        return web.Response(text=json.dumps({"seconds": seconds}), content_type="application/json")

    async def _serve_restart(self, request: web.Request) -> web.Response:
        """``POST /debug/embedded/restart?downSeconds=S``: :meth:`restart`, after answering."""
        try:
            down = float(request.query.get("downSeconds", "0.5"))
        except ValueError:
            raise ApiError(400, "downSeconds must be a number of seconds") from None
        task = asyncio.get_running_loop().create_task(self.restart(down))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)
        return web.Response(text='{"restarting":true}', content_type="application/json")

    async def __aenter__(self) -> EmbeddedApiServer:
        if self._runner is None:
            await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- kubeconfig ------------------------------------------------------------------------

    def kubeconfig_dict(self, name: str = "embedded", namespace: str = "default") -> Obj:
        """A kubeconfig with one cluster (plain HTTP), one user (dummy token) and one context."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": name, "cluster": {"server": self.url}}],
            "users": [{"name": name, "user": {"token": self.token}}],
            "contexts": [
                {"name": name, "context": {"cluster": name, "user": name, "namespace": namespace}}
            ],
            "current-context": name,
            "preferences": {},
        }

    def write_kubeconfig(self, path: str | Path) -> Path:
        """Write :meth:`kubeconfig_dict` as YAML (mode 0600, like kubeconfigs usually are)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(yaml.safe_dump(self.kubeconfig_dict(), sort_keys=False))
        target.chmod(0o600)
        return target

    # -- direct access for tests and the demo ----------------------------------------------

    @property
    def resource_version(self) -> int:
        return self.store.resource_version

    def get_object(self, kind: str, name: str, namespace: str | None = None) -> Obj | None:
        """The stored object or ``None``; ``kind`` is a plural, a Kind or ``plural.group``."""
        try:
            return self.store.get(self.kinds.resolve(kind), namespace, name)
        except ApiError as error:
            if error.code == 404:
                return None
            raise

    def list_objects(
        self,
        kind: str,
        namespace: str | None = None,
        *,
        field_selector: str = "",
        label_selector: str = "",
    ) -> list[Obj]:
        resolved = self.kinds.resolve(kind)
        selector = Selector.from_query(resolved, namespace, field_selector, label_selector)
        return self.store.select(resolved, selector)

    def put_object(self, obj: Obj) -> Obj:
        """Create or replace ``obj`` (status included), found by its ``apiVersion`` and ``kind``.

        Watches see the write like any other. Validation applies; resourceVersion checks do not.
        """
        kind = self.kinds.by_type(obj.get("apiVersion", ""), obj.get("kind", ""))
        if kind is None:
            raise KeyError(f"not served: {obj.get('apiVersion')}/{obj.get('kind')}")
        return self.store.put(kind, obj)

    def delete_object(self, kind: str, name: str, namespace: str | None = None) -> Obj | None:
        """Delete an object (and its dependents); ``None`` when it did not exist."""
        if self.get_object(kind, name, namespace) is None:
            return None
        return self.store.delete(self.kinds.resolve(kind), namespace, name)

    def end_watches(self, path: PathPattern = "*") -> int:
        """End open watches whose request path matches (glob or regex); returns how many."""
        return self.watches.end_watches(path)

    def open_watches(self, path: PathPattern = "*") -> int:
        """How many watches matching ``path`` are open now."""
        return self.watches.count(path)

    async def wait_for_watches(self, count: int, path: PathPattern = "*") -> None:
        """Wait until exactly ``count`` watches match ``path``; wrap it in a timeout."""
        await self.watches.wait_for_count(count, path)

    # -- middleware ------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(DEBUG_PREFIX):  # an observer's: not counted, never refused
            try:
                return await handler(request)
            except ApiError as error:
                return _status_response(error.status(), error.code, error.headers)
        arrived = time.monotonic()
        watching = parse_bool(request.query.get("watch"))
        plan = self.faults.plan(request.method, request.path, watching)
        status = 0  # stays 0 for a dropped connection
        retry_after: str | None = None
        seated = watching or self.in_flight.enter()
        try:
            if not seated:
                retry = str(self.in_flight.retry_after)
                raise ApiError(429, THROTTLED_MESSAGE, headers={"Retry-After": retry})
            if plan.delay:
                await asyncio.sleep(plan.delay)
            if plan.drop:
                if request.transport is not None:
                    request.transport.abort()
                return web.Response(status=499)
            if plan.fail is not None:
                rule = plan.fail
                headers = {"Retry-After": str(rule.retry_after)} if rule.retry_after else {}
                message = rule.message or _FAULT_MESSAGES.get(rule.status, "injected fault")
                raise ApiError(rule.status, message, headers=headers)
            response = await handler(request)
            status = response.status
            if plan.delay_after:
                await asyncio.sleep(plan.delay_after)
            return response
        except ApiError as error:
            status = error.code
            retry_after = error.headers.get("Retry-After") if error.headers else None
            return _status_response(error.status(), error.code, error.headers)
        except web.HTTPException as error:
            status = error.status
            reason = {404: "NotFound", 405: "MethodNotAllowed"}.get(error.status, "BadRequest")
            message = (
                "the server could not find the requested resource"
                if error.status == 404
                else error.reason
            )
            return _status_response(status_body(error.status, reason, message), error.status, {})
        except Exception as error:
            log.exception("embedded API server: %s %s failed", request.method, request.path)
            status = 500
            body = status_body(500, "InternalError", f"Internal error occurred: {error}")
            return _status_response(body, 500, {})
        finally:
            if seated and not watching:
                self.in_flight.leave()
            resource, item = resource_of(request.path, self._plurals)
            self.counts.add(verb_of(request.method, watching, item), resource, status)
            self.requests.add(
                RequestRecord(
                    request.method,
                    request.path,
                    dict(request.query),
                    status,
                    watching,
                    request.headers.get("Content-Type", ""),
                    arrived,
                    request.headers.get("User-Agent", ""),
                    None if retry_after is None else float(retry_after),
                    time.monotonic(),
                )
            )


def _status_response(body: Obj, code: int, headers: dict[str, str]) -> web.Response:
    return web.Response(
        status=code, text=json.dumps(body), content_type="application/json", headers=headers
    )
