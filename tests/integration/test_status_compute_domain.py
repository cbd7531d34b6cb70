"""``gpu-dra-agent status`` on a gb200 tray in a ComputeDomain (the real agent, the
controller and the embedded API server of ``compute_domains.Cluster``): it lists the domain
with the node's membership index and its IMEX daemon (pid, ready); an IMEX daemon killed
while the agent is down is one DRIFT line with a hint and exit 1, and the agent's start
makes it exit 0 again.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.imex.daemon_files import CONFIG_FILE
from tests.integration.compute_domains import (
    TRAY,
    Cluster,
    Node,
    eventually,
    imex_daemons,
    running_cluster,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture(scope="module")
async def cluster(workdir: Path) -> AsyncIterator[Cluster]:
    """One gb200 tray (``workdir``: the integration conftest's, one per module)."""
    async with running_cluster(workdir, {"tray-a": (TRAY, "10.0.7.1")}) as cluster:
        yield cluster


async def status(cluster: Cluster, node: Node) -> tuple[int, dict[str, Any], str]:
    command = [sys.executable, "-m", "agent", "status", "--simulate", node.profile]
    command += ["--plugins-dir", str(node.root / "plugins"), "--cdi-root", str(node.root / "cdi")]
    command += ["--node-name", node.name, "--kubeconfig", str(cluster.kubeconfig), "-o", "json"]
    environ = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    result = await anyio.run_process(command, check=False, env=environ)
    assert result.returncode in (0, 1) and result.stdout, result.stderr.decode()
    return result.returncode, json.loads(result.stdout), result.stderr.decode()


async def until_ready(cluster: Cluster, node: Node) -> None:
    """Wait until status exits 0 with the domain's daemon ready (the domain's status)."""
    with anyio.fail_after(30):
        while True:
            code, found, _ = await status(cluster, node)
            domains = found["computeDomains"]
            if code == 0 and domains and domains[0]["imexDaemon"].get("ready") is True:
                return
            await anyio.sleep(0.3)


async def test_a_tray_in_a_domain_and_its_imex_daemon(cluster: Cluster) -> None:
    node = cluster.nodes["tray-a"]
    domain = await cluster.create_domain("cd-status", num_nodes=1)
    uid = domain["metadata"]["uid"]
    claim = await cluster.channel_claim(node, "status-channel", domain)
    answer = await cluster.prepare(node, claim)
    assert not answer.get("error"), f"{answer}\n{node.log()}"

    await until_ready(cluster, node)
    code, found, _ = await status(cluster, node)
    [entry] = found["computeDomains"]
    assert entry["domain"] == "default/cd-status" and entry["uid"] == uid
    assert entry["member"] is True and entry["index"] == 0
    pid = entry["imexDaemon"]["pid"]
    assert entry["imexDaemon"]["alive"] and pid in imex_daemons(node.domain_dir(uid) / CONFIG_FILE)
    assert entry["claims"] == [f"default/status-channel ({claim.uid}) PrepareCompleted"]
    assert found["gpus"] and found["gpus"][0]["model"].startswith("NVIDIA GB200")

    assert await cluster.stop(node) == 0  # the daemon outlives the agent ...
    os.kill(pid, signal.SIGKILL)  # ... until someone kills it
    await eventually(
        lambda: not imex_daemons(node.domain_dir(uid) / CONFIG_FILE), what="the daemon gone"
    )
    code, found, _ = await status(cluster, node)
    assert code == 1 and found["agent"]["running"] is False
    [drift] = found["drift"]
    assert drift["subject"] == f"ComputeDomain default/cd-status ({uid})"
    assert "no IMEX daemon runs" in drift["problem"]
    assert drift["hint"] == "start the agent: its start starts the daemon again"

    await cluster.start(node)
    await until_ready(cluster, node)
    await cluster.unprepare(node, claim)
