"""``/openapi/v2`` and ``/openapi/v3``: the served kinds' schemas, as kube-apiserver publishes them.

kubectl reads them before it writes: ``apply`` asks OpenAPI v3 (v2 as a fallback) whether the
server validates fields itself (a PATCH operation for the kind with a ``fieldValidation``
parameter) and computes strategic merge patches from the schemas' patch extensions;
``explain`` walks the kind's v3 schema. v3 is a discovery document (one entry per
group-version, a content hash in its URL) and one document per group-version with the paths
of its kinds and every component schema they reach. v2 is one document with everything,
served as JSON only (kube-apiserver also serves it as protobuf; a client that accepts nothing
but protobuf gets 406).
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from typing import Any

from aiohttp import web

from agent.sim.apiserver.errors import ApiError
from agent.sim.apiserver.kinds import KindRegistry, ResourceKind
from agent.sim.apiserver.schema_index import (
    META,
    REF_PREFIX,
    SchemaIndex,
    release_for,
    schema_index,
)

Obj = dict[str, Any]
_PATCH_TYPES = (
    "application/apply-patch+yaml",
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
)
_QUERY = {
    "dryRun": "When present, indicates that modifications should not be persisted.",
    "fieldManager": "fieldManager is a name associated with the actor or entity that is "
    "making these changes.",
    "fieldValidation": "fieldValidation instructs the server on how to handle objects in the "
    "request containing unknown or duplicate fields: Ignore, Warn or Strict.",
    "force": 'Force is going to "force" Apply requests: the user re-acquires conflicting '
    "fields owned by other people.",
}
_WRITE = ("dryRun", "fieldManager", "fieldValidation")
_META_ROOTS = tuple(META + n for n in ("Status", "DeleteOptions", "WatchEvent", "Patch"))


def _tag(kind: ResourceKind) -> str:
    return f"{kind.group.split('.')[0] if kind.group else 'core'}_{kind.version}"


def _ref(name: str) -> Obj:
    return {"$ref": REF_PREFIX + name}


def _operation(
    kind: ResourceKind, schema: str | None, action: str, params: tuple[str, ...], body: str
) -> Obj:
    """One operation: the GVK extension and the query parameters are what kubectl reads."""
    op: Obj = {
        "description": f"{action} {kind.kind}",
        "operationId": f"{action}{_tag(kind).title().replace('_', '')}{kind.kind}",
        "tags": [_tag(kind)],
        "parameters": [
            {
                "name": name,
                "in": "query",
                "description": _QUERY[name],
                "schema": {"type": "boolean" if name == "force" else "string", "uniqueItems": True},
            }
            for name in params
        ],
        "responses": {"200": {"description": "OK"}, "401": {"description": "Unauthorized"}},
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {
            "group": kind.group,
            "kind": kind.kind,
            "version": kind.version,
        },
    }
    if schema is not None:
        returned = schema + "List" if action in ("list", "deletecollection") else schema
        op["responses"]["200"]["content"] = {"application/json": {"schema": _ref(returned)}}
    if body == "patch":
        types = [t for t in _PATCH_TYPES if not (kind.custom and "strategic" in t)]
        op["requestBody"] = {
            "content": {t: {"schema": _ref(META + "Patch")} for t in types},
            "required": True,
        }
    elif body and schema is not None:
        op["requestBody"] = {
            "content": {"application/json": {"schema": _ref(schema)}},
            "required": True,
        }
    return op


def kind_paths(kind: ResourceKind, schema: str | None) -> dict[str, Obj]:
    """The path items of one kind, in OpenAPI 3 form."""
    base = f"/{kind.prefix}"
    coll = (
        f"{base}/namespaces/{{namespace}}/{kind.plural}" if kind.namespaced
        else f"{base}/{kind.plural}"
    )  # fmt: skip
    item = f"{coll}/{{name}}"

    def op(action: str, params: tuple[str, ...] = (), body: str = "") -> Obj:
        return _operation(kind, schema, action, params, body)

    out: dict[str, Obj] = {
        coll: {"get": op("list"), "post": op("post", _WRITE, "object"),
               "delete": op("deletecollection")},
        item: {"get": op("get"), "put": op("put", _WRITE, "object"),
               "patch": op("patch", (*_WRITE, "force"), "patch"), "delete": op("delete")},
    }  # fmt: skip
    if kind.namespaced:
        out[f"{base}/{kind.plural}"] = {"get": op("list")}
    if kind.status_subresource:
        out[f"{item}/status"] = {"get": op("get"), "put": op("put", _WRITE, "object"),
                                 "patch": op("patch", (*_WRITE, "force"), "patch")}  # fmt: skip
    for path, path_item in out.items():
        path_item["parameters"] = [
            {"name": n, "in": "path", "required": True, "description": f"{n} of the object",
             "schema": {"type": "string", "uniqueItems": True}}
            for n in ("namespace", "name") if "{" + n + "}" in path
        ]  # fmt: skip
    return out


def to_v2(node: Any) -> Any:
    """An OpenAPI 3 schema node in Swagger 2 form: references to ``#/definitions/``, a
    described reference as a ``$ref`` with siblings, int-or-string and quantities as strings."""
    if isinstance(node, list):
        return [to_v2(item) for item in node]
    if not isinstance(node, dict):
        return node
    if "oneOf" in node and all("type" in s for s in node["oneOf"]):
        types = sorted(s["type"] for s in node["oneOf"])
        out = {k: to_v2(v) for k, v in node.items() if k != "oneOf"}
        out["type"] = "string"
        if types == ["integer", "string"]:
            out["format"] = "int-or-string"
        return out
    out = {k: to_v2(v) for k, v in node.items()}
    if len(node.get("allOf", ())) == 1 and "$ref" in node["allOf"][0]:
        out["$ref"] = out.pop("allOf")[0]["$ref"]
    if isinstance(out.get("$ref"), str):
        out["$ref"] = out["$ref"].replace(REF_PREFIX, "#/definitions/")
    return out


def _param_v2(param: Obj) -> Obj:
    out = {k: v for k, v in param.items() if k != "schema"}
    out.update(param.get("schema", {}))
    return out


def _operation_v2(op: Obj) -> Obj:
    out = {k: v for k, v in op.items() if k not in ("requestBody", "responses", "parameters")}
    params = [_param_v2(p) for p in op["parameters"]]
    if "requestBody" in op:
        content = op["requestBody"]["content"]
        out["consumes"] = list(content)
        schema = to_v2(next(iter(content.values()))["schema"])
        params.append({"name": "body", "in": "body", "required": True, "schema": schema})
    out["parameters"] = params
    out["produces"] = ["application/json"]
    responses: Obj = {}
    for code, response in op["responses"].items():
        responses[code] = {"description": response["description"]}
        if "content" in response:
            responses[code]["schema"] = to_v2(response["content"]["application/json"]["schema"])
    out["responses"] = responses
    return out


class OpenApi:
    """The documents of one server, built on their first request and kept (kinds never change)."""

    def __init__(self, kinds: KindRegistry, git_version: str) -> None:
        self.kinds = kinds
        self.git_version = git_version
        self.release = release_for(git_version)

    @property
    def index(self) -> SchemaIndex:
        return schema_index(self.release)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/openapi/v2", self._serve_v2, allow_head=False)
        router.add_get("/openapi/v3", self._serve_v3_root, allow_head=False)
        router.add_get("/openapi/v3/{path:.+}", self._serve_v3, allow_head=False)

    def document(self, kinds: list[ResourceKind]) -> Obj:
        """The OpenAPI 3 document of these kinds: their paths and every schema they reach."""
        paths: dict[str, Obj] = {}
        roots = list(_META_ROOTS)
        for kind in kinds:
            name = self.index.name_for(kind.group, kind.version, kind.kind)
            if name is not None:
                roots += [name, name + "List"]
            paths.update(kind_paths(kind, name))
        schemas = {n: self.index.schemas[n] for n in self.index.closure(roots)}
        security = {"type": "apiKey", "name": "authorization", "in": "header",
                    "description": "Bearer Token authentication"}  # fmt: skip
        return {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": self.git_version},
            "paths": paths,
            "components": {"schemas": schemas, "securitySchemes": {"BearerToken": security}},
        }

    @cached_property
    def v3_documents(self) -> dict[str, bytes]:
        """``api/v1`` or ``apis/<group>/<version>`` -> the encoded document."""
        by_prefix: dict[str, list[ResourceKind]] = {}
        for kind in self.kinds:
            by_prefix.setdefault(kind.prefix, []).append(kind)
        return {
            prefix: json.dumps(self.document(kinds), separators=(",", ":")).encode()
            for prefix, kinds in by_prefix.items()
        }

    @cached_property
    def v2_document(self) -> bytes:
        doc = self.document(list(self.kinds))
        paths = {
            path: {
                verb: [_param_v2(p) for p in op] if verb == "parameters" else _operation_v2(op)
                for verb, op in item.items()
            }
            for path, item in doc["paths"].items()
        }
        v2 = {
            "swagger": "2.0",
            "info": doc["info"],
            "paths": paths,
            "definitions": to_v2(doc["components"]["schemas"]),
            "securityDefinitions": doc["components"]["securitySchemes"],
            "security": [{"BearerToken": []}],
        }
        return json.dumps(v2, separators=(",", ":")).encode()

    async def _serve_v2(self, request: web.Request) -> web.Response:
        accept = request.headers.get("Accept", "")
        media = [t.split(";")[0].strip() for t in accept.split(",")] if accept else []
        if media and not {"application/json", "*/*", "application/*"} & set(media):
            raise ApiError(
                406,
                "the embedded API server serves OpenAPI v2 as application/json only",
                reason="NotAcceptable",
            )
        return _json_bytes(self.v2_document)

    async def _serve_v3_root(self, request: web.Request) -> web.Response:
        paths = {
            prefix: {"serverRelativeURL": f"/openapi/v3/{prefix}?hash={_hash(data)}"}
            for prefix, data in self.v3_documents.items()
        }
        return _json_bytes(json.dumps({"paths": paths}).encode())

    async def _serve_v3(self, request: web.Request) -> web.Response:
        data = self.v3_documents.get(request.match_info["path"].strip("/"))
        if data is None:
            raise ApiError(404, "the server could not find the requested resource")
        return _json_bytes(data, etag=_hash(data))


def _hash(data: bytes) -> str:
    return hashlib.sha512(data).hexdigest().upper()


def _json_bytes(data: bytes, etag: str | None = None) -> web.Response:
    headers = {"ETag": f'"{etag}"'} if etag else None
    return web.Response(body=data, content_type="application/json", headers=headers)
