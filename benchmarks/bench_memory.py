"""The agent's memory around one huge request (``python -m benchmarks --only bench_memory``).

The kubelet sends one pod's claims per call, but a call may hold up to
``MAX_CLAIMS_PER_REQUEST`` (10 000) and the agent must survive it without keeping what it
built. This starts ``gpu-dra-agent run --simulate dgx-h100`` (as ``bench_agent`` does: the
embedded API server and the kubelet emulator in this process), waits until it is registered
and idle, and sends one NodePrepareResources of 10 000 claims the API server does not have
(each one is still checkpointed as started, read, refused and rolled back: the whole
per-claim path but the CDI spec). Rows, in MB of the agent's resident memory:

* ``huge request: RSS before``: idle after start;
* ``huge request: RSS peak``: the process's high-water mark (``VmHWM``) after the answer;
* ``huge request: RSS after``: sampled every 0.5 s after the answer until it is under
  ``SETTLED_MB`` or ``SETTLE_WAIT_S`` passed; the row's name says how long that took;
* ``huge request: RSS at +60 s``: then every 5 s until ``SETTLE_WAIT_S`` after the answer,
  the last sample (memory that settled must stay settled: nothing the request built may
  come back, and no cache may grow from it).

The curve (before, peak, each sample) is printed. ``--check`` holds the peak to 120 MB and
the settled value and the one at +60 s to ``SETTLED_MB`` (90 MB) (benchmarks/summary.py).
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import anyio

from agent.kubelet.dra_service import MAX_CLAIMS_PER_REQUEST
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.control.client import wait_engine_started
from agent.sim.kubelet import ClaimRef, EventKind, KubeletEmulator
from benchmarks import Result
from benchmarks.agent_process import agent_command, start_agent

DRIVER, NODE = "gpu.nvidia.com", "bench-node"
SETTLED_MB = 90.0
SETTLE_WAIT_S = 60.0


def run(repeat: int) -> list[Result]:
    logging.getLogger("agent").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bm-", dir="/tmp") as folder:
        return anyio.run(_huge_request, Path(folder))


def memory(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MB."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) / 1024
    return found["VmRSS"], found["VmHWM"]


def claims(count: int) -> list[ClaimRef]:
    return [
        ClaimRef(namespace="default", name=f"c-{i}", uid=f"6ba7b814-9dad-11d1-{i:04x}-00c04fd430c8")
        for i in range(count)
    ]


async def _huge_request(base: Path) -> list[Result]:
    async with EmbeddedApiServer() as server:
        server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        kubeconfig = server.write_kubeconfig(base / "kubeconfig")
        async with KubeletEmulator(
            base / "registry", node_name=NODE, poll_interval=0.05, call_timeout=120
        ) as kl:
            command = agent_command(base, kubeconfig, NODE, "dgx-h100")
            agent = await start_agent(command, base / "agent.log")
            try:
                await kl.wait_event(EventKind.REGISTERED, DRIVER, timeout=60)
                await wait_engine_started(base / "plugins" / DRIVER)  # sockets open before it
                await anyio.sleep(2)  # the first publish and the health stream settle
                before, _ = memory(agent.pid)
                refs = claims(MAX_CLAIMS_PER_REQUEST)
                began = time.perf_counter()
                answers = await kl.prepare(DRIVER, refs)
                call_s = time.perf_counter() - began
                if len(answers) != len(refs) or not all(a.error for a in answers.values()):
                    raise RuntimeError("the huge request was not answered claim by claim")
                del answers, refs
                answered = time.monotonic()
                after, peak = memory(agent.pid)
                curve = [after]
                while after >= SETTLED_MB and time.monotonic() - answered < SETTLE_WAIT_S:
                    await anyio.sleep(0.5)
                    after, peak = memory(agent.pid)
                    curve.append(after)
                waited = time.monotonic() - answered
                later = after
                while (left := answered + SETTLE_WAIT_S - time.monotonic()) > 0:
                    await anyio.sleep(min(5.0, left))
                    later, peak = memory(agent.pid)
                    curve.append(later)
            finally:
                agent.terminate()
                with anyio.fail_after(20):
                    await agent.wait()
    print(
        f"huge request ({MAX_CLAIMS_PER_REQUEST} claims, answered in {call_s:.1f} s): RSS "
        f"before {before:.1f} MB, peak {peak:.1f} MB, then every 0.5 s until under "
        f"{SETTLED_MB:g} MB and every 5 s until +{SETTLE_WAIT_S:g} s: "
        + " ".join(f"{value:.1f}" for value in curve),
    )
    return [
        Result("huge request: RSS before", (before,), "MB"),
        Result(f"huge request: RSS peak ({MAX_CLAIMS_PER_REQUEST} claims)", (peak,), "MB"),
        Result(f"huge request: RSS after (+{waited:.1f} s)", (after,), "MB"),
        Result(f"huge request: RSS at +{SETTLE_WAIT_S:g} s", (later,), "MB"),
        Result("huge request: the call", (call_s * 1000,)),
    ]
