"""One node's devices as the scheduler's allocator sees them, from ResourceSlices and claims.

The scheduler gathers the pools whose slices reach a node (``nodeName``, ``allNodes``, a
``nodeSelector`` naming it, or per-device node selection), keeps each pool's newest
generation (pools by driver and name, those with binding conditions last; slices by name: the
1.36 scheduler's order), and notes which devices other claims already hold and how much of each shared
counter (KEP-4815 partitionable devices) their devices consume. This module does the same on
plain JSON objects, so it serves the embedded cluster, ``explain --simulate`` and tests alike.

A device allowing multiple allocations (KEP-5075) that consumes counters (a ``--dynamic-mig``
placement published with ``--consumable-shares``) consumes them once, however many claims hold
shares of it: the physical instance exists once. Upstream's allocator differs here: the
1.36 scheduler (``allocator_experimental.go``, ``checkAvailableCounters``) counts the counters
of earlier allocations from ``AllocatedDevices`` only, the devices held whole, so it does not
subtract the counters of shared devices other claims hold (docs/OPERATIONS.md, "Consumable
shares", says what that means for a node; the agent's prepare-time rules refuse an
overlapping placement).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from agent.dra.cel import device_variable
from agent.dra.quantity import parse_quantity

Obj = dict[str, Any]
CounterKey = tuple[str, str, str, str]  # driver, pool, counter set, counter


@dataclass(frozen=True, order=True)
class DeviceId:
    driver: str
    pool: str
    device: str

    def __str__(self) -> str:
        return f"{self.driver}/{self.pool}/{self.device}"


@dataclass(frozen=True)
class NodeDevice:
    """One device the node can use, in the allocator's search order."""

    id: DeviceId
    spec: Obj  # the ResourceSlice's device entry
    variable: Obj  # the CEL ``device`` variable
    node_local: bool  # from a slice (or device) bound to this node by name
    consumes: tuple[tuple[str, str, Fraction], ...]  # (counter set, counter, amount)
    problem: str = ""  # why its pool cannot be used at all (invalid), else ""
    pool_incomplete: bool = False
    #: where the scheduler read it, so ``explain`` can say why first fit reaches it when it
    #: does: the ResourceSlice's name (its ``generateName`` while it has none) and the
    #: device's 1-based place in that slice's ``devices`` list
    slice_name: str = ""
    slice_position: int = 0

    @property
    def taints(self) -> list[Obj]:
        return list(self.spec.get("taints") or [])

    @property
    def multi(self) -> bool:
        """KEP-5075 ``allowMultipleAllocations``: several allocations share the device."""
        return self.spec.get("allowMultipleAllocations") is True

    def capacity(self, qualified: str) -> Obj | None:
        """The ``capacity`` entry named ``qualified`` (unqualified names are the driver's)."""
        capacities = self.spec.get("capacity") or {}
        domain, _, short = qualified.rpartition("/")
        entry = capacities.get(qualified)
        if entry is None and domain == self.id.driver:
            entry = capacities.get(short)
        if entry is None and not domain:
            entry = capacities.get(f"{self.id.driver}/{short}")
        return entry if isinstance(entry, dict) else None

    def attribute(self, qualified: str) -> Any:
        """The raw value of attribute ``domain/name`` (unqualified names are the driver's)."""
        attributes = self.spec.get("attributes") or {}
        domain, _, short = qualified.rpartition("/")
        value = attributes.get(qualified)
        if value is None and domain == self.id.driver:
            value = attributes.get(short)
        if not value:
            return None
        return next(iter(value.values()))


@dataclass
class NodeState:
    """Everything allocation on one node depends on besides the claim."""

    node_name: str
    devices: list[NodeDevice] = field(default_factory=list)
    counters: dict[CounterKey, Fraction] = field(default_factory=dict)  # totals
    consumed: dict[CounterKey, Fraction] = field(default_factory=dict)  # by other claims
    in_use: dict[DeviceId, str] = field(default_factory=dict)  # device -> "ns/claim"
    #: KEP-5075: what the shares other claims hold consume, device -> capacity -> amount
    shared: dict[DeviceId, dict[str, Fraction]] = field(default_factory=dict)
    #: device -> the claims holding shares of it ("ns/claim")
    sharers: dict[DeviceId, list[str]] = field(default_factory=dict)
    #: shared devices whose counters other claims' shares consume already (once per device:
    #: a share of a MIG placement uses the one instance its first share made)
    counted: set[DeviceId] = field(default_factory=set)
    #: ``available`` by counter, until ``consumed`` changes
    _left: dict[CounterKey, Fraction] = field(default_factory=dict, repr=False)

    def capacity_left(self, device: NodeDevice, name: str) -> Fraction:
        """What is left of capacity ``name`` (as the slice spells it) of a shared device."""
        entry = (device.spec.get("capacity") or {}).get(name) or {}
        total = parse_quantity(str(entry.get("value", "0")))
        return total - self.shared.get(device.id, {}).get(name, Fraction(0))

    def available(self, key: CounterKey) -> Fraction | None:
        """What other claims leave of counter ``key`` (None: the pool has no such counter);
        remembered until the claims counted change (:func:`note_allocations`)."""
        left = self._left.get(key)
        if left is not None:
            return left
        total = self.counters.get(key)
        if total is None:
            return None
        used = self.consumed.get(key)
        left = total if used is None else total - used
        self._left[key] = left
        return left


def _reaches(spec: Mapping[str, Any], node_name: str, labels: Mapping[str, str]) -> bool | None:
    """True: bound to the node by name; False: not the node; None: all nodes/selector."""
    if spec.get("nodeName"):
        return True if spec["nodeName"] == node_name else False
    if spec.get("allNodes"):
        return None
    selector = spec.get("nodeSelector")
    if selector:
        return None if node_selector_matches(selector, node_name, labels) else False
    return False


def node_selector_matches(
    selector: Mapping[str, Any], node: str, labels: Mapping[str, str]
) -> bool:
    """A ``v1.NodeSelector``: any term matches when all its expressions and fields do."""
    for term in selector.get("nodeSelectorTerms") or []:
        checks = [(e, labels.get(e["key"])) for e in term.get("matchExpressions") or []]
        checks += [
            (e, node if e["key"] == "metadata.name" else None)
            for e in term.get("matchFields") or []
        ]
        if all(_requirement(e, value) for e, value in checks):
            return True
    return False


def _requirement(expression: Mapping[str, Any], value: str | None) -> bool:
    operator, values = expression.get("operator"), expression.get("values") or []
    if operator == "In":
        return value in values
    if operator == "NotIn":
        return value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    return False


def _newest_pools(slices: Iterable[Obj]) -> dict[tuple[str, str], list[Obj]]:
    pools: dict[tuple[str, str], list[Obj]] = {}
    for item in slices:
        spec = item["spec"]
        pools.setdefault((spec["driver"], spec["pool"]["name"]), []).append(item)
    newest = {}
    for key, items in pools.items():
        generation = max(int(i["spec"]["pool"].get("generation", 0)) for i in items)
        newest[key] = sorted(
            (i for i in items if int(i["spec"]["pool"].get("generation", 0)) == generation),
            key=lambda i: str(i["metadata"].get("name", "")),
        )
    # 1.36: pools by (driver, name), slices by name; pools whose devices have binding
    # conditions (KEP-5007) after all others, so that devices ready at once are preferred.
    ordered = sorted(newest.items(), key=lambda item: (_binds_later(item[1]), item[0]))
    return dict(ordered)


def _binds_later(items: list[Obj]) -> bool:
    return any(
        device.get("bindingConditions")
        for item in items
        for device in item["spec"].get("devices") or []
    )


def build_node_state(
    node_name: str,
    slices: Iterable[Obj],
    claims: Iterable[Obj] = (),
    *,
    node_labels: Mapping[str, str] | None = None,
    exclude_claim_uid: str | None = None,
) -> NodeState:
    """The node's usable devices, shared counters and in-use devices.

    ``claims`` are every allocated ResourceClaim the scheduler would know of (any node);
    ``exclude_claim_uid`` leaves out the claim being (re)allocated.
    """
    labels = dict(node_labels or {})
    state = NodeState(node_name)
    for (driver, pool), items in _newest_pools(slices).items():
        expected = max(int(i["spec"]["pool"].get("resourceSliceCount", 1)) for i in items)
        incomplete = len(items) < expected
        sets: dict[str, dict[str, Fraction]] = {}
        for item in items:
            for counter_set in item["spec"].get("sharedCounters") or []:
                values = {
                    name: parse_quantity(str(c["value"]))
                    for name, c in (counter_set.get("counters") or {}).items()
                }
                sets[counter_set["name"]] = values
        pool_devices: list[NodeDevice] = []
        names: set[str] = set()
        duplicate = False
        for item in items:
            spec = item["spec"]
            reach = _reaches(spec, node_name, labels)
            where = _slice_name(item)
            for position, device in enumerate(spec.get("devices") or [], start=1):
                device_reach = reach
                if spec.get("perDeviceNodeSelection"):
                    device_reach = _reaches(device, node_name, labels)
                if device_reach is False:
                    continue
                duplicate = duplicate or device["name"] in names
                names.add(device["name"])
                pool_devices.append(
                    _node_device(driver, pool, device, bool(device_reach), sets, (where, position))
                )
        if not pool_devices:
            continue
        for name, values in sets.items():
            for counter, value in values.items():
                state.counters[(driver, pool, name, counter)] = value
        problem = f"pool {driver}/{pool} has duplicate device names" if duplicate else ""
        for device in pool_devices:
            if problem or incomplete:  # every other field, the slice's place included, kept
                device = replace(
                    device, problem=device.problem or problem, pool_incomplete=incomplete
                )
            state.devices.append(device)
    _note_allocations(state, claims, exclude_claim_uid)
    return state


def _slice_name(item: Obj) -> str:
    """``metadata.name``, or the ``generateName`` of a slice not created yet (a preview)."""
    metadata = item.get("metadata") or {}
    return str(metadata.get("name") or metadata.get("generateName") or "")


def _node_device(
    driver: str,
    pool: str,
    device: Obj,
    node_local: bool,
    sets: Mapping[str, Mapping[str, Fraction]],
    place: tuple[str, int] = ("", 0),
) -> NodeDevice:
    """The device as the allocator checks it; ``place``: its slice's name and its 1-based
    position in that slice's ``devices``."""
    consumes: list[tuple[str, str, Fraction]] = []
    problem = ""
    for consumption in device.get("consumesCounters") or []:
        name = consumption["counterSet"]
        for counter, amount in (consumption.get("counters") or {}).items():
            if counter not in sets.get(name, {}):
                problem = f"counter {name}/{counter} it consumes is in no slice of pool {pool}"
            consumes.append((name, counter, parse_quantity(str(amount["value"]))))
    return NodeDevice(
        DeviceId(driver, pool, device["name"]),
        device,
        device_variable(device, driver),
        node_local,
        tuple(consumes),
        problem,
        slice_name=place[0],
        slice_position=place[1],
    )


def note_allocations(state: NodeState, claims: Iterable[Obj]) -> None:
    """Count the devices and counters ``claims`` (allocated ResourceClaims) hold, on top of
    what ``state`` counts already (a simulator placing claims one by one)."""
    _note_allocations(state, claims, None)


def forget_allocations(state: NodeState) -> None:
    """Count no claim at all: the node as :func:`build_node_state` found it without claims."""
    state.consumed.clear()
    state._left.clear()
    state.in_use.clear()
    state.shared.clear()
    state.sharers.clear()
    state.counted.clear()


def _note_allocations(state: NodeState, claims: Iterable[Obj], exclude_uid: str | None) -> None:
    by_id = {d.id: d for d in state.devices}
    for claim in claims:
        metadata = claim.get("metadata", {})
        if exclude_uid is not None and metadata.get("uid") == exclude_uid:
            continue
        allocation = (claim.get("status") or {}).get("allocation") or {}
        owner = f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"
        for result in (allocation.get("devices") or {}).get("results") or []:
            if result.get("adminAccess"):
                continue  # admin access does not count as allocated
            device_id = DeviceId(result["driver"], result["pool"], result["device"])
            device = by_id.get(device_id)
            if result.get("shareID") is not None:  # a share: the device stays available
                _note_share(state, device_id, device, result, owner)
                if device_id in state.counted:
                    continue  # its counters are consumed once, by its first share
                state.counted.add(device_id)
            else:
                state.in_use[device_id] = owner
            for name, counter, amount in device.consumes if device else ():
                key = (device_id.driver, device_id.pool, name, counter)
                state.consumed[key] = state.consumed.get(key, Fraction(0)) + amount
                state._left.pop(key, None)


def _note_share(
    state: NodeState, device_id: DeviceId, device: NodeDevice | None, result: Obj, owner: str
) -> None:
    """A share another claim holds: its consumedCapacity, by the slice's capacity names."""
    used = state.shared.setdefault(device_id, {})
    for name, amount in (result.get("consumedCapacity") or {}).items():
        entry_name = name
        if device is not None:
            capacities = device.spec.get("capacity") or {}
            entry_name = next(
                (k for k in capacities if device.capacity(name) is capacities[k]), name
            )
        used[entry_name] = used.get(entry_name, Fraction(0)) + parse_quantity(str(amount))
    state.sharers.setdefault(device_id, []).append(owner)
