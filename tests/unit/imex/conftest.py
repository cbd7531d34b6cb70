"""A ComputeDomain manifest for the ComputeDomain tests (the embedded API server, kubeconfig and
client fixtures are in tests/conftest.py)."""

from __future__ import annotations

from typing import Any


def compute_domain(name: str = "cd", namespace: str = "default", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "numNodes": spec.get("num_nodes", 0),
            "channel": {
                "resourceClaimTemplate": {"name": f"{name}-channel"},
                "allocationMode": spec.get("mode", "Single"),
            },
        },
    }
