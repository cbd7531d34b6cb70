"""Tests of agent/dra/devices.py and agent/dra/model.py: what a node publishes, exactly."""

import dataclasses
from datetime import UTC, datetime, timedelta, timezone

import pytest

from agent.dra import limits
from agent.dra.devices import build_device_set, build_devices, fabric_clique
from agent.dra.errors import (
    DraModelError,
    DuplicateDeviceError,
    InvalidNameError,
    InvalidValueError,
    LimitExceededError,
)
from agent.dra.model import DeviceAttribute, DeviceTaint, DraDevice
from agent.hardware.inventory import FabricInfo
from tests.support.inventories import (
    CLUSTER_UUID,
    H100_1G_ME,
    bare_pcie_node,
    gb200_tray,
    gpu_uuid,
    h100,
    h100_mixed_mig_node,
    h100_node,
    inventory,
    mig,
    mig_uuid,
)

SHARED_H100 = {
    "productName": {"string": "NVIDIA H100 80GB HBM3"},
    "brand": {"string": "Nvidia"},
    "architecture": {"string": "Hopper"},
    "cudaComputeCapability": {"version": "9.0.0"},
    "driverVersion": {"version": "570.158.1"},
    "cudaDriverVersion": {"version": "12.8.0"},
    "nvlinkDomain": {"string": "nvswitch-domain-0"},
    "nvlinkPeerCount": {"int": 7},
}


def test_full_gpu_device_in_kubernetes_shape() -> None:
    devices = build_devices(h100_node(8))
    assert [device.name for device in devices] == [f"gpu-{minor}" for minor in range(8)]
    assert devices[5].to_dict() == {
        "name": "gpu-5",
        "attributes": {
            **SHARED_H100,
            "type": {"string": "gpu"},
            "uuid": {"string": gpu_uuid(5)},
            "resource.kubernetes.io/pciBusID": {"string": "0000:68:00.0"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:66"},
            "resource.kubernetes.io/numaNode": {"int": 1},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    }
    # Keys are rendered sorted, so the same device always serializes identically.
    assert list(devices[5].to_dict()["attributes"]) == sorted(devices[5].to_dict()["attributes"])


def test_mig_enabled_gpu_offers_only_its_mig_devices() -> None:
    result = build_device_set(h100_mixed_mig_node())
    assert [device.name for device in result.devices] == [
        "gpu-0",
        "gpu-1-mig-1g10gb-19-6",
        "gpu-1-mig-2g20gb-14-4",
        "gpu-1-mig-3g40gb-9-0",
    ]
    assert result.stranded_gpus == (gpu_uuid(2),)
    assert result.dropped == ()


def test_mig_device_attributes_and_capacities() -> None:
    devices = {device.name: device for device in build_devices(h100_mixed_mig_node())}
    assert devices["gpu-1-mig-3g40gb-9-0"].to_dict() == {
        "name": "gpu-1-mig-3g40gb-9-0",
        "attributes": {
            **SHARED_H100,
            "type": {"string": "mig"},
            "uuid": {"string": mig_uuid(1, 1)},
            "parentUUID": {"string": gpu_uuid(1)},
            "profile": {"string": "3g.40gb"},
            "resource.kubernetes.io/pciBusID": {"string": "0000:28:00.0"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:26"},
            "resource.kubernetes.io/numaNode": {"int": 0},
        },
        "capacity": {
            "copyEngines": {"value": "3"},
            "decoders": {"value": "3"},
            "encoders": {"value": "0"},
            "jpegEngines": {"value": "3"},
            "memory": {"value": "40320Mi"},
            "memorySlice0": {"value": "1"},
            "memorySlice1": {"value": "1"},
            "memorySlice2": {"value": "1"},
            "memorySlice3": {"value": "1"},
            "multiprocessors": {"value": "60"},
            "ofaEngines": {"value": "0"},
        },
    }
    one_g = devices["gpu-1-mig-1g10gb-19-6"].to_dict()["capacity"]
    assert [name for name in one_g if name.startswith("memorySlice")] == ["memorySlice6"]


def test_mig_profile_with_media_extensions_is_named_like_the_incumbent() -> None:
    gpu = h100(0, mig_enabled=True, mig_devices=(mig(0, 7, H100_1G_ME, 2),))
    (device,) = build_devices(inventory(gpu))
    assert device.name == "gpu-0-mig-1g10gb-me-20-2"
    assert device.attributes["profile"].value == "1g.10gb+me"
    assert device.capacity["ofaEngines"] == 1


def test_missing_optional_fields_are_omitted() -> None:
    (device,) = build_devices(bare_pcie_node())
    assert sorted(device.attributes) == [
        "architecture",
        "brand",
        "cudaComputeCapability",
        "cudaDriverVersion",
        "driverVersion",
        "nvlinkPeerCount",
        "productName",
        "resource.kubernetes.io/pciBusID",
        "type",
        "uuid",
    ]
    assert device.attributes["driverVersion"].value == "565.57.0"
    assert device.attributes["cudaComputeCapability"].value == "8.9.0"
    assert device.attributes["nvlinkPeerCount"].value == 0
    assert "capacity" not in device.to_dict()


def test_unknown_numa_node_is_omitted() -> None:
    (device,) = build_devices(inventory(h100(0, numa_node=-1)))
    assert "resource.kubernetes.io/numaNode" not in device.attributes


def test_fabric_clique_published_when_registration_completed() -> None:
    devices = build_devices(gb200_tray())
    assert {device.attributes["fabricClique"].value for device in devices} == {
        f"{CLUSTER_UUID}.32766"
    }
    assert devices[0].attributes["nvlinkPeerCount"].value == 71
    assert devices[0].attributes["driverVersion"].value == "575.57.8"
    assert devices[0].capacity["memory"] == 189471 * 2**20


@pytest.mark.parametrize(
    "fabric",
    [
        FabricInfo(CLUSTER_UUID, 1, "in-progress"),
        FabricInfo(CLUSTER_UUID, 1, "not-supported"),
        FabricInfo(CLUSTER_UUID, 1, "completed", status_ok=False),
        FabricInfo("00000000-0000-0000-0000-000000000000", 0, "completed"),
        FabricInfo("", 0, "completed"),
    ],
)
def test_unusable_fabric_info_publishes_no_clique(fabric: FabricInfo) -> None:
    gpu = h100(0, fabric=fabric)
    assert fabric_clique(gpu) is None
    (device,) = build_devices(inventory(gpu))
    assert "fabricClique" not in device.attributes


def test_too_long_descriptive_value_is_dropped_with_a_reason() -> None:
    long_name = "NVIDIA " + "X" * 60
    result = build_device_set(inventory(h100(0, name=long_name), h100(1)))
    assert "productName" not in result.devices[0].attributes
    assert result.devices[1].attributes["productName"].value == "NVIDIA H100 80GB HBM3"
    (dropped,) = result.dropped
    assert (dropped.device, dropped.attribute) == ("gpu-0", "productName")
    assert "67 characters" in dropped.reason


def test_too_long_identity_value_raises() -> None:
    with pytest.raises(InvalidValueError, match=r"device 'gpu-0': required attribute 'uuid'"):
        build_devices(inventory(h100(0, uuid="GPU-" + "f" * 61)))


def test_duplicate_minor_numbers_raise() -> None:
    with pytest.raises(DuplicateDeviceError, match="gpu-3"):
        build_devices(inventory(h100(3), h100(3, uuid="GPU-other")))


def test_mig_device_with_foreign_parent_raises() -> None:
    stray = dataclasses.replace(mig(0, 7, H100_1G_ME, 2), parent_uuid="GPU-elsewhere")
    with pytest.raises(DraModelError, match="inconsistent"):
        build_devices(inventory(h100(0, mig_enabled=True, mig_devices=(stray,))))


def test_unparsable_driver_version_raises() -> None:
    with pytest.raises(InvalidValueError, match="driver/CUDA version"):
        build_devices(inventory(h100(0), driver="570.x"))


def test_taints_are_attached_by_device_name() -> None:
    taint = DeviceTaint("gpu.nvidia.com/xid", "79", "NoExecute")
    result = build_device_set(
        h100_node(2), taints={"gpu-1": [taint], "gpu-9": [taint], "gpu-0": []}
    )
    assert result.devices[0].taints == ()
    assert result.devices[1].taints == (taint,)
    assert result.devices[1].to_dict()["taints"] == [
        {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoExecute"}
    ]
    assert result.unknown_taint_targets == ("gpu-9",)


def test_taint_limits() -> None:
    taints = [DeviceTaint(f"k{i}", effect="NoSchedule") for i in range(5)]
    assert len(build_devices(h100_node(1), taints={"gpu-0": taints})[0].taints) == 5
    with pytest.raises(LimitExceededError, match="5 taints; at most 4"):
        build_devices(
            h100_node(1),
            taints={"gpu-0": taints},
            max_taints_per_device=limits.MAX_TAINTS_PER_DEVICE_1_34,
        )
    with pytest.raises(LimitExceededError, match="17 taints"):
        build_devices(h100_node(1), taints={"gpu-0": taints * 3 + taints[:2]})


def test_taint_rendering_and_validation() -> None:
    moment = datetime(2026, 3, 4, 5, 6, 7, 890000, tzinfo=timezone(timedelta(hours=2)))
    assert DeviceTaint("unhealthy", effect="None", time_added=moment).to_dict() == {
        "key": "unhealthy",
        "effect": "None",
        "timeAdded": "2026-03-04T03:06:07Z",
    }
    with pytest.raises(InvalidValueError, match="effect"):
        DeviceTaint("x", effect="PreferNoSchedule")  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="timezone"):
        DeviceTaint("x", time_added=datetime(2026, 1, 1))
    with pytest.raises(InvalidNameError, match="taint key"):
        DeviceTaint("bad key")
    with pytest.raises(InvalidValueError, match="label value"):
        DeviceTaint("x", value="-bad")
    assert DeviceTaint("x", time_added=datetime(2026, 1, 1, tzinfo=UTC)).to_dict()["timeAdded"] == (
        "2026-01-01T00:00:00Z"
    )


def test_device_attribute_holds_exactly_one_valid_value() -> None:
    assert DeviceAttribute.of_int(3).to_dict() == {"int": 3}
    assert DeviceAttribute.of_bool(False).to_dict() == {"bool": False}
    assert DeviceAttribute.of_string("").to_dict() == {"string": ""}
    assert DeviceAttribute.of_version("1.2.3").to_dict() == {"version": "1.2.3"}
    with pytest.raises(InvalidValueError, match="exactly one"):
        DeviceAttribute()
    with pytest.raises(InvalidValueError, match="exactly one"):
        DeviceAttribute(int_value=1, string_value="1")
    with pytest.raises(InvalidValueError, match="not an int"):
        DeviceAttribute.of_int(True)
    with pytest.raises(InvalidValueError, match="int64"):
        DeviceAttribute.of_int(2**63)
    with pytest.raises(InvalidValueError, match="65 characters"):
        DeviceAttribute.of_string("x" * 65)
    with pytest.raises(InvalidValueError, match="SemVer"):
        DeviceAttribute.of_version("570.158.01")


def test_device_limits() -> None:
    many = {f"a{i}": DeviceAttribute.of_int(i) for i in range(20)}
    DraDevice("gpu-0", many, {f"c{i}": i for i in range(12)})
    with pytest.raises(LimitExceededError, match="20 attributes and 13 capacities"):
        DraDevice("gpu-0", many, {f"c{i}": i for i in range(13)})
    with pytest.raises(InvalidNameError, match="DNS label"):
        DraDevice("GPU-0")
    with pytest.raises(InvalidNameError, match=r"'gpu-0'.*'bad-name'"):
        DraDevice("gpu-0", {"bad-name": DeviceAttribute.of_int(1)})
    with pytest.raises(InvalidNameError, match="both an attribute and a capacity"):
        DraDevice("gpu-0", {"memory": DeviceAttribute.of_int(1)}, {"memory": 1})
    with pytest.raises(InvalidValueError, match="capacity 'memory'"):
        DraDevice("gpu-0", capacity={"memory": "80GB"})
    with pytest.raises(InvalidValueError, match="capacity 'memory'"):
        DraDevice("gpu-0", capacity={"memory": -1})
    assert DraDevice("gpu-0", capacity={"memory": "1.5Gi"}).to_dict()["capacity"] == {
        "memory": {"value": "1.5Gi"}
    }


def test_devices_are_immutable_after_validation() -> None:
    attributes = {"uuid": DeviceAttribute.of_string("GPU-1")}
    device = DraDevice("gpu-0", attributes, {"memory": 1024})
    attributes["x" * 40] = DeviceAttribute.of_int(1)  # the caller's dict, not the device's
    assert list(device.attributes) == ["uuid"]
    with pytest.raises(TypeError):
        device.capacity["memory"] = 1  # type: ignore[index]
    assert device.to_dict() == {
        "name": "gpu-0",
        "attributes": {"uuid": {"string": "GPU-1"}},
        "capacity": {"memory": {"value": "1Ki"}},
    }


def test_a_gpu_instance_split_into_compute_instances_is_left_out_with_the_reason() -> None:
    from tests.support.inventories import H100_1G, H100_3G, h100, inventory, mig

    whole = mig(1, 2, H100_1G, 6)
    split = mig(1, 1, H100_3G, 0)
    second_ci = dataclasses.replace(split, uuid="MIG-second-ci", compute_instance_id=1)
    node = inventory(h100(1, mig_enabled=True, mig_devices=(split, second_ci, whole)))
    result = build_device_set(node)
    assert [device.name for device in result.devices] == ["gpu-1-mig-1g10gb-19-6"]
    (reason,) = result.unpublished_mig
    assert "GPU instance 1 (3g.40gb) is split into 2 compute instances" in reason
