"""Property tests of agent/dra/devices.py and agent/dra/slices.py over arbitrary inventories.

Limits are re-checked here with the test's own rules rather than the model's helpers, so a
mistake in a model helper cannot hide itself.
"""

import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.dra.devices import build_device_set
from agent.dra.errors import DraModelError
from agent.dra.slices import build_slices, slices_match
from agent.hardware.inventory import Inventory
from tests.strategies import inventories, taint_maps
from tests.support import k8s_schema

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
QUALIFIED = re.compile(
    r"(([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/)?[A-Za-z_][A-Za-z0-9_]{0,31}"
)
SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)")
PROPERTY_SETTINGS = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def assert_within_api_limits(slices: list[dict[str, Any]], expected_devices: int) -> None:
    assert slices, "a pool always has at least one slice"
    generations = {s["spec"]["pool"]["generation"] for s in slices}
    assert len(generations) == 1
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}
    names: list[str] = []
    for resource_slice in slices:
        devices = resource_slice["spec"]["devices"]
        limit = 64 if any(device.get("taints") for device in devices) else 128
        assert len(devices) <= limit
        for device in devices:
            names.append(device["name"])
            assert DNS_LABEL.fullmatch(device["name"]), device["name"]
            attributes, capacity = device.get("attributes", {}), device.get("capacity", {})
            assert len(attributes) + len(capacity) <= 32
            assert len(device.get("taints", [])) <= 16
            for key in (*attributes, *capacity):
                assert QUALIFIED.fullmatch(key) and len(key.split("/")[0]) <= 63, key
            for value in attributes.values():
                assert len(value) == 1
                ((kind, text),) = value.items()
                if kind in ("string", "version"):
                    assert isinstance(text, str) and len(text) <= 64
                if kind == "version":
                    assert SEMVER.fullmatch(text), text
    assert len(names) == len(set(names)) == expected_devices
    assert names == sorted(
        names, key=lambda n: [int(r) if r.isdigit() else r for r in re.findall(r"\d+|\D+", n)]
    )


def expected_device_count(inventory: Inventory) -> int:
    return sum(len(gpu.mig_devices) if gpu.mig_enabled else 1 for gpu in inventory.gpus)


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(data=st.data(), inventory=inventories(), generation=st.integers(0, 2**40))
def test_every_inventory_publishes_within_api_limits(
    data: st.DataObject, inventory: Inventory, generation: int
) -> None:
    untainted = build_device_set(inventory)
    taints = data.draw(taint_maps([device.name for device in untainted.devices]))
    result = build_device_set(inventory, taints=taints)
    slices = build_slices(
        result.devices, node_name="node-a", driver_name="gpu.nvidia.com", generation=generation
    )
    assert_within_api_limits(slices, expected_device_count(inventory))
    assert {s["spec"]["pool"]["generation"] for s in slices} == {generation}
    # Same input, same slices: the publisher relies on it to match by content.
    again = build_slices(
        build_device_set(inventory, taints=taints).devices,
        node_name="node-a",
        driver_name="gpu.nvidia.com",
        generation=generation,
    )
    assert again == slices
    assert all(slices_match(a, b) for a, b in zip(slices, again, strict=True))
    tainted = {d["name"] for s in slices for d in s["spec"]["devices"] if d.get("taints")}
    assert tainted == {name for name, values in taints.items() if values and name != "gpu-99999"}
    for dropped in result.dropped:
        assert (
            dropped.attribute
            not in next(d for d in result.devices if d.name == dropped.device).attributes
        )


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(inventory=inventories(max_devices=40))
def test_generated_slices_pass_the_kubernetes_schema(inventory: Inventory) -> None:
    try:
        devices = build_device_set(inventory).devices
    except DraModelError as error:  # pragma: no cover - the strategy only builds valid inventories
        raise AssertionError(f"valid inventory rejected: {error}") from error
    for resource_slice in build_slices(devices, node_name="node-a", driver_name="gpu.nvidia.com"):
        assert k8s_schema.schema_errors(resource_slice, "1.35") == []
