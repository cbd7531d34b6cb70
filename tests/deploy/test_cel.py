"""The CEL of the DeviceClasses and the examples compiles and selects the intended devices.

Devices come from the agent itself: ``discover_host`` on a simulated profile, then
``agent.dra.build_slices``, exactly what ``gpu-dra-agent run --simulate`` publishes. The
selectors are evaluated with common-expression-language plus the Kubernetes quantity and
semver functions of tests/deploy/cel_k8s.py; a request's devices must pass its DeviceClass's
selectors and its own, as in the scheduler.
"""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.dra import build_devices, build_slices
from agent.hardware.discovery import discover_host
from tests.deploy import cel_k8s
from tests.deploy.conftest import KUBERNETES, build, example_objects

DRIVER = "gpu.nvidia.com"
Devices = list[tuple[str, dict[str, Any]]]


@cache
def _profile_devices(profile: str) -> tuple[tuple[str, Any], ...]:
    with tempfile.TemporaryDirectory(prefix="cel-") as root:
        inventory = anyio.run(discover_host, profile, Path(root))
    slices = build_slices(build_devices(inventory), node_name="node-a", driver_name=DRIVER)
    return tuple(cel_k8s.slice_devices(slices))


def devices(profile: str) -> Devices:
    return list(_profile_devices(profile))


def class_selectors() -> dict[str, list[str]]:
    return {
        o["metadata"]["name"]: [s["cel"]["expression"] for s in o["spec"]["selectors"]]
        for o in build(KUBERNETES / "base")
        if o["kind"] == "DeviceClass"
    }


def requests() -> dict[str, dict[str, Any]]:
    """Example file -> its one request (with the claim's constraints)."""
    out: dict[str, dict[str, Any]] = {}
    for name, docs in example_objects().items():
        (template,) = [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
        spec = template["spec"]["spec"]["devices"]
        (request,) = spec["requests"]
        out[name] = {**request["exactly"], "constraints": spec.get("constraints", [])}
    return out


def request_selects(example: str, profile: str) -> list[str]:
    request = requests()[example]
    expressions = class_selectors()[request["deviceClassName"]]
    expressions = expressions + [s["cel"]["expression"] for s in request.get("selectors", [])]
    return cel_k8s.select(expressions, devices(profile))


def all_expressions() -> list[str]:
    found = [e for exprs in class_selectors().values() for e in exprs]
    for request in requests().values():
        found += [s["cel"]["expression"] for s in request.get("selectors", [])]
    return found


def test_every_expression_compiles_in_the_dra_environment() -> None:
    expressions = all_expressions()
    assert len(expressions) == 6
    for expression in expressions:
        cel_k8s.check_compiles(expression)
    with pytest.raises(AssertionError, match="unknown functions"):
        cel_k8s.check_compiles("device.attributes['gpu.nvidia.com'].model.semverish()")
    with pytest.raises(AssertionError, match="variables"):
        cel_k8s.check_compiles("gpu.type == 'gpu'")
    with pytest.raises(ValueError):
        cel_k8s.check_compiles("device.driver ==")


def test_device_classes_split_full_gpus_from_mig_devices() -> None:
    classes = class_selectors()
    assert set(classes) == {"gpu.nvidia.com", "mig.nvidia.com"}
    h100 = devices("dgx-h100")
    assert cel_k8s.select(classes["gpu.nvidia.com"], h100) == [f"gpu-{i}" for i in range(8)]
    assert cel_k8s.select(classes["mig.nvidia.com"], h100) == []
    a100 = devices("dgx-a100")  # every GPU of this profile is partitioned into MIG devices
    migs = cel_k8s.select(classes["mig.nvidia.com"], a100)
    assert len(migs) == len(a100) == 42 and all("-mig-" in name for name in migs)
    assert cel_k8s.select(classes["gpu.nvidia.com"], a100) == []
    # another driver's device of type gpu is not ours
    foreign = [("x", {**h100[0][1], "driver": "gpu.example.com"})]
    assert cel_k8s.select(classes["gpu.nvidia.com"], foreign) == []


def test_four_h100_on_one_numa_node_and_nvlink_domain() -> None:
    example = "gpu-4x-h100-one-numa-nvlink.yaml"
    request = requests()[example]
    assert request["count"] == 4
    matched = [c["matchAttribute"] for c in request["constraints"]]
    assert matched == ["resource.kubernetes.io/numaNode", "gpu.nvidia.com/nvlinkDomain"]

    h100 = devices("dgx-h100")
    selected = request_selects(example, "dgx-h100")
    assert len(selected) == 8
    groups = cel_k8s.feasible_groups(selected, h100, matched, request["count"])
    assert groups == [[f"gpu-{i}" for i in range(4)], [f"gpu-{i}" for i in range(4, 8)]]
    by_name = dict(h100)
    for group in groups:
        numa = {by_name[n]["attributes"]["resource.kubernetes.io"]["numaNode"] for n in group}
        links = {by_name[n]["attributes"][DRIVER]["nvlinkDomain"] for n in group}
        assert len(numa) == len(links) == 1

    # other hosts: no H100 at all, or H100-class GPUs without one shared NVLink domain
    assert request_selects(example, "h200-nvl-bridged") == []
    l40s = devices("l40s-pcie")
    names = [name for name, _ in l40s]
    assert cel_k8s.feasible_groups(names, l40s, matched, 4) == []  # no nvlinkDomain on PCIe


def test_at_least_80gi_of_gpu_memory() -> None:
    example = "gpu-80gi-memory.yaml"
    assert request_selects(example, "dgx-h100") == [f"gpu-{i}" for i in range(8)]  # 80Gi
    assert len(request_selects(example, "h200-nvl-bridged")) > 0  # 141Gi
    assert len(request_selects(example, "gb200-nvl72-tray")) > 0  # 189471Mi
    assert request_selects(example, "l40s-pcie") == []  # 48Gi
    assert request_selects(example, "dgx-a100") == []  # MIG devices only, not this class
    # by value, not by spelling: 81920Mi is 80Gi, one byte less is not
    (expression,) = [s["cel"]["expression"] for s in requests()[example]["selectors"]]
    device = devices("dgx-h100")[0][1]
    for memory, expected in (
        ("81920Mi", True),
        ("85899345919", False),
        ("0.078Ti", False),
        ("0.08Ti", True),
    ):
        device = {**device, "capacity": {DRIVER: {"memory": cel_k8s.quantity(memory)}}}
        assert cel_k8s.selects(expression, device) is expected, memory


def test_hopper_with_compute_capability_nine_or_newer() -> None:
    example = "gpu-hopper-cc90.yaml"
    assert request_selects(example, "dgx-h100") == [f"gpu-{i}" for i in range(8)]
    assert len(request_selects(example, "h200-nvl-bridged")) > 0
    assert request_selects(example, "gb200-nvl72-tray") == []  # Blackwell, 10.0
    assert request_selects(example, "l40s-pcie") == []  # Ada, 8.9
    assert request_selects(example, "dgx-a100") == []
    (expression,) = [s["cel"]["expression"] for s in requests()[example]["selectors"]]
    device = devices("dgx-h100")[0][1]
    hopper = device["attributes"][DRIVER]
    for version, expected in (("9.0.0", True), ("10.0.0", True), ("8.9.0", False)):
        changed = {**hopper, "cudaComputeCapability": cel_k8s.semver(version)}
        attributes = {**device["attributes"], DRIVER: changed}
        assert cel_k8s.selects(expression, {**device, "attributes": attributes}) is expected


def test_mig_example_picks_only_its_profile() -> None:
    example = "mig-1g10gb.yaml"
    a100 = dict(devices("dgx-a100"))
    chosen = request_selects(example, "dgx-a100")
    assert chosen and all(a100[n]["attributes"][DRIVER]["profile"] == "1g.10gb" for n in chosen)
    others = [n for n in a100 if n not in chosen]
    assert others and all(a100[n]["attributes"][DRIVER]["profile"] != "1g.10gb" for n in others)
    assert request_selects(example, "dgx-h100") == []


def test_kubernetes_library_semantics() -> None:
    q, v = cel_k8s.quantity, cel_k8s.semver
    assert cel_k8s.compare_to(q("1Gi"), q("1024Mi")) == 0
    assert cel_k8s.compare_to(q("1G"), q("1Gi")) == -1
    assert cel_k8s.compare_to(v("10.0.0"), v("9.0.0")) == 1  # not string order
    assert cel_k8s.compare_to(v("1.0.0-rc.1"), v("1.0.0")) == -1
    assert cel_k8s.compare_to(v("1.0.0-alpha.2"), v("1.0.0-alpha.10")) == -1
    with pytest.raises(TypeError):
        cel_k8s.compare_to(q("1"), v("1.0.0"))
    with pytest.raises(ValueError):
        v("9.0")
    device = devices("dgx-h100")[0][1]
    assert cel_k8s.selects(
        "device.attributes['gpu.nvidia.com'].cudaComputeCapability.major() == 9 && "
        "device.capacity['gpu.nvidia.com'].memory.asInteger() == 85899345920",
        device,
    )
    with pytest.raises(KeyError):  # a missing attribute is an error, as in Kubernetes
        cel_k8s.selects("device.attributes['gpu.nvidia.com'].nothing == 1", device)
