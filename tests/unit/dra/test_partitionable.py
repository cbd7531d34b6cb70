"""Dynamic MIG publishing (``--dynamic-mig``): KEP-4815 counters that allow exactly what NVML
allows, checked against the simulated NVML beneath the real pynvml and against the allocator.

The NVML side enumerates, per GPU model, every set of GPU instances NVML accepts together: a
depth-first walk that creates each placement in turn (``hardware.mig_ops``) and destroys it on
the way back. The counter side enumerates every set of published MIG devices whose summed
consumption fits the published counters, as the scheduler's allocator reads them from the
slices (``allocator.build_node_state``). The two families must be equal; the allocator itself
must then allocate every maximal geometry and refuse every pair NVML refuses.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from fractions import Fraction
from typing import Any

import pynvml
import pytest

from agent.dra import build_device_set, build_slices
from agent.dra.allocator import allocate, build_node_state, parse_claim
from agent.dra.allocator.node import NodeDevice, NodeState
from agent.dra.errors import DraModelError, InvalidNameError, LimitExceededError
from agent.dra.model import CounterConsumption, CounterSet, DraDevice
from agent.dra.partitionable import (
    DynamicMig,
    counter_set_name,
    is_partitionable,
    partition,
)
from agent.dra.slices import pool_layout, slice_differences
from agent.hardware import mig_ops
from agent.hardware.errors import NvmlCallFailed
from agent.hardware.inventory import Gpu, MigDevice
from agent.hardware.simulated.install import install, uninstall
from agent.hardware.simulated.library import SimulatedNvmlLibrary
from agent.hardware.simulated.profile import load_profile
from agent.kube.sliceplan import plan_pool
from tests.support import k8s_schema
from tests.support.profile_slices import DRIVER, profile_inventory, profile_slices

NODE = "node-a"
DYNAMIC = DynamicMig()
ADOPT = DynamicMig(adopt=True)
Obj = dict[str, Any]
Geometry = frozenset[tuple[int, int]]  # (GI profile id, placement start)


def gpu_state(slices: list[Obj], minor: int) -> NodeState:
    """The allocator's view of the pool, keeping only GPU ``minor``'s devices."""
    state = build_node_state(NODE, slices)
    prefix = f"gpu-{minor}"
    state.devices = [
        d for d in state.devices if d.id.device == prefix or d.id.device.startswith(prefix + "-")
    ]
    return state


def geometry_of(device: NodeDevice) -> tuple[int, int]:
    """(GI profile id, placement start) from a MIG device name."""
    *_, profile_id, start = device.id.device.rsplit("-", 2)
    return int(profile_id), int(start)


def fits(state: NodeState, devices: list[NodeDevice]) -> bool:
    used: dict[tuple[str, str, str, str], Fraction] = {}
    for device in devices:
        for counter_set, counter, amount in device.consumes:
            key = (device.id.driver, device.id.pool, counter_set, counter)
            used[key] = used.get(key, Fraction(0)) + amount
    return all(amount <= state.counters[key] for key, amount in used.items())


def counter_geometries(state: NodeState) -> set[Geometry]:
    """Every set of MIG devices whose consumption fits the counters (the scheduler's rule)."""
    migs = [d for d in state.devices if "-mig-" in d.id.device]
    found: set[Geometry] = set()

    def walk(start: int, chosen: list[NodeDevice]) -> None:
        found.add(frozenset(geometry_of(d) for d in chosen))
        for index in range(start, len(migs)):
            if fits(state, [*chosen, migs[index]]):
                walk(index + 1, [*chosen, migs[index]])

    walk(0, [])
    return found


@pytest.fixture
def nvml_gpu() -> Iterator[Any]:
    """Install a profile's simulated NVML beneath pynvml (its MIG rules, no files)."""
    libraries: list[SimulatedNvmlLibrary] = []

    def start(profile: str) -> SimulatedNvmlLibrary:
        library = SimulatedNvmlLibrary(load_profile(profile))
        install(library)
        pynvml.nvmlInit()
        libraries.append(library)
        return library

    yield start
    for library in libraries:
        uninstall(library)


def nvml_geometries(gpu: Gpu, held: Geometry = frozenset()) -> set[Geometry]:
    """Every set of GPU instances NVML creates together on ``gpu`` (beside ``held``, which
    exist already), found by creating and destroying them through pynvml."""
    parent = gpu.uuid
    slots = [(p.profile_id, pl.start, pl.size) for p in gpu.mig_profiles for pl in p.placements]
    slots = [s for s in slots if (s[0], s[1]) not in held]
    found: set[Geometry] = set()

    def walk(start: int, chosen: list[tuple[int, int]]) -> None:
        found.add(frozenset(chosen))
        for index in range(start, len(slots)):
            profile_id, first, size = slots[index]
            try:
                gi = mig_ops.create_gpu_instance(parent, profile_id, first, size)
            except NvmlCallFailed as error:
                assert error.code == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
                continue
            walk(index + 1, [*chosen, (profile_id, first)])
            assert mig_ops.destroy_gpu_instance(parent, gi)

    walk(0, [])
    return found


def maximal(family: set[Geometry]) -> list[Geometry]:
    return [g for g in family if not any(g < other for other in family)]


# -- the counter model -------------------------------------------------------------------------


def test_h100_counter_set_and_consumption() -> None:
    gpu = profile_inventory("dgx-h100").gpus[3]
    split = partition(gpu)
    assert split is not None and split.full_gpu and not split.static
    assert split.counters.name == counter_set_name(3) == "gpu-3-counter-set"
    assert dict(split.counters.counters) == {
        "multiprocessors": 132,
        "copy-engines": 8,
        "decoders": 7,
        "encoders": 0,
        "jpeg-engines": 7,
        "ofa-engines": 1,
        "memory": 80896 * 2**20,
        **{f"memory-slice-{i}": 1 for i in range(8)},
    }
    devices = {
        d.name: d
        for d in build_device_set(profile_inventory("dgx-h100"), dynamic_mig=DYNAMIC).devices
    }
    full = devices["gpu-3"]
    (everything,) = full.consumes_counters
    assert everything.counter_set == "gpu-3-counter-set"
    assert dict(everything.counters) == {k: v for k, v in split.counters.counters.items() if v}
    three = devices["gpu-3-mig-3g40gb-9-4"]
    assert [entry.to_dict() for entry in three.consumes_counters] == [
        {
            "counterSet": "gpu-3-counter-set",
            "counters": {
                "multiprocessors": {"value": "60"},
                "copy-engines": {"value": "3"},
                "decoders": {"value": "3"},
                "jpeg-engines": {"value": "3"},
                "memory": {"value": "40448Mi"},
                **{f"memory-slice-{i}": {"value": "1"} for i in range(4, 8)},
            },
        }
    ]
    # the +me placement is the only one (besides 7g) that takes the single OFA engine
    me = devices["gpu-3-mig-1g10gb-me-20-6"].consumes_counters[0].counters
    assert me["ofa-engines"] == 1 and me["memory-slice-6"] == 1 and "memory-slice-7" not in me


def test_slot_devices_carry_the_static_mig_attributes_but_uuid() -> None:
    inventory = profile_inventory("dgx-a100")
    static = {d.name: d for d in build_device_set(inventory).devices}
    dynamic = {d.name: d for d in build_device_set(inventory, dynamic_mig=ADOPT).devices}
    name = "gpu-4-mig-3g40gb-9-0"  # a static instance on the discovered host
    assert set(static[name].attributes) - set(dynamic[name].attributes) == {"uuid"}
    assert {k: v for k, v in static[name].attributes.items() if k != "uuid"} == dict(
        dynamic[name].attributes
    )
    assert static[name].capacity == dynamic[name].capacity
    assert not static[name].consumes_counters and dynamic[name].consumes_counters


def test_h100_publishes_the_full_gpu_and_every_placement() -> None:
    inventory = profile_inventory("dgx-h100")
    device_set = build_device_set(inventory, dynamic_mig=DYNAMIC)
    names = {d.name for d in device_set.devices}
    per_gpu = 1 + sum(len(p.placements) for p in inventory.gpus[0].mig_profiles)
    assert per_gpu == 26 and len(names) == 8 * per_gpu
    assert {f"gpu-{i}" for i in range(8)} <= names
    assert "gpu-7-mig-7g80gb-0-0" in names and "gpu-0-mig-1g20gb-15-6" in names
    assert [s.name for s in device_set.counter_sets] == [f"gpu-{i}-counter-set" for i in range(8)]
    assert all(d.consumes_counters for d in device_set.devices)
    # without the flag: as before, no counters
    assert not build_device_set(inventory).counter_sets


def test_a100_with_mig_on_publishes_placements_only() -> None:
    """dgx-a100 has MIG on, with static layouts: no full GPU either way; without
    --adopt-mig-instances the static instances keep their slices (their placements only,
    uuid and all, no counters); adopted, every placement is offered with counters."""
    inventory = profile_inventory("dgx-a100")
    kept = build_device_set(inventory, dynamic_mig=DYNAMIC)
    assert {d.name for d in kept.devices} == {d.name for d in build_device_set(inventory).devices}
    assert all("uuid" in d.attributes and not d.consumes_counters for d in kept.devices)
    assert not kept.counter_sets  # nothing left to carve on these full layouts
    assert "gpu-0-mig-2g20gb-14-0: overlaps static MIG instance gpu-0-mig-1g10gb-19-0" in (
        kept.held_back
    )
    adopted = build_device_set(inventory, dynamic_mig=ADOPT)
    names = {d.name for d in adopted.devices}
    assert not any(name.startswith("gpu-") and name.count("-") == 1 for name in names)
    assert len(names) == 8 * 25 and len(adopted.counter_sets) == 8
    assert all(d.consumes_counters and "uuid" not in d.attributes for d in adopted.devices)


def test_non_mig_gpus_are_published_as_before() -> None:
    inventory = profile_inventory("l40s-pcie")
    assert not any(is_partitionable(g) for g in inventory.gpus)
    assert build_device_set(inventory, dynamic_mig=DYNAMIC) == build_device_set(inventory)


def test_owned_instances_do_not_hold_anything_back() -> None:
    """An instance the agent created (its checkpoint names the slot) is a slot like any
    other: the full GPU stays published and nothing is held back."""
    inventory = profile_inventory("dgx-a100")
    gpu = inventory.gpus[4]  # 3g.40gb@0, 2g.20gb@4, 1g.10gb@6
    names = {f"gpu-4-mig-{p}" for p in ("3g40gb-9-0", "2g20gb-14-4", "1g10gb-19-6")}
    split = partition(gpu, owned=names)
    assert split is not None and not split.static and not split.held_back
    assert len(split.slots) == 25
    part = partition(gpu, owned=names - {"gpu-4-mig-1g10gb-19-6"})
    assert part is not None and set(part.static) == {"gpu-4-mig-1g10gb-19-6"}
    assert part.counters.counters["memory-slice-6"] == 0


# -- counters == NVML ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "dynamic"),
    [
        ("dgx-h100", DYNAMIC),
        ("h200-nvl-bridged", DYNAMIC),
        ("gb200-nvl72-tray", DYNAMIC),
        ("dgx-a100", ADOPT),
    ],
)
def test_counters_allow_exactly_what_nvml_allows(
    profile: str, dynamic: DynamicMig, nvml_gpu: Any
) -> None:
    inventory = profile_inventory(profile)  # discovery first: it installs its own library
    slices = profile_slices(profile, dynamic_mig=dynamic)
    library = nvml_gpu(profile)
    gpu = inventory.gpus[0]
    if gpu.mig_enabled:  # start from an empty GPU: the static layout is adopted
        state = library.state
        state.clear_instances(state.gpus[0])
    else:
        mig_ops.set_mig_mode(gpu.uuid, True)
    state = gpu_state(slices, gpu.minor)
    nvml = nvml_geometries(gpu)
    counters = counter_geometries(state)
    assert len(nvml) > 1000  # the walk really explored the GPU
    assert counters == nvml, (
        f"counters allow {sorted(map(sorted, counters - nvml))[:5]}, "
        f"NVML allows {sorted(map(sorted, nvml - counters))[:5]}"
    )
    # the full GPU (MIG mode off, NVML can hold no instance) excludes every MIG device
    full = [d for d in state.devices if d.id.device == f"gpu-{gpu.minor}"]
    migs = [d for d in state.devices if "-mig-" in d.id.device]
    if gpu.mig_enabled:
        assert not full  # Ampere: MIG mode needs a reset to change; placements only
    else:
        assert len(full) == 1 and fits(state, full)
        assert not any(fits(state, [*full, mig]) for mig in migs)


def test_static_instances_hold_their_slices_exactly(nvml_gpu: Any) -> None:
    """A static 1g.10gb+me at 0 and a 2g.20gb at 4 on an H100: the counters left allow exactly
    the sets NVML still accepts beside them (no other +me, nothing over slices 0, 4, 5)."""
    inventory = profile_inventory("dgx-h100")
    nvml_gpu("dgx-h100")
    gpu = inventory.gpus[0]
    mig_ops.set_mig_mode(gpu.uuid, True)
    held = frozenset({(20, 0), (14, 4)})
    created = {key: mig_ops.create_gpu_instance(gpu.uuid, key[0], key[1], 1 if key[0] == 20 else 2)
               for key in sorted(held)}  # fmt: skip
    profiles = {p.profile_id: p for p in gpu.mig_profiles}
    live_gpu = replace(
        gpu,
        mig_enabled=True,
        mig_devices=tuple(
            MigDevice(
                f"MIG-{gi}",
                gpu.uuid,
                gi,
                0,
                profiles[key[0]],
                next(p for p in profiles[key[0]].placements if p.start == key[1]),
            )
            for key, gi in created.items()
        ),
    )
    live = replace(inventory, gpus=(live_gpu, *inventory.gpus[1:]))
    device_set = build_device_set(live, dynamic_mig=DYNAMIC)
    slices = build_slices(
        device_set.devices, node_name=NODE, driver_name=DRIVER, counter_sets=device_set.counter_sets
    )
    state = gpu_state(slices, 0)
    names = {d.id.device for d in state.devices}
    assert "gpu-0" not in names  # MIG mode cannot go off under a static instance
    assert {"gpu-0-mig-1g10gb-me-20-0", "gpu-0-mig-2g20gb-14-4"} <= names
    assert "gpu-0-mig-1g10gb-me-20-1" not in names  # the OFA engine is held
    assert "gpu-0-mig-3g40gb-9-4" not in names  # overlaps the 2g.20gb
    static = [d for d in state.devices if not d.consumes]
    assert sorted(d.id.device for d in static) == sorted(
        ["gpu-0-mig-1g10gb-me-20-0", "gpu-0-mig-2g20gb-14-4"]
    )
    state.devices = [d for d in state.devices if d.consumes]
    assert counter_geometries(state) == nvml_geometries(live_gpu, held)


# -- the allocator -----------------------------------------------------------------------------


CLASSES = {
    "mig.nvidia.com": {
        "metadata": {"name": "mig.nvidia.com"},
        "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]},
    }
}


def claim_for(devices: list[NodeDevice]) -> Any:
    """A claim asking for exactly these devices, one request each, by profile and slice."""
    requests = []
    for index, device in enumerate(devices):
        attrs = device.spec["attributes"]
        if "profile" in attrs:
            profile = attrs["profile"]["string"]
            start = geometry_of(device)[1]
            expression = (
                f'device.attributes["{DRIVER}"].profile == "{profile}" && '
                f'"memorySlice{start}" in device.capacity["{DRIVER}"]'
            )
        else:
            expression = f'device.attributes["{DRIVER}"].type == "gpu"'
        requests.append(
            {
                "name": f"r{index}",
                "exactly": {
                    "deviceClassName": "mig.nvidia.com",
                    "selectors": [{"cel": {"expression": expression}}],
                },
            }
        )
    claim = {
        "metadata": {"name": "c", "namespace": "default"},
        "spec": {"devices": {"requests": requests}},
    }
    return parse_claim(claim, CLASSES)


@pytest.mark.slow
def test_allocator_allocates_every_maximal_geometry_and_refuses_what_nvml_refuses() -> None:
    slices = profile_slices("dgx-h100", dynamic_mig=DYNAMIC)
    state = gpu_state(slices, 2)
    by_geometry = {geometry_of(d): d for d in state.devices if "-mig-" in d.id.device}
    family = counter_geometries(state)
    # one maximal geometry per shape (its multiset of profiles), every shape covered
    shapes: dict[tuple[int, ...], Geometry] = {}
    for geometry in sorted(maximal(family), key=sorted):
        shapes.setdefault(tuple(sorted(profile for profile, _ in geometry)), geometry)
    assert len(shapes) > 20
    for geometry in shapes.values():
        wanted = [by_geometry[g] for g in sorted(geometry)]
        outcome = allocate(claim_for(wanted), state)
        assert outcome.fits, (sorted(geometry), outcome.reasons)
        assert {a.device.id.device for a in outcome.devices} == {d.id.device for d in wanted}
    refused = [
        (a, b) for a in sorted(by_geometry) for b in sorted(by_geometry) if a < b
        and frozenset({a, b}) not in family
    ]  # fmt: skip
    assert refused
    for pair in refused:
        assert not allocate(claim_for([by_geometry[g] for g in pair]), state).fits, pair
    full = next(d for d in state.devices if d.id.device == "gpu-2")
    assert allocate(claim_for([full]), state).fits
    assert not allocate(claim_for([full, by_geometry[(19, 6)]]), state).fits


# -- slices ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "dynamic", "slice_layout", "version"),
    [
        ("dgx-h100", DYNAMIC, "combined", "1.34"),
        ("dgx-h100", DYNAMIC, "split", "1.35"),
        ("dgx-h100", DYNAMIC, "split", "1.36"),
        ("dgx-a100", DYNAMIC, "combined", "1.34"),
        ("dgx-a100", ADOPT, "split", "1.35"),
        ("big-mig-host", ADOPT, "split", "1.35"),
        ("big-mig-host", ADOPT, "combined", "1.34"),
        ("gb200-nvl72-tray", DYNAMIC, "split", "1.36"),
    ],
)
def test_dynamic_slices_are_valid(
    profile: str, dynamic: DynamicMig, slice_layout: Any, version: str
) -> None:
    slices = profile_slices(profile, dynamic_mig=dynamic, slice_layout=slice_layout)
    for item in slices:
        k8s_schema.validate(item, version)
    assert k8s_schema.pool_rule_errors(slices, version) == []
    assert {item["spec"]["pool"]["resourceSliceCount"] for item in slices} == {len(slices)}
    # and the other layout is refused by that version's rules, so the check can fail
    other = "split" if slice_layout == "combined" else "combined"
    wrong = profile_slices(profile, dynamic_mig=dynamic, slice_layout=other)
    if any(item["spec"].get("sharedCounters") for item in wrong):
        assert k8s_schema.pool_rule_errors(wrong, version)


def test_combined_layout_is_one_slice_per_gpu() -> None:
    slices = profile_slices("dgx-h100", dynamic_mig=DYNAMIC, slice_layout="combined")
    assert len(slices) == 8
    for minor, item in enumerate(slices):
        spec = item["spec"]
        assert [s["name"] for s in spec["sharedCounters"]] == [f"gpu-{minor}-counter-set"]
        assert len(spec["devices"]) == 26
        assert {d["consumesCounters"][0]["counterSet"] for d in spec["devices"]} == {
            f"gpu-{minor}-counter-set"
        }


def test_split_layout_counters_first_at_most_eight_sets_per_slice() -> None:
    slices = profile_slices(
        "big-mig-host", dynamic_mig=ADOPT, slice_layout="split", device_order="names"
    )
    counters_only = [s for s in slices if s["spec"].get("sharedCounters")]
    assert [len(s["spec"]["sharedCounters"]) for s in counters_only] == [8, 8, 8]
    assert all("devices" not in s["spec"] for s in counters_only)
    assert slices[:3] == counters_only
    device_slices = slices[3:]
    assert len(device_slices) == 24  # names: one per GPU, as the incumbent lays them out
    for item in device_slices:
        sets = {d["consumesCounters"][0]["counterSet"] for d in item["spec"]["devices"]}
        assert len(sets) == 1


def test_split_layout_in_the_packing_order() -> None:
    """Counters first; then the MIG placements, consecutive GPUs sharing a slice up to 64
    devices and no GPU's run cut; the whole GPUs last."""
    slices = profile_slices(
        "dgx-h100", dynamic_mig=ADOPT, slice_layout="split", device_order="packing"
    )
    assert slices[0]["spec"].get("sharedCounters") and "devices" not in slices[0]["spec"]
    device_lists = [[d["name"] for d in s["spec"]["devices"]] for s in slices[1:]]
    assert device_lists[-1] == [f"gpu-{minor}" for minor in range(8)]
    mig_runs = device_lists[:-1]
    assert all(len(run) <= 64 for run in mig_runs)
    parents = [[int(name.split("-")[1]) for name in run] for run in mig_runs]
    assert [p for run in parents for p in run] == sorted(p for run in parents for p in run)
    assert len(mig_runs) < 8  # fewer slices than GPUs: more of the order within a slice
    first_gpu = [name for name in mig_runs[0] if name.startswith("gpu-0-")]
    assert first_gpu[:3] == [
        "gpu-0-mig-1g10gb-19-6",
        "gpu-0-mig-1g10gb-19-5",
        "gpu-0-mig-1g10gb-19-4",
    ]
    assert first_gpu[-1] == "gpu-0-mig-7g80gb-0-0"
    names = [s["metadata"]["name"] for s in slices]
    assert names == sorted(names)  # 1.36 sorts slices by name: the index prefix keeps this order


def test_combined_layout_limits_are_enforced() -> None:
    counters = CounterSet("gpu-0-counter-set", {"n": 100})
    many = [
        DraDevice(f"d-{i}", consumes_counters=(CounterConsumption("gpu-0-counter-set", {"n": 1}),))
        for i in range(65)
    ]
    assert len(pool_layout(many, [counters], "split")) == 3  # counters, 64, 1
    with pytest.raises(LimitExceededError, match=r"65 devices .* use the split layout"):
        pool_layout(many, [counters], "combined")
    wide = CounterSet("gpu-1-counter-set", {f"c-{i}": 1 for i in range(32)})
    greedy = [
        DraDevice(
            f"e-{i}",
            consumes_counters=(
                CounterConsumption("gpu-1-counter-set", {f"c-{j}": 1 for j in range(32)}),
            ),
        )
        for i in range(33)
    ]
    with pytest.raises(LimitExceededError, match="1056 consumed counters"):
        pool_layout(greedy, [wide], "combined")
    with pytest.raises(DraModelError, match="not published"):
        pool_layout(many, [], "split")
    with pytest.raises(DraModelError, match="does not have"):
        pool_layout(many[:1], [CounterSet("gpu-0-counter-set", {"m": 1})], "split")


def test_counter_model_validation() -> None:
    with pytest.raises(InvalidNameError):
        CounterSet("Gpu-0", {"n": 1})
    with pytest.raises(InvalidNameError):
        CounterSet("gpu-0", {"memorySlice0": 1})
    with pytest.raises(LimitExceededError):
        CounterSet("gpu-0", {f"c-{i}": 1 for i in range(33)})
    with pytest.raises(DraModelError):
        CounterSet("gpu-0", {"n": -1})
    entry = CounterConsumption("a", {f"c-{i}": 1 for i in range(20)})
    other = CounterConsumption("b", {f"c-{i}": 1 for i in range(13)})
    with pytest.raises(LimitExceededError, match="33 counters"):
        DraDevice("d", consumes_counters=(entry, other))
    with pytest.raises(LimitExceededError, match="3 counter sets"):
        DraDevice("d", consumes_counters=tuple(CounterConsumption(n, {"x": 1}) for n in "abc"))
    device = DraDevice("d", consumes_counters=(CounterConsumption("a", {"x": 1}),))
    assert device.uses_advanced_features
    assert device.with_taints(()).consumes_counters == device.consumes_counters


def test_slice_comparison_of_counters() -> None:
    def slices() -> list[Obj]:  # the names order: the full GPU first in its slice
        return profile_slices(
            "dgx-h100", dynamic_mig=DYNAMIC, slice_layout="combined", device_order="names"
        )

    (desired, *_) = slices()
    stored = slices()[0]
    counters = stored["spec"]["sharedCounters"][0]["counters"]
    counters["memory"]["value"] = str(80896 * 2**20)  # the server may respell a quantity
    stored["spec"]["devices"][0]["consumesCounters"][0]["counters"]["memory"]["value"] = (
        "84825604096"
    )
    assert slice_differences(desired, stored) == []
    counters["memory-slice-3"]["value"] = "0"
    stored["spec"]["devices"][1]["consumesCounters"][0]["counterSet"] = "gpu-9-counter-set"
    problems = slice_differences(desired, stored)
    assert any("memory-slice-3" in p for p in problems)
    assert any("consumesCounters" in p for p in problems)


def test_counters_only_slices_are_matched_by_their_sets() -> None:
    """Two counters-only slices (no devices) are told apart by their counter sets, so a
    pass over an unchanged pool writes nothing and a changed set rewrites only its slice."""
    desired = profile_slices("big-mig-host", dynamic_mig=ADOPT)
    observed = {}
    for index, item in enumerate(reversed(desired)):
        name = item["metadata"]["generateName"] + f"s{index:04d}"  # as the server names it
        copy = {**item, "metadata": {"name": name, "uid": f"u-{index}"}}
        copy["spec"] = {**item["spec"], "pool": {**item["spec"]["pool"], "generation": 3}}
        observed[name] = copy
    plan = plan_pool(desired, observed, pool_name=NODE)
    assert plan.empty and plan.generation == 3


def test_the_agent_owns_the_instances_its_mig_intents_name() -> None:
    """Startup settings (node_side): a MIG intent (kept from before the instance until it is
    gone) marks the agent's instances; a static device prepared with live ids does not."""
    from types import SimpleNamespace

    from agent.node_side import _dynamic_mig_settings

    def claim(intents: list[tuple[str, str]], devices: list[str]) -> SimpleNamespace:
        return SimpleNamespace(
            intents=[SimpleNamespace(effector=e, device=d) for e, d in intents],
            devices=[SimpleNamespace(device=d, mig=object()) for d in devices],
        )

    checkpoint = SimpleNamespace(
        claims={
            "a": claim([("mig", "gpu-0-mig-3g40gb-9-4")], ["gpu-0-mig-3g40gb-9-4"]),
            "b": claim([], ["gpu-1-mig-1g10gb-19-0"]),  # a static instance, prepared
            "c": claim([("other", "gpu-2")], []),
        }
    )
    settings = _dynamic_mig_settings(checkpoint, adopt=False)
    assert settings == DynamicMig(owned=frozenset({"gpu-0-mig-3g40gb-9-4"}))
    assert _dynamic_mig_settings(checkpoint, adopt=True).adopt


def test_layout_for_the_api_server_version() -> None:
    from agent.dra.slices import layout_for_version

    assert layout_for_version((1, 34)) == "combined"
    assert layout_for_version((1, 35)) == layout_for_version((1, 36)) == "split"
    assert layout_for_version(None) == "split"
