"""Whether one device can serve one request, check by check, with what each check saw.

The allocator needs only the answer; ``explain`` needs every check's verdict and the value
behind it, so both use these records: the DeviceClass's and the request's selectors, the
device's taints against the request's tolerations, another claim holding the device, and the
shared counters it would consume.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

from agent.dra.allocator.claim import Request
from agent.dra.allocator.node import NodeDevice, NodeState
from agent.dra.capacity import consumed_amount
from agent.dra.cel import CelError, split_name
from agent.dra.quantity import parse_quantity

Obj = dict[str, Any]
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """``DeviceToleration`` semantics: an empty key with Exists matches every key, an empty
    effect every effect; ``operator`` defaults to Equal."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    operator = toleration.get("operator") or "Equal"
    if key and key != taint.get("key"):
        return False
    if operator == "Exists":
        return True
    if operator == "Equal":
        return bool(key) and (toleration.get("value") or "") == (taint.get("value") or "")
    return False


def blocks(taint: Mapping[str, Any], tolerations: tuple[Obj, ...]) -> bool:
    """NoSchedule and NoExecute block unless tolerated; None (and unknown effects) never do."""
    if taint.get("effect") not in BLOCKING_EFFECTS:
        return False
    return not any(tolerates(t, taint) for t in tolerations)


@dataclass(frozen=True)
class SelectorVerdict:
    source: str
    expression: str
    result: bool | None  # None: it failed (error)
    saw: dict[str, Any]
    error: CelError | None = None


class CounterVerdict(NamedTuple):
    """One shared counter a device consumes (a tuple: a node of 8 GPUs with every MIG
    placement published makes thousands of these per claim, ``sim packing`` millions)."""

    counter_set: str
    counter: str
    needs: Fraction
    available: Fraction  # after other claims' devices
    exhausted: bool


@dataclass(frozen=True)
class CapacityVerdict:
    """One capacity of the device against the request (KEP-5075). ``consumes`` is what an
    allocation would take (None: the request breaks the capacity's request policy, or the
    device lacks a capacity the request names); ``left`` what other claims' shares leave."""

    capacity: str
    requested: Fraction | None
    consumes: Fraction | None
    left: Fraction
    shared: bool  # the device allows multiple allocations

    @property
    def fits(self) -> bool:
        return self.consumes is not None and self.consumes <= self.left


class DeviceCheck(NamedTuple):
    """Every check of one device for one request (a tuple: made per device per request per
    node the scheduler tries; see :class:`CounterVerdict`)."""

    device: NodeDevice
    selectors: tuple[SelectorVerdict, ...]
    taints: tuple[tuple[Obj, bool], ...]  # (taint, blocks)
    in_use_by: str | None
    counters: tuple[CounterVerdict, ...]
    admin_access: bool
    capacities: tuple[CapacityVerdict, ...] = ()

    @property
    def selected(self) -> bool:
        return all(s.result is True for s in self.selectors)

    @property
    def error(self) -> CelError | None:
        return next((s.error for s in self.selectors if s.error is not None), None)

    @property
    def verdict(self) -> str:
        """The first reason the device cannot serve the request, or ``candidate``."""
        if self.error is not None:
            return "selector error"
        if not self.selected:
            return "not selected"
        if self.device.problem:
            return "pool invalid"
        if any(b for _, b in self.taints):
            return "tainted"
        if self.in_use_by is not None and not self.admin_access:
            return "in use"
        if any(c.consumes is None for c in self.capacities):
            return "capacity policy"
        if any(not c.fits for c in self.capacities) and not self.admin_access:
            return "capacity exhausted"
        if any(c.exhausted for c in self.counters) and not self.admin_access:
            return "counters exhausted"
        return "candidate"

    @property
    def usable(self) -> bool:
        return self.verdict == "candidate"


def raw_value(device: NodeDevice, reference: tuple[str, str, str]) -> Any:
    """What the ResourceSlice says for ``(field, domain, name)``; None when it has nothing."""
    field_name, domain, name = reference
    if field_name == "driver":
        return device.id.driver
    entries = device.spec.get(field_name) or {}
    for qualified, value in entries.items():
        if split_name(qualified, device.id.driver) == (domain, name):
            if field_name == "capacity":
                return value.get("value")
            return next(iter(value.values()), None)
    return None


def reference_label(reference: tuple[str, str, str]) -> str:
    field_name, domain, name = reference
    return "driver" if field_name == "driver" else f"{field_name}[{domain}].{name}"


_ZERO = Fraction(0)


def exceeds(amount: Fraction, left: Fraction) -> bool:
    """``amount > left``; counters are whole numbers nearly always, and comparing those as
    integers costs a tenth of the Fraction comparison."""
    if amount.denominator == 1 and left.denominator == 1:
        return amount.numerator > left.numerator
    return amount > left


def check_device(
    request: Request, device: NodeDevice, state: NodeState, *, selected: bool = False
) -> DeviceCheck:
    """Every check of ``device`` for ``request``; ``selected``: the caller knows the
    selectors select it (they are not evaluated again, and no verdict of theirs is kept)."""
    verdicts = []
    for source in () if selected else request.selectors:
        if source.selector is None:
            verdicts.append(SelectorVerdict(source.source, "", None, {}, source.error))
            continue
        selector = source.selector
        saw = {reference_label(r): raw_value(device, r) for r in selector.references}
        try:
            result: bool | None = selector.matches(device.variable)
            error = None
        except CelError as err:
            result, error = None, err
        verdicts.append(SelectorVerdict(source.source, selector.expression, result, saw, error))
        if result is not True:
            break  # like the scheduler: the first failing selector decides
    taints = tuple((t, blocks(t, request.tolerations)) for t in device.taints)
    counters = []
    # a shared device whose counters other claims' shares consume already: one more share
    # takes none (the instance exists once)
    held = device.multi and device.id in state.counted and not request.admin_access
    driver, pool = device.id.driver, device.id.pool
    for counter_set, counter, amount in device.consumes:
        available = state.available((driver, pool, counter_set, counter))
        left = _ZERO if available is None else available
        if held:
            amount = _ZERO
        counters.append(CounterVerdict(counter_set, counter, amount, left, exceeds(amount, left)))
    return DeviceCheck(
        device,
        tuple(verdicts),
        taints,
        state.in_use.get(device.id),
        tuple(counters),
        bool(request.admin_access),
        capacity_verdicts(request, device, state),
    )


def capacity_verdicts(
    request: Request, device: NodeDevice, state: NodeState
) -> tuple[CapacityVerdict, ...]:
    """A shared device: every capacity, what the request would consume of it by its policy
    (``agent.dra.capacity``) and what is left; a device for one claim: the capacities the
    request names, which the device must have at least of."""
    asked: dict[str, Fraction] = {}
    out = []
    for name, amount in request.capacity:
        entry = device.capacity(name)
        key = _entry_name(device, entry) if entry is not None else name
        asked[key] = amount
        if entry is None:
            out.append(CapacityVerdict(name, amount, None, Fraction(0), device.multi))
    if not device.multi:
        for name, amount in asked.items():
            entry = (device.spec.get("capacity") or {}).get(name)
            if entry is not None:
                value = parse_quantity(str(entry.get("value", "0")))
                out.append(
                    CapacityVerdict(name, amount, amount if amount <= value else None, value, False)
                )
        return tuple(out)
    for name, entry in sorted((device.spec.get("capacity") or {}).items()):
        value = parse_quantity(str(entry.get("value", "0")))
        consumes = consumed_amount(asked.get(name), value, entry.get("requestPolicy"))
        out.append(
            CapacityVerdict(
                name, asked.get(name), consumes, state.capacity_left(device, name), True
            )
        )
    return tuple(out)


def _entry_name(device: NodeDevice, entry: Obj) -> str:
    capacities = device.spec.get("capacity") or {}
    return str(next(k for k, v in capacities.items() if v is entry))
