"""The Kubernetes DRA CEL environment: libraries, device variable, errors with positions.

Expected values come from the Kubernetes library definitions (quantity by value, semver
precedence, ext.Strings) and the seed's selector styles; devices come from the agent's own
slices of simulated hosts.
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.dra.cel import CelError, compare, compile_selector, device_variable
from agent.dra.cel import quantity_of as q
from agent.dra.cel import semver_of as v
from agent.dra.names import device_sort_key
from tests.support.profile_slices import profile_slices

GPU = "device.attributes['gpu.nvidia.com']"
MEMORY = "device.capacity['gpu.nvidia.com'].memory"
PROFILES = ("dgx-h100", "dgx-a100", "h200-nvl-bridged", "gb200-nvl72-tray")


def devices(profile: str) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in profile_slices(profile) for d in s["spec"]["devices"]}


def select(profile: str, expression: str) -> list[str]:
    selector = compile_selector(expression)
    return [
        n
        for n, d in devices(profile).items()
        if selector.matches(device_variable(d, "gpu.nvidia.com"))
    ]


def gpus(count: int) -> list[str]:
    return [f"gpu-{i}" for i in range(count)]


def migs(wanted: str) -> list[str]:
    """The dgx-a100 MIG devices whose profile starts with one of ``wanted``'s characters."""
    return [
        n
        for n, d in devices("dgx-a100").items()
        if d["attributes"]["profile"]["string"].startswith(tuple(wanted))
    ]


FULL = {"dgx-h100": gpus(8), "h200-nvl-bridged": gpus(4), "gb200-nvl72-tray": gpus(4)}
CASES: list[tuple[str, dict[str, Any]]] = [
    (f"{GPU}.productName == 'NVIDIA H100 80GB HBM3'", {"dgx-h100": gpus(8)}),
    (f"{MEMORY}.compareTo(quantity('80Gi')) >= 0", FULL),
    (
        f"{MEMORY}.isGreaterThan(quantity('100Gi'))",
        {"h200-nvl-bridged": gpus(4), "gb200-nvl72-tray": gpus(4)},
    ),
    (f"{MEMORY}.isLessThan(quantity('10Gi'))", {"dgx-a100": "1"}),
    (f"{GPU}.cudaComputeCapability.compareTo(semver('9.0.0')) >= 0", FULL),
    (f"{GPU}.cudaComputeCapability.isGreaterThan(semver('9.0.0'))", {"gb200-nvl72-tray": gpus(4)}),
    (f"{GPU}.cudaComputeCapability.major() == 8 && {GPU}.type == 'mig'", {"dgx-a100": "1234567"}),
    (
        f"device.attributes['resource.kubernetes.io'].numaNode == 1 && {GPU}.type == 'gpu'",
        {
            "dgx-h100": ["gpu-4", "gpu-5", "gpu-6", "gpu-7"],
            "h200-nvl-bridged": ["gpu-2", "gpu-3"],
            "gb200-nvl72-tray": ["gpu-2", "gpu-3"],
        },
    ),
    (f"has({GPU}.fabricClique)", {"gb200-nvl72-tray": gpus(4)}),
    (f"{GPU}.productName.lowerAscii().split(' ')[1] == 'h200'", {"h200-nvl-bridged": gpus(4)}),
    (f"{GPU}.nvlinkPeerCount >= 7 && {GPU}.type == 'gpu'", {"dgx-h100": gpus(8)}),
    (f"has({GPU}.profile) && {GPU}.profile.matches('^[37]g')", {"dgx-a100": "37"}),
    (
        f"{MEMORY}.add(quantity('1Gi')).asInteger() == 81 * 1024 * 1024 * 1024",
        {"dgx-h100": gpus(8)},
    ),
]


@pytest.mark.parametrize(("expression", "expected"), CASES)
def test_seed_style_selectors_pick_the_intended_devices(
    expression: str, expected: dict[str, Any]
) -> None:
    for profile in PROFILES:
        want = expected.get(profile, [])
        if isinstance(want, str):
            want = migs(want)
            assert want
        # which devices, not their published order (agent.dra.order)
        assert sorted(select(profile, expression), key=device_sort_key) == sorted(
            want, key=device_sort_key
        ), profile


def test_quantity_and_semver_semantics() -> None:
    assert compare(q("1Gi"), q("1024Mi"), "compareTo") == 0
    assert compare(q("1G"), q("1Gi"), "compareTo") == -1
    assert compare(v("10.0.0"), v("9.0.0"), "compareTo") == 1  # not string order
    assert compare(v("1.0.0-rc.1"), v("1.0.0"), "compareTo") == -1
    assert compare(v("1.0.0-alpha.2"), v("1.0.0-alpha.10"), "compareTo") == -1
    device = device_variable(devices("dgx-h100")["gpu-0"], "gpu.nvidia.com")
    for expression, expected in [
        (f"{MEMORY} == quantity('81920Mi')", True),  # by value, not by spelling
        (f"{MEMORY}.compareTo(quantity('85899345921')) < 0", True),
        ("quantity('1.5Gi').isInteger() && quantity('1500m').asApproximateFloat() == 1.5", True),
        (
            "quantity('2').sub(quantity('3')).sign() == -1 && quantity('1').add(2) == quantity('3')",
            True,
        ),
        (
            "isSemver('9.0') == false && isSemver('v9.0', true) && semver('v9', true).major() == 9",
            True,
        ),
        ("semver('1.0.0+build.1') == semver('1.0.0') && isQuantity('80Gi')", True),
        (
            "'abc'.charAt(1) == 'b' && 'a,b'.split(',') == ['a', 'b'] && 'abc'.substring(1, 2) == 'b'",
            True,
        ),
        (
            "' x '.trim() == 'x' && ['a', 'b'].join('-') == 'a-b' && 'aXa'.replace('a', 'b') == 'bXb'",
            True,
        ),
        (
            "[3, 1, 2].min() == 1 && [1, 2].isSorted() && [1, 2].sum() == 3 && 'abc'.indexOf('c') == 2",
            True,
        ),
        ("'gpu-12'.find('[0-9]+') == '12' && 'a1b2'.findAll('[0-9]') == ['1', '2']", True),
        (f"{GPU}.cudaComputeCapability.isLessThan(semver('9.0.0'))", False),
        ("has(device.attributes['example.com'].x)", False),  # unknown domain: an empty map
    ]:
        assert compile_selector(expression).matches(device) is expected, expression


def error(expression: str, profile: str = "dgx-h100") -> CelError:
    device = device_variable(next(iter(devices(profile).values())), "gpu.nvidia.com")
    with pytest.raises(CelError) as caught:
        compile_selector(expression).matches(device)
    return caught.value


def test_an_int_attribute_compared_to_a_quantity_is_a_type_error_with_a_hint() -> None:
    expression = f"{GPU}.nvlinkPeerCount.compareTo(quantity('4')) >= 0"
    err = error(expression)
    assert err.kind == "type" and "no such overload: int.compareTo(quantity)" in err.message
    assert (err.line, err.column) == (1, expression.index("compareTo") + 1)
    assert "compare it with an int" in err.hint
    assert "^" in str(err)
    err = error(f"{MEMORY} >= quantity('80Gi')")
    assert err.kind == "type" and "compareTo()" in err.hint
    assert err.column == len(MEMORY) + 2  # the operator


def test_an_unknown_attribute_is_a_runtime_error_at_its_name() -> None:
    expression = f"{GPU}.type == 'gpu' && {GPU}.modelName == 'x'"
    err = error(expression)
    assert err.kind == "runtime" and err.message == "no such key: modelName"
    assert err.column == expression.index("modelName") + 1
    assert "has(device.attributes['gpu.nvidia.com'].modelName)" in err.hint


def test_syntax_unsupported_and_cost_errors_come_from_compilation() -> None:
    with pytest.raises(CelError) as caught:
        compile_selector("device.driver ==\n  'x' &&")
    assert caught.value.kind == "syntax" and (caught.value.line, caught.value.column) == (
        2,
        9,
    )  # just past the end
    with pytest.raises(CelError, match="undeclared reference to 'gpu'"):
        compile_selector("gpu.type == 'gpu'")
    with pytest.raises(CelError, match=r"function semverish\(\) is not") as caught:
        compile_selector(f"{GPU}.cudaComputeCapability.semverish()")
    assert caught.value.column == len(GPU) + len(".cudaComputeCapability.") + 1
    compile_selector("[1, 2].all(x, [1, 2].exists(y, x == y))")  # bound variables are fine
    nested = "[1].all(a, [1].all(b, [1].all(c, [1].all(d, a == d))))"
    with pytest.raises(CelError, match="exceeds the limit 1000000") as caught:
        compile_selector(nested)
    assert caught.value.kind == "cost"
    with pytest.raises(CelError, match="longer than 10240 bytes"):
        compile_selector("device.driver == '" + "x" * 10240 + "'")
    with pytest.raises(CelError, match="must give bool"):
        compile_selector("device.driver").matches({"driver": "d", "attributes": {}, "capacity": {}})
    err = error("quantity('eighty') == quantity('80')")
    assert err.kind == "runtime" and err.column == 1 and "'80Gi'" in err.hint
