"""IMEX attach: a ComputeDomain channel's prepare on a tray (``python -m benchmarks --only imex``).

The real agent runs as ``gpu-dra-agent run --simulate gb200-nvl72-tray --compute-domains on``
(health monitoring off), the embedded API server and the kubelet emulator in this process. One
ComputeDomain (``numNodes: 0``) is stored and one channel claim holds the node's ``channel-0``
with the domain's ComputeDomainChannelConfig (a hand-written allocation, as the integration
tests make one where no controller runs). Rows:

* ``IMEX attach: channel prepare``: NodePrepareResources of that claim, which writes the
  domain's IMEX configuration, starts the simulated IMEX daemon (a process of its own) and waits
  until it answers, then writes the CDI spec with the channel;
* ``IMEX detach: channel unprepare``: the NodeUnprepareResources that follows each prepare.

No floor: nothing cheaper does the same work.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import anyio

from agent.imex.config import DRIVER as CD_DRIVER
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.claims import AllocatedDevice, OpaqueConfig, create_allocated_claim
from agent.sim.kubelet import ClaimRef, EventKind, KubeletEmulator
from benchmarks import Result
from benchmarks.agent_process import agent_command, start_agent

NODE, NAMESPACE = "bench-tray", "default"


def run(repeat: int) -> list[Result]:
    logging.getLogger("agent").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bi-", dir="/tmp") as folder:
        return anyio.run(measure, Path(folder), max(5, repeat // 3))


async def measure(base: Path, repeat: int) -> list[Result]:
    async with EmbeddedApiServer() as server:
        server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        kubeconfig = server.write_kubeconfig(base / "kubeconfig")
        async with KubeletEmulator(base / "registry", node_name=NODE, poll_interval=0.05) as kl:
            command = agent_command(
                base, kubeconfig, NODE, "gb200-nvl72-tray",
                "--sim-fabric-dir", str(base / "fabric"),
                "--health-monitoring", "false", "--compute-domains", "on",
            )  # fmt: skip
            agent = await start_agent(command, base / "agent.log")
            try:
                await kl.wait_event(EventKind.REGISTERED, CD_DRIVER, timeout=60)
                claim = await channel_claim(server, NODE)
                attach: list[float] = []
                detach: list[float] = []
                for index in range(repeat + 1):  # the first cycle is not counted
                    began = time.perf_counter()
                    answer = (await kl.prepare(CD_DRIVER, [claim]))[claim.uid]
                    prepared = time.perf_counter()
                    assert not answer.error, answer.error
                    answer = (await kl.unprepare(CD_DRIVER, [claim]))[claim.uid]
                    assert not answer.error, answer.error
                    if index:
                        attach.append((prepared - began) * 1000)
                        detach.append((time.perf_counter() - prepared) * 1000)
            finally:
                agent.terminate()
                with anyio.fail_after(20):
                    await agent.wait()
    return [
        Result("IMEX attach: channel prepare (gb200-nvl72-tray)", tuple(attach)),
        Result("IMEX detach: channel unprepare (gb200-nvl72-tray)", tuple(detach)),
    ]


async def channel_claim(server: EmbeddedApiServer, node: str) -> ClaimRef:
    """A ComputeDomain and a claim holding ``node``'s channel-0 in it (no controller)."""
    domain = server.put_object(
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomain",
            "metadata": {"name": "bench", "namespace": NAMESPACE},
            "spec": {
                "numNodes": 0,
                "channel": {
                    "resourceClaimTemplate": {"name": "bench-channel"},
                    "allocationMode": "Single",
                },
            },
        }
    )
    config = OpaqueConfig(
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomainChannelConfig",
            "domainID": domain["metadata"]["uid"],
            "allocationMode": "Single",
        },
        driver=CD_DRIVER,
        requests=("channel",),
    )
    created = await create_allocated_claim(
        server.url,
        "bench-channel-claim",
        [AllocatedDevice("channel", "channel-0", node, driver=CD_DRIVER)],
        namespace=NAMESPACE,
        configs=[config],
        node_name=node,
        device_class_name="compute-domain-default-channel.nvidia.com",
    )
    meta = created["metadata"]
    return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])
