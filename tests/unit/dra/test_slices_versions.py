"""Every slice the agent can publish, for every API server version it supports.

The agent picks the slice layout from the server's version (``layout_for_version``: 1.34
combined, 1.35+ split) and the taint effects it may use (``None`` from 1.35). For each
supported version (1.34 to 1.37) and each way of publishing (static devices, dynamic MIG,
dynamic MIG adopting static instances, consumable shares in every mode, all of these with a
taint on every device), the slices of real simulated hosts must pass the strict schema of
that version and the pool rules the API server checks beyond it (64 devices per slice with
taints or counters, counter-set limits: ``tests/support/k8s_schema.pool_rule_errors``).
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.dra import build_device_set, build_slices
from agent.dra.devices import DeviceSet
from agent.dra.model import DeviceTaint
from agent.dra.partitionable import DynamicMig
from agent.dra.shares import parse_mode
from agent.dra.slices import layout_for_version
from tests.support import k8s_schema
from tests.support.profile_slices import profile_inventory

NODE, DRIVER = "node-a", "gpu.nvidia.com"
MODES = {
    "static": {},
    "dynamic-mig": {"dynamic_mig": DynamicMig()},
    "dynamic-mig-adopt": {"dynamic_mig": DynamicMig(adopt=True)},
    "shares-memory": {"shares": parse_mode("memory")},
    "shares-unlimited": {"shares": parse_mode("unlimited")},
    "shares-8": {"shares": parse_mode("8")},
    "dynamic-mig-shares": {"dynamic_mig": DynamicMig(), "shares": parse_mode("memory")},
}
PROFILES = ("dgx-h100", "dgx-a100", "gb200-nvl72-tray")


def version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split(".")
    return int(major), int(minor)


def published(profile: str, mode: str, version: str, *, tainted: bool) -> list[dict[str, Any]]:
    settings: dict[str, Any] = MODES[mode]
    inventory = profile_inventory(profile)
    devices: DeviceSet = build_device_set(inventory, **settings)
    if tainted:  # every device, with the effect health would choose for this version
        effect = "NoSchedule" if version_tuple(version) < (1, 35) else "None"
        taint = (DeviceTaint("gpu.nvidia.com/unmonitored", "", effect),)  # type: ignore[arg-type]
        names = {d.name: taint for d in devices.devices}
        devices = build_device_set(inventory, taints=names, **settings)
    slices = build_slices(
        devices.devices,
        node_name=NODE,
        driver_name=DRIVER,
        node_uid="u-1",
        counter_sets=devices.counter_sets,
        slice_layout=layout_for_version(version_tuple(version)),
    )
    for index, item in enumerate(slices):
        item["metadata"]["name"] = f"{NODE}-{DRIVER}-{index}"
    return slices


@pytest.mark.parametrize("tainted", [False, True], ids=["plain", "tainted"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("version", k8s_schema.SUPPORTED_VERSIONS)
@pytest.mark.parametrize("profile", PROFILES)
def test_every_published_slice_is_valid(
    profile: str, version: str, mode: str, tainted: bool
) -> None:
    slices = published(profile, mode, version, tainted=tainted)
    for item in slices:
        assert k8s_schema.schema_errors(item, version) == [], item["spec"].get("devices", [])[:1]
    assert k8s_schema.pool_rule_errors(slices, version) == []
    if tainted:  # the 64-device limit bites: no slice holds more; effects the version knows
        assert all(len(item["spec"].get("devices") or []) <= 64 for item in slices)
        devices = [d for i in slices for d in i["spec"].get("devices") or []]
        effects = {t["effect"] for d in devices for t in d["taints"]}
        assert effects <= k8s_schema.taint_effects(version)


def test_the_checks_can_fail() -> None:
    """A shared device's policy broken by hand is caught by the schema, a too-large tainted
    slice by the pool rules."""
    slices = published("dgx-h100", "shares-memory", "1.37", tainted=False)
    capacity = slices[0]["spec"]["devices"][0]["capacity"]["memory"]
    capacity["requestPolicy"]["validRange"]["stride"] = "1Mi"
    assert k8s_schema.schema_errors(slices[0], "1.37")
    tainted = published("dgx-h100", "dynamic-mig", "1.37", tainted=True)
    devices = [d for item in tainted for d in item["spec"].get("devices") or []]
    big = {**tainted[-1], "spec": {**tainted[-1]["spec"], "devices": devices[:65]}}
    assert k8s_schema.pool_rule_errors([*tainted[:-1], big], "1.37")
