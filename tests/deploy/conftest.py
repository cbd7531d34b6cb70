"""Shared helpers for the deployment tests: paths, the tools, kustomize builds.

These tests run the tools an operator would run (``kubectl kustomize``, ``systemd-analyze``).
A missing tool fails the test with a message naming it, rather than skipping: CI must have
them (``make test`` runs ``scripts/check_tools.sh`` before the suite starts).
"""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
EXAMPLES = ROOT / "examples"
SYSTEMD = ROOT / "systemd"
#: Kubernetes versions the manifests must be valid for.
VERSIONS = ("1.34", "1.35")


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not installed; the deployment tests need it (make tools says how to install it)"
        )
    return path


def kustomizations() -> list[Path]:
    """Every directory under deploy/kubernetes that kustomize can build."""
    return sorted(p.parent for p in KUBERNETES.rglob("kustomization.yaml"))


@cache
def build_text(directory: Path) -> str:
    kubectl = require_tool("kubectl")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize {directory} failed:\n{result.stderr}")
    return result.stdout


def build(directory: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(build_text(directory)) if doc]


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"].get("name"))]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def example_objects() -> dict[str, list[dict[str, Any]]]:
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        for path in sorted(EXAMPLES.glob("*.yaml"))
    }


#: The node name Kubernetes puts into a token bound to a pod or a Node (1.32+).
NODE_CLAIM = "authentication.kubernetes.io/node-name"


def admission_denials(
    policy: dict[str, Any], operation: str, old: Any, new: Any, node: str | None, user: str
) -> list[str] | None:
    """Evaluate a ValidatingAdmissionPolicy as the API server does (matchConditions, then the
    variables in order, then the validations) for one request: the messages of the failing
    validations, or None when the policy does not apply to this request."""
    import cel

    spec = policy["spec"]
    extra = {NODE_CLAIM: [node]} if node else {}
    activation: dict[str, Any] = {
        "request": {"operation": operation, "userInfo": {"username": user, "extra": extra}},
        "object": new,
        "oldObject": old,
    }
    if not all(cel.evaluate(c["expression"], activation) for c in spec["matchConditions"]):
        return None
    activation["variables"] = {}
    for variable in spec["variables"]:  # in order: later ones read earlier ones
        activation["variables"][variable["name"]] = cel.evaluate(variable["expression"], activation)
    return [
        str(cel.evaluate(v["messageExpression"], activation))
        for v in spec["validations"]
        if not cel.evaluate(v["expression"], activation)
    ]
