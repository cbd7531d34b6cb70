"""REST handlers for every registered kind: the verbs of the Kubernetes API on the store.

Routes are generated from the kind registry (collection, item and, where the kind has one, the
``status`` subresource; namespaced kinds also get the all-namespaces collection for list/watch), so the
handlers are written once. Errors are raised as :class:`ApiError` and rendered by the server middleware.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from functools import partial
from typing import Any

from aiohttp import web

from agent.sim.apiserver.apply import server_side_apply
from agent.sim.apiserver.errors import ApiError
from agent.sim.apiserver.fieldcheck import check_body, directive
from agent.sim.apiserver.kinds import KindRegistry, ResourceKind
from agent.sim.apiserver.patch import APPLY_PATCH, apply_patch, media_type
from agent.sim.apiserver.printers import utc_now
from agent.sim.apiserver.schema_index import SchemaIndex, schema_index
from agent.sim.apiserver.selectors import Selector
from agent.sim.apiserver.store import ObjectStore, now_rfc3339
from agent.sim.apiserver.tables import include_object, table, table_version
from agent.sim.apiserver.watch import WatchHub, parse_bool, query_number, serve_watch
from agent.yamlload import YAMLError, safe_load

Obj = dict[str, Any]


class ResourceHandlers:
    def __init__(
        self,
        store: ObjectStore,
        hub: WatchHub,
        bookmark_interval: float = 60.0,
        release: str = "1.35",
    ) -> None:
        self.store = store
        self.hub = hub
        self.bookmark_interval = bookmark_interval
        #: the Kubernetes release whose schemas validate, apply and print (read on first use)
        self.release = release

    @property
    def schemas(self) -> SchemaIndex:
        return schema_index(self.release)

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
        version = table_version(request.headers.get("Accept", ""))
        include = include_object(request.query)
        if parse_bool(request.query.get("watch")):
            transform = None if version is None else _table_events(kind, version, include)
            return await serve_watch(
                request, self.store, self.hub, kind, selector, self.bookmark_interval, transform
            )
        items = self.store.select(kind, selector)
        meta: Obj = {"resourceVersion": str(self.store.resource_version)}
        items, meta = _paginate(items, meta, request.query)
        if version is not None:
            return _json(table(kind, items, version=version, include=include, metadata=meta,
                               now=utc_now()))  # fmt: skip
        if not kind.custom:
            for item in items:
                item.pop("kind", None)
                item.pop("apiVersion", None)
        return _json({"kind": kind.list_kind, "apiVersion": kind.api_version, "metadata": meta,
                      "items": items})  # fmt: skip

    async def read(self, kind: ResourceKind, request: web.Request) -> web.Response:
        namespace, name = request.match_info.get("namespace"), request.match_info["name"]
        obj = self.store.get(kind, namespace, name)
        version = table_version(request.headers.get("Accept", ""))
        if version is not None:
            meta = {"resourceVersion": obj["metadata"].get("resourceVersion", "")}
            return _json(table(kind, [obj], version=version, include=include_object(request.query),
                               metadata=meta, now=utc_now()))  # fmt: skip
        return _json(obj)

    async def create(self, kind: ResourceKind, request: web.Request) -> web.Response:
        body, warnings = self._validated(kind, request, await _body(request))
        created = self.store.create(kind, request.match_info.get("namespace"), body)
        return _json(created, 201, warnings)

    def _validated(
        self, kind: ResourceKind, request: web.Request, body: Any, patch: Any = None
    ) -> tuple[Any, list[str]]:
        """``fieldValidation``: the body without unknown fields and the warnings to send."""
        mode = directive(request.query)
        if mode in ("", "Ignore") or not isinstance(body, dict):
            return body, []
        return check_body(self.schemas, kind, body, mode, patch=patch)

    async def replace(
        self, kind: ResourceKind, status_only: bool, request: web.Request
    ) -> web.Response:
        namespace, name = request.match_info.get("namespace"), request.match_info["name"]
        body, warnings = self._validated(kind, request, await _body(request))
        updated = self.store.update(kind, namespace, name, body, status_only=status_only)
        return _json(updated, 200, warnings)

    async def patch(
        self, kind: ResourceKind, status_only: bool, request: web.Request
    ) -> web.Response:
        namespace, name = request.match_info.get("namespace"), request.match_info["name"]
        content_type = request.headers.get("Content-Type", "")
        if media_type(content_type) == APPLY_PATCH:
            return await self._apply(kind, status_only, request, namespace, name)
        if "force" in request.query:
            raise ApiError(422, 'PatchOptions.meta.k8s.io "" is invalid: force: Forbidden: '
                           "may not be specified for non-apply patch")  # fmt: skip
        body = await _body(request)
        current = self.store.get(kind, namespace, name)
        patched = apply_patch(content_type, current, body)
        if not isinstance(patched, dict):
            raise ApiError(
                422, "the patch result is not a JSON object", name=name, kind=kind.plural
            )
        patched, warnings = self._validated(kind, request, patched, patch=patched)
        updated = self.store.update(kind, namespace, name, patched, status_only=status_only)
        return _json(updated, 200, warnings)

    async def _apply(
        self,
        kind: ResourceKind,
        status_only: bool,
        request: web.Request,
        namespace: str | None,
        name: str,
    ) -> web.Response:
        """Server-side apply: create or merge, managed fields, conflicts (:mod:`.apply`)."""
        text = await request.text()
        try:
            config = safe_load(text) if text.strip() else None
        except YAMLError as error:
            raise ApiError(400, f"error decoding YAML: {error}") from error
        try:
            live: Obj | None = self.store.get(kind, namespace, name)
        except ApiError as error:
            if error.code != 404 or status_only:
                raise
            live = None
        merged = server_side_apply(
            self.schemas, kind, live, config, name=name, namespace=namespace,
            manager=request.query.get("fieldManager", ""),
            force=parse_bool(request.query.get("force")), now=now_rfc3339(), status=status_only,
        )  # fmt: skip
        if live is None:
            return _json(self.store.create(kind, namespace, merged), 201)
        if merged is live:
            return _json(live)
        return _json(self.store.update(kind, namespace, name, merged, status_only=status_only))

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


def _json(obj: Obj, status: int = 200, warnings: list[str] | None = None) -> web.Response:
    response = web.Response(
        status=status, text=json.dumps(obj, separators=(",", ":")), content_type="application/json"
    )
    for warning in warnings or ():
        response.headers.add("Warning", "299 - " + json.dumps(warning))
    return response


def _table_events(kind: ResourceKind, version: str, include: str) -> Callable[[Obj], Obj]:
    """Each watched object as a Table of one row; column definitions only in the first."""
    first = [True]

    def convert(obj: Obj) -> Obj:
        headers, first[0] = first[0], False
        meta = {"resourceVersion": obj.get("metadata", {}).get("resourceVersion", "")}
        return table(kind, [obj], version=version, include=include, metadata=meta,
                     now=utc_now(), headers=headers)  # fmt: skip

    return convert


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
