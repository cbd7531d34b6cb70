"""``make fleet``: ComputeDomains across NVL72 racks, a fleet of agents against one API server.

``python -m benchmarks.fleet --nodes 72 --cliques 4`` (``make fleet NODES=72 CLIQUES=4``)
starts the fleet of :mod:`benchmarks.fleet_cluster` (the API server with its max-in-flight
limit on, the controller, one agent process per simulated GB200 tray, ``--nodes /
--cliques`` trays per rack) and runs the scenarios, one row each of the printed table:

0. start-up shedding (:mod:`benchmarks.fleet_shedding`): the controller and every agent start
   at once while the API server answers every request 429 with ``Retry-After: 1`` for
   ``--startup-shedding-seconds`` (20): nobody exits, every pool is whole and the controller
   leads within 10 s of the shedding's end, and no client comes back sooner than its
   ``Retry-After``;
1. formation: a ComputeDomain (``numNodes`` = N) and one channel claim per node, allocated by
   the embedded allocator; all N prepares issued at once (a failed one is retried every 0.5 s,
   as the kubelet retries): first prepare to last answer, p50/max per node, to ``Ready``; the
   API requests of the formation by verb and code (409s, 429s);
2. steady state for ``--steady-seconds`` (60): requests per node per minute of the agents
   (everything but the controller's requests, shown apart: per minute, and per renewal of
   its Lease, which is all an idle controller sends, its caches being watched);
3. the API server restarted (every watch and connection drops, 1 s down): until every watch
   (the controller's too) is open again; the storm's requests per node;
4. the domain deleted with its pods (the kubelet unprepares every claim): until every daemon
   stopped and every clique and the domain are gone (goal 10 s);
5. a second formation with one agent killed (SIGKILL) once it joined, then restarted: the
   domain converges, the node keeps its index, one daemon per node; then deleted as in 4.

With ``--binding-conditions`` the API server answers as 1.36 (KEP-5007 binding conditions on)
and the first formation is scheduled as kube-scheduler 1.36 does, each pod bound only once its
node's IMEX daemon is READY; then a node whose daemon never comes up loses its pod to a spare
(:mod:`benchmarks.fleet_binding`).

Totals: the agents' RSS (sum, sampled each second: the peak), the API server's CPU seconds.
Exit 0 only when every goal holds. The raw numbers go to ``<workdir>/fleet.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import traceback
from contextlib import AsyncExitStack
from pathlib import Path

import anyio

from agent.imex.cliques import MAX_DAEMONS
from benchmarks.fleet_binding import binding_goals, form_with_binding, move_from_a_failing_node
from benchmarks.fleet_cluster import (
    Fleet,
    FleetNode,
    counts_delta,
    cpu_seconds,
    describe_counts,
    dump,
    imex_daemons,
    rss_mb,
)
from benchmarks.fleet_goals import Row, goals_for, render
from benchmarks.fleet_scenarios import Formation, delete_domain, form
from benchmarks.fleet_shedding import startup_shedding

#: the controller's requests but its watches: its Lease, its lists (at its start and after a
#: 410) and its template and finalizer writes
CONTROLLER_ROWS = {("get", "leases"), ("update", "leases"), ("create", "leases"),
                   ("list", "computedomains"), ("list", "computedomaincliques"),
                   ("list", "resourceclaimtemplates"), ("create", "resourceclaimtemplates"),
                   ("delete", "resourceclaimtemplates"), ("update", "computedomains")}  # fmt: skip
#: the controller's watches (of cliques the agents' too: those count as the agents')
CONTROLLER_WATCHES = {("watch", "computedomains"), ("watch", "resourceclaimtemplates")}
LEASE_RENEWED = ("update", "leases", 200)


def split_controller(
    delta: dict[tuple[str, str, int], int],
) -> tuple[int, int]:
    """(the agents' requests, the controller's but its watches)."""
    controller = watches = 0
    for (verb, resource, _), n in delta.items():
        controller += n if (verb, resource) in CONTROLLER_ROWS else 0
        watches += n if (verb, resource) in CONTROLLER_WATCHES else 0
    return sum(delta.values()) - controller - watches, controller


async def scenario_steady(fleet: Fleet, seconds: float) -> tuple[float, float, float, str]:
    """Per minute the agents' requests per node and the controller's; the controller's per
    Lease renewal of the window (idle, it renews its Lease and sends nothing else)."""
    before = await fleet.counts()
    await anyio.sleep(seconds)
    delta = counts_delta(await fleet.counts(), before)
    agents, controller = split_controller(delta)
    renewals = delta.get(LEASE_RENEWED, 0)
    per_renewal = controller / renewals if renewals else math.nan
    minutes = seconds / 60
    return (agents / fleet.nodes_count / minutes, controller / minutes, per_renewal,
            describe_counts(delta))  # fmt: skip


async def scenario_restart(fleet: Fleet) -> tuple[float, float, str]:
    watches = await fleet.open_watches()
    before = await fleet.counts()
    started = time.monotonic()
    await fleet.restart_server(1.0)
    await anyio.sleep(0.2)
    with anyio.fail_after(120):
        while True:
            try:  # the controller's watches among them
                if await fleet.open_watches() >= watches:
                    break
            except OSError:
                pass  # the server is down
            await anyio.sleep(0.1)
    took = time.monotonic() - started
    delta = counts_delta(await fleet.counts(), before)
    return took, sum(delta.values()) / fleet.nodes_count, describe_counts(delta)


async def sample_rss(fleet: Fleet, peaks: dict[str, float]) -> None:
    while True:
        agents = sum(rss_mb(n.process.pid) for n in fleet.nodes if n.process is not None)
        daemons = sum(rss_mb(pid) for pid in imex_daemons(fleet.workdir))
        peaks["agents"] = max(peaks.get("agents", 0.0), agents)
        peaks["daemons"] = max(peaks.get("daemons", 0.0), daemons)
        await anyio.sleep(1.0)


async def run(args: argparse.Namespace, workdir: Path) -> int:
    fleet = Fleet(workdir, args.nodes, args.cliques, args.max_in_flight)
    if args.binding_conditions:
        fleet.kubernetes_version = "1.36.0"
    rows: list[Row] = []
    report: dict[str, object] = {"nodes": args.nodes, "cliques": args.cliques}
    peaks: dict[str, float] = {}
    async with AsyncExitStack() as stack:
        shedding = args.startup_shedding_seconds
        await fleet.start(stack, shed_seconds=shedding)
        began = time.monotonic()
        if shedding > 0:
            rows += await startup_shedding(fleet, shedding)
        else:
            limiter = anyio.CapacityLimiter(args.start_concurrency)

            async def start(node: FleetNode) -> None:
                async with limiter:
                    await fleet.start_agent(node)

            async with anyio.create_task_group() as group:
                for node in fleet.nodes:
                    group.start_soon(start, node)
        print(
            f"{args.nodes} agents registered in {time.monotonic() - began:.1f} s", file=sys.stderr
        )
        async with anyio.create_task_group() as sampler:
            sampler.start_soon(sample_rss, fleet, peaks)
            if args.binding_conditions:
                bound = await form_with_binding(fleet, "fleet-a")
                rows += bound.rows()
                report["binding"] = bound.__dict__
                first = Formation(bound.name, bound.uid, bound.claims)
            else:
                first = await form(fleet, "fleet-a")
                rows += first.rows(args.nodes)
                report["formation"] = first.as_json()
                print("formation requests:\n" + first.requests, file=sys.stderr)
            steady = await scenario_steady(fleet, args.steady_seconds)
            per_node, controller, per_renewal, text = steady
            rows.append(Row("steady: agents' requests per node per minute", per_node, "req/min"))
            rows.append(
                Row("steady: controller requests per minute (Lease)", controller, "req/min")
            )
            rows.append(Row("steady: controller requests per Lease renewal", per_renewal, "req"))
            print("steady-state requests:\n" + text, file=sys.stderr)
            took, storm, text = await scenario_restart(fleet)
            rows.append(Row("API server restart: every agent re-listed and re-watched", took, "s"))
            rows.append(Row("API server restart: requests of the storm per node", storm, "req"))
            print("restart requests:\n" + text, file=sys.stderr)
            took = await delete_domain(fleet, first)
            rows.append(Row("domain deleted: daemons stopped, cliques gone", took, "s"))
            second = await form(fleet, "fleet-b", kill=fleet.nodes[min(1, args.nodes - 1)])
            rows += second.kill_rows()
            report["kill"] = second.as_json()
            took = await delete_domain(fleet, second)
            rows.append(Row("after the kill: domain deleted, cleaned up", took, "s"))
            if args.binding_conditions:
                rows += await move_from_a_failing_node(fleet)
            sampler.cancel_scope.cancel()
        assert fleet.server is not None
        rows.append(Row("total: agents' RSS, peak sum", peaks.get("agents", 0.0), "MB"))
        rows.append(Row("total: IMEX daemons' RSS, peak sum", peaks.get("daemons", 0.0), "MB"))
        rows.append(Row("total: API server CPU", cpu_seconds(fleet.server.pid), "s"))
    goals = goals_for(args.nodes, args.cliques)
    if args.binding_conditions:
        goals.update(binding_goals(args.nodes))
    text, failed = render(rows, goals, f"Fleet: {args.nodes} nodes in {args.cliques} clique(s)")
    print(text)
    report["rows"] = [r.__dict__ for r in rows]
    dump(workdir / "fleet.json", report)
    for line in failed:
        print(f"GOAL MISSED: {line}")
    return 1 if failed else 0


def leaves(error: BaseException) -> list[BaseException]:
    """The exceptions inside nested exception groups (a task group's failure)."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]


def run_reporting(args: argparse.Namespace, workdir: Path) -> int:
    try:
        return anyio.run(run, args, workdir)
    except BaseExceptionGroup as group:
        for leaf in leaves(group):
            traceback.print_exception(leaf)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--nodes", type=int, default=18, help="agents, one per tray (18)")
    parser.add_argument("--cliques", type=int, default=1, help="racks the trays fill (1)")
    parser.add_argument("--steady-seconds", type=float, default=60.0, help="steady state (60)")
    parser.add_argument("--max-in-flight", type=int, default=16,
                        help="the API server's seats; 429 with Retry-After beyond (16)")  # fmt: skip
    parser.add_argument("--start-concurrency", type=int, default=4,
                        help="agents starting at once without start-up shedding (4)")  # fmt: skip
    parser.add_argument("--startup-shedding-seconds", type=float, default=20.0,
                        help="the API server answers every request 429 (Retry-After: 1) this "
                        "long while the controller and every agent start at once; 0: none, "
                        "the agents start --start-concurrency at a time (20)")  # fmt: skip
    parser.add_argument("--binding-conditions", action="store_true",
                        help="the API server answers as 1.36: channels carry KEP-5007 binding "
                        "conditions, pods are bound once their node's IMEX daemon is READY, "
                        "and a node whose daemon never comes up loses its pod to a spare")  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=None, help="kept after the run")
    args = parser.parse_args(argv)
    if args.nodes < 2 or args.cliques < 1 or -(-args.nodes // args.cliques) > MAX_DAEMONS:
        parser.error(f"--nodes / --cliques: at least 2 nodes, at most {MAX_DAEMONS} per clique")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        return run_reporting(args, args.workdir)
    with tempfile.TemporaryDirectory(prefix="fleet-", dir="/tmp") as folder:
        return run_reporting(args, Path(folder))


if __name__ == "__main__":
    sys.exit(main())
