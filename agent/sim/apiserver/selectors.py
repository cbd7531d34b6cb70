"""Label and field selectors, parsed once per request and matched against stored objects.

Watches and lists filter by the node and driver of a slice (``spec.nodeName``, ``spec.driver``) and by
labels, exactly as the slice publisher and the kubelet's slice wiping do against a real cluster.
Unsupported field labels are rejected with 400, as the real server does, so a typo fails here too.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.sim.apiserver.errors import ApiError
from agent.sim.apiserver.kinds import ResourceKind

Obj = dict[str, Any]
Matcher = Callable[[Obj], bool]

_SET_REQ = re.compile(r"^(?P<key>[^\s!=(),]+)\s+(?P<op>in|notin)\s*\((?P<values>[^)]*)\)$")
_EQ_REQ = re.compile(r"^(?P<key>[^\s!=(),]+)\s*(?P<op>==|=|!=)\s*(?P<value>[^\s!=(),]*)$")
_EXISTS_REQ = re.compile(r"^(?P<neg>!?)\s*(?P<key>[^\s!=(),]+)$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside ``( … )`` value sets."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: frozenset[str]

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        return not present or value not in self.values  # "!=", "notin"


def parse_label_selector(text: str) -> list[Requirement]:
    """Parse ``a=b,c!=d,e in (f,g),h notin (i),j,!k``; an empty selector matches everything."""
    requirements: list[Requirement] = []
    for part in _split_top_level(text):
        if m := _SET_REQ.match(part):
            values = frozenset(v.strip() for v in m["values"].split(",") if v.strip())
            requirements.append(Requirement(m["key"], m["op"], values))
        elif m := _EQ_REQ.match(part):
            op = "=" if m["op"] in ("=", "==") else "!="
            requirements.append(Requirement(m["key"], op, frozenset([m["value"]])))
        elif m := _EXISTS_REQ.match(part):
            op = "!" if m["neg"] else "exists"
            requirements.append(Requirement(m["key"], op, frozenset()))
        else:
            raise ApiError(400, f"unable to parse requirement: {part!r} in label selector {text!r}")
    return requirements


def field_value(obj: Obj, path: str) -> str:
    """The string a field selector compares with; absent fields compare as ``""``."""
    current: Any = obj
    for part in path.split("."):
        current = current.get(part) if isinstance(current, dict) else None
    if current is None:
        return ""
    if isinstance(current, bool):
        return "true" if current else "false"
    return str(current)


def parse_field_selector(text: str, kind: ResourceKind) -> list[tuple[str, bool, str]]:
    """Parse ``a=b,c!=d`` into ``(path, equal, value)`` triples, checking the kind supports them."""
    terms: list[tuple[str, bool, str]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = re.match(r"^([^=!]+?)\s*(==|=|!=)\s*(.*)$", part)
        if m is None:
            raise ApiError(400, f"invalid selector: {text!r}; can't understand {part!r}")
        path, op, value = m.group(1), m.group(2), m.group(3)
        if path not in kind.supported_fields():
            raise ApiError(
                400,
                f'field label not supported: {path}; "{kind.plural}" supports '
                f"{', '.join(kind.supported_fields())}",
            )
        terms.append((path, op != "!=", value))
    return terms


@dataclass(frozen=True)
class Selector:
    """A parsed request filter: namespace (from the URL), field selector and label selector."""

    namespace: str | None
    fields: tuple[tuple[str, bool, str], ...]
    labels: tuple[Requirement, ...]

    @classmethod
    def from_query(
        cls, kind: ResourceKind, namespace: str | None, field_text: str, label_text: str
    ) -> Selector:
        return cls(
            namespace,
            tuple(parse_field_selector(field_text, kind)),
            tuple(parse_label_selector(label_text)),
        )

    def matches(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        for path, equal, value in self.fields:
            if (field_value(obj, path) == value) != equal:
                return False
        labels = meta.get("labels") or {}
        return all(req.matches(labels) for req in self.labels)
