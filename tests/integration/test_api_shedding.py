"""An API server that sheds load at start: agents of both drivers and the controller ride it out.

A fleet restarting at once meets kube-apiserver's priority and fairness: every request is
answered 429 with ``Retry-After`` until seats free up. Here the embedded API server answers
every request that way for :data:`SHEDDING_S` seconds while two GB200 trays (each serving
``gpu.nvidia.com`` and ``compute-domain.nvidia.com``), an H100 node and the controller start.
Nobody may exit; within :data:`CONVERGE_S` seconds of the shedding's end every pool is
published whole, the controller leads and has given the ComputeDomain created meanwhile its
finalizer and template; and the server's request log shows no client that came back sooner
than a ``Retry-After`` it was given (per client, by ``User-Agent``, and per method and path).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from pathlib import Path

import anyio
import pytest

from agent.imex.config import DRIVER as CD_DRIVER
from agent.sim.allocation import published_pool
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.deviceclasses import default_device_classes
from tests.integration.compute_domains import (
    DRIVER_NAMESPACE,
    TRAY,
    Cluster,
    eventually,
    start_controller,
    stop_all,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

GPU_DRIVER = "gpu.nvidia.com"
#: How long the server answers everything 429, and the promise after it.
SHEDDING_S = 20.0
CONVERGE_S = 10.0
RETRY_AFTER_S = 1
NODES = {"tray-a": (TRAY, "127.0.7.1"), "tray-b": (TRAY, "127.0.7.2"), "h100": ("dgx-h100", "")}


async def test_agents_and_controller_ride_out_a_shedding_api_server(short_dir: Path) -> None:
    workdir = short_dir
    async with EmbeddedApiServer() as server, contextlib.AsyncExitStack() as stack:
        for device_class in default_device_classes():
            server.put_object(device_class)
        cluster = Cluster(workdir, server)
        try:
            for name, (profile, address) in NODES.items():
                await stack.enter_async_context(cluster.node(name, profile, address))
            cluster.put_domain("cd-shed", num_nodes=2)
            shedding = server.faults.fail_next("*", "*", 429, count=None, retry_after=RETRY_AFTER_S)
            await start_controller(cluster)
            for node in cluster.nodes.values():
                await cluster.start(node, wait=False)
            ends = time.monotonic() + SHEDDING_S
            while time.monotonic() < ends:
                _all_running(cluster)
                await anyio.sleep(0.5)
            server.faults.remove(shedding)
            ended = time.monotonic()

            await _converged(cluster, ended + CONVERGE_S)
            _all_running(cluster)
            throttled = Counter(
                r.user_agent.split(" ")[-1] for r in server.requests.records() if r.status == 429
            )
            # every process met the shedding (the claim reader's and the Node reads' client
            # says the node's name, the controller's its identity)
            assert set(throttled) >= {*NODES, "controller-0"}, throttled
            early = server.requests.early_retries()
            assert early == [], [
                (
                    a.user_agent.split(" ")[-1],
                    a.method,
                    a.path,
                    a.query,
                    b.query,
                    round(b.at - a.at, 3),
                )
                for a, b in early
            ]
        finally:
            await stop_all(cluster)


def _all_running(cluster: Cluster) -> None:
    assert cluster.controller is not None
    exited = {n.name: n.log()[-2000:] for n in cluster.nodes.values() if _exited(n.process)}
    if _exited(cluster.controller):
        exited["controller"] = (cluster.workdir / "controller.log").read_text()[-2000:]
    assert not exited, exited


def _exited(process: object) -> bool:
    return process is None or getattr(process, "returncode", None) is not None


async def _converged(cluster: Cluster, deadline: float) -> None:
    """Every pool whole, the controller leading with the domain's finalizer and template,
    by ``deadline``."""
    left = lambda: max(0.1, deadline - time.monotonic())  # noqa: E731
    for name in NODES:
        await published_pool(cluster.api, name, GPU_DRIVER, timeout_s=left())
    for name, (profile, _) in NODES.items():
        if profile == TRAY:
            await published_pool(cluster.api, name, CD_DRIVER, timeout_s=left())
    server = cluster.server

    def led() -> bool:
        lease = server.get_object("leases", "gpu-dra-agent-controller", DRIVER_NAMESPACE)
        return lease is not None and lease["spec"].get("holderIdentity") == "controller-0"

    def reconciled() -> bool:
        domain = cluster.domain("cd-shed")
        template = server.get_object("resourceclaimtemplates", "cd-shed-channel", "default")
        finalizers = domain["metadata"].get("finalizers") or []
        return template is not None and "resource.nvidia.com/computeDomain" in finalizers

    await eventually(led, what="the controller to lead", timeout=left())
    await eventually(reconciled, what="the domain's finalizer and template", timeout=left())
