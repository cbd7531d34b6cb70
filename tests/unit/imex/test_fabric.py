"""The node's clique from discovery, the channel device, and the channel CDI spec."""

from __future__ import annotations

import dataclasses

from agent.hardware.hostfiles import HostFiles
from agent.imex.cdi import channel_spec, channels_for
from agent.imex.config import AllocationMode
from agent.imex.fabric import CHANNEL_COUNT, channel_devices, node_clique
from agent.imex.simulated import add_channel_major
from tests.support.cdi_schema import assert_valid_cdi_spec
from tests.support.profile_slices import profile_inventory

UID = "0b6f5f2e-8d6a-4b7e-9a31-2f1c7d9e4a10"
CLIQUE = "6f1a3c2e-9b4d-4e7a-8c21-3d5f7a9b1c0e.32766"


def test_a_tray_has_one_clique_and_publishes_channel_0() -> None:
    clique = node_clique(profile_inventory("gb200-nvl72-tray"))
    assert clique.clique == CLIQUE
    (device,) = channel_devices(clique.clique)
    assert device.to_dict() == {
        "name": "channel-0",
        "attributes": {
            "fabricClique": {"string": CLIQUE},
            "id": {"int": 0},
            "type": {"string": "channel"},
        },
    }


def test_a_host_without_a_fabric_has_no_clique_and_says_why() -> None:
    clique = node_clique(profile_inventory("dgx-h100"))
    assert clique.clique is None
    assert clique.reason.startswith("no usable fabric clique: GPU 0 (no NVLink fabric)")
    assert channel_devices(None) == []


def test_gpus_that_disagree_or_are_not_registered_give_no_clique() -> None:
    inventory = profile_inventory("gb200-nvl72-tray")
    gpus = list(inventory.gpus)
    fabric = gpus[1].fabric
    assert fabric is not None
    gpus[1] = dataclasses.replace(gpus[1], fabric=dataclasses.replace(fabric, clique_id=7))
    split = node_clique(dataclasses.replace(inventory, gpus=tuple(gpus)))
    assert split.clique is None and "the GPUs disagree on the fabric clique" in split.reason
    gpus[1] = dataclasses.replace(gpus[1], fabric=dataclasses.replace(fabric, state="in-progress"))
    pending = node_clique(dataclasses.replace(inventory, gpus=tuple(gpus)))
    assert pending.clique is None and "GPU 1 (fabric state in-progress)" in pending.reason


def test_channel_specs_single_and_all(tmp_path: object) -> None:
    single = channel_spec(
        "compute-domain.nvidia.com", UID, "channel-0", channels_for(AllocationMode.SINGLE), 236
    )
    assert_valid_cdi_spec(single)
    (device,) = single["devices"]
    assert device["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia-caps-imex-channels/channel0", "type": "c", "major": 236, "minor": 0}
    ]
    every = channel_spec(
        "compute-domain.nvidia.com", UID, "channel-0", channels_for(AllocationMode.ALL), 236
    )
    nodes = every["devices"][0]["containerEdits"]["deviceNodes"]
    assert len(nodes) == CHANNEL_COUNT == 2048
    assert nodes[-1]["path"].endswith("/channel2047") and nodes[-1]["minor"] == 2047


def test_the_simulated_proc_devices_gets_the_channel_major(tmp_path: object) -> None:
    from pathlib import Path

    root = Path(str(tmp_path))
    (root / "proc").mkdir()
    (root / "proc/devices").write_text("Character devices:\n195 nvidia\n\nBlock devices:\n  8 sd\n")
    add_channel_major(root, 236)
    add_channel_major(root, 236)
    majors = HostFiles(root).device_majors()
    assert majors == {"nvidia": 195, "nvidia-caps-imex-channels": 236}
    assert (root / "proc/devices").read_text().count("imex") == 1


def test_binding_conditions_on_the_channel_and_the_schemas_of_each_release() -> None:
    """With --binding-conditions the channel carries KEP-5007's conditions; the slice is
    valid for 1.36 and 1.37. Off (1.34/1.35), the slice has none and is valid there."""
    from agent.dra.slices import build_slices
    from agent.imex.config import DRIVER
    from agent.imex.fabric import BINDING_CONDITION, BINDING_FAILURE_CONDITION
    from tests.support.k8s_schema import schema_errors

    (device,) = channel_devices(CLIQUE, binding_conditions=True)
    document = device.to_dict()
    assert document["bindingConditions"] == [BINDING_CONDITION] == ["IMEXDaemonReady"]
    assert document["bindingFailureConditions"] == [BINDING_FAILURE_CONDITION]
    for devices, versions in (
        (channel_devices(CLIQUE, binding_conditions=True), ("1.36", "1.37")),
        (channel_devices(CLIQUE), ("1.34", "1.35", "1.36", "1.37")),
    ):
        (item,) = build_slices(devices, node_name="tray-a", driver_name=DRIVER)
        for version in versions:
            assert schema_errors(item, version) == [], version
    (plain,) = build_slices(channel_devices(CLIQUE), node_name="tray-a", driver_name=DRIVER)
    assert "bindingConditions" not in plain["spec"]["devices"][0]
