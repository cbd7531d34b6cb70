"""The typed DRA device model: attributes, taints and devices in Kubernetes' wire shape.

Plain dicts would let a device with two attribute values, a 70-character string or a bad
name reach the API server, which rejects the whole ResourceSlice. These frozen dataclasses
validate on construction, so every object that exists is publishable, and ``to_dict()``
renders the exact camelCase JSON of ``resource.k8s.io/v1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Literal

from agent.dra import limits
from agent.dra.capacity import RequestPolicy
from agent.dra.errors import InvalidNameError, InvalidValueError, LimitExceededError
from agent.dra.names import (
    is_dns_label,
    is_label_value,
    is_semver,
    label_key_problem,
    validate_device_name,
    validate_qualified_name,
)
from agent.dra.quantity import format_quantity, parse_quantity

TaintEffect = Literal["NoSchedule", "NoExecute", "None"]
TAINT_EFFECTS: frozenset[str] = frozenset({"NoSchedule", "NoExecute", "None"})

#: A capacity value: an integer (rendered by :func:`format_quantity`) or a quantity string.
Capacity = int | str


@dataclass(frozen=True, slots=True)
class DeviceAttribute:
    """One attribute value; exactly one of the four fields is set.

    Build it with :meth:`of_int`, :meth:`of_bool`, :meth:`of_string` or :meth:`of_version`.
    """

    int_value: int | None = None
    bool_value: bool | None = None
    string_value: str | None = None
    version_value: str | None = None

    def __post_init__(self) -> None:
        values = (self.int_value, self.bool_value, self.string_value, self.version_value)
        if sum(value is not None for value in values) != 1:
            raise InvalidValueError(f"a device attribute needs exactly one value, got {self!r}")
        if self.int_value is not None and (
            isinstance(self.int_value, bool) or not isinstance(self.int_value, int)
        ):
            raise InvalidValueError(f"int attribute value {self.int_value!r} is not an int")
        if self.int_value is not None and not -(2**63) <= self.int_value < 2**63:
            raise InvalidValueError(f"int attribute value {self.int_value} does not fit int64")
        if self.bool_value is not None and not isinstance(self.bool_value, bool):
            raise InvalidValueError(f"bool attribute value {self.bool_value!r} is not a bool")
        text = self.string_value if self.string_value is not None else self.version_value
        if text is not None:
            if not isinstance(text, str):
                raise InvalidValueError(f"attribute value {text!r} is not a str")
            if len(text) > limits.MAX_ATTRIBUTE_VALUE_LENGTH:
                raise InvalidValueError(
                    f"attribute value {text!r} has {len(text)} characters; the API allows "
                    f"{limits.MAX_ATTRIBUTE_VALUE_LENGTH}"
                )
        if self.version_value is not None and not is_semver(self.version_value):
            raise InvalidValueError(f"version attribute {self.version_value!r} is not SemVer 2.0.0")

    @classmethod
    def of_int(cls, value: int) -> DeviceAttribute:
        return cls(int_value=value)

    @classmethod
    def of_bool(cls, value: bool) -> DeviceAttribute:
        return cls(bool_value=value)

    @classmethod
    def of_string(cls, value: str) -> DeviceAttribute:
        return cls(string_value=value)

    @classmethod
    def of_version(cls, value: str) -> DeviceAttribute:
        return cls(version_value=value)

    @property
    def value(self) -> int | bool | str:
        """The one value that is set."""
        for value in (self.int_value, self.bool_value, self.string_value, self.version_value):
            if value is not None:
                return value
        raise AssertionError("unreachable: validated in __post_init__")

    def to_dict(self) -> dict[str, int | bool | str]:
        if self.int_value is not None:
            return {"int": self.int_value}
        if self.bool_value is not None:
            return {"bool": self.bool_value}
        if self.string_value is not None:
            return {"string": self.string_value}
        return {"version": self.value}


@dataclass(frozen=True, slots=True)
class DeviceTaint:
    """A taint on a device (``DRADeviceTaints``); the health code decides which to set.

    ``time_added`` is optional: the API server fills it in when empty and stores it at
    second precision, which is why :meth:`to_dict` drops sub-second digits.
    """

    key: str
    value: str = ""
    effect: TaintEffect = "NoSchedule"
    time_added: datetime | None = None

    def __post_init__(self) -> None:
        problem = label_key_problem(self.key)
        if problem is not None:
            raise InvalidNameError(f"taint key {self.key!r}: {problem}")
        if not is_label_value(self.value):
            raise InvalidValueError(
                f"taint {self.key!r}: value {self.value!r} is not a label value "
                "(at most 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric)"
            )
        if self.effect not in TAINT_EFFECTS:
            raise InvalidValueError(
                f"taint {self.key!r}: effect {self.effect!r} is not one of "
                f"{', '.join(sorted(TAINT_EFFECTS))} ('None' needs Kubernetes 1.35+)"
            )
        if self.time_added is not None and self.time_added.tzinfo is None:
            raise InvalidValueError(f"taint {self.key!r}: time_added must be timezone-aware")

    def to_dict(self) -> dict[str, str]:
        out = {"key": self.key}
        if self.value:
            out["value"] = self.value
        out["effect"] = self.effect
        if self.time_added is not None:
            out["timeAdded"] = format_time(self.time_added)
        return out


def format_time(moment: datetime) -> str:
    """RFC 3339 in UTC at second precision, as ``metav1.Time`` serializes."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class DraDevice:
    """One device of a ResourceSlice, valid by construction.

    Attribute and capacity names without a domain belong to the driver's domain
    (``gpu.nvidia.com``), as with the incumbent.
    """

    name: str
    attributes: Mapping[str, DeviceAttribute] = field(default_factory=dict)
    capacity: Mapping[str, Capacity] = field(default_factory=dict)
    taints: tuple[DeviceTaint, ...] = ()
    #: KEP-4815: the shared counters an allocation of this device uses up.
    consumes_counters: tuple[CounterConsumption, ...] = ()
    #: KEP-5075: several claims may hold the device at once, each consuming capacity.
    allow_multiple_allocations: bool = False
    #: KEP-5075: capacity name -> what one allocation may take of it (needs the above).
    request_policies: Mapping[str, RequestPolicy] = field(default_factory=dict)
    #: KEP-5007: condition types the scheduler waits for (all True) before it binds a pod
    #: that got this device, and those that make it give the allocation up (any True).
    binding_conditions: tuple[str, ...] = ()
    binding_failure_conditions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Read-only copies: a device validated once must not change behind our back.
        object.__setattr__(self, "attributes", MappingProxyType(dict(self.attributes)))
        object.__setattr__(self, "capacity", MappingProxyType(dict(self.capacity)))
        object.__setattr__(self, "taints", tuple(self.taints))
        object.__setattr__(self, "consumes_counters", tuple(self.consumes_counters))
        object.__setattr__(self, "request_policies", MappingProxyType(dict(self.request_policies)))
        object.__setattr__(self, "binding_conditions", tuple(self.binding_conditions))
        object.__setattr__(
            self, "binding_failure_conditions", tuple(self.binding_failure_conditions)
        )
        validate_device_name(self.name)
        _check_binding_conditions(self)
        _check_policies(self)
        for name in (*self.attributes, *self.capacity):
            validate_qualified_name(name, device=self.name)
        clash = set(self.attributes) & set(self.capacity)
        if clash:
            raise InvalidNameError(
                f"device {self.name!r}: {sorted(clash)} is both an attribute and a capacity"
            )
        total = len(self.attributes) + len(self.capacity)
        if total > limits.MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE:
            raise LimitExceededError(
                f"device {self.name!r} has {len(self.attributes)} attributes and "
                f"{len(self.capacity)} capacities ({total}); the API allows "
                f"{limits.MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE} in total"
            )
        if len(self.taints) > limits.MAX_TAINTS_PER_DEVICE:
            raise LimitExceededError(
                f"device {self.name!r} has {len(self.taints)} taints; the API allows "
                f"{limits.MAX_TAINTS_PER_DEVICE}"
            )
        for name, value in self.capacity.items():
            _quantity_text(self.name, name, value)
        consumed = self.consumes_counters
        if len(consumed) > limits.MAX_COUNTER_CONSUMPTIONS_PER_DEVICE:
            raise LimitExceededError(
                f"device {self.name!r} consumes from {len(consumed)} counter sets; the API "
                f"allows {limits.MAX_COUNTER_CONSUMPTIONS_PER_DEVICE}"
            )
        if len({entry.counter_set for entry in consumed}) != len(consumed):
            raise InvalidNameError(f"device {self.name!r} names a counter set twice")
        if self.consumed_counter_count > limits.MAX_COUNTERS_PER_DEVICE:
            raise LimitExceededError(
                f"device {self.name!r} consumes {self.consumed_counter_count} counters; the "
                f"API allows {limits.MAX_COUNTERS_PER_DEVICE}"
            )

    @property
    def consumed_counter_count(self) -> int:
        """How many counters the device consumes, over all its counter sets."""
        return sum(len(entry.counters) for entry in self.consumes_counters)

    @property
    def uses_advanced_features(self) -> bool:
        """Whether the device counts toward the 64-devices-per-slice limit (1.35+)."""
        return bool(self.taints) or bool(self.consumes_counters)

    def with_taints(self, taints: tuple[DeviceTaint, ...]) -> DraDevice:
        """The same device with ``taints`` instead of its current taints."""
        return replace(self, taints=taints)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.attributes:
            out["attributes"] = {
                name: self.attributes[name].to_dict() for name in sorted(self.attributes)
            }
        if self.capacity:
            out["capacity"] = {name: self._capacity_dict(name) for name in sorted(self.capacity)}
        if self.allow_multiple_allocations:
            out["allowMultipleAllocations"] = True
        if self.consumes_counters:
            out["consumesCounters"] = [entry.to_dict() for entry in self.consumes_counters]
        if self.taints:
            out["taints"] = [taint.to_dict() for taint in self.taints]
        if self.binding_conditions:
            out["bindingConditions"] = list(self.binding_conditions)
            out["bindingFailureConditions"] = list(self.binding_failure_conditions)
        return out

    def _capacity_dict(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {"value": _quantity_text(self.name, name, self.capacity[name])}
        policy = self.request_policies.get(name)
        if policy is not None:
            out["requestPolicy"] = policy.to_dict()
        return out


def _check_binding_conditions(device: DraDevice) -> None:
    """At most 4 of each, condition types (qualified names), and failure conditions only
    with binding conditions (the API server's rules)."""
    for kind, names in (
        ("binding", device.binding_conditions),
        ("binding failure", device.binding_failure_conditions),
    ):
        if len(names) > limits.MAX_BINDING_CONDITIONS:
            raise LimitExceededError(
                f"device {device.name!r} has {len(names)} {kind} conditions; the API allows "
                f"{limits.MAX_BINDING_CONDITIONS}"
            )
        for name in names:
            validate_qualified_name(name, device=device.name)
    if device.binding_failure_conditions and not device.binding_conditions:
        raise InvalidValueError(
            f"device {device.name!r}: binding failure conditions need binding conditions"
        )


def _check_policies(device: DraDevice) -> None:
    """A request policy needs ``allowMultipleAllocations`` and a capacity of its name, and
    must suit that capacity's value (:meth:`RequestPolicy.check_capacity`)."""
    if device.request_policies and not device.allow_multiple_allocations:
        raise InvalidValueError(
            f"device {device.name!r}: a capacity request policy needs allowMultipleAllocations"
        )
    unknown = sorted(set(device.request_policies) - set(device.capacity))
    if unknown:
        raise InvalidNameError(f"device {device.name!r}: request policy for no capacity {unknown}")
    for name, policy in device.request_policies.items():
        raw = device.capacity[name]
        value = (
            raw if isinstance(raw, int) else parse_quantity(_quantity_text(device.name, name, raw))
        )
        policy.check_capacity(value, f"device {device.name!r}: capacity {name!r}")
    if not isinstance(device.allow_multiple_allocations, bool):
        raise InvalidValueError(f"device {device.name!r}: allowMultipleAllocations is a bool")


def _counters(owner: str, counters: Mapping[str, Capacity]) -> MappingProxyType[str, Capacity]:
    """Validated, read-only counters: DNS-label names, non-negative quantities, at most 32."""
    if len(counters) > limits.MAX_COUNTERS_PER_SET:
        raise LimitExceededError(
            f"{owner} has {len(counters)} counters; the API allows {limits.MAX_COUNTERS_PER_SET}"
        )
    for name, value in counters.items():
        if not isinstance(name, str) or not is_dns_label(name):
            raise InvalidNameError(f"{owner}: counter name {name!r} is not a DNS label")
        if parse_quantity(_quantity_text(owner, name, value)) < 0:
            raise InvalidValueError(f"{owner}: counter {name!r} is negative ({value!r})")
    return MappingProxyType(dict(counters))


def _counters_dict(owner: str, counters: Mapping[str, Capacity]) -> dict[str, dict[str, str]]:
    return {name: {"value": _quantity_text(owner, name, counters[name])} for name in counters}


@dataclass(frozen=True, slots=True)
class CounterSet:
    """A KEP-4815 ``CounterSet``: named amounts that devices of the pool share.

    Counters are kept in the order given (the wire form is a map; the order only makes
    ``discover`` and the docs read naturally)."""

    name: str
    counters: Mapping[str, Capacity] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not is_dns_label(self.name):
            raise InvalidNameError(f"counter set name {self.name!r} is not a DNS label")
        object.__setattr__(self, "counters", _counters(f"counter set {self.name!r}", self.counters))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "counters": _counters_dict(f"counter set {self.name!r}", self.counters),
        }


@dataclass(frozen=True, slots=True)
class CounterConsumption:
    """A KEP-4815 ``DeviceCounterConsumption``: what a device uses up of one counter set."""

    counter_set: str
    counters: Mapping[str, Capacity] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.counter_set, str) or not is_dns_label(self.counter_set):
            raise InvalidNameError(f"counter set name {self.counter_set!r} is not a DNS label")
        object.__setattr__(
            self, "counters", _counters(f"consumption of {self.counter_set!r}", self.counters)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "counterSet": self.counter_set,
            "counters": _counters_dict(f"consumption of {self.counter_set!r}", self.counters),
        }


def _quantity_text(device: str, name: str, value: Capacity) -> str:
    if isinstance(value, str):
        try:
            parse_quantity(value)
        except InvalidValueError as error:
            raise InvalidValueError(f"device {device!r}: capacity {name!r}: {error}") from None
        return value
    try:
        return format_quantity(value)
    except InvalidValueError as error:
        raise InvalidValueError(f"device {device!r}: capacity {name!r}: {error}") from None
