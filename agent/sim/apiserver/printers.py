"""The columns kube-apiserver prints for the built-in kinds we serve (server-side printing).

Facts from Kubernetes' ``pkg/printers/internalversion/printers.go``: the column names, types
and priorities (priority 1 is ``-o wide``; the server always sends them, kubectl hides them)
and how each cell is computed; ages are ``duration.HumanDuration`` of the time since.
Pods are printed from what the object says (no kubelet fills it here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

Obj = dict[str, Any]
Cell = str | int | float | bool | None


@dataclass(frozen=True)
class Column:
    name: str
    description: str = ""
    priority: int = 0
    type: str = "string"
    format: str = ""

    def definition(self) -> Obj:
        return {"name": self.name, "type": self.type, "format": self.format,
                "description": self.description, "priority": self.priority}  # fmt: skip


def parse_time(text: Any) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def human_duration(seconds: float) -> str:
    """apimachinery's ``duration.HumanDuration``: about two significant figures."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" if hours % 24 == 0 else f"{hours // 24}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y" if days == 0 else f"{hours // 24 // 365}y{days}d"
    return f"{hours // 24 // 365}y"


def since(text: Any, now: datetime) -> str:
    """``translateTimestampSince``: ``<unknown>`` for a missing time."""
    when = parse_time(text)
    return "<unknown>" if when is None else human_duration((now - when).total_seconds())


def _get(obj: Any, *path: str) -> Any:
    for part in path:
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def _age(obj: Obj, now: datetime) -> str:
    return since(_get(obj, "metadata", "creationTimestamp"), now)


NAME = Column("Name", "Name must be unique within a namespace.", format="name")
AGE = Column("Age", "CreationTimestamp is a timestamp representing the server time when this "
             "object was created.")  # fmt: skip


def _claim_state(obj: Obj) -> str:
    states = []
    deleted = bool(_get(obj, "metadata", "deletionTimestamp"))
    if deleted:
        states.append("deleted")
    if _get(obj, "status", "allocation") is None:
        if not deleted:
            states.append("pending")
    else:
        states.append("allocated")
        if _get(obj, "status", "reservedFor"):
            states.append("reserved")
    return ",".join(states)


def _node_row(obj: Obj, now: datetime) -> list[Cell]:
    conditions = {c.get("type"): c for c in _get(obj, "status", "conditions") or []}
    ready = conditions.get("Ready")
    status = [] if ready is None else ["Ready" if ready.get("status") == "True" else "NotReady"]
    status = status or ["Unknown"]
    if _get(obj, "spec", "unschedulable"):
        status.append("SchedulingDisabled")
    roles = sorted(
        {k.removeprefix("node-role.kubernetes.io/") for k in _get(obj, "metadata", "labels") or {}
         if k.startswith("node-role.kubernetes.io/") and k != "node-role.kubernetes.io/"}
        | {v for k, v in (_get(obj, "metadata", "labels") or {}).items()
           if k == "kubernetes.io/role" and v}
    )  # fmt: skip
    info = _get(obj, "status", "nodeInfo") or {}
    addresses = _get(obj, "status", "addresses") or []

    def address(kind: str) -> str:
        return next((a["address"] for a in addresses if a.get("type") == kind), "<none>")

    return [
        obj["metadata"]["name"], ",".join(status), ",".join(roles) or "<none>", _age(obj, now),
        info.get("kubeletVersion", ""), address("InternalIP"), address("ExternalIP"),
        info.get("osImage") or "<unknown>", info.get("kernelVersion") or "<unknown>",
        info.get("containerRuntimeVersion") or "<unknown>",
    ]  # fmt: skip


def _pod_reason(obj: Obj, reason: str) -> tuple[str, int, bool]:
    """The STATUS column from the containers' states (the init containers' are not read),
    the number of ready containers and whether one runs."""
    ready = 0
    running = False
    for status in reversed(_get(obj, "status", "containerStatuses") or []):
        state = status.get("state") or {}
        waiting, terminated = state.get("waiting"), state.get("terminated")
        if waiting and waiting.get("reason"):
            reason = waiting["reason"]
        elif terminated and terminated.get("reason"):
            reason = terminated["reason"]
        elif terminated:
            signal = terminated.get("signal", 0)
            reason = f"Signal:{signal}" if signal else f"ExitCode:{terminated.get('exitCode', 0)}"
        elif status.get("ready") and state.get("running") is not None:
            running = True
            ready += 1
    return reason, ready, running


def _pod_row(obj: Obj, now: datetime) -> list[Cell]:
    phase = _get(obj, "status", "phase") or ""
    reason = _get(obj, "status", "reason") or phase
    conditions = _get(obj, "status", "conditions") or []
    if any(c.get("type") == "PodScheduled" and c.get("reason") == "SchedulingGated"
           for c in conditions):  # fmt: skip
        reason = "SchedulingGated"
    reason, ready, running = _pod_reason(obj, reason)
    if reason == "Completed" and running:
        pod_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        reason = "Running" if pod_ready else "NotReady"
    if _get(obj, "metadata", "deletionTimestamp"):
        if _get(obj, "status", "reason") == "NodeLost":
            reason = "Unknown"
        elif phase not in ("Succeeded", "Failed"):
            reason = "Terminating"
    statuses = _get(obj, "status", "containerStatuses") or []
    restarts = sum(int(s.get("restartCount", 0)) for s in statuses)
    finished = [
        t for s in statuses
        if (t := parse_time(_get(s, "lastState", "terminated", "finishedAt"))) is not None
    ]  # fmt: skip
    restarts_cell = str(restarts)
    if restarts and finished:
        restarts_cell = f"{restarts} ({human_duration((now - max(finished)).total_seconds())} ago)"
    total = len(_get(obj, "spec", "containers") or [])
    ips = _get(obj, "status", "podIPs") or []
    gates = _get(obj, "spec", "readinessGates") or []
    gates_cell = "<none>"
    if gates:
        true = {c.get("type") for c in conditions if c.get("status") == "True"}
        gates_cell = f"{sum(1 for g in gates if g.get('conditionType') in true)}/{len(gates)}"
    return [
        obj["metadata"]["name"], f"{ready}/{total}", reason, restarts_cell, _age(obj, now),
        (ips[0].get("ip") if ips else "") or "<none>", _get(obj, "spec", "nodeName") or "<none>",
        _get(obj, "status", "nominatedNodeName") or "<none>", gates_cell,
    ]  # fmt: skip


def pod_conditions(obj: Obj) -> list[Obj]:
    """A finished pod's row condition (kubectl hides such rows unless ``--show-all``-like)."""
    phase = _get(obj, "status", "phase")
    if phase == "Succeeded":
        return [{"type": "Completed", "status": "True", "reason": "Succeeded",
                 "message": "The pod has completed successfully."}]  # fmt: skip
    if phase == "Failed":
        return [{"type": "Completed", "status": "True", "reason": "Failed",
                 "message": "The pod failed."}]  # fmt: skip
    return []


def _event_row(obj: Obj, now: datetime) -> list[Cell]:
    first = since(obj.get("firstTimestamp"), now)
    if not obj.get("firstTimestamp"):
        first = since(obj.get("eventTime"), now)
    last = since(obj.get("lastTimestamp"), now) if obj.get("lastTimestamp") else first
    count = obj.get("count") or 0
    series = obj.get("series")
    if series:
        last = since(series.get("lastObservedTime"), now)
        count = series.get("count", 0)
    elif count == 0:
        count = 1
    involved = obj.get("involvedObject") or {}
    kind = str(involved.get("kind", "")).lower()
    target = f"{kind}/{involved['name']}" if involved.get("name") else kind
    source = obj.get("source") or {}
    component = source.get("component") or obj.get("reportingComponent", "")
    instance = source.get("host") or obj.get("reportingInstance", "")
    return [
        last, obj.get("type", ""), obj.get("reason", ""), target, involved.get("fieldPath", ""),
        f"{component}, {instance}" if instance else component,
        str(obj.get("message", "")).strip(), first, int(count), obj["metadata"]["name"],
    ]  # fmt: skip


Printer = tuple[tuple[Column, ...], Callable[[Obj, datetime], list[Cell]]]
PRINTERS: dict[str, Printer] = {
    "resourceslices.resource.k8s.io": (
        (NAME, Column("Node", "NodeName identifies the node which provides the resources in "
                      "this pool."),
         Column("Driver", "Driver identifies the DRA driver providing the capacity information."),
         Column("Pool", "Name is used to identify the pool."), AGE),
        lambda o, now: [o["metadata"]["name"], _get(o, "spec", "nodeName") or "",
                        _get(o, "spec", "driver") or "", _get(o, "spec", "pool", "name") or "",
                        _age(o, now)],
    ),
    "resourceclaims.resource.k8s.io": (
        (NAME, Column("State", "A summary of the current state (allocated, pending, reserved, "
                      "etc.)."), AGE),
        lambda o, now: [o["metadata"]["name"], _claim_state(o), _age(o, now)],
    ),
    "deviceclasses.resource.k8s.io": (
        (NAME, AGE), lambda o, now: [o["metadata"]["name"], _age(o, now)],
    ),
    "resourceclaimtemplates.resource.k8s.io": (
        (NAME, AGE), lambda o, now: [o["metadata"]["name"], _age(o, now)],
    ),
    "leases.coordination.k8s.io": (
        (NAME, Column("Holder", "holderIdentity contains the identity of the holder of a "
                      "current lease."), AGE),
        lambda o, now: [o["metadata"]["name"], _get(o, "spec", "holderIdentity") or "",
                        _age(o, now)],
    ),
    "nodes": (
        (NAME, Column("Status", "The status of the node"), Column("Roles", "The roles of the node"),
         AGE, Column("Version", "Kubelet Version reported by the node."),
         Column("Internal-IP", "List of addresses reachable to the node.", 1),
         Column("External-IP", "List of addresses reachable to the node.", 1),
         Column("OS-Image", "OS Image reported by the node from /etc/os-release.", 1),
         Column("Kernel-Version", "Kernel Version reported by the node.", 1),
         Column("Container-Runtime", "ContainerRuntime Version reported by the node.", 1)),
        _node_row,
    ),
    "pods": (
        (NAME, Column("Ready", "The aggregate readiness state of this pod for accepting traffic."),
         Column("Status", "The aggregate status of the containers in this pod."),
         Column("Restarts", "The number of times the containers in this pod have been restarted "
                "and when the last container in this pod has restarted."),
         AGE, Column("IP", "IP address allocated to the pod.", 1),
         Column("Node", "NodeName is a request to schedule this pod onto a specific node.", 1),
         Column("Nominated Node", "nominatedNodeName is set only when this pod preempts other "
                "pods on the node.", 1),
         Column("Readiness Gates", "If specified, all readiness gates will be evaluated for pod "
                "readiness.", 1)),
        _pod_row,
    ),
    "events": (
        (Column("Last Seen", "The time at which the most recent occurrence of this event was "
                "recorded."),
         Column("Type", "Type of this event (Normal, Warning)."),
         Column("Reason", "This should be a short, machine understandable string that gives "
                "the reason for the transition into the object's current status."),
         Column("Object", "The object that this event is about."),
         Column("Subobject", "The field of the object the event is about.", 1),
         Column("Source", "The component reporting this event.", 1),
         Column("Message", "A human-readable description of the status of this operation."),
         Column("First Seen", "The time at which the event was first recorded.", 1),
         Column("Count", "The number of times this event has occurred.", 1),
         Column("Name", "Name must be unique within a namespace.", 1, format="name")),
        _event_row,
    ),
}  # fmt: skip


def utc_now() -> datetime:
    return datetime.now(UTC)
