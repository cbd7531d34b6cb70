"""The special claim of KEP-5004 as kube-scheduler 1.36 builds it, from plain pod JSON."""

from __future__ import annotations

from typing import Any

import pytest

from agent.sim.extended import (
    EXTENDED_RESOURCE_CLAIM_ANNOTATION,
    ExtendedResourceError,
    claim_of,
    class_mapping,
    pod_manifest,
    special_claim,
)

CLASSES = [
    {"metadata": {"name": "gpu.nvidia.com", "creationTimestamp": "2026-01-01T00:00:00Z"},
     "spec": {"extendedResourceName": "nvidia.com/gpu"}},
    {"metadata": {"name": "mig.nvidia.com", "creationTimestamp": "2026-01-02T00:00:00Z"}},
]  # fmt: skip
MAPPING = class_mapping(CLASSES)


def pod(**containers: dict[str, Any]) -> dict[str, Any]:
    manifest = pod_manifest("p", containers)
    manifest["metadata"]["uid"] = "0b6e1c2a-4f4e-4a7e-9d55-3c1d2e6f7a80"
    return manifest


def test_the_mapping_has_explicit_and_implicit_names_newest_first() -> None:
    assert MAPPING == {
        "deviceclass.resource.kubernetes.io/gpu.nvidia.com": "gpu.nvidia.com",
        "nvidia.com/gpu": "gpu.nvidia.com",
        "deviceclass.resource.kubernetes.io/mig.nvidia.com": "mig.nvidia.com",
    }
    newer = {
        "metadata": {"name": "gpu-shared", "creationTimestamp": "2026-02-01T00:00:00Z"},
        "spec": {"extendedResourceName": "nvidia.com/gpu"},
    }
    assert class_mapping([newer, *CLASSES])["nvidia.com/gpu"] == "gpu-shared"


def test_request_names_follow_container_and_sorted_resource_indices() -> None:
    manifest = pod(
        a={"cpu": "1"},
        b={"nvidia.com/gpu": "2", "cpu": "2", "example.com/foo": "1"},
        c={"deviceclass.resource.kubernetes.io/mig.nvidia.com": 1, "nvidia.com/gpu": "1"},
    )
    special = special_claim(manifest, MAPPING)
    assert special is not None
    requests = special.manifest["spec"]["devices"]["requests"]
    assert [
        (r["name"], r["exactly"]["deviceClassName"], r["exactly"]["count"]) for r in requests
    ] == [
        ("container-1-request-2", "gpu.nvidia.com", 2),
        ("container-2-request-0", "mig.nvidia.com", 1),
        ("container-2-request-1", "gpu.nvidia.com", 1),
    ]
    meta = special.manifest["metadata"]
    assert meta["generateName"] == "p-extended-resources-"
    assert meta["annotations"] == {EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"}
    assert "resource.kubernetes.io/pod-claim-name" not in meta["annotations"]
    assert meta["ownerReferences"][0]["uid"] == manifest["metadata"]["uid"]
    assert "config" not in special.manifest["spec"]["devices"]  # the class's config applies
    assert special.mappings[0] == {
        "containerName": "b",
        "resourceName": "nvidia.com/gpu",
        "requestName": "container-1-request-2",
    }


def test_nothing_for_dra_gives_no_claim() -> None:
    assert special_claim(pod(a={"cpu": "1"}), MAPPING) is None
    assert special_claim(pod(a={"nvidia.com/gpu": "0"}), MAPPING) is None
    # the node's device plugin advertises it: not DRA's
    assert special_claim(pod(a={"nvidia.com/gpu": "1"}), MAPPING, {"nvidia.com/gpu": "8"}) is None
    assert special_claim(pod(a={"nvidia.com/gpu": "1"}), MAPPING, {"nvidia.com/gpu": "0"})


def test_requests_win_over_limits_and_fractions_are_refused() -> None:
    manifest = pod(a={"nvidia.com/gpu": "2"})
    manifest["spec"]["containers"][0]["resources"]["requests"] = {"nvidia.com/gpu": "3"}
    special = special_claim(manifest, MAPPING)
    assert special is not None
    assert special.manifest["spec"]["devices"]["requests"][0]["exactly"]["count"] == 3
    with pytest.raises(ExtendedResourceError, match="whole number of devices"):
        special_claim(pod(a={"nvidia.com/gpu": "500m"}), MAPPING)
    with pytest.raises(ExtendedResourceError, match=r"nvidia\.com/gpu: 'lots'"):
        special_claim(pod(a={"nvidia.com/gpu": "lots"}), MAPPING)


def test_the_kubelet_finds_the_claim_in_the_pod_status() -> None:
    assert claim_of({"status": {}}) is None
    status = {"extendedResourceClaimStatus": {"resourceClaimName": "p-extended-resources-x"}}
    assert claim_of({"status": status}) == "p-extended-resources-x"
