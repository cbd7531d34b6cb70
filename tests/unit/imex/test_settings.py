"""The ComputeDomain settings: defaults, sources, precise errors, the second driver's sockets."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import ConfigError, load_config
from agent.imex.wiring import simulated_address


def test_defaults_and_sockets_named_like_the_gpu_drivers() -> None:
    config = load_config({"node_name": "n", "instance_id": "abc"}, {})
    assert (config.compute_domains, config.imex_daemon_cmd) == ("auto", "nvidia-imex")
    assert config.imex_ready_timeout_s == 20.0 and config.node_ip is None
    dra, registration = config.sockets_of("compute-domain.nvidia.com")
    assert dra == Path("/var/lib/kubelet/plugins/compute-domain.nvidia.com/dra-abc.sock")
    assert registration == Path(
        "/var/lib/kubelet/plugins_registry/compute-domain.nvidia.com-abc-reg.sock"
    )


def test_environment_and_flags() -> None:
    environ = {
        "GPU_DRA_COMPUTE_DOMAINS": "OFF",
        "NODE_IP": "10.1.2.3",
        "GPU_DRA_IMEX_READY_TIMEOUT_SECONDS": "7.5",
        "GPU_DRA_SIM_FABRIC_DIR": "/tmp/fabric",
    }
    config = load_config({"node_name": "n", "imex_daemon_cmd": "/opt/imex/nvidia-imex"}, environ)
    assert config.compute_domains == "off" and config.node_ip == "10.1.2.3"
    assert config.imex_ready_timeout_s == 7.5 and config.sim_fabric_dir == Path("/tmp/fabric")
    assert config.imex_daemon_cmd == "/opt/imex/nvidia-imex"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"compute_domains": "maybe"}, r"--compute-domains 'maybe' is not one of auto, on, off"),
        ({"imex_ready_timeout_seconds": "45"}, r"not a number of seconds in \(0, 40\]"),
        ({"imex_ready_timeout_seconds": "soon"}, r"--imex-ready-timeout-seconds 'soon'"),
        ({"node_ip": "tray-a"}, r"--node-ip 'tray-a' is not an IP address"),
        ({"imex_daemon_cmd": " "}, r"--imex-daemon-cmd is empty"),
    ],
)
def test_bad_values_name_their_source(flags: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config({"node_name": "n", **flags}, {})


def test_simulated_addresses_are_stable_and_distinct() -> None:
    assert simulated_address("tray-a") == simulated_address("tray-a")
    assert simulated_address("tray-a") != simulated_address("tray-b")
    assert simulated_address("tray-a").startswith("127.")
