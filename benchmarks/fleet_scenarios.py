"""The formation and deletion scenarios of ``make fleet`` (:mod:`benchmarks.fleet`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from agent.imex.cliques import DOMAIN_LABEL, daemon_entries
from agent.imex.config import DRIVER as CD_DRIVER
from agent.sim.allocation import ApiAccess, delete_claim
from agent.sim.kubelet import ClaimRef
from benchmarks import percentile
from benchmarks.fleet_cluster import (
    DRIVER_NAMESPACE,
    NAMESPACE,
    Fleet,
    FleetNode,
    counts_delta,
    describe_counts,
    imex_daemons,
)
from benchmarks.fleet_goals import Row

RETRY_S = 0.5  # the "kubelet" retries a failed prepare after this long
FORMATION_TIMEOUT_S = 60


@dataclass
class Formation:
    name: str
    uid: str
    claims: dict[str, ClaimRef]
    answered: dict[str, float] = field(default_factory=dict)  # node -> s after the first send
    tries: dict[str, int] = field(default_factory=dict)
    ready_s: float = float("nan")
    last_s: float = float("nan")
    conflicts: int = 0
    throttled: int = 0
    requests: str = ""
    total_requests: int = 0
    kill: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # node -> its last prepare error
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds of the formation

    def rows(self, nodes: int) -> list[Row]:
        per_node = sorted(self.answered.values())
        return [
            Row("formation: first prepare to last answer", self.last_s, "s"),
            Row("formation: prepare answer per node, p50", percentile(per_node, 50), "s"),
            Row("formation: prepare answer per node, max", max(per_node), "s"),
            Row("formation: to domain Ready", self.ready_s, "s"),
            Row("formation: kubelet retries of a prepare", sum(self.tries.values()) - nodes, "n"),
            Row("formation: API requests", self.total_requests, "req"),
            Row("formation: 409 Conflict answers", self.conflicts, "n"),
            Row("formation: 429 TooManyRequests answers", self.throttled, "n"),
            Row("formation: CPU, agents (with daemons)", self.cpu.get("agents", 0.0), "s"),
            Row("formation: CPU, API server", self.cpu.get("apiserver", 0.0), "s"),
            Row("formation: CPU, kubelet emulators", self.cpu.get("kubelets", 0.0), "s"),
        ]

    def kill_rows(self) -> list[Row]:
        kill = self.kill
        return [
            Row("SIGKILL in formation: to domain Ready", self.ready_s, "s"),
            Row("SIGKILL in formation: index kept (1 yes)", float(kill["kept"]), "bool"),
            Row("SIGKILL in formation: nodes with != 1 daemon", float(kill["bad_daemons"]), "n"),
            Row("SIGKILL in formation: duplicate entries", float(kill["duplicates"]), "n"),
        ]

    def as_json(self) -> dict[str, Any]:
        return {
            "answered": self.answered, "tries": self.tries, "ready_s": self.ready_s,
            "last_s": self.last_s, "conflicts": self.conflicts, "throttled": self.throttled,
            "requests": self.requests, "kill": self.kill, "errors": self.errors, "cpu": self.cpu,
        }  # fmt: skip


async def cliques_of(fleet: Fleet, uid: str) -> list[dict[str, Any]]:
    return await fleet.objects("computedomaincliques", DRIVER_NAMESPACE, f"{DOMAIN_LABEL}={uid}")


async def form(fleet: Fleet, name: str, *, kill: FleetNode | None = None) -> Formation:
    """A domain of every node: claims made and allocated first, then every prepare at once;
    with ``kill``, that node's agent is killed once it joined and started again."""
    domain = await fleet.create_domain(name)
    uid = domain["metadata"]["uid"]
    formation = Formation(name, uid, await fleet.claims(domain))
    before = await fleet.counts()
    cpu_before = fleet.cpu()
    started = time.monotonic()
    killed = anyio.Event()

    async def prepare(node: FleetNode) -> None:
        assert node.kubelet is not None
        claim = formation.claims[node.name]
        while True:
            formation.tries[node.name] = formation.tries.get(node.name, 0) + 1
            try:
                answer = (await node.kubelet.prepare(CD_DRIVER, [claim]))[claim.uid]
                error = answer.error
            except Exception as failure:  # the agent was killed under the call
                error = str(failure) or repr(failure)
            if not error:
                formation.answered[node.name] = time.monotonic() - started
                return
            formation.errors[node.name] = error
            if node is kill and not killed.is_set():
                await killed.wait()
            await anyio.sleep(RETRY_S)

    async def watch_ready() -> None:
        while True:
            status = await fleet.domain_status(name)
            if status.get("status") == "Ready" and len(status.get("nodes") or []) == len(
                fleet.nodes
            ):
                formation.ready_s = time.monotonic() - started
                return
            await anyio.sleep(0.05)

    async def kill_once_joined(node: FleetNode) -> None:
        index = None
        while index is None:
            for clique in await cliques_of(fleet, uid):
                found = [e.index for e in daemon_entries(clique) if e.name == node.name]
                index = found[0] if found else index
            await anyio.sleep(0.02)
        formation.kill.update(node=node.name, index=index)
        await fleet.kill_agent(node)
        killed.set()
        await fleet.start_agent(node)

    with anyio.move_on_after(FORMATION_TIMEOUT_S) as deadline:
        async with anyio.create_task_group() as group:
            group.start_soon(watch_ready)
            if kill is not None:
                group.start_soon(kill_once_joined, kill)
            for node in fleet.nodes:
                group.start_soon(prepare, node)
    if deadline.cancelled_caught:
        missing = {n.name for n in fleet.nodes} - set(formation.answered)
        raise TimeoutError(
            f"{name} did not form in {FORMATION_TIMEOUT_S} s: no answer for {sorted(missing)}; "
            f"last errors: {formation.errors}; domain status: {await fleet.domain_status(name)}"
        )
    formation.last_s = max(formation.answered.values())
    cpu_after = fleet.cpu()
    formation.cpu = {k: cpu_after[k] - cpu_before[k] for k in cpu_after}
    delta = counts_delta(await fleet.counts(), before)
    formation.total_requests = sum(delta.values())
    formation.conflicts = sum(n for (_, _, code), n in delta.items() if code == 409)
    formation.throttled = sum(n for (_, _, code), n in delta.items() if code == 429)
    formation.requests = describe_counts(delta)
    if kill is not None:
        await check_kill(fleet, formation)
    return formation


async def check_kill(fleet: Fleet, formation: Formation) -> None:
    entries = [e for c in await cliques_of(fleet, formation.uid) for e in daemon_entries(c)]
    names = [e.name for e in entries]
    mine = [e.index for e in entries if e.name == formation.kill["node"]]
    formation.kill["kept"] = mine == [formation.kill["index"]]
    formation.kill["duplicates"] = len(names) - len(set(names))
    # a daemon restarting for its settled node list may be gone or not yet replaced for a
    # moment: the count must come to one per node within a few seconds, never stay at two
    bad: list[str] = []
    with anyio.move_on_after(10):
        while True:
            daemons = imex_daemons(fleet.workdir)
            per_node = {n.name: sum(1 for c in daemons.values() if c.startswith(f"{n.root}/"))
                        for n in fleet.nodes}  # fmt: skip
            bad = [f"{name}: {count}" for name, count in per_node.items() if count != 1]
            if not bad:
                break
            await anyio.sleep(0.2)
    formation.kill["bad_daemons"] = len(bad)
    formation.kill["bad_daemon_nodes"] = bad


async def leftovers(fleet: Fleet, formation: Formation) -> bool:
    """Whether a daemon, a clique or the domain of ``formation`` is left."""
    if imex_daemons(fleet.workdir) or await cliques_of(fleet, formation.uid):
        return True
    domains = await fleet.objects("computedomains", NAMESPACE)
    return any(d["metadata"]["name"] == formation.name for d in domains)


async def delete_domain(fleet: Fleet, formation: Formation) -> float:
    """Delete the domain and its pods (each node's claim unprepared); seconds until every
    daemon stopped, every clique and the domain are gone."""
    started = time.monotonic()
    await fleet.delete(
        f"/apis/resource.nvidia.com/v1beta1/namespaces/{NAMESPACE}/computedomains/{formation.name}"
    )

    async def unprepare(node: FleetNode) -> None:
        assert node.kubelet is not None
        claim = formation.claims[node.name]
        for _ in range(20):
            answer = (await node.kubelet.unprepare(CD_DRIVER, [claim]))[claim.uid]
            if not answer.error:
                return
            await anyio.sleep(RETRY_S)

    async with anyio.create_task_group() as group:
        for node in fleet.nodes:
            group.start_soon(unprepare, node)
    with anyio.fail_after(60):
        while await leftovers(fleet, formation):  # noqa: ASYNC110 - other processes
            await anyio.sleep(0.05)
    took = time.monotonic() - started
    access = ApiAccess(fleet.url, "embedded-apiserver-token")
    for claim in formation.claims.values():
        await delete_claim(access, claim.namespace, claim.name)
    return took
