"""Server-side apply (``PATCH`` with ``application/apply-patch+yaml``), for the common cases.

A manager (``fieldManager``) sends the whole configuration it wants; the server merges it into
the live object (creating it when absent) by the kind's schema (``fieldsets``), records the
fields the configuration sets as that manager's in ``metadata.managedFields`` (operation
Apply), removes the fields the manager set last time and no longer does (unless another
manager also set them), and refuses with 409, naming each field and its manager, to change a
field another manager set, unless ``force=true`` (then the field changes hands). The
messages are kube-apiserver's (``Apply failed with 1 conflict: conflict with "a":
.spec.x``), so kubectl prints what it prints against a cluster.

Not implemented (docs/ARCHITECTURE.md, "The embedded cluster"): managed fields of writes
other than apply (operation Update: the server records none, so such writes neither conflict
with an applier nor take fields from it), managed fields of an apply to ``/status``, dry run,
and structured-merge-diff's ordering of merged keyed lists (live items first, then new ones).
"""

from __future__ import annotations

import copy
from typing import Any

from agent.sim.apiserver.errors import ApiError
from agent.sim.apiserver.fieldcheck import unknown_fields
from agent.sim.apiserver.fieldsets import (
    FieldPath,
    decode,
    encode,
    field_set,
    merge,
    path_string,
    remove_path,
)
from agent.sim.apiserver.kinds import ResourceKind
from agent.sim.apiserver.schema_index import SchemaIndex

Obj = dict[str, Any]
_IDENTITY = ("name", "namespace", "creationTimestamp", "selfLink", "uid", "clusterName",
             "generation", "managedFields", "resourceVersion")  # fmt: skip
_STRIPPED: frozenset[FieldPath] = frozenset(
    [("f:apiVersion",), ("f:kind",), ("f:metadata",)]
    + [("f:metadata", "f:" + name) for name in _IDENTITY]
)


def _owned(paths: set[FieldPath], status_reset: bool) -> set[FieldPath]:
    """What a manager can own: not the identity fields (kube-apiserver strips them), nor the
    status when it is written through the main resource (the strategy resets it)."""
    return {
        p
        for p in paths
        if p not in _STRIPPED
        and p[:2] != ("f:metadata", "f:managedFields")
        and not (status_reset and p[:1] == ("f:status",))
    }


def manager_label(entry: Obj) -> str:
    """A manager as kube-apiserver names it in a conflict."""
    label = f'"{entry.get("manager", "")}"'
    if entry.get("subresource"):
        label += f' with subresource "{entry["subresource"]}"'
    if entry.get("operation") == "Update":
        label += f" using {entry.get('apiVersion', '')}"
        if entry.get("time"):
            label += f" at {entry['time']}"
    return label


def conflict_error(conflicts: list[tuple[Obj, FieldPath]]) -> ApiError:
    causes = [
        {"type": "FieldManagerConflict", "message": f"conflict with {manager_label(entry)}",
         "field": path_string(path)}
        for entry, path in conflicts
    ]  # fmt: skip
    if len(conflicts) == 1:
        entry, path = conflicts[0]
        message = (
            f"Apply failed with 1 conflict: conflict with {manager_label(entry)}: "
            f"{path_string(path)}"
        )
    else:
        by_manager: dict[str, list[str]] = {}
        for entry, path in conflicts:
            by_manager.setdefault(manager_label(entry), []).append(path_string(path))
        lines = []
        for label in sorted(by_manager):
            lines.append(f"conflicts with {label}:")
            lines.extend(f"- {p}" for p in by_manager[label])
        message = f"Apply failed with {len(conflicts)} conflicts: " + "\n".join(lines)
    return ApiError(409, message, reason="Conflict", causes=causes)


def _checked_config(
    index: SchemaIndex, kind: ResourceKind, config: Any, namespace: str | None, name: str
) -> Obj:
    if not isinstance(config, dict):
        raise ApiError(400, "error decoding YAML: the apply configuration must be an object")
    if config.get("apiVersion") != kind.api_version:
        raise ApiError(
            400,
            f"Incorrect version specified in apply patch. Specified patch version: "
            f"{config.get('apiVersion', '')}, expected: {kind.api_version}",
        )
    meta = config.get("metadata")
    if isinstance(meta, dict) and meta.get("managedFields") is not None:
        raise ApiError(400, "metadata.managedFields must be nil")
    unknown, _ = unknown_fields(index, kind, config)
    if unknown:
        where = (
            f"{namespace or ''}/{name}; {kind.api_version if kind.group else '/' + kind.version}"
        )
        problems = [f".{field}: field not declared in schema" for field in unknown]
        detail = problems[0] if len(problems) == 1 else "errors:\n  " + "\n  ".join(problems)
        raise ApiError(
            500,
            f"failed to create typed patch object ({where}, Kind={kind.kind}): {detail}",
            bare=True,
        )
    return copy.deepcopy(config)


def server_side_apply(
    index: SchemaIndex,
    kind: ResourceKind,
    live: Obj | None,
    config: Any,
    *,
    name: str,
    namespace: str | None,
    manager: str,
    force: bool,
    now: str,
    status: bool = False,
) -> Obj:
    """The object to store after ``manager`` applies ``config`` to ``live`` (None: create).

    Returns ``live`` itself when the apply changes nothing (no new resourceVersion then).
    """
    if not manager:
        raise ApiError(
            422,
            'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: '
            "is required for apply patch",
            group="meta.k8s.io",
            kind="PatchOptions",
        )
    config = _checked_config(index, kind, config, namespace, name)
    schema = index.schema_for(kind.group, kind.version, kind.kind)
    reset = kind.status_subresource and not status
    if reset:
        config.pop("status", None)
    subresource = "status" if status else ""
    base: Obj = copy.deepcopy(live) if live is not None else {}
    entries: list[Obj] = copy.deepcopy(base.get("metadata", {}).get("managedFields") or [])
    base.get("metadata", {}).pop("managedFields", None)

    applied = _owned(set(field_set(index, schema, config)), reset)
    merged: Obj = merge(index, schema, base, config) if live is not None else config
    before = field_set(index, schema, base)
    changed = {
        path
        for path, member in field_set(index, schema, merged).items()
        if not member.item and (path not in before or before[path].value != member.value)
    }

    mine: Obj | None = None
    others: list[tuple[Obj, set[FieldPath]]] = []
    for entry in entries:
        paths = decode(entry.get("fieldsV1") or {})
        if (entry.get("manager"), entry.get("operation"), entry.get("subresource", "")) == (
            manager, "Apply", subresource
        ):  # fmt: skip
            mine = entry
        else:
            others.append((entry, paths))
    conflicts = [
        (entry, path) for entry, paths in others for path in sorted(paths & changed & applied)
    ]
    if conflicts and not force:
        raise conflict_error(conflicts)
    for _entry, paths in others:
        paths -= changed & applied  # forced: the fields change hands

    previous = decode(mine.get("fieldsV1") or {}) if mine else set()
    still_owned = set().union(*(paths for _, paths in others))
    for path in sorted(previous - applied, key=len, reverse=True):
        if not any(p[: len(path)] == path for p in still_owned):
            remove_path(merged, path)

    if live is not None and mine is not None and previous == applied and merged == base:
        return live  # nothing changes: the object keeps its resourceVersion and times
    entry_out: Obj = {
        "manager": manager,
        "operation": "Apply",
        "apiVersion": kind.api_version,
        "time": now,
        "fieldsType": "FieldsV1",
        "fieldsV1": encode(applied),
    }
    if subresource:
        entry_out["subresource"] = subresource
    kept = [{**entry, "fieldsV1": encode(paths)} for entry, paths in others if paths]
    managed = sorted(
        [entry_out, *kept] if applied else kept,  # a manager of no field is no manager
        key=lambda e: (e.get("operation", ""), e.get("time", ""), e.get("manager", ""),
                       e.get("subresource", "")),
    )  # fmt: skip
    merged.setdefault("metadata", {})["managedFields"] = managed
    if not managed:
        del merged["metadata"]["managedFields"]
    merged["metadata"].setdefault("name", name)
    return merged
