"""``gpu-dra-agent status`` on a simulated host laid out in a temporary directory, without
an agent: what it reads, its exit status for each kind of bad input (a precise line, never
a traceback), and that it writes nothing."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.cli import build_parser, main
from agent.config import SIMULATED_HOST_DIR
from agent.dra.config import default_config
from agent.hardware.hostfiles import HostFiles
from agent.hardware.simulated.host import SimulatedHost
from agent.node import checkpoint as cp
from agent.node.cdi import CdiSpecDirectory
from agent.node.checkpoint_store import FILE_NAME
from agent.node.facts import claim_spec
from agent.status import cli as status_cli
from agent.status.cli import CANNOT_READ, CONSISTENT, DRIFT

DRIVER = "gpu.nvidia.com"


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A plugins directory with a simulated dgx-h100 laid out as the agent would."""
    plugins = tmp_path / "plugins"
    with SimulatedHost.start("dgx-h100", plugins / DRIVER / SIMULATED_HOST_DIR):
        pass
    return plugins


def status(capsys: pytest.CaptureFixture[str], plugins: Path, *extra: str) -> tuple[int, str, str]:
    cdi = plugins.parent / "cdi"
    argv = ["status", "--simulate", "dgx-h100", "--plugins-dir", str(plugins)]
    code = main([*argv, "--cdi-root", str(cdi), "--node-name", "node-a", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(root: Path) -> dict[str, Any]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*")}


def test_no_simulated_host_cannot_be_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    code, out, err = status(capsys, tmp_path / "plugins")
    assert code == CANNOT_READ and out == ""
    assert err.startswith("status: cannot read: no simulated host under") and "Traceback" not in err


def test_an_idle_node_without_an_agent(
    host: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    (host.parent / "cdi").mkdir()
    (host.parent / "cdi" / "k8s.gpu.nvidia.com-common.json").write_text("{}")
    before = snapshot(host.parent)
    code, out, _ = status(capsys, host, "-o", "json")
    document = json.loads(out)
    assert code == CONSISTENT and document["drift"] == []
    assert document["agent"]["running"] is False and document["agent"]["slices"] is None
    assert document["agent"]["checkpointStatus"] == "missing"
    assert len(document["gpus"]) == 8 and document["gpus"][0]["model"].startswith("NVIDIA H100")
    assert snapshot(host.parent) == before  # read-only


def test_a_missing_common_spec_is_drift_with_a_hint(
    host: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    code, out, _ = status(capsys, host)
    [line] = [line for line in out.splitlines() if line.startswith("DRIFT ")]
    assert code == DRIFT and "common spec is missing" in line
    assert line.endswith("-> start the agent: its start writes it again")


@pytest.mark.parametrize("content", [b"not json", b'{"schemaVersion": 1}', b"\xff\xfe"])
def test_a_corrupt_checkpoint_is_drift_and_stays_where_it_is(
    host: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, content: bytes
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    (host.parent / "cdi").mkdir()
    (host.parent / "cdi" / "k8s.gpu.nvidia.com-common.json").write_text("{}")
    checkpoint = host / DRIVER / FILE_NAME
    checkpoint.write_bytes(content)
    code, out, err = status(capsys, host)
    [line] = [line for line in out.splitlines() if line.startswith("DRIFT ")]
    assert code == DRIFT and f"checkpoint {checkpoint}: cannot be loaded" in line, err
    assert "moves it aside" in line
    assert checkpoint.read_bytes() == content  # not moved aside: that is the agent's job
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == [FILE_NAME, SIMULATED_HOST_DIR]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_an_unreadable_plugin_directory_cannot_be_read(
    host: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    (host / DRIVER).chmod(0)
    try:
        code, _, err = status(capsys, host)
    finally:
        (host / DRIVER).chmod(0o755)
    assert code == CANNOT_READ and "not readable" in err


def test_an_unreachable_api_server_cannot_be_read(
    host: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
        "users: [{name: u, user: {}}]\n"
    )
    code, out, err = status(
        capsys, host, "--kubeconfig", str(kubeconfig), "--api-timeout-seconds", "2"
    )
    assert code == CANNOT_READ and out == ""
    assert err.startswith("status: cannot read: the API server could not be read"), err


def test_a_missing_kubeconfig_cannot_be_read(
    host: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = status(capsys, host, "--kubeconfig", str(tmp_path / "nope"))
    assert code == CANNOT_READ and "does not exist" in err


def test_claim_specs_against_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepared claim whose spec differs, one whose spec is gone, a spec no entry owns:
    one line each; the spec of the claim that matches gives none."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    plugins = tmp_path / "plugins"
    root = plugins / DRIVER / SIMULATED_HOST_DIR
    with SimulatedHost.start("dgx-h100", root) as simulated:
        gpus = simulated.profile.gpus
    boot = HostFiles(root).boot_id()
    assert boot is not None
    uids = [str(uuid.UUID(int=n)) for n in range(1, 5)]
    claims = {}
    for index, uid in enumerate(uids[:3]):
        device = cp.PreparedDevice(
            ("gpu",), "node-a", f"gpu-{gpus[index].minor}", (), "gpu", gpus[index].uuid,
            gpus[index].minor, default_config("gpu"),
        )  # fmt: skip
        claims[uid] = cp.PreparedClaim(
            uid, "default", f"c{index}", cp.ClaimState.PREPARE_COMPLETED, (device,)
        )
    (plugins / DRIVER / FILE_NAME).write_bytes(cp.encode(cp.Checkpoint(boot, claims)))
    specs = CdiSpecDirectory(tmp_path / "cdi", DRIVER)
    specs.write_common({"kind": "k8s.gpu.nvidia.com/claim"})
    matches, differs, gone = uids[:3]
    specs.write_claim(matches, claim_spec(DRIVER, matches, claims[matches].devices))
    specs.write_claim(differs, {"kind": "k8s.gpu.nvidia.com/claim", "devices": []})
    specs.write_claim(uids[3], {"kind": "k8s.gpu.nvidia.com/claim", "devices": []})
    code, out, _ = status(capsys, plugins)
    drift = sorted(line for line in out.splitlines() if line.startswith("DRIFT "))
    assert code == DRIFT and len(drift) == 3, out
    assert f"({differs}): its CDI spec" in drift[1] and "differs from the checkpoint" in drift[1]
    assert f"({gone}): prepared in the checkpoint, but its CDI spec" in drift[2]
    assert str(specs.claim_path(uids[3])) in drift[0] and "no checkpoint entry owns" in drift[0]
    assert all("start the agent" in line for line in drift)


@pytest.mark.anyio
async def test_watch_redraws_every_two_seconds(
    host: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(status_cli, "WATCH_INTERVAL_S", 0.2)
    argv = ["status", "--simulate", "dgx-h100", "--plugins-dir", str(host), "--watch"]
    args = build_parser(argv).parse_args([*argv, "--cdi-root", str(host.parent / "cdi")])
    out = ""
    # until three frames are out (about 1 s; a frame's collection waits for the CPU under
    # the parallel suite's load: one second alone drew only two there), at most 10 s
    with anyio.move_on_after(10.0):
        async with anyio.create_task_group() as group:
            group.start_soon(status_cli.run, args)
            while out.count("\x1b[H\x1b[2J") < 3:
                await anyio.sleep(0.05)
                out += capsys.readouterr().out
            group.cancel_scope.cancel()
    out += capsys.readouterr().out
    assert out.count("\x1b[H\x1b[2J") >= 3 and out.count("1 drift finding(s)") >= 3
