"""Server-side field validation: the fields of a request body that its kind's schema lacks.

kubectl 1.32 leaves validation to the server whenever the server's OpenAPI says it can (a
``fieldValidation`` parameter on the kind's PATCH operation, which ours says), and sends
``fieldValidation=Strict`` (``--validate=strict``, the default), ``Warn`` or ``Ignore``. As in
kube-apiserver, Strict refuses a body with unknown fields (400 for a create or replace, 422
for a patch, naming every one: ``strict decoding error: unknown field "spec.foo"``), Warn
answers with one ``Warning`` header per unknown field and stores the object without them.
A request without the parameter is not checked here (kube-apiserver would warn), which
keeps the agent's own writes, which never name it, as cheap as before.
"""

from __future__ import annotations

import json
from typing import Any

from agent.sim.apiserver.errors import ApiError
from agent.sim.apiserver.kinds import ResourceKind
from agent.sim.apiserver.schema_index import SchemaIndex

Obj = dict[str, Any]
DIRECTIVES = ("Ignore", "Warn", "Strict")


def directive(query: Any) -> str:
    """The request's ``fieldValidation``; "" when it names none (nothing is checked then)."""
    value = str(query.get("fieldValidation", ""))
    if value and value not in DIRECTIVES:
        raise ApiError(
            422,
            f'PatchOptions.meta.k8s.io "" is invalid: fieldValidation: Unsupported value: '
            f'"{value}": supported values: "Ignore", "Strict", "Warn"',
        )
    return value


def _walk(index: SchemaIndex, node: Obj, value: Any, path: str, out: list[str]) -> Any:
    """Collect unknown fields below ``path`` into ``out``; returns the value without them
    (what kube-apiserver stores: unknown fields are dropped when not refused)."""
    node = index.resolve(node)
    if isinstance(value, dict):
        props = node.get("properties")
        extra = node.get("additionalProperties")
        preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
        if props is None and not isinstance(extra, dict):
            return value  # untyped (RawExtension, a free-form map): anything goes
        kept: Obj = {}
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if props is not None and key in props:
                kept[key] = _walk(index, props[key], item, where, out)
            elif isinstance(extra, dict):
                kept[key] = _walk(index, extra, item, where, out)
            elif preserve:
                kept[key] = item
            else:
                out.append(where)
        return kept
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [
            _walk(index, node["items"], item, f"{path}[{i}]", out) for i, item in enumerate(value)
        ]
    return value


def unknown_fields(index: SchemaIndex, kind: ResourceKind, obj: Obj) -> tuple[list[str], Obj]:
    """The unknown fields of ``obj`` (in body order) and ``obj`` without them; nothing is
    unknown for a kind without a schema."""
    schema = index.schema_for(kind.group, kind.version, kind.kind)
    if schema is None:
        return [], obj
    found: list[str] = []
    pruned = _walk(index, schema, obj, "", found)
    return found, pruned


def strict_message(fields: list[str]) -> str:
    return "strict decoding error: " + ", ".join(f'unknown field "{f}"' for f in fields)


def check_body(
    index: SchemaIndex, kind: ResourceKind, obj: Obj, mode: str, *, patch: Any = None
) -> tuple[Obj, list[str]]:
    """Apply the directive to a create, replace (``patch`` None) or patch result: returns
    the object to store and the warnings to send, or raises kube-apiserver's refusal."""
    if mode in ("", "Ignore"):
        return obj, []
    fields, pruned = unknown_fields(index, kind, obj)
    if not fields:
        return obj, []
    if mode == "Warn":
        return pruned, [f'unknown field "{f}"' for f in fields]
    if patch is None:
        raise ApiError(
            400,
            f'{kind.kind} in version "{kind.version}" cannot be handled as a {kind.kind}: '
            f"{strict_message(fields)}",
        )
    shown = json.dumps(patch, separators=(",", ":"))
    raise ApiError(
        422,
        f' "" is invalid: patch: Invalid value: "{shown}": {strict_message(fields)}',
        causes=[{"reason": "FieldValueInvalid", "message": strict_message(fields),
                 "field": "patch"}],
    )  # fmt: skip
