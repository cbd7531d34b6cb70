"""Field sets as server-side apply sees them: which fields an object sets, by schema.

A field set is what ``metadata.managedFields`` records per manager (``fieldsV1``): the paths
of the leaves an object sets, where a path element is ``f:<field>``, ``k:<keys as JSON>`` for
an item of a list keyed by some of its fields (``x-kubernetes-list-type: map``), ``v:<JSON>``
for a member of a set-list, and an atomic list or map (``x-kubernetes-list-type: atomic``,
the default for lists, or ``x-kubernetes-map-type: atomic``) is one leaf. Fields without a
schema (``x-kubernetes-preserve-unknown-fields``, RawExtension) are treated as the
structured-merge-diff library treats them: maps are merged, lists are atomic. Here also the
merge of an applied configuration into the live object, and the removal of a path.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agent.sim.apiserver.schema_index import SchemaIndex

Obj = dict[str, Any]
FieldPath = tuple[str, ...]


@dataclass(frozen=True)
class Shape:
    """How one schema node merges: ``struct``/``map`` (granular unless ``atomic``),
    ``list`` (``atomic``, ``set`` or ``map`` with ``keys``), ``leaf`` or ``untyped``."""

    kind: str
    atomic: bool = False
    list_type: str = "atomic"
    keys: tuple[str, ...] = ()
    props: Obj | None = None
    element: Obj | None = None


UNTYPED = Shape("untyped")


def shape_of(index: SchemaIndex, node: Obj | None) -> Shape:
    if node is None:
        return UNTYPED
    node = index.resolve(node)
    atomic_map = node.get("x-kubernetes-map-type") == "atomic"
    extra = node.get("additionalProperties")
    if "properties" in node:
        element = extra if isinstance(extra, dict) else None
        if element is None and node.get("x-kubernetes-preserve-unknown-fields"):
            element = {}
        return Shape("struct", atomic_map, props=node["properties"], element=element)
    if isinstance(extra, dict) or extra is True:
        return Shape("map", atomic_map, element=extra if isinstance(extra, dict) else {})
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return UNTYPED
    if node.get("type") == "array":
        list_type = node.get("x-kubernetes-list-type")
        keys = tuple(node.get("x-kubernetes-list-map-keys", ()))
        if list_type is None and "merge" in str(node.get("x-kubernetes-patch-strategy", "")):
            merge_key = node.get("x-kubernetes-patch-merge-key")
            list_type, keys = ("map", (merge_key,)) if merge_key else ("set", ())
        return Shape("list", list_type=list_type or "atomic", keys=keys, element=node.get("items"))
    if node.get("type") == "object":
        return UNTYPED
    return Shape("leaf")


def _child(shape: Shape, key: str) -> Obj | None:
    if shape.props is not None and key in shape.props:
        child: Obj = shape.props[key]
        return child
    return shape.element if shape.element else None


def item_key(item: Any, keys: tuple[str, ...]) -> str:
    present = {k: item[k] for k in sorted(keys) if isinstance(item, dict) and k in item}
    return "k:" + json.dumps(present, separators=(",", ":"), sort_keys=True)


def value_key(value: Any) -> str:
    return "v:" + json.dumps(value, separators=(",", ":"), sort_keys=True)


@dataclass(frozen=True)
class Member:
    """One path of a field set; ``item`` marks a keyed list item's own entry (``.``)."""

    value: Any
    item: bool = False


def field_set(index: SchemaIndex, node: Obj | None, obj: Obj) -> dict[FieldPath, Member]:
    """Every path ``obj`` sets under the schema ``node``, with the value found there."""
    out: dict[FieldPath, Member] = {}
    _fields(index, shape_of(index, node), obj, (), out)
    return out


def _fields(
    index: SchemaIndex, shape: Shape, obj: Obj, path: FieldPath, out: dict[FieldPath, Member]
) -> None:
    for key, value in obj.items():
        _collect(index, _child(shape, key), value, (*path, "f:" + key), out)


def _collect(
    index: SchemaIndex, node: Obj | None, value: Any, path: FieldPath, out: dict[FieldPath, Member]
) -> None:
    shape = shape_of(index, node)
    if isinstance(value, dict) and shape.kind in ("struct", "map", "untyped") and not shape.atomic:
        if not value:
            out[path] = Member({})
        _fields(index, shape, value, path, out)
    elif isinstance(value, list) and shape.kind == "list" and shape.list_type == "map":
        element = shape_of(index, shape.element)
        for item in value:
            where = (*path, item_key(item, shape.keys))
            out[where] = Member(item, item=True)
            if isinstance(item, dict):
                _fields(index, element, item, where, out)
    elif isinstance(value, list) and shape.kind == "list" and shape.list_type == "set":
        for item in value:
            out[(*path, value_key(item))] = Member(item)
    else:
        out[path] = Member(value)


def merge(index: SchemaIndex, node: Obj | None, live: Any, config: Any) -> Any:
    """``config`` applied onto ``live``: granular maps and keyed lists merge, the rest is
    replaced by the configuration's value."""
    shape = shape_of(index, node)
    if isinstance(live, dict) and isinstance(config, dict) and not shape.atomic:
        if shape.kind in ("struct", "map", "untyped"):
            out = dict(live)
            for key, value in config.items():
                child = _child(shape, key)
                out[key] = merge(index, child, live[key], value) if key in live else value
            return out
    if isinstance(live, list) and isinstance(config, list) and shape.kind == "list":
        if shape.list_type == "map":
            wanted = {item_key(item, shape.keys): item for item in config}
            out_list = []
            for item in live:
                key = item_key(item, shape.keys)
                out_list.append(
                    merge(index, shape.element, item, wanted.pop(key)) if key in wanted else item
                )
            return out_list + list(wanted.values())
        if shape.list_type == "set":
            return live + [item for item in config if item not in live]
    return copy.deepcopy(config)


def _find(container: Any, element: str) -> tuple[Any, Any]:
    """(the child at ``element``, the key or index to reach it), or (None, None)."""
    kind, _, rest = element.partition(":")
    if kind == "f" and isinstance(container, dict) and rest in container:
        return container[rest], rest
    if kind in ("k", "v") and isinstance(container, list):
        for i, item in enumerate(container):
            if kind == "k" and isinstance(item, dict):
                wanted = json.loads(rest)
                if all(item.get(k) == v for k, v in wanted.items()):
                    return item, i
            elif kind == "v" and value_key(item) == element:
                return item, i
    return None, None


def remove_path(obj: Obj, path: FieldPath) -> None:
    """Remove the field, keyed item or set member at ``path``, if it is there."""
    container: Any = obj
    for element in path[:-1]:
        container, _ = _find(container, element)
        if container is None:
            return
    _, where = _find(container, path[-1])
    if where is not None:
        del container[where]


def encode(paths: Iterable[FieldPath]) -> Obj:
    """A field set as ``fieldsV1``: a trie, ``.`` marking a path that is itself a member."""
    root: Obj = {}
    for path in paths:
        node = root
        for element in path:
            node = node.setdefault(element, {})
        node["."] = {}

    def finish(node: Obj) -> Obj:
        children = {k: finish(v) for k, v in sorted(node.items()) if k != "."}
        return {".": {}, **children} if "." in node and children else children

    return finish(root)


def decode(fields: Obj, prefix: FieldPath = ()) -> set[FieldPath]:
    out: set[FieldPath] = set()
    for key, value in fields.items():
        if key == ".":
            out.add(prefix)
        elif isinstance(value, dict) and value:
            out |= decode(value, (*prefix, key))
        else:
            out.add((*prefix, key))
    return out


def path_string(path: FieldPath) -> str:
    """A path as structured-merge-diff prints it: ``.spec.items[name="a"].value``."""
    parts: list[str] = []
    for element in path:
        kind, _, rest = element.partition(":")
        if kind == "f":
            parts.append("." + rest)
        elif kind == "k":
            keys = json.loads(rest)
            parts.append("[" + ",".join(f"{k}={json.dumps(v)}" for k, v in keys.items()) + "]")
        elif kind == "v":
            parts.append(f"[={rest}]")
        else:
            parts.append(f"[{rest}]")
    return "".join(parts)
