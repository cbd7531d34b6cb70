"""The binding-conditions scenarios of ``make fleet`` (``--binding-conditions``; issue 32).

The API server answers as 1.36, so every tray publishes ``channel-0`` with KEP-5007's
``IMEXDaemonReady`` / ``IMEXDaemonFailed`` and prepares a channel claim as soon as it is
allocated there (:mod:`agent.imex.binding`). The scheduler is the embedded one
(:func:`agent.sim.binding.place_claim`): it allocates, waits in PreBind for the conditions,
undoes the allocation on a failure and tries the next node.

1. formation with binding: a ComputeDomain of every node, one pod (claim) per node, every pod
   scheduled at once (eight allocations at a time, as :meth:`Fleet.claims`): each pod is
   bound once its node's daemon is READY, and the kubelet's prepare follows at once. The
   time from the first allocation until every pod is bound and prepared (next to the
   formation row of a run without the option: the kubelet's prepares waiting for the daemons
   and retried), and the kubelet's prepare latency after binding (p50, p99);
2. a node whose daemon never comes up (the simulated fabric's ``hang``): a one-node domain's
   pod is tried on that node first, a spare node second; the time until it is bound on the
   spare, against the node's ready timeout plus 5 s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio

from agent.imex.config import DRIVER as CD_DRIVER
from agent.sim.allocation import ApiAccess, allocate_existing_claim, create_claim, delete_claim
from agent.sim.binding import place_claim, wait_for_binding
from agent.sim.claims import PodReference
from agent.sim.kubelet import ClaimRef
from benchmarks import percentile
from benchmarks.fleet_cluster import NAMESPACE, Fleet, FleetNode
from benchmarks.fleet_goals import Row

#: the agents' --imex-ready-timeout-seconds (its default): a failing node's bound
READY_TIMEOUT_S = 20.0
BINDING_TIMEOUT_S = 600.0  # kube-scheduler's default bindingTimeout


@dataclass
class BoundFormation:
    name: str
    uid: str
    claims: dict[str, ClaimRef]
    allocated: dict[str, float]  # node -> s from the start until the scheduler allocated it
    bound: dict[str, float]  # node -> s from the start until its pod was bound
    prepared: dict[str, float]  # node -> s until the kubelet's prepare answered
    prepare_latency: list[float]  # the kubelet's prepare after binding, s each
    ready_s: float = float("nan")  # until the domain said Ready

    def rows(self) -> list[Row]:
        last_allocation = max(self.allocated.values())
        return [
            Row("binding: every pod bound and prepared", max(self.prepared.values()), "s"),
            Row("binding: the scheduler's allocations, first to last", last_allocation, "s"),
            Row(
                "binding: last allocation to every pod bound and prepared",
                max(self.prepared.values()) - last_allocation,
                "s",
            ),
            Row("binding: to domain Ready", self.ready_s, "s"),
            Row("binding: pods bound, p50", percentile(sorted(self.bound.values()), 50), "s"),
            Row("binding: prepare after binding, p50", percentile(self.prepare_latency, 50), "s"),
            Row("binding: prepare after binding, p99", percentile(self.prepare_latency, 99), "s"),
        ]


def _access(fleet: Fleet) -> ApiAccess:
    return ApiAccess(fleet.url, "embedded-apiserver-token")


async def _pending_claim(fleet: Fleet, spec: dict[str, Any], name: str) -> ClaimRef:
    created = await create_claim(
        _access(fleet),
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
         "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec},
    )  # fmt: skip
    meta = created["metadata"]
    return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def _allocate(access: ApiAccess, name: str, node: str) -> dict[str, Any]:
    """One allocation by the emulated scheduler, in a worker thread's own event loop."""
    reserved = (PodReference(f"{name}-pod"),)

    async def allocate() -> dict[str, Any]:
        return await allocate_existing_claim(access, NAMESPACE, name, node, reserved_for=reserved)

    result: dict[str, Any] = anyio.run(allocate)
    return result


async def form_with_binding(fleet: Fleet, name: str) -> BoundFormation:
    """Scenario 1 (module docstring)."""
    domain = await fleet.create_domain(name)
    spec = await fleet.template_spec(domain)
    claims = {
        node.name: await _pending_claim(fleet, spec, f"{node.name}-{name}") for node in fleet.nodes
    }
    formation = BoundFormation(name, domain["metadata"]["uid"], claims, {}, {}, {}, [])
    limiter = anyio.CapacityLimiter(8)
    started = time.monotonic()

    async def pod(node: FleetNode) -> None:
        assert node.kubelet is not None
        claim = claims[node.name]
        # the scheduler allocates a few at a time (PreBind waits apart), each in a thread of
        # its own: the emulated allocator's CPU must not delay this loop, where the kubelet
        # emulators time the prepares
        allocated = await anyio.to_thread.run_sync(
            _allocate, _access(fleet), claim.name, node.name, limiter=limiter
        )
        formation.allocated[node.name] = time.monotonic() - started
        outcome = await wait_for_binding(
            _access(fleet), allocated, binding_timeout_s=BINDING_TIMEOUT_S
        )
        if not outcome.bound:
            raise RuntimeError(f"{claim.name} was not bound: {outcome.state}: {outcome.message}")
        formation.bound[node.name] = time.monotonic() - started
        asked = time.monotonic()
        answer = (await node.kubelet.prepare(CD_DRIVER, [claim]))[claim.uid]
        if answer.error:
            raise RuntimeError(f"{node.name}: prepare after binding failed: {answer.error}")
        formation.prepare_latency.append(time.monotonic() - asked)
        formation.prepared[node.name] = time.monotonic() - started

    async with anyio.create_task_group() as group:
        for node in fleet.nodes:
            group.start_soon(pod, node)
    with anyio.fail_after(30):
        while (await fleet.domain_status(name)).get("status") != "Ready":  # noqa: ASYNC110 - another process
            await anyio.sleep(0.05)
    formation.ready_s = time.monotonic() - started
    formation.prepare_latency.sort()
    return formation


async def move_from_a_failing_node(fleet: Fleet) -> list[Row]:
    """Scenario 2 (module docstring): the pod lands on the spare node."""
    failing, spare = fleet.nodes[0], fleet.nodes[-1]
    faults = fleet.workdir / "fabric" / "faults"
    faults.mkdir(parents=True, exist_ok=True)
    (faults / failing.name).write_text("hang\n")
    domain = await fleet.create_domain("fleet-failing", nodes=1)
    claim = await _pending_claim(fleet, await fleet.template_spec(domain), "moved-channel")
    started = time.monotonic()
    try:
        placement = await place_claim(
            _access(fleet), NAMESPACE, claim.name, [failing.name, spare.name],
            reserved_for=(PodReference("moved-pod"),), binding_timeout_s=BINDING_TIMEOUT_S,
        )  # fmt: skip
    finally:
        (faults / failing.name).unlink()
    took = time.monotonic() - started
    moved = placement.node == spare.name and [a.node for a in placement.attempts] == [
        failing.name,
        spare.name,
    ]
    if placement.node is not None:  # the pod goes away again: its kubelet unprepares
        node = spare if placement.node == spare.name else failing
        assert node.kubelet is not None
        await node.kubelet.unprepare(CD_DRIVER, [claim])
    await fleet.delete(
        f"/apis/resource.nvidia.com/v1beta1/namespaces/{NAMESPACE}/computedomains/fleet-failing"
    )
    await delete_claim(_access(fleet), NAMESPACE, claim.name)
    return [
        Row("binding failure: pod moved to a spare node (1 yes)", float(moved), "bool"),
        Row("binding failure: until bound on the spare node", took, "s"),
    ]


def binding_goals(nodes: int, ready_timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
    """The issue's goals for these rows (fleet_goals.Goal by row name); ``ready_timeout_s``:
    the agents' --imex-ready-timeout-seconds."""
    import operator

    from benchmarks.fleet_goals import Goal

    last = 5.0 if nodes <= 18 else 10.0
    # Today's formation row is timed from the moment every claim is allocated; with binding
    # the agents start at each allocation, so the comparable window starts at the last one
    # (the whole, with the emulated scheduler's own allocations, is the row above it).
    return {
        "binding: last allocation to every pod bound and prepared": Goal(last),
        "binding: prepare after binding, p99": Goal(0.05),
        "binding failure: pod moved to a spare node (1 yes)": Goal(1.0, operator.ge),
        "binding failure: until bound on the spare node": Goal(ready_timeout_s + 5.0),
    }
