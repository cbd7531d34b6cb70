"""The answer to "why does my claim not fit this node?", as plain data (``explain``).

For each request (each ``firstAvailable`` subrequest), every device of the node with each
selector's verdict and the values it read, the taints and whether they block, the claim
holding it, the shared counters it would overdraw, for a shared device (KEP-5075) what a share
would consume of each capacity and what the other claims' shares leave, and one overall
verdict; then each
``matchAttribute`` constraint with the candidates grouped by value, and the allocation the
scheduler would make or the reasons there is none. Values are JSON-ready.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.dra.allocator.checks import DeviceCheck
from agent.dra.allocator.claim import ParsedClaim, Request
from agent.dra.allocator.node import NodeState
from agent.dra.allocator.search import Outcome, quantity_text

Obj = dict[str, Any]


def _number(value: Any) -> Any:
    if value.denominator == 1:
        return int(value)
    return float(value)


def _device(check: DeviceCheck, chosen: bool, sharers: list[str]) -> Obj:
    out: Obj = {
        "device": check.device.id.device,
        "pool": check.device.id.pool,
        "driver": check.device.id.driver,
        "verdict": "allocated" if chosen else check.verdict,
        "selectors": [
            {
                "source": s.source,
                "result": s.result,
                "saw": dict(s.saw),
                **({"error": s.error.to_dict()} if s.error is not None else {}),
            }
            for s in check.selectors
        ],
    }
    if check.taints:
        out["taints"] = [{**dict(t), "blocks": b} for t, b in check.taints]
    if check.in_use_by is not None:
        out["allocatedTo"] = check.in_use_by
    if check.counters:
        out["counters"] = [
            {
                "counterSet": c.counter_set,
                "counter": c.counter,
                "needs": _number(c.needs),
                "available": _number(c.available),
                "exhausted": c.exhausted,
            }
            for c in check.counters
        ]
    if check.capacities:  # KEP-5075: what a share would take, what the others leave
        out["capacity"] = [
            {
                "capacity": c.capacity,
                "requested": None if c.requested is None else quantity_text(c.requested),
                "consumes": None if c.consumes is None else quantity_text(c.consumes),
                "remaining": quantity_text(c.left),
                "fits": c.fits,
            }
            for c in check.capacities
        ]
    if sharers:
        out["sharedBy"] = list(sharers)
    if check.device.problem:
        out["problem"] = check.device.problem
    return out


def _request(
    request: Request, checks: list[DeviceCheck], chosen: set[tuple[str, Any]], state: NodeState
) -> Obj:
    out: Obj = {
        "name": request.name,
        "deviceClassName": request.class_name,
        "allocationMode": request.mode,
        "selectors": [
            {"source": s.source, "expression": s.selector.expression if s.selector else ""}
            for s in request.selectors
        ],
        "candidates": sum(1 for c in checks if c.usable),
        "devices": [
            _device(c, (request.name, c.device.id) in chosen, state.sharers.get(c.device.id, []))
            for c in checks
        ],
    }
    if request.mode == "ExactCount":
        out["count"] = request.count
    if request.admin_access is not None:
        out["adminAccess"] = request.admin_access
    if request.class_problem:
        out["problem"] = request.class_problem
    return out


def explain(claim: ParsedClaim, state: NodeState, outcome: Outcome) -> Obj:
    chosen = {(a.request.name, a.device.id) for a in outcome.devices}
    requests = [
        _request(alternative, outcome.checks[alternative.name], chosen, state)
        for claim_request in claim.requests
        for alternative in claim_request.alternatives
    ]
    constraints = []
    for constraint in claim.constraints:
        groups: dict[str, list[str]] = {}
        for claim_request in claim.requests:
            for alternative in claim_request.alternatives:
                if not constraint.applies_to(alternative):
                    continue
                for check in outcome.checks[alternative.name]:
                    if check.usable:
                        value = check.device.attribute(constraint.match_attribute)
                        key = "(missing)" if value is None else str(value)
                        names = groups.setdefault(key, [])
                        if check.device.id.device not in names:
                            names.append(check.device.id.device)
        constraints.append(
            {
                constraint.kind: constraint.match_attribute,
                "requests": list(constraint.requests) or ["(all)"],
                "groups": [{"value": k, "devices": v} for k, v in groups.items()],
            }
        )
    return {
        "claim": f"{claim.namespace}/{claim.name}",
        "node": state.node_name,
        "fits": outcome.fits,
        "reasons": list(outcome.reasons),
        "requests": requests,
        "constraints": constraints,
        "allocation": outcome.allocation,
    }


def summary(report: Mapping[str, Any]) -> str:
    verdict = "fits" if report["fits"] else "does not fit"
    return f"claim {report['claim']} {verdict} node {report['node']}"
