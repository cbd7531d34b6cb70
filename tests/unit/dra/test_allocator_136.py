"""The 1.36 scheduler's additions in the embedded allocator, after kube-scheduler's structured
allocator tests (``structured/internal/incubating``, ``allocator_test.go``): consumable
capacity (KEP-5075: ``allowMultipleAllocations``, request policies, ``consumedCapacity``,
``shareID``, ``distinctAttribute``) and the allocation order over several pools (pools by
driver and name, pools with binding conditions last, slices by name)."""

from __future__ import annotations

import itertools
from typing import Any

from agent.dra.allocator import allocate, build_node_state, explain, parse_claim
from agent.dra.devices import build_device_set
from agent.dra.share_mode import parse_mode
from agent.dra.slices import build_slices
from tests.support.inventories import h100_mixed_mig_node
from tests.unit.dra.test_allocator import (
    CLASSES,
    DRIVER,
    NODE,
    allocated_claim,
    claim,
    device,
    exactly,
    partitions,
    run,
    slice_,
)

Obj = dict[str, Any]
MEMORY_POLICY = {"default": "80Gi", "validRange": {"min": "1Mi", "max": "80Gi", "step": "1Mi"}}


def shared(name: str, numa: int = 0, policy: Obj | None = MEMORY_POLICY) -> Obj:
    out = device(name, numa, allowMultipleAllocations=True)
    if policy is not None:
        out["capacity"]["memory"]["requestPolicy"] = policy
    return out


def memory(name: str, amount: str, **extra: Any) -> Obj:
    return exactly(name, capacity={"requests": {"memory": amount}}, **extra)


class Cluster:
    """Claims allocated one after another on the same slices, as the scheduler would."""

    def __init__(self, slices: list[Obj]) -> None:
        self.slices = slices
        self.claims: list[Obj] = []
        self.ids = (f"share-{i}" for i in itertools.count())

    def allocate(self, doc: Obj) -> tuple[Obj | None, Obj]:
        parsed = parse_claim(doc, CLASSES)
        state = build_node_state(NODE, self.slices, self.claims)
        outcome = allocate(parsed, state, lambda: next(self.ids))
        if outcome.allocation is not None:
            number = len(self.claims)
            self.claims.append(
                {
                    "metadata": {"name": f"c{number}", "namespace": "default", "uid": f"u{number}"},
                    "status": {"allocation": outcome.allocation},
                }
            )
        return outcome.allocation, explain(parsed, state, outcome)


def results(allocation: Obj | None) -> list[Obj]:
    assert allocation is not None
    return list(allocation["devices"]["results"])


def test_three_shares_fill_a_gpu_and_a_fourth_is_refused_naming_the_capacity() -> None:
    cluster = Cluster([slice_([shared("gpu-0")])])
    ids = []
    for amount in ("20Gi", "20Gi", "40Gi"):
        allocation, _ = cluster.allocate(claim(memory("r", amount)))
        (result,) = results(allocation)
        assert result["device"] == "gpu-0"
        assert result["consumedCapacity"] == {"memory": amount}
        ids.append(result["shareID"])
    assert ids == ["share-0", "share-1", "share-2"]
    allocation, report = cluster.allocate(claim(memory("r", "1Gi")))
    assert allocation is None
    assert "capacity memory of gpu-0: needs 1Gi, 0 left" in report["reasons"][0]
    (checked,) = report["requests"][0]["devices"]
    assert checked["verdict"] == "capacity exhausted"
    assert checked["capacity"] == [
        {
            "capacity": "memory",
            "requested": "1Gi",
            "consumes": "1Gi",
            "remaining": "0",
            "fits": False,
        }
    ]
    assert checked["sharedBy"] == ["default/c0", "default/c1", "default/c2"]


def test_the_default_is_consumed_and_requests_are_rounded_up_to_the_step() -> None:
    cluster = Cluster([slice_([shared("gpu-0"), shared("gpu-1")])])
    allocation, _ = cluster.allocate(claim(exactly("whole")))  # no amount: the default
    assert results(allocation)[0]["consumedCapacity"] == {"memory": "80Gi"}
    allocation, _ = cluster.allocate(claim(memory("odd", "1000Ki")))
    (result,) = results(allocation)
    assert (result["device"], result["consumedCapacity"]) == ("gpu-1", {"memory": "1Mi"})
    allocation, report = cluster.allocate(claim(memory("big", "81Gi")))
    assert allocation is None
    assert {d["verdict"] for d in report["requests"][0]["devices"]} == {"capacity policy"}


def test_without_a_policy_a_share_takes_what_it_names_or_everything() -> None:
    cluster = Cluster([slice_([shared("gpu-0", policy=None)])])
    allocation, _ = cluster.allocate(claim(memory("r", "30Gi")))
    assert results(allocation)[0]["consumedCapacity"] == {"memory": "30Gi"}
    allocation, _ = cluster.allocate(claim(exactly("rest")))
    assert allocation is None  # the whole capacity, of which 50Gi are left


def test_one_claim_may_hold_two_shares_of_a_device_unless_distinct() -> None:
    slices = [slice_([shared("gpu-0", numa=0), shared("gpu-1", numa=1)])]
    doc = claim(memory("a", "10Gi"), memory("b", "10Gi"))
    allocation, _ = Cluster(slices).allocate(doc)
    assert [(r["request"], r["device"]) for r in results(allocation)] == [
        ("a", "gpu-0"),
        ("b", "gpu-0"),
    ]
    assert len({r["shareID"] for r in results(allocation)}) == 2
    distinct = claim(
        memory("a", "10Gi"),
        memory("b", "10Gi"),
        constraints=[{"distinctAttribute": "example.com/numa"}],
    )
    allocation, report = Cluster(slices).allocate(distinct)
    assert [r["device"] for r in results(allocation)] == ["gpu-0", "gpu-1"]
    assert report["constraints"][0]["distinctAttribute"] == "example.com/numa"


def test_a_device_for_one_claim_must_have_the_capacity_asked() -> None:
    slices = [slice_([device("small"), device("big")])]
    slices[0]["spec"]["devices"][0]["capacity"]["memory"]["value"] = "40Gi"
    assert run(claim(memory("r", "60Gi")), slices) == [("r", "big")]
    allocation, _ = Cluster(slices).allocate(claim(memory("r", "60Gi")))
    assert "shareID" not in results(allocation)[0]  # not shared: no share, no consumption


def test_admin_access_consumes_nothing_and_a_whole_allocation_blocks_shares() -> None:
    cluster = Cluster([slice_([shared("gpu-0")])])
    allocation, _ = cluster.allocate(claim(exactly("all")))
    assert results(allocation)[0]["consumedCapacity"] == {"memory": "80Gi"}
    allocation, _ = cluster.allocate(claim(exactly("watch", adminAccess=True)))
    assert "shareID" not in results(allocation)[0]
    # a result without shareID (allocated before the device was shared) holds it whole
    before = {
        "metadata": {"name": "old", "namespace": "default", "uid": "u-old"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "r", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}]
                }
            }
        },
    }
    assert run(claim(memory("r", "1Gi")), [slice_([shared("gpu-0")])], [before]) is None


# -- allocation order over several pools (1.36: sorted, binding conditions last) ----------


def pool(name: str, *devices: Obj, slice_name: str | None = None) -> Obj:
    return slice_(list(devices), pool=name, name=slice_name or f"{name}-s0")


def test_pools_are_tried_by_name_whatever_order_the_slices_come_in() -> None:
    slices = [pool("pool-b", device("b0")), pool("pool-a", device("a0")), pool("pool-c")]
    assert run(claim(exactly("r")), slices) == [("r", "a0")]
    assert run(claim(exactly("r", 2)), slices) == [("r", "a0"), ("r", "b0")]


def test_slices_of_a_pool_are_tried_by_name() -> None:
    slices = [
        slice_([device("late")], name="node-1-z", count=2),
        slice_([device("early")], name="node-1-a", count=2),
    ]
    assert run(claim(exactly("r")), slices) == [("r", "early")]


def test_pools_with_binding_conditions_come_last() -> None:
    waiting = device("a-waits", bindingConditions=["Ready"], bindingFailureConditions=["Failed"])
    slices = [pool("pool-a", waiting), pool("pool-b", device("b-now"))]
    assert run(claim(exactly("r")), slices) == [("r", "b-now")]
    assert run(claim(exactly("r", 2)), slices) == [("r", "b-now"), ("r", "a-waits")]


def test_first_available_over_pools_names_the_subrequest() -> None:
    slices = [pool("pool-b", device("b0"), device("b1")), pool("pool-a", device("a0"))]
    slices[0]["spec"]["devices"][0]["attributes"]["model"] = {"string": "small"}
    doc = claim(
        {
            "name": "gpu",
            "firstAvailable": [
                {
                    "name": "two-big",
                    "deviceClassName": "plain",
                    "count": 3,
                    "selectors": [
                        {"cel": {"expression": f"device.attributes['{DRIVER}'].model == 'big'"}}
                    ],
                },
                {"name": "any-two", "deviceClassName": "plain", "count": 2},
            ],
        }
    )
    assert run(doc, slices) == [("gpu/any-two", "a0"), ("gpu/any-two", "b0")]


def test_a_multi_pool_claim_fills_pools_in_order_with_shares() -> None:
    slices = [pool("pool-b", shared("b0")), pool("pool-a", shared("a0"))]
    cluster = Cluster(slices)
    placed = []
    for _ in range(3):
        allocation, _ = cluster.allocate(claim(memory("r", "50Gi")))
        placed.append(results(allocation)[0]["device"] if allocation else None)
    assert placed == ["a0", "b0", None]


def test_two_shares_of_a_published_static_mig_device() -> None:
    """The agent's own slices with --consumable-shares memory: a MIG device holds several
    shares (its engines default to 0 each), not one share that takes everything."""
    devices = build_device_set(h100_mixed_mig_node(), shares=parse_mode("memory")).devices
    slices = build_slices(devices, node_name=NODE, driver_name="gpu.nvidia.com")
    for index, item in enumerate(slices):
        item["metadata"]["name"] = f"s{index}"
    cluster = Cluster(slices)
    mig = "device.attributes['gpu.nvidia.com'].type == 'mig'"
    placed = []
    for _ in range(2):
        allocation, _ = cluster.allocate(
            claim(memory("r", "2Gi", selectors=[{"cel": {"expression": mig}}]))
        )
        [result] = results(allocation)
        assert result["consumedCapacity"]["memory"] == "2Gi"
        assert result["consumedCapacity"]["multiprocessors"] == "0"
        placed.append(result["device"])
    assert placed[0] == placed[1]


# -- shared devices that consume counters (--dynamic-mig placements with --consumable-shares)


def shared_partitions() -> list[Obj]:
    """``partitions()`` of the allocator tests with every device shared (a memory policy),
    the whole GPU on NUMA node 2 and the halves on 0 and 1, to pick each by a selector."""
    counters, devices = partitions()
    for item, numa in zip(devices["spec"]["devices"], (2, 0, 1), strict=True):
        item["allowMultipleAllocations"] = True
        item["attributes"]["example.com/numa"] = {"int": numa}
        total = item["consumesCounters"][0]["counters"]["memory"]["value"]  # 80Gi or 40Gi
        item["capacity"]["memory"]["value"] = total
        item["capacity"]["memory"]["requestPolicy"] = {
            "default": total,
            "validRange": {"min": "1Mi", "max": total, "step": "1Mi"},
        }
    return [counters, devices]


def on_numa(numa: int, amount: str, name: str = "r") -> Obj:
    selector = f"device.attributes['example.com'].numa == {numa}"
    return memory(name, amount, selectors=[{"cel": {"expression": selector}}])


def test_a_shared_partition_consumes_its_counters_once_across_claims() -> None:
    cluster = Cluster(shared_partitions())
    for _ in range(2):  # the second share fits by capacity: the counters are taken already
        allocation, _ = cluster.allocate(claim(on_numa(0, "20Gi")))
        assert [r["device"] for r in results(allocation)] == ["gpu-0-half-0"]
    allocation, report = cluster.allocate(claim(on_numa(0, "1Gi")))  # 40Gi used: none left
    assert allocation is None and "capacity memory of gpu-0-half-0" in report["reasons"][0]
    # the overlapping whole GPU stays excluded by the counters the half's shares hold
    allocation, report = cluster.allocate(claim(on_numa(2, "1Gi")))
    assert allocation is None
    verdicts = {d["device"]: d["verdict"] for d in report["requests"][0]["devices"]}
    assert verdicts["gpu-0"] == "counters exhausted"
    # the other half is untouched, and its own shares count once too
    for _ in range(2):
        allocation, _ = cluster.allocate(claim(on_numa(1, "10Gi")))
        assert [r["device"] for r in results(allocation)] == ["gpu-0-half-1"]


def test_shares_of_one_partition_in_one_pass_consume_its_counters_once() -> None:
    cluster = Cluster(shared_partitions())
    both = claim(on_numa(0, "20Gi", "a"), on_numa(0, "20Gi", "b"), on_numa(1, "40Gi", "c"))
    allocation, _ = cluster.allocate(both)
    assert [(r["request"], r["device"]) for r in results(allocation)] == [
        ("a", "gpu-0-half-0"),
        ("b", "gpu-0-half-0"),
        ("c", "gpu-0-half-1"),
    ]
    assert len({r["shareID"] for r in results(allocation)}) == 3
    # a claim of the whole GPU next to shares of a half in one pass: the counters refuse it
    fresh = Cluster(shared_partitions())
    allocation, _ = fresh.allocate(claim(on_numa(0, "20Gi", "a"), on_numa(2, "1Gi", "b")))
    assert allocation is None


def test_a_whole_allocation_of_a_partition_still_consumes_per_claim() -> None:
    """Only shares consume once: a result without shareID holds the device (and its
    counters) whole, and a second whole claim of the same counters does not fit."""
    slices = partitions()
    assert run(claim(exactly("r")), slices, [allocated_claim("gpu-0-half-0")]) == [
        ("r", "gpu-0-half-1")
    ]
    assert run(claim(exactly("r", 2)), slices, [allocated_claim("gpu-0-half-0")]) is None
