"""Tests of agent/dra/names.py: the naming rules shared with the incumbent and Kubernetes."""

import pytest

from agent.dra.errors import InvalidNameError, InvalidValueError
from agent.dra.names import (
    device_sort_key,
    gpu_device_name,
    is_dns_label,
    is_semver,
    label_key_problem,
    mig_device_name,
    parse_mig_device_name,
    qualified_name_problem,
    rfc1123_profile,
    semver_from_numeric,
    validate_device_name,
    validate_driver_name,
    validate_node_name,
    validate_qualified_name,
)


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        ("1g.10gb", "1g10gb"),
        ("1g.10gb+me", "1g10gb-me"),
        ("7g.80gb", "7g80gb"),
        ("1g.24gb", "1g24gb"),
        ("2G.47GB", "2g47gb"),
        ("1g.10gb+me.all", "1g10gb-meall"),
        ("1g.12gb+gfx", "1g12gb-gfx"),
    ],
)
def test_rfc1123_profile_matches_incumbent(profile: str, expected: str) -> None:
    assert rfc1123_profile(profile) == expected


def test_device_names_match_incumbent_examples() -> None:
    assert gpu_device_name(3) == "gpu-3"
    assert mig_device_name(1, "2g.47gb", 14, 0) == "gpu-1-mig-2g47gb-14-0"
    assert mig_device_name(0, "1g.10gb+me", 20, 6) == "gpu-0-mig-1g10gb-me-20-6"


def test_parse_mig_device_name_round_trips() -> None:
    assert parse_mig_device_name("gpu-1-mig-2g47gb-14-0") == (1, "2g47gb", 14, 0)
    assert parse_mig_device_name("gpu-0-mig-1g10gb-me-20-6") == (0, "1g10gb-me", 20, 6)
    assert parse_mig_device_name("gpu-3") is None


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("570.158.01", "570.158.1"),
        ("565.57", "565.57.0"),
        ("12.8", "12.8.0"),
        ("580", "580.0.0"),
        (" 550.54.15 ", "550.54.15"),
        ("00.0.000", "0.0.0"),
    ],
)
def test_semver_from_numeric(version: str, expected: str) -> None:
    assert semver_from_numeric(version) == expected
    assert is_semver(expected)


@pytest.mark.parametrize("version", ["", "570.158.01.2", "r570", "12.8-beta", "1..2"])
def test_semver_from_numeric_rejects_garbage(version: str) -> None:
    with pytest.raises(InvalidValueError, match="major"):
        semver_from_numeric(version)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("1.2.3", True),
        ("1.2.3-rc.1+build.5", True),
        ("01.2.3", False),
        ("1.2", False),
        ("v1.2.3", False),
    ],
)
def test_is_semver(value: str, ok: bool) -> None:
    assert is_semver(value) is ok


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("gpu-0", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("GPU-0", False),
        ("-gpu", False),
        ("gpu-", False),
        ("gpu.0", False),
        ("", False),
    ],
)
def test_dns_label(name: str, ok: bool) -> None:
    assert is_dns_label(name) is ok
    if not ok:
        with pytest.raises(InvalidNameError, match="DNS label"):
            validate_device_name(name)


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("uuid", None),
        ("_x9", None),
        ("a" * 32, None),
        ("resource.kubernetes.io/pciBusID", None),
        ("a" * 33, "C identifier"),
        ("9lives", "C identifier"),
        ("memory-slice", "C identifier"),
        ("Example.COM/x", "DNS subdomain"),
        (("d" * 64) + "/x", "DNS subdomain"),
        ("a/b/c", "more than one"),
        ("/x", "DNS subdomain"),
    ],
)
def test_qualified_names(name: str, problem: str | None) -> None:
    found = qualified_name_problem(name)
    if problem is None:
        assert found is None
        validate_qualified_name(name, device="gpu-0")
    else:
        assert found is not None and problem in found
        with pytest.raises(InvalidNameError, match="gpu-0"):
            validate_qualified_name(name, device="gpu-0")


def test_label_keys() -> None:
    assert label_key_problem("gpu.nvidia.com/xid") is None
    assert label_key_problem("unhealthy") is None
    assert label_key_problem("Bad_Prefix/x") is not None
    assert label_key_problem("x/" + "a" * 64) is not None


def test_driver_and_node_names() -> None:
    validate_driver_name("gpu.nvidia.com")
    validate_node_name("node-1.example.com")
    with pytest.raises(InvalidNameError, match="driver name"):
        validate_driver_name("GPU.nvidia.com")
    with pytest.raises(InvalidNameError, match="driver name"):
        validate_driver_name("a" * 64)
    with pytest.raises(InvalidNameError, match="node name"):
        validate_node_name("node_1")


def test_device_sort_key_counts_like_people() -> None:
    names = ["gpu-10", "gpu-2", "gpu-1-mig-1g10gb-19-6", "gpu-1", "gpu-1-mig-1g10gb-19-10"]
    assert sorted(names, key=device_sort_key) == [
        "gpu-1",
        "gpu-1-mig-1g10gb-19-6",
        "gpu-1-mig-1g10gb-19-10",
        "gpu-2",
        "gpu-10",
    ]
