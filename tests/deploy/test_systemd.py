"""systemd/: the unit passes ``systemd-analyze verify``, says what the issue asks, agrees with
the agent's settings, and ``install.sh`` lays the files out (and removes them) as documented.

``systemd-analyze verify`` exits 0 on most mistakes and only warns on stderr
(dependency-notes.md §6c), so any stderr output fails the test; and it needs an ExecStart
that exists, so the unit is rendered with this checkout's ``gpu-dra-agent``.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from agent.cli import build_parser
from agent.config import (
    DEFAULT_CDI_ROOT,
    DEFAULT_PLUGINS_DIR,
    DEFAULT_REGISTRAR_DIR,
    SETTINGS,
    load_config,
)
from tests.deploy.conftest import ROOT, SYSTEMD, require_tool

UNIT = SYSTEMD / "gpu-dra-agent.service"
INSTALLED_BINARY = "/opt/gpu-dra-agent/venv/bin/gpu-dra-agent"
AGENT_BINARY = Path(sys.executable).parent / "gpu-dra-agent"


def directives(text: str) -> dict[str, list[str]]:
    """``Section.Key`` -> values, in order (keys may repeat)."""
    found: dict[str, list[str]] = defaultdict(list)
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        found[f"{section}.{key}"].append(value)
    return found


def verify(text: str, folder: Path) -> subprocess.CompletedProcess[str]:
    analyze = require_tool("systemd-analyze")
    unit = folder / "gpu-dra-agent.service"
    unit.write_text(text)
    return subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
    )


def rendered() -> str:
    assert AGENT_BINARY.is_file(), f"{AGENT_BINARY} is missing; install the project (make)"
    text = UNIT.read_text()
    assert INSTALLED_BINARY in text
    return text.replace(INSTALLED_BINARY, str(AGENT_BINARY))


def test_systemd_analyze_verify_is_silent(tmp_path: Path) -> None:
    result = verify(rendered(), tmp_path)
    assert (result.returncode, result.stderr, result.stdout) == (0, "", "")


def test_systemd_analyze_verify_would_catch_mistakes(tmp_path: Path) -> None:
    typo = rendered().replace("Type=notify", "Type=notifyy")
    assert "Failed to parse service type" in verify(typo, tmp_path).stderr
    missing = rendered().replace(str(AGENT_BINARY), "/nonexistent/gpu-dra-agent")
    assert verify(missing, tmp_path).returncode != 0


def test_unit_is_a_watched_notify_service_that_restarts_with_backoff() -> None:
    unit = directives(UNIT.read_text())
    assert unit["Service.Type"] == ["notify"]
    assert unit["Service.NotifyAccess"] == ["main"]
    assert unit["Service.WatchdogSec"] == ["30s"]
    assert unit["Service.Restart"] == ["always"]
    assert unit["Service.RestartSec"] == ["5s"]
    # the MPS and IMEX daemons of prepared claims outlive a restart of the agent
    assert unit["Service.KillMode"] == ["process"]
    assert unit["Unit.StartLimitIntervalSec"] == ["10min"]
    assert unit["Unit.StartLimitBurst"] == ["10"]
    assert unit["Service.EnvironmentFile"] == ["-/etc/gpu-dra-agent/agent.env"]
    for key in ("Unit.After", "Unit.Wants"):
        (value,) = unit[key]
        assert {"kubelet.service", "nvidia-persistenced.service"} <= set(value.split()), key
    assert "Unit.Requires" not in unit  # a kubelet restart must not stop the agent


def test_exec_start_is_a_valid_run_command_logging_json() -> None:
    (exec_start,) = directives(UNIT.read_text())["Service.ExecStart"]
    words = shlex.split(exec_start)
    assert words[0] == INSTALLED_BINARY
    assert words[-1] == "$GPU_DRA_AGENT_ARGS"
    argv = words[1:-1] + env_file()["GPU_DRA_AGENT_ARGS"].split()
    args = build_parser(argv).parse_args(argv)
    assert args.log_format == "json" and args.log_level == "info"


def test_hardening_keeps_device_access_and_the_agents_directories() -> None:
    unit = directives(UNIT.read_text())
    assert unit["Service.ProtectSystem"] == ["strict"]
    (writable,) = unit["Service.ReadWritePaths"]
    paths = {p.lstrip("-") for p in writable.split()}
    # /var/run is a symlink to /run; systemd wants the real path
    defaults = {str(DEFAULT_REGISTRAR_DIR), str(DEFAULT_PLUGINS_DIR)}
    defaults.add(str(DEFAULT_CDI_ROOT).replace("/var/run/", "/run/"))
    assert paths == defaults
    for closed in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock", "ProcSubset"):
        assert f"Service.{closed}" not in unit, f"{closed} would cut the agent off the GPUs"
    assert unit["Service.NoNewPrivileges"] == ["yes"]
    assert unit["Service.SystemCallFilter"] == ["@system-service"]


def env_file() -> dict[str, str]:
    values = {}
    for line in (SYSTEMD / "agent.env").read_text().splitlines():
        line = line.strip().lstrip("#")
        if "=" in line and line.split("=", 1)[0].isupper():
            key, _, value = line.partition("=")
            values[key] = value
    return values


def test_env_file_names_only_variables_the_agent_reads() -> None:
    values = env_file()
    known = {s.env for s in SETTINGS if s.env} | {
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_TRACES_EXPORTER",
        "OTEL_METRICS_EXPORTER",
        "GPU_DRA_AGENT_ARGS",
    }
    assert set(values) <= known, set(values) - known
    assert {"NODE_NAME", "KUBECONFIG", "GPU_DRA_AGENT_ARGS"} <= set(values)
    # the values given (commented or not) load as a valid configuration
    environ = {k: v for k, v in values.items() if k != "KUBECONFIG"}
    environ["NODE_NAME"] = "gpu-node-1"
    config = load_config({}, environ)
    assert config.registrar_dir == DEFAULT_REGISTRAR_DIR
    assert config.plugins_dir == DEFAULT_PLUGINS_DIR


def run_install(*args: str) -> subprocess.CompletedProcess[str]:
    require_tool("bash")
    return subprocess.run(
        ["bash", str(SYSTEMD / "install.sh"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_install_script_lays_out_and_removes_the_files(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kc.yaml"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    root = tmp_path / "root"
    common = ("--root", str(root), "--skip-venv")
    first = run_install(*common, "--node-name", "gpu-node-1", "--kubeconfig", str(kubeconfig))
    assert first.returncode == 0, first.stderr
    unit = root / "etc/systemd/system/gpu-dra-agent.service"
    env = root / "etc/gpu-dra-agent/agent.env"
    assert unit.read_text() == UNIT.read_text()
    assert "NODE_NAME=gpu-node-1\n" in env.read_text() and "@" not in env.read_text()
    assert ((root / "etc/gpu-dra-agent/kubeconfig").stat().st_mode & 0o777) == 0o600
    doc = root / "opt/gpu-dra-agent/OPERATIONS.md"
    assert doc.read_text() == (ROOT / "docs/OPERATIONS.md").read_text()
    assert directives(unit.read_text())["Unit.Documentation"] == [f"file:/{doc.relative_to(root)}"]

    env.write_text(env.read_text() + "GPU_DRA_AGENT_ARGS=--log-level debug\n")
    again = run_install(*common, "--node-name", "other")
    assert again.returncode == 0 and "kept" in again.stdout
    assert "--log-level debug" in env.read_text(), "an upgrade keeps the operator's settings"

    removed = run_install("--root", str(root), "--uninstall")
    assert removed.returncode == 0, removed.stderr
    assert not unit.exists() and not (root / "opt/gpu-dra-agent").exists()
    assert env.exists()
    purged = run_install("--root", str(root), "--uninstall", "--purge")
    assert purged.returncode == 0 and not env.parent.exists()


def test_install_script_refuses_unknown_options() -> None:
    result = run_install("--frobnicate")
    assert result.returncode == 2 and "unknown option --frobnicate" in result.stderr


@pytest.mark.parametrize("script", ["install.sh"])
def test_shell_syntax(script: str) -> None:
    result = subprocess.run(["bash", "-n", str(SYSTEMD / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
