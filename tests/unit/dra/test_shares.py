"""Tests of agent/dra/shares.py and agent/dra/capacity.py: --consumable-shares publishing and
the request-policy arithmetic of consumable capacity (KEP-5075)."""

from fractions import Fraction

import pytest

from agent.dra.capacity import RequestPolicy, consumed_amount
from agent.dra.devices import build_device_set
from agent.dra.errors import InvalidNameError, InvalidValueError
from agent.dra.model import DraDevice
from agent.dra.partitionable import DynamicMig
from agent.dra.quantity import parse_quantity
from agent.dra.share_mode import DISABLED, SharesMode, parse_mode
from agent.dra.shares import MEMORY_STEP
from agent.dra.slices import build_slices
from tests.support import k8s_schema
from tests.support.inventories import h100_mixed_mig_node, h100_node

GI = 2**30
NODE, DRIVER = "node-a", "gpu.nvidia.com"


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("disabled", DISABLED),
        ("Memory", SharesMode("memory")),
        (" unlimited ", SharesMode("unlimited")),
        ("4", SharesMode("count", 4)),
        ("1024", SharesMode("count", 1024)),
    ],
)
def test_parse_mode(text: str, mode: SharesMode) -> None:
    assert parse_mode(text) == mode


@pytest.mark.parametrize("text", ["", "0", "1025", "-1", "mem", "2.5", "shares"])
def test_parse_mode_refuses(text: str) -> None:
    with pytest.raises(InvalidValueError, match="disabled, memory, unlimited or a number"):
        parse_mode(text)


def gpu0(mode: SharesMode) -> DraDevice:
    devices = build_device_set(h100_node(1), shares=mode).devices
    return devices[0]


def test_disabled_publishes_as_before() -> None:
    plain = build_device_set(h100_node(2)).devices
    assert build_device_set(h100_node(2), shares=DISABLED).devices == plain
    assert "allowMultipleAllocations" not in plain[0].to_dict()


def test_memory_mode_policy() -> None:
    device = gpu0(SharesMode("memory")).to_dict()
    assert device["allowMultipleAllocations"] is True
    memory = device["capacity"]["memory"]
    total = int(parse_quantity(memory["value"]))
    top = total - total % MEMORY_STEP
    policy = memory["requestPolicy"]
    assert parse_quantity(policy["default"]) == top  # a plain claim keeps the whole GPU
    assert parse_quantity(policy["validRange"]["max"]) == top
    assert parse_quantity(policy["validRange"]["step"]) == MEMORY_STEP
    assert parse_quantity(policy["validRange"]["min"]) == MEMORY_STEP


def test_unlimited_and_count_modes() -> None:
    unlimited = gpu0(SharesMode("unlimited")).to_dict()["capacity"]
    assert unlimited["memory"]["requestPolicy"]["default"] == "0"
    assert "shares" not in unlimited
    counted = gpu0(SharesMode("count", 4)).to_dict()["capacity"]
    assert counted["shares"] == {
        "value": "4",
        "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}},
    }
    assert counted["memory"]["requestPolicy"]["default"] == "0"


def test_static_mig_devices_are_shared_too() -> None:
    devices = build_device_set(h100_mixed_mig_node(), shares=SharesMode("memory")).devices
    assert all(d.allow_multiple_allocations for d in devices)
    mig = next(d for d in devices if "mig" in d.name).to_dict()["capacity"]
    # engines and memory slices: nothing unless a share asks (else one share takes them all)
    assert mig["multiprocessors"]["requestPolicy"]["default"] == "0"
    assert (
        mig["memory"]["requestPolicy"]["default"]
        == mig["memory"]["requestPolicy"]["validRange"]["max"]
    )


def test_dynamic_mig_placements_and_their_full_gpu_are_shared() -> None:
    """With --dynamic-mig the devices that consume counters are shared too: the placement's
    one instance serves every share, and the counters stay on the device (consumed once)."""
    devices = build_device_set(
        h100_node(1), dynamic_mig=DynamicMig(), shares=SharesMode("memory")
    ).devices
    slots = [d for d in devices if "-mig-" in d.name]
    full = next(d for d in devices if d.name == "gpu-0")
    assert slots and full.consumes_counters
    for device in (full, *slots):
        assert device.allow_multiple_allocations and device.consumes_counters, device.name
    placement = next(d for d in slots if d.name == "gpu-0-mig-3g40gb-9-4").to_dict()
    assert placement["consumesCounters"][0]["counters"]["memory-slice-4"] == {"value": "1"}
    memory = placement["capacity"]["memory"]["requestPolicy"]
    assert memory["default"] == memory["validRange"]["max"]  # a plain claim: the whole slot
    assert placement["capacity"]["memorySlice4"]["requestPolicy"]["default"] == "0"
    for version in ("1.34", "1.35", "1.36", "1.37"):
        for item in build_slices(
            devices,
            node_name=NODE,
            driver_name=DRIVER,
            counter_sets=build_device_set(h100_node(1), dynamic_mig=DynamicMig()).counter_sets,
            slice_layout="combined" if version == "1.34" else "split",
        ):
            item["metadata"]["name"] = "s"
            assert k8s_schema.schema_errors(item, version) == []


@pytest.mark.parametrize("mode", ["memory", "unlimited", "7"])
@pytest.mark.parametrize("version", ["1.34", "1.35", "1.36", "1.37"])
def test_shared_slices_validate(mode: str, version: str) -> None:
    devices = build_device_set(h100_mixed_mig_node(), shares=parse_mode(mode)).devices
    for item in build_slices(devices, node_name=NODE, driver_name=DRIVER):
        item["metadata"]["name"] = "s"
        assert k8s_schema.schema_errors(item, version) == []


def test_policy_validation_matches_the_api_server() -> None:
    with pytest.raises(InvalidValueError, match="not on its steps"):
        RequestPolicy(3, 0, 10, 2)
    with pytest.raises(InvalidValueError, match="max 9 is not min"):
        RequestPolicy(2, 0, 9, 2)
    with pytest.raises(InvalidValueError, match="outside"):
        RequestPolicy(12, 0, 10, 2)
    with pytest.raises(InvalidValueError, match="exactly one"):
        RequestPolicy(1)
    with pytest.raises(InvalidValueError, match="one of validValues"):
        RequestPolicy(3, valid_values=(1, 2))
    with pytest.raises(InvalidValueError, match="ascending"):
        RequestPolicy(1, valid_values=(2, 1))
    assert RequestPolicy(2, valid_values=(1, 2)).to_dict() == {
        "default": "2",
        "validValues": ["1", "2"],
    }


def test_policy_needs_multiple_allocations_and_the_capacity() -> None:
    policy = {"memory": RequestPolicy(0, 0, 8, 1)}
    with pytest.raises(InvalidValueError, match="needs allowMultipleAllocations"):
        DraDevice("d", capacity={"memory": 8}, request_policies=policy)
    with pytest.raises(InvalidNameError, match="for no capacity"):
        DraDevice("d", allow_multiple_allocations=True, request_policies=policy)


RANGE = {"default": "1Gi", "validRange": {"min": "1Mi", "max": "80Gi", "step": "1Mi"}}


@pytest.mark.parametrize(
    ("requested", "policy", "consumed"),
    [
        (None, None, 80 * GI),  # no policy, nothing named: the whole capacity
        (5 * GI, None, 5 * GI),  # no policy: what is named
        (None, RANGE, GI),  # the default
        (20 * GI, RANGE, 20 * GI),
        (Fraction(1), RANGE, 2**20),  # up to min
        (2**20 + 1, RANGE, 2 * 2**20),  # rounded up to the step
        (81 * GI, RANGE, None),  # over max: the device cannot serve it
        (3, {"default": "2", "validValues": ["2", "4", "8"]}, 4),
        (9, {"default": "2", "validValues": ["2", "4", "8"]}, None),
    ],
)
def test_consumed_amount(requested: int | None, policy: dict | None, consumed: int | None) -> None:
    asked = None if requested is None else Fraction(requested)
    got = consumed_amount(asked, Fraction(80 * GI), policy)
    assert got == (None if consumed is None else Fraction(consumed))


def test_a_capacity_of_zero_gets_no_policy() -> None:
    """A 1g placement has no encoder: the API server refuses any range with a step on a
    capacity of 0 (min + step <= value), so the capacity is published without a policy."""
    devices = build_device_set(
        h100_node(1), dynamic_mig=DynamicMig(), shares=SharesMode("memory")
    ).devices
    small = next(d for d in devices if "-mig-1g" in d.name)
    capacity = small.to_dict()["capacity"]
    zero = sorted(name for name, entry in capacity.items() if entry["value"] == "0")
    assert "encoders" in zero
    assert all("requestPolicy" not in capacity[name] for name in zero)
    assert all("requestPolicy" in entry for entry in capacity.values() if entry["value"] != "0")
    consumed = consumed_amount(None, Fraction(0), capacity["encoders"].get("requestPolicy"))
    assert consumed == 0  # a share that names nothing takes all of nothing


def test_one_share_has_no_step() -> None:
    """``--consumable-shares 1``: min 1 + step 1 would pass the capacity of 1."""
    shares = gpu0(SharesMode("count", 1)).to_dict()["capacity"]["shares"]
    assert shares == {
        "value": "1",
        "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "1"}},
    }


@pytest.mark.parametrize(
    ("value", "policy", "message"),
    [
        (0, RequestPolicy(0, 0, 0, 1), r"one step from min \(0 \+ 1\) passes"),
        (1, RequestPolicy(1, 1, 1, 1), r"one step from min \(1 \+ 1\) passes"),
        (4, RequestPolicy(0, 0, 8, 1), "validRange 8 passes the capacity value 4"),
        (4, RequestPolicy(5, 5), "validRange 5 passes the capacity value 4"),
        (4, RequestPolicy(2, valid_values=(2, 8)), "validValues pass the capacity value 4"),
    ],
)
def test_policy_must_suit_its_capacity(value: int, policy: RequestPolicy, message: str) -> None:
    with pytest.raises(InvalidValueError, match=message):
        DraDevice(
            "d",
            capacity={"c": value},
            allow_multiple_allocations=True,
            request_policies={"c": policy},
        )
    with pytest.raises(InvalidValueError, match=message):  # a quantity string, the same
        DraDevice(
            "d",
            capacity={"c": str(value)},
            allow_multiple_allocations=True,
            request_policies={"c": policy},
        )
    DraDevice(
        "d", capacity={"c": 8}, allow_multiple_allocations=True, request_policies={"c": policy}
    )
