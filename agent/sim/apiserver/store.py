"""The in-memory object store: one global resourceVersion, optimistic concurrency, watch history.

Like etcd behind the real apiserver, every write of any kind takes the next resourceVersion, so a
client can resume a watch from any version it has seen, and a stale ``metadata.resourceVersion`` on a
write is a 409 Conflict. Each write is recorded in a bounded history (for watch resumption; older
versions get 410 Gone) and pushed to every open watch's queue. All methods are synchronous and run on
the server's event loop, so each one is atomic with respect to the others.
"""

from __future__ import annotations

import asyncio
import copy
import secrets
import uuid
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from agent.sim.apiserver.errors import CONFLICT_MESSAGE, ApiError
from agent.sim.apiserver.kinds import KindRegistry, ResourceKind
from agent.sim.apiserver.selectors import Selector

Obj = dict[str, Any]
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # the apiserver's: no vowels, no look-alikes
#: kube-apiserver cuts a longer ``generateName`` to this many characters, then adds 5.
MAX_GENERATED_PREFIX = 58
_SERVER_FIELDS = ("uid", "creationTimestamp", "resourceVersion", "generation", "deletionTimestamp")


@dataclass(frozen=True)
class StoreEvent:
    """One write, as watches see it. ``old`` lets a watch notice an object leaving its selector."""

    rv: int
    kind: ResourceKind
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj
    old: Obj | None


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _body_sans_meta(obj: Obj, *drop: str) -> Obj:
    return {k: v for k, v in obj.items() if k not in ("metadata", *drop)}


class ObjectStore:
    def __init__(self, kinds: KindRegistry, history_size: int = 1000) -> None:
        self.kinds = kinds
        self._objects: dict[str, dict[tuple[str, str], Obj]] = {k.key: {} for k in kinds}
        self._rv = 1
        self._history: deque[StoreEvent] = deque(maxlen=history_size)
        self._history_floor = 1  # events after this version are all still in the history
        self._watchers: set[asyncio.Queue[StoreEvent | None]] = set()

    @property
    def resource_version(self) -> int:
        return self._rv

    # -- reads -----------------------------------------------------------------------------

    def get(self, kind: ResourceKind, namespace: str | None, name: str) -> Obj:
        obj = self._objects[kind.key].get((namespace or "", name))
        if obj is None:
            raise ApiError(
                404,
                f'{kind.plural}.{kind.group} "{name}" not found'
                if kind.group
                else f'{kind.plural} "{name}" not found',
                name=name,
                group=kind.group,
                kind=kind.plural,
            )
        return copy.deepcopy(obj)

    def select(self, kind: ResourceKind, selector: Selector) -> list[Obj]:
        """Matching objects sorted by namespace and name, like an etcd range read."""
        objects = self._objects[kind.key]
        return [
            copy.deepcopy(objects[key]) for key in sorted(objects) if selector.matches(objects[key])
        ]

    # -- writes ----------------------------------------------------------------------------

    def create(self, kind: ResourceKind, namespace: str | None, body: Obj) -> Obj:
        obj = self._prepare_new(kind, namespace, body)
        if kind.status_subresource and not kind.keep_status_on_create:
            obj.pop("status", None)
        meta = obj["metadata"]
        for field_name in _SERVER_FIELDS:
            meta.pop(field_name, None)
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise kind.invalid(
                    None, "metadata.name: Required value: name or generateName is required"
                )
            prefix = prefix[:MAX_GENERATED_PREFIX]  # as kube-apiserver cuts it
            for _ in range(10):
                meta["name"] = prefix + "".join(secrets.choice(_NAME_ALPHABET) for _ in range(5))
                if (meta.get("namespace", ""), meta["name"]) not in self._objects[kind.key]:
                    break
        self._validate(kind, obj, None)
        key = (meta.get("namespace", ""), meta["name"])
        if key in self._objects[kind.key]:
            raise ApiError(
                409,
                f'{kind.plural}{"." + kind.group if kind.group else ""} "{meta["name"]}" already exists',
                reason="AlreadyExists",
                name=meta["name"],
                group=kind.group,
                kind=kind.plural,
            )
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        return self._commit(kind, key, "ADDED", obj, None)

    def update(
        self,
        kind: ResourceKind,
        namespace: str | None,
        name: str,
        body: Obj,
        *,
        status_only: bool = False,
    ) -> Obj:
        """Replace an object (PUT); ``status_only`` is the ``/status`` subresource."""
        obj = self._prepare_new(kind, namespace, body)
        meta = obj["metadata"]
        if meta.get("name") != name:
            raise ApiError(
                400,
                f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})",
            )
        old = self.get(kind, namespace, name)
        wanted_rv = meta.get("resourceVersion")
        if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                f"Operation cannot be fulfilled on {kind.plural}{'.' + kind.group if kind.group else ''} "
                f'"{name}": {CONFLICT_MESSAGE}',
                name=name,
                group=kind.group,
                kind=kind.plural,
            )
        wanted_uid = meta.get("uid")
        if wanted_uid and wanted_uid != old["metadata"]["uid"]:
            raise ApiError(
                409,
                f"Precondition failed: UID in precondition: {wanted_uid}, "
                f"UID in object meta: {old['metadata']['uid']}",
                name=name,
                group=kind.group,
                kind=kind.plural,
            )
        if status_only:
            obj = copy.deepcopy(old)
            if "status" in body:
                obj["status"] = copy.deepcopy(body["status"])
            else:
                obj.pop("status", None)
        else:
            for field_name in _SERVER_FIELDS:
                if field_name in old["metadata"]:
                    meta[field_name] = old["metadata"][field_name]
            if "managedFields" not in meta and "managedFields" in old["metadata"]:
                meta["managedFields"] = old["metadata"]["managedFields"]  # omitted: kept
            if kind.status_subresource:
                obj.pop("status", None)
                if "status" in old:
                    obj["status"] = old["status"]
            if _body_sans_meta(obj, "status") != _body_sans_meta(old, "status"):
                meta["generation"] = old["metadata"].get("generation", 1) + 1
        self._validate(kind, obj, old)
        if obj == old:
            return old  # a no-op write does not take a new resourceVersion, as in the real server
        key = (meta.get("namespace", ""), name)
        stored = self._commit(kind, key, "MODIFIED", obj, old)
        if stored["metadata"].get("deletionTimestamp") and not stored["metadata"].get("finalizers"):
            self._remove(kind, key, stored)  # the last finalizer went: the deletion completes
        return stored

    def delete(
        self,
        kind: ResourceKind,
        namespace: str | None,
        name: str,
        preconditions: Obj | None = None,
    ) -> Obj:
        """Delete and return the object as it was last stored; an object with finalizers is
        only marked (``deletionTimestamp``) and goes when an update removes the last one."""
        old = self.get(kind, namespace, name)
        pre = preconditions or {}
        for field_name, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            wanted = pre.get(field_name)
            if wanted and wanted != old["metadata"].get(field_name):
                raise ApiError(
                    409,
                    f"Precondition failed: {label} in precondition: {wanted}, "
                    f"{label} in object meta: {old['metadata'].get(field_name)}",
                    name=name,
                    group=kind.group,
                    kind=kind.plural,
                )
        key = (namespace or "", name)
        if old["metadata"].get("finalizers"):  # graceful: marked, gone once they are removed
            if old["metadata"].get("deletionTimestamp"):
                return old
            marked = copy.deepcopy(old)
            marked["metadata"]["deletionTimestamp"] = now_rfc3339()
            return self._commit(kind, key, "MODIFIED", marked, old)
        self._remove(kind, key, old)
        return old

    def _remove(self, kind: ResourceKind, key: tuple[str, str], old: Obj) -> None:
        del self._objects[kind.key][key]
        self._rv += 1
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self._rv)
        self._publish(StoreEvent(self._rv, kind, "DELETED", gone, old))
        self._collect_dependents(old["metadata"]["uid"])

    def _collect_dependents(self, owner_uid: str) -> None:
        """Background cascading deletion: objects owned (ownerReferences) by a deleted object go too."""
        for kind in self.kinds:
            for (namespace, name), obj in list(self._objects[kind.key].items()):
                owners = obj.get("metadata", {}).get("ownerReferences") or []
                if any(ref.get("uid") == owner_uid for ref in owners):
                    self.delete(kind, namespace or None, name)

    # -- watch support ---------------------------------------------------------------------

    def subscribe(self) -> asyncio.Queue[StoreEvent | None]:
        """A queue receiving every later write; ``None`` in it means "end this watch"."""
        queue: asyncio.Queue[StoreEvent | None] = asyncio.Queue()
        self._watchers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[StoreEvent | None]) -> None:
        self._watchers.discard(queue)

    def events_after(self, rv: int) -> list[StoreEvent]:
        """History after ``rv``; 410 Expired when part of it has already been dropped."""
        if rv < self._history_floor:
            raise ApiError(
                410,
                f"too old resource version: {rv} ({self._history_floor})",
                reason="Expired",
            )
        return [event for event in self._history if event.rv > rv]

    # -- internals -------------------------------------------------------------------------

    def _prepare_new(self, kind: ResourceKind, namespace: str | None, body: Obj) -> Obj:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        obj = copy.deepcopy(body)
        for field_name, expected in (("apiVersion", kind.api_version), ("kind", kind.kind)):
            given = obj.setdefault(field_name, expected)
            if given != expected:
                raise kind.invalid(
                    obj.get("metadata", {}).get("name"),
                    f"{field_name}: Invalid value: {given!r}: must be {expected!r}",
                )
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise ApiError(400, "metadata must be a JSON object")
        if kind.namespaced:
            given_ns = meta.setdefault("namespace", namespace)
            if given_ns != namespace:
                raise kind.invalid(
                    meta.get("name"),
                    "metadata.namespace: Invalid value: the namespace of the provided object "
                    "does not match the namespace sent on the request",
                )
        else:
            meta.pop("namespace", None)
        return obj

    def _validate(self, kind: ResourceKind, obj: Obj, old: Obj | None) -> None:
        for validator in kind.validators:
            validator(kind, obj, old)

    def _commit(
        self, kind: ResourceKind, key: tuple[str, str], type_: str, obj: Obj, old: Obj | None
    ) -> Obj:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._objects[kind.key][key] = obj
        self._publish(StoreEvent(self._rv, kind, type_, copy.deepcopy(obj), old))
        return copy.deepcopy(obj)

    def _publish(self, event: StoreEvent) -> None:
        if len(self._history) == self._history.maxlen:
            self._history_floor = self._history[0].rv
        self._history.append(event)
        for queue in self._watchers:
            queue.put_nowait(event)

    # -- direct access for tests and the demo ----------------------------------------------

    def put(self, kind: ResourceKind, obj: Obj) -> Obj:
        """Create or replace ``obj`` unconditionally (no resourceVersion check)."""
        meta = obj.get("metadata", {})
        namespace = meta.get("namespace") if kind.namespaced else None
        if (namespace or "", meta.get("name", "")) in self._objects[kind.key]:
            body = copy.deepcopy(obj)
            body["metadata"].pop("resourceVersion", None)
            updated = self.update(kind, namespace, meta["name"], body)
            if kind.status_subresource and "status" in obj:
                updated = self.update(
                    kind,
                    namespace,
                    meta["name"],
                    {**updated, "status": obj["status"]},
                    status_only=True,
                )
            return updated
        created = self.create(kind, namespace, obj)
        if kind.status_subresource and not kind.keep_status_on_create and "status" in obj:
            created = self.update(
                kind,
                namespace,
                created["metadata"]["name"],
                {**created, "status": obj["status"]},
                status_only=True,
            )
        return created
