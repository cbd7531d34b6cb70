"""A cache of API objects that never moves backwards: the store of every list-then-watch.

A watcher's cache is fed by a LIST, by watch events and by what its owner's own writes
returned (so that the owner's next pass sees them at once: client-go needs a mutation cache
for that). Those can arrive out of order: a late watch event must not overwrite a newer
write, and must not bring back an object the owner just deleted. resourceVersions order
them (opaque in theory, integers in every kube-apiserver: an object without one is taken
as it comes), and tombstones remember the version a deleted object had, until a LIST or the
watch is past it. Used by the slice watcher (:mod:`agent.kube.slicewatch`) and the
controller's informers (:mod:`agent.kube.informer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

Obj = dict[str, Any]


def resource_version(obj: Obj) -> int | None:
    """The object's resourceVersion as an int, or None (versions are opaque in theory)."""
    raw = (obj.get("metadata") or {}).get("resourceVersion")
    try:
        return int(str(raw))
    except (TypeError, ValueError):
        return None


def object_key(obj: Obj) -> str:
    """``namespace/name``, or ``name`` for an object without a namespace."""
    meta = obj.get("metadata") or {}
    namespace, name = meta.get("namespace"), str(meta.get("name", ""))
    return f"{namespace}/{name}" if namespace else name


class VersionedCache:
    """Objects by ``key`` (:func:`object_key` by default), each kept as ``transform`` makes
    it (the fields its readers need; all of it by default), never moved backwards."""

    def __init__(
        self,
        key: Callable[[Obj], str] = object_key,
        transform: Callable[[Obj], Obj] | None = None,
    ) -> None:
        self._key = key
        self._transform = transform
        self._objects: dict[str, Obj] = {}
        self._tombstones: dict[str, int] = {}

    def get(self, key: str) -> Obj | None:
        """The object of ``key``; shared: readers must not change it."""
        return self._objects.get(key)

    def items(self) -> list[Obj]:
        """The objects in key order; shared: readers must not change them."""
        return [self._objects[key] for key in sorted(self._objects)]

    def snapshot(self) -> dict[str, Obj]:
        """The objects by key; shared: readers must not change them."""
        return dict(self._objects)

    def __len__(self) -> int:
        return len(self._objects)

    def replace_all(self, items: Iterable[Obj], list_version: int | None = None) -> None:
        """Take a LIST's items; writes newer than the list (``list_version``) survive it."""
        transform = self._transform or (lambda obj: obj)
        fresh = {self._key(item): transform(item) for item in items}
        if list_version is not None:
            for key, obj in self._objects.items():
                rv = resource_version(obj)
                if rv is not None and rv > list_version:
                    fresh[key] = obj
            for key, rv in self._tombstones.items():
                if rv > list_version:
                    fresh.pop(key, None)
        self._objects = fresh
        self._tombstones = {
            key: rv
            for key, rv in self._tombstones.items()
            if list_version is not None and rv > list_version
        }

    def apply(self, event_type: str, obj: Obj) -> bool:
        """One watch event (``ADDED``, ``MODIFIED``, ``DELETED``) or write result; whether
        the cache changed."""
        key, rv = self._key(obj), resource_version(obj)
        current = self._objects.get(key)
        if rv is not None:
            newest = resource_version(current) if current is not None else None
            if newest is not None and rv < newest:
                return False
            tomb = self._tombstones.get(key)
            if current is None and tomb is not None and rv <= tomb:
                return False
        if event_type == "DELETED":
            if current is None:
                return False
            del self._objects[key]
            if rv is not None:
                self._tombstones[key] = rv
            return True
        kept = self._transform(obj) if self._transform is not None else obj
        self._tombstones.pop(key, None)
        if current == kept:
            return False
        self._objects[key] = kept
        return True

    def forget(self, key: str, rv: int | None) -> None:
        """The owner deleted ``key`` (last seen at version ``rv``): gone, and no late event of
        that version or an older one brings it back."""
        self._objects.pop(key, None)
        if rv is not None:
            self._tombstones[key] = max(rv, self._tombstones.get(key, rv))

    def passed(self, version: int) -> None:
        """The watch is past ``version``: no older event of a deleted object can come."""
        if self._tombstones:
            self._tombstones = {k: rv for k, rv in self._tombstones.items() if rv > version}
