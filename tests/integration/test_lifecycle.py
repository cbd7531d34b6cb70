"""The agent process's life: stale sockets at start, SIGTERM at the end, bad settings, a demo."""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path

import anyio
import pytest

from tests.integration.conftest import DRIVER, AgentHarness, gpu_request

pytestmark = pytest.mark.anyio


def stale_socket(path: Path) -> None:
    """A socket file nobody listens on, as a SIGKILLed agent leaves it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()


async def test_stale_sockets_replaced_and_removed_on_sigterm(fresh_harness: AgentHarness) -> None:
    harness = fresh_harness
    stale_socket(harness.dra_socket)
    stale_socket(harness.registration_socket)
    await harness.start_agent()  # registration through the replaced sockets
    ref, _ = await harness.allocate(gpu_request())
    assert (await harness.prepare(ref))[ref.uid].error == ""
    assert await harness.stop_agent() == 0
    assert not harness.dra_socket.exists()
    assert not harness.registration_socket.exists()
    await harness.kubelet.wait_deregistered(DRIVER)
    # a restarted agent serves the claim it prepared before (from its checkpoint)
    await harness.start_agent()
    assert (await harness.unprepare(ref))[ref.uid].error == ""
    assert await harness.stop_agent() == 0


async def test_instance_id_names_the_sockets_and_sigint_stops(
    fresh_harness: AgentHarness,
) -> None:
    harness = fresh_harness
    agent = await harness.start_agent(args=["--instance-id", "pod-1234"])
    registration = harness.kubelet.registrations(DRIVER)[-1]
    assert registration.socket == harness.registrar_dir / f"{DRIVER}-pod-1234-reg.sock"
    assert registration.endpoint == str(harness.plugin_dir / "dra-pod-1234.sock")
    ref, _ = await harness.allocate(gpu_request())
    assert (await harness.prepare(ref))[ref.uid].error == ""
    assert (await harness.unprepare(ref))[ref.uid].error == ""
    assert await agent.stop(signal_number=signal.SIGINT) == 0
    assert not list(harness.workdir.rglob("*.sock"))


async def test_invalid_settings_exit_1_with_a_message(fresh_harness: AgentHarness) -> None:
    command = [*fresh_harness.command(), "--driver-name", "Not A Driver"]
    result = await anyio.run_process(command, check=False)
    assert result.returncode == 1
    assert b"--driver-name 'Not A Driver' is not a valid DRA driver name" in result.stderr


@pytest.mark.slow
async def test_demo_exits_0() -> None:
    result = await anyio.run_process([sys.executable, "-m", "agent", "demo"], check=False)
    output = result.stdout.decode()
    assert result.returncode == 0, output + result.stderr.decode()
    assert "registered gpu.nvidia.com" in output
    assert "CDI device k8s.gpu.nvidia.com/" in output
    assert "ResourceSlice taint on gpu-3: gpu.nvidia.com/xid=79:NoExecute" in output
    assert "gpu-3 Healthy again" in output
    assert "time-sliced (Long) by the" in output  # nvidia.com/gpu: 2 served by DRA (KEP-5004)
    assert "the first prepare as one trace" in output
    tree = output.split("the first prepare as one trace")[1].splitlines()[1:]
    assert (
        tree[0].strip().startswith("k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources")
    )
    assert any(line.startswith("       resourceclaim.get") for line in tree)  # two levels down
    assert "demo finished: every step worked" in output
    # readable: the slice listing summarises each slice (dynamic MIG: 208 devices in 9
    # slices), and explain's table of the third 4-GPU claim fits a screen
    slices = output.split("ResourceSlices published")[1].split("\n5.")[0].splitlines()[1:]
    assert len(slices) == 9 and all(len(line) <= 160 for line in slices), slices
    assert any("1 gpu device(s) (gpu-0), 25 mig device(s)" in line for line in slices)
    table = output.split("gpu-dra-agent explain on a third claim")[1].split("\n6.")[0]
    assert len(table.splitlines()) <= 40 and "allocated to default/one-gpu" in table
