"""From an injected NVML event to the kubelet's health message and to the taint in the API server.

The acceptance targets: event -> health-stream message p99 < 100 ms, event -> taint visible in the
API server p99 < 500 ms. The real agent runs as a process of its own (``gpu-dra-agent run
--simulate dgx-h100``), the embedded API server and the kubelet emulator in this process, as in
the integration tests. Each sample injects one XID through the agent's control socket into the
simulated NVML library; the control socket answers with the ``time.monotonic()`` of the
injection (CLOCK_MONOTONIC is system-wide on Linux, so the agent's and this process's readings
compare). Rows:

* ``xid -> health stream``: until the emulator has received the message that reports the new XID
  (its receive time, stamped on arrival);
* ``xid -> taint in API server``: until the API server's store commits the ResourceSlice write
  that carries the taint (seen through the store's own watch queue, not a poll).

Samples walk over the 8 GPUs with a new non-fatal XID each time (NoSchedule, 5 minute quarantine),
so every injection is one real transition: new taint value, new health message, one slice write.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from agent.sim.allocation import ApiAccess, published_pool
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.control import control_socket_path
from agent.sim.control.client import send_request, wait_engine_started
from agent.sim.kubelet import EventKind, KubeletEmulator
from benchmarks import Result
from benchmarks.agent_process import agent_command, start_agent

DRIVER, NODE = "gpu.nvidia.com", "bench-node"
#: Non-fatal XIDs, each a NoSchedule taint under the default policy.
XIDS = (8, 32, 38, 56, 57, 60, 61, 62, 63, 65, 69)
PAUSE = 0.1  # between samples, so each one starts from a quiet agent


def run(repeat: int) -> list[Result]:
    logging.getLogger("agent").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bh-", dir="/tmp") as folder:
        return anyio.run(measure, Path(folder), repeat)


async def measure(base: Path, repeat: int) -> list[Result]:
    """Both rows, ``repeat`` samples each, against an agent started under ``base``."""
    async with EmbeddedApiServer() as server:
        server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        kubeconfig = server.write_kubeconfig(base / "kubeconfig")
        async with KubeletEmulator(base / "registry", node_name=NODE, poll_interval=0.05) as kl:
            command = agent_command(base, kubeconfig, NODE, "dgx-h100")
            agent = await start_agent(command, base / "agent.log")
            try:
                await kl.wait_event(EventKind.HEALTH_STREAM_OPENED, DRIVER, timeout=30)
                await kl.next_health_report(DRIVER, timeout=10)
                await wait_engine_started(base / "plugins" / DRIVER)  # its control socket
                # the slices written: a taint before that waits for the API client (start-up)
                await published_pool(ApiAccess(server.url, server.token), NODE, DRIVER)
                control = control_socket_path(base / "plugins" / DRIVER)
                return await _samples(server, kl, control, repeat)
            finally:
                agent.terminate()
                with anyio.fail_after(20):
                    await agent.wait()


async def _samples(
    server: EmbeddedApiServer, kubelet: KubeletEmulator, control: Path, repeat: int
) -> list[Result]:
    stream_ms: list[float] = []
    taint_ms: list[float] = []
    store = server.store.subscribe()
    try:
        for k in range(repeat):
            gpu, xid = k % 8, XIDS[(k // 8) % len(XIDS)]
            device, seen = f"gpu-{gpu}", len(kubelet.health_reports(DRIVER))
            while not store.empty():
                store.get_nowait()
            reply = await send_request(control, {"op": "xid", "gpu": str(gpu), "xid": xid})
            injected = float(reply["injected_at"])
            with anyio.fail_after(10):
                committed = await _taint_committed(store, device, str(xid))
                received = await _health_received(kubelet, seen, device, f"XID {xid}")
            taint_ms.append((committed - injected) * 1000)
            stream_ms.append((received - injected) * 1000)
            await anyio.sleep(PAUSE)
    finally:
        server.store.unsubscribe(store)
    return [
        Result("xid -> health stream message (dgx-h100)", tuple(stream_ms)),
        Result("xid -> taint in API server (dgx-h100)", tuple(taint_ms)),
    ]


async def _taint_committed(store: asyncio.Queue[Any], device: str, value: str) -> float:
    while True:
        event = await store.get()
        if event is None or event.kind.plural != "resourceslices":
            continue
        for entry in event.obj["spec"].get("devices", []):
            if entry["name"] == device and any(
                t.get("value") == value for t in entry.get("taints", [])
            ):
                return time.monotonic()


async def _health_received(kubelet: KubeletEmulator, seen: int, device: str, text: str) -> float:
    while True:
        for report in kubelet.health_reports(DRIVER)[seen:]:
            for record in report.devices:
                if record.device == device and text in record.message:
                    return report.received_at
        await kubelet.next_health_report(DRIVER)
