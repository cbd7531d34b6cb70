"""Evaluate DRA CEL selectors the way the Kubernetes scheduler does, for tests.

``common-expression-language`` evaluates standard CEL but has none of the Kubernetes
extension libraries, and only plain Python values cross into it. Here:

- a device becomes the ``device`` variable of the DRA CEL environment: ``driver``,
  ``attributes[domain][name]`` and ``capacity[domain][name]``, with unqualified names in the
  driver's domain (``type`` is ``attributes['gpu.nvidia.com'].type``);
- Kubernetes' ``quantity`` and ``semver`` types are tagged dicts, and their functions
  (``quantity()``, ``semver()``, ``compareTo``, ``isGreaterThan``, ``isLessThan``, ``major`` ...)
  are written here after the Kubernetes CEL library's definitions; a member call such as
  ``x.compareTo(y)`` reaches the Python function with ``x`` first;
- :func:`check_compiles` parses an expression and checks that it uses only the ``device``
  variable and functions the Kubernetes DRA environment has;
- :func:`feasible_groups` applies ``matchAttribute`` constraints: devices are grouped by the
  values of the constrained attributes, and a device without one of them fits no group.

An expression that fails at run time (a missing attribute, a wrong type) raises, as it makes
allocation fail in Kubernetes rather than quietly skip the device.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import cel

from agent.dra.quantity import parse_quantity

QUANTITY = "__k8s_quantity__"
SEMVER = "__k8s_semver__"
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?"
    r"(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?"
)

Obj = dict[str, Any]


# -- the Kubernetes quantity and semver libraries --------------------------------------------


def quantity(text: str) -> Obj:
    parse_quantity(text)  # raises on a malformed quantity, like the Kubernetes function
    return {QUANTITY: text}


def semver(text: str) -> Obj:
    if _SEMVER.fullmatch(text) is None:
        raise ValueError(f"semver: {text!r} is not a semantic version")
    return {SEMVER: text}


def _kind(value: Any) -> str:
    if isinstance(value, dict) and len(value) == 1:
        (key,) = value
        if key in (QUANTITY, SEMVER):
            return str(key)
    raise TypeError(f"no such overload: expected a quantity or a semver, got {value!r}")


def _quantity_value(value: Any) -> Fraction:
    if _kind(value) != QUANTITY:
        raise TypeError(f"no such overload: {value!r} is not a quantity")
    return parse_quantity(value[QUANTITY])


def _semver_key(value: Any) -> tuple[Any, ...]:
    if _kind(value) != SEMVER:
        raise TypeError(f"no such overload: {value!r} is not a semver")
    match = _SEMVER.fullmatch(value[SEMVER])
    assert match is not None
    major, minor, patch, pre = match.groups()
    # semver.org §11: a pre-release sorts before its release; numeric identifiers compare as
    # numbers and sort before alphanumeric ones
    pre_key: tuple[Any, ...] = (1,)
    if pre:
        pre_key = (
            0,
            tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split(".")),
        )
    return (int(major), int(minor), int(patch), pre_key)


def compare_to(left: Any, right: Any) -> int:
    kind = _kind(left)
    if kind != _kind(right):
        raise TypeError(f"no such overload: compareTo({left!r}, {right!r})")
    a: Any
    b: Any
    if kind == QUANTITY:
        a, b = _quantity_value(left), _quantity_value(right)
    else:
        a, b = _semver_key(left), _semver_key(right)
    return (a > b) - (a < b)


def _semver_part(index: int) -> Any:
    return lambda value: _semver_key(value)[index]


def _as_integer(value: Any) -> int:
    number = _quantity_value(value)
    if number.denominator != 1 or not -(2**63) <= number < 2**63:
        raise ValueError(f"asInteger: {value[QUANTITY]} is not an int64")
    return int(number)


FUNCTIONS: dict[str, Any] = {
    "quantity": quantity,
    "isQuantity": lambda text: _try(quantity, text),
    "semver": semver,
    "isSemver": lambda text: _try(semver, text),
    "compareTo": compare_to,
    "isGreaterThan": lambda a, b: compare_to(a, b) > 0,
    "isLessThan": lambda a, b: compare_to(a, b) < 0,
    "major": _semver_part(0),
    "minor": _semver_part(1),
    "patch": _semver_part(2),
    "asInteger": _as_integer,
    "isInteger": lambda value: _quantity_value(value).denominator == 1,
    "asApproximateFloat": lambda value: float(_quantity_value(value)),
    "sign": lambda value: (_quantity_value(value) > 0) - (_quantity_value(value) < 0),
}
#: Standard CEL operators and functions a selector may use, plus the libraries above.
STANDARD = frozenset(
    {"_&&_", "_||_", "!_", "_==_", "_!=_", "_<_", "_<=_", "_>_", "_>=_", "_?_:_", "_[_]"}
    | {"@in", "size", "has", "startsWith", "endsWith", "contains", "matches", "lowerAscii"}
    | {"upperAscii", "int", "string", "exists", "all", "exists_one", "map", "filter"}
)


def _try(function: Any, text: str) -> bool:
    try:
        function(text)
    except ValueError:
        return False
    return True


# -- devices as the DRA CEL environment sees them --------------------------------------------


def _attribute_value(value: Mapping[str, Any]) -> Any:
    ((kind, raw),) = value.items()
    if kind == "version":
        return semver(str(raw))
    if kind in ("int", "bool", "string"):
        return raw
    raise ValueError(f"unknown attribute type {kind!r}")


def _split(name: str, driver: str) -> tuple[str, str]:
    domain, _, short = name.rpartition("/")
    return (domain or driver), short


def device_variable(device: Mapping[str, Any], driver: str) -> Obj:
    """The ``device`` CEL variable for one device of a ResourceSlice of ``driver``."""
    attributes: dict[str, Obj] = defaultdict(dict)
    for name, value in (device.get("attributes") or {}).items():
        domain, short = _split(name, driver)
        attributes[domain][short] = _attribute_value(value)
    capacity: dict[str, Obj] = defaultdict(dict)
    for name, value in (device.get("capacity") or {}).items():
        domain, short = _split(name, driver)
        capacity[domain][short] = quantity(str(value["value"]))
    return {
        "driver": driver,
        "attributes": dict(attributes),
        "capacity": dict(capacity),
        "allowMultipleAllocations": bool(device.get("allowMultipleAllocations", False)),
    }


def slice_devices(slices: Iterable[Mapping[str, Any]]) -> list[tuple[str, Obj]]:
    """(device name, ``device`` variable) of every device in ``slices``."""
    return [
        (str(device["name"]), device_variable(device, str(item["spec"]["driver"])))
        for item in slices
        for device in item["spec"].get("devices", [])
    ]


def check_compiles(expression: str) -> None:
    """Parse ``expression``; raise if it uses a variable other than ``device`` or a function
    the DRA environment does not have."""
    program = cel.compile(expression)
    references = program.references()
    variables = set(references["variables"])
    if variables != {"device"}:
        raise AssertionError(f"{expression!r}: variables {sorted(variables)}, expected device")
    unknown = set(references["functions"]) - STANDARD - set(FUNCTIONS)
    if unknown:
        raise AssertionError(f"{expression!r}: unknown functions {sorted(unknown)}")


def selects(expression: str, device: Obj) -> bool:
    """Evaluate a selector on one ``device`` variable; it must return a bool."""
    context = cel.Context(variables={"device": device}, functions=FUNCTIONS)
    result = cel.evaluate(expression, context)
    if not isinstance(result, bool):
        raise TypeError(f"{expression!r} returned {result!r}, not a bool")
    return result


def select(expressions: Sequence[str], devices: Sequence[tuple[str, Obj]]) -> list[str]:
    """Names of the devices every expression selects (the AND of a request's selectors)."""
    return [name for name, device in devices if all(selects(e, device) for e in expressions)]


def _attribute(device: Obj, qualified: str) -> Any:
    domain, _, short = qualified.rpartition("/")
    return device["attributes"].get(domain, {}).get(short)


def feasible_groups(
    names: Sequence[str],
    devices: Sequence[tuple[str, Obj]],
    match_attributes: Sequence[str],
    count: int,
) -> list[list[str]]:
    """The groups of ``names`` that share every ``match_attributes`` value and hold at least
    ``count`` devices: the sets one ``matchAttribute``-constrained request can come from."""
    by_name = dict(devices)
    groups: dict[tuple[Any, ...], list[str]] = defaultdict(list)
    for name in names:
        values = tuple(repr(_attribute(by_name[name], a)) for a in match_attributes)
        if any(_attribute(by_name[name], a) is None for a in match_attributes):
            continue  # a device without the attribute cannot satisfy the constraint
        groups[values].append(name)
    return sorted(group for group in groups.values() if len(group) >= count)
