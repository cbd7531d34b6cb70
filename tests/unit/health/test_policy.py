"""The health policy's defaults, its XID table parser, the config file keys and the
unmonitored taint's effect per API server version."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import ConfigError, load_config
from agent.dra import build_devices, build_slices
from agent.hardware.health_events import EventKind, HealthEvent
from agent.health.policy import (
    DEFAULT_IGNORED_XIDS,
    RESET_XIDS,
    HealthPolicy,
    XidAction,
    parse_xid_actions,
    unmonitored_effect_for,
)
from agent.health.records import device_map
from agent.health.state import HealthStateMachine
from tests.support.inventories import gpu_uuid, h100_node
from tests.support.k8s_schema import SUPPORTED_VERSIONS, taint_effects, validate


def test_defaults_follow_the_incumbent_and_reset_xids_are_no_execute() -> None:
    policy = HealthPolicy()
    assert {x for x in range(200) if policy.action(x) is XidAction.IGNORE} == DEFAULT_IGNORED_XIDS
    assert all(policy.action(x) is XidAction.NO_EXECUTE for x in RESET_XIDS)
    assert policy.action(62) is XidAction.NO_SCHEDULE
    assert policy.quarantine_seconds == 300


def test_parse_xid_actions() -> None:
    assert parse_xid_actions(" 79=noexecute, 13=NoSchedule;62=Ignore,") == {
        79: XidAction.NO_EXECUTE,
        13: XidAction.NO_SCHEDULE,
        62: XidAction.IGNORE,
    }
    with pytest.raises(ValueError, match="not XID=ACTION"):
        parse_xid_actions("79")
    with pytest.raises(ValueError, match="unknown action 'Evict'"):
        parse_xid_actions("79=Evict")


def _load(tmp_path: Path, text: str, **env: str) -> object:
    config = tmp_path / "agent.yaml"
    config.write_text(text)
    return load_config({"node_name": "node-a"}, env, config)


def test_config_file_keys(tmp_path: Path) -> None:
    config = load_config({"node_name": "node-a"}, {})
    assert config.health_monitoring and config.health == HealthPolicy()
    text = "health_monitoring: false\nhealth-xids: '62=Ignore, 13=NoExecute'\n"
    text += "health-quarantine-seconds: 30\n"
    loaded = _load(tmp_path, text)
    assert not loaded.health_monitoring  # type: ignore[attr-defined]
    policy = loaded.health  # type: ignore[attr-defined]
    assert policy.action(62) is XidAction.IGNORE and policy.action(13) is XidAction.NO_EXECUTE
    assert policy.action(31) is XidAction.IGNORE  # the defaults stay under the overrides
    assert policy.quarantine_seconds == 30
    assert _load(tmp_path, "", GPU_DRA_HEALTH_MONITORING="off").health_monitoring is False  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("health-monitoring: maybe\n", "not a boolean"),
        ("health-xids: '79=Evict'\n", "unknown action"),
        ("health-quarantine-seconds: soon\n", "not a number of seconds"),
        ("health-quarantine-seconds: -1\n", "not a number of seconds"),
    ],
)
def test_bad_health_settings_name_their_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        _load(tmp_path, text)
    assert "agent.yaml: health-" in str(raised.value)


@pytest.mark.parametrize(
    ("server", "effect"),
    [((1, 34), "NoSchedule"), ((1, 35), "None"), ((1, 36), "None"), ((2, 0), "None")],
)
def test_unmonitored_effect_follows_the_server_version(
    server: tuple[int, int], effect: str
) -> None:
    assert unmonitored_effect_for(server) == effect


def test_unknown_server_version_gets_the_effect_every_version_accepts() -> None:
    effect = unmonitored_effect_for(None)
    assert all(effect in taint_effects(version) for version in SUPPORTED_VERSIONS)
    assert HealthPolicy().unmonitored_effect == effect


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_unmonitored_slice_is_valid_for_each_version(version: str) -> None:
    """The slice the agent publishes for an unmonitored GPU, for an API server of ``version``:
    strict schema, and an effect that version's API server accepts (the schema leaves the
    effect a free string; its description names the valid ones)."""
    major, minor = (int(part) for part in version.split("."))
    policy = HealthPolicy(unmonitored_effect=unmonitored_effect_for((major, minor)))
    inventory = h100_node(2)
    machine = HealthStateMachine(policy, device_map(inventory))
    machine.observe([HealthEvent(gpu_uuid(1), EventKind.UNMONITORED, detail="NVML: Unknown")], 0)
    devices = build_devices(inventory, taints=machine.taints())
    [obj] = build_slices(devices, node_name="node-a", driver_name="gpu.nvidia.com")
    validate(obj, version)
    [tainted] = [d for d in obj["spec"]["devices"] if d.get("taints")]
    assert tainted["name"] == "gpu-1"
    assert [t["key"] for t in tainted["taints"]] == ["gpu.nvidia.com/unmonitored"]
    assert {t["effect"] for t in tainted["taints"]} <= taint_effects(version)
