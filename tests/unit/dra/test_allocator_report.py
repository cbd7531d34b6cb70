"""``explain``'s ``firstFit``: which device first fit takes and why that one.

kube-scheduler does not score devices, so a fitting claim's devices follow from the order the
node publishes them in; each case checks the place reported against the published slices and
the reasons counted for the devices first fit went past.
"""

from __future__ import annotations

from typing import Any

from agent.dra.allocator import allocate, build_node_state, explain, parse_claim
from agent.dra.allocator.node import NodeState
from agent.dra.partitionable import DynamicMig
from agent.sim.deviceclasses import default_device_classes
from tests.support.profile_slices import profile_slices
from tests.unit.dra.test_allocator import NUMA_ATTR, holding, seed_claim

Obj = dict[str, Any]
CLASSES = {c["metadata"]["name"]: c for c in default_device_classes()}
MIG_1G = "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"


def report(doc: Obj, state: NodeState) -> Obj:
    claim = parse_claim(doc, CLASSES)
    return explain(claim, state, allocate(claim, state))


def walk(slices: list[Obj]) -> list[tuple[str, str, int]]:
    """(device, slice, position) in the scheduler's walk of one pool: slices by name, each
    slice's devices as listed."""
    ordered = sorted(slices, key=lambda s: s["metadata"]["name"])
    return [
        (d["name"], s["metadata"]["name"], n)
        for s in ordered
        for n, d in enumerate(s["spec"].get("devices") or [], start=1)
    ]


def test_first_fit_counts_the_device_in_use_it_passes_over() -> None:
    slices = profile_slices("dgx-h100", "node-a")
    state = build_node_state("node-a", slices, [holding("gpu-0")])
    out = report(seed_claim(1, []), state)
    [entry] = out["firstFit"]
    assert (entry["request"], entry["device"], entry["pool"]) == ("gpus", "gpu-1", "node-a")
    assert entry["driver"] == "gpu.nvidia.com"
    assert (entry["order"], entry["of"], entry["before"]) == (2, 8, {"in use": 1})
    published = walk(slices)
    assert published[1] == ("gpu-1", entry["slice"], entry["inSlice"])
    assert entry["why"].endswith("first fit took it after 1 the selectors choose: 1 in use")
    assert entry["why"].startswith("gpu-1 is device 2 of 8 in the order the node publishes")


def test_first_fit_of_a_mig_device_on_a_dynamic_mig_host() -> None:
    slices = profile_slices("dgx-h100", "node-a", dynamic_mig=DynamicMig(), device_order="packing")
    state = build_node_state("node-a", slices)
    doc = seed_claim(1, [], MIG_1G, cls="mig.nvidia.com")
    [entry] = report(doc, state)["firstFit"]
    assert entry["device"] == "gpu-0-mig-1g10gb-19-6"
    assert entry["inSlice"] == 1 and entry["slice"].startswith("00001-")
    published = walk(slices)
    names = [name for name, _, _ in published]
    assert entry["order"] == names.index("gpu-0-mig-1g10gb-19-6") + 1
    assert entry["of"] == len(published) == len(state.devices)
    assert entry["before"] == {}
    assert entry["why"].endswith("the first device the request's selectors choose")


def test_a_whole_gpu_on_a_dynamic_mig_host_comes_after_every_placement() -> None:
    """The packing order publishes MIG placements before whole GPUs: first fit of a whole GPU
    goes past all of them (not selected, left out of the sentence), and past a GPU whose
    counters a MIG device of it holds."""
    slices = profile_slices("dgx-h100", dynamic_mig=DynamicMig(), device_order="packing")
    mig_devices = sum(1 for name, _, _ in walk(slices) if "-mig-" in name)
    state = build_node_state("node-a", slices, [holding("gpu-0-mig-1g10gb-19-6")])
    [entry] = report(seed_claim(1, []), state)["firstFit"]
    assert entry["device"] == "gpu-1"
    assert entry["before"] == {"not selected": mig_devices, "counters exhausted": 1}
    assert entry["order"] == mig_devices + 2
    assert "after 1 the selectors choose: 1 counters exhausted" in entry["why"]


def test_a_constraint_and_another_request_of_the_claim_are_told_apart() -> None:
    # three GPUs of socket 0 held: one is left there, so two on one NUMA node come from
    # socket 1, and the fourth GPU of socket 0 is passed over for the constraint
    held = [holding("gpu-0", "gpu-1", "gpu-2")]
    state = build_node_state("node-a", profile_slices("dgx-h100"), held)
    first, second = report(seed_claim(2, [NUMA_ATTR]), state)["firstFit"]
    assert (first["device"], second["device"]) == ("gpu-4", "gpu-5")
    assert first["before"] == {"in use": 3, "constraint": 1}
    assert second["before"] == {"in use": 3, "constraint": 1, "taken by this request": 1}
    assert "after 4 the selectors choose: 3 in use, 1 constraint" in first["why"]
    two_requests = seed_claim(1, [])
    two_requests["spec"]["devices"]["requests"].append(
        {"name": "more", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 1}}
    )
    state = build_node_state("node-a", profile_slices("dgx-h100"))
    first, second = report(two_requests, state)["firstFit"]
    assert (first["request"], first["device"], first["before"]) == ("gpus", "gpu-0", {})
    assert (second["request"], second["device"]) == ("more", "gpu-1")
    assert second["before"] == {"taken by this claim": 1}


def test_a_claim_that_does_not_fit_has_no_first_fit() -> None:
    held = [holding(*(f"gpu-{i}" for i in range(8)))]
    state = build_node_state("node-a", profile_slices("dgx-h100"), held)
    out = report(seed_claim(1, []), state)
    assert out["fits"] is False and out["firstFit"] == []


def test_devices_know_their_slice_and_keep_it_in_an_incomplete_pool() -> None:
    """Unnamed slices (a preview) go by their generateName; a pool missing a slice re-wraps
    its devices with the problem, and their place must survive that."""
    slices = profile_slices("dgx-h100")
    for item in slices:
        del item["metadata"]["name"]
        item["spec"]["pool"]["resourceSliceCount"] += 1  # one slice not published yet
    state = build_node_state("node-a", slices)
    assert all(d.pool_incomplete for d in state.devices)
    assert [(d.id.device, d.slice_name, d.slice_position) for d in state.devices] == [
        (name, place, n)
        for name, place, n in walk(
            [{**s, "metadata": {"name": s["metadata"]["generateName"]}} for s in slices]
        )
    ]
