"""Allocator conformance: cases after kube-scheduler's own structured allocator tests.

Each case builds hand-written ResourceSlices, DeviceClasses and claims (the shapes of
``staging/src/k8s.io/dynamic-resource-allocation/structured/allocator_test.go``: a driver, a
pool per node, devices with attributes, taints and counters) and checks the outcome the
scheduler reaches: which devices, in which order, under which request names, and the exact
``status.allocation``, or that nothing fits. The seed's ``matchAttribute`` styles (NUMA node,
NVLink domain, fabric clique, MIG parent) run on the simulated profiles' own slices.
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.dra.allocator import ClaimSpecError, allocate, build_node_state, parse_claim
from agent.sim.deviceclasses import default_device_classes
from tests.support.profile_slices import profile_slices

DRIVER = "driver.example.com"
NODE = "node-1"
Obj = dict[str, Any]


def device(name: str, numa: int = 0, taints: list[Obj] | None = None, **extra: Any) -> Obj:
    out: Obj = {
        "name": name,
        "attributes": {"model": {"string": "big"}, "example.com/numa": {"int": numa}},
        "capacity": {"memory": {"value": "80Gi"}},
    }
    if taints:
        out["taints"] = taints
    out.update(extra)
    return out


def slice_(
    devices: list[Obj],
    *,
    pool: str = NODE,
    node: str | None = NODE,
    count: int = 1,
    name: str = "s0",
    counters: list[Obj] | None = None,
) -> Obj:
    spec: Obj = {
        "driver": DRIVER,
        "pool": {"name": pool, "generation": 1, "resourceSliceCount": count},
    }
    spec.update({"nodeName": node} if node else {"allNodes": True})
    if devices:
        spec["devices"] = devices
    if counters:
        spec["sharedCounters"] = counters
    return {"metadata": {"name": name}, "spec": spec}


CLASSES = {
    "example": {
        "metadata": {"name": "example"},
        "spec": {
            "selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}],
            "config": [{"opaque": {"driver": DRIVER, "parameters": {"kind": "ClassConfig"}}}],
        },
    },
    "plain": {
        "metadata": {"name": "plain"},
        "spec": {"selectors": [{"cel": {"expression": "true"}}]},
    },
}


def claim(
    *requests: Obj, constraints: list[Obj] | None = None, config: list[Obj] | None = None
) -> Obj:
    devices: Obj = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = constraints
    if config:
        devices["config"] = config
    return {
        "kind": "ResourceClaim",
        "metadata": {"name": "claim-0", "namespace": "default"},
        "spec": {"devices": devices},
    }


def exactly(name: str, count: int = 1, cls: str = "plain", **extra: Any) -> Obj:
    body: Obj = {"deviceClassName": cls, "allocationMode": "ExactCount", "count": count, **extra}
    return {"name": name, "exactly": body}


def allocated_claim(*devices: str, admin: bool = False) -> Obj:
    results = [{"request": "r", "driver": DRIVER, "pool": NODE, "device": d} for d in devices]
    if admin:
        for result in results:
            result["adminAccess"] = True
    return {
        "metadata": {"name": "other", "namespace": "default", "uid": "u-other"},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def run(
    claim_doc: Obj, slices: list[Obj], claims: list[Obj] | None = None
) -> list[tuple[str, str]] | None:
    outcome = allocate(
        parse_claim(claim_doc, CLASSES), build_node_state(NODE, slices, claims or [])
    )
    if not outcome.fits:
        assert outcome.reasons
        return None
    assert outcome.allocation is not None
    return [(r["request"], r["device"]) for r in outcome.allocation["devices"]["results"]]


def test_simple_allocation_has_the_schedulers_exact_shape() -> None:
    doc = claim(
        exactly("req-0", cls="example"),
        config=[
            {"requests": ["req-0"], "opaque": {"driver": DRIVER, "parameters": {"a": 1}}},
            {"opaque": {"driver": DRIVER, "parameters": {"b": 2}}},
        ],
    )
    outcome = allocate(
        parse_claim(doc, CLASSES),
        build_node_state(NODE, [slice_([device("dev-1"), device("dev-2")])]),
    )
    assert outcome.allocation == {
        "devices": {
            "results": [{"request": "req-0", "driver": DRIVER, "pool": NODE, "device": "dev-1"}],
            "config": [
                {
                    "source": "FromClass",
                    "requests": ["req-0"],
                    "opaque": {"driver": DRIVER, "parameters": {"kind": "ClassConfig"}},
                },
                {
                    "source": "FromClaim",
                    "requests": ["req-0"],
                    "opaque": {"driver": DRIVER, "parameters": {"a": 1}},
                },
                {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {"b": 2}}},
            ],
        },
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
            ]
        },
    }


def test_network_attached_devices_get_no_node_selector() -> None:
    outcome = allocate(
        parse_claim(claim(exactly("r")), CLASSES),
        build_node_state(NODE, [slice_([device("d")], pool="net", node=None)]),
    )
    assert outcome.allocation is not None and "nodeSelector" not in outcome.allocation


def test_exact_count_takes_devices_in_order_and_fails_when_too_few() -> None:
    slices = [slice_([device(f"dev-{i}") for i in range(3)])]
    assert run(claim(exactly("r", 2)), slices) == [("r", "dev-0"), ("r", "dev-1")]
    assert run(claim(exactly("r", 4)), slices) is None
    assert run(claim(exactly("a", 2), exactly("b", 1)), slices) == [
        ("a", "dev-0"),
        ("a", "dev-1"),
        ("b", "dev-2"),
    ]
    assert run(claim(exactly("a", 2), exactly("b", 2)), slices) is None


def test_devices_of_other_claims_are_skipped_unless_admin_access() -> None:
    slices = [slice_([device("dev-0"), device("dev-1")])]
    assert run(claim(exactly("r")), slices, [allocated_claim("dev-0")]) == [("r", "dev-1")]
    assert run(claim(exactly("r", 2)), slices, [allocated_claim("dev-0")]) is None
    # an admin-access claim does not hold its devices ...
    assert run(claim(exactly("r", 2)), slices, [allocated_claim("dev-0", admin=True)]) is not None
    # ... and an admin-access request may use allocated devices; the result says so
    doc = claim(exactly("r", 2, adminAccess=True))
    outcome = allocate(
        parse_claim(doc, CLASSES),
        build_node_state(NODE, slices, [allocated_claim("dev-0", "dev-1")]),
    )
    assert outcome.allocation is not None
    assert [r.get("adminAccess") for r in outcome.allocation["devices"]["results"]] == [True, True]


def test_allocation_mode_all() -> None:
    slices = [slice_([device("dev-0"), device("dev-1"), device("other", model="x")])]
    slices[0]["spec"]["devices"][2]["attributes"]["model"] = {"string": "small"}
    all_big = {
        "name": "r",
        "exactly": {
            "deviceClassName": "plain",
            "allocationMode": "All",
            "selectors": [{"cel": {"expression": f"device.attributes['{DRIVER}'].model == 'big'"}}],
        },
    }
    assert run(claim(all_big), slices) == [("r", "dev-0"), ("r", "dev-1")]
    assert run(claim(all_big), slices, [allocated_claim("dev-1")]) is None  # one is in use
    incomplete = [slice_([device("dev-0")], count=2)]
    assert run(claim(all_big), incomplete) is None  # the pool is being updated
    assert run(claim(exactly("r")), incomplete) == [("r", "dev-0")]
    none = {
        "name": "r",
        "exactly": {
            "deviceClassName": "plain",
            "allocationMode": "All",
            "selectors": [{"cel": {"expression": "false"}}],
        },
    }
    assert run(claim(none), slices) is None


def test_first_available_falls_back_to_the_next_subrequest() -> None:
    slices = [slice_([device("dev-0"), device("dev-1")])]
    request = {
        "name": "r",
        "firstAvailable": [
            {"name": "four", "deviceClassName": "plain", "count": 4},
            {"name": "two", "deviceClassName": "example", "count": 2},
        ],
    }
    outcome = allocate(parse_claim(claim(request), CLASSES), build_node_state(NODE, slices))
    assert outcome.allocation is not None
    assert [r["request"] for r in outcome.allocation["devices"]["results"]] == ["r/two", "r/two"]
    assert outcome.allocation["devices"]["config"][0]["requests"] == ["r/two"]
    # a later request can force an earlier one onto its second choice (backtracking)
    first = {
        "name": "a",
        "firstAvailable": [
            {"name": "big", "deviceClassName": "plain", "count": 2},
            {"name": "small", "deviceClassName": "plain", "count": 1},
        ],
    }
    assert run(claim(first, exactly("b")), slices) == [("a/small", "dev-0"), ("b", "dev-1")]


def test_match_attribute_across_numa_nodes() -> None:
    slices = [
        slice_(
            [
                device("dev-0", 0),
                device("dev-1", 1),
                device("dev-2", 0),
                device("dev-3", 1),
                device("dev-4", 1),
            ]
        )
    ]
    numa = [{"matchAttribute": "example.com/numa"}]
    assert run(claim(exactly("r", 3), constraints=numa), slices) == [
        ("r", "dev-1"),
        ("r", "dev-3"),
        ("r", "dev-4"),
    ]
    assert run(claim(exactly("r", 4), constraints=numa), slices) is None
    # the constraint spans requests it names
    across = [{"requests": ["a", "b"], "matchAttribute": "example.com/numa"}]
    got = run(claim(exactly("a", 2), exactly("b", 1), constraints=across), slices)
    assert got == [("a", "dev-1"), ("a", "dev-3"), ("b", "dev-4")]
    # a device without the attribute satisfies no constraint
    missing = [{"matchAttribute": "example.com/nothing"}]
    assert run(claim(exactly("r"), constraints=missing), slices) is None
    with pytest.raises(ClaimSpecError):
        parse_claim(claim(exactly("r"), constraints=[{"matchAttribute": "numa"}]), CLASSES)


def test_taints_block_unless_tolerated() -> None:
    taint = {"key": "example.com/broken", "value": "yes", "effect": "NoSchedule"}
    slices = [slice_([device("dev-0", taints=[taint]), device("dev-1")])]
    assert run(claim(exactly("r")), slices) == [("r", "dev-1")]
    assert run(claim(exactly("r", 2)), slices) is None
    for toleration in (
        {"key": "example.com/broken", "operator": "Exists"},
        {"key": "example.com/broken", "operator": "Equal", "value": "yes", "effect": "NoSchedule"},
        {"operator": "Exists"},
    ):
        assert run(claim(exactly("r", 2, tolerations=[toleration])), slices) == [
            ("r", "dev-0"),
            ("r", "dev-1"),
        ]
    for toleration in (
        {"key": "example.com/broken", "operator": "Equal", "value": "no"},
        {"key": "example.com/broken", "operator": "Exists", "effect": "NoExecute"},
        {"key": "example.com/other", "operator": "Exists"},
    ):
        assert run(claim(exactly("r", 2, tolerations=[toleration])), slices) is None
    no_execute = [slice_([device("dev-0", taints=[{**taint, "effect": "NoExecute"}])])]
    assert run(claim(exactly("r")), no_execute) is None
    harmless = [slice_([device("dev-0", taints=[{**taint, "effect": "None"}])])]
    assert run(claim(exactly("r")), harmless) == [("r", "dev-0")]
    outcome = allocate(
        parse_claim(claim(exactly("r", tolerations=[{"operator": "Exists"}])), CLASSES),
        build_node_state(NODE, slices),
    )
    assert outcome.allocation is not None
    assert outcome.allocation["devices"]["results"][0]["tolerations"] == [{"operator": "Exists"}]


def partitions() -> list[Obj]:
    """A GPU and its halves sharing one counter set, the counters in a slice of their own (1.35)."""
    counters = [
        {
            "name": "gpu-0-counters",
            "counters": {
                "memory": {"value": "80Gi"},
                "slice-0": {"value": "1"},
                "slice-1": {"value": "1"},
            },
        }
    ]

    def consumes(memory: str, *slices: int) -> list[Obj]:
        used = {"memory": {"value": memory}, **{f"slice-{s}": {"value": "1"} for s in slices}}
        return [{"counterSet": "gpu-0-counters", "counters": used}]

    devices = [
        device("gpu-0", consumesCounters=consumes("80Gi", 0, 1)),
        device("gpu-0-half-0", consumesCounters=consumes("40Gi", 0)),
        device("gpu-0-half-1", consumesCounters=consumes("40Gi", 1)),
    ]
    return [
        slice_([], name="counters", count=2, counters=counters),
        slice_(devices, name="devices", count=2),
    ]


def test_shared_counters_are_not_overdrawn() -> None:
    slices = partitions()
    assert run(claim(exactly("r")), slices) == [("r", "gpu-0")]
    assert run(claim(exactly("r", 2)), slices) == [("r", "gpu-0-half-0"), ("r", "gpu-0-half-1")]
    assert run(claim(exactly("r", 3)), slices) is None
    # the whole GPU is taken by another claim: its counters are exhausted for the halves
    assert run(claim(exactly("r")), slices, [allocated_claim("gpu-0")]) is None
    # one half is taken: the other half still fits, the whole GPU does not
    assert run(claim(exactly("r")), slices, [allocated_claim("gpu-0-half-0")]) == [
        ("r", "gpu-0-half-1")
    ]
    assert run(claim(exactly("r", 2)), slices, [allocated_claim("gpu-0-half-0")]) is None
    # a counter set that no slice of the pool defines makes the device unusable
    broken = partitions()[1:]
    assert run(claim(exactly("r")), broken) is None


def test_missing_class_and_bad_claims() -> None:
    slices = [slice_([device("dev-0")])]
    outcome = allocate(
        parse_claim(claim(exactly("r", cls="nope")), CLASSES), build_node_state(NODE, slices)
    )
    assert not outcome.fits and "DeviceClass nope does not exist" in outcome.reasons[0]
    for bad in (
        claim(exactly("r", 0)),
        claim({"name": "r"}),
        claim(exactly("r", selectors=[{"cel": {"expression": "device.driver =="}}])),
        claim(exactly("r"), exactly("r")),
    ):
        with pytest.raises(ClaimSpecError):
            parse_claim(bad, CLASSES)


def test_a_selector_failing_on_a_device_fails_the_allocation() -> None:
    slices = [slice_([device("dev-0")])]
    doc = claim(
        exactly(
            "r", selectors=[{"cel": {"expression": f"device.attributes['{DRIVER}'].nothing == 1"}}]
        )
    )
    outcome = allocate(parse_claim(doc, CLASSES), build_node_state(NODE, slices))
    assert not outcome.fits and "no such key: nothing" in outcome.reasons[0]


def seed_claim(count: int, match: list[str], *selectors: str, cls: str = "gpu.nvidia.com") -> Obj:
    """The seed's claim style: a count of devices of a shipped class, CEL selectors,
    ``matchAttribute`` constraints."""
    request = exactly("gpus", count, cls=cls)
    if selectors:
        request["exactly"]["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    return claim(request, constraints=[{"matchAttribute": m} for m in match] or None)


def on_profile(
    profile: str, doc: Obj, others: list[Obj] | None = None
) -> tuple[list[str] | None, list[str]]:
    """(devices the allocator picks or None, its reasons) on the profile's own slices."""
    classes = {c["metadata"]["name"]: c for c in default_device_classes()}
    state = build_node_state("node-a", profile_slices(profile, "node-a"), others or [])
    outcome = allocate(parse_claim(doc, classes), state)
    if outcome.allocation is None:
        return None, list(outcome.reasons)
    return [r["device"] for r in outcome.allocation["devices"]["results"]], []


def holding(*devices: str) -> Obj:
    results = [
        {"request": "r", "driver": "gpu.nvidia.com", "pool": "node-a", "device": d} for d in devices
    ]
    return {
        "metadata": {"name": "holder", "namespace": "default", "uid": "u-holder"},
        "status": {"allocation": {"devices": {"results": results}}},
    }


NUMA_ATTR, NVLINK = "resource.kubernetes.io/numaNode", "gpu.nvidia.com/nvlinkDomain"
CLIQUE = "gpu.nvidia.com/fabricClique"
H100 = "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H100 80GB HBM3'"


def test_seed_style_match_attribute_on_the_seed_profiles() -> None:
    # dgx-h100: two sockets of four GPUs, one NVLink domain
    assert on_profile("dgx-h100", seed_claim(4, [NUMA_ATTR, NVLINK], H100))[0] == [
        f"gpu-{i}" for i in range(4)
    ]
    taken = on_profile("dgx-h100", seed_claim(4, [NUMA_ATTR], H100), [holding("gpu-0")])
    assert taken[0] == ["gpu-4", "gpu-5", "gpu-6", "gpu-7"]  # socket 0 has 3 left
    picked, reasons = on_profile("dgx-h100", seed_claim(5, [NUMA_ATTR]))
    assert picked is None and "at most 4 of them share" in " ".join(reasons)
    assert on_profile("dgx-h100", seed_claim(8, [NVLINK]))[0] == [f"gpu-{i}" for i in range(8)]
    # h200-nvl-bridged: NVLink bridges pair GPUs 0-1 and 2-3
    assert on_profile("h200-nvl-bridged", seed_claim(2, [NVLINK]))[0] == ["gpu-0", "gpu-1"]
    bridged = on_profile("h200-nvl-bridged", seed_claim(2, [NVLINK]), [holding("gpu-1")])
    assert bridged[0] == ["gpu-2", "gpu-3"]
    assert on_profile("h200-nvl-bridged", seed_claim(3, [NVLINK]))[0] is None
    # gb200-nvl72-tray: the tray's four GPUs share one fabric clique
    assert on_profile("gb200-nvl72-tray", seed_claim(4, [CLIQUE, NVLINK]))[0] == [
        f"gpu-{i}" for i in range(4)
    ]
    assert on_profile("gb200-nvl72-tray", seed_claim(3, [NUMA_ATTR]))[0] is None  # 2 per socket
    # dgx-a100 (MIG): seven 1g.10gb of one parent GPU, not eight
    one_g = "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"
    parent = "gpu.nvidia.com/parentUUID"
    seven, _ = on_profile("dgx-a100", seed_claim(7, [parent], one_g, cls="mig.nvidia.com"))
    assert seven == [f"gpu-0-mig-1g10gb-19-{i}" for i in range(7)]
    eight, _ = on_profile("dgx-a100", seed_claim(8, [parent], one_g, cls="mig.nvidia.com"))
    assert eight is None
