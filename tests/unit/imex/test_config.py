"""ComputeDomainChannelConfig: strict decoding with field paths, and which config applies."""

from __future__ import annotations

import pytest

from agent.dra.config import AllocationResult, ConfigError, DeviceConfigEntry
from agent.imex.config import (
    DRIVER,
    AllocationMode,
    ChannelConfig,
    channel_config_for,
    decode_channel_config,
)

UID = "0b6f5f2e-8d6a-4b7e-9a31-2f1c7d9e4a10"
OTHER = "9d1c0e7a-3f2b-4c6d-8e5f-7a9b1c2d3e4f"


def params(**extra: object) -> dict[str, object]:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainChannelConfig",
        "domainID": UID,
        **extra,
    }


def test_decodes_and_round_trips() -> None:
    config = decode_channel_config(params(allocationMode="All"))
    assert config == ChannelConfig(UID, AllocationMode.ALL)
    assert decode_channel_config(config.to_dict()) == config
    assert decode_channel_config(params()).allocation_mode is AllocationMode.SINGLE


def test_every_problem_is_reported_with_its_path() -> None:
    bad = params(domainID="not-a-uid", allocationMode="Some", channel=3)
    bad["apiVersion"] = "v1"
    with pytest.raises(ConfigError) as caught:
        decode_channel_config(bad, "devices.config[0].parameters")
    problems = caught.value.problems
    assert "devices.config[0].parameters.channel: unknown field" in problems[0]
    assert any(p.startswith("devices.config[0].parameters.apiVersion:") for p in problems)
    assert any(p.startswith("devices.config[0].parameters.domainID:") for p in problems)
    assert any(
        p.startswith("devices.config[0].parameters.allocationMode: must be one of Single, All")
        for p in problems
    )
    assert len(problems) == 4


def test_not_an_object_and_wrong_kind() -> None:
    with pytest.raises(ConfigError, match=r"parameters: must be an object"):
        decode_channel_config("[1]")
    with pytest.raises(ConfigError, match=r"parameters.kind: must be 'ComputeDomainChannelConfig'"):
        decode_channel_config(params(kind="GpuConfig"))


def entry(
    source: str, requests: tuple[str, ...], domain: str, driver: str = DRIVER
) -> DeviceConfigEntry:
    return DeviceConfigEntry(source, requests, driver, params(domainID=domain))  # type: ignore[arg-type]


def test_claim_config_beats_class_config_and_named_request_beats_empty() -> None:
    result = AllocationResult("channel", DRIVER, "node-a", "channel-0")
    chosen = channel_config_for(
        result,
        [entry("FromClaim", (), OTHER), entry("FromClass", ("channel",), OTHER),
         entry("FromClaim", ("channel",), UID), entry("FromClaim", ("other",), OTHER),
         entry("FromClaim", ("channel",), OTHER, driver="gpu.nvidia.com")],
    )  # fmt: skip
    assert chosen.domain_id == UID


def test_a_channel_without_config_is_refused_naming_the_claim() -> None:
    result = AllocationResult("channel", DRIVER, "node-a", "channel-0")
    with pytest.raises(
        ConfigError, match=r"claim default/c: .*no opaque ComputeDomainChannelConfig"
    ):
        channel_config_for(result, [], "default/c")
