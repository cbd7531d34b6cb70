"""PATCH bodies: JSON merge patch (RFC 7386) and JSON patch (RFC 6902).

Strategic merge patch is served with merge-patch semantics: maps merge recursively, ``null`` deletes a
key, and lists are replaced as a whole. The real server merges some lists by key (e.g. a Node's
``status.conditions`` by ``type``) and honours ``$patch``/``$retainKeys`` directives; none of our kinds'
writers rely on that, so clients that send a full list get the same result as against a real cluster.
"""

from __future__ import annotations

import copy
from typing import Any

from agent.sim.apiserver.errors import ApiError

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply: agent.sim.apiserver.apply
SUPPORTED_PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH)


def media_type(content_type: str) -> str:
    """The media type of a ``Content-Type`` (parameters such as ``charset`` dropped)."""
    return content_type.split(";")[0].strip().lower()


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: apply ``patch`` to a copy of ``target``."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, f"json patch: invalid path {path!r}: must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], path: str) -> Any:
    current = doc
    for part in parts[:-1]:
        if isinstance(current, dict) and part in current:
            current = current[part]
        elif isinstance(current, list) and part.isdigit() and int(part) < len(current):
            current = current[int(part)]
        else:
            raise ApiError(422, f"json patch: path {path!r} does not exist")
    return current


def _get(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return doc
    parent = _parent(doc, parts, path)
    last = parts[-1]
    if isinstance(parent, dict) and last in parent:
        return parent[last]
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent[int(last)]
    raise ApiError(422, f"json patch: path {path!r} does not exist")


def _remove(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    parent = _parent(doc, parts, path)
    value = _get(doc, path)
    if isinstance(parent, dict):
        del parent[parts[-1]]
    else:
        del parent[int(parts[-1])]
    return value


def _add(doc: Any, path: str, value: Any) -> Any:
    parts = _pointer(path)
    if not parts:
        return value
    parent = _parent(doc, parts, path)
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            parent.insert(int(last), value)
        else:
            raise ApiError(422, f"json patch: index out of range in {path!r}")
    else:
        raise ApiError(422, f"json patch: path {path!r} does not exist")
    return doc


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902: apply the operations to a copy of ``target``; any failure leaves it unchanged."""
    if not isinstance(operations, list):
        raise ApiError(400, "json patch: the body must be a JSON array of operations")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise ApiError(400, f"json patch: malformed operation {op!r}")
        name, path = op["op"], op["path"]
        if name == "add":
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif name == "remove":
            _remove(doc, path)
        elif name == "replace":
            _get(doc, path)
            parts = _pointer(path)
            if not parts:
                doc = copy.deepcopy(op.get("value"))
            else:
                _remove(doc, path)
                doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif name == "move":
            doc = _add(doc, path, _remove(doc, op["from"]))
        elif name == "copy":
            doc = _add(doc, path, copy.deepcopy(_get(doc, op["from"])))
        elif name == "test":
            if _get(doc, path) != op.get("value"):
                raise ApiError(422, f"json patch: test operation failed at {path!r}")
        else:
            raise ApiError(400, f"json patch: unknown operation {name!r}")
    return doc


def _without_directives(patch: Any) -> Any:
    """A strategic merge patch without its ``$`` directives (kubectl's ``$setElementOrder/...``
    and ``$retainKeys`` only order and prune lists), which must not be stored as fields."""
    if isinstance(patch, dict):
        return {k: _without_directives(v) for k, v in patch.items() if not k.startswith("$")}
    if isinstance(patch, list):
        return [_without_directives(item) for item in patch]
    return patch


def apply_patch(content_type: str, target: Any, body: Any) -> Any:
    """Dispatch on the request's ``Content-Type`` (parameters such as ``charset`` ignored)."""
    media = media_type(content_type)
    if media == JSON_PATCH:
        return json_patch(target, body)
    if media in (MERGE_PATCH, STRATEGIC_MERGE_PATCH):
        if not isinstance(body, dict):
            raise ApiError(400, "merge patch: the body must be a JSON object")
        if media == STRATEGIC_MERGE_PATCH:
            body = _without_directives(body)
        return merge_patch(target, body)
    raise ApiError(
        415,
        f"the body of the request was in an unknown format - accepted media types include: "
        f"{', '.join(SUPPORTED_PATCH_TYPES)}",
    )
