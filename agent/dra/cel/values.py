"""Kubernetes' CEL ``quantity`` and ``semver`` types as values the CEL library can carry.

``common-expression-language`` passes only plain values (numbers, strings, lists, maps)
between CEL and Python, so a Kubernetes quantity or semantic version travels as a one-key
map tagged with its type. The tag holds a canonical spelling, so CEL's own ``==`` compares
them by value as the Kubernetes types do (``quantity('1Gi') == quantity('1024Mi')``,
``semver('1.0.0+a') == semver('1.0.0')``). A function that fails returns an error marker
instead of raising: the CEL library would print a traceback for a raised exception, and the
evaluator (:mod:`agent.dra.cel.selector`) turns the marker into an error with a position.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from agent.dra.errors import InvalidValueError
from agent.dra.quantity import parse_quantity

QUANTITY = "__k8s_quantity__"
SEMVER = "__k8s_semver__"
ERROR = "__cel_error__"

_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
)
_LOOSE_SEMVER = re.compile(r"v?(\d+)(?:\.(\d+))?(?:\.(\d+))?((?:[-+].*)?)")


class CelFunctionError(Exception):
    """A Kubernetes library function refused its arguments (no such overload, bad text)."""


def quantity_of(text: str) -> dict[str, str]:
    """The CEL value of quantity string ``text``; raises :class:`CelFunctionError`."""
    try:
        value = parse_quantity(text)
    except InvalidValueError as err:
        raise CelFunctionError(f"quantity: {text!r} is not a Kubernetes quantity") from err
    return quantity_from_fraction(value)


def quantity_from_fraction(value: Fraction) -> dict[str, str]:
    return {QUANTITY: str(value)}


def semver_of(text: str, normalize: bool = False) -> dict[str, str]:
    """The CEL value of version ``text`` (semver 2.0.0; ``normalize`` accepts ``v1.2``)."""
    if normalize:
        loose = _LOOSE_SEMVER.fullmatch(text)
        if loose is not None:
            major, minor, patch, rest = loose.groups()
            text = f"{int(major)}.{int(minor or 0)}.{int(patch or 0)}{rest}"
    match = _SEMVER.fullmatch(text)
    if match is None:
        raise CelFunctionError(f"semver: {text!r} is not a semantic version (like '9.0.0')")
    return {SEMVER: text.split("+", 1)[0]}  # build metadata does not take part in comparisons


def kind_of(value: Any) -> str:
    """``quantity``, ``semver``, ``error`` or the CEL type name of a plain value."""
    if isinstance(value, dict) and len(value) == 1:
        (key,) = value
        if key == QUANTITY:
            return "quantity"
        if key == SEMVER:
            return "semver"
        if key == ERROR:
            return "error"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "double"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "map"
    return "null" if value is None else type(value).__name__


def quantity_value(value: Any, function: str) -> Fraction:
    if kind_of(value) != "quantity":
        raise CelFunctionError(
            f"no such overload: {function} on {kind_of(value)}, expected quantity"
        )
    return Fraction(value[QUANTITY])


def semver_key(value: Any, function: str) -> tuple[Any, ...]:
    """Semver precedence (semver.org §11): a pre-release sorts before its release; numeric
    identifiers compare as numbers and before alphanumeric ones."""
    if kind_of(value) != "semver":
        raise CelFunctionError(f"no such overload: {function} on {kind_of(value)}, expected semver")
    match = _SEMVER.fullmatch(value[SEMVER])
    assert match is not None
    major, minor, patch, pre, _ = match.groups()
    pre_key: tuple[Any, ...] = (1,)
    if pre:
        parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split("."))
        pre_key = (0, parts)
    return (int(major), int(minor), int(patch), pre_key)


def compare(left: Any, right: Any, function: str) -> int:
    """-1, 0 or 1 for two quantities or two semvers; anything else has no overload."""
    kinds = (kind_of(left), kind_of(right))
    if kinds == ("quantity", "quantity"):
        a: Any = quantity_value(left, function)
        b: Any = quantity_value(right, function)
    elif kinds == ("semver", "semver"):
        a, b = semver_key(left, function), semver_key(right, function)
    else:
        raise CelFunctionError(f"no such overload: {kinds[0]}.{function}({kinds[1]})")
    return int((a > b) - (a < b))


def display(value: Any) -> Any:
    """A CEL value as a person reads it: quantities and versions as text."""
    kind = kind_of(value)
    if kind == "quantity":
        return f"quantity({value[QUANTITY]})"
    if kind == "semver":
        return f"semver({value[SEMVER]})"
    return value
