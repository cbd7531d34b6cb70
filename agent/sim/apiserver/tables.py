"""Server-side printing: ``Accept: application/json;as=Table;g=meta.k8s.io;v=v1``.

``kubectl get`` asks for a Table and prints the columns the server chose: the built-in kinds'
from :mod:`.printers`, a CRD's ``additionalPrinterColumns`` (after ``Name``) as the
CRD handler does. Each row carries the object as ``includeObject`` asks (``Metadata``, the
default: a PartialObjectMetadata; ``Object``; ``None``). A watch sends one Table per event,
the column definitions only in the first, as kube-apiserver does.

A CRD column's ``jsonPath`` is evaluated for the simple paths CRDs use (``.a.b``, ``[n]``,
``[*]``); its first result is the cell.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

from agent.sim.apiserver.errors import ApiError
from agent.sim.apiserver.kinds import ResourceKind
from agent.sim.apiserver.printers import NAME, PRINTERS, Cell, Column, pod_conditions, since
from agent.sim.apiserver.schema_index import crd_for

Obj = dict[str, Any]
_STEP = re.compile(r"\.([A-Za-z0-9_\-]+)|\[(\*|\d+)\]")
TABLE_VERSIONS = ("v1", "v1beta1")


def table_version(accept: str) -> str | None:
    """``v1`` or ``v1beta1`` when the client prefers a Table, else None (plain JSON).

    The first media type the server can produce wins, as in kube-apiserver's negotiation."""
    for entry in accept.split(","):
        media, *params = (p.strip() for p in entry.split(";"))
        options = dict(p.split("=", 1) for p in params if "=" in p)
        if options.get("as") == "Table":
            if options.get("g") == "meta.k8s.io" and options.get("v") in TABLE_VERSIONS:
                return options["v"]
            continue
        if media in ("application/json", "*/*", "application/*", ""):
            return None
    if "as=Table" in accept:
        raise ApiError(406, "only the following media types are accepted: application/json, "
                       "application/json;as=Table;v=v1;g=meta.k8s.io", reason="NotAcceptable")  # fmt: skip
    return None


def _json_path(obj: Any, path: str) -> list[Any]:
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    current = [obj]
    for name, index in _STEP.findall(path):
        found: list[Any] = []
        for value in current:
            if name and isinstance(value, dict) and name in value:
                found.append(value[name])
            elif index == "*" and isinstance(value, list):
                found.extend(value)
            elif index and index != "*" and isinstance(value, list) and int(index) < len(value):
                found.append(value[int(index)])
        current = found
    return current


def _crd_cell(column: Obj, obj: Obj, now: datetime) -> Cell:
    found = _json_path(obj, str(column.get("jsonPath", "")))
    if not found or found[0] is None:
        return None
    value = found[0]
    kind = column.get("type", "string")
    if kind == "date":
        return since(value, now) if isinstance(value, str) else None
    if kind == "integer":
        return (
            int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
        )
    if kind == "boolean":
        return value if isinstance(value, bool) else None
    if kind == "number":
        return value if isinstance(value, int | float) else None
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else str(value)


def columns_and_row(kind: ResourceKind) -> tuple[list[Obj], Callable[[Obj, datetime], list[Cell]]]:
    """The column definitions of a kind and its row function."""
    printer = PRINTERS.get(kind.key)
    if printer is not None:
        columns, row = printer
        return [c.definition() for c in columns], row
    crd = crd_for(kind.group, kind.version, kind.kind) if kind.custom else None
    extra = list(crd.columns) if crd else [{"name": "Age", "type": "date",
                                            "jsonPath": ".metadata.creationTimestamp"}]  # fmt: skip
    defs = [NAME.definition()] + [
        Column(c["name"], c.get("description", ""), int(c.get("priority", 0)),
               c.get("type", "string"), c.get("format", "")).definition()
        for c in extra
    ]  # fmt: skip

    def crd_row(obj: Obj, now: datetime) -> list[Cell]:
        return [obj["metadata"]["name"], *(_crd_cell(c, obj, now) for c in extra)]

    return defs, crd_row


def _row_object(kind: ResourceKind, obj: Obj, include: str, version: str) -> Obj | None:
    if include == "None":
        return None
    if include == "Object":
        return {"kind": kind.kind, "apiVersion": kind.api_version, **obj}
    return {"kind": "PartialObjectMetadata", "apiVersion": f"meta.k8s.io/{version}",
            "metadata": obj.get("metadata", {})}  # fmt: skip


def include_object(query: Any) -> str:
    value = str(query.get("includeObject", "") or "Metadata")
    if value not in ("Metadata", "Object", "None"):
        raise ApiError(400, f'unrecognized includeObject value: "{value}"')
    return value


def table(
    kind: ResourceKind,
    objects: list[Obj],
    *,
    version: str,
    include: str,
    metadata: Obj,
    now: datetime,
    headers: bool = True,
) -> Obj:
    """A ``meta.k8s.io`` Table of ``objects``; ``headers=False`` leaves the column
    definitions out (null), as a watch does after its first event."""
    columns, row = columns_and_row(kind)
    rows = []
    for obj in objects:
        entry: Obj = {"cells": row(obj, now), "object": _row_object(kind, obj, include, version)}
        if kind.key == "pods" and (conditions := pod_conditions(obj)):
            entry["conditions"] = conditions
        rows.append(entry)
    return {
        "kind": "Table",
        "apiVersion": f"meta.k8s.io/{version}",
        "metadata": metadata,
        "columnDefinitions": columns if headers else None,
        "rows": rows,
    }
