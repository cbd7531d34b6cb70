"""The CEL of the DeviceClasses and the examples compiles and selects the intended devices.

Devices come from the agent itself (``tests/support/profile_slices``: discovery on a simulated
profile, then ``agent.dra.build_slices``, exactly what ``gpu-dra-agent run --simulate``
publishes). The selectors are compiled and evaluated by the shipped DRA CEL environment
(``agent.dra.cel``), and each example claim is allocated by the shipped allocator
(``agent.dra.allocator``) with the DeviceClasses kustomize builds, as the scheduler would.
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.dra.allocator import allocate, build_node_state, parse_claim
from agent.dra.cel import CelError, compile_selector, device_variable
from tests.deploy.conftest import KUBERNETES, build, example_objects
from tests.support.profile_slices import DRIVER, profile_slices


def classes() -> dict[str, dict[str, Any]]:
    return {
        o["metadata"]["name"]: o for o in build(KUBERNETES / "base") if o["kind"] == "DeviceClass"
    }


def template(example: str) -> dict[str, Any]:
    (found,) = [d for d in example_objects()[example] if d["kind"] == "ResourceClaimTemplate"]
    return found


def candidates(example: str, profile: str) -> list[str]:
    """Devices that pass the request's class and own selectors (what the scheduler may pick)."""
    claim = parse_claim(template(example), classes())
    (request,) = [a for r in claim.requests for a in r.alternatives]
    outcome = allocate(claim, build_node_state("node-a", profile_slices(profile)))
    return [c.device.id.device for c in outcome.checks[request.name] if c.selected]


def allocated(example: str, profile: str) -> list[str] | None:
    claim = parse_claim(template(example), classes())
    outcome = allocate(claim, build_node_state("node-a", profile_slices(profile)))
    if not outcome.fits:
        return None
    assert outcome.allocation is not None
    return [r["device"] for r in outcome.allocation["devices"]["results"]]


def all_expressions() -> list[str]:
    found = [s["cel"]["expression"] for c in classes().values() for s in c["spec"]["selectors"]]
    for example in example_objects():
        for request in template(example)["spec"]["spec"]["devices"]["requests"]:
            found += [s["cel"]["expression"] for s in request["exactly"].get("selectors", [])]
    return found


def test_every_expression_compiles_in_the_dra_environment() -> None:
    expressions = all_expressions()
    assert len(expressions) == 7  # the 3 DeviceClasses (gpu, mig, channel), 4 examples
    for expression in expressions:
        compile_selector(expression)
    with pytest.raises(CelError, match="not in the Kubernetes DRA CEL environment"):
        compile_selector("device.attributes['gpu.nvidia.com'].model.semverish()")
    with pytest.raises(CelError, match="undeclared reference"):
        compile_selector("gpu.type == 'gpu'")
    with pytest.raises(CelError, match="syntax error"):
        compile_selector("device.driver ==")


def class_selects(name: str, profile: str) -> list[str]:
    selectors = [
        compile_selector(s["cel"]["expression"]) for s in classes()[name]["spec"]["selectors"]
    ]
    return [
        d["name"]
        for s in profile_slices(profile)
        for d in s["spec"]["devices"]
        if all(x.matches(device_variable(d, s["spec"]["driver"])) for x in selectors)
    ]


def test_device_classes_split_full_gpus_from_mig_devices() -> None:
    channel = "compute-domain-default-channel.nvidia.com"
    assert set(classes()) == {"gpu.nvidia.com", "mig.nvidia.com", channel}
    assert class_selects(channel, "dgx-h100") == []  # another driver's devices
    assert class_selects("gpu.nvidia.com", "dgx-h100") == [f"gpu-{i}" for i in range(8)]
    assert class_selects("mig.nvidia.com", "dgx-h100") == []
    migs = class_selects("mig.nvidia.com", "dgx-a100")  # every GPU here is partitioned
    assert len(migs) == 42 and all("-mig-" in name for name in migs)
    assert class_selects("gpu.nvidia.com", "dgx-a100") == []
    # another driver's device of type gpu is not ours
    (expression,) = [s["cel"]["expression"] for s in classes()[DRIVER]["spec"]["selectors"]]
    device = profile_slices("dgx-h100")[0]["spec"]["devices"][0]
    assert compile_selector(expression).matches(device_variable(device, "gpu.example.com")) is False


def test_four_h100_on_one_numa_node_and_nvlink_domain() -> None:
    example = "gpu-4x-h100-one-numa-nvlink.yaml"
    spec = template(example)["spec"]["spec"]["devices"]
    matched = [c["matchAttribute"] for c in spec["constraints"]]
    assert matched == ["resource.kubernetes.io/numaNode", "gpu.nvidia.com/nvlinkDomain"]
    assert candidates(example, "dgx-h100") == [f"gpu-{i}" for i in range(8)]
    assert allocated(example, "dgx-h100") == [f"gpu-{i}" for i in range(4)]  # socket 0 first
    # no H100 at all elsewhere
    for profile in ("h200-nvl-bridged", "gb200-nvl72-tray", "dgx-a100"):
        assert candidates(example, profile) == [] and allocated(example, profile) is None


def test_at_least_80gi_of_gpu_memory() -> None:
    example = "gpu-80gi-memory.yaml"
    assert candidates(example, "dgx-h100") == [f"gpu-{i}" for i in range(8)]  # 80Gi
    assert candidates(example, "h200-nvl-bridged") == [f"gpu-{i}" for i in range(4)]  # 141Gi
    assert candidates(example, "gb200-nvl72-tray") == [f"gpu-{i}" for i in range(4)]  # 189471Mi
    assert candidates(example, "l40s-pcie") == []  # 48Gi
    assert candidates(example, "dgx-a100") == []  # MIG devices only, not this class
    assert allocated(example, "h200-nvl-bridged") == ["gpu-0"]
    # by value, not by spelling: 81920Mi is 80Gi, one byte less is not
    (selector,) = template(example)["spec"]["spec"]["devices"]["requests"][0]["exactly"][
        "selectors"
    ]
    compiled = compile_selector(selector["cel"]["expression"])
    device = profile_slices("dgx-h100")[0]["spec"]["devices"][0]
    for memory, expected in (
        ("81920Mi", True),
        ("85899345919", False),
        ("0.078Ti", False),
        ("0.08Ti", True),
    ):
        changed = {**device, "capacity": {"memory": {"value": memory}}}
        assert compiled.matches(device_variable(changed, DRIVER)) is expected, memory


def test_hopper_with_compute_capability_nine_or_newer() -> None:
    example = "gpu-hopper-cc90.yaml"
    assert candidates(example, "dgx-h100") == [f"gpu-{i}" for i in range(8)]
    assert candidates(example, "h200-nvl-bridged") == [f"gpu-{i}" for i in range(4)]
    assert candidates(example, "gb200-nvl72-tray") == []  # Blackwell, 10.0
    assert candidates(example, "l40s-pcie") == []  # Ada, 8.9
    assert candidates(example, "dgx-a100") == []


def test_mig_example_picks_only_its_profile() -> None:
    example = "mig-1g10gb.yaml"
    a100 = {d["name"]: d for s in profile_slices("dgx-a100") for d in s["spec"]["devices"]}
    chosen = candidates(example, "dgx-a100")
    profiles = {n: d["attributes"]["profile"]["string"] for n, d in a100.items()}
    assert chosen == [n for n, p in profiles.items() if p == "1g.10gb"] and chosen
    assert allocated(example, "dgx-a100") == chosen[:1]
    assert candidates(example, "dgx-h100") == []
    assert candidates(example, "gb200-nvl72-tray") == []


SEED_PROFILES = ("dgx-h100", "dgx-a100", "h200-nvl-bridged", "gb200-nvl72-tray")


def _a100_migs(profile_name: str) -> list[str]:
    a100 = [d for s in profile_slices("dgx-a100") for d in s["spec"]["devices"]]
    return [d["name"] for d in a100 if d["attributes"]["profile"]["string"] == profile_name]


def _gpus(count: int) -> list[str]:
    return [f"gpu-{i}" for i in range(count)]


#: example -> seed profile -> (the devices its selectors admit, what the allocator picks or
#: None when it does not fit); every example under examples/ on every seed profile.
EXAMPLE_OUTCOMES: dict[str, dict[str, tuple[list[str], list[str] | None]]] = {
    "gpu-4x-h100-one-numa-nvlink.yaml": {
        "dgx-h100": (_gpus(8), _gpus(4)),
        "dgx-a100": ([], None),
        "h200-nvl-bridged": ([], None),
        "gb200-nvl72-tray": ([], None),
    },
    "gpu-80gi-memory.yaml": {
        "dgx-h100": (_gpus(8), ["gpu-0"]),
        "dgx-a100": ([], None),  # MIG devices only, not of the full-GPU class
        "h200-nvl-bridged": (_gpus(4), ["gpu-0"]),
        "gb200-nvl72-tray": (_gpus(4), ["gpu-0"]),
    },
    "gpu-hopper-cc90.yaml": {
        "dgx-h100": (_gpus(8), ["gpu-0"]),
        "dgx-a100": ([], None),
        "h200-nvl-bridged": (_gpus(4), ["gpu-0"]),
        "gb200-nvl72-tray": ([], None),  # Blackwell
    },
    "mig-1g10gb.yaml": {
        "dgx-h100": ([], None),  # MIG off
        "dgx-a100": (_a100_migs("1g.10gb"), _a100_migs("1g.10gb")[:1]),
        "h200-nvl-bridged": ([], None),
        "gb200-nvl72-tray": ([], None),
    },
}


def test_every_example_on_every_seed_profile() -> None:
    assert set(EXAMPLE_OUTCOMES) == set(example_objects())  # a new example needs a row
    for example, by_profile in EXAMPLE_OUTCOMES.items():
        assert set(by_profile) == set(SEED_PROFILES), example
        for profile, (admitted, picked) in by_profile.items():
            assert candidates(example, profile) == admitted, (example, profile)
            assert allocated(example, profile) == picked, (example, profile)
    assert _a100_migs("1g.10gb")
