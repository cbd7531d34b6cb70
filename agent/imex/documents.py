"""A ComputeDomain's status as plain data: the node entries and the per-node conditions.

Pure functions on the JSON the API server holds (:mod:`agent.imex.domains` reads and writes
it): a node's entry (``status.nodes``: IMEX daemon address, clique, index, readiness) and its
``IMEXDaemonReady.<node>`` condition.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

Obj = dict[str, Any]
GROUP, VERSION, PLURAL, KIND = "resource.nvidia.com", "v1beta1", "computedomains", "ComputeDomain"
API_VERSION = f"{GROUP}/{VERSION}"
CONDITION_PREFIX = "IMEXDaemonReady."
NodeStatus = Literal["Ready", "NotReady"]


@dataclass(frozen=True)
class DomainRef:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"ComputeDomain {self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True)
class NodeEntry:
    name: str
    ip_address: str
    clique: str
    index: int
    status: NodeStatus

    @classmethod
    def of(cls, item: Obj) -> NodeEntry:
        return cls(
            str(item.get("name", "")),
            str(item.get("ipAddress", "")),
            str(item.get("cliqueID", "")),
            int(item.get("index", -1)),
            "Ready" if item.get("status") == "Ready" else "NotReady",
        )

    def to_dict(self) -> Obj:
        return {
            "name": self.name,
            "ipAddress": self.ip_address,
            "cliqueID": self.clique,
            "index": self.index,
            "status": self.status,
        }


def node_entries(domain: Obj) -> list[NodeEntry]:
    return [NodeEntry.of(n) for n in (domain.get("status") or {}).get("nodes") or []]


def domain_ref(domain: Obj) -> DomainRef:
    meta = domain["metadata"]
    return DomainRef(meta["namespace"], meta["name"], meta["uid"])


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(status: Obj, node: str, ready: bool, reason: str, message: str) -> None:
    """Put (or update) the node's ``IMEXDaemonReady.<node>`` condition into ``status``."""
    conditions = [c for c in status.get("conditions") or [] if isinstance(c, dict)]
    kind = CONDITION_PREFIX + node
    value = "True" if ready else "False"
    previous = next((c for c in conditions if c.get("type") == kind), None)
    changed = previous is None or previous.get("status") != value
    condition = {
        "type": kind,
        "status": value,
        "reason": reason,
        "message": message[:4096],
        "lastTransitionTime": now() if changed else previous.get("lastTransitionTime", now()),  # type: ignore[union-attr]
    }
    status["conditions"] = [c for c in conditions if c.get("type") != kind] + [condition]


def drop_condition(status: Obj, node: str) -> None:
    kind = CONDITION_PREFIX + node
    conditions = [c for c in status.get("conditions") or [] if c.get("type") != kind]
    if conditions:
        status["conditions"] = conditions
    else:
        status.pop("conditions", None)
