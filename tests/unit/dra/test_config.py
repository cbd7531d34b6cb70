"""Opaque config decoding (every error names its field path) and config precedence."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.dra.config import (
    API_VERSION,
    AllocationResult,
    ConfigError,
    DeviceConfigEntry,
    DeviceKind,
    GpuConfig,
    MigDeviceConfig,
    MpsConfig,
    Sharing,
    SharingStrategy,
    TimeSliceInterval,
    TimeSlicingConfig,
    config_to_dict,
    decode_parameters,
    effective_configs,
    parse_allocation,
)

DRIVER = "gpu.nvidia.com"


def gpu(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "GpuConfig", **fields}


def mig(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "MigDeviceConfig", **fields}


def problems(parameters: Any) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as raised:
        decode_parameters(parameters)
    return raised.value.problems


def test_decodes_full_gpu_config() -> None:
    config = decode_parameters(
        gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})
    )
    assert config == GpuConfig(
        Sharing(SharingStrategy.TIME_SLICING, TimeSlicingConfig(TimeSliceInterval.LONG))
    )
    mps = decode_parameters(
        json.dumps(
            mig(
                sharing={
                    "strategy": "MPS",
                    "mpsConfig": {
                        "defaultActiveThreadPercentage": 0,
                        "defaultPinnedDeviceMemoryLimit": "10Gi",
                        "defaultPerDevicePinnedMemoryLimit": {"1": "4Gi", "GPU-abc": 1024},
                    },
                }
            )
        )
    )
    assert mps == MigDeviceConfig(
        Sharing(
            SharingStrategy.MPS,
            mps=MpsConfig(0, "10Gi", (("1", "4Gi"), ("GPU-abc", "1024"))),
        )
    )
    assert decode_parameters(config_to_dict(mps)) == mps
    assert decode_parameters(config_to_dict(config)) == config


def test_defaults_are_normalized() -> None:
    assert decode_parameters(gpu()) == GpuConfig()
    assert decode_parameters(gpu(sharing={"strategy": "TimeSlicing"})) == GpuConfig(
        Sharing(SharingStrategy.TIME_SLICING, TimeSlicingConfig(TimeSliceInterval.DEFAULT))
    )
    assert decode_parameters(mig(sharing={"strategy": "MPS"})).sharing == Sharing(
        SharingStrategy.MPS, mps=MpsConfig()
    )


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        (
            gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"intervall": "Long"}}),
            "parameters.sharing.timeSlicingConfig.intervall: unknown field",
        ),
        (
            gpu(sharing={"strategy": "TimeSlicing", "extra": 1}),
            "parameters.sharing.extra: unknown field",
        ),
        (gpu(spec={}), "parameters.spec: unknown field"),
        (
            mig(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
            "parameters.sharing.timeSlicingConfig: unknown field",
        ),
        (
            gpu(sharing={"strategy": "Exclusive"}),
            "parameters.sharing.strategy: must be one of TimeSlicing, MPS, got 'Exclusive'",
        ),
        (gpu(sharing={}), "parameters.sharing.strategy: must be one of"),
        (
            gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}}),
            "parameters.sharing.timeSlicingConfig.interval: must be one of Default, Short, Medium, Long",
        ),
        (
            gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": 5}),
            "parameters.sharing.timeSlicingConfig: must be an object, got int",
        ),
        (gpu(sharing="MPS"), "parameters.sharing: must be an object, got str"),
        (
            gpu(sharing={"strategy": "TimeSlicing", "mpsConfig": {}}),
            "parameters.sharing.mpsConfig: only allowed with strategy MPS",
        ),
        (
            gpu(sharing={"strategy": "MPS", "timeSlicingConfig": {}}),
            "parameters.sharing.timeSlicingConfig: only allowed with strategy TimeSlicing",
        ),
        (
            gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}}),
            "parameters.sharing.mpsConfig.defaultActiveThreadPercentage: must be an integer 0-100",
        ),
        (
            gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": True}}),
            "parameters.sharing.mpsConfig.defaultActiveThreadPercentage",
        ),
        (
            gpu(
                sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "ten"}}
            ),
            "parameters.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: must be a non-negative quantity like '8Gi', got 'ten'",
        ),
        (
            gpu(
                sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "-1Gi"}}
            ),
            "defaultPinnedDeviceMemoryLimit: must be a non-negative quantity",
        ),
        (
            gpu(
                sharing={
                    "strategy": "MPS",
                    "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"x": "1Gi"}},
                }
            ),
            "parameters.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.x: not a GPU/MIG UUID",
        ),
        (
            gpu(
                sharing={
                    "strategy": "MPS",
                    "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": []}},
                }
            ),
            "parameters.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.0: must be a non-negative quantity",
        ),
        (
            gpu(
                sharing={"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": []}}
            ),
            "defaultPerDevicePinnedMemoryLimit: must be an object",
        ),
        (
            {"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"},
            "parameters.apiVersion: must be 'resource.nvidia.com/v1beta1', got 'resource.nvidia.com/v1'",
        ),
        (
            {"apiVersion": API_VERSION, "kind": "VfioDeviceConfig"},
            "parameters.kind: 'VfioDeviceConfig' is not supported",
        ),
        ({"apiVersion": API_VERSION}, "parameters.kind: None is not supported"),
        ([], "parameters: must be an object, got list"),
        ("{", "parameters: not valid JSON"),
        (
            gpu(
                sharing={
                    "strategy": "MPS",
                    "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "1" * 11000},
                }
            ),
            "bytes exceed the limit of 10240",
        ),
    ],
)
def test_every_error_names_its_field_path(parameters: Any, expected: str) -> None:
    found = problems(parameters)
    assert any(expected in problem for problem in found), found


def test_all_problems_are_reported_at_once() -> None:
    found = problems(gpu(bogus=1, sharing={"strategy": "MPS", "mpsConfig": {"typo": 1}}))
    assert found == (
        "parameters.bogus: unknown field (known: apiVersion, kind, sharing)",
        "parameters.sharing.mpsConfig.typo: unknown field (known: defaultActiveThreadPercentage, "
        "defaultPinnedDeviceMemoryLimit, defaultPerDevicePinnedMemoryLimit)",
    )


KINDS: dict[str, DeviceKind] = {"gpu-0": "gpu", "gpu-1": "gpu", "gpu-2-mig-1g10gb-19-0": "mig"}


def kind_of(pool: str, device: str) -> DeviceKind | None:
    return KINDS.get(device)


def result(request: str, device: str = "gpu-0", driver: str = DRIVER) -> AllocationResult:
    return AllocationResult(request, driver, "node-a", device)


def entry(
    parameters: dict[str, Any], *requests: str, source: str = "FromClaim", driver: str = DRIVER
) -> DeviceConfigEntry:
    return DeviceConfigEntry(source, requests, driver, parameters)  # type: ignore[arg-type]


TS_SHORT = gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}})
TS_LONG = gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})
MPS = gpu(sharing={"strategy": "MPS"})


def interval(effective: Any) -> str | None:
    sharing = effective.config.sharing
    if sharing is None:
        return None
    return str(sharing.time_slicing.interval) if sharing.time_slicing else str(sharing.strategy)


def chosen(results: list[AllocationResult], configs: list[DeviceConfigEntry]) -> list[str | None]:
    return [interval(e) for e in effective_configs(results, configs, DRIVER, kind_of)]


def test_defaults_apply_without_configs() -> None:
    found = effective_configs(
        [result("a"), result("b", "gpu-2-mig-1g10gb-19-0"), result("c", driver="other")],
        [],
        DRIVER,
        kind_of,
    )
    assert [(e.result.request, e.config, e.origin) for e in found] == [
        ("a", GpuConfig(), "default"),
        ("b", MigDeviceConfig(), "default"),
    ]


def test_precedence() -> None:
    results = [result("a"), result("b", "gpu-1")]
    # claim beats class, even a class config naming the request
    assert chosen(results, [entry(TS_SHORT, "a", source="FromClass"), entry(TS_LONG)]) == [
        "Long",
        "Long",
    ]
    # within one source, naming the request beats empty requests, whatever the order
    assert chosen(results, [entry(TS_SHORT, "a"), entry(TS_LONG)]) == ["Short", "Long"]
    # otherwise the later entry wins
    assert chosen(results, [entry(TS_SHORT), entry(TS_LONG)]) == ["Long", "Long"]
    assert chosen(results, [entry(TS_LONG, "a"), entry(TS_SHORT, "a", "b")]) == ["Short", "Short"]
    # configs of other drivers are ignored, even invalid ones
    assert chosen(results, [entry({"nonsense": 1}, driver="other.example.com")]) == [None, None]


def test_origin_names_the_config() -> None:
    found = effective_configs(
        [result("a")], [entry(TS_SHORT, source="FromClass"), entry(MPS, "a")], DRIVER, kind_of
    )
    assert found[0].origin == "devices.config[1]"


def test_request_name_covers_subrequests() -> None:
    results = [result("req/big"), result("other", "gpu-1")]
    assert chosen(results, [entry(TS_SHORT, "req")]) == ["Short", None]
    assert chosen(results, [entry(TS_SHORT, "req"), entry(TS_LONG, "req/big")]) == ["Long", None]
    assert chosen(results, [entry(TS_SHORT, "req/small")]) == [None, None]


def test_type_mismatch() -> None:
    mig_result = result("m", "gpu-2-mig-1g10gb-19-0")
    # a GpuConfig with empty requests simply does not apply to a mig device
    found = effective_configs([mig_result], [entry(TS_SHORT)], DRIVER, kind_of)
    assert found[0].config == MigDeviceConfig()
    # a parent request may have subrequests of both kinds: skipped, not an error
    found = effective_configs(
        [AllocationResult("r/mig", DRIVER, "node-a", "gpu-2-mig-1g10gb-19-0")],
        [entry(TS_SHORT, "r")],
        DRIVER,
        kind_of,
    )
    assert found[0].config == MigDeviceConfig()
    # explicitly targeted at the request: an error that says what to use
    with pytest.raises(ConfigError) as raised:
        effective_configs([mig_result], [entry(TS_SHORT, "m")], DRIVER, kind_of, claim="ns/claim")
    message = str(raised.value)
    assert message.startswith("claim ns/claim: ")
    assert "devices.config[0]: GpuConfig cannot be applied to request 'm'" in message
    assert "is a mig device (use MigDeviceConfig)" in message
    with pytest.raises(ConfigError, match="MigDeviceConfig cannot be applied to request 'a'"):
        effective_configs([result("a")], [entry(mig(), "a")], DRIVER, kind_of)


def test_errors_of_one_claim_are_reported_together() -> None:
    bad = gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"intervall": "Long"}})
    with pytest.raises(ConfigError) as raised:
        effective_configs(
            [result("a"), result("x", "gpu-9")],
            [entry(TS_SHORT, "nothing"), entry(bad)],
            DRIVER,
            kind_of,
        )
    assert raised.value.problems == (
        "devices.config[1].opaque.parameters.sharing.timeSlicingConfig.intervall: unknown field (known: interval)",
        "devices.results[1]: device node-a/gpu-9 is not a device of this node",
    )


def test_parse_allocation() -> None:
    results, configs = parse_allocation(
        {
            "devices": {
                "results": [
                    {
                        "request": "r/s",
                        "driver": DRIVER,
                        "pool": "p",
                        "device": "gpu-0",
                        "adminAccess": True,
                    }
                ],
                "config": [
                    {
                        "source": "FromClass",
                        "requests": ["r"],
                        "opaque": {"driver": DRIVER, "parameters": MPS},
                    },
                    {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": TS_LONG}},
                ],
            }
        }
    )
    assert results == (AllocationResult("r/s", DRIVER, "p", "gpu-0", admin_access=True),)
    assert results[0].base_request == "r"
    assert configs == (
        DeviceConfigEntry("FromClass", ("r",), DRIVER, MPS),
        DeviceConfigEntry("FromClaim", (), DRIVER, TS_LONG),
    )


@pytest.mark.parametrize(
    ("allocation", "expected"),
    [
        ({}, "allocation.devices: missing"),
        (
            {"devices": {"results": [{"request": "r"}]}},
            "devices.results[0]: request, driver, pool, device must be set",
        ),
        ({"devices": {"config": [{"source": "FromSomewhere"}]}}, "devices.config[0].source"),
        (
            {"devices": {"config": [{"source": "FromClaim", "requests": "r"}]}},
            "devices.config[0].requests",
        ),
        (
            {"devices": {"config": [{"source": "FromClaim", "opaque": {"driver": DRIVER}}]}},
            "devices.config[0].opaque",
        ),
    ],
)
def test_parse_allocation_errors(allocation: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        parse_allocation(allocation)
