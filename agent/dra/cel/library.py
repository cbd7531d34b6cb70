"""The Kubernetes CEL libraries a DRA selector may call, written after their definitions.

The Kubernetes DRA environment adds to standard CEL: the ``quantity`` and ``semver``
libraries, the extended string functions (``charAt``, ``indexOf``, ``lowerAscii``,
``replace``, ``split``, ``substring``, ``trim``, ``join``, ...), the list library
(``isSorted``, ``sum``, ``min``, ``max``, ``indexOf``, ``lastIndexOf``) and the regex
library (``find``, ``findAll``). ``common-expression-language`` has none of them, so they
are Python functions here; a member call such as ``x.compareTo(y)`` reaches the function
with ``x`` first. Every function is wrapped so that a failure is recorded (function name and
message) and an error marker flows on instead of an exception (see :mod:`.values`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from functools import reduce
from typing import Any

from agent.dra.cel.values import (
    ERROR,
    CelFunctionError,
    compare,
    kind_of,
    quantity_from_fraction,
    quantity_of,
    quantity_value,
    semver_key,
    semver_of,
)

Function = Callable[..., Any]
#: (function name, message) of the first failure of one evaluation
FailureSlot = list[tuple[str, str]]


def _expect(value: Any, kind: str, function: str) -> Any:
    if kind_of(value) != kind:
        raise CelFunctionError(f"no such overload: {function} on {kind_of(value)}, expected {kind}")
    return value


def _try(parse: Function, *args: Any) -> bool:
    try:
        parse(*args)
    except CelFunctionError:
        return False
    return True


def _as_integer(value: Any) -> int:
    number = quantity_value(value, "asInteger")
    if number.denominator != 1 or not -(2**63) <= number < 2**63:
        raise CelFunctionError(f"asInteger: {value} cannot be represented as an int64")
    return int(number)


def _add(left: Any, right: Any, sign: int, name: str) -> Any:
    a = quantity_value(left, name)
    if kind_of(right) == "int":
        return quantity_from_fraction(a + sign * right)
    return quantity_from_fraction(a + sign * quantity_value(right, name))


def _index_of(receiver: Any, item: Any, *start: int) -> int:
    if isinstance(receiver, str):
        return receiver.find(_expect(item, "string", "indexOf"), *start)
    values = _expect(receiver, "list", "indexOf")
    return next((i for i, v in enumerate(values) if v == item), -1)


def _last_index_of(receiver: Any, item: Any, *end: int) -> int:
    if isinstance(receiver, str):
        text = _expect(item, "string", "lastIndexOf")
        return receiver.rfind(text, 0, end[0] + len(text)) if end else receiver.rfind(text)
    values = _expect(receiver, "list", "lastIndexOf")
    return max((i for i, v in enumerate(values) if v == item), default=-1)


def _ordered(values: Any, function: str) -> list[Any]:
    items = _expect(values, "list", function)
    kinds = {kind_of(v) for v in items}
    if kinds <= {"int", "double", "string", "bool"} and len(kinds) <= 1:
        return list(items)
    if kinds in ({"quantity"}, {"semver"}):
        return list(items)  # compared through _key()
    raise CelFunctionError(f"no such overload: {function} on a list of {sorted(kinds)}")


def _key(value: Any) -> Any:
    kind = kind_of(value)
    if kind == "quantity":
        return quantity_value(value, "compare")
    if kind == "semver":
        return semver_key(value, "compare")
    return value


def _extreme(values: Any, function: str, pick: Function) -> Any:
    items = _ordered(values, function)
    if not items:
        raise CelFunctionError(f"{function}: the list is empty")
    return pick(items, key=_key)


def _sum(values: Any) -> Any:
    items = _expect(values, "list", "sum")
    if items and all(kind_of(v) == "quantity" for v in items):
        return quantity_from_fraction(sum((quantity_value(v, "sum") for v in items), Fraction(0)))
    if all(kind_of(v) in ("int", "double") for v in items):
        return reduce(lambda a, b: a + b, items, 0)
    raise CelFunctionError("no such overload: sum on a list that is not of numbers")


def _split(text: Any, separator: Any, *limit: int) -> list[str]:
    text = _expect(text, "string", "split")
    if limit and limit[0] == 0:
        return []
    if limit and limit[0] > 0:
        return str(text).split(separator, limit[0] - 1)
    return str(text).split(separator)


def _substring(text: Any, start: int, *end: int) -> str:
    text = _expect(text, "string", "substring")
    stop = end[0] if end else len(text)
    if not 0 <= start <= stop <= len(text):
        raise CelFunctionError(f"substring: index out of range [{start}, {stop}) of {len(text)}")
    return str(text)[start:stop]


def _char_at(text: Any, index: int) -> str:
    text = _expect(text, "string", "charAt")
    if not 0 <= index <= len(text):
        raise CelFunctionError(f"charAt: index {index} out of range of {len(text)}")
    return str(text)[index : index + 1]


def _replace(text: Any, old: str, new: str, *limit: int) -> str:
    count = limit[0] if limit else -1
    return str(_expect(text, "string", "replace")).replace(old, new, count)


def _find_all(text: Any, pattern: str, *limit: int) -> list[str]:
    found = [m.group(0) for m in re.finditer(pattern, _expect(text, "string", "findAll"))]
    return found[: limit[0]] if limit and limit[0] >= 0 else found


def _find(text: Any, pattern: str) -> str:
    match = re.search(pattern, _expect(text, "string", "find"))
    return match.group(0) if match else ""


_FUNCTIONS: dict[str, Function] = {
    # quantity (k8s.io/apiserver/pkg/cel/library/quantity.go)
    "quantity": lambda text: quantity_of(_expect(text, "string", "quantity")),
    "isQuantity": lambda text: _try(quantity_of, _expect(text, "string", "isQuantity")),
    "sign": lambda q: (quantity_value(q, "sign") > 0) - (quantity_value(q, "sign") < 0),
    "isInteger": lambda q: quantity_value(q, "isInteger").denominator == 1,
    "asInteger": _as_integer,
    "asApproximateFloat": lambda q: float(quantity_value(q, "asApproximateFloat")),
    "add": lambda a, b: _add(a, b, 1, "add"),
    "sub": lambda a, b: _add(a, b, -1, "sub"),
    # semver (k8s.io/apiserver/pkg/cel/library/semverlib.go)
    "semver": lambda text, *normalize: semver_of(_expect(text, "string", "semver"), *normalize),
    "isSemver": lambda text, *normalize: _try(
        semver_of, _expect(text, "string", "isSemver"), *normalize
    ),
    "major": lambda v: semver_key(v, "major")[0],
    "minor": lambda v: semver_key(v, "minor")[1],
    "patch": lambda v: semver_key(v, "patch")[2],
    # both
    "compareTo": lambda a, b: compare(a, b, "compareTo"),
    "isGreaterThan": lambda a, b: compare(a, b, "isGreaterThan") > 0,
    "isLessThan": lambda a, b: compare(a, b, "isLessThan") < 0,
    # extended strings (cel-go ext.Strings, as Kubernetes enables it)
    "charAt": _char_at,
    "indexOf": _index_of,
    "lastIndexOf": _last_index_of,
    "lowerAscii": lambda s: str(_expect(s, "string", "lowerAscii")).lower(),
    "upperAscii": lambda s: str(_expect(s, "string", "upperAscii")).upper(),
    "replace": _replace,
    "split": _split,
    "substring": _substring,
    "trim": lambda s: str(_expect(s, "string", "trim")).strip(),
    "join": lambda values, *sep: (sep[0] if sep else "").join(_expect(values, "list", "join")),
    "reverse": lambda s: str(_expect(s, "string", "reverse"))[::-1],
    # lists (k8s.io/apiserver/pkg/cel/library/lists.go)
    "isSorted": lambda values: all(
        _key(a) <= _key(b) for a, b in zip(_ordered(values, "isSorted"), values[1:], strict=False)
    ),
    "sum": _sum,
    "min": lambda values: _extreme(values, "min", min),
    "max": lambda values: _extreme(values, "max", max),
    # regex (k8s.io/apiserver/pkg/cel/library/regex.go)
    "find": _find,
    "findAll": _find_all,
}
#: Names of the functions above: what a selector may call besides standard CEL.
KUBERNETES_FUNCTIONS = frozenset(_FUNCTIONS)


def bind_functions(failures: FailureSlot) -> dict[str, Function]:
    """The library for one evaluation: failures go to ``failures``, never raise into CEL."""

    def wrap(name: str, function: Function) -> Function:
        def call(*args: Any) -> Any:
            if any(kind_of(a) == "error" for a in args):
                return {ERROR: name}
            try:
                return function(*args)
            except (CelFunctionError, TypeError, ValueError, IndexError, re.error) as err:
                failures.append((name, str(err)))
                return {ERROR: name}

        return call

    return {name: wrap(name, function) for name, function in _FUNCTIONS.items()}
