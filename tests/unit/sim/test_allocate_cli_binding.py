"""``--binding-timeout`` of ``gpu-dra-agent sim allocate`` and ``sim kubelet --pod`` against a
1.36 embedded API server: the wait is printed, a node whose conditions never come is left for
the next ``--node``; the kubelet emulator's pod waits in PreBind for as long as the flag says,
and starts its prepare once the conditions are True."""

from __future__ import annotations

import subprocess
import sys
from functools import partial
from pathlib import Path

import anyio
import pytest

from agent.sim.allocation import ApiAccess, create_claim
from agent.sim.apiserver import EmbeddedApiServer
from tests.unit.sim.test_binding import (
    READY,
    Obj,
    channel,
    fake_controller,
    results,
    stored,
)
from tests.unit.sim.test_binding import cluster as cluster  # the fixture (1.36)


async def beside_a_controller(
    cluster: EmbeddedApiServer,
    access: ApiAccess,
    answers: dict[str, tuple[str, str]],
    command: list[str],
) -> subprocess.CompletedProcess[bytes]:
    """Run ``command`` while a driver's controller answers claim ``ch`` per node."""
    written: dict[str, Obj] = {}
    async with anyio.create_task_group() as group:
        group.start_soon(partial(fake_controller, cluster, access, "ch", answers, written))
        with anyio.fail_after(60):
            result = await anyio.run_process(command, check=False)
        group.cancel_scope.cancel()  # a controller still waiting for its node must not hang
    return result


@pytest.mark.anyio
async def test_sim_allocate_waits_and_moves_on_after_the_binding_timeout(
    cluster: EmbeddedApiServer, tmp_path: Path
) -> None:
    kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    access = ApiAccess(cluster.url)
    await create_claim(access, channel("ch"))
    command = [sys.executable, "-m", "agent", "sim", "allocate", "--kubeconfig", str(kubeconfig)]
    command += ["--node", "node-a", "--node", "node-b", "--binding-timeout", "2", "default/ch"]
    # node-a never answers, node-b does
    result = await beside_a_controller(cluster, access, {"node-b": (READY, "")}, command)
    out, err = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, out + err
    assert "default/ch: allocated on node-a; PreBind waits up to 2 s for " in out
    assert "compute-domain.nvidia.com/node-a/channel-0 IMEXDaemonReady" in out
    assert "default/ch: binding timeout on node-a after" in err
    assert "allocation undone: binding conditions not True" in err
    assert "default/ch: bound on node-b after" in out
    assert "default/ch: channel=channel-0" in out
    assert (
        stored(cluster, "ch")["status"]["allocation"]["devices"]["results"][0]["pool"] == "node-b"
    )


@pytest.mark.anyio
async def test_sim_allocate_fails_when_no_node_binds(
    cluster: EmbeddedApiServer, tmp_path: Path
) -> None:
    kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    await create_claim(ApiAccess(cluster.url), channel("ch"))
    command = [sys.executable, "-m", "agent", "sim", "allocate", "--kubeconfig", str(kubeconfig)]
    command += ["--node", "node-a", "--binding-timeout", "1", "default/ch"]
    with anyio.fail_after(60):
        result = await anyio.run_process(command, check=False)
    assert result.returncode == 1
    assert "binding timeout on node-a" in result.stderr.decode()
    assert not (stored(cluster, "ch").get("status") or {}).get("allocation")


def kubelet_pod(kubeconfig: Path, registry: Path, *flags: str) -> list[str]:
    """``sim kubelet`` on node-a with one pod whose claim is ``ch``."""
    command = [sys.executable, "-m", "agent", "sim", "kubelet", "--registrar-dir", str(registry)]
    command += ["--node-name", "node-a", "--kubeconfig", str(kubeconfig)]
    return [*command, "--no-wipe-on-start", "--no-auto-wipe", "--pod", "p", "--claim", "ch", *flags]


@pytest.mark.anyio
async def test_sim_kubelet_pod_waits_in_prebind_up_to_the_binding_timeout(
    cluster: EmbeddedApiServer, tmp_path: Path
) -> None:
    kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    await create_claim(ApiAccess(cluster.url), channel("ch"))
    command = kubelet_pod(kubeconfig, tmp_path / "registry", "--binding-timeout", "1")
    with anyio.fail_after(60):
        result = await anyio.run_process([*command, "--pod-timeout", "5"], check=False)
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert "waits in PreBind on node-a for the binding conditions of claims ['ch']" in err
    assert "binding conditions not True within the binding timeout of 1 s" in err
    assert "pod default/p did not start within 5s" in err
    assert not (stored(cluster, "ch").get("status") or {}).get("allocation")  # undone


@pytest.mark.anyio
async def test_a_pod_given_up_in_prebind_gives_its_claim_back(
    cluster: EmbeddedApiServer, tmp_path: Path
) -> None:
    """--pod-timeout ends the start while PreBind still waits: the allocation is undone, as
    the scheduler's Unreserve does, not left to a pod that will never run."""
    kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    await create_claim(ApiAccess(cluster.url), channel("ch"))
    command = kubelet_pod(kubeconfig, tmp_path / "registry", "--binding-timeout", "60")
    with anyio.fail_after(60):
        result = await anyio.run_process([*command, "--pod-timeout", "2"], check=False)
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert "waits in PreBind on node-a" in err and "pod default/p did not start within 2s" in err
    assert "within the binding timeout" not in err
    assert not (stored(cluster, "ch").get("status") or {}).get("allocation")


@pytest.mark.anyio
async def test_sim_kubelet_pod_goes_on_to_prepare_once_the_conditions_are_true(
    cluster: EmbeddedApiServer, tmp_path: Path
) -> None:
    kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    access = ApiAccess(cluster.url)
    await create_claim(access, channel("ch"))
    command = kubelet_pod(kubeconfig, tmp_path / "registry", "--binding-timeout", "30")
    result = await beside_a_controller(
        cluster, access, {"node-a": (READY, "")}, [*command, "--pod-timeout", "4"]
    )
    err = result.stderr.decode()
    # bound on node-a; no compute-domain plugin is registered here, so the prepare waits
    assert result.returncode == 1, err
    assert "within the binding timeout" not in err
    assert "no plugin instance of driver 'compute-domain.nvidia.com' is registered" in err
    assert results(stored(cluster, "ch"))[0]["pool"] == "node-a"
