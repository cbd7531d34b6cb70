"""``gpu-dra-agent probe`` as the DaemonSet runs it: a separate process against the real agent."""

from __future__ import annotations

import os
import sys

import anyio
import pytest

from tests.integration.conftest import DRIVER, AgentHarness

pytestmark = pytest.mark.anyio


async def probe(harness: AgentHarness) -> tuple[int, list[str]]:
    command = [sys.executable, "-m", "agent", "probe"]
    command += ["--registrar-dir", str(harness.registrar_dir)]
    command += ["--plugins-dir", str(harness.plugins_dir)]
    environ = {k: v for k, v in os.environ.items() if k != "POD_UID"}
    with anyio.fail_after(30):
        result = await anyio.run_process(command, check=False, env=environ)
    lines = (result.stdout + result.stderr).decode().splitlines()
    return result.returncode, lines


async def test_probe_passes_while_the_agent_serves_and_fails_once_it_stopped(
    harness: AgentHarness,
) -> None:
    status, lines = await probe(harness)
    assert status == 0, lines
    assert len(lines) == 1 and lines[0].startswith(f"ok: {DRIVER} answered GetInfo")
    assert await harness.stop_agent() == 0
    status, lines = await probe(harness)
    assert status == 1 and len(lines) == 1
    assert "does not exist" in lines[0], "the agent removed its sockets on SIGTERM"
