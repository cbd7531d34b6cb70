"""overlays/extended-resources (Kubernetes 1.36+): the production overlay with the
gpu.nvidia.com DeviceClass serving ``nvidia.com/gpu``, valid for the 1.36 and 1.37 schemas,
and the same classes as the embedded cluster's (``agent.sim.deviceclasses``)."""

from __future__ import annotations

from typing import Any

import pytest

from agent.sim.deviceclasses import EXTENDED_RESOURCE_NAME, default_device_classes
from tests.deploy.conftest import KUBERNETES, build, find
from tests.support.k8s_schema import schema_errors

OVERLAY = KUBERNETES / "overlays" / "extended-resources"
PRODUCTION = KUBERNETES / "overlays" / "production"


def _without_labels(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in obj["metadata"].items() if k != "labels"}
    return {**obj, "metadata": meta}


def test_it_is_production_with_the_extended_resource_name() -> None:
    overlay, production = build(OVERLAY), build(PRODUCTION)
    assert [(o["kind"], o["metadata"]["name"]) for o in overlay] == [
        (o["kind"], o["metadata"]["name"]) for o in production
    ]
    gpu = find(overlay, "DeviceClass", "gpu.nvidia.com")
    assert gpu["spec"]["extendedResourceName"] == EXTENDED_RESOURCE_NAME == "nvidia.com/gpu"
    assert (
        gpu["spec"]["selectors"]
        == find(production, "DeviceClass", "gpu.nvidia.com")["spec"]["selectors"]
    )
    others = [o for o in overlay if o["metadata"]["name"] != "gpu.nvidia.com"]
    assert others == [o for o in production if o["metadata"]["name"] != "gpu.nvidia.com"]
    assert not any("extendedResourceName" in o.get("spec", {}) for o in production)


@pytest.mark.parametrize("version", ["1.36", "1.37"])
def test_every_object_is_valid_for_kubernetes_1_36_and_1_37(version: str) -> None:
    errors = [
        f"{o['kind']}/{o['metadata']['name']}: {e}"
        for o in build(OVERLAY)
        for e in schema_errors(o, version)
    ]
    assert errors == []


def test_a_wrong_field_would_be_caught() -> None:
    gpu = find(build(OVERLAY), "DeviceClass", "gpu.nvidia.com")
    gpu = {**gpu, "spec": {**gpu["spec"], "extendedResourceNames": "nvidia.com/gpu"}}
    assert schema_errors(gpu, "1.36")


def test_the_embedded_cluster_has_the_same_classes() -> None:
    shipped = [_without_labels(o) for o in build(OVERLAY) if o["kind"] == "DeviceClass"]
    embedded = default_device_classes(extended_resources=True)

    def by_name(objects: list[dict[str, Any]]) -> dict[str, Any]:
        return {o["metadata"]["name"]: o for o in objects}

    assert by_name(shipped).keys() == by_name(embedded).keys()
    for name, obj in by_name(embedded).items():
        assert obj["spec"].get("extendedResourceName") == by_name(shipped)[name]["spec"].get(
            "extendedResourceName"
        )
