"""The answer to "why does my claim not fit this node?", as plain data (``explain``).

For each request (each ``firstAvailable`` subrequest), every device of the node with each
selector's verdict and the values it read, the taints and whether they block, the claim
holding it, the shared counters it would overdraw, for a shared device (KEP-5075) what a share
would consume of each capacity and what the other claims' shares leave, and one overall
verdict; then each
``matchAttribute`` constraint with the candidates grouped by value, and the allocation the
scheduler would make or the reasons there is none. Values are JSON-ready.

kube-scheduler does not score devices: it takes the first solution of its walk over the
node's pools, slices and devices (``node``), so which device a fitting claim gets follows from
where the device is published. ``firstFit`` says so per allocated device: its place in that
walk and in its slice, and why first fit went past the devices before it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from agent.dra.allocator.checks import DeviceCheck
from agent.dra.allocator.claim import ParsedClaim, Request
from agent.dra.allocator.node import DeviceId, NodeState
from agent.dra.allocator.search import Allocated, Outcome, quantity_text

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
        "firstFit": first_fit(claim, state, outcome),
        "allocation": outcome.allocation,
    }


#: A usable device first fit went past because this claim's allocation has it already.
TAKEN_BY_REQUEST, TAKEN_BY_CLAIM = "taken by this request", "taken by this claim"
#: ... because a ``matchAttribute``/``distinctAttribute`` constraint ruled it out, or for a
#: reason the outcome does not record (this claim's own counters or shares, backtracking).
CONSTRAINT, PASSED_OVER = "constraint", "passed over"
NOT_SELECTED = "not selected"


def first_fit(claim: ParsedClaim, state: NodeState, outcome: Outcome) -> list[Obj]:
    """Per allocated device, in allocation order: where the scheduler's walk finds it and a
    count, by reason, of the devices the walk meets before it for the same request (``[]``
    when the claim does not fit). People ask "why that GPU?"; the answer is its place in the
    published order, since nothing else ranks devices."""
    if not outcome.fits:
        return []
    order: dict[DeviceId, int] = {}
    for number, device in enumerate(state.devices, start=1):
        order.setdefault(device.id, number)
    entries = []
    for allocated in outcome.devices:
        device = allocated.device
        checks = outcome.checks[allocated.request.name]
        index = next(i for i, c in enumerate(checks) if c.device.id == device.id)
        reasons = Counter(_why_not(claim, outcome, allocated, c) for c in checks[:index])
        before = dict(sorted(reasons.items(), key=lambda item: (-item[1], item[0])))
        entry: Obj = {
            "request": allocated.request.name,
            "device": device.id.device,
            "pool": device.id.pool,
            "driver": device.id.driver,
            "order": order[device.id],
            "of": len(state.devices),
            "slice": device.slice_name,
            "inSlice": device.slice_position,
            "before": before,
        }
        entry["why"] = _sentence(entry)
        entries.append(entry)
    return entries


def _why_not(claim: ParsedClaim, outcome: Outcome, allocated: Allocated, check: DeviceCheck) -> str:
    """Why first fit did not take ``check``'s device for ``allocated``'s request: its verdict,
    or for a usable one what this claim's allocation tells (who took it, a constraint)."""
    if not check.usable:
        return check.verdict
    holders = {a.request.name for a in outcome.devices if a.device.id == check.device.id}
    if allocated.request.name in holders:
        return TAKEN_BY_REQUEST
    if holders:
        return TAKEN_BY_CLAIM
    request = allocated.request
    for constraint in claim.constraints:
        if not constraint.applies_to(request):
            continue
        value = check.device.attribute(constraint.match_attribute)
        if value is None:
            return CONSTRAINT
        if constraint.distinct:
            taken = [
                a.device.attribute(constraint.match_attribute)
                for a in outcome.devices
                if a is not allocated and constraint.applies_to(a.request)
            ]
            if value in taken:
                return CONSTRAINT
        elif value != allocated.device.attribute(constraint.match_attribute):
            return CONSTRAINT
    return PASSED_OVER


def chosen_before(before: Mapping[str, int]) -> str:
    """``2 in use, 1 counters exhausted``: the devices before it the selectors choose."""
    return ", ".join(f"{n} {reason}" for reason, n in before.items() if reason != NOT_SELECTED)


def _sentence(entry: Mapping[str, Any]) -> str:
    where = (
        f"{entry['device']} is device {entry['order']} of {entry['of']} in the order the node "
        f"publishes (slice {entry['slice']}, position {entry['inSlice']}): first fit took it"
    )
    seen = sum(n for reason, n in entry["before"].items() if reason != NOT_SELECTED)
    if not seen:
        return f"{where}, the first device the request's selectors choose"
    return f"{where} after {seen} the selectors choose: {chosen_before(entry['before'])}"


def summary(report: Mapping[str, Any]) -> str:
    verdict = "fits" if report["fits"] else "does not fit"
    return f"claim {report['claim']} {verdict} node {report['node']}"
