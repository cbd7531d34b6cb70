"""Validate CDI spec documents against the CDI JSON schema from the Debian package.

The schema ships in ``golang-github-container-orchestrated-devices-container-device-
interface-dev`` (draft-07). ``make test`` fetches its two files into ``.cache/cdi-schema`` of
the checkout (``make cdi-schema``: ``apt-get download`` + ``dpkg -x``, no root), and this
module reads them only from there, so the suite needs nothing the README does not install.
Two traps (dependency-notes.md §6b): ``defs.json`` has no
``$schema``, so it is registered as a draft-07 resource explicitly; and the schema does not
check ``cdiVersion`` nor the names the Go library checks, so :func:`cdi_problems` adds the
Go library's rules: the version set of ``pkg/cdi/spec.go``, vendor/class/device name syntax
and non-empty device edits. A missing schema is an error, not a skip: these tests are the
only proof that the runtime will accept our specs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from jsonschema import Draft7Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

DEBIAN_PACKAGE = "golang-github-container-orchestrated-devices-container-device-interface-dev"
#: Where ``make cdi-schema`` puts the schema (the Makefile's ``CACHE_DIR``, default ``.cache``).
SCHEMA_DIR = Path(__file__).resolve().parents[2] / ".cache" / "cdi-schema"
VALID_VERSIONS = ("0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0")  # pkg/cdi/spec.go of 0.5.x
_VENDOR = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_-]*[A-Za-z0-9])?")
_DEVICE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")


class CdiSchemaMissing(AssertionError):
    """The schema files are not installed; the message says which package provides them."""


@lru_cache(maxsize=1)
def _validator() -> Draft7Validator:
    return load_validator(SCHEMA_DIR)


def load_validator(schema_dir: Path) -> Draft7Validator:
    """A validator built from the ``schema.json`` and ``defs.json`` in ``schema_dir``."""
    schema_path, defs_path = schema_dir / "schema.json", schema_dir / "defs.json"
    if not schema_path.is_file() or not defs_path.is_file():
        raise CdiSchemaMissing(
            f"the CDI JSON schema is missing ({schema_path}, {defs_path}): run `make cdi-schema`"
            f" (it fetches the Debian package {DEBIAN_PACKAGE}; `make test` does it first)"
        )
    schema = json.loads(schema_path.read_text())
    defs = Resource.from_contents(json.loads(defs_path.read_text()), default_specification=DRAFT7)
    registry: Registry[Any] = Registry().with_resource("defs.json", defs)
    return Draft7Validator(schema, registry=registry)


def cdi_problems(spec: Mapping[str, Any], validator: Draft7Validator | None = None) -> list[str]:
    """Every schema violation and Go-library rule ``spec`` breaks; empty if it is valid."""
    problems = [
        f"{'.'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
        for error in (validator or _validator()).iter_errors(spec)
    ]
    if spec.get("cdiVersion") not in VALID_VERSIONS:
        problems.append(f"cdiVersion: {spec.get('cdiVersion')!r} not in {VALID_VERSIONS}")
    vendor, _, class_name = str(spec.get("kind", "")).partition("/")
    if not _VENDOR.fullmatch(vendor) or not _CLASS.fullmatch(class_name):
        problems.append(f"kind: {spec.get('kind')!r} is not <vendor>/<class>")
    for index, device in enumerate(spec.get("devices") or []):
        if not _DEVICE.fullmatch(str(device.get("name", ""))):
            problems.append(f"devices.{index}.name: {device.get('name')!r} is not a device name")
        edits = device.get("containerEdits") or {}
        if not any(edits.get(key) for key in ("env", "deviceNodes", "mounts", "hooks")):
            problems.append(f"devices.{index}.containerEdits: empty (the Go library rejects it)")
    return problems


def assert_valid_cdi_spec(spec: Mapping[str, Any]) -> None:
    """Fail with every problem listed if ``spec`` is not a valid CDI spec."""
    problems = cdi_problems(spec)
    if problems:
        raise AssertionError("invalid CDI spec:\n  " + "\n  ".join(problems))
