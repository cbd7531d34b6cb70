"""Discovery documents (``/version``, ``/api``, ``/apis`` and the per-version resource lists).

Clients check the server version before choosing API versions and look up which resources a group
serves; both are answered from the kind registry, so discovery always matches what is routed.
"""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from agent.sim.apiserver.kinds import KindRegistry, ResourceKind

Obj = dict[str, Any]
_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


def version_info(kubernetes_version: str) -> Obj:
    """``/version`` for ``"1.35.0"`` or ``"v1.35.0"``."""
    git_version = (
        kubernetes_version if kubernetes_version.startswith("v") else f"v{kubernetes_version}"
    )
    m = re.match(r"^v(\d+)\.(\d+)", git_version)
    if m is None:
        raise ValueError(f"kubernetes version {kubernetes_version!r} is not like 1.35.0")
    return {
        "major": m.group(1),
        "minor": m.group(2),
        "gitVersion": git_version,
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.25.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    }


def _resources(kinds: list[ResourceKind]) -> list[Obj]:
    out: list[Obj] = []
    for kind in kinds:
        singular = kind.singular or kind.kind.lower()
        out.append({"name": kind.plural, "singularName": singular, "namespaced": kind.namespaced,
                    "kind": kind.kind, "verbs": _VERBS})  # fmt: skip
        if kind.status_subresource:
            out.append({"name": f"{kind.plural}/status", "singularName": "",
                        "namespaced": kind.namespaced, "kind": kind.kind,
                        "verbs": ["get", "patch", "update"]})  # fmt: skip
    return out


class Discovery:
    def __init__(self, kinds: KindRegistry, kubernetes_version: str) -> None:
        self.kinds = kinds
        self.version = version_info(kubernetes_version)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """Discovery paths answer with and without a trailing slash, as the real server's do."""
        routes: list[tuple[str, Any]] = [
            ("/version", self._version),
            ("/api", self._api),
            ("/apis", self._apis),
            ("/api/v1", self._core_resources),
        ]
        for group, versions in self.kinds.groups().items():
            routes.append((f"/apis/{group}", self._group))
            routes.extend((f"/apis/{group}/{v}", self._group_resources) for v in versions)
        for path, handler in routes:
            router.add_get(path, handler, allow_head=False)
            router.add_get(f"{path}/", handler, allow_head=False)

    def _group_doc(self, group: str) -> Obj:
        versions = [
            {"groupVersion": f"{group}/{v}", "version": v} for v in self.kinds.groups()[group]
        ]
        return {"name": group, "versions": versions, "preferredVersion": versions[0]}

    async def _version(self, request: web.Request) -> web.Response:
        return _json(self.version)

    async def _api(self, request: web.Request) -> web.Response:
        host = request.host
        return _json({"kind": "APIVersions", "versions": ["v1"],
                      "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0",
                                                      "serverAddress": host}]})  # fmt: skip

    async def _apis(self, request: web.Request) -> web.Response:
        groups = [self._group_doc(g) for g in self.kinds.groups()]
        return _json({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})

    async def _group(self, request: web.Request) -> web.Response:
        group = request.path.removeprefix("/apis/").rstrip("/")
        return _json({"kind": "APIGroup", "apiVersion": "v1", **self._group_doc(group)})

    async def _core_resources(self, request: web.Request) -> web.Response:
        kinds = [k for k in self.kinds if not k.group]
        return _json({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "v1",
                      "resources": _resources(kinds)})  # fmt: skip

    async def _group_resources(self, request: web.Request) -> web.Response:
        group_version = request.path.removeprefix("/apis/").rstrip("/")
        kinds = [k for k in self.kinds if k.api_version == group_version]
        return _json({"kind": "APIResourceList", "apiVersion": "v1",
                      "groupVersion": group_version, "resources": _resources(kinds)})  # fmt: skip


def _json(obj: Obj) -> web.Response:
    return web.Response(text=json.dumps(obj), content_type="application/json")
