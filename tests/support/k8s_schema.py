"""Validate objects against the Kubernetes OpenAPI schemas bundled with kubernetes-validate.

The ``kubernetes-validate`` CLI stops at the first error (dependency-notes.md §6a), which
hides every other mistake in a generated manifest. Here the same strict schemas (unknown
fields rejected) are loaded from the installed package and checked with ``jsonschema``'s
``iter_errors`` over a ``referencing`` registry holding the package's ``_definitions.json``,
so every error is reported, with its path. Schema-only: values the schema leaves free (a
taint effect, a name's syntax) are the model's own checks, except for the ResourceSlice rules
the API server enforces beyond the schema and a test must not miss: a pool's counter and
device limits (:func:`pool_rule_errors`) and capacity request policies
(:func:`request_policy_errors`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from agent.dra.quantity import parse_quantity

SUPPORTED_VERSIONS = ("1.34", "1.35", "1.36", "1.37")


@dataclass(frozen=True)
class SchemaError:
    """One schema violation: where (dotted path, '' for the root) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.message}"


class SchemaValidationFailed(AssertionError):
    """An object does not match its Kubernetes schema; the message lists every error."""

    def __init__(self, kind: str, version: str, errors: list[SchemaError]) -> None:
        self.errors = errors
        lines = "\n  ".join(str(error) for error in errors)
        super().__init__(
            f"{kind} is invalid for Kubernetes {version} ({len(errors)} errors):\n  {lines}"
        )


def schema_root() -> Path:
    """The folder of bundled schemas inside the installed kubernetes_validate package."""
    return Path(str(files("kubernetes_validate"))) / "kubernetes-json-schema"


def _schema_dir(version: str) -> Path:
    match = re.fullmatch(r"v?(\d+)\.(\d+)(\.\d+)?", version)
    if match is None:
        raise ValueError(f"Kubernetes version {version!r} is not of the form 1.35 or 1.35.0")
    folder = schema_root() / f"v{match[1]}.{match[2]}.0-local-strict"
    if not folder.is_dir():
        raise ValueError(f"kubernetes-validate bundles no strict schemas for Kubernetes {version}")
    return folder


def _schema_file_name(api_version: str, kind: str) -> str:
    # "resource.k8s.io/v1" -> "resource-v1"; core "v1" stays "v1".
    group, _, ver = api_version.rpartition("/")
    suffix = f"{group.split('.')[0]}-{ver}" if group else ver
    return f"{kind.lower()}-{suffix}.json"


@lru_cache(maxsize=8)
def _registry(version: str) -> Registry[Any]:
    definitions = json.loads((_schema_dir(version) / "_definitions.json").read_text())
    return Registry().with_resource(definitions["$id"], Resource.from_contents(definitions))


@lru_cache(maxsize=64)
def _validator(version: str, api_version: str, kind: str) -> Draft202012Validator:
    path = _schema_dir(version) / _schema_file_name(api_version, kind)
    if not path.is_file():
        raise ValueError(f"no schema for {kind} {api_version} in Kubernetes {version}")
    schema = json.loads(path.read_text())
    registry = _registry(version).with_resource(schema["$id"], Resource.from_contents(schema))
    return Draft202012Validator(schema, registry=registry)


def schema_errors(obj: Mapping[str, Any], version: str) -> list[SchemaError]:
    """Every way ``obj`` breaks the strict schema of its apiVersion/kind in ``version``."""
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if not isinstance(api_version, str) or not isinstance(kind, str):
        return [SchemaError("", "apiVersion and kind must both be strings")]
    validator = _validator(version, api_version, kind)
    found = [
        SchemaError(".".join(str(part) for part in error.absolute_path), error.message)
        for error in validator.iter_errors(obj)
    ]
    return sorted(found, key=lambda error: (error.path, error.message))


def taint_effects(version: str) -> frozenset[str]:
    """The DeviceTaint effects the API server of ``version`` accepts.

    The schema types ``effect`` as a free string (the server validates it), but its description
    names the valid effects ("Valid effects are None, NoSchedule and NoExecute."); they are read
    from there, so they follow the bundled schemas rather than a list written here.
    """
    definitions = json.loads((_schema_dir(version) / "_definitions.json").read_text())["$defs"]
    [taint] = [d for name, d in definitions.items() if name.endswith("resource.v1.DeviceTaint")]
    text = str(taint["properties"]["effect"].get("description", ""))
    match = re.search(r"Valid effects are ([A-Za-z, ]+?)\.", text)
    if match is None:
        raise ValueError(f"Kubernetes {version}: no valid DeviceTaint effects in {text!r}")
    return frozenset(re.split(r",\s*|\s+and\s+", match[1].strip()))


def validate(obj: Mapping[str, Any], version: str) -> None:
    """Raise SchemaValidationFailed listing every error when ``obj`` is invalid."""
    errors = schema_errors(obj, version)
    if errors:
        raise SchemaValidationFailed(str(obj.get("kind")), version, errors)


def manifest_errors(text: str, version: str) -> list[SchemaError]:
    """Every schema error in a YAML or JSON manifest (one or many documents, or a List).

    For CLI tests: feed it what ``gpu-dra-agent`` prints. Paths are prefixed with the
    document index (``0:spec.devices.3``).
    """
    out: list[SchemaError] = []
    for index, obj in enumerate(_objects(yaml.safe_load_all(text))):
        out.extend(
            SchemaError(f"{index}:{error.path}", error.message)
            for error in schema_errors(obj, version)
        )
    return out


def _objects(documents: Iterable[Any]) -> Iterable[Mapping[str, Any]]:
    for document in documents:
        if document is None:
            continue
        if (
            isinstance(document, Mapping)
            and str(document.get("kind", "")).endswith("List")
            and "items" in document
        ):
            yield from document["items"]
        elif isinstance(document, list):
            yield from document
        else:
            yield document


def pool_rule_errors(slices: Iterable[Mapping[str, Any]], version: str) -> list[str]:
    """The ResourceSlice rules the API server of ``version`` checks beyond the schema, for the
    partitionable-device fields (kubelet-dra-protocol.md §4), over one pool's slices.

    1.34: a slice holds at most 32 shared counters in all its sets, a device consumes at most
    32 counters and a slice's devices at most 1024, and a device may only consume a counter
    set of its own slice. 1.35+: ``sharedCounters`` and ``devices`` never share a slice, at
    most 8 sets per slice and 32 counters per set, at most 2 consumption entries per device of
    32 counters each. Always: at most 128 devices per slice, 64 when any has taints or
    consumesCounters (from 1.35), set names unique in the pool, every consumed set and counter
    published in the pool, at most 32 attributes and capacities per device.
    """
    minor = int(re.fullmatch(r"v?1\.(\d+).*", version)[1])  # type: ignore[index]
    errors: list[str] = []
    sets: dict[str, set[str]] = {}
    items = list(slices)
    for obj in items:
        for counter_set in obj["spec"].get("sharedCounters") or []:
            if counter_set["name"] in sets:
                errors.append(f"counter set {counter_set['name']} is published twice")
            sets[counter_set["name"]] = set(counter_set.get("counters") or {})
    for index, obj in enumerate(items):
        spec = obj["spec"]
        where = f"slice {index}"
        shared = spec.get("sharedCounters") or []
        devices = spec.get("devices") or []
        advanced = any(d.get("taints") or d.get("consumesCounters") for d in devices)
        limit = 64 if advanced else 128
        if len(devices) > limit:
            errors.append(f"{where}: {len(devices)} devices, at most {limit}")
        total_shared = sum(len(s.get("counters") or {}) for s in shared)
        consumed = 0
        if minor <= 34:
            if total_shared > 32:
                errors.append(f"{where}: {total_shared} shared counters, at most 32")
        else:
            if shared and devices:
                errors.append(f"{where}: sharedCounters and devices in one slice")
            if len(shared) > 8:
                errors.append(f"{where}: {len(shared)} counter sets, at most 8")
            for s in shared:
                if len(s.get("counters") or {}) > 32:
                    errors.append(f"{where}: counter set {s['name']} has more than 32 counters")
        own = {s["name"] for s in shared}
        for device in devices:
            name = device["name"]
            if len(device.get("attributes") or {}) + len(device.get("capacity") or {}) > 32:
                errors.append(f"{where}: device {name} has over 32 attributes and capacities")
            entries = device.get("consumesCounters") or []
            count = sum(len(e.get("counters") or {}) for e in entries)
            consumed += count
            if minor >= 35 and len(entries) > 2:
                errors.append(f"{where}: device {name} has {len(entries)} consumesCounters")
            if count > 32 and (minor <= 34 or any(len(e["counters"]) > 32 for e in entries)):
                errors.append(f"{where}: device {name} consumes {count} counters")
            for entry in entries:
                set_name = entry["counterSet"]
                if minor <= 34 and set_name not in own:
                    errors.append(f"{where}: device {name} consumes {set_name} of another slice")
                missing = set(entry.get("counters") or {}) - sets.get(set_name, set())
                if set_name not in sets or missing:
                    errors.append(f"{where}: device {name} consumes unpublished {set_name}")
        if minor <= 34 and consumed > 1024:
            errors.append(f"{where}: devices consume {consumed} counters, at most 1024")
    return errors


def request_policy_errors(slices: Iterable[Mapping[str, Any]]) -> list[str]:
    """The KEP-5075 request-policy rules the API server checks beyond the schema (resource.k8s.io
    validation, ``validateRequestPolicy``), over every capacity of every device of ``slices``.

    A ``requestPolicy`` needs ``allowMultipleAllocations: true`` and one of ``validValues`` and
    ``validRange``, and its ``default``. ``validValues``: ascending, distinct, at most 10, each
    at most the capacity's value, the default among them. ``validRange``: a ``min``, with
    ``min <= value``, ``min <= default``; with ``max``: ``min <= max <= value`` and
    ``default <= max``; with ``step`` (positive): ``min + step <= value`` and the default and
    max a multiple of step counted from min. (Without ``max`` the server leaves the default
    above the value alone, and so does this check.)
    """
    errors: list[str] = []
    for index, obj in enumerate(slices):
        for device in obj["spec"].get("devices") or []:
            shared = device.get("allowMultipleAllocations") is True
            for name, capacity in (device.get("capacity") or {}).items():
                policy = capacity.get("requestPolicy")
                if policy is None:
                    continue
                where = f"slice {index}: device {device['name']}: capacity {name}"
                if not shared:
                    errors.append(f"{where}: requestPolicy without allowMultipleAllocations")
                value = parse_quantity(str(capacity["value"]))
                errors.extend(f"{where}: {e}" for e in _policy_errors(policy, value))
    return errors


def _policy_errors(policy: Mapping[str, Any], value: Fraction) -> list[str]:
    values, valid_range = policy.get("validValues") or [], policy.get("validRange")
    if values and valid_range is not None:
        return ["both validValues and validRange"]
    if not values and valid_range is None:
        return []
    if policy.get("default") is None:
        return ["no default"]
    default = parse_quantity(str(policy["default"]))
    if values:
        options = [parse_quantity(str(v)) for v in values]
        errors = [f"validValue {v} above the value {value}" for v in options if v > value]
        if options != sorted(set(options)) or len(options) > 10:
            errors.append(f"validValues {values}: at most 10, ascending, distinct")
        if default not in options:
            errors.append(f"default {default} is not among validValues")
        return errors
    if valid_range.get("min") is None:
        return ["validRange without min"]
    low = parse_quantity(str(valid_range["min"]))
    errors = [f"min {low} above the value {value}"] if low > value else []
    if default < low:
        errors.append(f"default {default} below min {low}")
    high = valid_range.get("max")
    top = None if high is None else parse_quantity(str(high))
    if top is not None:
        if top < low or top > value:
            errors.append(f"max {top} outside min {low} to the value {value}")
        if default > top:
            errors.append(f"default {default} above max {top}")
    if valid_range.get("step") is not None:
        step = parse_quantity(str(valid_range["step"]))
        if step <= 0:
            return [*errors, f"step {step} is not positive"]
        if low + step > value:
            errors.append(f"min + step ({low} + {step}) above the value {value}")
        for label, amount in (("default", default), ("max", top)):
            if amount is not None and (amount - low) % step:
                errors.append(f"{label} {amount} is not min {low} + a multiple of step {step}")
    return errors
