"""Settings: precedence (flags > environment > config file > defaults) and validation messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.config import AgentConfig, ConfigError, load_config


def flags(**given: Any) -> dict[str, Any]:
    return given


def test_defaults_with_only_a_node_name() -> None:
    config = load_config(flags(node_name="node-a"), {})
    assert config == AgentConfig(
        node_name="node-a",
        kubeconfig=None,
        driver_name="gpu.nvidia.com",
        registrar_dir=Path("/var/lib/kubelet/plugins_registry"),
        plugins_dir=Path("/var/lib/kubelet/plugins"),
        cdi_root=Path("/var/run/cdi"),
        driver_root=Path("/"),
        host_root=Path("/"),
        simulate=None,
        instance_id=None,
    )
    assert config.dra_socket == Path("/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock")
    assert config.registration_socket == Path(
        "/var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock"
    )


def test_flags_beat_environment_beats_file_beats_default(tmp_path: Path) -> None:
    config_file = tmp_path / "agent.yaml"
    config_file.write_text(
        "node-name: from-file\ncdi-root: /file/cdi\nplugins_dir: /file/plugins\n"
        "registrar-dir: /file/registry\n"
    )
    environ = {"NODE_NAME": "from-env", "CDI_ROOT": "/env/cdi"}
    config = load_config(flags(node_name="from-flag"), environ, config_file)
    assert config.node_name == "from-flag"  # flag over environment and file
    assert config.cdi_root == Path("/env/cdi")  # environment over file
    assert config.plugins_dir == Path("/file/plugins")  # file over default (snake_case key)
    assert config.registrar_dir == Path("/file/registry")
    assert config.driver_name == "gpu.nvidia.com"  # default


def test_driver_root_mount_defaults_to_the_driver_root() -> None:
    plain = load_config(flags(node_name="node-a", driver_root="/run/nvidia/driver"), {})
    assert plain.driver_root_mount is None
    assert plain.driver_files == Path("/run/nvidia/driver")
    mounted = load_config(
        flags(node_name="node-a"),
        {"NVIDIA_DRIVER_ROOT": "/run/nvidia/driver", "NVIDIA_DRIVER_ROOT_MOUNT": "/driver-root"},
    )
    assert mounted.driver_root == Path("/run/nvidia/driver")
    assert mounted.driver_files == Path("/driver-root")


def test_environment_variables_are_read() -> None:
    environ = {
        "NODE_NAME": "node-b",
        "KUBELET_REGISTRAR_DIRECTORY_PATH": "/r",
        "KUBELET_PLUGINS_DIRECTORY_PATH": "/p",
        "NVIDIA_DRIVER_ROOT": "/run/nvidia/driver",
        "GPU_DRA_SIMULATE": "dgx-a100",
        "POD_UID": "5D4C7B3A-0000-4000-8000-000000000001",
    }
    config = load_config(flags(), environ)
    assert config.node_name == "node-b"
    assert config.driver_root == Path("/run/nvidia/driver")
    assert config.simulate == "dgx-a100"
    # rolling update: one socket name per instance (the pod UID, lower-cased)
    uid = "5d4c7b3a-0000-4000-8000-000000000001"
    assert config.instance_id == uid
    assert config.dra_socket == Path(f"/p/gpu.nvidia.com/dra-{uid}.sock")
    assert config.registration_socket == Path(f"/r/gpu.nvidia.com-{uid}-reg.sock")


def test_simulate_puts_host_and_driver_root_under_the_plugin_dir() -> None:
    config = load_config(flags(node_name="n", simulate="dgx-h100", plugins_dir="/p"), {})
    assert config.host_root == Path("/p/gpu.nvidia.com/simulated-host")
    assert config.driver_root == config.host_root / "driver-root"  # lay_out_host puts it there
    given = load_config(flags(node_name="n", simulate="dgx-h100", host_root="/h"), {})
    assert given.host_root == Path("/h")


def test_relative_paths_become_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(flags(node_name="n", cdi_root="cdi"), {})
    assert config.cdi_root == tmp_path / "cdi"


@pytest.mark.parametrize(
    ("given", "environ", "message"),
    [
        ({}, {}, "the node name is required: pass --node-name or set NODE_NAME"),
        ({"node_name": "Node_A"}, {}, "--node-name 'Node_A' is not a valid node name"),
        ({}, {"NODE_NAME": "a..b"}, "NODE_NAME 'a..b' is not a valid node name"),
        (
            {"node_name": "n", "driver_name": "GPU"},
            {},
            "--driver-name 'GPU' is not a valid DRA driver name",
        ),
        (
            {"node_name": "n", "instance_id": "a/b"},
            {},
            "--instance-id 'a/b' is not a valid instance id",
        ),
        ({"node_name": "n"}, {"POD_UID": "x" * 64}, "POD_UID"),
        ({"node_name": "n", "kubeconfig": "/nonexistent/k"}, {}, "kubeconfig /nonexistent/k"),
        ({"node_name": "n"}, {"KUBECONFIG": "/a:/b"}, "KUBECONFIG names several files"),
        ({"node_name": "n", "simulate": " "}, {}, "--simulate is empty"),
        ({"node_name": "n", "plugins_dir": "/" + "p" * 120}, {}, "shorten --plugins-dir"),
        (
            {"node_name": "n"},
            {"KUBELET_REGISTRAR_DIRECTORY_PATH": "/" + "r" * 100},
            "shorten KUBELET_REGISTRAR_DIRECTORY_PATH",
        ),
    ],
)
def test_validation_names_the_source(
    given: dict[str, Any], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(given, environ)
    assert message in str(caught.value)


def test_config_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("node-name: n\nnode-nmae: typo\n")
    with pytest.raises(ConfigError, match="unknown key 'node-nmae'"):
        load_config(flags(), {}, path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping of settings"):
        load_config(flags(), {}, path)
    path.write_text("node-name: [a, b]\n")
    with pytest.raises(ConfigError, match="key 'node-name' needs a single value"):
        load_config(flags(), {}, path)
    path.write_text("node-name: a\nnode_name: b\n")
    with pytest.raises(ConfigError, match="given twice"):
        load_config(flags(), {}, path)
    path.write_text("node-name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(flags(), {}, path)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(flags(), {}, tmp_path / "missing.yaml")


def test_file_values_are_named_by_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("node-name: Bad_Name\n")
    with pytest.raises(ConfigError, match=r"agent\.yaml: node-name 'Bad_Name' is not a valid"):
        load_config(flags(), {}, path)


def test_empty_environment_variable_counts_as_unset() -> None:
    config = load_config(flags(node_name="n"), {"CDI_ROOT": ""})
    assert config.cdi_root == Path("/var/run/cdi")


def test_run_command_reports_config_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main

    assert main(["run", "--node-name", "Not_Valid"]) == 1
    assert "--node-name 'Not_Valid' is not a valid node name" in capsys.readouterr().err


def test_health_settings_from_flags_beat_the_environment() -> None:
    from agent.run import configure_parser
    from agent.switches import SwitchParser

    parser = SwitchParser()
    configure_parser(parser)
    args = parser.parse_args(
        [
            "--node-name",
            "node-a",
            "--health-monitoring",
            "false",
            "--health-quarantine-seconds",
            "60",
        ]
    )
    config = load_config(vars(args), {"GPU_DRA_HEALTH_MONITORING": "true"})
    assert config.health_monitoring is False
    assert config.health.quarantine_seconds == 60


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0.0.0.0:9464", ("0.0.0.0", 9464)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        (":9464", ("0.0.0.0", 9464)),
        ("[::]:9464", ("::", 9464)),
        ("localhost:9100", ("localhost", 9100)),
    ],
)
def test_metrics_address_is_host_and_port(value: str, expected: tuple[str, int]) -> None:
    from_flag = load_config({"node_name": "node-a", "metrics_address": value}, {})
    from_env = load_config({"node_name": "node-a"}, {"GPU_DRA_METRICS_ADDRESS": value})
    assert from_flag.metrics_address == from_env.metrics_address == expected
    assert load_config({"node_name": "node-a"}, {}).metrics_address is None


@pytest.mark.parametrize("value", ["9464", "host:", "host:http", ":70000", "::1:9464", "a b:1"])
def test_a_bad_metrics_address_names_its_source(value: str) -> None:
    with pytest.raises(ConfigError, match=r"GPU_DRA_METRICS_ADDRESS .* is not a listen address"):
        load_config({"node_name": "node-a"}, {"GPU_DRA_METRICS_ADDRESS": value})


def test_dynamic_mig_settings_defaults_and_sources(tmp_path: Path) -> None:
    base = {"node_name": "node-a"}
    config = load_config(base, {})
    assert (config.dynamic_mig, config.slice_layout) == (False, "auto")
    assert (config.adopt_mig_instances, config.mig_mode_off_when_idle) == (False, True)
    config = load_config(
        {**base, "slice_layout": "split"},
        {"GPU_DRA_DYNAMIC_MIG": "true", "GPU_DRA_MIG_MODE_OFF_WHEN_IDLE": "false"},
    )
    assert (config.dynamic_mig, config.slice_layout, config.mig_mode_off_when_idle) == (
        True,
        "split",
        False,
    )
    file = tmp_path / "agent.yaml"
    file.write_text("dynamic-mig: true\nadopt-mig-instances: yes\n")
    config = load_config(base, {}, file)
    assert config.dynamic_mig and config.adopt_mig_instances


def test_slice_layout_must_be_known() -> None:
    with pytest.raises(ConfigError, match=r"--slice-layout 'both' is not one of auto, combined"):
        load_config({"node_name": "node-a", "slice_layout": "both"}, {})


def test_api_timeout_flag_beats_environment_beats_file_beats_default(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("node-name: n\napi_timeout_seconds: 3\n")  # snake_case key, like the others
    env = {"GPU_DRA_API_TIMEOUT_SECONDS": "2.5"}
    assert load_config(flags(node_name="n"), {}).api_timeout_s == 10.0
    assert load_config(flags(), {}, path).api_timeout_s == 3.0
    assert load_config(flags(), env, path).api_timeout_s == 2.5
    assert load_config(flags(api_timeout_seconds="1.5"), env, path).api_timeout_s == 1.5
    path.write_text("node-name: n\napi-timeout-seconds: 40\n")  # the largest accepted
    assert load_config(flags(), {}, path).api_timeout_s == 40.0


@pytest.mark.parametrize("value", ["0", "-1", "41", "soon", "", "nan", "inf"])
def test_a_bad_api_timeout_names_its_source(tmp_path: Path, value: str) -> None:
    bound = r"is not a number of seconds in \(0, 40\]: it bounds each call to the API server"
    if value:  # an empty variable counts as unset
        with pytest.raises(ConfigError, match=rf"^GPU_DRA_API_TIMEOUT_SECONDS '{value}' {bound}"):
            load_config(flags(node_name="n"), {"GPU_DRA_API_TIMEOUT_SECONDS": value})
    with pytest.raises(ConfigError, match=rf"^--api-timeout-seconds '{value}' {bound}"):
        load_config(flags(node_name="n", api_timeout_seconds=value), {})
    path = tmp_path / "agent.yaml"
    path.write_text(f"node-name: n\napi-timeout-seconds: '{value}'\n")
    with pytest.raises(ConfigError, match=rf"agent\.yaml: api-timeout-seconds '{value}' {bound}"):
        load_config(flags(), {}, path)


def test_the_controller_takes_the_api_timeout_like_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gpu-dra-agent controller --api-timeout-seconds`` (or the variable) is validated the
    same way before the controller touches the API server."""
    import anyio

    from agent.cli import build_parser
    from agent.imex.controller import run

    argv = ["controller", "--api-timeout-seconds", "0"]
    monkeypatch.setenv("GPU_DRA_API_TIMEOUT_SECONDS", "soon")  # the flag wins
    with pytest.raises(ConfigError, match=r"^--api-timeout-seconds '0' is not a number of sec"):
        anyio.run(run, build_parser(argv).parse_args(argv))
    argv = ["controller"]
    with pytest.raises(ConfigError, match=r"^GPU_DRA_API_TIMEOUT_SECONDS 'soon' is not a numb"):
        anyio.run(run, build_parser(argv).parse_args(argv))


def test_consumable_shares_from_flag_env_and_file(tmp_path: Path) -> None:
    base = {"node_name": "node-a"}
    assert load_config(base, {}).consumable_shares == "disabled"
    assert load_config({**base, "consumable_shares": "Memory"}, {}).consumable_shares == "memory"
    env = {"GPU_DRA_CONSUMABLE_SHARES": "8"}
    assert load_config(base, env).consumable_shares == "8"
    file = tmp_path / "agent.yaml"
    file.write_text("consumable-shares: unlimited\n")
    assert load_config(base, {}, file).consumable_shares == "unlimited"
    assert load_config(base, env, file).consumable_shares == "8"  # env beats the file


@pytest.mark.parametrize("value", ["0", "all", "1.5"])
def test_a_bad_consumable_shares_mode_names_its_source(value: str) -> None:
    with pytest.raises(ConfigError, match=r"GPU_DRA_CONSUMABLE_SHARES: .* is not a consumable"):
        load_config({"node_name": "node-a"}, {"GPU_DRA_CONSUMABLE_SHARES": value})


def test_device_order_from_flag_environment_or_file(tmp_path: Path) -> None:
    """names (the incumbent's) unless asked; anything else is refused naming the choices."""
    base = {"node_name": "node-a"}
    assert load_config(base, {}).device_order == "names"
    assert load_config({**base, "device_order": "packing"}, {}).device_order == "packing"
    assert load_config(base, {"GPU_DRA_DEVICE_ORDER": "packing"}).device_order == "packing"
    file = tmp_path / "agent.yaml"
    file.write_text("device-order: packing\n")
    assert load_config(base, {}, file).device_order == "packing"
    with pytest.raises(ConfigError, match=r"--device-order 'best' is not one of packing, names"):
        load_config({**base, "device_order": "best"}, {})
