"""REST handlers for every registered kind: the verbs of the Kubernetes API on the store.

Routes are generated from the kind registry (collection, item and, where the kind has one, the
``status`` subresource; namespaced kinds also get the all-namespaces collection for list/watch), so the
handlers are written once. Errors are raised as :class:`ApiError` and rendered by the server middleware.
"""

from __future__ import annotations

import base64
import json
from functools import partial
from typing import Any

from aiohttp import web

from agent.sim.apiserver.errors import ApiError
from agent.sim.apiserver.kinds import KindRegistry, ResourceKind
from agent.sim.apiserver.patch import apply_patch
from agent.sim.apiserver.selectors import Selector
from agent.sim.apiserver.store import ObjectStore
from agent.sim.apiserver.watch import WatchHub, parse_bool, query_number, serve_watch

Obj = dict[str, Any]


class ResourceHandlers:
    def __init__(self, store: ObjectStore, hub: WatchHub, bookmark_interval: float = 60.0) -> None:
        self.store = store
        self.hub = hub
        self.bookmark_interval = bookmark_interval

    def add_routes(self, router: web.UrlDispatcher, kinds: KindRegistry) -> None:
        for kind in kinds:
            base = f"/{kind.prefix}"
            coll = (
                f"{base}/namespaces/{{namespace}}/{kind.plural}"
                if kind.namespaced
                else f"{base}/{kind.plural}"
            )
            item = f"{coll}/{{name}}"
            router.add_get(coll, partial(self.list_or_watch, kind), allow_head=False)
            router.add_post(coll, partial(self.create, kind))
            router.add_delete(coll, partial(self.delete_collection, kind))
            if kind.namespaced:
                router.add_get(f"{base}/{kind.plural}", partial(self.list_or_watch, kind),
                               allow_head=False)  # fmt: skip
            router.add_get(item, partial(self.read, kind), allow_head=False)
            router.add_put(item, partial(self.replace, kind, False))
            router.add_patch(item, partial(self.patch, kind, False))
            router.add_delete(item, partial(self.delete, kind))
            if kind.status_subresource:
                router.add_get(f"{item}/status", partial(self.read, kind), allow_head=False)
                router.add_put(f"{item}/status", partial(self.replace, kind, True))
                router.add_patch(f"{item}/status", partial(self.patch, kind, True))

    # -- verbs -----------------------------------------------------------------------------

    async def list_or_watch(self, kind: ResourceKind, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info.get("namespace")
        selector = Selector.from_query(
            kind,
            namespace,
            request.query.get("fieldSelector", ""),
            request.query.get("labelSelector", ""),
        )
        if parse_bool(request.query.get("watch")):
            return await serve_watch(
                request, self.store, self.hub, kind, selector, self.bookmark_interval
            )
        items = self.store.select(kind, selector)
        meta: Obj = {"resourceVersion": str(self.store.resource_version)}
        items, meta = _paginate(items, meta, request.query)
        if not kind.custom:
            for item in items:
                item.pop("kind", None)
                item.pop("apiVersion", None)
        return _json({"kind": kind.list_kind, "apiVersion": kind.api_version, "metadata": meta,
                      "items": items})  # fmt: skip

    async def read(self, kind: ResourceKind, request: web.Request) -> web.Response:
        namespace, name = request.match_info.get("namespace"), request.match_info["name"]
        return _json(self.store.get(kind, namespace, name))

    async def create(self, kind: ResourceKind, request: web.Request) -> web.Response:
        body = await _body(request)
        return _json(self.store.create(kind, request.match_info.get("namespace"), body), 201)

    async def replace(
        self, kind: ResourceKind, status_only: bool, request: web.Request
    ) -> web.Response:
        namespace, name = request.match_info.get("namespace"), request.match_info["name"]
        body = await _body(request)
        return _json(self.store.update(kind, namespace, name, body, status_only=status_only))

    async def patch(
        self, kind: ResourceKind, status_only: bool, request: web.Request
    ) -> web.Response:
        namespace, name = request.match_info.get("namespace"), request.match_info["name"]
        body = await _body(request)
        current = self.store.get(kind, namespace, name)
        patched = apply_patch(request.headers.get("Content-Type", ""), current, body)
        if not isinstance(patched, dict):
            raise ApiError(
                422, "the patch result is not a JSON object", name=name, kind=kind.plural
            )
        return _json(self.store.update(kind, namespace, name, patched, status_only=status_only))

    async def delete(self, kind: ResourceKind, request: web.Request) -> web.Response:
        namespace, name = request.match_info.get("namespace"), request.match_info["name"]
        options = await _body(request, optional=True)
        preconditions = options.get("preconditions") if options else None
        return _json(self.store.delete(kind, namespace, name, preconditions))

    async def delete_collection(self, kind: ResourceKind, request: web.Request) -> web.Response:
        namespace = request.match_info.get("namespace")
        selector = Selector.from_query(
            kind,
            namespace,
            request.query.get("fieldSelector", ""),
            request.query.get("labelSelector", ""),
        )
        deleted: list[Obj] = []
        for obj in self.store.select(kind, selector):
            meta = obj["metadata"]
            try:
                deleted.append(self.store.delete(kind, meta.get("namespace"), meta["name"]))
            except ApiError as error:
                if error.code != 404:  # removed meanwhile by cascading deletion
                    raise
        return _json({"kind": kind.list_kind, "apiVersion": kind.api_version,
                      "metadata": {"resourceVersion": str(self.store.resource_version)},
                      "items": deleted})  # fmt: skip


def _json(obj: Obj, status: int = 200) -> web.Response:
    return web.Response(
        status=status, text=json.dumps(obj, separators=(",", ":")), content_type="application/json"
    )


async def _body(request: web.Request, optional: bool = False) -> Any:
    text = await request.text()
    if not text.strip():
        if optional:
            return None
        raise ApiError(400, "the request body is empty; a JSON object is required")
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from error


def _paginate(items: list[Obj], meta: Obj, query: Any) -> tuple[list[Obj], Obj]:
    """``limit``/``continue`` over the name-sorted result; the token names the last key returned."""
    token = query.get("continue", "")
    if token:
        try:
            after = tuple(json.loads(base64.urlsafe_b64decode(token.encode())))
        except (ValueError, TypeError) as error:
            raise ApiError(400, f"invalid continue token: {token!r}") from error
        items = [i for i in items if _key(i) > after]
    limit = query_number(query, "limit") or 0
    if 0 < limit < len(items):
        rest = len(items) - limit
        items = items[:limit]
        last = json.dumps(list(_key(items[-1]))).encode()
        meta["continue"] = base64.urlsafe_b64encode(last).decode()
        meta["remainingItemCount"] = rest
    return items, meta


def _key(obj: Obj) -> tuple[str, str]:
    meta = obj.get("metadata", {})
    return (meta.get("namespace", ""), meta.get("name", ""))
