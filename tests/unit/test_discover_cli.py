"""``gpu-dra-agent discover``: the operator's view of a host, for every shipped profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from agent.cli import main
from tests.support.k8s_schema import manifest_errors

PROFILES = [
    "dgx-h100",
    "dgx-a100",
    "gb200-nvl72-tray",
    "l40s-pcie",
    "h200-nvl-bridged",
    "big-mig-host",
]


def discover(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = main(["discover", "--node-name", "node-a", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("version", ["1.34", "1.35"])
def test_yaml_slices_validate_strictly(
    capsys: pytest.CaptureFixture[str], profile: str, version: str
) -> None:
    text = discover(capsys, "--simulate", profile, "-o", "yaml")
    errors = manifest_errors(text, version)
    assert errors == [], "\n".join(map(str, errors))
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert docs and all(d["kind"] == "ResourceSlice" for d in docs)
    assert {d["spec"]["pool"]["resourceSliceCount"] for d in docs} == {len(docs)}


def test_table_shows_dgx_h100_topology(capsys: pytest.CaptureFixture[str]) -> None:
    text = discover(capsys, "--simulate", "dgx-h100", "-o", "table")
    assert "Node node-a: 8 GPU(s)" in text
    assert "2 NUMA node(s), 1 NVLink domain(s)" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("gpu-")]
    assert [r[0] for r in rows] == [f"gpu-{i}" for i in range(8)]
    assert all("H100" in " ".join(r) and "80Gi" in r for r in rows)
    numa = [r[r.index("80Gi") + 1] for r in rows]
    assert sorted(set(numa)) == ["0", "1"] and numa.count("0") == 4
    assert {r[r.index("80Gi") + 3] for r in rows} == {rows[0][rows[0].index("80Gi") + 3]}
    assert "(7 peers)" in text and "capable, disabled" in text


def test_table_of_bridged_host_shows_two_domains(capsys: pytest.CaptureFixture[str]) -> None:
    text = discover(capsys, "--simulate", "h200-nvl-bridged")
    assert "2 NVLink domain(s)" in text
    assert text.count("(1 peers)") == 4


def test_json_has_inventory_and_slices(capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(discover(capsys, "--simulate", "dgx-a100", "-o", "json"))
    gpus = data["inventory"]["gpus"]
    assert len(gpus) == 8 and all(g["mig_enabled"] for g in gpus)
    names = [d["name"] for s in data["resourceSlices"] for d in s["spec"]["devices"]]
    assert len(names) == sum(len(g["mig_devices"]) for g in gpus) >= 32
    assert all("-mig-" in n for n in names)


def test_user_profile_file(capsys: pytest.CaptureFixture[str], tmp_path: os.PathLike[str]) -> None:
    from importlib import resources

    source = (
        resources.files("agent.hardware.simulated")
        .joinpath("profiles", "l40s-pcie.yaml")
        .read_text()
    )
    mine = os.path.join(tmp_path, "mine.yaml")
    with open(mine, "w") as f:
        f.write(source)
    text = discover(capsys, "--simulate", mine)
    assert "4 GPU(s)" in text and "L40S" in text


def test_without_driver_exits_with_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GPU_DRA_SIMULATE"}
    result = subprocess.run(
        [sys.executable, "-m", "agent", "discover"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "NVML library (libnvidia-ml.so.1) was not found" in lines[0]
    assert "--simulate" in lines[0]
    assert result.stdout == ""


def test_unknown_profile_names_the_shipped_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["discover", "--simulate", "no-such-host"]) == 1
    err = capsys.readouterr().err
    assert "no-such-host" in err and "dgx-h100" in err
