"""``gpu-dra-agent sim xid|recover`` right after ``gpu-dra-agent run --simulate ... &``: the
control socket opens only once the agent's prepare engine runs, a moment after its start, and
the commands wait for it (bounded by ``--wait``) instead of failing; where nothing ever listens
they fail within the bound, naming the socket and what they waited for."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import anyio
import pytest

from agent.sim.control import control_socket_path
from agent.sim.kubelet.health import DeviceHealthState
from tests.integration.conftest import DRIVER, NODE, AgentHarness
from tests.integration.test_health import wait_taints

pytestmark = pytest.mark.anyio

HEALTHY, UNHEALTHY = DeviceHealthState.HEALTHY, DeviceHealthState.UNHEALTHY
GPU = 3


async def sim(
    plugins_dir: Path, op: str, *args: str, wait: float | None = None
) -> tuple[int, str, str]:
    """Run ``gpu-dra-agent sim <op>`` on GPU 3; (exit status, stdout, stderr)."""
    command = [sys.executable, "-m", "agent", "sim", op, "--plugins-dir", str(plugins_dir)]
    command += ["--gpu", str(GPU), "--log-format", "text", *args]
    if wait is not None:
        command += ["--wait", f"{wait:g}"]
    result = await anyio.run_process(command, check=False)
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def start_without_waiting(harness: AgentHarness) -> None:
    """Start the agent and return at once: its control socket is not there yet."""
    await harness.start_agent(wait_registered=False)
    assert not control_socket_path(harness.plugin_dir).exists(), "the agent was up too soon"


async def test_sim_xid_right_after_a_start_waits_for_the_engine(
    fresh_harness: AgentHarness,
) -> None:
    harness = fresh_harness
    await start_without_waiting(harness)
    status, out, err = await sim(harness.plugins_dir, "xid", "--xid", "79")
    assert status == 0, err + (harness.agent.log() if harness.agent else "")
    assert f"xid on GPU {GPU} " in out
    device = f"gpu-{GPU}"
    await harness.kubelet.wait_health(DRIVER, NODE, device, UNHEALTHY, timeout=15)
    await wait_taints(harness, device, [("gpu.nvidia.com/xid", "79", "NoExecute")], timeout=15)

    status, out, err = await sim(harness.plugins_dir, "recover")
    assert status == 0, err
    await wait_taints(harness, device, [], timeout=15)
    await harness.kubelet.wait_health(DRIVER, NODE, device, HEALTHY, timeout=10)
    assert harness.agent is not None
    assert await harness.stop_agent() == 0, harness.agent.log()


async def test_sim_recover_right_after_a_start_waits_for_the_engine(
    fresh_harness: AgentHarness,
) -> None:
    harness = fresh_harness
    await start_without_waiting(harness)
    status, out, err = await sim(harness.plugins_dir, "recover")
    assert harness.agent is not None
    assert status == 0, err + harness.agent.log()
    assert f"recover on GPU {GPU} (GPU-" in out
    await harness.kubelet.wait_health(DRIVER, NODE, f"gpu-{GPU}", HEALTHY, timeout=15)
    assert await harness.stop_agent() == 0, harness.agent.log()
    assert f"simulated fault: recover on GPU {GPU}" in harness.agent.log()


@pytest.mark.parametrize("op", ["xid", "recover"])
async def test_where_nothing_listens_the_wait_ends_with_what_was_waited_for(
    short_dir: Path, op: str
) -> None:
    plugins = short_dir / "nowhere"  # not even the directory: a wrong --plugins-dir
    socket = control_socket_path(plugins.absolute() / DRIVER)
    started = time.monotonic()
    status, out, err = await sim(plugins, op, *(["--xid", "79"] if op == "xid" else []), wait=1.5)
    elapsed = time.monotonic() - started
    assert status == 1 and not out
    # after a second it says that it waits, and for what
    assert f"waiting up to 1.5 s for the simulated agent's control socket {socket}" in err
    assert f"cannot reach the simulated agent's control socket {socket} after 1.5 s of " in err
    assert "waiting for the agent to open it (once its prepare engine runs)" in err
    assert f"its directory {socket.parent} does not exist" in err
    assert "same --plugins-dir and --driver-name" in err
    assert 1.5 <= elapsed < 10, elapsed  # the bound, and not much more (a process start)
