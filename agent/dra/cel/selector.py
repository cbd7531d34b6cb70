"""Compile and evaluate DRA CEL selectors as the Kubernetes scheduler does.

A selector sees one variable, ``device``: ``driver``, ``attributes[domain][name]`` and
``capacity[domain][name]`` (a name without a domain in the ResourceSlice belongs to the
driver's domain), ``allowMultipleAllocations``; version attributes are semvers and
capacities quantities. Standard CEL comes from ``common-expression-language``; the
Kubernetes libraries from :mod:`.library`. Compilation checks what the API server checks
(length, variables, functions, estimated cost); evaluation fails, as in Kubernetes, on a
missing key or a wrong type instead of quietly not selecting the device, and every error
carries a position and a hint (:class:`.CelError`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import cel

from agent.dra.cel.errors import CelError
from agent.dra.cel.library import KUBERNETES_FUNCTIONS, FailureSlot, bind_functions
from agent.dra.cel.source import (
    MAX_COST,
    MAX_EXPRESSION_LENGTH,
    Token,
    call_offset,
    comprehension_variables,
    device_references,
    estimate_cost,
    key_offset,
    tokenize,
)
from agent.dra.cel.values import ERROR, kind_of, quantity_of, semver_of

Obj = dict[str, Any]
STANDARD_FUNCTIONS = frozenset(
    {"_&&_", "_||_", "!_", "-_", "_==_", "_!=_", "_<_", "_<=_", "_>_", "_>=_", "_?_:_"}
    | {"_+_", "_-_", "_*_", "_/_", "_%_", "_[_]", "@in", "@not_strictly_false"}
    | {"size", "has", "startsWith", "endsWith", "contains", "matches", "type", "dyn"}
    | {"int", "uint", "double", "string", "bool", "bytes", "timestamp", "duration"}
)
TYPE_NAMES = frozenset({"int", "uint", "double", "string", "bool", "bytes", "list", "map"})
_SYNTAX = re.compile(r"<input>:(\d+):(\d+): (.*)")
_RELATIONAL = frozenset({"<", "<=", ">", ">="})
_DEVICE_HINT = (
    "a selector sees one variable, device: device.driver, "
    "device.attributes['<domain>'].<name>, device.capacity['<domain>'].<name>"
)


@dataclass(frozen=True)
class Selector:
    """One compiled ``cel.expression``; :meth:`matches` evaluates it on a device."""

    expression: str
    tokens: tuple[Token, ...] = field(repr=False)
    program: Any = field(repr=False, compare=False)
    cost: int = 0

    @property
    def references(self) -> list[tuple[str, str, str]]:
        """The device fields it reads: ``(field, domain, name)``, see :func:`device_references`."""
        return device_references(list(self.tokens))

    def matches(self, device: Obj) -> bool:
        """Evaluate on a ``device`` variable (:func:`device_variable`); raises :class:`CelError`."""
        failures: FailureSlot = []
        variable = _with_referenced_domains(device, self.references)
        context = cel.Context(variables={"device": variable}, functions=bind_functions(failures))
        try:
            result = self.program.execute(context)
        except KeyError as err:
            if failures:
                raise self._failure(failures[0]) from None
            raise self._missing_key(str(err.args[0]) if err.args else "") from None
        except (TypeError, ValueError, RuntimeError, ZeroDivisionError) as err:
            if failures:
                raise self._failure(failures[0]) from None
            raise self._runtime(err) from None
        if failures:
            raise self._failure(failures[0])
        if not isinstance(result, bool):
            raise CelError(
                "type",
                f"the expression gives {kind_of(result)}, a selector must give bool",
                self.expression,
                0,
                "compare the value with something, e.g. ... == 'gpu' or ....compareTo(...) >= 0",
            )
        return result

    # -- errors --------------------------------------------------------------------------------

    def _failure(self, failure: tuple[str, str]) -> CelError:
        name, message = failure
        offset = call_offset(list(self.tokens), name)
        if "no such overload" in message:
            return CelError("type", message, self.expression, offset, _overload_hint(message))
        hint = ""
        if name in ("quantity", "isQuantity"):
            hint = "write quantities like '80Gi', '81920Mi', '1.5G' or '14'"
        elif name in ("semver", "isSemver"):
            hint = "versions are semantic versions like '9.0.0'; semver('v9.0', true) normalizes"
        text = message if message.startswith(f"{name}:") else f"{name}: {message}"
        return CelError("runtime", text, self.expression, offset, hint)

    def _missing_key(self, key: str) -> CelError:
        tokens = list(self.tokens)
        attribute = next((r for r in self.references if r[2] == key), None)
        if attribute is not None:
            field_name, domain, _ = attribute
            hint = (
                f"this device has no {field_name[:-1] if field_name == 'attributes' else field_name}"
                f" {domain}/{key}; check the name (gpu-dra-agent discover -o yaml lists them) "
                f"or guard it: has(device.{field_name}['{domain}'].{key}) && ..."
            )
        else:
            hint = f"guard optional fields with has(...); {_DEVICE_HINT}"
        return CelError(
            "runtime", f"no such key: {key}", self.expression, key_offset(tokens, key), hint
        )

    def _runtime(self, err: Exception) -> CelError:
        tokens = list(self.tokens)
        text = str(err)
        if isinstance(err, TypeError) or "No such overload" in text:
            offset = next((t.offset for t in tokens if t.text in _RELATIONAL), None)
            return CelError(
                "type",
                "no such overload: an operator got operands of different types",
                self.expression,
                offset,
                "quantities and versions compare with compareTo(), isGreaterThan() and "
                "isLessThan(), not < or >; ints with ints (CEL does not convert types)",
            )
        named = re.search(r"Function '(\w+)'", text)
        offset = call_offset(tokens, named.group(1)) if named else None
        if isinstance(err, ZeroDivisionError):
            offset = next((t.offset for t in tokens if t.text in ("/", "%")), None)
        return CelError("runtime", text.split(". Check")[0], self.expression, offset)


def _overload_hint(message: str) -> str:
    if "int" in message and "quantity" in message:
        return (
            "an int attribute cannot be compared with a quantity: compare it with an int "
            "(e.g. device.attributes['gpu.nvidia.com'].nvlinkPeerCount >= 4), or use a "
            "capacity, which is a quantity (device.capacity['gpu.nvidia.com'].memory)"
        )
    if "string" in message and ("semver" in message or "quantity" in message):
        return "this value is a string attribute: compare strings with ==, startsWith(), matches()"
    return "compareTo() and friends take two quantities or two versions of the same kind"


def compile_selector(expression: str) -> Selector:
    """Check ``expression`` the way the API server does; raises :class:`CelError`."""
    if len(expression.encode()) > MAX_EXPRESSION_LENGTH:
        raise CelError(
            "cost",
            f"the expression is longer than {MAX_EXPRESSION_LENGTH} bytes",
            expression,
            MAX_EXPRESSION_LENGTH,
            "split it, or move shared conditions into the DeviceClass",
        )
    try:
        program = cel.compile(expression)
    except ValueError as err:
        raise _syntax_error(expression, str(err)) from None
    tokens = tokenize(expression)
    references = program.references()
    allowed = {"device"} | comprehension_variables(tokens) | TYPE_NAMES
    unknown_variables = sorted(set(references["variables"]) - allowed)
    if unknown_variables:
        name = unknown_variables[0]
        offset = next((t.offset for t in tokens if t.text == name), None)
        raise CelError(
            "unsupported", f"undeclared reference to {name!r}", expression, offset, _DEVICE_HINT
        )
    known = STANDARD_FUNCTIONS | KUBERNETES_FUNCTIONS
    unknown_functions = sorted(set(references["functions"]) - known)
    if unknown_functions:
        name = unknown_functions[0]
        raise CelError(
            "unsupported",
            f"function {name}() is not in the Kubernetes DRA CEL environment",
            expression,
            call_offset(tokens, name),
            "see docs/ARCHITECTURE.md (the allocator) for the functions the environment has",
        )
    cost = estimate_cost(tokens)
    if cost > MAX_COST:
        raise CelError(
            "cost",
            f"estimated cost {cost} exceeds the limit {MAX_COST} of the API server",
            expression,
            0,
            "nested comprehensions (all, exists, map, filter) multiply the cost; flatten them",
        )
    return Selector(expression, tuple(tokens), program, cost)


def _syntax_error(expression: str, text: str) -> CelError:
    match = _SYNTAX.search(text)
    if match is None:
        return CelError("syntax", text, expression, 0, "check the expression's syntax")
    line, column = int(match.group(1)), int(match.group(2))
    lines = expression.split("\n")
    offset = sum(len(x) + 1 for x in lines[: line - 1]) + column - 1
    message = match.group(3).split("\n")[0]
    if "unsupported syntax" in message:
        hint = "optional field selection (.? and [?]) is not supported by this evaluator"
    else:
        hint = "check the parentheses, quotes and operators just before this point"
    return CelError("syntax", message, expression, min(offset, len(expression)), hint)


# -- devices as the environment sees them -------------------------------------------------------


def _attribute_value(value: Mapping[str, Any]) -> Any:
    ((kind, raw),) = value.items()
    if kind == "version":
        return semver_of(str(raw))
    if kind in ("int", "bool", "string"):
        return raw
    if kind in ("ints", "bools", "strings"):
        return list(raw)
    if kind == "versions":
        return [semver_of(str(v)) for v in raw]
    raise ValueError(f"unknown attribute type {kind!r}")


def split_name(name: str, driver: str) -> tuple[str, str]:
    """``(domain, name)`` of a qualified attribute or capacity name."""
    domain, _, short = name.rpartition("/")
    return (domain or driver), short


def device_variable(device: Mapping[str, Any], driver: str) -> Obj:
    """The ``device`` CEL variable of one ResourceSlice device of ``driver``."""
    attributes: dict[str, Obj] = {}
    for name, value in (device.get("attributes") or {}).items():
        domain, short = split_name(name, driver)
        attributes.setdefault(domain, {})[short] = _attribute_value(value)
    capacity: dict[str, Obj] = {}
    for name, value in (device.get("capacity") or {}).items():
        domain, short = split_name(name, driver)
        capacity.setdefault(domain, {})[short] = quantity_of(str(value["value"]))
    return {
        "driver": driver,
        "attributes": attributes,
        "capacity": capacity,
        "allowMultipleAllocations": bool(device.get("allowMultipleAllocations", False)),
    }


def _with_referenced_domains(device: Obj, references: Iterable[tuple[str, str, str]]) -> Obj:
    """Kubernetes answers an unknown domain with an empty map (so ``has()`` works on it)."""
    missing = [(f, d) for f, d, _ in references if f != "driver" and d not in device[f]]
    if not missing:
        return device
    copy = {
        **device,
        "attributes": dict(device["attributes"]),
        "capacity": dict(device["capacity"]),
    }
    for field_name, domain in missing:
        copy[field_name][domain] = {}
    return copy


def is_error_value(value: Any) -> bool:
    return kind_of(value) == "error" or (isinstance(value, dict) and ERROR in value)
