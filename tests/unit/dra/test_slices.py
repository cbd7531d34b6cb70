"""Tests of agent/dra/slices.py: slice layout, object shape, schema validity, comparison."""

import copy
import random
from typing import Any

import pytest

from agent.dra.devices import build_devices
from agent.dra.errors import DuplicateDeviceError, InvalidNameError, InvalidValueError
from agent.dra.model import DeviceAttribute, DeviceTaint, DraDevice
from agent.dra.slices import build_slices, device_names, layout, slice_differences, slices_match
from tests.support import k8s_schema
from tests.support.inventories import bare_pcie_node, gb200_tray, h100_mixed_mig_node, h100_node

NODE, DRIVER = "node-a", "gpu.nvidia.com"


def plain(count: int, tainted: frozenset[int] = frozenset()) -> list[DraDevice]:
    taint = (DeviceTaint("unhealthy", effect="NoSchedule"),)
    return [
        DraDevice(
            f"dev-{i}", {"index": DeviceAttribute.of_int(i)}, {}, taint if i in tainted else ()
        )
        for i in range(count)
    ]


def test_slice_object_shape() -> None:
    (only,) = build_slices(
        build_devices(h100_node(2)), node_name=NODE, driver_name=DRIVER, generation=3
    )
    assert only["apiVersion"] == "resource.k8s.io/v1"
    assert only["kind"] == "ResourceSlice"
    # the index first (1.36 sorts slices by name), as the Go resourceslice library names them
    assert only["metadata"] == {"generateName": "00000-gpu.nvidia.com-node-a-"}
    assert only["spec"]["driver"] == DRIVER
    assert only["spec"]["nodeName"] == NODE
    assert only["spec"]["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": 1}
    assert [device["name"] for device in only["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    assert set(only["spec"]) == {"driver", "nodeName", "pool", "devices"}


def test_owner_reference_when_node_uid_known() -> None:
    (only,) = build_slices([], node_name=NODE, driver_name=DRIVER, node_uid="1234-abcd")
    assert only["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "1234-abcd", "controller": True}
    ]


def test_empty_pool_still_has_one_slice() -> None:
    slices = build_slices([], node_name=NODE, driver_name=DRIVER)
    assert len(slices) == 1
    assert slices[0]["spec"]["devices"] == []
    assert slices[0]["spec"]["pool"]["resourceSliceCount"] == 1


@pytest.mark.parametrize(
    ("count", "tainted", "sizes"),
    [
        (128, frozenset(), [128]),
        (129, frozenset(), [128, 1]),
        (300, frozenset(), [128, 128, 44]),
        (100, frozenset({99}), [64, 36]),
        (64, frozenset({0}), [64]),
        (300, frozenset({130}), [128, 64, 64, 44]),
        (300, frozenset({5, 290}), [64, 64, 128, 44]),
    ],
)
def test_layout_respects_device_limits(
    count: int, tainted: frozenset[int], sizes: list[int]
) -> None:
    assert [len(chunk) for chunk in layout(plain(count, tainted))] == sizes


def test_layout_is_sorted_and_deterministic() -> None:
    devices = plain(200, frozenset({7}))
    shuffled = devices[:]
    random.Random(4).shuffle(shuffled)
    first = build_slices(devices, node_name=NODE, driver_name=DRIVER)
    assert build_slices(shuffled, node_name=NODE, driver_name=DRIVER) == first
    names = [device["name"] for s in first for device in s["spec"]["devices"]]
    assert names[:3] == ["dev-0", "dev-1", "dev-2"] and names[-1] == "dev-199"
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in first} == {len(first)} == {3}


def test_build_slices_rejects_bad_input() -> None:
    with pytest.raises(DuplicateDeviceError, match="dev-1"):
        build_slices(plain(2) + plain(2)[1:], node_name=NODE, driver_name=DRIVER)
    with pytest.raises(InvalidValueError, match="generation"):
        build_slices([], node_name=NODE, driver_name=DRIVER, generation=-1)
    with pytest.raises(InvalidNameError, match="driver name"):
        build_slices([], node_name=NODE, driver_name="GPU")
    with pytest.raises(InvalidNameError, match="node name"):
        build_slices([], node_name="Node A", driver_name=DRIVER)


def test_device_names() -> None:
    (only,) = build_slices(plain(3), node_name=NODE, driver_name=DRIVER)
    assert device_names(only) == frozenset({"dev-0", "dev-1", "dev-2"})
    assert device_names({"spec": {}}) == frozenset()


# --- comparison with what the API server returns ---------------------------------------


def as_stored(desired: dict[str, Any]) -> dict[str, Any]:
    """What the API server hands back: server metadata, its own quantity and time spelling."""
    stored = copy.deepcopy(desired)
    stored["metadata"] = {
        "name": "node-a-gpu.nvidia.com-x7k2p",
        "uid": "u-1",
        "resourceVersion": "42",
    }
    for device in stored["spec"]["devices"]:
        for capacity in device.get("capacity", {}).values():
            if capacity["value"] == "80Gi":
                capacity["value"] = "81920Mi"
        for taint in device.get("taints", []):
            taint.setdefault("timeAdded", "2026-01-01T00:00:00Z")
            taint.setdefault("value", "")
        device.setdefault("taints", [])
    return stored


def tainted_slice(time_added: str | None = None) -> dict[str, Any]:
    devices = build_devices(h100_node(2))
    moment = (
        None if time_added is None else __import__("datetime").datetime.fromisoformat(time_added)
    )
    devices[1] = devices[1].with_taints((DeviceTaint("unhealthy", time_added=moment),))
    (only,) = build_slices(devices, node_name=NODE, driver_name=DRIVER, device_order="names")
    return only


def test_matches_ignoring_server_set_fields() -> None:
    desired = tainted_slice()
    assert slice_differences(desired, as_stored(desired)) == []
    assert slices_match(desired, desired)


def test_time_added_tolerance() -> None:
    desired = tainted_slice("2026-01-01T00:00:10+00:00")
    stored = copy.deepcopy(desired)
    stored["spec"]["devices"][1]["taints"][0]["timeAdded"] = "2026-01-01T00:00:11Z"
    assert slices_match(desired, stored)
    stored["spec"]["devices"][1]["taints"][0]["timeAdded"] = "2026-01-01T00:00:12Z"
    assert slice_differences(desired, stored) == [
        "spec.devices[gpu-1].taints[0].timeAdded: '2026-01-01T00:00:10Z' != '2026-01-01T00:00:12Z'"
    ]


def test_real_differences_are_reported() -> None:
    desired = tainted_slice()
    stored = as_stored(desired)
    stored["spec"]["pool"]["generation"] = 1
    stored["spec"]["devices"][0]["attributes"]["nvlinkPeerCount"] = {"int": 6}
    stored["spec"]["devices"][0]["capacity"]["memory"]["value"] = "40Gi"
    stored["spec"]["devices"][1]["taints"] = []
    stored["spec"]["devices"].append({"name": "gpu-7"})
    assert slice_differences(desired, stored) == [
        "spec.devices[gpu-7]: unexpected",
        "spec.devices[gpu-0].attributes.nvlinkPeerCount.int: 7 != 6",
        "spec.devices[gpu-0].capacity.memory.value: '80Gi' != '40Gi'",
        "spec.devices[gpu-1].taints: 1 taints != 0",
        "spec.pool.generation: 0 != 1",
    ]
    del stored["spec"]["devices"][0]
    assert "spec.devices[gpu-0]: missing" in slice_differences(desired, stored)


def test_bool_and_int_attributes_differ() -> None:
    desired = {"spec": {"devices": [{"name": "d", "attributes": {"x": {"int": 1}}}]}}
    observed = {"spec": {"devices": [{"name": "d", "attributes": {"x": {"int": True}}}]}}
    assert not slices_match(desired, observed)


# --- schema validation against the Kubernetes OpenAPI -----------------------------------

REPRESENTATIVE = {
    "h100": h100_node,
    "mixed-mig": h100_mixed_mig_node,
    "gb200": gb200_tray,
    "bare": bare_pcie_node,
}


@pytest.mark.parametrize("version", ["1.34", "1.35"])
@pytest.mark.parametrize("node", sorted(REPRESENTATIVE))
def test_representative_slices_validate(node: str, version: str) -> None:
    devices = build_devices(REPRESENTATIVE[node]())
    devices[0] = devices[0].with_taints((DeviceTaint("gpu.nvidia.com/xid", "79", "NoExecute"),))
    for resource_slice in build_slices(devices, node_name=NODE, driver_name=DRIVER, node_uid="u-1"):
        k8s_schema.validate(resource_slice, version)


def test_broken_slice_reports_every_error() -> None:
    (broken,) = build_slices(build_devices(h100_node(1)), node_name=NODE, driver_name=DRIVER)
    broken["spec"]["gpuCount"] = 1
    broken["spec"]["pool"]["generation"] = "one"
    broken["spec"]["devices"][0]["basic"] = {}
    broken["spec"]["devices"][0]["attributes"]["uuid"] = {"string": 7}
    errors = k8s_schema.schema_errors(broken, "1.35")
    assert [str(error) for error in errors] == [
        "spec: Additional properties are not allowed ('gpuCount' was unexpected)",
        "spec.devices.0: Additional properties are not allowed ('basic' was unexpected)",
        "spec.devices.0.attributes.uuid.string: 7 is not of type 'string', 'null'",
        "spec.pool.generation: 'one' is not of type 'integer'",
    ]
    with pytest.raises(k8s_schema.SchemaValidationFailed, match=r"\(4 errors\)"):
        k8s_schema.validate(broken, "1.34")


def test_manifest_errors_reads_yaml_streams() -> None:
    import yaml

    good = build_slices(build_devices(h100_node(1)), node_name=NODE, driver_name=DRIVER)
    bad = copy.deepcopy(good[0])
    bad["spec"]["pool"]["resourceSliceCount"] = "1"
    text = yaml.safe_dump_all([good[0], {"apiVersion": "v1", "kind": "List", "items": [bad]}])
    assert [str(e) for e in k8s_schema.manifest_errors(text, "1.35")] == [
        "1:spec.pool.resourceSliceCount: '1' is not of type 'integer'"
    ]
    with pytest.raises(ValueError, match="no strict schemas"):
        k8s_schema.schema_errors(good[0], "1.20")
