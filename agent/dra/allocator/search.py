"""Allocate one claim on one node the way kube-scheduler's structured allocator does.

Requests are satisfied in order; a ``firstAvailable`` request tries its subrequests in order;
``ExactCount`` takes devices in the node's device order (pools by driver and name, slices by
name, devices as listed) and backtracks when a later choice cannot be completed, so the first
allocation found is the scheduler's. ``All`` takes every selected device and fails if one of
them cannot be had. A device must pass its class's and the request's selectors, carry no
untolerated NoSchedule/NoExecute taint, not be held by another claim (unless admin access),
fit in what is left of the shared counters it consumes, and keep every ``matchAttribute``
constraint equal. A selector that fails on a device fails the allocation, as in Kubernetes.
A shared device (KEP-5075) consumes its counters once: with its first share, in this claim or
another; a further share must fit by capacity only (``node``).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from agent.dra.allocator.checks import DeviceCheck, check_device
from agent.dra.allocator.claim import ParsedClaim, Request
from agent.dra.allocator.node import CounterKey, DeviceId, NodeDevice, NodeState
from agent.dra.allocator.result import allocation_result
from agent.dra.quantity import format_quantity

Obj = dict[str, Any]
#: resource.k8s.io/v1 AllocationResultsMaxSize
MAX_RESULTS = 32
#: Devices tried before giving up (the scheduler bounds its search by time instead).
MAX_STEPS = 1_000_000


@dataclass(frozen=True)
class Allocated:
    request: Request
    device: NodeDevice
    #: KEP-5075, a device allowing multiple allocations: what this share consumes
    consumed: tuple[tuple[str, Fraction], ...] = ()

    @property
    def shared(self) -> bool:
        return self.device.multi


@dataclass(frozen=True)
class Outcome:
    """The allocation (``status.allocation``) or why there is none, plus every check made."""

    fits: bool
    allocation: Obj | None
    devices: tuple[Allocated, ...]
    reasons: tuple[str, ...]
    checks: dict[str, list[DeviceCheck]] = field(repr=False)


class _Abort(Exception):
    """Stop the whole search (a selector error, too many steps)."""


class _Search:
    def __init__(self, claim: ParsedClaim, state: NodeState, checks: dict[str, list[DeviceCheck]]):
        self.claim = claim
        self.state = state
        self.checks = checks
        self.chosen: list[Allocated] = []
        self.allocating: Counter[DeviceId] = Counter()
        #: shares of each shared device taken here (not admin access): its counters are
        #: consumed with the first one, unless other claims' shares consume them already
        self.sharing: Counter[DeviceId] = Counter()
        self.used: dict[CounterKey, Fraction] = {}
        self.values: dict[int, tuple[Any, int]] = {}  # constraint -> (value, devices holding it)
        self.distinct: dict[int, Counter[Any]] = {}  # distinctAttribute -> values taken
        self.capacity: dict[tuple[DeviceId, str], Fraction] = {}  # shares taken here
        self.verdicts = {(name, c.device.id): c for name, found in checks.items() for c in found}
        self.steps = 0

    def solve(self, index: int) -> bool:
        if index == len(self.claim.requests):
            return True
        for request in self.claim.requests[index].alternatives:
            if request.class_problem:
                continue
            checks = self.checks[request.name]
            error = next((c.error for c in checks if c.error is not None), None)
            if error is not None:
                raise _Abort(f"request {request.name}: {error.message} on a device (see explain)")
            if request.mode == "All":
                selected = [c for c in checks if c.selected]
                if not selected or any(not c.usable or c.device.pool_incomplete for c in selected):
                    continue
                if self._place_all(request, [c.device for c in selected], index):
                    return True
            else:
                candidates = [c.device for c in checks if c.usable]
                if self._place(request, candidates, 0, request.count, index):
                    return True
        return False

    def _place_all(self, request: Request, devices: list[NodeDevice], index: int) -> bool:
        added = 0
        for device in devices:
            if not self._add(request, device):
                break
            added += 1
        else:
            if self.solve(index + 1):
                return True
        for _ in range(added):
            self._remove()
        return False

    def _place(
        self, request: Request, candidates: list[NodeDevice], start: int, left: int, index: int
    ) -> bool:
        if left == 0:
            return self.solve(index + 1)
        for position in range(start, len(candidates) - left + 1):
            if self._add(request, candidates[position]):
                if self._place(request, candidates, position + 1, left - 1, index):
                    return True
                self._remove()
        return False

    def _add(self, request: Request, device: NodeDevice) -> bool:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _Abort(f"gave up after trying {MAX_STEPS} devices")
        if len(self.chosen) >= MAX_RESULTS:
            return False
        if not request.admin_access and not device.multi and self.allocating[device.id]:
            return False
        for number, constraint in enumerate(self.claim.constraints):
            if not constraint.applies_to(request):
                continue
            value = device.attribute(constraint.match_attribute)
            if value is None:
                return False
            if constraint.distinct:
                if self.distinct.get(number, Counter())[value]:
                    return False
            elif number in self.values and self.values[number][0] != value:
                return False
        consumed = self._consumed(request, device)
        if consumed is None:
            return False
        if self._counts(request, device, 1):
            for counter_set, counter, amount in device.consumes:
                key = (device.id.driver, device.id.pool, counter_set, counter)
                available = self.state.available(key) or Fraction(0)
                if self.used.get(key, Fraction(0)) + amount > available:
                    return False
        self._apply(request, device, 1, consumed)
        self.chosen.append(Allocated(request, device, consumed))
        return True

    def _consumed(
        self, request: Request, device: NodeDevice
    ) -> tuple[tuple[str, Fraction], ...] | None:
        """What a share of ``device`` for ``request`` takes (empty for a device of one
        claim), or None when what is left, after this claim's other shares, is too little."""
        if not device.multi or request.admin_access:
            return ()
        check = self.verdicts[(request.name, device.id)]
        taken = []
        for verdict in check.capacities:
            if verdict.consumes is None:
                return None
            used = self.capacity.get((device.id, verdict.capacity), Fraction(0))
            if used + verdict.consumes > verdict.left:
                return None
            taken.append((verdict.capacity, verdict.consumes))
        return tuple(taken)

    def _counts(self, request: Request, device: NodeDevice, sign: int) -> bool:
        """Whether adding (``sign`` 1) or removing (-1) this allocation changes the counters:
        not for admin access, and for a shared device only with its first share."""
        if request.admin_access:
            return False
        if not device.multi:
            return True
        if device.id in self.state.counted:
            return False
        return self.sharing[device.id] == (0 if sign > 0 else 1)

    def _remove(self) -> None:
        last = self.chosen.pop()
        self._apply(last.request, last.device, -1, last.consumed)

    def _apply(
        self,
        request: Request,
        device: NodeDevice,
        sign: int,
        consumed: tuple[tuple[str, Fraction], ...],
    ) -> None:
        counts = self._counts(request, device, sign)
        self.allocating[device.id] += sign
        if device.multi and not request.admin_access:
            self.sharing[device.id] += sign
        for name, amount in consumed:
            taken = (device.id, name)
            self.capacity[taken] = self.capacity.get(taken, Fraction(0)) + sign * amount
        for number, constraint in enumerate(self.claim.constraints):
            if constraint.applies_to(request) and constraint.distinct:
                self.distinct.setdefault(number, Counter())[
                    device.attribute(constraint.match_attribute)
                ] += sign
            elif constraint.applies_to(request):
                value, holders = self.values.get(
                    number, (device.attribute(constraint.match_attribute), 0)
                )
                if holders + sign == 0:
                    self.values.pop(number, None)
                else:
                    self.values[number] = (value, holders + sign)
        if counts:
            for counter_set, counter, amount in device.consumes:
                key = (device.id.driver, device.id.pool, counter_set, counter)
                self.used[key] = self.used.get(key, Fraction(0)) + sign * amount


def allocate(
    claim: ParsedClaim,
    state: NodeState,
    share_id: Callable[[], str] = lambda: str(uuid.uuid4()),
    *,
    selected: Callable[[Request], Sequence[NodeDevice]] | None = None,
    binding_conditions: bool = False,
) -> Outcome:
    """Allocate ``claim`` on ``state``'s node; never raises for an unsatisfiable claim.
    ``share_id`` makes the ``shareID`` of each allocation of a shared device (a UUID, as
    the scheduler's). ``selected``, when given, names for each request the devices its
    selectors select, in the node's order (a caller that allocates many claims of the same
    shapes, ``sim packing``, remembers them: the devices do not change between claims, and
    the CEL selectors are most of the cost); only those are checked, and the outcome's
    checks then leave out the devices the selectors turn away. ``binding_conditions`` is
    the scheduler's ``DRADeviceBindingConditions`` gate (on from 1.36): the results copy the
    devices' binding conditions and ``bindsToNode`` devices get the node selector."""
    checks = {
        request.name: (
            [check_device(request, device, state) for device in state.devices]
            if selected is None
            else [check_device(request, d, state, selected=True) for d in selected(request)]
        )
        for claim_request in claim.requests
        for request in claim_request.alternatives
    }
    search = _Search(claim, state, checks)
    try:
        found = search.solve(0)
    except _Abort as abort:
        return Outcome(False, None, (), (str(abort),), checks)
    if not found:
        return Outcome(False, None, (), tuple(failure_reasons(claim, checks)), checks)
    chosen = tuple(search.chosen)
    allocation = allocation_result(
        claim, chosen, state.node_name, share_id, binding_conditions=binding_conditions
    )
    return Outcome(True, allocation, chosen, (), checks)


def failure_reasons(claim: ParsedClaim, checks: dict[str, list[DeviceCheck]]) -> list[str]:
    """Why each request cannot be met on its own, or that they cannot be met together."""
    reasons = []
    for claim_request in claim.requests:
        for request in claim_request.alternatives:
            reason = _request_reason(claim, request, checks[request.name])
            if reason:
                reasons.append(f"request {request.name}: {reason}")
    if not reasons:
        reasons.append(
            "each request can be met alone, but not all together "
            "(shared devices, counters or constraints across requests)"
        )
    return reasons


def _request_reason(claim: ParsedClaim, request: Request, checks: list[DeviceCheck]) -> str:
    if request.class_problem:
        return request.class_problem
    usable = [c for c in checks if c.usable]
    verdicts = Counter(c.verdict for c in checks if not c.usable)
    summary = ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items()))
    if request.mode == "All":
        selected = [c for c in checks if c.selected]
        if not selected:
            return "allocationMode All, but no device matches the selectors"
        blocked = [c for c in selected if not c.usable]
        if blocked:
            names = ", ".join(f"{c.device.id.device} ({c.verdict})" for c in blocked)
            return f"allocationMode All needs every matching device, but: {names}"
        if any(c.device.pool_incomplete for c in selected):
            return "allocationMode All, but a pool is being updated (incomplete)"
        need = len(selected)
    else:
        need = request.count
    applying = [c for c in claim.constraints if c.applies_to(request)]
    best = need
    applying = [c for c in applying if not c.distinct]
    names = " and ".join(k.match_attribute for k in applying)
    if applying:
        groups = Counter(
            tuple(c.device.attribute(k.match_attribute) for k in applying) for c in usable
        )
        best = max((n for key, n in groups.items() if None not in key), default=0)
    if len(usable) < need:
        text = f"needs {need} device(s), {len(usable)} available" + (
            f" ({summary})" if summary else ""
        )
        text += exhausted_capacity(checks)
        return text + (f"; at most {best} of them share {names}" if applying else "")
    if best < need:
        return (
            f"needs {need} device(s) with equal {names}; {len(usable)} available, "
            f"at most {best} of them share those values"
        )
    if any(c.counters for c in usable):
        return f"the {len(usable)} available device(s) together exceed the shared counters"
    return ""


def exhausted_capacity(checks: list[DeviceCheck]) -> str:
    """``; capacity memory of gpu-0: needs 1Gi, 0 left`` for each shared device too full."""
    parts = []
    for check in checks:
        if check.verdict != "capacity exhausted":
            continue
        for c in check.capacities:
            if not c.fits and c.consumes is not None:
                parts.append(
                    f"capacity {c.capacity} of {check.device.id.device}: needs "
                    f"{quantity_text(c.consumes)}, {quantity_text(c.left)} left"
                )
    return "".join(f"; {part}" for part in parts)


def quantity_text(value: Fraction) -> str:
    return format_quantity(int(value)) if value.denominator == 1 and value >= 0 else str(value)
