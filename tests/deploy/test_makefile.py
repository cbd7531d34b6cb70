"""The Makefile's own preparation steps, run as ``make test`` runs them on a fresh clone.

``make test`` must be self-sufficient: it fetches the CDI schema into a cache inside the
checkout and reports missing system tools up front. These tests run those exact steps.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.dra import cdi
from tests.deploy.conftest import ROOT
from tests.support.cdi_schema import cdi_problems, load_validator

UID = "0e5a2f4c-7d1b-4a8e-9c3f-2b6d8e1a4f70"


def test_schema_step_fills_an_empty_cache_and_validates(tmp_path: Path) -> None:
    if shutil.which("apt-get") is None:
        pytest.skip("not a Debian or Ubuntu machine: the schema comes from a Debian package")
    cache = tmp_path / "cache"
    result = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "cdi-schema", f"CACHE_DIR={cache}"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (cache / "cdi-schema").iterdir()) == ["defs.json", "schema.json"]

    validator = load_validator(cache / "cdi-schema")
    spec = cdi.claim_spec("gpu.nvidia.com", UID, [cdi.ClaimDevice("gpu-0", 0)])
    assert cdi_problems(spec, validator) == []
    # The fetched schema really checks: a device node without a path is refused.
    broken = cdi.claim_spec("gpu.nvidia.com", UID, [cdi.ClaimDevice("gpu-0", 0)])
    for device in broken["devices"]:
        for node in device["containerEdits"].get("deviceNodes", []):
            del node["path"]
    assert broken != spec
    assert any("path" in problem for problem in cdi_problems(broken, validator))

    # A second run finds the cache filled and fetches nothing.
    again = subprocess.run(
        ["make", "-C", str(ROOT), "cdi-schema", f"CACHE_DIR={cache}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "apt-get" not in again.stdout and "fetch_deb_files" not in again.stdout


def _path_with(tmp_path: Path, **tools: str) -> dict[str, str]:
    """An environment whose PATH holds grep plus the given fake tools (name -> script)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "grep").symlink_to(shutil.which("grep") or "/bin/grep")
    for name, body in tools.items():
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(0o755)
    return {**os.environ, "PATH": str(bin_dir)}


def _check_tools(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash") or "/bin/bash"
    return subprocess.run(
        [bash, str(ROOT / "scripts" / "check_tools.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )


def test_missing_tools_are_reported_in_one_line_each(tmp_path: Path) -> None:
    result = _check_tools(_path_with(tmp_path))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("missing: systemd-analyze") and "apt-get install systemd" in lines[0]
    assert lines[1].startswith("missing: kubectl with kustomize v5")
    assert "apt-get install kubectl" in lines[1]


def test_old_kustomize_is_reported(tmp_path: Path) -> None:
    env = _path_with(
        tmp_path,
        **{
            "systemd-analyze": "exit 0",
            "kubectl": "echo 'Client Version: v1.24.0'; echo 'Kustomize Version: v4.5.4'",
        },
    )
    result = _check_tools(env)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert "Kustomize Version: v4.5.4" in result.stderr


def test_present_tools_pass_silently(tmp_path: Path) -> None:
    env = _path_with(
        tmp_path,
        **{"systemd-analyze": "exit 0", "kubectl": "echo 'Kustomize Version: v5.5.0'"},
    )
    result = _check_tools(env)
    assert (result.returncode, result.stderr) == (0, "")
