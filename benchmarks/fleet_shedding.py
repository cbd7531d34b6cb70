"""The fleet's start under an API server that sheds load (``make fleet``'s first scenario).

A whole fleet restarting at once meets kube-apiserver's priority and fairness: every request
is answered 429 with ``Retry-After`` until seats free up. Here the API server answers every
request that way for ``--startup-shedding-seconds`` (20) from the controller's first request
on, while every agent starts at once. Measured: how many 429s were answered, whether any
process exited (goal: none), how long after the shedding's end every node's pools
(``gpu.nvidia.com`` and ``compute-domain.nvidia.com``) were whole and the controller led
(goal: 10 s), and how many requests came back sooner than the ``Retry-After`` their client
was given (goal: none; the server's request log, per client by ``User-Agent``, per method
and path).
"""

from __future__ import annotations

import time
from collections import defaultdict

import anyio

from agent.imex.config import DRIVER as CD_DRIVER
from agent.sim.allocation import whole_pool
from benchmarks.fleet_cluster import DRIVER_NAMESPACE, Fleet
from benchmarks.fleet_goals import Row

GPU_DRIVER = "gpu.nvidia.com"
LEASE = "gpu-dra-agent-controller"
#: How long the scenario waits for convergence before it reports what it got.
GIVE_UP_S = 120.0


async def startup_shedding(fleet: Fleet, seconds: float) -> list[Row]:
    """Start every agent at once while the server sheds (the fleet was started with
    ``shed_seconds``: the shedding began before the controller's start); the rows."""
    began = time.monotonic()
    before = await fleet.counts()
    for node in fleet.nodes:
        await fleet.start_agent(node, wait=False)
    exited: set[str] = set()
    ends = began + seconds
    while time.monotonic() < ends:
        exited |= _exited(fleet)
        await anyio.sleep(0.5)
    ended = time.monotonic()
    took = await _converged(fleet, ended)
    exited |= _exited(fleet)
    counts = await fleet.counts()
    throttled = sum(n for (_, _, code), n in counts.items() if code == 429) - sum(
        n for (_, _, code), n in before.items() if code == 429
    )
    early = await fleet.early_retries()
    for sample in early[:5]:
        print(f"sent again too soon: {sample}")
    for name in sorted(exited):
        print(f"exited during the shedding: {name}")
    async with anyio.create_task_group() as group:  # each agent registered and ready
        for node in fleet.nodes:
            if node.name not in exited:
                group.start_soon(fleet.wait_started, node)
    return [
        Row("start-up shedding: 429 answers", float(throttled), "req"),
        Row("start-up shedding: processes that exited", float(len(exited)), ""),
        Row("start-up shedding: converged after it ended", took, "s"),
        Row("start-up shedding: requests sooner than Retry-After", float(len(early)), "req"),
    ]


def _exited(fleet: Fleet) -> set[str]:
    found = {
        n.name for n in fleet.nodes if n.process is not None and n.process.returncode is not None
    }
    if fleet.controller is not None and fleet.controller.returncode is not None:
        found.add("controller")
    return found


async def _converged(fleet: Fleet, ended: float) -> float:
    """Seconds from ``ended`` until every node's two pools are whole and the controller holds
    its Lease (read through the server's uncounted endpoints); NaN past :data:`GIVE_UP_S`."""
    names = {n.name for n in fleet.nodes}
    with anyio.move_on_after(GIVE_UP_S):
        while True:
            pools: dict[tuple[str, str], list[dict[str, object]]] = defaultdict(list)
            for item in await fleet.objects("resourceslices"):
                spec = item.get("spec") or {}
                pools[(str(spec.get("nodeName")), str(spec.get("driver")))].append(item)
            whole = all(
                whole_pool(pools.get((name, driver), []))
                for name in names
                for driver in (GPU_DRIVER, CD_DRIVER)
            )
            leases = await fleet.objects("leases", DRIVER_NAMESPACE)
            led = any(
                (lease.get("metadata") or {}).get("name") == LEASE
                and (lease.get("spec") or {}).get("holderIdentity") == "controller-0"
                for lease in leases
            )
            if whole and led:
                return time.monotonic() - ended
            await anyio.sleep(0.1)
    return float("nan")
