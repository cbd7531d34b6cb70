"""``--device-metadata``: off by default; the flag beats the environment beats the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import ConfigError, load_config
from agent.run import configure_parser
from agent.switches import SwitchParser

BASE = {"node_name": "node-a"}


def test_device_metadata_is_off_unless_asked_for(tmp_path: Path) -> None:
    assert load_config(BASE, {}).device_metadata is False
    assert load_config(BASE, {"GPU_DRA_DEVICE_METADATA": "true"}).device_metadata is True
    file = tmp_path / "agent.yaml"
    file.write_text("device-metadata: true\n")
    assert load_config(BASE, {}, file).device_metadata is True
    flag = {**BASE, "device_metadata": "false"}
    assert load_config(flag, {"GPU_DRA_DEVICE_METADATA": "true"}, file).device_metadata is False


def test_a_bad_value_names_its_source() -> None:
    with pytest.raises(ConfigError, match="GPU_DRA_DEVICE_METADATA"):
        load_config(BASE, {"GPU_DRA_DEVICE_METADATA": "sometimes"})


def test_the_run_command_has_the_flag() -> None:
    parser = SwitchParser()
    configure_parser(parser)
    assert parser.parse_args(["--device-metadata", "true"]).device_metadata is True
    assert parser.parse_args(["--device-metadata"]).device_metadata is True
    assert parser.parse_args(["--no-device-metadata"]).device_metadata is False
