"""Every slice the agent can publish, for every API server version it supports.

The agent picks the slice layout from the server's version (``layout_for_version``: 1.34
combined, 1.35+ split) and the taint effects it may use (``None`` from 1.35). For each
supported version (1.34 to 1.37) and each way of publishing (static devices, dynamic MIG,
dynamic MIG adopting static instances, consumable shares in every mode, all of these with a
taint on every device), the slices of real simulated hosts must pass the strict schema of
that version and the rules the API server checks beyond it (64 devices per slice with
taints or counters, counter-set limits: ``tests/support/k8s_schema.pool_rule_errors``; the
capacities' request policies: ``k8s_schema.request_policy_errors``). Every shipped host,
with and without dynamic MIG, has its request policies checked in every shares mode.
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.dra import build_device_set, build_slices
from agent.dra.devices import DeviceSet
from agent.dra.model import DeviceTaint
from agent.dra.order import DEVICE_ORDERS, DeviceOrder
from agent.dra.partitionable import DynamicMig
from agent.dra.share_mode import parse_mode
from agent.dra.slices import layout_for_version, name_for_preview
from agent.hardware.simulated import shipped_profiles
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


def published(
    profile: str, mode: str, version: str, *, tainted: bool, order: DeviceOrder = "names"
) -> list[dict[str, Any]]:
    return publish(profile, MODES[mode], version, tainted=tainted, order=order)


def publish(
    profile: str,
    settings: dict[str, Any],
    version: str,
    *,
    tainted: bool,
    order: DeviceOrder = "names",
) -> list[dict[str, Any]]:
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
        device_order=order,
    )
    return name_for_preview(slices)  # named as the API server names them


@pytest.mark.parametrize("order", DEVICE_ORDERS)
@pytest.mark.parametrize("tainted", [False, True], ids=["plain", "tainted"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("version", k8s_schema.SUPPORTED_VERSIONS)
@pytest.mark.parametrize("profile", PROFILES)
def test_every_published_slice_is_valid(
    profile: str, version: str, mode: str, tainted: bool, order: DeviceOrder
) -> None:
    slices = published(profile, mode, version, tainted=tainted, order=order)
    for item in slices:
        assert k8s_schema.schema_errors(item, version) == [], item["spec"].get("devices", [])[:1]
    assert k8s_schema.pool_rule_errors(slices, version) == []
    assert k8s_schema.request_policy_errors(slices) == []
    if tainted:  # the 64-device limit bites: no slice holds more; effects the version knows
        assert all(len(item["spec"].get("devices") or []) <= 64 for item in slices)
        devices = [d for i in slices for d in i["spec"].get("devices") or []]
        effects = {t["effect"] for d in devices for t in d["taints"]}
        assert effects <= k8s_schema.taint_effects(version)


@pytest.mark.parametrize("shares", ["memory", "unlimited", "1", "8"])
@pytest.mark.parametrize("dynamic_mig", [False, True], ids=["static", "dynamic-mig"])
@pytest.mark.parametrize("profile", shipped_profiles())
def test_every_request_policy_is_valid(profile: str, dynamic_mig: bool, shares: str) -> None:
    """Every shipped host in every ``--consumable-shares`` mode, with and without
    ``--dynamic-mig``: the API server accepts each capacity's request policy (a MIG device's
    capacity of 0 and a ``shares`` capacity of 1 among them)."""
    settings: dict[str, Any] = {"shares": parse_mode(shares)}
    if dynamic_mig:
        settings["dynamic_mig"] = DynamicMig()
    slices = publish(profile, settings, "1.37", tainted=False)
    devices = [d for item in slices for d in item["spec"].get("devices") or []]
    assert any("requestPolicy" in c for d in devices for c in d["capacity"].values())
    assert k8s_schema.request_policy_errors(slices) == []


def policy_slice(capacity: dict[str, Any], shared: bool) -> dict[str, Any]:
    device = {"name": "d", "capacity": {"c": capacity}, "allowMultipleAllocations": shared}
    return {"spec": {"devices": [device]}}


def ranged(
    value: str, default: str, low: str, high: str | None, step: str | None
) -> dict[str, Any]:
    bounds = {"min": low} | ({} if high is None else {"max": high})
    bounds |= {} if step is None else {"step": step}
    return {"value": value, "requestPolicy": {"default": default, "validRange": bounds}}


@pytest.mark.parametrize(
    ("capacity", "shared", "expected"),
    [
        (ranged("8", "2", "0", "8", "2"), True, []),
        (ranged("1", "1", "1", "1", None), True, []),  # one amount: no step needed
        (ranged("8", "2", "0", "8", "2"), False, ["without allowMultipleAllocations"]),
        (ranged("0", "0", "0", "0", "1"), True, ["min + step (0 + 1) above the value 0"]),
        (ranged("1", "1", "1", "1", "1"), True, ["min + step (1 + 1) above the value 1"]),
        (ranged("8", "0", "1", "8", None), True, ["default 0 below min 1"]),
        (ranged("8", "8", "0", "4", None), True, ["default 8 above max 4"]),
        (ranged("8", "9", "9", None, None), True, ["min 9 above the value 8"]),
        (ranged("8", "0", "0", "9", None), True, ["max 9 outside min 0 to the value 8"]),
        (ranged("8", "3", "1", "7", "3"), True, ["default 3 is not min 1 + a multiple"]),
        (ranged("8", "4", "1", "8", "3"), True, ["max 8 is not min 1 + a multiple"]),
        (ranged("8", "0", "0", "8", "0"), True, ["step 0 is not positive"]),
        ({"value": "8", "requestPolicy": {"default": "2", "validValues": ["2", "9"]}}, True,
         ["validValue 9 above the value 8"]),
        ({"value": "8", "requestPolicy": {"default": "3", "validValues": ["2", "4"]}}, True,
         ["default 3 is not among validValues"]),
        ({"value": "8", "requestPolicy": {"default": "2", "validValues": ["4", "2"]}}, True,
         ["ascending"]),
    ],
)  # fmt: skip
def test_request_policy_rules(capacity: dict[str, Any], shared: bool, expected: list[str]) -> None:
    """Each rule of ``k8s_schema.request_policy_errors`` on its own (the server's rules)."""
    errors = k8s_schema.request_policy_errors([policy_slice(capacity, shared)])
    assert len(errors) == len(expected), errors
    for error, part in zip(errors, expected, strict=True):
        assert error.startswith("slice 0: device d: capacity c: ") and part in error


def test_the_checks_can_fail() -> None:
    """A shared device's policy broken by hand is caught by the schema, one whose step
    passes its capacity by the request-policy rules, a too-large tainted slice by the pool
    rules."""
    slices = published("dgx-h100", "shares-memory", "1.37", tainted=False)
    capacity = slices[0]["spec"]["devices"][0]["capacity"]["memory"]
    capacity["requestPolicy"]["validRange"]["stride"] = "1Mi"
    assert k8s_schema.schema_errors(slices[0], "1.37")
    shared = published("dgx-h100", "dynamic-mig-shares", "1.37", tainted=False)
    devices = [d for item in shared for d in item["spec"].get("devices") or []]
    encoders = next(d["capacity"]["encoders"] for d in devices if "-mig-1g" in d["name"])
    assert encoders["value"] == "0" and "requestPolicy" not in encoders
    encoders["requestPolicy"] = {
        "default": "0",
        "validRange": {"min": "0", "max": "0", "step": "1"},
    }
    [error] = k8s_schema.request_policy_errors(shared)
    assert "encoders: min + step (0 + 1) above the value 0" in error
    tainted = published("dgx-h100", "dynamic-mig", "1.37", tainted=True)
    devices = [d for item in tainted for d in item["spec"].get("devices") or []]
    big = {**tainted[-1], "spec": {**tainted[-1]["spec"], "devices": devices[:65]}}
    assert k8s_schema.pool_rule_errors([*tainted[:-1], big], "1.37")
